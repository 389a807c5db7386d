"""The CRD's schema, evaluated the way the API server does, without an API server (crd_schema.py):
nulls pruned, structural defaults applied, the OpenAPI v3 schema, then the CEL rules. Each bad
value is refused with a message that names the field, and what the schema accepts the parser
accepts too.
"""

from __future__ import annotations

from typing import Any

import pytest
from crd_schema import CRD, SCHEMA, isvc, validate
from kvasir_engine.config import CHECKPOINT_QUANTIZATIONS
from kvasir_engine.config import QUANTIZATIONS as ENGINE_QUANTIZATIONS
from kvasir_operator import spec_parse
from kvasir_operator.spec_parse import parse_spec

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
    {"model": {"uri": "/opt/model"}, "engine": {"quantization": "int8", "dtype": "float32"},
     "resources": {"gpus": 0, "cpu": "1500m", "memory": "2Gi"},
     "cache": {"sizeLimit": "20Gi"}},
    {"model": {"uri": "s3://models/m"}, "engine": {"quantization": None,
                                                   "tensorParallelSize": 2,
                                                   "env": [{"name": "HF_HOME", "value": "/tmp"}]},
     "resources": {"cpu": 4, "memory": 68719476736, "gpuResourceName": "amd.com/gpu"},
     "tolerations": [{"operator": "Exists"}], "nodeSelector": {"gpu": "mi300x"}},
]

INVALID = [
    ({"model": {}}, "uri"),
    ({"model": {"uri": "http://x/y"}}, "does not match"),
    ({"model": {"uri": "s3://bkt/m"}, "engine": {"tensorParallelSize": 0}}, "is not one of"),
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
# Issue 13, defect 6: values the API server used to accept and the Deployment apply then refused.
M = {"uri": "s3://bkt/m"}
NAMED = [
    ({"model": M, "engine": {"quantization": "fp3"}}, "spec.engine.quantization: 'fp3' is not one"),
    ({"model": M, "engine": {"tensorParallelSize": 3}}, "spec.engine.tensorParallelSize: 3 is not"),
    ({"model": M, "engine": {"tensorParallelSize": 16}}, "spec.engine.tensorParallelSize: 16 is"),
    ({"model": M, "resources": {"memory": "lots"}}, "spec.resources.memory: 'lots' does not match"),
    ({"model": M, "resources": {"cpu": "-1"}}, "spec.resources.cpu: '-1' does not match"),
    ({"model": M, "resources": {"cpu": -2}}, "spec.resources.cpu: -2 is less than the minimum"),
    ({"model": M, "resources": {"memory": 1.5}}, "spec.resources.memory: 1.5 is not of type"),
    ({"model": M, "cache": {"sizeLimit": "big"}}, "spec.cache.sizeLimit: 'big' does not match"),
    ({"model": M, "resources": {"gpuResourceName": "gpu"}}, "spec.resources.gpuResourceName"),
    ({"model": M, "disruptionBudget": {"minAvailable": "150%"}}, "spec.disruptionBudget.minAv"),
    ({"model": M, "disruptionBudget": {"maxUnavailable": -1}}, "spec.disruptionBudget.maxUnav"),
    ({"model": {"uri": "s3://bkt/m", "credentialsSecret": "S3_Creds"}},
     "spec.model.credentialsSecret: 'S3_Creds' does not match"),
    ({"model": M, "engine": {"image": "bad image"}}, "spec.engine.image: 'bad image' does not"),
    ({"model": M, "engine": {"env": [{"value": "1"}]}}, "spec.engine.env.0: 'name' is a required"),
    ({"model": M, "engine": {"env": [{"name": "A=B"}]}}, "spec.engine.env.0.name: 'A=B' does not"),
    ({"model": M, "fetch": {"endpointUrl": "minio:9000"}}, "spec.fetch.endpointUrl: 'minio:9000'"),
    ({"model": M, "cache": {"type": "hostPath", "path": "/mnt/../etc"}}, "must not contain '..'"),
    ({"model": M, "cache": {"type": "pvc", "claimName": "My_Claim"}}, "spec.cache.claimName"),
    ({"model": M, "tolerations": [{"key": "k", "operator": "Exists", "value": "v"}]},
     "operator Exists must not set value"),
    ({"model": M, "tolerations": [{"value": "v"}]}, "without key must have operator Exists"),
    ({"model": M, "tolerations": [{"key": "k", "effect": "Sometimes"}]},
     "spec.tolerations.0.effect: 'Sometimes' is not one of"),
    ({"model": M, "tolerations": [{"key": "k", "opertor": "Exists"}]},
     "spec.tolerations.0.opertor: field not declared in schema"),
    ({"model": M, "nodeSelector": {"gpu": "h100 80gb"}}, "spec.nodeSelector.gpu: 'h100 80gb'"),
    ({"model": M, "podLabels": {"team": "x" * 64}}, "spec.podLabels.team: 'xxxx"),
    ({"model": M, "serviceAccountName": "Engine"}, "spec.serviceAccountName: 'Engine' does not"),
    ({"model": M, "imagePullSecrets": ["reg cred"]}, "spec.imagePullSecrets.0: 'reg cred'"),
    ({"model": M, "priorityClassName": "High"}, "spec.priorityClassName: 'High' does not match"),
    ({"model": M, "engine": {"tensorParalelSize": 2}},
     "spec.engine.tensorParalelSize: field not declared in schema"),
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


@pytest.mark.parametrize(("spec", "message"), NAMED)
def test_bad_values_are_refused_naming_the_field(spec: dict[str, Any], message: str) -> None:
    errors = validate(isvc(spec))
    assert any(message in e for e in errors), errors


@pytest.mark.parametrize("name", ["1llama", "llama.3", "Llama", "x" * 64])
def test_names_that_cannot_name_a_service_are_refused(name: str) -> None:
    errors = validate(isvc({"model": {"uri": "s3://bkt/m"}}, name=name))
    assert any(e.startswith("metadata.name: ") for e in errors), errors


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


def test_schema_choices_are_the_parsers_and_the_engines() -> None:
    """One vocabulary: the CRD's enums and quantity pattern are the parser's, whose
    quantizations are the engine's (the operator does not import the engine; this test does)."""
    spec = SCHEMA["properties"]["spec"]["properties"]
    engine = spec["engine"]["properties"]
    assert tuple(engine["quantization"]["enum"]) == spec_parse.QUANTIZATIONS
    assert set(spec_parse.QUANTIZATIONS) == set(ENGINE_QUANTIZATIONS + CHECKPOINT_QUANTIZATIONS)
    assert tuple(engine["tensorParallelSize"]["enum"]) == spec_parse.TP_SIZES
    assert tuple(engine["dtype"]["enum"]) == spec_parse.DTYPES
    assert tuple(engine["imagePullPolicy"]["enum"]) == spec_parse.PULL_POLICIES
    for node in (spec["resources"]["properties"]["cpu"], spec["resources"]["properties"]["memory"],
                 spec["cache"]["properties"]["sizeLimit"]):
        assert node["pattern"] == spec_parse.QUANTITY.pattern
    budget = spec["disruptionBudget"]["properties"]
    for node in (budget["minAvailable"], budget["maxUnavailable"]):
        assert node["pattern"] == spec_parse.PERCENT.pattern
