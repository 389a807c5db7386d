"""The operator's own metrics (kvasir_operator_*), as its handlers feed them: each reconcile by
result with the replicas its status derives, failures by reason, and the series of an
InferenceService dropped with it. The operator dashboard's queries run against these series
in tests/gateway/test_dashboards.py."""

from __future__ import annotations

from typing import Any

import kopf
import pytest
from kvasir_operator import handlers, k8s
from kvasir_operator.metrics import OperatorMetrics
from kvasir_operator.settings import Settings
from operator_support import isvc, serve_operator_resources
from prometheus_client import generate_latest

NS = "ns1"
ISVCS = "kvasir.dev/v1alpha1/inferenceservices"


def _sample(metrics: OperatorMetrics, name: str, **labels: str) -> float | None:
    return metrics.registry.get_sample_value(name, {"namespace": NS, **labels})


@pytest.mark.asyncio
async def test_the_handlers_feed_the_operator_metrics(kmock: Any) -> None:
    serve_operator_resources(kmock)
    kmock.objects[ISVCS, NS, "m"] = isvc("m", NS, "uid-m", {
        "model": {"uri": "/models/m", "sizeBytes": 10**6}, "resources": {"gpus": 1},
        "replicas": 2, "autoscaling": {"mode": "external"}})
    kmock.objects[ISVCS, NS, "bad"] = isvc("bad", NS, "uid-bad", {
        "model": {"uri": "/models/m"}, "engine": {"quantization": "int8"},
        "resources": {"gpus": 1}})
    metrics = OperatorMetrics()
    async with k8s.K8sClient(str(kmock.url)) as client:
        memo = kopf.Memo(settings=Settings(), k8s=client, locks={}, metrics=metrics)
        for name in ("m", "bad"):
            body = await client.get(k8s.INFERENCESERVICES, NS, name)
            assert body is not None
            await handlers._reconcile(memo, body)  # noqa: SLF001
    assert _sample(metrics, "kvasir_operator_reconciles_total", inferenceservice="m",
                   result="ok") == 1
    assert _sample(metrics, "kvasir_operator_desired_replicas", inferenceservice="m") == 2
    assert _sample(metrics, "kvasir_operator_ready_replicas", inferenceservice="m") == 0
    assert _sample(metrics, "kvasir_operator_reconciles_total", inferenceservice="bad",
                   result="invalid") == 1
    assert _sample(metrics, "kvasir_operator_reconcile_errors_total", inferenceservice="bad",
                   reason="InvalidSpec") == 1
    metrics.observe_decision(NS, "m", "Stable")
    assert _sample(metrics, "kvasir_operator_scale_decisions_total", inferenceservice="m",
                   reason="Stable") == 1
    metrics.forget(NS, "m")
    assert _sample(metrics, "kvasir_operator_desired_replicas", inferenceservice="m") is None
    assert b"kvasir_operator_reconciles_total" in generate_latest(metrics.registry)
