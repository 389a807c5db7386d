"""The informers (issue 35): a running operator reads what it reconciles from watch streams, so a
converged fleet costs no request per object and tick; the caches follow the watch, keep what our
own writes returned over older events, and list again when the server forgets a version."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping
from typing import Any

import kopf
import pytest
from auth_proxy import kubeconfig
from kmock_namespaces import namespaces_served
from kvasir_operator import k8s, labels
from kvasir_operator.informer import CachedClient, Informer
from kvasir_operator.settings import Settings
from operator_support import (
    isvc,
    operator_running,
    serve_operator_cluster,
    serve_operator_resources,
    until,
)

NS = "ns1"
ISVCS = "kvasir.dev/v1alpha1/inferenceservices"
SPEC = {"model": {"uri": "/models/m", "sizeBytes": 1_000_000}, "resources": {"gpus": 1}}
WRITES = ("POST", "PUT", "PATCH", "DELETE")


def _deployment(name: str, version: str, replicas: int) -> dict[str, Any]:
    return {"apiVersion": "apps/v1", "kind": "Deployment",
            "metadata": {"name": name, "namespace": NS, "resourceVersion": version,
                         "labels": labels.common_labels(name)},
            "spec": {"replicas": replicas}}


@pytest.mark.asyncio
async def test_a_running_operator_reads_nothing_per_tick_once_converged(
        kmock: Any, tmp_path: Any) -> None:
    serve_operator_cluster(kmock, (NS,))
    for name in ("a", "b", "c"):
        spec = {**SPEC, "autoscaling": {"mode": "builtin" if name == "c" else "external"}}
        kmock.objects[ISVCS, NS, name] = isvc(name, NS, f"uid-{name}", spec)
    config = kubeconfig(tmp_path / "kubeconfig", str(kmock.url), {})
    settings = Settings(kubeconfig=str(config), reconcile_interval_seconds=0.2)
    with pytest.MonkeyPatch.context() as mp, namespaces_served(mp):
        async with operator_running(settings, memo=kopf.Memo()):
            for name in ("a", "b", "c"):
                await until(f"{name}'s Deployment", lambda n=name: _exists(kmock, n))
            await asyncio.sleep(1.0)  # the status settles on what was created
            settled = len(list(kmock))
            await asyncio.sleep(2.0)  # ten resync periods of three objects, the autoscaler's ticks
            quiet = list(kmock)[settled:]
    writes = [f"{r.method} {r.url.path}" for r in quiet if r.method in WRITES]
    reads = [f"{r.method} {r.url.path}" for r in quiet
             if r.method == "GET" and r.params.get("watch") != "true"]
    assert writes == []
    assert reads == []  # every reconcile and tick read its caches


async def _exists(kmock: Any, name: str) -> bool:
    key = ("apps/v1/deployments", NS, name)
    return any(k == key for k in kmock.objects)


class _ScriptedServer:
    """list_versioned/watch as a server that forgets the first list's version (410 Gone)."""

    def __init__(self) -> None:
        self.lists = 0
        self.forever = asyncio.Event()

    async def list_versioned(self, res: k8s.Resource, namespace: str | None, **_: Any
                             ) -> tuple[list[dict[str, Any]], str]:
        self.lists += 1
        return [_deployment("m", "10" if self.lists == 1 else "20", self.lists)], "30"

    async def watch(self, res: k8s.Resource, namespace: str | None, **_: Any
                    ) -> AsyncIterator[Mapping[str, Any]]:
        if self.lists == 1:  # K8sClient.watch raises a stream's error event, as lightkube does
            raise k8s.ApiError(410, "Expired", "too old")
        yield {"type": "MODIFIED", "object": _deployment("m", "25", 5)}
        yield {"type": "BOOKMARK", "object": {"metadata": {"resourceVersion": "26"}}}
        await self.forever.wait()


@pytest.mark.asyncio
async def test_an_expired_watch_lists_again_and_a_newer_write_wins() -> None:
    server = _ScriptedServer()
    informer = Informer(server, k8s.DEPLOYMENTS, NS)  # type: ignore[arg-type]
    informer.start()
    try:
        await until("the relist and the event",
                    lambda: _true((informer.get(NS, "m") or {}).get("spec") == {"replicas": 5}))
        assert server.lists == 2
        # What our own write returned (version 40) is kept over a late event of version 25 ...
        informer.note(_deployment("m", "40", 7))
        informer.note(_deployment("m", "25", 5))
        assert informer.get(NS, "m")["spec"]["replicas"] == 7  # type: ignore[index]
        # ... and an object that no longer matches the informer's selector leaves it.
        stray = _deployment("m", "41", 7)
        informer.label_selector = {labels.MANAGED_BY: labels.OPERATOR}
        stray["metadata"]["labels"] = {}
        informer.note(stray)
        assert informer.get(NS, "m") is None
    finally:
        await informer.stop()


