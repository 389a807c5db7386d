"""spec.disaggregation (issue 33): one Deployment per role, rendered, admitted, validated and
reconciled against kmock (toggled on and off, status per role, quiet in steady state)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from crd_schema import admit
from crd_schema import isvc as admitted
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kubeval import errors, supported_versions
from kvasir_operator import k8s, labels
from kvasir_operator.disaggregation import role_spec
from kvasir_operator.render import Owner, render_pdb, render_role_deployments, render_service
from kvasir_operator.spec import SpecError, spec_hash
from kvasir_operator.spec_parse import parse_spec
from operator_support import isvc, reconcile_named, serve_operator_resources, writes
from test_render import specs

NS = "ns1"
ISVCS = "kvasir.dev/v1alpha1/inferenceservices"
DEPLOYMENTS = "apps/v1/deployments"
OWNER = Owner("llm", NS, "uid-1")
M = {"uri": "s3://models/llama-8b", "sizeBytes": 16 * 10**9}
DISAGG: dict[str, Any] = {
    "enabled": True, "holdTimeoutSeconds": 30, "transferTimeoutSeconds": 5,
    "prefill": {"minReplicas": 1, "maxReplicas": 4, "replicas": 2, "maxNumSeqs": 16,
                "resources": {"cpu": "16"}, "extraArgs": ["--max-num-batched-tokens", "8192"]},
    "decode": {"minReplicas": 1, "maxReplicas": 8, "resources": {"gpus": 2, "memory": "128Gi"},
               "targetRequests": 64}}
SPEC: dict[str, Any] = {"model": M, "resources": {"gpus": 1, "cpu": "8", "memory": "64Gi"},
                        "engine": {"extraArgs": ["--seed", "1"]},
                        "autoscaling": {"mode": "none"}, "disaggregation": DISAGG}


def _engine(deployment: dict[str, Any]) -> dict[str, Any]:
    return next(c for c in deployment["spec"]["template"]["spec"]["containers"]
                if c["name"] == labels.ENGINE_CONTAINER)


def _kv_config(deployment: dict[str, Any]) -> dict[str, Any]:
    args = _engine(deployment)["args"]
    return dict(json.loads(args[args.index("--kv-transfer-config") + 1]))


def test_each_role_renders_its_own_deployment_with_its_kv_role() -> None:
    spec = parse_spec(OWNER.name, SPEC)
    role_to_dep = render_role_deployments(spec, OWNER, 16 * 10**9, "kvasir-engine")
    assert sorted(role_to_dep) == ["decode", "prefill"]
    prefill, decode = role_to_dep["prefill"], role_to_dep["decode"]
    for role, dep in role_to_dep.items():
        assert dep["metadata"]["name"] == f"llm-{role}"
        assert dep["metadata"]["labels"][labels.ROLE] == role
        selector = {labels.INFERENCESERVICE: "llm", labels.ROLE: role}
        assert dep["spec"]["selector"]["matchLabels"] == selector
        assert selector.items() <= dep["spec"]["template"]["metadata"]["labels"].items()
    assert (prefill["spec"]["replicas"], decode["spec"]["replicas"]) == (2, 1)

    assert _kv_config(prefill) == {
        "kv_connector": "TCPConnector", "kv_role": "kv_producer", "kv_ip": "$(POD_IP)",
        "kv_port": 14579, "kv_connector_extra_config": {"hold_timeout_s": 30.0}}
    assert _kv_config(decode) == {"kv_connector": "TCPConnector", "kv_role": "kv_consumer",
                                  "kv_connector_extra_config": {"transfer_timeout_s": 5.0}}
    # The producer advertises its pod's address: POD_IP from the downward API, port declared.
    producer = _engine(prefill)
    assert {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}} in (
        producer["env"])
    assert {"name": "kv-transfer", "containerPort": 14579, "protocol": "TCP"} in (
        producer["ports"])
    consumer = _engine(decode)
    assert all(e["name"] != "POD_IP" for e in consumer["env"])
    assert [p["name"] for p in consumer["ports"]] == ["http"]

    # Resources, max-num-seqs and extra arguments per role, else the service's.
    assert producer["resources"]["limits"] == {"nvidia.com/gpu": "1", "cpu": "16",
                                               "memory": "64Gi"}
    assert consumer["resources"]["limits"] == {"nvidia.com/gpu": "2", "cpu": "8",
                                               "memory": "128Gi"}
    assert producer["args"][producer["args"].index("--max-num-seqs") + 1] == "16"
    assert "--max-num-seqs" not in consumer["args"]
    assert producer["args"][-4:] == ["--seed", "1", "--max-num-batched-tokens", "8192"]
    assert consumer["args"][-2:] == ["--seed", "1"]


def test_the_service_and_the_pdb_cover_both_roles() -> None:
    spec = parse_spec(OWNER.name, SPEC)
    assert render_service(spec, OWNER)["spec"]["selector"] == {labels.INFERENCESERVICE: "llm"}
    pdb = render_pdb(spec, OWNER)
    assert pdb is not None and pdb["spec"]["maxUnavailable"] == 1
    assert pdb["spec"]["selector"]["matchLabels"] == {labels.INFERENCESERVICE: "llm"}


@pytest.mark.parametrize("version", [supported_versions()[0], supported_versions()[-1]])
def test_rendered_role_objects_are_valid_kubernetes_strictly(version: str) -> None:
    assert admit(admitted(SPEC, name="llm"))[1] == []
    spec = parse_spec(OWNER.name, SPEC)
    objects = [*render_role_deployments(spec, OWNER, 16 * 10**9, "kvasir-engine").values(),
               render_service(spec, OWNER), render_pdb(spec, OWNER)]
    assert [e for o in objects if o is not None for e in errors(o, version)] == []


def test_a_roles_scale_never_rolls_its_pods_and_disabled_changes_no_hash() -> None:
    spec = parse_spec(OWNER.name, SPEC)
    scaled = {**DISAGG, "prefill": {**DISAGG["prefill"], "replicas": 4, "maxReplicas": 6}}
    again = parse_spec(OWNER.name, {**SPEC, "disaggregation": scaled})
    assert spec_hash(spec) == spec_hash(again)
    assert spec_hash(role_spec(spec, "prefill")) == spec_hash(role_spec(again, "prefill"))
    plain = {k: v for k, v in SPEC.items() if k != "disaggregation"}
    off = {**plain, "disaggregation": {**DISAGG, "enabled": False}}
    assert spec_hash(parse_spec("llm", off)) == spec_hash(parse_spec("llm", plain))
    # A change to one role's pods rolls that role only.
    bigger = {**DISAGG, "decode": {**DISAGG["decode"], "resources": {"gpus": 4}}}
    changed = parse_spec(OWNER.name, {**SPEC, "disaggregation": bigger})
    assert spec_hash(role_spec(changed, "prefill")) == spec_hash(role_spec(spec, "prefill"))
    assert spec_hash(role_spec(changed, "decode")) != spec_hash(role_spec(spec, "decode"))


def _with(**disagg: Any) -> dict[str, Any]:
    return {**SPEC, "disaggregation": {**DISAGG, **disagg}}


BAD = [
    # (spec, the CRD's message, the parser's message): both name the fields.
    (_with(decode={"tensorParallelSize": 2, "resources": {"gpus": 2}}),
     "disaggregation.prefill.tensorParallelSize and disaggregation.decode.tensorParallelSize "
     "(each default engine.tensorParallelSize) must be equal",
     "spec.disaggregation.prefill.tensorParallelSize (1) and "
     "spec.disaggregation.decode.tensorParallelSize (2)"),
    ({**_with(kvPort=7999), "engine": {"tensorParallelSize": 2}, "resources": {"gpus": 2}},
     "disaggregation.kvPort + r, the port of the prefill engine's tensor-parallel rank r",
     "spec.disaggregation.kvPort (7999): the prefill engine's tensor-parallel rank r serves "
     "on kvPort + r, up to 8000"),
    ({**_with(kvPort=65535), "engine": {"tensorParallelSize": 2}, "resources": {"gpus": 2}},
     "disaggregation.kvPort + r, the port of the prefill engine's tensor-parallel rank r",
     "up to 65536, which must be <= 65535"),
    ({**_with(), "engine": {"pipelineParallelSize": 2}},
     "engine.pipelineParallelSize must be 1 with disaggregation.enabled",
     "spec.engine.pipelineParallelSize 2"),
    (_with(prefill={"minReplicas": 3, "maxReplicas": 2}),
     "disaggregation.prefill.minReplicas must be <= disaggregation.prefill.maxReplicas",
     "spec.disaggregation.prefill.minReplicas (3) must be <= spec.disaggregation.prefill"),
    (_with(decode={"minReplicas": 5, "maxReplicas": 1}),
     "disaggregation.decode.minReplicas must be <= disaggregation.decode.maxReplicas",
     "spec.disaggregation.decode.minReplicas (5)"),
    (_with(prefill={"replicas": 1}, decode={"replicas": 0, "minReplicas": 0}),
     "disaggregation.decode.replicas is 0 while disaggregation.prefill.replicas is not",
     "spec.disaggregation.decode.replicas is 0"),
    (_with(kvPort=8000), "disaggregation.kvPort must differ",
     "spec.disaggregation.kvPort: must differ"),
]


@pytest.mark.parametrize(("spec", "crd_message", "parser_message"), BAD)
def test_bad_combinations_are_refused_by_the_crd_and_the_parser_naming_the_fields(
        spec: dict[str, Any], crd_message: str, parser_message: str) -> None:
    found = admit(admitted(spec))[1]
    assert any(crd_message in e for e in found), found
    with pytest.raises(SpecError) as refused:
        parse_spec("m", spec)
    assert parser_message in str(refused.value)


def test_the_schema_refuses_a_bad_connector_and_a_privileged_port() -> None:
    assert admit(admitted(_with(connector="NixlConnector")))[1]
    assert admit(admitted(_with(kvPort=80)))[1]
    with pytest.raises(SpecError, match="spec.disaggregation.connector"):
        parse_spec("m", _with(connector="NixlConnector"))


def test_tensor_parallel_roles_of_one_size_are_admitted_each_rank_with_its_kv_port() -> None:
    spec = {**_with(decode={**DISAGG["decode"], "resources": {"gpus": 2}}),
            "engine": {"tensorParallelSize": 2}, "resources": {"gpus": 2}}
    assert admit(admitted(spec))[1] == []
    role_to_dep = render_role_deployments(parse_spec("llm", spec), OWNER, 16 * 10**9,
                                          "kvasir-engine")
    producer = _engine(role_to_dep["prefill"])
    assert [(p["name"], p["containerPort"]) for p in producer["ports"]
            if p["name"].startswith("kv-transfer")] == [("kv-transfer", 14579),
                                                       ("kv-transfer-1", 14580)]
    assert "--tensor-parallel-size" in _engine(role_to_dep["decode"])["args"]


def test_prefill_at_zero_is_allowed_decode_prefills_itself() -> None:
    spec = _with(prefill={"replicas": 0, "minReplicas": 0})
    assert admit(admitted(spec))[1] == []
    assert role_spec(parse_spec("m", spec), "prefill").desired_replicas == 0


async def _reconcile(client: k8s.K8sClient) -> None:
    await reconcile_named(client, NS, "llm")


async def _deployments(client: k8s.K8sClient) -> list[str]:
    return sorted(d["metadata"]["name"] for d in await client.list(k8s.DEPLOYMENTS, NS))


async def _set_spec(client: k8s.K8sClient, spec: dict[str, Any], generation: int) -> None:
    await client.patch_merge(k8s.INFERENCESERVICES, NS, "llm",
                             {"spec": spec, "metadata": {"generation": generation}})


@pytest.mark.asyncio
async def test_toggling_disaggregation_swaps_the_workloads_and_settles_quietly(
        kmock: Any) -> None:
    serve_operator_resources(kmock)
    kmock.objects[ISVCS, NS, "llm"] = isvc("llm", NS, "uid-1", SPEC)
    async with k8s.K8sClient(str(kmock.url)) as client:
        for _ in range(2):  # create, then settle the status on what was created
            await _reconcile(client)
        assert await _deployments(client) == ["llm-decode", "llm-prefill"]
        assert await client.get(k8s.SERVICES, NS, "llm") is not None
        settled = len(list(kmock))
        for _ in range(3):  # an unchanged disaggregated service: nothing written
            await _reconcile(client)
        assert writes(kmock, settled) == []

        # Off: the plain Deployment comes back, the role Deployments go.
        await _set_spec(client, {"disaggregation": {"enabled": False}}, 2)
        await _reconcile(client)
        assert await _deployments(client) == ["llm"]
        body = await client.get(k8s.INFERENCESERVICES, NS, "llm")
        assert body is not None and "roles" not in body["status"]
        await _reconcile(client)
        settled = len(list(kmock))
        await _reconcile(client)
        assert writes(kmock, settled) == []

        # On again: the roles come back, the plain one goes.
        await _set_spec(client, {"disaggregation": {"enabled": True}}, 3)
        await _reconcile(client)
        assert await _deployments(client) == ["llm-decode", "llm-prefill"]

        # A role scaled by hand (or by the autoscaler) is written to its Deployment only.
        await _set_spec(client, {"disaggregation": {"decode": {"replicas": 3, "maxReplicas": 8}}},
                        4)
        before = len(list(kmock))
        await _reconcile(client)
        written = writes(kmock, before)
        assert any("/deployments/llm-decode" in w for w in written), written
        assert not any("/deployments/llm-prefill" in w for w in written), written
        dep = await client.get(k8s.DEPLOYMENTS, NS, "llm-decode")
        assert dep is not None and dep["spec"]["replicas"] == 3


@pytest.mark.asyncio
async def test_status_counts_each_role_and_ready_needs_both(kmock: Any) -> None:
    serve_operator_resources(kmock)
    kmock.objects[ISVCS, NS, "llm"] = isvc("llm", NS, "uid-1", {
        **SPEC, "model": {"uri": "/opt/model"}})
    async with k8s.K8sClient(str(kmock.url)) as client:
        await _reconcile(client)

        async def report(role: str, replicas: int, ready: int) -> None:
            await client.patch_merge(k8s.DEPLOYMENTS, NS, f"llm-{role}", {"status": {
                "replicas": replicas, "readyReplicas": ready, "updatedReplicas": replicas}})

        await report("prefill", 2, 2)
        await report("decode", 1, 0)
        await _reconcile(client)
        body = await client.get(k8s.INFERENCESERVICES, NS, "llm")
        assert body is not None
        status = body["status"]
        assert status["roles"] == {
            "prefill": {"replicas": 2, "readyReplicas": 2, "desiredReplicas": 2},
            "decode": {"replicas": 1, "readyReplicas": 0, "desiredReplicas": 1}}
        assert (status["readyReplicas"], status["desiredReplicas"]) == (2, 3)
        conditions = {c["type"]: c for c in status["conditions"]}
        assert conditions["Available"]["status"] == "False"  # no decode replica can answer
        assert "decode 0/1" in conditions["Available"]["message"]
        assert conditions["Ready"]["status"] == "False" and status["phase"] != "Ready"

        await report("decode", 1, 1)
        await _reconcile(client)
        body = await client.get(k8s.INFERENCESERVICES, NS, "llm")
        assert body is not None
        status = body["status"]
        conditions = {c["type"]: c for c in status["conditions"]}
        assert conditions["Available"]["status"] == "True"
        assert conditions["Ready"]["status"] == "True" and status["phase"] == "Ready"
        assert status["roles"]["decode"]["readyReplicas"] == 1


def test_the_connectors_are_the_engines_and_the_crds() -> None:
    from crd_schema import SCHEMA
    from kvasir_engine.config import KV_CONNECTORS
    from kvasir_operator import spec_parse

    enum = SCHEMA["properties"]["spec"]["properties"]["disaggregation"]["properties"][
        "connector"]["enum"]
    assert tuple(enum) == spec_parse.KV_CONNECTORS == KV_CONNECTORS


def test_an_unset_role_count_runs_its_floor_in_every_mode() -> None:
    for mode in ("builtin", "external", "none"):
        spec = parse_spec("m", {**SPEC, "autoscaling": {"mode": mode}, "disaggregation": {
            "enabled": True, "decode": {"minReplicas": 2, "maxReplicas": 5}}})
        assert role_spec(spec, "decode").desired_replicas == 2, mode
        assert role_spec(spec, "prefill").desired_replicas == 1, mode


def test_the_capacity_check_judges_each_roles_pods() -> None:
    from kvasir_operator.reconcile import Children, plan

    arch = {"numLayers": 32, "numKVHeads": 8, "headDim": 128}
    # 16 GB of weights, 8192-token sequences (1 GiB each): a 24 GiB GPU holds them; a 16 GiB
    # one does not, unless its role has two of them.
    spec = {"model": {"uri": "s3://models/llama-8b", "sizeBytes": 16 * 10**9,
                      "architecture": arch},
            "engine": {"maxModelLen": 8192}, "resources": {"gpus": 1, "gpuMemoryBytes": 24 << 30},
            "disaggregation": {"enabled": True, "prefill": {"resources": {"gpus": 1}},
                               "decode": {"resources": {"gpus": 1}}}}
    fits = plan(isvc("llm", NS, "uid-1", spec), Children())
    assert fits.status["capacity"]["fits"] is True and fits.apply
    small = {**spec, "resources": {"gpus": 1, "gpuMemoryBytes": 16 << 30},
             "disaggregation": {"enabled": True, "prefill": {"resources": {"gpus": 2}},
                                "decode": {"resources": {"gpus": 1}}}}
    refused = plan(isvc("llm", NS, "uid-1", small), Children())
    assert refused.apply == () and refused.status["capacity"]["fits"] is False
    assert refused.status["capacity"]["message"].startswith("decode: ")
    assert refused.status["capacity"]["gpus"] == 1


@st.composite
def disaggregated_specs(draw: st.DrawFn) -> dict[str, Any]:
    """test_render's specs with one engine process per pod and a drawn disaggregation."""
    raw = draw(specs())
    raw["engine"]["tensorParallelSize"] = 1

    def role() -> dict[str, Any]:
        lo = draw(st.integers(0, 3))
        out: dict[str, Any] = {"minReplicas": lo, "maxReplicas": lo + draw(st.integers(1, 4)),
                               "replicas": draw(st.none() | st.integers(1, 9))}
        if draw(st.booleans()):
            out["resources"] = {"gpus": draw(st.integers(0, 2)), "memory": "32Gi"}
        if draw(st.booleans()):
            out["extraArgs"] = ["--max-num-batched-tokens", "4096"]
        return out

    raw["disaggregation"] = {"enabled": True, "prefill": role(), "decode": role(),
                             "connector": draw(st.sampled_from(["TCPConnector",
                                                                "TorchDistConnector"])),
                             "kvPort": draw(st.integers(1024, 65535).filter(
                                 lambda p: p != labels.HTTP_PORT))}
    return raw


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(raw=disaggregated_specs())
def test_any_disaggregated_spec_renders_two_valid_deployments(raw: dict[str, Any]) -> None:
    assert admit(admitted(raw, name="llm"))[1] == []
    spec = parse_spec(OWNER.name, raw)
    role_to_dep = render_role_deployments(spec, OWNER, None, None)
    version = supported_versions()[-1]
    for role, dep in role_to_dep.items():
        assert errors(dep, version) == []
        bounds, prefill = raw["disaggregation"][role], raw["disaggregation"]["prefill"]
        want = bounds["minReplicas"] if bounds["replicas"] is None else bounds["replicas"]
        is_prefill_running = (prefill["replicas"] or prefill["minReplicas"]) > 0
        floor = bounds["minReplicas"] if role == "prefill" or not is_prefill_running else max(
            1, bounds["minReplicas"])  # builtin autoscaling: decode follows a running prefill
        assert dep["spec"]["replicas"] == max(floor, min(bounds["maxReplicas"], want))
        config = _kv_config(dep)
        assert config["kv_role"] == ("kv_producer" if role == "prefill" else "kv_consumer")
        assert config["kv_connector"] == raw["disaggregation"]["connector"]
        ports = {p["name"]: p["containerPort"] for p in _engine(dep)["ports"]}
        assert ports.get("kv-transfer") == (
            raw["disaggregation"]["kvPort"] if role == "prefill" else None)
    selectors = [d["spec"]["selector"]["matchLabels"] for d in role_to_dep.values()]
    assert selectors[0] != selectors[1]  # no pod is claimed by both roles


def test_the_builtin_autoscaler_keeps_a_decode_replica_while_prefill_runs() -> None:
    both = {"prefill": {"minReplicas": 1, "maxReplicas": 3, "replicas": 2},
            "decode": {"minReplicas": 0, "maxReplicas": 3, "replicas": 0}}
    builtin = {**SPEC, "autoscaling": {"mode": "builtin"},
               "disaggregation": {"enabled": True, **both}}
    assert admit(admitted(builtin))[1] == []  # the autoscaler's own writes are never refused
    decode = role_spec(parse_spec("m", builtin), "decode")
    assert (decode.autoscaling.min_replicas, decode.desired_replicas) == (1, 1)
    idle = {**builtin, "disaggregation": {
        "enabled": True, "prefill": {"minReplicas": 0, "replicas": 0},
        "decode": {"minReplicas": 0, "replicas": 0}}}
    assert role_spec(parse_spec("m", idle), "decode").desired_replicas == 0  # all at zero
