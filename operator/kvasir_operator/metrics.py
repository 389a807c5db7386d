"""The operator's own Prometheus metrics (`kvasir_operator_*`), for its Grafana dashboard.

Per InferenceService (labels `namespace`, `inferenceservice`): the replicas it wants and has
ready (from the status each reconcile derives), the reconciles by result and their failures by
reason, and the builtin autoscaler's decisions by reason (`ScaleUp`, `Stable`,
`MetricsUnavailable`, ... as in `status.autoscaling.reason`). Served on `--metrics-port` by
prometheus_client's own HTTP server, beside kopf's liveness endpoint. The handlers feed it; the
reconcile and the autoscaler's decision stay free of it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server

LABELS = ("namespace", "inferenceservice")


class OperatorMetrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.desired_replicas = Gauge("kvasir_operator_desired_replicas",
                                      "Replicas the InferenceService asks for", LABELS,
                                      registry=r)
        self.ready_replicas = Gauge("kvasir_operator_ready_replicas",
                                    "Replicas ready to generate", LABELS, registry=r)
        self.reconciles = Counter("kvasir_operator_reconciles",
                                  "Reconciles by result (ok, failed: a child or the status "
                                  "could not be written, invalid: the spec is refused)",
                                  (*LABELS, "result"), registry=r)
        self.reconcile_errors = Counter("kvasir_operator_reconcile_errors",
                                        "Failed reconciles by reason (ApplyFailed, "
                                        "InvalidSpec, ApiError)", (*LABELS, "reason"),
                                        registry=r)
        self.scale_decisions = Counter("kvasir_operator_scale_decisions",
                                       "The builtin autoscaler's decisions by reason",
                                       (*LABELS, "reason"), registry=r)

    def observe_reconcile(self, namespace: str | None, name: str,
                          status: Mapping[str, Any] | None,
                          failures: Sequence[tuple[str, int, str]],
                          spec_error: str | None) -> None:
        """One executed reconcile: its status (whose reason, for a failure, is the one the
        status module decided: InvalidSpec or ApplyFailed) and what failed."""
        key = (namespace or "", name)
        status = status or {}
        if status:
            self.desired_replicas.labels(*key).set(int(status.get("desiredReplicas") or 0))
            self.ready_replicas.labels(*key).set(int(status.get("readyReplicas") or 0))
        result = "invalid" if spec_error is not None else "failed" if failures else "ok"
        self.reconciles.labels(*key, result).inc()
        if result != "ok":
            self.reconcile_errors.labels(*key, str(status.get("reason") or "InvalidSpec")).inc()

    def observe_api_error(self, namespace: str | None, name: str) -> None:
        """A reconcile that could not observe or write the status at all."""
        self.reconciles.labels(namespace or "", name, "failed").inc()
        self.reconcile_errors.labels(namespace or "", name, "ApiError").inc()

    def observe_decision(self, namespace: str | None, name: str, reason: str) -> None:
        self.scale_decisions.labels(namespace or "", name, reason).inc()

    def forget(self, namespace: str | None, name: str) -> None:
        """The InferenceService is gone: its gauges leave with it."""
        for gauge in (self.desired_replicas, self.ready_replicas):
            try:
                gauge.remove(namespace or "", name)
            except KeyError:
                pass

    def serve(self, port: int, addr: str = "0.0.0.0") -> WSGIServer:  # noqa: S104 - a pod's port
        """/metrics on its own thread; the server, so that a caller can shut it down."""
        server, _thread = start_http_server(port, addr=addr, registry=self.registry)
        return server
