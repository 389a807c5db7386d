"""spec.engine.speculative: the CRD's schema and CEL rules, the parser, and the rendered flag."""

from __future__ import annotations

import json
from typing import Any

import pytest
from crd_schema import isvc, validate
from kvasir_engine.config import SPECULATIVE_METHODS as ENGINE_METHODS
from kvasir_operator import spec_parse
from kvasir_operator.pod import engine_args
from kvasir_operator.spec import SpecError
from kvasir_operator.spec_parse import parse_spec

M = {"uri": "s3://bkt/m"}


def _flag(engine: dict[str, Any]) -> dict[str, Any] | None:
    args = engine_args(parse_spec("m", {"model": M, "engine": engine}))
    if "--speculative-config" not in args:
        return None
    value: dict[str, Any] = json.loads(args[args.index("--speculative-config") + 1])
    return value


def test_ngram_renders_vllms_json() -> None:
    spec = {"numSpeculativeTokens": 4, "promptLookupMax": 5, "promptLookupMin": 2,
            "disableByBatchSize": 16}
    assert validate(isvc({"model": M, "engine": {"speculative": spec}})) == []
    assert _flag({"speculative": spec}) == {
        "method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 5,
        "prompt_lookup_min": 2, "disable_by_batch_size": 16}
    assert _flag({}) is None


def test_draft_model_renders_its_path() -> None:
    spec = {"method": "draft_model", "model": "/models/draft", "numSpeculativeTokens": 3}
    assert validate(isvc({"model": M, "engine": {"speculative": spec}})) == []
    assert _flag({"speculative": spec}) == {"method": "draft_model", "model": "/models/draft",
                                            "num_speculative_tokens": 3}


@pytest.mark.parametrize(("spec", "message"), [
    ({}, "numSpeculativeTokens"),
    ({"numSpeculativeTokens": 0}, "less than the minimum"),
    ({"numSpeculativeTokens": 2, "method": "eagle"}, "is not one of"),
    ({"numSpeculativeTokens": 2, "method": "draft_model"}, "model is required"),
    ({"numSpeculativeTokens": 2, "model": "/models/draft"}, "model is required"),
    ({"numSpeculativeTokens": 2, "promptLookupMin": 4, "promptLookupMax": 2}, "promptLookupMin"),
    ({"numSpeculativeTokens": 2, "lookahead": 2}, "field not declared in schema"),
])
def test_bad_values_are_refused_by_the_schema_and_the_parser(spec: dict[str, Any],
                                                             message: str) -> None:
    errors = validate(isvc({"model": M, "engine": {"speculative": spec}}))
    assert any(message in e for e in errors), errors
    if "lookahead" not in spec:  # the parser ignores unknown fields, as kopf's schema prunes them
        with pytest.raises(SpecError, match="spec.engine.speculative"):
            parse_spec("m", {"model": M, "engine": {"speculative": spec}})


def test_methods_are_the_engines() -> None:
    assert spec_parse.SPECULATIVE_METHODS == ENGINE_METHODS
