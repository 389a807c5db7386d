"""The Kubernetes API calls the operator makes, as RBAC (apiGroup, resource, verb) triples.

One table, checked from both sides: the chart test asserts the chart grants every entry (and
nothing with a wildcard); the KopfRunner test asserts every request the running operator sent
to kmock maps to an entry (so a new call without a grant fails a test).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

# Where each is used, by module.
_USES: dict[tuple[str, str], set[str]] = {
    # kopf: list/watch the CR, patch its annotations (progress, diff base) and finalizer;
    # handlers._reconcile_owner, handlers._resync and autoscale.loop: get.
    ("kvasir.dev", "inferenceservices"): {"get", "list", "watch", "patch"},
    ("kvasir.dev", "inferenceservices/status"): {"patch"},  # reconcile, autoscale.actuator
    ("kvasir.dev", "inferenceservices/scale"): {"patch"},  # autoscale.actuator
    # informer.py (list, watch), k8s.apply (PATCH apply, which creates), kopf on.event watches of the children; the PDB is deleted when the spec disables it, and
    # the workload of the other kind when engine.pipelineParallelSize moves across 1.
    ("apps", "deployments"): {"get", "list", "watch", "create", "patch", "delete"},
    ("leaderworkerset.x-k8s.io", "leaderworkersets"): {"get", "list", "watch", "create",
                                                        "patch", "delete"},
    ("", "services"): {"get", "list", "watch", "create", "patch"},
    ("policy", "poddisruptionbudgets"): {"get", "list", "watch", "create", "patch", "delete"},
    # informer.py lists and watches the pods, the pod-scheduling Events and the engine's
    # ServiceAccount (by name) that reconcile.observe and autoscale.actuator read; the actuator
    # patches pod-deletion-cost annotations; autoscale.scrape reads /metrics through the pod proxy.
    ("", "pods"): {"list", "watch", "patch"},
    ("", "pods/proxy"): {"get"},
    ("", "events"): {"list", "watch", "create"},  # the informer; our Events and kopf's
    ("", "serviceaccounts"): {"list", "watch"},  # the informer: does the engine SA exist here?
    ("", "secrets"): {"get"},  # modelprobe: spec.model.credentialsSecret, by name only
    # kopf's discovery: namespaces to serve `--namespace` (cluster-scoped), CRDs.
    ("", "namespaces"): {"list", "watch"},
    ("apiextensions.k8s.io", "customresourcedefinitions"): {"list", "watch"},
}
OPERATOR_RULES = frozenset((g, r, v) for (g, r), verbs in _USES.items() for v in verbs)
CLUSTER_SCOPED = frozenset({("", "namespaces"),
                            ("apiextensions.k8s.io", "customresourcedefinitions")})
# The engine pods' ServiceAccount: the fetch initContainer patches its own pod's progress
# annotation (the kubernetes client reads it back in the response; get for retries/debugging).
ENGINE_RULES = frozenset({("", "pods", "get"), ("", "pods", "patch")})

_VERBS = {"POST": "create", "PATCH": "patch", "PUT": "update"}


def request_attributes(method: str, path: str, params: Mapping[str, str]
                       ) -> tuple[str, str, str] | None:
    """(apiGroup, resource[/subresource], verb) of a request; None for discovery paths."""
    parts = path.strip("/").split("/")
    if parts[0] == "api" and len(parts) > 2:
        group, rest = "", parts[2:]
    elif parts[0] == "apis" and len(parts) > 3:
        group, rest = parts[1], parts[3:]
    else:
        return None  # /api, /apis, /apis/g/v: non-resource discovery URLs
    if rest[0] == "namespaces" and len(rest) > 2:
        rest = rest[2:]  # a namespaced resource: drop namespaces/<ns>
    resource, name = rest[0], rest[1] if len(rest) > 1 else None
    if len(rest) > 2:
        resource = f"{resource}/{rest[2]}"
    if method == "GET":
        verb = "watch" if params.get("watch") in ("true", "1") else ("get" if name else "list")
    elif method == "DELETE":
        verb = "delete" if name else "deletecollection"
    else:
        verb = _VERBS[method]
    return group, resource, verb


def unlisted(requests: Iterable[Any], *, skip_agent: str | None = None
             ) -> set[tuple[str, str, str]]:
    """The RBAC attributes of kmock `requests` missing from OPERATOR_RULES (empty: all granted)."""
    used = {request_attributes(r.method, r.url.path, r.params) for r in requests
            if skip_agent is None or r.headers.get("User-Agent") != skip_agent}
    return {a for a in used if a is not None} - OPERATOR_RULES
