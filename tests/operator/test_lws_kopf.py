"""The operator (kopf.testing.KopfRunner) against kmock with and without the LeaderWorkerSet API.

With it: a pipeline-parallel InferenceService gets a LeaderWorkerSet (owned, no finalizer), no
Deployment, and a Service on the group leaders; the status counts the groups the LWS reports
(the LWS controller's part is played by the test, which writes the LWS's status); going back to
one stage replaces the LWS with a Deployment. Without it: Ready=False with reason
LeaderWorkerSetAPIMissing and a message naming what to install, one Event, nothing created.
Every request the operator sent is in the RBAC table the chart is tested with.
"""

from __future__ import annotations

from typing import Any

import pytest
from kvasir_operator import k8s, labels
from operator_support import isvc, until
from rbac_table import unlisted
from test_operator_kopf import NS, TEST_AGENT, cluster, running_operator  # noqa: F401

ISVCS = "kvasir.dev/v1alpha1/inferenceservices"
LWS_KEY = "leaderworkerset.x-k8s.io/v1/leaderworkersets"
SPEC = {"model": {"uri": "/opt/models/llama", "name": "llama"},
        "engine": {"tensorParallelSize": 2, "pipelineParallelSize": 2},
        "autoscaling": {"minReplicas": 2, "maxReplicas": 4}}


def _serve_lws(kmock: Any) -> None:
    kmock.resources[LWS_KEY] = kmock.ResourceInfo(
        kind="LeaderWorkerSet", namespaced=True, subresources={"status", "scale"},
        verbs={"get", "list", "watch", "patch", "create", "delete"})


async def _status(client: k8s.K8sClient) -> dict[str, Any]:
    obj = await client.get(k8s.INFERENCESERVICES, NS, "llm")
    return dict((obj or {}).get("status") or {})


def _ready(status: dict[str, Any]) -> dict[str, Any]:
    return next((c for c in status.get("conditions") or [] if c["type"] == "Ready"), {})


@pytest.mark.asyncio
async def test_a_pipeline_runs_as_a_leaderworkerset_whose_groups_are_the_replicas(
        cluster: Any) -> None:  # noqa: F811
    kmock, client = cluster
    _serve_lws(kmock)
    kmock.objects[ISVCS, NS, "llm"] = isvc("llm", NS, "uid-1", SPEC)

    async with running_operator():
        lws = await until("the LeaderWorkerSet",
                          lambda: client.get(k8s.LEADERWORKERSETS, NS, "llm-lws"))
        svc = await until("the Service", lambda: client.get(k8s.SERVICES, NS, "llm"))
        assert lws["metadata"]["ownerReferences"][0]["uid"] == "uid-1"
        assert not lws["metadata"].get("finalizers")
        assert lws["spec"]["replicas"] == 2
        assert lws["spec"]["leaderWorkerTemplate"]["size"] == 2
        first_hash = lws["metadata"]["labels"][labels.SPEC_HASH]
        assert svc["spec"]["selector"][labels.LWS_WORKER_INDEX] == "0"
        assert await client.get(k8s.DEPLOYMENTS, NS, "llm") is None

        # The LWS controller reports 2 groups, 1 ready: the status counts groups, not pods.
        await client.patch_merge(k8s.LEADERWORKERSETS, NS, "llm-lws", {"status": {
            "replicas": 2, "readyReplicas": 1, "updatedReplicas": 2}})

        async def counted() -> dict[str, Any] | None:
            st = await _status(client)
            return st if st.get("readyReplicas") == 1 else None

        st = await until("readyReplicas from the LWS", counted)
        assert (st["replicas"], st["desiredReplicas"]) == (2, 2)
        assert st["selector"] == ("kvasir.dev/inferenceservice=llm,"
                                  "leaderworkerset.sigs.k8s.io/worker-index=0")
        assert {c["type"]: c["status"] for c in st["conditions"]}["Available"] == "True"

        # Scaling the CR (what the autoscaler and `kubectl scale` do) scales the groups.
        await client.patch_scale(k8s.INFERENCESERVICES, NS, "llm", 3)

        async def groups(n: int) -> bool:
            obj = await client.get(k8s.LEADERWORKERSETS, NS, "llm-lws")
            return bool(obj and obj["spec"]["replicas"] == n)

        await until("3 groups", lambda: groups(3))

        # A spec change updates both templates (LWS then rolls the groups by its spec hash).
        await client.patch_merge(k8s.INFERENCESERVICES, NS, "llm",
                                 {"spec": {"engine": {"maxModelLen": 8192}}})

        async def rolled() -> dict[str, Any] | None:
            obj = await client.get(k8s.LEADERWORKERSETS, NS, "llm-lws")
            group = (obj or {}).get("spec", {}).get("leaderWorkerTemplate", {})
            args = [group[t]["spec"]["containers"][0]["args"]
                    for t in ("leaderTemplate", "workerTemplate") if t in group]
            return obj if args and all("8192" in a for a in args) else None

        lws = await until("the templates updated", rolled)
        assert lws["metadata"]["labels"][labels.SPEC_HASH] != first_hash

        # Back to one stage: a Deployment, and the LeaderWorkerSet goes.
        await client.patch_merge(k8s.INFERENCESERVICES, NS, "llm",
                                 {"spec": {"engine": {"pipelineParallelSize": 1}}})
        dep = await until("the Deployment", lambda: client.get(k8s.DEPLOYMENTS, NS, "llm"))
        assert dep["spec"]["replicas"] == 3

        async def lws_gone() -> bool:
            return await client.get(k8s.LEADERWORKERSETS, NS, "llm-lws") is None

        await until("the LeaderWorkerSet deleted", lws_gone)
        # What was applied last (kmock merges an apply; a real server's SSA drops the key).
        applied = [r.data for r in list(kmock) if r.method == "PATCH"
                   and r.url.path == "/api/v1/namespaces/ns1/services/llm"]
        assert applied[-1]["spec"]["selector"] == labels.selector_labels("llm")
    requests = [r for r in kmock if r.headers.get("User-Agent") != TEST_AGENT]
    watched = {r.url.path for r in requests if r.params.get("watch") == "true"}
    assert "/apis/leaderworkerset.x-k8s.io/v1/namespaces/ns1/leaderworkersets" in watched
    assert unlisted(requests) == set()


