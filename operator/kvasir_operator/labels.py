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

ENGINE_APP = "kvasir-engine"
OPERATOR = "kvasir-operator"

FETCH_PROGRESS = f"{GROUP}/fetch-progress"
KOPF_PREFIX = f"operator.{GROUP}"  # kopf's finalizer / progress / last-handled annotations

# The engine pods' ServiceAccount, created per namespace by the chart (get/patch pods: the
# fetcher's progress annotation); used only where it exists.
ENGINE_SERVICE_ACCOUNT = "kvasir-engine"

ENGINE_CONTAINER = "engine"
FETCH_CONTAINER = "kvasir-fetch"
HTTP_PORT_NAME = "http"
HTTP_PORT = 8000


def selector_labels(isvc_name: str) -> dict[str, str]:
    """The pod selector of an InferenceService's Deployment, Service and PDB."""
    return {INFERENCESERVICE: isvc_name}


def selector_string(isvc_name: str) -> str:
    """The selector as a string, as published in status.selector for the scale subresource."""
    return ",".join(f"{k}={v}" for k, v in sorted(selector_labels(isvc_name).items()))


def common_labels(isvc_name: str) -> dict[str, str]:
    """Labels put on every child object and on pods."""
    return {
        NAME: ENGINE_APP,
        INSTANCE: isvc_name,
        MANAGED_BY: OPERATOR,
        INFERENCESERVICE: isvc_name,
    }


def pod_labels(isvc_name: str, spec_hash: str) -> dict[str, str]:
    return {**common_labels(isvc_name), SPEC_HASH: spec_hash}


def child_name(isvc_name: str) -> str:
    """Deployment, Service, PDB and ConfigMap share the InferenceService's name."""
    return isvc_name
