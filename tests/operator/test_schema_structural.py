"""The CRD as apiextensions v1 judges it at creation: structural, defaults valid against their own
schema, CEL rules that compile and hold on the defaulted objects (and on the `default: {}`
values themselves, which the API server validates as written), every optional field a rule
reads guarded with has(). Defect 1 of issue 13 (a description split by YAML into junk schema
keys) is reproduced and must be caught.
"""

from __future__ import annotations

import copy
import re
from typing import Any

import pytest
import yaml
from crd_schema import (
    CRD,
    CRD_PATH,
    SCHEMA,
    admit,
    apply_defaults,
    cel_errors,
    compile_rule,
    evaluate,
    is_transition,
    isvc,
    nodes,
    openapi_errors,
    unknown_fields,
)
from crd_structural import schema_errors
from kubeval import errors as kube_errors

RULES = [(path, node, rule["rule"]) for path, node in nodes(SCHEMA)
         for rule in node.get("x-kubernetes-validations") or []]
# Rules of objects, whose fields may be absent (a scalar's rule always has its value).
OBJECT_RULES = [(path, node, rule) for path, node, rule in RULES if node.get("type") == "object"]
DEFAULTED = [(path, node) for path, node in nodes(SCHEMA) if "default" in node]
# The one-line flow mapping the CRD had (issue 13, defect 1): the commas split the description.
SPLIT_LINE = ("gpuType: {type: string, maxLength: 64, "
              "description: GPU model for the capacity check (H100-80GB, A100-40GB, L4, ...).}")
# Defaulted objects the rules must hold on: from the bare minimum to most fields set.
SAMPLES = [
    {"model": {"uri": "s3://models/m"}},
    {"model": {"uri": "s3://models/m"}, "cache": {}, "autoscaling": {}, "engine": {},
     "resources": {}, "drain": {}, "disruptionBudget": {}},
    {"model": {"uri": "s3://models/m"}, "engine": {"quantization": None}, "resources": None},
    {"model": {"uri": "pvc://weights/llama"}, "engine": {"tensorParallelSize": 8},
     "resources": {"gpus": 8, "cpu": "32", "memory": "512Gi"},
     "cache": {"type": "pvc", "claimName": "nvme"},
     "autoscaling": {"minReplicas": 2, "maxReplicas": 2},
     "drain": {"preStopSeconds": 0, "terminationGracePeriodSeconds": 30},
     "disruptionBudget": {"minAvailable": "50%"},
     "tolerations": [{"operator": "Exists"}, {"key": "gpu", "value": "h100",
                                              "effect": "NoSchedule"}]},
    {"model": {"uri": "/opt/model"}, "engine": {"quantization": "int4"}, "resources": {
        "gpus": 0, "cpu": 4, "memory": 8589934592},
     "cache": {"type": "hostPath", "path": "/mnt/nvme/kvasir"}},
]


def test_crd_schema_is_structural() -> None:
    assert CRD["apiVersion"] == "apiextensions.k8s.io/v1"
    for version in CRD["spec"]["versions"]:
        schema = version["schema"]["openAPIV3Schema"]
        assert schema_errors(schema, with_status="status" in version.get(
            "subresources", {})) == []


def test_crd_yaml_cannot_split_prose() -> None:
    """Block style only: a flow mapping ({...}) holds nothing but `{}`, and a flow sequence
    ([...]) only single-word scalars, so no comma in prose can become a key."""
    tokens = list(yaml.scan(CRD_PATH.read_text()))
    depth, problems = 0, []
    for prev, token in zip(tokens, tokens[1:], strict=False):
        if isinstance(prev, yaml.FlowMappingStartToken) and not isinstance(
                token, yaml.FlowMappingEndToken):
            problems.append(f"line {prev.start_mark.line + 1}: non-empty flow mapping")
        if isinstance(token, yaml.FlowSequenceStartToken):
            depth += 1
        elif isinstance(token, yaml.FlowSequenceEndToken):
            depth -= 1
        elif depth and isinstance(token, yaml.ScalarToken) and not re.fullmatch(
                r"[\w.-]+", token.value):
            problems.append(f"line {token.start_mark.line + 1}: {token.value!r} in a flow list")
    assert problems == []


