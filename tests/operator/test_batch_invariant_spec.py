"""spec.engine.batchInvariant: the CRD's schema and CEL rule, the parser, and the rendered flag
(which the engine's own parser takes)."""

from __future__ import annotations

from typing import Any

import pytest
from crd_schema import isvc, validate
from kvasir_engine.main import build_parser
from kvasir_operator.pod import engine_args
from kvasir_operator.spec import SpecError
from kvasir_operator.spec_parse import parse_spec

M = {"uri": "s3://bkt/m"}
CPU = {"gpus": 0}


def _spec(engine: dict[str, Any], resources: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"model": M, "engine": engine, "resources": CPU if resources is None else resources}


def test_on_renders_the_engines_flag_and_off_renders_nothing() -> None:
    spec = _spec({"batchInvariant": True})
    assert validate(isvc(spec)) == []
    args = engine_args(parse_spec("m", spec))
    assert "--batch-invariant" in args
    assert build_parser().parse_args(args).batch_invariant is True
    assert "--batch-invariant" not in engine_args(parse_spec("m", _spec({})))
    assert "--batch-invariant" not in engine_args(parse_spec("m", _spec({"batchInvariant": False})))


def test_off_by_default_and_the_default_changes_no_rendered_argument() -> None:
    assert parse_spec("m", _spec({})).engine.batch_invariant is False


@pytest.mark.parametrize("engine", [
    {"quantization": "int8"}, {"quantization": "int4"},
    {"speculative": {"numSpeculativeTokens": 2}}])
def test_what_the_engine_takes_under_it_is_admitted(engine: dict[str, Any]) -> None:
    spec = _spec({"batchInvariant": True, **engine})
    assert validate(isvc(spec)) == []
    assert "--batch-invariant" in engine_args(parse_spec("m", spec))


@pytest.mark.parametrize(("engine", "resources", "field"), [
    ({"quantization": "gptq"}, CPU, "spec.engine.quantization gptq"),
    ({"quantization": "compressed-tensors"}, CPU, "spec.engine.quantization compressed-tensors"),
    ({"speculative": {"numSpeculativeTokens": 2, "method": "draft_model", "model": "/d"}}, CPU,
     "spec.engine.speculative.method draft_model"),
    ({"pipelineParallelSize": 2}, CPU, "spec.engine.pipelineParallelSize 2"),
    ({"tensorParallelSize": 2}, {"gpus": 2}, "spec.engine.tensorParallelSize 2"),
    ({}, {"gpus": 1}, "spec.resources.gpus 1"),
    ({}, {}, "spec.resources.gpus 1"),  # gpus defaults to tensorParallelSize: a GPU engine
])
def test_what_the_engine_refuses_is_refused_by_the_crd_and_the_parser(
        engine: dict[str, Any], resources: dict[str, Any], field: str) -> None:
    spec = _spec({"batchInvariant": True, **engine}, resources)
    errors = validate(isvc(spec))
    assert any("engine.batchInvariant runs on CPU engines of one process" in e
               for e in errors), errors
    with pytest.raises(SpecError) as refused:
        parse_spec("m", spec)
    assert "spec.engine.batchInvariant" in str(refused.value)
    assert field in str(refused.value)
    # The same spec without the flag is admitted by the CEL rule in question.
    assert not any("batchInvariant" in e for e in validate(isvc(_spec(engine, resources))))