@pytest.mark.asyncio
async def test_without_the_leaderworkerset_api_nothing_is_created_and_ready_says_why(
        cluster: Any) -> None:  # noqa: F811
    kmock, client = cluster
    kmock.objects[ISVCS, NS, "llm"] = isvc("llm", NS, "uid-1", SPEC)

    async def refused() -> dict[str, Any] | None:
        st = await _status(client)
        return st if _ready(st).get("reason") == "LeaderWorkerSetAPIMissing" else None

    async with running_operator():
        st = await until("the refusal", refused)
        ready = _ready(st)
        assert ready["status"] == "False" and st["phase"] == "Failed"
        assert "leaderworkersets.leaderworkerset.x-k8s.io/v1" in ready["message"]
        assert "kubernetes-sigs/lws" in ready["message"]
        # A later reconcile (a touch of the object) posts no second Event.
        await client.patch_merge(k8s.INFERENCESERVICES, NS, "llm",
                                 {"metadata": {"labels": {"touched": "yes"}}})
        await until("a second reconcile", lambda: _touched_and_reconciled(client))
    assert await client.get(k8s.DEPLOYMENTS, NS, "llm") is None
    assert await client.get(k8s.SERVICES, NS, "llm") is None
    assert await client.get(k8s.PDBS, NS, "llm") is None
    events = [e for e in await client.list(k8s.EVENTS, NS)
              if e["reason"] == "LeaderWorkerSetAPIMissing"]
    assert len(events) == 1 and events[0]["type"] == "Warning"
    requests = [r for r in kmock if r.headers.get("User-Agent") != TEST_AGENT]
    assert not [r for r in requests if r.method in ("POST", "PATCH")
                and "/leaderworkersets" in r.url.path]
    assert unlisted(requests) == set()


async def _touched_and_reconciled(client: k8s.K8sClient) -> bool:
    """kopf records the touched labels as handled once on_change (the reconcile) returned."""
    obj = await client.get(k8s.INFERENCESERVICES, NS, "llm") or {}
    handled = (obj["metadata"].get("annotations") or {}).get(
        f"{labels.KOPF_PREFIX}/last-handled-configuration", "")
    return "touched" in handled


