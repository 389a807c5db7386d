"""`status.cost`: cost per million output tokens, measured from the pods' token counters and at
full load from the declared capacity; pure functions first, then the tick against kmock and real
HTTP /metrics servers on 127.0.0.1, then the engine's own /metrics page."""

from __future__ import annotations

from typing import Any

import pytest
from autoscale_fakes import FakeEngine, engine_pod
from kvasir_operator import k8s
from kvasir_operator.autoscale.actuator import AutoscalerState, tick
from kvasir_operator.autoscale.cost import (
    cost_status,
    holds_a_node,
    per_million,
    pod_tokens_per_second,
    tokens_per_second,
)
from kvasir_operator.autoscale.scrape import ScrapeSettings
from kvasir_operator.autoscale.signals import PodSample, parse_metrics
from kvasir_operator.spec import CostSpec

ISVC_KEY = "kvasir.dev/v1alpha1/inferenceservices"
START = 1_700_000_000.0


def sample(t: float, tokens: float | None) -> PodSample:
    return PodSample(pod_name="p", timestamp=START + t, generation_tokens=tokens)


def test_the_formula_is_the_seed_s() -> None:
    # $2/h at 1000 tokens/s: 2 / 3.6e6 tokens x 1e6 = $0.5556 per million
    assert per_million(2.0, 1000.0) == pytest.approx(0.5556, abs=1e-4)
    # an idle card costs ten times more per token than a busy one: 100 vs 1000 tokens/s
    assert per_million(2.0, 100.0) == pytest.approx(10 * per_million(2.0, 1000.0))


def test_a_pod_rate_counts_a_reset_from_zero_and_needs_two_samples() -> None:
    assert pod_tokens_per_second([sample(0, 100)]) is None
    assert pod_tokens_per_second([sample(0, None), sample(15, 100)]) is None
    assert pod_tokens_per_second([sample(0, 100), sample(0.5, 200)]) is None  # too close
    assert pod_tokens_per_second([sample(0, 100), sample(15, 400), sample(30, 700)]) == (600, 30)
    # the engine restarted between 15 s and 30 s: 50 tokens since its start, not -350
    assert pod_tokens_per_second([sample(0, 100), sample(15, 400), sample(30, 50)]) == (350, 30)


def test_the_service_rate_sums_its_pods() -> None:
    assert tokens_per_second({}) is None
    assert tokens_per_second({"a": [sample(0, 0)]}) is None
    rate = tokens_per_second({"a": [sample(0, 0), sample(10, 1000)],
                              "b": [sample(0, 500), sample(20, 2500)],
                              "c": [sample(0, 7)]})
    assert rate == pytest.approx(100 + 100)


def test_the_record_measured_full_load_idle_and_unpriced() -> None:
    assert cost_status(CostSpec(), num_paid_replicas=2, measured_tokens_per_second=10,
                       now=START) is None
    priced = CostSpec(per_hour=3.6, currency="EUR", full_load_tokens_per_second=2000)
    busy = cost_status(priced, num_paid_replicas=2, measured_tokens_per_second=500, now=START)
    assert busy is not None
    assert busy["perMillionOutputTokens"] == pytest.approx(4.0)  # 7.2/h over 1.8e6 tokens/h
    assert busy["perMillionOutputTokensAtFullLoad"] == pytest.approx(0.5)
    assert busy["currency"] == "EUR" and busy["paidReplicas"] == 2 and busy["idle"] is False
    assert busy["outputTokensPerSecond"] == 500 and busy["measuredAt"].endswith("Z")
    idle = cost_status(priced, num_paid_replicas=1, measured_tokens_per_second=0, now=START)
    assert idle is not None and idle["idle"] is True and "perMillionOutputTokens" not in idle
    first = cost_status(CostSpec(per_hour=1.0), num_paid_replicas=1,
                        measured_tokens_per_second=None, now=START)
    assert first is not None and "outputTokensPerSecond" not in first
    assert "idle" not in first and "perMillionOutputTokensAtFullLoad" not in first


def test_only_pods_on_a_node_and_not_leaving_are_paid() -> None:
    assert holds_a_node(engine_pod("a", "m", 1))
    assert not holds_a_node(engine_pod("b", "m", 1, unschedulable=True))
    leaving = engine_pod("c", "m", 1)
    leaving["metadata"]["deletionTimestamp"] = "2026-12-03T00:00:00Z"
    assert not holds_a_node(leaving)


def test_the_engine_s_own_metrics_page_gives_the_counter() -> None:
    from kvasir_engine.frontend.metrics import EngineMetrics

    metrics = EngineMetrics("m", max_model_len=64, max_num_seqs=4)
    metrics.vllm.generation_tokens.inc(42)
    page = metrics.render().decode()
    parsed = parse_metrics(page, pod_name="p", timestamp=START, model_name="m")
    assert parsed.error is None and parsed.generation_tokens == 42


