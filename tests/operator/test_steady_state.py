"""Quiet in steady state (issue 35): once an InferenceService has converged, reconciling it
again writes nothing — no apply of an unchanged child (a server-side apply of one still bumps
its resourceVersion), no status patch, no Event — while a change is still written at once,
including a field that is no longer rendered and a child edited by someone else."""

from __future__ import annotations

from typing import Any

import pytest
from kvasir_operator import k8s
from operator_support import isvc, reconcile_named, serve_operator_resources, writes

NS = "ns1"
ISVCS = "kvasir.dev/v1alpha1/inferenceservices"
SPEC = {"model": {"uri": "/models/m", "sizeBytes": 1_000_000},
        "resources": {"gpus": 1}, "autoscaling": {"mode": "external"}}


async def _reconcile(client: k8s.K8sClient) -> None:
    await reconcile_named(client, NS, "m")


@pytest.mark.asyncio
async def test_a_converged_service_is_reconciled_without_a_write(kmock: Any) -> None:
    serve_operator_resources(kmock)
    kmock.objects[ISVCS, NS, "m"] = isvc("m", NS, "uid-m", SPEC)
    async with k8s.K8sClient(str(kmock.url)) as client:
        for _ in range(2):  # create, then settle the status on what was created
            await _reconcile(client)
        settled = len(list(kmock))
        for _ in range(5):  # five periodic reconciles of an unchanged service
            await _reconcile(client)
        assert writes(kmock, settled) == []

        # A change is written at once: a new replica count rolls into the Deployment.
        await client.patch_merge(k8s.INFERENCESERVICES, NS, "m",
                                 {"spec": {"replicas": 2}, "metadata": {"generation": 2}})
        before = len(list(kmock))
        await _reconcile(client)
        assert any("/deployments/m" in w for w in writes(kmock, before))

        # Someone scales the Deployment by hand: the drift is applied back.
        await client.patch_merge(k8s.DEPLOYMENTS, NS, "m", {"spec": {"replicas": 7}})
        before = len(list(kmock))
        await _reconcile(client)
        assert any("/deployments/m" in w for w in writes(kmock, before))
        dep = await client.get(k8s.DEPLOYMENTS, NS, "m")
        assert dep is not None and dep["spec"]["replicas"] == 2


@pytest.mark.asyncio
async def test_model_uri_is_held_immutable_where_cel_is_not_run(kmock: Any) -> None:
    """API servers older than 1.25 skip the CRD's transition rule; the operator refuses."""
    serve_operator_resources(kmock)
    kmock.objects[ISVCS, NS, "m"] = isvc("m", NS, "uid-m", SPEC)
    async with k8s.K8sClient(str(kmock.url)) as client:
        await _reconcile(client)
        await client.patch_merge(k8s.INFERENCESERVICES, NS, "m", {
            "spec": {"model": {"uri": "/models/other"}}, "metadata": {"generation": 2}})
        before = len(list(kmock))
        await _reconcile(client)
        assert not any("/deployments/" in w for w in writes(kmock, before))
        obj = await client.get(k8s.INFERENCESERVICES, NS, "m")
        assert obj is not None
        ready = next(c for c in obj["status"]["conditions"] if c["type"] == "Ready")
        assert ready["reason"] == "InvalidSpec" and "model.uri is immutable" in ready["message"]
