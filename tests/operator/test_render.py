"""Renderers over many specs (hypothesis), checked against the Kubernetes OpenAPI models.

Each manifest is deserialized into the `kubernetes` client's model (V1Deployment...) with
client-side validation on, then serialized back: a misspelled key or a wrong type makes the round
trip differ, so the check is a schema check, not a smoke test.
"""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kubernetes.client import ApiClient
from kvasir_operator import labels
from kvasir_operator.merge import strategic_merge
from kvasir_operator.pod import CPU_KERNEL_BUILD_SECONDS, model_dir, startup_budget_seconds
from kvasir_operator.render import Owner, render_deployment, render_pdb, render_service
from kvasir_operator.spec import SpecError, spec_hash
from kvasir_operator.spec_parse import parse_spec

OWNER = Owner("llm", "ns1", "uid-1")
API = ApiClient()


def _round_trip(manifest: dict[str, Any], model: str) -> None:
    obj = API.deserialize(json.dumps(manifest), model, None)
    assert API.sanitize_for_serialization(obj) == manifest


@st.composite
def specs(draw: st.DrawFn) -> dict[str, Any]:
    tp = draw(st.sampled_from([1, 2, 4, 8]))
    gpus = tp * draw(st.integers(0, 2))
    cache = draw(st.sampled_from([
        {"type": "emptyDir"}, {"type": "emptyDir", "sizeLimit": "200Gi"},
        {"type": "hostPath", "path": "/mnt/nvme/kvasir"}, {"type": "pvc", "claimName": "c"}]))
    uri = draw(st.sampled_from(["s3://models/llama-3.1-8b", "pvc://weights/llama", "/opt/model"]))
    lo = draw(st.integers(0, 4))
    spec: dict[str, Any] = {
        "model": {"uri": uri, "sizeBytes": draw(st.none() | st.integers(0, 10**12)),
                  "credentialsSecret": draw(st.none() | st.just("s3-creds"))},
        "engine": {"tensorParallelSize": tp, "maxModelLen": draw(st.integers(16, 131072)),
                   "dtype": draw(st.sampled_from(["auto", "bfloat16", "float16", "float32"])),
                   "kvCacheDtype": draw(st.sampled_from(["auto", "bfloat16", "float32"])),
                   "enablePrefixCaching": draw(st.booleans()),
                   "extraArgs": draw(st.lists(st.sampled_from(["--seed", "1"]), max_size=2)),
                   "env": [{"name": "B", "value": "2"}, {"name": "A", "value": "1"}]},
        "resources": {"gpus": gpus, "cpu": "8", "memory": "64Gi"},
        "cache": cache,
        "autoscaling": {"minReplicas": lo, "maxReplicas": lo + draw(st.integers(1, 5))},
        "replicas": draw(st.none() | st.integers(0, 12)),
        "startup": draw(st.sampled_from([{}, {"timeoutSeconds": 900}])),
        "drain": {"preStopSeconds": draw(st.integers(0, 30))},
        "nodeSelector": {"gpu": "h100"},
        "tolerations": [{"key": "dedicated", "operator": "Exists"}],
        "podAnnotations": {"a": "b"},
    }
    if draw(st.booleans()):
        spec["podTemplate"] = {"spec": {
            "containers": [{"name": "engine", "env": [{"name": "EXTRA", "value": "1"}]},
                           {"name": "sidecar", "image": "busybox"}],
            "hostIPC": True}}
    return spec


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(raw=specs())
def test_rendered_manifests_are_valid_kubernetes_objects(raw: dict[str, Any]) -> None:
    spec = parse_spec("llm", raw)
    digest = spec_hash(spec)
    dep = render_deployment(spec, OWNER, digest)
    _round_trip(dep, "V1Deployment")
    _round_trip(render_service(spec, OWNER), "V1Service")
    pdb = render_pdb(spec, OWNER)
    assert pdb is not None
    _round_trip(pdb, "V1PodDisruptionBudget")
    assert pdb["spec"]["minAvailable"] == max(0, raw["autoscaling"]["minReplicas"] - 1)

    tmpl = dep["spec"]["template"]
    pod, engine = tmpl["spec"], tmpl["spec"]["containers"][0]
    assert tmpl["metadata"]["labels"][labels.SPEC_HASH] == digest
    assert dep["spec"]["selector"]["matchLabels"] == {labels.INFERENCESERVICE: "llm"}
    assert engine["name"] == "engine" and engine["ports"][0]["containerPort"] == 8000
    gpus = raw["resources"]["gpus"]
    assert engine["resources"]["limits"].get("nvidia.com/gpu") == (str(gpus) if gpus else None)
    args = engine["args"]
    assert args[args.index("--tensor-parallel-size") + 1] == str(raw["engine"]["tensorParallelSize"])
    assert args[1] == model_dir(spec)
    kv_dtype = raw["engine"]["kvCacheDtype"]
    assert ("--kv-cache-dtype" in args) == (kv_dtype != "auto")
    if kv_dtype != "auto":
        assert args[args.index("--kv-cache-dtype") + 1] == kv_dtype
    lo, hi = raw["autoscaling"]["minReplicas"], raw["autoscaling"]["maxReplicas"]
    want = lo if raw["replicas"] is None else raw["replicas"]
    assert dep["spec"]["replicas"] == max(lo, min(hi, want))
    assert pod["terminationGracePeriodSeconds"] >= (
        raw["drain"]["preStopSeconds"] + spec.engine.shutdown_grace_seconds)
    startup = engine["startupProbe"]
    budget = startup_budget_seconds(spec, None)
    assert startup["periodSeconds"] * startup["failureThreshold"] >= budget
    ready = engine["readinessProbe"]
    assert ready["httpGet"]["path"] == "/ready"
    # The engine gives up on a /ready answer (503 with its reason) before kubelet's timeout.
    assert 0 < float(args[args.index("--ready-timeout-seconds") + 1]) < ready["timeoutSeconds"]
    assert engine["livenessProbe"]["httpGet"]["path"] == "/health"
    mounts = {m["name"]: m for m in engine["volumeMounts"]}
    if raw["model"]["uri"].startswith("/"):
        assert "initContainers" not in pod and "cache" not in mounts
    else:
        *owner, fetch = pod["initContainers"]
        assert fetch["name"] == "kvasir-fetch" and mounts["cache"]["readOnly"] is True
        assert [c["name"] for c in owner] == (
            ["cache-owner"] if raw["cache"]["type"] == "hostPath" else [])
        env = {e["name"]: e for e in fetch["env"]}
        assert env["POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    if "podTemplate" in raw:
        names = [c["name"] for c in pod["containers"]]
        assert names == ["engine", "sidecar"] and pod["hostIPC"] is True
        assert {"name": "EXTRA", "value": "1"} in engine["env"]
    else:
        env_names = [e["name"] for e in engine["env"]]
        assert env_names == sorted(env_names)


def test_startup_budget_follows_model_size() -> None:
    base = {"model": {"uri": "s3://b/m"}}
    small = parse_spec("m", {**base, "model": {"uri": "s3://b/m", "sizeBytes": 10**9}})
    big = parse_spec("m", {**base, "model": {"uri": "s3://b/m", "sizeBytes": 400 * 10**9}})
    assert startup_budget_seconds(small, None) == 1 + 120
    assert startup_budget_seconds(big, None) == 400 + 120
    fixed = parse_spec("m", {**base, "startup": {"timeoutSeconds": 77}})
    assert startup_budget_seconds(fixed, 10**12) == 77
    # On CPU the engine compiles its native kernels first (docs/images.md).
    cpu = parse_spec("m", {"model": {"uri": "s3://b/m", "sizeBytes": 10**9},
                           "resources": {"gpus": 0}})
    assert startup_budget_seconds(cpu, None) == 1 + 120 + CPU_KERNEL_BUILD_SECONDS
    dep = render_deployment(big, OWNER, "h")
    probe = dep["spec"]["template"]["spec"]["containers"][0]["startupProbe"]
    assert probe["failureThreshold"] == math.ceil(520 / 10)


def test_spec_hash_ignores_scaling_but_not_engine() -> None:
    a = parse_spec("m", {"model": {"uri": "s3://b/m"}, "autoscaling": {"maxReplicas": 2}})
    b = parse_spec("m", {"model": {"uri": "s3://b/m"}, "autoscaling": {"maxReplicas": 9},
                         "replicas": 5})
    c = parse_spec("m", {"model": {"uri": "s3://b/m"}, "engine": {"maxModelLen": 1024}})
    assert spec_hash(a) == spec_hash(b) != spec_hash(c)


@pytest.mark.parametrize(("raw", "message"), [
    ({}, "spec.model: required"),
    ({"model": {"uri": "http://x"}}, "spec.model.uri: must start with"),
    ({"model": {"uri": "s3://b"}, "engine": {"tensorParallelSize": 0}},
     "spec.engine.tensorParallelSize: must be one of [1, 2, 4, 8], got 0"),
    ({"model": {"uri": "s3://b"}, "engine": {"tensorParallelSize": 4}, "resources": {"gpus": 6}},
     "spec.resources.gpus (6) must be a multiple of spec.engine.tensorParallelSize (4)"),
    ({"model": {"uri": "s3://b"}, "cache": {"type": "hostPath"}}, "spec.cache.path: required"),
    ({"model": {"uri": "s3://b"}, "engine": {"dtype": "int3"}}, "spec.engine.dtype: must be one"),
    ({"model": {"uri": "s3://b"}, "engine": {"kvCacheDtype": "fp8"}},
     "spec.engine.kvCacheDtype: must be one"),
    ({"model": {"uri": "s3://b"}, "engine": {"maxModelLen": "long"}},
     "spec.engine.maxModelLen: must be an integer"),
    ({"model": {"uri": "s3://b"}, "drain": {"terminationGracePeriodSeconds": 5}},
     "terminationGracePeriodSeconds (5) must be >="),
])
def test_invalid_specs_name_the_field(raw: dict[str, Any], message: str) -> None:
    with pytest.raises(SpecError) as info:
        parse_spec("m", raw)
    assert message in str(info.value)


def test_strategic_merge_by_name_and_delete() -> None:
    base = {"containers": [{"name": "a", "image": "x", "env": [{"name": "K", "value": "1"}]},
                           {"name": "b", "image": "y"}], "dnsPolicy": "ClusterFirst"}
    patch = {"containers": [{"name": "a", "env": [{"name": "K", "value": "2"}]},
                            {"name": "b", "$patch": "delete"}], "dnsPolicy": None}
    assert strategic_merge(base, patch) == {
        "containers": [{"name": "a", "image": "x", "env": [{"name": "K", "value": "2"}]}]}


def test_service_account_and_api_token_only_in_the_fetch_container() -> None:
    owner = Owner("m", "ns", "u")
    spec = parse_spec("m", {"model": {"uri": "s3://b/m"}})
    pod = render_deployment(spec, owner, spec_hash(spec), None, labels.ENGINE_SERVICE_ACCOUNT)[
        "spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == labels.ENGINE_SERVICE_ACCOUNT
    assert pod["automountServiceAccountToken"] is False
    token_dir = "/var/run/secrets/kubernetes.io/serviceaccount"
    fetch_mounts = {m["mountPath"] for m in pod["initContainers"][0]["volumeMounts"]}
    engine_mounts = {m["mountPath"] for m in pod["containers"][0]["volumeMounts"]}
    assert token_dir in fetch_mounts and token_dir not in engine_mounts
    _round_trip(render_deployment(spec, owner, "h", None, "kvasir-engine"), "V1Deployment")
    # No engine ServiceAccount in the namespace: the namespace default; the spec's one wins.
    assert "serviceAccountName" not in render_deployment(spec, owner, "h")["spec"]["template"][
        "spec"]
    own = parse_spec("m", {"model": {"uri": "s3://b/m"}, "serviceAccountName": "irsa"})
    assert render_deployment(own, owner, "h", None, "kvasir-engine")["spec"]["template"]["spec"][
        "serviceAccountName"] == "irsa"
