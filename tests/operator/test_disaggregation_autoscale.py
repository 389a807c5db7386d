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
from kvasir_operator.autoscale.signals import PodSample, parse_metrics
from kvasir_operator.autoscale.window import SampleWindow
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

        # Steady: the same load a tick later writes nothing at all.
        isvc = dict(kmock.objects[ISVCS, "ns1", "m"])
        state, _ = await tick(client, isvc, state, settings=DIRECT, clock=lambda: START + 30)
        before = len(list(kmock))
        state, _ = await tick(client, dict(kmock.objects[ISVCS, "ns1", "m"]), state,
                              settings=DIRECT, clock=lambda: START + 45)
        assert [r for r in list(kmock)[before:] if r.method in ("PATCH", "POST")] == []
    assert unlisted(kmock) == set()  # every call is granted by the chart (test_rbac.py)


def _ttft(pod: str, at: float, total: float, count: float) -> PodSample:
    return PodSample(pod, at, num_waiting=0, num_running=0, kv_cache_usage=0.1,
                     ttft_sum=total, ttft_count=count)


def test_prefill_scales_on_its_time_to_first_token_when_targeted() -> None:
    prefill = {"maxReplicas": 6, "replicas": 2, "targetTimeToFirstTokenSeconds": 0.5}
    spec = parse_spec("m", {**SPEC, "disaggregation": {**SPEC["disaggregation"],
                                                       "prefill": prefill}})
    policy = role_spec(spec, "prefill").autoscaling
    now = 1_000_000.0
    # Over the last 30 s: pod a 10 first tokens in 20 s (2 s each), pod b 10 in 5 s (0.5 s);
    # pod c restarted (its count went down): its new counters are the growth, 4 s over 8.
    window = SampleWindow().record(
        [_ttft("a", now - 30, 100, 50), _ttft("a", now, 120, 60),
         _ttft("b", now - 30, 0, 0), _ttft("b", now, 5, 10),
         _ttft("c", now - 30, 500, 90), _ttft("c", now, 4, 8)],
        ready_pod_names=["a", "b", "c"], now=now, horizon_seconds=1e9)
    assert window.mean_time_to_first_token("a", now=now, span_seconds=60) == pytest.approx(2.0)
    assert window.mean_time_to_first_token("c", now=now, span_seconds=60) == pytest.approx(0.5)
    assert window.mean_time_to_first_token("a", now=now, span_seconds=10) == 0.0  # one sample
    decision = decide(policy, 3, window, 0, long_history(now, policy), now)
    ttft = next(r for r in decision.signals.readings if r.signal.value == "timeToFirstToken")
    assert ttft.pool_total == pytest.approx(3.0) and ttft.replicas_needed == pytest.approx(6.0)
    assert (decision.reason, decision.desired) == (Reason.SCALE_UP, 6)
    # Without the target, time to first token is no signal: an empty queue, a scale-down.
    plain = role_spec(parse_spec("m", SPEC), "prefill").autoscaling
    down = decide(plain, 3, window, 0, long_history(now, plain), now)
    assert [r.signal.value for r in down.signals.readings] == ["waiting"]
    assert (down.reason, down.desired) == (Reason.SCALE_DOWN, 1)


def test_the_time_to_first_token_histogram_is_read() -> None:
    text = ('# TYPE vllm:time_to_first_token_seconds histogram\n'
            'vllm:time_to_first_token_seconds_bucket{model_name="m",le="+Inf"} 7\n'
            'vllm:time_to_first_token_seconds_sum{model_name="m"} 3.5\n'
            'vllm:time_to_first_token_seconds_count{model_name="m"} 7\n'
            'vllm:time_to_first_token_seconds_sum{model_name="other"} 100\n'
            'vllm:time_to_first_token_seconds_count{model_name="other"} 1\n')
    sample = parse_metrics(text, pod_name="p", timestamp=1.0, model_name="m")
    assert (sample.ttft_sum, sample.ttft_count, sample.error) == (3.5, 7, None)
