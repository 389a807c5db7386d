"""The builtin autoscaler over a disaggregated service (issue 33): each role decided on its own
signal and bounds, its count written to spec.disaggregation.<role>.replicas and its record to
status.autoscaling.roles.<role>; against kmock and fake engine pods on 127.0.0.1."""

from __future__ import annotations

from typing import Any

import pytest
from autoscale_fakes import FakeEngine, Load, engine_pod, long_history, window_of
from kvasir_operator import labels
from kvasir_operator.autoscale.actuator import AutoscalerState, tick
from kvasir_operator.autoscale.decision import Reason, decide
from kvasir_operator.autoscale.scrape import ScrapeSettings
from kvasir_operator.disaggregation import role_spec
from kvasir_operator.spec_parse import parse_spec
from rbac_table import unlisted

ISVCS = "kvasir.dev/v1alpha1/inferenceservices"
DIRECT = ScrapeSettings(route="direct", timeout_seconds=2.0)
START = 1_700_000_000.0
SPEC: dict[str, Any] = {
    "model": {"uri": "s3://bucket/m", "name": "m"},
    "autoscaling": {"scaleDownDelaySeconds": 60, "targetRequestsWaiting": 2,
                    "targetKVCacheUsage": 0.8},
    "disaggregation": {"enabled": True,
                       "prefill": {"minReplicas": 1, "maxReplicas": 4, "replicas": 1},
                       "decode": {"minReplicas": 1, "maxReplicas": 3, "replicas": 1,
                                  "targetKVCacheUsage": 0.5}}}


def test_each_role_scales_on_its_own_signal() -> None:
    spec = parse_spec("m", SPEC)
    prefill, decode = (role_spec(spec, r).autoscaling for r in ("prefill", "decode"))
    assert (prefill.role, decode.role, decode.target_kv_cache_usage) == ("prefill", "decode", 0.5)
    now = 1_000_000.0
    queued = window_of(now, {"p0": Load(waiting=6, kv=0.0)})  # prompts queue, cache empty
    full = window_of(now, {"p0": Load(waiting=0, running=30, kv=0.9)})  # cache full, no queue
    up = decide(prefill, 1, queued, 0, long_history(now, prefill), now)
    assert (up.reason, up.desired) == (Reason.SCALE_UP_LIMITED, 2)
    assert [r.signal.value for r in up.signals.readings] == ["waiting"]
    # A decode pool with a long queue of prompts but room in its cache: no scale-up.
    assert decide(decode, 1, queued, 0, long_history(now, decode), now).desired == 1
    up = decide(decode, 1, full, 0, long_history(now, decode), now)
    assert up.desired == 2 and [r.signal.value for r in up.signals.readings] == ["kvCacheUsage"]
    # A prefill pool whose producers hold blocks (a full cache) but queue nothing: no scale-up.
    assert decide(prefill, 1, full, 0, long_history(now, prefill), now).desired == 1
    # targetRequests adds running requests to a role's signals.
    with_running = parse_spec("m", {**SPEC, "disaggregation": {
        **SPEC["disaggregation"], "decode": {"maxReplicas": 3, "targetRequests": 10}}})
    policy = role_spec(with_running, "decode").autoscaling
    assert decide(policy, 1, full, 0, long_history(now, policy), now).desired == 2


def _pod(name: str, role: str, port: int) -> dict[str, Any]:
    pod = engine_pod(name, "m", port)
    pod["metadata"]["labels"] = {**pod["metadata"]["labels"], labels.ROLE: role}
    return pod


@pytest.mark.asyncio
async def test_a_tick_scales_prefill_on_its_queue_and_leaves_decode(
        kmock: Any, engines: list[FakeEngine]) -> None:
    kmock.resources["v1/events"] = {}
    kmock.resources["v1/pods"] = {}
    kmock.objects[ISVCS, "ns1", "m"] = {
        "apiVersion": "kvasir.dev/v1alpha1", "kind": "InferenceService",
        "metadata": {"name": "m", "namespace": "ns1", "uid": "uid-m"}, "spec": SPEC,
        "status": {"autoscaling": {"reason": "Stable", "message": "from before"}}}
    kmock.objects["v1/pods", "ns1", "m-prefill-0"] = _pod("m-prefill-0", "prefill",
                                                          engines[0].port)
    kmock.objects["v1/pods", "ns1", "m-decode-0"] = _pod("m-decode-0", "decode", engines[1].port)
    engines[0].set(waiting=8, kv=0.9)  # a producer's queue, and blocks held for consumers
    engines[1].set(waiting=8, running=4, kv=0.2)  # a consumer with room in its cache

    from kvasir_operator import k8s

    async with k8s.K8sClient(str(kmock.url)) as client:
        state, _ = await tick(client, dict(kmock.objects[ISVCS, "ns1", "m"]), AutoscalerState(),
                              settings=DIRECT, clock=lambda: START)
        isvc = dict(kmock.objects[ISVCS, "ns1", "m"])
        roles = isvc["spec"]["disaggregation"]
        assert (roles["prefill"]["replicas"], roles["decode"]["replicas"]) == (2, 1)
        assert "replicas" not in isvc["spec"]  # the scale subresource's count is untouched
        record = isvc["status"]["autoscaling"]
        assert "reason" not in record  # the single-pool record is cleared
        assert record["roles"]["prefill"]["reason"] == "ScaleUpLimited"
        assert record["roles"]["decode"]["reason"] == "Stable"
        assert record["roles"]["decode"]["signals"]["podsFresh"] == 1
        assert set(state.role_to_state) == {"prefill", "decode"}
        posted = [r.data for r in list(kmock)
                  if r.method == "POST" and r.url.path.endswith("/events")]
        assert [(e["reason"], e["message"].split(":")[0]) for e in posted] == [
            ("ScaledUp", "prefill")]

        # The next tick, the queue drained while the new producer starts: no count is written.
        engines[0].set(waiting=2, kv=0.9)
        before = len(list(kmock))
        state, _ = await tick(client, isvc, state, settings=DIRECT, clock=lambda: START + 15)
        writes = [r for r in list(kmock)[before:] if r.method in ("PATCH", "POST")]
        assert all("/scale" not in r.url.path for r in writes)
        assert not any(r.data.get("spec") for r in writes if r.method == "PATCH")
    assert unlisted(kmock) == set()  # every call is granted by the chart (test_rbac.py)
