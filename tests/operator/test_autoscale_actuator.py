"""The actuator against kmock's Kubernetes emulator and fake engine pods, all on 127.0.0.1.

Each test drives `tick` one interval at a time with an injected clock; the pods' /metrics are
real HTTP servers whose values the test changes.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from autoscale_fakes import FakeEngine, engine_pod
from kvasir_operator import k8s
from kvasir_operator.autoscale import loop
from kvasir_operator.autoscale.actuator import DELETION_COST, AutoscalerState, tick
from kvasir_operator.autoscale.decision import Reason
from kvasir_operator.autoscale.scrape import ScrapeSettings
from rbac_table import unlisted

ISVC_KEY = "kvasir.dev/v1alpha1/inferenceservices"
DIRECT = ScrapeSettings(route="direct", timeout_seconds=2.0)
START = 1_700_000_000.0


class Clock:
    def __init__(self) -> None:
        self.now = START

    def __call__(self) -> float:
        return self.now


def isvc_body(autoscaling: dict[str, Any], replicas: int = 1) -> dict[str, Any]:
    return {"apiVersion": "kvasir.dev/v1alpha1", "kind": "InferenceService",
            "metadata": {"name": "m", "namespace": "ns1", "uid": "uid-m"},
            "spec": {"model": {"uri": "s3://bucket/m", "name": "m"}, "replicas": replicas,
                     "autoscaling": autoscaling},
            "status": {"replicas": replicas, "readyReplicas": replicas}}


class Cluster:
    """kmock plus the pods the Deployment would have, driven one tick at a time."""

    def __init__(self, kmock: Any, engines: list[FakeEngine], autoscaling: dict[str, Any]):
        self.kmock, self.engines, self.clock = kmock, engines, Clock()
        self.client = k8s.K8sClient(str(kmock.url))
        self.state = AutoscalerState()
        kmock.resources["v1/events"] = {}
        kmock.resources["v1/pods"] = {}
        kmock.objects[ISVC_KEY, "ns1", "m"] = isvc_body(autoscaling)
        self.sync_pods()

    def isvc(self) -> dict[str, Any]:
        return dict(self.kmock.objects[ISVC_KEY, "ns1", "m"])

    def replicas(self) -> int:
        return int(self.isvc()["spec"]["replicas"])

    def sync_pods(self) -> None:
        """What the reconcile + ReplicaSet would do: one ready pod per replica."""
        for i, fake in enumerate(self.engines):
            key = ("v1/pods", "ns1", f"m-{i}")
            if i < self.replicas():
                if key not in self.kmock.objects:
                    self.kmock.objects[key] = engine_pod(f"m-{i}", "m", fake.port)
            elif key in self.kmock.objects:
                del self.kmock.objects[key]

    async def tick(self, seconds: float = 15.0) -> Reason | None:
        self.state, decision = await tick(self.client, self.isvc(), self.state,
                                          settings=DIRECT, clock=self.clock)
        self.clock.now += seconds
        return None if decision is None else decision.reason

    def events(self) -> list[tuple[str, str]]:
        posted = [r.data for r in list(self.kmock)
                  if r.method == "POST" and r.url.path.endswith("/events")]
        assert all(e["involvedObject"]["uid"] == "uid-m" for e in posted)
        return [(e["type"], e["reason"]) for e in posted]


@pytest.mark.asyncio
async def test_up_on_waiting_down_after_delay_costs_first_events_and_status(
        kmock: Any, engines: list[FakeEngine]) -> None:
    cluster = Cluster(kmock, engines, {"minReplicas": 1, "maxReplicas": 4,
                                       "scaleDownDelaySeconds": 60})
    assert await cluster.tick() is Reason.STABLE
    engines[0].set(waiting=10, running=8, kv=0.9)
    assert await cluster.tick() is Reason.SCALE_UP_LIMITED
    assert cluster.replicas() == 2
    cluster.sync_pods()
    engines[1].set(waiting=2, running=8, kv=0.9)
    assert await cluster.tick() is Reason.SCALE_UP
    assert cluster.replicas() == 4
    cluster.sync_pods()
    assert engines[3].num_scrapes == 0

    # Load falls; the least busy pods must go first, and only after 60 s of lower demand.
    for fake, running in zip(engines, [5, 0, 3, 1], strict=True):
        fake.set(running=running, kv=0.05)
    reasons = [await cluster.tick() for _ in range(4)]
    assert reasons == [Reason.SCALE_DOWN_DELAYED] * 4 and cluster.replicas() == 4
    assert all(DELETION_COST not in (p.get("metadata", {}).get("annotations") or {})
               for p in await cluster.client.list(k8s.PODS, "ns1"))
    assert await cluster.tick() is Reason.SCALE_DOWN
    assert cluster.replicas() == 1

    patches = [r for r in list(kmock) if r.method == "PATCH"]
    scale_at = next(i for i, r in enumerate(patches) if r.url.path.endswith("/scale")
                    and r.data["spec"] == {"replicas": 1})
    cost_patches = {r.url.path.rsplit("/", 1)[-1]: r.data["metadata"]["annotations"]
                    [DELETION_COST] for r in patches[:scale_at] if "/pods/" in r.url.path}
    assert cost_patches == {"m-0": "5", "m-1": "0", "m-2": "3", "m-3": "1"}

    assert cluster.events() == [("Normal", "ScaledUp"), ("Normal", "ScaledUp"),
                                      ("Normal", "ScaledDown")]
    status = cluster.isvc()["status"]
    assert status["replicas"] == 1 and status["readyReplicas"] == 1  # the operator's, untouched
    record = status["autoscaling"]
    assert (record["reason"], record["desiredReplicas"], record["currentReplicas"]) == (
        "ScaleDown", 1, 4)
    assert record["signals"]["podsFresh"] == 4
    assert record["signals"]["kvCacheUsage"]["perPodMean"] == pytest.approx(0.05)
    assert record["history"]["recommendations"][-1]["replicas"] == 1
    assert unlisted(kmock) == set()  # every call is granted by the chart (test_rbac.py)
    await cluster.client.close()


@pytest.mark.asyncio
async def test_a_restart_keeps_the_pending_scale_down_timer(
        kmock: Any, engines: list[FakeEngine]) -> None:
    cluster = Cluster(kmock, engines, {"maxReplicas": 4, "scaleDownDelaySeconds": 60})
    engines[0].set(waiting=6)
    assert await cluster.tick() is Reason.SCALE_UP_LIMITED
    cluster.sync_pods()
    engines[0].set(waiting=2)
    engines[1].set(waiting=2)
    assert await cluster.tick() is Reason.STABLE  # 4 waiting / 2 per replica = 2 replicas
    engines[0].set()
    engines[1].set()
    assert await cluster.tick() is Reason.SCALE_DOWN_DELAYED
    cluster.state = AutoscalerState()  # the operator restarts: memory is gone
    reasons = [await cluster.tick() for _ in range(4)]
    # The recommendation of 2 was made 15 s before the drop; 60 s later it leaves the window.
    assert reasons == [Reason.SCALE_DOWN_DELAYED] * 3 + [Reason.SCALE_DOWN], reasons
    assert cluster.replicas() == 1
    await cluster.client.close()


@pytest.mark.asyncio
async def test_stale_pod_blocks_scale_down_and_unschedulable_pods_limit_scale_up(
        kmock: Any, engines: list[FakeEngine]) -> None:
    cluster = Cluster(kmock, engines, {"maxReplicas": 4, "scaleDownDelaySeconds": 0})
    engines[0].set(waiting=4)
    assert await cluster.tick() is Reason.SCALE_UP
    cluster.sync_pods()
    engines[0].set()
    await engines[1].stop()  # m-1 stops answering /metrics
    reasons = [await cluster.tick() for _ in range(4)]
    # Its last good sample never existed: stale at once, counted saturated, no scale-down.
    assert set(reasons) == {Reason.SCALE_DOWN_BLOCKED} and cluster.replicas() == 2
    assert cluster.isvc()["status"]["autoscaling"]["signals"]["podsStale"] == 1

    await engines[1].start()
    kmock.objects["v1/pods", "ns1", "m-1"] = engine_pod("m-1", "m", engines[1].port)
    kmock.objects["v1/pods", "ns1", "m-2"] = engine_pod("m-2", "m", 0, unschedulable=True)
    engines[0].set(waiting=20)
    assert await cluster.tick() is Reason.INSUFFICIENT_GPU
    assert await cluster.tick() is Reason.INSUFFICIENT_GPU
    assert cluster.replicas() == 2
    events = cluster.events()
    assert events.count(("Warning", "ScalingLimited")) == 1  # once per episode, not per tick
    await cluster.client.close()


@pytest.mark.asyncio
async def test_external_mode_leaves_replicas_alone(kmock: Any, engines: list[FakeEngine]) -> None:
    cluster = Cluster(kmock, engines, {"mode": "external", "maxReplicas": 4})
    engines[0].set(waiting=50)
    assert await cluster.tick() is None
    assert cluster.replicas() == 1 and engines[0].num_scrapes == 0
    assert not [r for r in list(kmock) if r.method in ("PATCH", "POST")]
    await cluster.client.close()


@pytest.mark.asyncio
async def test_metrics_through_the_api_server_pod_proxy(kmock: Any) -> None:
    kmock.objects[ISVC_KEY, "ns1", "m"] = isvc_body({"maxReplicas": 4})
    kmock.objects["v1/pods", "ns1", "m-0"] = engine_pod("m-0", "m", 8000)
    kmock["get /api/v1/namespaces/ns1/pods/m-0:8000/proxy/metrics"] << (
        b'sglang:num_queue_reqs{model_name="m"} 9\nsglang:token_usage{model_name="m"} 0.5\n')
    client = k8s.K8sClient(str(kmock.url))
    state, decision = await tick(client, dict(kmock.objects[ISVC_KEY, "ns1", "m"]),
                                 AutoscalerState(),
                                 settings=ScrapeSettings(route="proxy"), clock=lambda: START)
    assert decision is not None and decision.desired == 2  # 9 waiting / 2 -> 5, x2 limit -> 2
    assert state.window.pod_to_samples["m-0"][-1].num_waiting == 9
    assert unlisted(kmock) == set()  # pods/proxy get is granted by the chart
    await client.close()


@pytest.mark.asyncio
async def test_the_loop_ticks_at_the_spec_interval_and_ends_with_its_object(
        kmock: Any, engines: list[FakeEngine]) -> None:
    cluster = Cluster(kmock, engines, {"maxReplicas": 4, "intervalSeconds": 1})
    engines[0].set(waiting=8)
    task = asyncio.create_task(loop.run_autoscaler(cluster.client, "ns1", "m", DIRECT))
    for _ in range(100):
        if cluster.replicas() == 4:
            break
        cluster.sync_pods()
        await asyncio.sleep(0.1)
    assert cluster.replicas() == 4  # 1 -> 2 -> 4, one decision per second
    del kmock.objects[ISVC_KEY, "ns1", "m"]
    await asyncio.wait_for(task, timeout=5)  # the object is gone: the loop ends by itself
    isvc = isvc_body({"mode": "builtin", "intervalSeconds": 1})
    policy = loop.loop_policy(isvc)
    assert policy is not None and policy.interval_seconds == 1
    off = {**isvc, "spec": {**isvc["spec"], "autoscaling": {"mode": "none"}}}
    broken = {**isvc, "spec": {**isvc["spec"], "model": {}}}
    assert loop.loop_policy(off) is None and loop.loop_policy(broken) is None
    priced = {**off, "spec": {**off["spec"], "cost": {"perHour": 2.5}}}
    assert loop.loop_policy(priced) is not None  # scraped for status.cost, never scaled
    await cluster.client.close()


@pytest.mark.asyncio
async def test_every_scrape_failing_is_said_not_decided_on(kmock: Any,
                                                           engines: list[FakeEngine]) -> None:
    """Issue 35: with every scrape failing the autoscaler said `Stable` with `podsStale: N`, no
    condition, no Event. Now: MetricsUnavailable (holding, no decision on stale data), one
    Warning Event for the episode, and the reconcile's MetricsAvailable condition says so."""
    cluster = Cluster(kmock, engines, {"maxReplicas": 4, "scaleDownDelaySeconds": 0})
    engines[0].set()
    assert await cluster.tick() is Reason.STABLE
    await engines[0].stop()  # the only ready pod stops answering /metrics
    reasons = [await cluster.tick() for _ in range(5)]
    # Its last good sample is trusted for two missed scrapes; then it is stale, and no pod is
    # fresh: the autoscaler holds and says why, at every tick after.
    first = reasons.index(Reason.METRICS_UNAVAILABLE)
    assert set(reasons[:first]) <= {Reason.STABLE} and first <= 2, reasons
    assert set(reasons[first:]) == {Reason.METRICS_UNAVAILABLE} and cluster.replicas() == 1
    autoscaling = cluster.isvc()["status"]["autoscaling"]
    assert autoscaling["reason"] == "MetricsUnavailable"
    assert "no decision on stale data" in autoscaling["message"]
    assert cluster.events().count(("Warning", "MetricsUnavailable")) == 1

    from kvasir_operator.reconcile import Children, plan
    body = cluster.isvc()
    conds = {c["type"]: c for c in plan(body, Children()).status["conditions"]}
    assert conds["MetricsAvailable"]["status"] == "False"
    assert conds["MetricsAvailable"]["reason"] == "MetricsUnavailable"
    await cluster.client.close()