def test_a_split_description_is_caught_by_both_checks() -> None:
    """Defect 1 reproduced: the old line parses into junk keys, which both the structural check
    and kubernetes-validate (strict, as the API server: "field not declared") refuse."""
    node = yaml.safe_load(SPLIT_LINE)["gpuType"]
    assert {"A100-40GB", "L4"} <= set(node) and node["A100-40GB"] is None
    broken = copy.deepcopy(CRD)
    schema = broken["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    schema["properties"]["spec"]["properties"]["resources"]["properties"]["gpuType"] = node
    found = schema_errors(schema)
    assert any(".resources.gpuType.A100-40GB: not a JSONSchemaProps field" in e for e in found)
    assert any(".resources.gpuType.L4: not a JSONSchemaProps field" in e for e in found)
    assert kube_errors(broken) != []


@pytest.mark.parametrize(("path", "node"), DEFAULTED, ids=[p for p, _ in DEFAULTED])
def test_every_default_is_valid_against_its_own_schema(path: str, node: dict[str, Any]) -> None:
    # As written (what the API server checks at CRD creation: pruned, schema, then CEL with
    # oldSelf = the default itself), then with its nested defaults applied.
    assert unknown_fields(node, node["default"]) == [], path
    for value in (copy.deepcopy(node["default"]), apply_defaults(node, copy.deepcopy(
            node["default"]))):
        assert openapi_errors(node, value) == [], (path, value)
        assert cel_errors(node, value, old=copy.deepcopy(value)) == [], (path, value)


def test_the_empty_object_defaults_validate() -> None:
    """spec.cache and spec.autoscaling default to {} and carry rules: those rules must hold on
    the bare {} (no "no such key: type") and on {} with its fields' defaults applied."""
    empty = {path for path, node in DEFAULTED if node["default"] == {}}
    assert {".spec.cache", ".spec.autoscaling"} <= empty
    for path, node in DEFAULTED:
        if node["default"] == {} and node.get("x-kubernetes-validations"):
            assert cel_errors(node, {}) == [], path
            assert cel_errors(node, apply_defaults(node, {})) == [], path


def test_every_enum_value_has_its_node_type() -> None:
    for path, node in nodes(SCHEMA):
        if "enum" in node:
            plain = {k: v for k, v in node.items() if k != "enum"}
            for value in node["enum"]:
                assert openapi_errors(plain, value) == [], (path, value)


@pytest.mark.parametrize(("path", "rule"), [(p, r) for p, _, r in RULES],
                         ids=[f"{p}:{i}" for i, (p, _, _) in enumerate(RULES)])
def test_every_cel_rule_compiles(path: str, rule: str) -> None:
    compile_rule(rule)


def _fields_read(rule: str) -> list[list[str]]:
    """self.a.b paths a rule reads (a method call such as self.contains(...) reads none)."""
    paths = []
    for match in re.finditer(r"\bself((?:\.[A-Za-z_]\w*)+)(\()?", rule):
        fields = match.group(1).split(".")[1:]
        paths.append(fields[:-1] if match.group(2) else fields)
    return [p for p in paths if p]


@pytest.mark.parametrize(("path", "node", "rule"), RULES,
                         ids=[f"{p}:{i}" for i, (p, _, _) in enumerate(RULES)])
def test_every_optional_field_a_rule_reads_is_guarded_with_has(
        path: str, node: dict[str, Any], rule: str) -> None:
    for fields in _fields_read(rule):
        here = node
        for depth, name in enumerate(fields):
            if name not in (here.get("required") or []):
                guard = "has(self." + ".".join(fields[:depth + 1]) + ")"
                assert guard in rule.replace(" ", ""), f"{path}: {rule!r} needs {guard}"
            here = (here.get("properties") or {}).get(name, {})


@pytest.mark.parametrize(("path", "node", "rule"), OBJECT_RULES,
                         ids=[f"{p}:{i}" for i, (p, _, _) in enumerate(OBJECT_RULES)])
def test_no_rule_fails_to_evaluate_when_every_optional_field_is_absent(
        path: str, node: dict[str, Any], rule: str) -> None:
    bare = {key: {"uri": "s3://models/m"} if key == "model" else {}
            for key in node.get("required") or []}
    outcome = evaluate(rule, bare, bare if is_transition(rule) else None)
    assert not isinstance(outcome, str), f"{path}: {rule!r}: {outcome}"


@pytest.mark.parametrize("spec", SAMPLES)
def test_rules_hold_on_the_defaulted_sample_objects(spec: dict[str, Any]) -> None:
    stored, errors = admit(isvc(spec))
    assert errors == []
    # the defaults really were applied before the rules ran
    assert stored["spec"]["cache"]["type"] in ("emptyDir", "pvc", "hostPath")
    assert stored["spec"]["autoscaling"]["minReplicas"] <= stored["spec"]["autoscaling"][
        "maxReplicas"]
    # an update with the same object passes the transition rules (immutable uri and cache)
    assert admit(isvc(spec), old=isvc(spec))[1] == []
