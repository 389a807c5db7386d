"""Pure renderers: spec + owner -> Deployment, Service and PodDisruptionBudget manifests.

Deterministic and I/O-free, so tests can run them over many specs and the reconcile can compare
their output with what it observes. No ConfigMap: every engine setting is a command-line flag
(visible in `kubectl describe pod`), so there is nothing a ConfigMap would hold.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvasir_operator import labels
from kvasir_operator.pod import render_pod_template, startup_budget_seconds
from kvasir_operator.spec import InferenceServiceSpec


@dataclass(frozen=True)
class Owner:
    """The InferenceService that owns the children."""

    name: str
    namespace: str
    uid: str

    @property
    def reference(self) -> dict[str, Any]:
        # controller + blockOwnerDeletion: the garbage collector deletes the children with it.
        return {"apiVersion": labels.API_VERSION, "kind": labels.KIND, "name": self.name,
                "uid": self.uid, "controller": True, "blockOwnerDeletion": True}


def _metadata(owner: Owner) -> dict[str, Any]:
    return {"name": labels.child_name(owner.name), "namespace": owner.namespace,
            "labels": labels.common_labels(owner.name), "ownerReferences": [owner.reference]}


def render_deployment(spec: InferenceServiceSpec, owner: Owner, spec_hash: str,
                      weights_bytes: int | None = None,
                      service_account: str | None = None) -> dict[str, Any]:
    template = render_pod_template(spec, owner.name, spec_hash, weights_bytes, service_account)
    meta = _metadata(owner)
    meta["labels"] = {**meta["labels"], labels.SPEC_HASH: spec_hash}
    return {
        "apiVersion": "apps/v1", "kind": "Deployment", "metadata": meta,
        "spec": {
            "replicas": spec.desired_replicas,
            "selector": {"matchLabels": labels.selector_labels(owner.name)},
            # Surge one pod, never drop below the current count: a rollout never loses capacity
            # (it waits for a spare GPU instead).
            "strategy": {"type": "RollingUpdate",
                         "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}},
            "revisionHistoryLimit": 3,
            # Loading big weights is slow: do not call a rollout stuck before the startup budget.
            "progressDeadlineSeconds": max(600, startup_budget_seconds(spec, weights_bytes) + 600),
            "template": template,
        },
    }


def render_service(spec: InferenceServiceSpec, owner: Owner) -> dict[str, Any]:
    return {
        "apiVersion": "v1", "kind": "Service", "metadata": _metadata(owner),
        "spec": {
            "type": spec.service_type,
            "selector": labels.selector_labels(owner.name),
            "ports": [{"name": labels.HTTP_PORT_NAME, "port": spec.service_port,
                       "targetPort": labels.HTTP_PORT_NAME, "protocol": "TCP"}],
        },
    }


def render_pdb(spec: InferenceServiceSpec, owner: Owner) -> dict[str, Any] | None:
    """None when the spec disables it (the reconcile then deletes an existing one)."""
    d = spec.disruption
    if not d.enabled:
        return None
    budget: dict[str, Any]
    if d.max_unavailable is not None:
        budget = {"maxUnavailable": d.max_unavailable}
    elif d.min_available is not None:
        budget = {"minAvailable": d.min_available}
    else:
        # One voluntary disruption at a time at the floor; at minReplicas <= 1 this is 0, so a
        # single-replica service never blocks a node drain forever.
        budget = {"minAvailable": max(0, spec.autoscaling.min_replicas - 1)}
    return {
        "apiVersion": "policy/v1", "kind": "PodDisruptionBudget", "metadata": _metadata(owner),
        "spec": {"selector": {"matchLabels": labels.selector_labels(owner.name)},
                 "unhealthyPodEvictionPolicy": "AlwaysAllow", **budget},
    }


def service_url(spec: InferenceServiceSpec, owner: Owner) -> str:
    host = f"{labels.child_name(owner.name)}.{owner.namespace}.svc"
    port = "" if spec.service_port == 80 else f":{spec.service_port}"
    return f"http://{host}{port}/v1"