def isvc(autoscaling: dict[str, Any], cost: dict[str, Any] | None) -> dict[str, Any]:
    spec: dict[str, Any] = {"model": {"uri": "s3://bucket/m", "name": "m"}, "replicas": 2,
                            "autoscaling": autoscaling}
    if cost is not None:
        spec["cost"] = cost
    return {"apiVersion": "kvasir.dev/v1alpha1", "kind": "InferenceService",
            "metadata": {"name": "m", "namespace": "ns1", "uid": "uid-m"}, "spec": spec,
            "status": {"replicas": 2, "readyReplicas": 2}}


async def run_ticks(kmock: Any, body: dict[str, Any], engines: list[FakeEngine],
                    per_tick_tokens: list[float]) -> list[dict[str, Any]]:
    """Tick every 15 s, each engine's counter growing by its share; the status.cost patches."""
    kmock.resources["v1/events"] = {}
    kmock.resources["v1/pods"] = {}
    kmock.objects[ISVC_KEY, "ns1", "m"] = body
    for i, fake in enumerate(engines):
        kmock.objects["v1/pods", "ns1", f"m-{i}"] = engine_pod(f"m-{i}", "m", fake.port)
    client = k8s.K8sClient(str(kmock.url))
    state = AutoscalerState()
    try:
        for i, tokens in enumerate(per_tick_tokens):
            for fake in engines:
                fake.generation_tokens += tokens
            state, _ = await tick(client, dict(kmock.objects[ISVC_KEY, "ns1", "m"]), state,
                                  settings=ScrapeSettings(route="direct", timeout_seconds=2.0),
                                  clock=lambda at=START + 15.0 * i: at)
    finally:
        await client.close()
    return [r.data["status"]["cost"] for r in list(kmock)
            if r.method == "PATCH" and "cost" in (r.data.get("status") or {})]


@pytest.mark.asyncio
async def test_a_priced_service_in_external_mode_gets_status_cost_and_is_not_scaled(
        kmock: Any, engines: list[FakeEngine]) -> None:
    two = engines[:2]
    cost = {"perHour": 7.2, "fullLoadTokensPerSecond": 400}
    # 0 s: first sample (written); 15 s: 300 tokens per pod = 20 tokens/s each (written: the
    # first rate); 30-60 s: nothing due; 75 s: the heartbeat, 60 s after the last write
    patches = await run_ticks(kmock, isvc({"mode": "external"}, cost), two,
                              [0, 300, 300, 300, 0, 0])
    first, measured, heartbeat = patches[0], patches[1], patches[2]
    assert "outputTokensPerSecond" not in first  # one sample: no rate yet
    assert measured["outputTokensPerSecond"] == pytest.approx(40)
    # 2 replicas x 7.2/h = 14.4/h over 40 tokens/s x 3600 = 144000 tokens/h -> 100 per million
    assert measured["perMillionOutputTokens"] == pytest.approx(100)
    assert measured["perMillionOutputTokensAtFullLoad"] == pytest.approx(5)
    assert measured["paidReplicas"] == 2
    # at 75 s: 900 tokens per pod over 75 s = 12 tokens/s each
    assert heartbeat["outputTokensPerSecond"] == pytest.approx(24)
    assert len(patches) == 3
    assert kmock.objects[ISVC_KEY, "ns1", "m"]["spec"]["replicas"] == 2  # external: not scaled


@pytest.mark.asyncio
async def test_an_unpriced_service_writes_no_cost(kmock: Any, engines: list[FakeEngine]) -> None:
    assert await run_ticks(kmock, isvc({"mode": "builtin", "maxReplicas": 4}, None),
                           engines[:2], [0, 10]) == []


@pytest.mark.asyncio
async def test_a_builtin_service_gets_both_records(kmock: Any, engines: list[FakeEngine]) -> None:
    patches = await run_ticks(kmock, isvc({"mode": "builtin", "maxReplicas": 4},
                                          {"perHour": 1.0}), engines[:2], [0, 150])
    assert patches[-1]["outputTokensPerSecond"] == pytest.approx(20)
    autoscaling = kmock.objects[ISVC_KEY, "ns1", "m"]["status"]
    assert "autoscaling" in autoscaling and "cost" in autoscaling


def test_the_reconcile_never_clears_the_cost_record() -> None:
    from kvasir_operator.reconcile import _status_patch

    old = {"phase": "Ready", "cost": {"perHour": 1.0}, "autoscaling": {"reason": "x"}}
    assert _status_patch(old, {"phase": "Ready"}) is None
    assert _status_patch(old, {"phase": "Degraded"}) == {"phase": "Degraded"}
