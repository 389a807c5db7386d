"""reconcile() against kmock with the model read from moto S3: status.capacity comes from the
source's config.json and weight sizes, a model that cannot fit is refused before any GPU is
spent (CapacityFits=False with the arithmetic, nothing rendered), and the startup probe budget
follows the same size."""

from __future__ import annotations

import math
from typing import Any

import pytest
from kvasir_operator import k8s
from kvasir_operator.capacity import GIB
from kvasir_operator.modelprobe import ModelProbe
from kvasir_operator.reconcile import reconcile
from operator_support import SHARDS, isvc, llama_files, secret, serve_operator_resources

NS = "ns1"
ISVCS = "kvasir.dev/v1alpha1/inferenceservices"
WEIGHTS = sum(SHARDS.values())
KV_PER_TOKEN = 2 * 32 * 8 * 128 * 2


def _conditions(obj: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["type"]: c for c in obj["status"]["conditions"]}


@pytest.mark.asyncio
async def test_capacity_from_source_refuses_then_fits(kmock: Any, aws_env: None, upload: Any,
                                                      moto_endpoint: str) -> None:
    serve_operator_resources(kmock)
    uri = upload(llama_files())
    kmock.objects["v1/secrets", NS, "creds"] = secret("creds", NS, {
        "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing"})
    # No sizeBytes, no architecture in the spec: both can only come from the source.
    spec = {"model": {"uri": uri, "credentialsSecret": "creds"},
            "fetch": {"endpointUrl": moto_endpoint},
            "engine": {"maxModelLen": 8192},
            "resources": {"gpus": 1, "gpuMemoryBytes": 64 << 20},
            "startup": {"loadBytesPerSecond": 10_000, "overheadSeconds": 100}}
    kmock.objects[ISVCS, NS, "big"] = isvc("big", NS, "uid-big", spec)
    probe = ModelProbe(timeout_seconds=10)
    async with k8s.K8sClient(str(kmock.url)) as client:
        body = await client.get(k8s.INFERENCESERVICES, NS, "big")
        assert body is not None
        await reconcile(client, body, probe)
        obj = await client.get(k8s.INFERENCESERVICES, NS, "big")
        assert obj is not None
        cap, conds = obj["status"]["capacity"], _conditions(obj)
        usable = int((64 << 20) * 0.9)
        assert cap["weightsBytes"] == WEIGHTS and cap["kvBytesPerToken"] == KV_PER_TOKEN
        assert cap["usableBytes"] == usable and cap["inputsFrom"] == "source"
        assert cap["sequencesFit"] == 0 and cap["fits"] is False
        assert conds["ModelInspected"]["reason"] == "ReadFromSource"
        fits = conds["CapacityFits"]
        assert (fits["status"], fits["reason"]) == ("False", "InsufficientGPUMemory")
        assert f"{KV_PER_TOKEN} B x 8192 tokens = 1.00 GiB per sequence) = 0 sequences" in (
            fits["message"])
        assert "2 x 32 layers x 8 KV heads x 128 head dim x 2 B" in fits["message"]
        assert obj["status"]["phase"] == "Failed"
        assert await client.get(k8s.DEPLOYMENTS, NS, "big") is None  # no GPU spent
        events = await client.list(k8s.EVENTS, NS)
        assert [e["reason"] for e in events] == ["InsufficientGPUMemory"]

        # Two GiB per GPU: one full-length sequence fits, the Deployment is rendered, and the
        # startup budget is ceil(weights / 10 kB/s) + 100 s from the source's size.
        await client.patch_merge(k8s.INFERENCESERVICES, NS, "big", {
            "metadata": {"generation": 2}, "spec": {"resources": {"gpuMemoryBytes": 2 * GIB}}})
        body = await client.get(k8s.INFERENCESERVICES, NS, "big")
        assert body is not None
        await reconcile(client, body, probe)
        obj = await client.get(k8s.INFERENCESERVICES, NS, "big")
        assert obj is not None
        cap = obj["status"]["capacity"]
        assert cap["sequencesFit"] == (int(2 * GIB * 0.9) - WEIGHTS) // (KV_PER_TOKEN * 8192)
        assert cap["sequencesFit"] == 1 and _conditions(obj)["CapacityFits"]["status"] == "True"
        dep = await client.get(k8s.DEPLOYMENTS, NS, "big")
        assert dep is not None
        engine = dep["spec"]["template"]["spec"]["containers"][0]
        budget = math.ceil(WEIGHTS / 10_000) + 100
        assert engine["startupProbe"]["failureThreshold"] == math.ceil(budget / 10)
    assert probe.reads == 2  # one per generation
