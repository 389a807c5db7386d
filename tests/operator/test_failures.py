"""Every failure ends in status and one Event, retries back off, and deletion needs no operator.

Against kmock on 127.0.0.1. kmock answers a Deployment apply with the API server's 422, as a real
server does for a spec that passed the CRD's schema but not the Deployment's validation: the
Service and PDB are still applied, the status says Ready=False / InvalidSpec with the server's
message, one Event is posted however often the reconcile is retried, and the retries' delays grow
exponentially up to the cap. With the operator stopped, an InferenceService is deleted at once:
kopf put no finalizer on it (and removes the one older versions put).
"""

from __future__ import annotations

import logging
import re
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
from auth_proxy import kubeconfig
from kmock_namespaces import namespaces_served
from kvasir_operator import k8s, labels
from kvasir_operator.reconcile import reconcile
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
SPEC = {"model": {"uri": "/models/m"}, "resources": {"gpus": 0},
        "autoscaling": {"minReplicas": 2, "maxReplicas": 2}}
REFUSAL = ('Deployment.apps "bad" is invalid: spec.template.spec.containers[0].resources'
           '.limits[memory]: Invalid value: "lots": quantities must match the regular expression')


def refuse_deployments(kmock: Any, name: str) -> None:
    status = {"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "Invalid",
              "message": REFUSAL, "code": 422}
    kmock[f"patch /apis/apps/v1/namespaces/{NS}/deployments/{name}"] << 422 << status
    kmock[f"post /apis/apps/v1/namespaces/{NS}/deployments"] << 422 << status


def _ready(obj: dict[str, Any]) -> dict[str, Any]:
    return next(c for c in obj["status"]["conditions"] if c["type"] == "Ready")


async def _events(client: k8s.K8sClient, reason: str) -> list[dict[str, Any]]:
    return [e for e in await client.list(k8s.EVENTS, NS) if e["reason"] == reason]


@pytest.mark.asyncio
async def test_a_refused_child_leaves_the_others_applied_and_explains_itself_once(
        kmock: Any) -> None:
    serve_operator_resources(kmock)
    refuse_deployments(kmock, "bad")
    kmock.objects[ISVCS, NS, "bad"] = isvc("bad", NS, "uid-bad", SPEC)
    async with k8s.K8sClient(str(kmock.url)) as client:
        for attempt in range(3):
            body = await client.get(k8s.INFERENCESERVICES, NS, "bad")
            assert body is not None
            done = await reconcile(client, body)
            assert [(f[0], f[1]) for f in done.failures] == [("Deployment bad", 422)]
            warnings = [e for e in done.events if e[0] == "Warning"]
            assert warnings == ([("Warning", "InvalidSpec", f"Deployment bad: {REFUSAL}")]
                                if attempt == 0 else [])
        # The other children were applied although the Deployment was refused.
        assert await client.get(k8s.SERVICES, NS, "bad") is not None
        assert await client.get(k8s.PDBS, NS, "bad") is not None
        obj = await client.get(k8s.INFERENCESERVICES, NS, "bad")
        assert obj is not None
        ready = _ready(obj)
        assert (ready["status"], ready["reason"]) == ("False", "InvalidSpec")
        assert REFUSAL in ready["message"] and ready["observedGeneration"] == 1
        assert obj["status"]["phase"] == "Failed" and obj["status"]["reason"] == "InvalidSpec"
        assert [e["message"] for e in await _events(client, "InvalidSpec")] == [
            f"Deployment bad: {REFUSAL}"]
        created = [e["message"] for e in await _events(client, "Created")]
        assert created == ["created Service bad"]  # nothing claims the Deployment was created
        # A new generation that still fails explains itself once more.
        await client.patch_merge(k8s.INFERENCESERVICES, NS, "bad", {"metadata": {"generation": 2}})
        body = await client.get(k8s.INFERENCESERVICES, NS, "bad")
        assert body is not None
        assert [e[1] for e in (await reconcile(client, body)).events] == ["InvalidSpec"]
        assert len(await _events(client, "InvalidSpec")) == 2


def test_retry_delays_double_up_to_the_cap() -> None:
    settings = Settings(retry_base_seconds=5, retry_max_seconds=300)
    assert [settings.retry_delay(n) for n in range(9)] == [5, 10, 20, 40, 80, 160, 300, 300, 300]
    assert settings.retry_delay(10_000) == 300


@pytest_asyncio.fixture
async def cluster(kmock: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                  ) -> AsyncIterator[tuple[k8s.K8sClient, Path]]:
    serve_operator_cluster(kmock, (NS,))
    config = kubeconfig(tmp_path / "kubeconfig", str(kmock.url), {})
    with namespaces_served(monkeypatch):
        async with k8s.K8sClient(str(kmock.url), user_agent="kvasir-tests") as client:
            yield client, config