@pytest.mark.asyncio
async def test_an_idle_service_writes_nothing_after_its_first_decision(
        kmock: Any, engines: list[FakeEngine]) -> None:
    """Issue 35: the autoscaler rewrote status.autoscaling (lastDecisionTime, history) every
    minute while nothing changed. Ten minutes of idle ticks now write once, at the first."""
    cluster = Cluster(kmock, engines, {"maxReplicas": 4})
    engines[0].set()
    reasons = [await cluster.tick() for _ in range(40)]  # 40 x 15 s
    assert set(reasons) == {Reason.STABLE}
    writes = [r for r in list(kmock) if r.method in ("PATCH", "POST", "PUT", "DELETE")]
    assert len(writes) == 1 and writes[0].method == "PATCH", [r.url.path for r in writes]
    await cluster.client.close()


@pytest.mark.asyncio
async def test_a_restarted_operator_does_not_rewrite_an_unchanged_decision(
        kmock: Any, engines: list[FakeEngine]) -> None:
    """Issue 35: after a restart the loop's memory is empty; the decision it makes again is
    compared with the one in status.autoscaling, and an unchanged one is not written."""
    cluster = Cluster(kmock, engines, {"maxReplicas": 4})
    engines[0].set()
    assert await cluster.tick() is Reason.STABLE
    before = len(list(kmock))
    cluster.state = AutoscalerState()  # the operator restarts: memory is gone
    reasons = [await cluster.tick() for _ in range(5)]
    assert set(reasons) == {Reason.STABLE}
    writes = [r for r in list(kmock)[before:] if r.method in ("PATCH", "POST", "PUT", "DELETE")]
    assert writes == [], [r.url.path for r in writes]
    await cluster.client.close()
