"""The autoscaler on a pipeline-parallel service counts groups, not pods (kmock, real /metrics).

Each group is a leader (worker-index 0, a real HTTP server with /metrics on 127.0.0.1) and a
worker (worker-index 1, which serves no HTTP: its port is closed). Only leaders are scraped and
count as ready replicas; the CR's replicas (the LeaderWorkerSet's groups) follow their load; a
group whose worker cannot be scheduled counts as one unschedulable replica; and no deletion-cost
annotation is written, since LeaderWorkerSet removes the highest-numbered groups first.
"""

from __future__ import annotations

from typing import Any

import pytest
from autoscale_fakes import FakeEngine, engine_pod
from kvasir_operator import k8s, labels
from kvasir_operator.autoscale.actuator import DELETION_COST, AutoscalerState, tick
from kvasir_operator.autoscale.decision import Reason
from kvasir_operator.autoscale.scrape import ScrapeSettings
from rbac_table import unlisted

ISVC_KEY = "kvasir.dev/v1alpha1/inferenceservices"
DIRECT = ScrapeSettings(route="direct", timeout_seconds=2.0)
START = 1_700_000_000.0


def _pod(group: int, index: int, port: int, **state: bool) -> dict[str, Any]:
    name = f"m-lws-{group}" + (f"-{index}" if index else "")
    pod = engine_pod(name, "m", port, **state)
    pod["metadata"]["labels"].update({labels.LWS_GROUP_INDEX: str(group),
                                      labels.LWS_WORKER_INDEX: str(index)})
    return pod


@pytest.mark.asyncio
async def test_groups_are_scraped_by_their_leader_and_scaled_as_one(
        kmock: Any, engines: list[FakeEngine]) -> None:
    leaders = engines[:3]
    kmock.resources["v1/events"] = {}
    kmock.resources["v1/pods"] = {}
    kmock.objects[ISVC_KEY, "ns1", "m"] = {
        "apiVersion": "kvasir.dev/v1alpha1", "kind": "InferenceService",
        "metadata": {"name": "m", "namespace": "ns1", "uid": "uid-m"},
        "spec": {"model": {"uri": "s3://bucket/m", "name": "m"}, "replicas": 2,
                 "engine": {"pipelineParallelSize": 2},
                 "autoscaling": {"minReplicas": 1, "maxReplicas": 4,
                                 "scaleDownDelaySeconds": 0}}}
    closed = FakeEngine()  # a port nothing listens on: a worker serves no HTTP
    await closed.start()
    worker_port = closed.port
    await closed.stop()
    for group in range(2):
        for index in range(2):
            port = leaders[group].port if index == 0 else worker_port
            kmock.objects["v1/pods", "ns1", f"m-lws-{group}-{index}"] = _pod(group, index, port)
    client = k8s.K8sClient(str(kmock.url))
    now = START

    async def once(state: AutoscalerState) -> tuple[AutoscalerState, Reason | None]:
        nonlocal now
        isvc = dict(kmock.objects[ISVC_KEY, "ns1", "m"])
        state, decision = await tick(client, isvc, state, settings=DIRECT, clock=lambda: now)
        now += 15.0
        return state, None if decision is None else decision.reason

    leaders[0].set(waiting=5)  # 5 waiting over 2 groups, target 2 per group: 3 groups
    state, reason = await once(AutoscalerState())
    assert reason is Reason.SCALE_UP
    assert kmock.objects[ISVC_KEY, "ns1", "m"]["spec"]["replicas"] == 3
    assert sorted(state.window.pod_names) == ["m-lws-0", "m-lws-1"]  # leaders only
    record = kmock.objects[ISVC_KEY, "ns1", "m"]["status"]["autoscaling"]
    assert record["signals"]["podsFresh"] == 2 and record["signals"]["podsStale"] == 0

    # The third group: neither of its pods can be scheduled: one unschedulable replica.
    kmock.objects["v1/pods", "ns1", "m-lws-2-0"] = _pod(2, 0, 0, unschedulable=True)
    kmock.objects["v1/pods", "ns1", "m-lws-2-1"] = _pod(2, 1, 0, unschedulable=True)
    leaders[0].set(waiting=20)
    state, reason = await once(state)
    assert reason is Reason.INSUFFICIENT_GPU
    record = kmock.objects[ISVC_KEY, "ns1", "m"]["status"]["autoscaling"]
    assert record["signals"]["podsUnschedulable"] == 1
    assert kmock.objects[ISVC_KEY, "ns1", "m"]["spec"]["replicas"] == 3

    # Idle: down to the floor, without deletion costs (LWS drops the last groups itself).
    kmock.objects["v1/pods", "ns1", "m-lws-2-0"] = _pod(2, 0, leaders[2].port)
    kmock.objects["v1/pods", "ns1", "m-lws-2-1"] = _pod(2, 1, worker_port)
    leaders[0].set()
    state, reason = await once(state)
    assert reason is Reason.SCALE_DOWN
    assert kmock.objects[ISVC_KEY, "ns1", "m"]["spec"]["replicas"] == 1
    assert not [r for r in list(kmock) if r.method == "PATCH" and "/pods/" in r.url.path]
    assert all(DELETION_COST not in (p["metadata"].get("annotations") or {})
               for p in await client.list(k8s.PODS, "ns1"))
    assert unlisted(kmock) == set()
    await client.close()