@pytest.mark.asyncio
async def test_the_operator_backs_off_and_posts_one_event(
        kmock: Any, cluster: tuple[k8s.K8sClient, Path], caplog: pytest.LogCaptureFixture
        ) -> None:
    client, config = cluster
    refuse_deployments(kmock, "bad")
    kmock.objects[ISVCS, NS, "bad"] = isvc("bad", NS, "uid-bad", SPEC)
    settings = Settings(kubeconfig=str(config), retry_base_seconds=0.2, retry_max_seconds=0.8)
    caplog.set_level(logging.WARNING)

    def delays() -> list[float]:
        return [float(m) for r in caplog.records
                for m in re.findall(r"could not apply Deployment bad; retry in ([0-9.]+) s",
                                    r.getMessage())]

    async with operator_running(settings):
        await until("retries at the cap", lambda: _true(delays().count(0.8) >= 2), timeout=20)
    seen = delays()
    # kmock does not bump resourceVersion, so kopf may run a retry on a body that predates its
    # own progress patch and repeat a delay; the delays still only grow, by doubling, to the cap.
    assert seen == sorted(seen) and sorted(set(seen)) == [0.2, 0.4, 0.8]
    assert len(await _events(client, "InvalidSpec")) == 1
    obj = await client.get(k8s.INFERENCESERVICES, NS, "bad")
    assert obj is not None and _ready(obj)["reason"] == "InvalidSpec"
    assert await client.get(k8s.SERVICES, NS, "bad") is not None


async def _true(value: bool) -> bool:
    return value


@pytest.mark.asyncio
async def test_deletion_needs_no_operator_and_old_finalizers_are_removed(
        kmock: Any, cluster: tuple[k8s.K8sClient, Path]) -> None:
    client, config = cluster
    kmock.objects[ISVCS, NS, "a"] = isvc("a", NS, "uid-a", SPEC)
    old = isvc("legacy", NS, "uid-legacy", SPEC)
    old["metadata"]["finalizers"] = [f"{labels.KOPF_PREFIX}/kopf-finalizer"]  # older versions'
    kmock.objects[ISVCS, NS, "legacy"] = old

    async def finalizers(name: str) -> list[str] | None:
        obj = await client.get(k8s.INFERENCESERVICES, NS, name)
        return None if obj is None else list(obj["metadata"].get("finalizers") or [])

    async with operator_running(Settings(kubeconfig=str(config))):
        await until("a's Deployment", lambda: client.get(k8s.DEPLOYMENTS, NS, "a"))
        await until("the old finalizer removed", lambda: _true(
            _is_empty_list(kmock.objects[ISVCS, NS, "legacy"])))
        assert await finalizers("a") == []
    # The operator is stopped: deleting does not wait for anything.
    assert await client.delete(k8s.INFERENCESERVICES, NS, "a")
    assert await client.delete(k8s.INFERENCESERVICES, NS, "legacy")
    assert await client.get(k8s.INFERENCESERVICES, NS, "a") is None
    assert await client.get(k8s.INFERENCESERVICES, NS, "legacy") is None
    # The children go with the garbage collector, through their controller owner reference.
    dep = await client.get(k8s.DEPLOYMENTS, NS, "a")
    assert dep is not None and dep["metadata"]["ownerReferences"][0]["uid"] == "uid-a"
    assert dep["metadata"]["ownerReferences"][0]["controller"] is True


def _is_empty_list(obj: Any) -> bool:
    return not (obj.get("metadata") or {}).get("finalizers")


@pytest.mark.asyncio
async def test_object_loops_repair_drift_and_stop_when_the_object_goes(
        kmock: Any, cluster: tuple[k8s.K8sClient, Path]) -> None:
    import kopf

    client, config = cluster
    kmock.objects[ISVCS, NS, "a"] = isvc("a", NS, "uid-a", SPEC)
    memo = kopf.Memo()
    settings = Settings(kubeconfig=str(config), reconcile_interval_seconds=0.3)
    async with operator_running(settings, memo=memo):
        await until("a's Deployment", lambda: client.get(k8s.DEPLOYMENTS, NS, "a"))
        assert await until("both loops", lambda: _true(
            memo.loops.running("uid-a") == {"resync", "autoscale"}))
        # Drift no watch handler reacts to (the replica counts did not move): the periodic
        # reconcile puts the label back.
        await client.patch_merge(k8s.DEPLOYMENTS, NS, "a",
                                 {"metadata": {"labels": {labels.SPEC_HASH: "tampered"}}})

        async def repaired() -> bool:
            dep = await client.get(k8s.DEPLOYMENTS, NS, "a")
            return bool(dep and dep["metadata"]["labels"][labels.SPEC_HASH] != "tampered")

        await until("the periodic reconcile", repaired, timeout=10)
        await client.patch_merge(k8s.INFERENCESERVICES, NS, "a",
                                 {"spec": {"autoscaling": {"mode": "none"}}})
        await until("the autoscaler stopped", lambda: _true(
            memo.loops.running("uid-a") == {"resync"}))
        assert await client.delete(k8s.INFERENCESERVICES, NS, "a")
        await until("no loops left", lambda: _true(memo.loops.running("uid-a") == set()))
