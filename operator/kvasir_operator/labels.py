"""Label, annotation and name conventions shared by the operator, the autoscaler and the fetcher.

`kvasir.dev/inferenceservice` is THE pod selector: it never changes for the life of an
InferenceService, so Deployments keep their (immutable) selector while the spec-hash label on the
pod template rolls pods on spec changes.
"""

from __future__ import annotations

GROUP = "kvasir.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "InferenceService"
PLURAL = "inferenceservices"

NAME = "app.kubernetes.io/name"
INSTANCE = "app.kubernetes.io/instance"
MANAGED_BY = "app.kubernetes.io/managed-by"
COMPONENT = "app.kubernetes.io/component"
INFERENCESERVICE = f"{GROUP}/inferenceservice"
SPEC_HASH = f"{GROUP}/spec-hash"
# On every child: a digest of its rendered form as last applied (reconcile.is_applied).
APPLIED_HASH = f"{GROUP}/applied-hash"
# On a disaggregated service's Deployments and pods: "prefill" or "decode" (disaggregation.py);
# with the InferenceService label, the selector of one role's Deployment.
ROLE = f"{GROUP}/role"
# On the workload: the model URI it was created for (spec.model.uri is immutable).
MODEL_URI = f"{GROUP}/model-uri"

ENGINE_APP = "kvasir-engine"
OPERATOR = "kvasir-operator"

FETCH_PROGRESS = f"{GROUP}/fetch-progress"
KOPF_PREFIX = f"operator.{GROUP}"  # kopf's finalizer / progress / last-handled annotations

# The engine pods' ServiceAccount, created per namespace by the chart (get/patch pods: the
# fetcher's progress annotation); used only where it exists.
ENGINE_SERVICE_ACCOUNT = "kvasir-engine"

# LeaderWorkerSet (kubernetes-sigs/lws): one replica of a multi-node service is a group of pods,
# node rank 0 (the leader) serving HTTP. The LWS controller labels every pod of a group with
# its group index and its index in the group; the leader's is "0".
LWS_GROUP = "leaderworkerset.x-k8s.io"
LWS_VERSION = "v1"
LWS_API_VERSION = f"{LWS_GROUP}/{LWS_VERSION}"
LWS_GROUP_INDEX = "leaderworkerset.sigs.k8s.io/group-index"
LWS_WORKER_INDEX = "leaderworkerset.sigs.k8s.io/worker-index"
LEADER_INDEX = "0"
# The oldest LWS release that works: the first whose controller puts LWS_WORKER_INDEX (the
# engine's --node-rank, pod.py) in every container; older ones leave `$(LWS_WORKER_INDEX)`
# unexpanded and every worker fails to start. Chart.yaml and docs/operator.md state it too.
LWS_MIN_RELEASE = "v0.6.0"

ENGINE_CONTAINER = "engine"
FETCH_CONTAINER = "kvasir-fetch"
HTTP_PORT_NAME = "http"
HTTP_PORT = 8000
KV_PORT_NAME = "kv-transfer"  # a KV producer's block server (disaggregation.py)
POD_IP_ENV = "POD_IP"  # the pod's address, from the downward API, in a KV producer's engine


def selector_labels(isvc_name: str) -> dict[str, str]:
    """The pod selector of an InferenceService's Deployment, Service and PDB."""
    return {INFERENCESERVICE: isvc_name}


def role_selector_labels(isvc_name: str, role: str | None) -> dict[str, str]:
    """The selector of one role's Deployment (every pod of the service without a role)."""
    return {**selector_labels(isvc_name), **({ROLE: role} if role else {})}


def role_of(pod_labels: dict[str, str]) -> str | None:
    return pod_labels.get(ROLE)


def managed_pod_labels(isvc_name: str) -> dict[str, str]:
    """An InferenceService's pods as the operator lists them: its informer watches every pod
    the operator manages (informer.py), and this narrows that cache to one service."""
    return {MANAGED_BY: OPERATOR, **selector_labels(isvc_name)}


def serving_selector_labels(isvc_name: str, is_multi_node: bool) -> dict[str, str]:
    """The pods that serve HTTP, one per replica: every pod, or only the group leaders."""
    leader = {LWS_WORKER_INDEX: LEADER_INDEX} if is_multi_node else {}
    return {**selector_labels(isvc_name), **leader}


def is_serving_pod(pod_labels: dict[str, str], is_multi_node: bool) -> bool:
    return not is_multi_node or pod_labels.get(LWS_WORKER_INDEX) == LEADER_INDEX


def replica_of(pod_name: str, pod_labels: dict[str, str], is_multi_node: bool) -> str:
    """Which replica a pod belongs to: itself, or its LeaderWorkerSet group."""
    return pod_labels.get(LWS_GROUP_INDEX, pod_name) if is_multi_node else pod_name


def selector_string(isvc_name: str, is_multi_node: bool = False) -> str:
    """The serving pods' selector as a string, as published in status.selector for the scale
    subresource: an HPA then counts one pod per replica (a group's leader)."""
    return ",".join(f"{k}={v}" for k, v in sorted(
        serving_selector_labels(isvc_name, is_multi_node).items()))


def common_labels(isvc_name: str) -> dict[str, str]:
    """Labels put on every child object and on pods."""
    return {
        NAME: ENGINE_APP,
        INSTANCE: isvc_name,
        MANAGED_BY: OPERATOR,
        INFERENCESERVICE: isvc_name,
    }


def pod_labels(isvc_name: str, spec_hash: str, role: str | None = None) -> dict[str, str]:
    return {**common_labels(isvc_name), SPEC_HASH: spec_hash, **({ROLE: role} if role else {})}


def child_name(isvc_name: str) -> str:
    """Deployment, Service, PDB and ConfigMap share the InferenceService's name."""
    return isvc_name


def role_workload_name(isvc_name: str, role: str) -> str:
    """A disaggregated role's Deployment: NAME-prefill, NAME-decode."""
    return f"{isvc_name}-{role}"


def group_set_name(isvc_name: str) -> str:
    """The LeaderWorkerSet's name: not the InferenceService's, because the LWS controller
    creates a headless Service of its own name (the pods' DNS subdomain) next to ours."""
    return f"{isvc_name}-lws"
