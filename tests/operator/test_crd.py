"""The CRD's schema, evaluated the way the API server does, without an API server.

Structural defaults are applied first (the API server defaults before it validates), then the
OpenAPI v3 schema is checked with jsonschema (Draft 4 semantics, the ones OpenAPI 3.0 uses:
boolean exclusiveMinimum), then every x-kubernetes-validations CEL rule is evaluated with celpy
(cel-python), transition rules (oldSelf) only on updates, as Kubernetes does.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import celpy
import jsonschema
import pytest
import yaml
from kvasir_operator.spec_parse import parse_spec

ROOT = Path(__file__).resolve().parents[2]
CRD = yaml.safe_load((ROOT / "crds" / "inferenceservices.kvasir.dev.yaml").read_text())
SCHEMA = CRD["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
CEL = celpy.Environment()


def apply_defaults(schema: dict[str, Any], value: Any) -> Any:
    if isinstance(value, dict):
        for key, sub in (schema.get("properties") or {}).items():
            if key not in value and "default" in sub:
                value[key] = copy.deepcopy(sub["default"])
            if key in value:
                value[key] = apply_defaults(sub, value[key])
    elif isinstance(value, list) and "items" in schema:
        return [apply_defaults(schema["items"], v) for v in value]
    return value


def cel_errors(schema: dict[str, Any], value: Any, old: Any, path: str) -> list[str]:
    errors: list[str] = []
    for rule in schema.get("x-kubernetes-validations") or []:
        is_transition = "oldSelf" in rule["rule"]
        if is_transition and old is None:
            continue
        activation = {"self": celpy.json_to_cel(value)}
        if is_transition:
            activation["oldSelf"] = celpy.json_to_cel(old)
        result = CEL.program(CEL.compile(rule["rule"])).evaluate(activation)
        if result is not True and not (isinstance(result, celpy.celtypes.BoolType) and result):
            errors.append(f"{path}: {rule['message']}")
    if isinstance(value, dict):
        for key, sub in (schema.get("properties") or {}).items():
            if key in value:
                old_sub = old.get(key) if isinstance(old, dict) else None
                errors += cel_errors(sub, value[key], old_sub, f"{path}.{key}")
    return errors


def validate(obj: dict[str, Any], old: dict[str, Any] | None = None) -> list[str]:
    obj = apply_defaults(SCHEMA, copy.deepcopy(obj))
    old = apply_defaults(SCHEMA, copy.deepcopy(old)) if old else None
    validator = jsonschema.Draft4Validator(SCHEMA)
    errors = [f"{'.'.join(map(str, e.absolute_path))}: {e.message}"
              for e in validator.iter_errors(obj)]
    return errors or cel_errors(SCHEMA, obj, old, "")


def isvc(spec: dict[str, Any]) -> dict[str, Any]:
    return {"apiVersion": "kvasir.dev/v1alpha1", "kind": "InferenceService",
            "metadata": {"name": "m"}, "spec": spec}


VALID = [
    {"model": {"uri": "s3://models/llama-3.1-8b", "name": "llama"}},
    {"model": {"uri": "pvc://weights/llama"}, "engine": {"tensorParallelSize": 4},
     "resources": {"gpus": 8, "gpuType": "H100-80GB", "cpu": 16, "memory": "200Gi"},
     "cache": {"type": "hostPath", "path": "/mnt/nvme"},
     "autoscaling": {"mode": "builtin", "minReplicas": 0, "maxReplicas": 4,
                     "targetRequests": 8, "scaleDownDelaySeconds": 600},
     "podTemplate": {"spec": {"hostIPC": True}}},
    {"model": {"uri": "/opt/model"}, "resources": {"gpus": 0},
     "disruptionBudget": {"maxUnavailable": "50%"}},
]

INVALID = [
    ({"model": {}}, "uri"),
    ({"model": {"uri": "http://x/y"}}, "does not match"),
    ({"model": {"uri": "s3://bkt/m"}, "engine": {"tensorParallelSize": 0}}, "less than the minimum"),
    ({"model": {"uri": "s3://bkt/m"}, "engine": {"gpuMemoryUtilization": 0}}, "less than or equal"),
    ({"model": {"uri": "s3://bkt/m"}, "engine": {"dtype": "int3"}}, "is not one of"),
    ({"model": {"uri": "s3://bkt/m"}, "engine": {"kvCacheDtype": "fp8"}}, "is not one of"),
    ({"model": {"uri": "s3://bkt/m"}, "autoscaling": {"minReplicas": 3, "maxReplicas": 2}},
     "minReplicas must be <= autoscaling.maxReplicas"),
    ({"model": {"uri": "s3://bkt/m"}, "engine": {"tensorParallelSize": 4},
      "resources": {"gpus": 6}}, "multiple of engine.tensorParallelSize"),
    ({"model": {"uri": "s3://bkt/m"}, "cache": {"type": "pvc"}}, "claimName is required"),
    ({"model": {"uri": "s3://bkt/m"}, "drain": {"terminationGracePeriodSeconds": 5}},
     "terminationGracePeriodSeconds must be >="),
    ({"model": {"uri": "s3://bkt/m"}, "disruptionBudget": {"minAvailable": 1,
                                                         "maxUnavailable": 1}}, "at most one"),
]


@pytest.mark.parametrize("spec", VALID)
def test_valid_examples_pass_schema_cel_and_the_parser(spec: dict[str, Any]) -> None:
    assert validate(isvc(spec)) == []
    parse_spec("m", spec)  # the operator accepts what the API server accepts


@pytest.mark.parametrize(("spec", "message"), INVALID)
def test_invalid_examples_fail_with_the_intended_message(spec: dict[str, Any],
                                                         message: str) -> None:
    errors = validate(isvc(spec))
    assert any(message in e for e in errors), errors


def test_transition_rules_make_model_uri_and_cache_immutable() -> None:
    old = isvc({"model": {"uri": "s3://bkt/m"}, "cache": {"type": "emptyDir"}})
    assert validate(isvc({"model": {"uri": "s3://bkt/m"}, "replicas": 3}), old) == []
    moved = validate(isvc({"model": {"uri": "s3://bkt/other"}}), old)
    assert any("model.uri is immutable" in e for e in moved)
    recached = validate(isvc({"model": {"uri": "s3://bkt/m"},
                              "cache": {"type": "hostPath", "path": "/mnt"}}), old)
    assert any("cache is immutable" in e for e in recached)


def test_every_field_has_a_description_and_the_contract_shape() -> None:
    def walk(schema: dict[str, Any], path: str) -> list[str]:
        missing = [] if "description" in schema or path in ("", ".metadata") else [path]
        for key, sub in (schema.get("properties") or {}).items():
            missing += walk(sub, f"{path}.{key}")
        if "items" in schema and "properties" in schema["items"]:
            missing += walk(schema["items"], f"{path}[]")
        return missing

    assert walk(SCHEMA, "") == []
    version = CRD["spec"]["versions"][0]
    assert CRD["spec"]["names"]["shortNames"] == ["kisvc"]
    assert version["subresources"]["scale"] == {
        "specReplicasPath": ".spec.replicas", "statusReplicasPath": ".status.replicas",
        "labelSelectorPath": ".status.selector"}
    columns = {c["name"] for c in version["additionalPrinterColumns"]}
    assert {"Model", "Ready", "Desired", "Phase", "Age"} <= columns
