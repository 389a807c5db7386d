"""Pure renderers: spec + owner -> Deployment (or LeaderWorkerSet), Service and PDB manifests.

Deterministic and I/O-free, so tests can run them over many specs and the reconcile can compare
their output with what it observes. No ConfigMap: every engine setting is a command-line flag
(visible in `kubectl describe pod`), so there is nothing a ConfigMap would hold.

A pipeline-parallel spec (`engine.pipelineParallelSize` > 1) spans several pods per replica; it
renders a LeaderWorkerSet (kubernetes-sigs/lws, the API KServe's LLMInferenceService and llm-d
use) instead of the Deployment: one group per replica, `size` pods per group (one per stage),
the leader and worker templates from the one pod renderer, and the Service on the leaders only.

A disaggregated spec (`spec.disaggregation`, disaggregation.py) renders one Deployment per role
(`NAME-prefill`, `NAME-decode`), each from its role spec, selected and labelled by
`kvasir.dev/role`; the Service and the PDB select both.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvasir_operator import labels
from kvasir_operator.disaggregation import role_specs
from kvasir_operator.pod import render_pod_template, startup_budget_seconds
from kvasir_operator.spec import InferenceServiceSpec, spec_hash


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
                      service_account: str | None = None,
                      role: str | None = None) -> dict[str, Any]:
    """`role`: a disaggregated role's Deployment (`spec` is then its role spec)."""
    template = render_pod_template(spec, owner.name, spec_hash, weights_bytes, service_account,
                                   role=role)
    meta = _workload_metadata(owner, spec, spec_hash)
    if role is not None:
        meta["name"] = labels.role_workload_name(owner.name, role)
        meta["labels"][labels.ROLE] = role
    return {
        "apiVersion": "apps/v1", "kind": "Deployment", "metadata": meta,
        "spec": {
            "replicas": spec.desired_replicas,
            "selector": {"matchLabels": labels.role_selector_labels(owner.name, role)},
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


def render_leaderworkerset(spec: InferenceServiceSpec, owner: Owner, spec_hash: str,
                           weights_bytes: int | None = None,
                           service_account: str | None = None) -> dict[str, Any]:
    """One group per replica; the leader (node rank 0) serves HTTP, the workers run the other
    stages. Any pod or container restart recreates the whole group, since a pipeline missing a
    stage cannot generate and its torch.distributed group cannot take a rank back."""
    def template(is_worker: bool) -> dict[str, Any]:
        return render_pod_template(spec, owner.name, spec_hash, weights_bytes, service_account,
                                   is_worker=is_worker)

    meta = _workload_metadata(owner, spec, spec_hash)
    meta["name"] = labels.group_set_name(owner.name)
    return {
        "apiVersion": labels.LWS_API_VERSION, "kind": "LeaderWorkerSet", "metadata": meta,
        "spec": {
            "replicas": spec.desired_replicas,
            "startupPolicy": "LeaderCreated",  # workers start with the leader: ranks meet sooner
            # As the Deployment: surge one group, never drop below the current count.
            "rolloutStrategy": {"type": "RollingUpdate", "rollingUpdateConfiguration": {
                "maxSurge": 1, "maxUnavailable": 0}},
            "leaderWorkerTemplate": {
                "size": spec.num_nodes,
                "restartPolicy": "RecreateGroupOnPodRestart",
                "leaderTemplate": template(is_worker=False),
                "workerTemplate": template(is_worker=True),
            },
        },
    }


def render_workload(spec: InferenceServiceSpec, owner: Owner, spec_hash: str,
                    weights_bytes: int | None = None,
                    service_account: str | None = None) -> dict[str, Any]:
    """The Deployment, or the LeaderWorkerSet when one replica spans several pods."""
    render = render_leaderworkerset if spec.is_multi_node else render_deployment
    return render(spec, owner, spec_hash, weights_bytes, service_account)


def render_role_deployments(spec: InferenceServiceSpec, owner: Owner,
                            weights_bytes: int | None = None,
                            service_account: str | None = None) -> dict[str, dict[str, Any]]:
    """Role -> its Deployment, each with its own spec hash (a change to one role's resources
    rolls that role only); empty unless disaggregated."""
    return {role: render_deployment(rspec, owner, spec_hash(rspec), weights_bytes,
                                    service_account, role=role)
            for role, rspec in role_specs(spec).items()}


def _workload_metadata(owner: Owner, spec: InferenceServiceSpec,
                       spec_hash: str) -> dict[str, Any]:
    """A workload's metadata: its spec hash, and the model URI it serves (which the reconcile
    holds spec.model.uri to)."""
    meta = _metadata(owner)
    meta["labels"] = {**meta["labels"], labels.SPEC_HASH: spec_hash}
    meta["annotations"] = {labels.MODEL_URI: spec.model.uri}
    return meta


def render_service(spec: InferenceServiceSpec, owner: Owner) -> dict[str, Any]:
    return {
        "apiVersion": "v1", "kind": "Service", "metadata": _metadata(owner),
        "spec": {
            "type": spec.service_type,
            "selector": labels.serving_selector_labels(owner.name, spec.is_multi_node),
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
    elif spec.is_multi_node or spec.disaggregation is not None:
        # The budget counts pods, and evicting any pod of a group takes the whole group down:
        # one pod at a time is one group at a time, whatever the number of groups. Over two
        # roles' pods, one at a time too (no one floor counts both pools).
        budget = {"maxUnavailable": 1}
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