async def _true(value: bool) -> bool:
    return value


@pytest.mark.asyncio
async def test_reads_a_cache_covers_cost_no_request_and_others_go_to_the_server(
        kmock: Any) -> None:
    serve_operator_resources(kmock)
    async with k8s.K8sClient(str(kmock.url)) as writer:
        await writer.apply(_deployment("m", "", 1))
        await writer.apply({**_deployment("other", "", 1),
                            "metadata": {"name": "other", "namespace": NS}})  # not ours
    async with CachedClient(str(kmock.url)) as client:
        assert (await client.get(k8s.DEPLOYMENTS, NS, "m") or {})["spec"] == {"replicas": 1}
        before = _requests(kmock)
        mine = await client.list(k8s.DEPLOYMENTS, NS, label_selector={
            labels.MANAGED_BY: labels.OPERATOR, labels.INFERENCESERVICE: "m"})
        assert [d["metadata"]["name"] for d in mine] == ["m"]
        assert await client.get(k8s.DEPLOYMENTS, NS, "other") is None  # outside the cache
        assert _requests(kmock) == before  # all three answered from the cache
        # A selector the cache does not cover (not the managed label) goes to the server.
        every = await client.list(k8s.DEPLOYMENTS, NS)
        assert {d["metadata"]["name"] for d in every} == {"m", "other"}
        assert _requests(kmock) == before + 1
        # Our write is in the cache at once; the watch brings someone else's.
        await client.patch_merge(k8s.DEPLOYMENTS, NS, "m", {"spec": {"replicas": 3}})
        assert (await client.get(k8s.DEPLOYMENTS, NS, "m") or {})["spec"] == {"replicas": 3}
        async with k8s.K8sClient(str(kmock.url)) as writer:
            await writer.delete(k8s.DEPLOYMENTS, NS, "m")
        await until("the deletion seen", lambda: _gone(client))


def _requests(kmock: Any) -> int:
    """Requests other than the informers' long-lived watch streams."""
    return sum(1 for r in list(kmock) if r.params.get("watch") != "true")


async def _gone(client: CachedClient) -> bool:
    return await client.get(k8s.DEPLOYMENTS, NS, "m") is None


@pytest.mark.asyncio
async def test_concurrent_reconciles_share_one_discovery_request(kmock: Any) -> None:
    """After a restart every object's reconcile asks whether LeaderWorkerSet is served at
    once: one request answers them all, and the answer is kept for a minute."""
    serve_operator_resources(kmock)
    async with CachedClient(str(kmock.url)) as client:
        answers = await asyncio.gather(*(client.is_served(k8s.LEADERWORKERSETS)
                                         for _ in range(20)))
        assert await client.is_served(k8s.LEADERWORKERSETS) is False
    assert answers == [False] * 20
    asked = [r for r in list(kmock) if r.url.path == "/apis/leaderworkerset.x-k8s.io/v1"]
    assert len(asked) == 1


@pytest.mark.asyncio
async def test_cluster_wide_one_informer_per_resource_serves_every_namespace(
        kmock: Any) -> None:
    """`--all-namespaces`: one LIST and one WATCH per resource, whatever the number of
    namespaces; each read is narrowed to its namespace."""
    serve_operator_resources(kmock)
    async with k8s.K8sClient(str(kmock.url)) as writer:
        for namespace, replicas in (("ns1", 1), ("ns2", 2), ("ns3", 3)):
            dep = _deployment("m", "", replicas)
            dep["metadata"]["namespace"] = namespace
            await writer.apply(dep)
    async with CachedClient(str(kmock.url), cluster_wide=True) as client:
        for namespace, replicas in (("ns1", 1), ("ns2", 2), ("ns3", 3)):
            got = await client.get(k8s.DEPLOYMENTS, namespace, "m")
            assert got is not None and got["spec"] == {"replicas": replicas}
            listed = await client.list(k8s.DEPLOYMENTS, namespace, label_selector={
                labels.MANAGED_BY: labels.OPERATOR})
            assert [d["metadata"]["namespace"] for d in listed] == [namespace]
        assert await client.get(k8s.DEPLOYMENTS, "ns4", "m") is None
        await client.patch_merge(k8s.DEPLOYMENTS, "ns2", "m", {"spec": {"replicas": 5}})
        assert (await client.get(k8s.DEPLOYMENTS, "ns2", "m") or {})["spec"] == {"replicas": 5}
        assert (await client.get(k8s.DEPLOYMENTS, "ns1", "m") or {})["spec"] == {"replicas": 1}
        assert [(i.res, i.namespace) for i in client.informers()] == [(k8s.DEPLOYMENTS, None)]
    lists = [r for r in list(kmock) if r.method == "GET" and r.params.get("watch") != "true"
             and r.url.path.endswith("/deployments")]
    assert [r.url.path for r in lists] == ["/apis/apps/v1/deployments"]
