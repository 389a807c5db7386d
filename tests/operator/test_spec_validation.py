"""The parser's own checks agree with the CRD and with the engine, and name the field.

The CRD's schema and the parser must accept and refuse the same values where they overlap (an
older CRD or an emulator may skip the schema, the parser is the last line), and the operator must
not import the engine, so its tuples are compared with the engine's config.py text here. One
table holds the defaults (spec_defaults.py): every `default:` in the CRD is in it with the same
value and the other way round, and an empty spec parses the same as the API server's defaulted one.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from crd_schema import admit, isvc
from kvasir_operator.spec import ModelSource, SpecError, spec_hash
from kvasir_operator.spec_defaults import DEFAULTS
from kvasir_operator.spec_parse import PERCENT, QUANTITY, QUANTIZATIONS, TP_SIZES, parse_spec

ROOT = Path(__file__).resolve().parents[2]
CRD = yaml.safe_load((ROOT / "crds" / "inferenceservices.kvasir.dev.yaml").read_text())
SPEC_SCHEMA = CRD["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
M = {"uri": "s3://bkt/m"}


def _engine_tuple(name: str) -> tuple[Any, ...]:
    tree = ast.parse((ROOT / "engine" / "kvasir_engine" / "config.py").read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == name for t in node.targets):
            value = ast.literal_eval(node.value)
            assert isinstance(value, tuple)
            return value
    raise AssertionError(f"engine config.py has no {name}")


def _node(path: str) -> dict[str, Any]:
    node = SPEC_SCHEMA
    for key in path.split("."):
        node = node["properties"][key]
    return node


def _patterns(node: dict[str, Any]) -> set[str]:
    found = {node["pattern"]} if "pattern" in node else set()
    for key in ("anyOf", "oneOf", "allOf"):
        for sub in node.get(key) or []:
            found |= _patterns(sub)
    return found


def test_quantizations_and_tp_sizes_match_the_engine_and_the_crd() -> None:
    assert QUANTIZATIONS == _engine_tuple("QUANTIZATIONS") + _engine_tuple(
        "CHECKPOINT_QUANTIZATIONS")
    assert list(QUANTIZATIONS) == _node("engine.quantization")["enum"]
    assert list(TP_SIZES) == _node("engine.tensorParallelSize")["enum"]


@pytest.mark.parametrize("path", ["resources.cpu", "resources.memory", "cache.sizeLimit"])
def test_quantity_pattern_is_the_crds(path: str) -> None:
    assert _patterns(_node(path)) == {QUANTITY.pattern}


@pytest.mark.parametrize("path", ["disruptionBudget.minAvailable",
                                  "disruptionBudget.maxUnavailable"])
def test_percent_pattern_is_the_crds(path: str) -> None:
    assert _patterns(_node(path)) == {PERCENT.pattern}


@pytest.mark.parametrize(("spec", "message"), [
    ({"engine": {"quantization": "fp3"}},
     "spec.engine.quantization: must be one of ['int8', 'int4', 'compressed-tensors', 'gptq', "
     "'awq', 'fp8'], got 'fp3'"),
    ({"engine": {"tensorParallelSize": 3}},
     "spec.engine.tensorParallelSize: must be one of [1, 2, 4, 8], got 3"),
    ({"engine": {"tensorParallelSize": 16}}, "spec.engine.tensorParallelSize: must be one of"),
    ({"engine": {"tensorParallelSize": True}}, "spec.engine.tensorParallelSize: must be one of"),
    ({"resources": {"memory": "lots"}},
     "spec.resources.memory: must be a Kubernetes quantity (e.g. 500m, 4, 16Gi), got 'lots'"),
    ({"resources": {"cpu": "-1"}}, "spec.resources.cpu: must be a Kubernetes quantity"),
    ({"resources": {"cpu": -2}}, "spec.resources.cpu: must be a Kubernetes quantity"),
    ({"resources": {"memory": 1.5}}, "spec.resources.memory: must be an integer or a quantity"),
    ({"cache": {"sizeLimit": "big"}}, "spec.cache.sizeLimit: must be a Kubernetes quantity"),
    ({"disruptionBudget": {"minAvailable": "150%"}},
     "spec.disruptionBudget.minAvailable: must be a count or a percentage"),
    ({"disruptionBudget": {"maxUnavailable": -1}}, "spec.disruptionBudget.maxUnavailable"),
])
def test_what_the_schema_refuses_the_parser_refuses_naming_the_field(
        spec: dict[str, Any], message: str) -> None:
    full = {"model": M, **spec}
    assert admit(isvc(full))[1], "the CRD refuses it too"
    with pytest.raises(SpecError) as info:
        parse_spec("m", full)
    assert message in str(info.value)


@pytest.mark.parametrize("value", ["500m", "4", "1.5", "16Gi", "200G", "1e3", ".5", 68719476736])
def test_quantities_the_schema_accepts_parse(value: str | int) -> None:
    full = {"model": M, "resources": {"memory": value, "cpu": value}}
    assert admit(isvc(full))[1] == []
    assert parse_spec("m", full).resources.memory == value


def _crd_defaults(node: dict[str, Any], path: tuple[str, ...] = ()) -> dict[tuple[str, ...], Any]:
    found: dict[tuple[str, ...], Any] = {}
    if "default" in node and node["default"] != {}:
        found[path] = node["default"]
    for key, sub in (node.get("properties") or {}).items():
        found.update(_crd_defaults(sub, (*path, key)))
    return found


def test_every_crd_default_is_the_parsers_and_back() -> None:
    crd = _crd_defaults(SPEC_SCHEMA)
    table = {(*section.split("."), key): value for section, values in DEFAULTS.items()
             for key, value in values.items()}
    assert crd == table


def test_an_empty_spec_parses_like_the_api_servers_defaulted_one() -> None:
    for spec in ({"model": M}, {"model": {"uri": "/opt/m"}, "resources": {"gpus": 0}}):
        stored, errors = admit(isvc(spec))
        assert errors == []
        assert stored["spec"] != spec  # the API server filled defaults in
        assert parse_spec("m", spec) == parse_spec("m", stored["spec"])


@pytest.mark.parametrize(("uri", "kind", "claim", "path"), [
    ("s3://bkt/llama/8b", "s3", None, ""), ("pvc://weights/llama/8b/", "pvc", "weights",
                                             "llama/8b"),
    ("pvc://weights", "pvc", "weights", ""), ("/opt/model", "local", None, "/opt/model")])
def test_model_source_is_parsed_once(uri: str, kind: str, claim: str | None, path: str) -> None:
    source = ModelSource.parse(uri)
    assert (source.kind, source.claim, source.path, source.uri) == (kind, claim, path, uri)
    assert [source.is_s3, source.is_pvc, source.is_local].count(True) == 1


@pytest.mark.parametrize("uri", ["http://x", "s3://", "pvc:///path", "models/m"])
def test_bad_model_uris_name_the_field(uri: str) -> None:
    with pytest.raises(SpecError, match=re.escape("spec.model.uri: ")):
        ModelSource.parse(uri)


@pytest.mark.parametrize(("spec", "before"), [
    ({"model": {"uri": "s3://models/llama"}}, "5116531d84e7b0fa"),
    # (int8 on two GPUs, once a case here, is refused now: quantization is CPU-only.)
    ({"model": {"uri": "pvc://w/l"}, "engine": {"tensorParallelSize": 2},
      "resources": {"memory": "16Gi"}}, "4874a2937fb64369")])
def test_spec_hash_is_the_one_before_model_source(spec: dict[str, Any], before: str) -> None:
    # Computed by the operator before ModelSource and the defaults table: upgrading rolls no pods.
    assert spec_hash(parse_spec("m", spec)) == before


def test_cost_is_validated_by_schema_and_parser_and_never_rolls_pods() -> None:
    cost = {"perHour": 2.5, "fullLoadTokensPerSecond": 1800}
    stored, errors = admit(isvc({"model": M, "cost": cost}))
    assert errors == [] and stored["spec"]["cost"]["currency"] == "USD"
    spec = parse_spec("m", stored["spec"])
    assert (spec.cost.per_hour, spec.cost.currency, spec.cost.full_load_tokens_per_second) == (
        2.5, "USD", 1800.0)
    assert spec_hash(spec) == spec_hash(parse_spec("m", {"model": M}))
    for bad, field in (({"perHour": -1}, "perHour"), ({"fullLoadTokensPerSecond": 0},
                                                       "fullLoadTokensPerSecond"),
                       ({"perHour": "cheap"}, "perHour")):
        assert admit(isvc({"model": M, "cost": bad}))[1], bad
        with pytest.raises(SpecError, match=f"spec.cost.{field}"):
            parse_spec("m", {"model": M, "cost": bad})
