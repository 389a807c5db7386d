"""A minimal structural schema of LeaderWorkerSet (leaderworkerset.x-k8s.io/v1), for the tests.

Written from the LWS API reference (kubernetes-sigs/lws, `LeaderWorkerSetSpec`): the fields
Kvasir may render, their types, enums and minimums, what is required, and unknown fields
refused at every level (as a strict API server refuses them), so a misspelled or misplaced key
fails. The pod templates are checked apart, against the real PodTemplateSpec of every
supported Kubernetes version (kubeval.py), because an LWS carries them as core/v1 types.
Not the LWS code nor its CRD: only what its reference publishes.
"""

from __future__ import annotations

from typing import Any

import jsonschema
from kubeval import errors as kube_errors

API_VERSION = "leaderworkerset.x-k8s.io/v1"
_INT_OR_PERCENT = {"anyOf": [{"type": "integer", "minimum": 0},
                             {"type": "string", "pattern": r"^(100|[1-9]?[0-9])%$"}]}
_OBJECT_META = {"type": "object", "required": ["name"], "properties": {
    "name": {"type": "string", "pattern": r"^[a-z]([-a-z0-9]*[a-z0-9])?$", "maxLength": 63},
    "namespace": {"type": "string"}, "labels": {"type": "object"},
    "annotations": {"type": "object"}, "ownerReferences": {"type": "array"}},
    "additionalProperties": False}
_POD_TEMPLATE = {"type": "object", "required": ["spec"]}  # PodTemplateSpec: kubeval checks it

SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "additionalProperties": False,
    "properties": {
        "apiVersion": {"enum": [API_VERSION]},
        "kind": {"enum": ["LeaderWorkerSet"]},
        "metadata": _OBJECT_META,
        "spec": {
            "type": "object", "required": ["leaderWorkerTemplate"],
            "additionalProperties": False,
            "properties": {
                "replicas": {"type": "integer", "minimum": 0, "maximum": 2**31 - 1},
                "startupPolicy": {"enum": ["LeaderCreated", "LeaderReady"]},
                "rolloutStrategy": {
                    "type": "object", "required": ["type"], "additionalProperties": False,
                    "properties": {
                        "type": {"enum": ["RollingUpdate"]},
                        "rollingUpdateConfiguration": {
                            "type": "object", "additionalProperties": False,
                            "properties": {"partition": {"type": "integer", "minimum": 0},
                                           "maxUnavailable": _INT_OR_PERCENT,
                                           "maxSurge": _INT_OR_PERCENT}}}},
                "networkConfig": {
                    "type": "object", "required": ["subdomainPolicy"],
                    "additionalProperties": False,
                    "properties": {"subdomainPolicy": {"enum": ["Shared", "UniquePerReplica"]}}},
                "leaderWorkerTemplate": {
                    "type": "object", "required": ["workerTemplate"],
                    "additionalProperties": False,
                    "properties": {
                        "leaderTemplate": _POD_TEMPLATE,
                        "workerTemplate": _POD_TEMPLATE,
                        "size": {"type": "integer", "minimum": 1, "maximum": 2**31 - 1},
                        "restartPolicy": {"enum": ["RecreateGroupOnPodRestart",
                                                   "RecreateGroupAfterStart", "None",
                                                   "Default"]},
                        "subGroupPolicy": {
                            "type": "object", "additionalProperties": False,
                            "properties": {
                                "subGroupPolicyType": {"enum": ["LeaderWorker",
                                                                "LeaderExcluded"]},
                                "subGroupSize": {"type": "integer", "minimum": 1}}},
                    }},
            }},
        "status": {"type": "object"},
    },
}
_VALIDATOR = jsonschema.Draft7Validator(SCHEMA)


def _pod_template(lws: dict[str, Any], which: str) -> dict[str, Any]:
    """A template of the LWS as a core/v1 PodTemplate, the object kubernetes-validate knows."""
    return {"apiVersion": "v1", "kind": "PodTemplate",
            "metadata": {"name": f"{lws['metadata']['name']}-{which}",
                         "namespace": lws["metadata"].get("namespace")},
            "template": lws["spec"]["leaderWorkerTemplate"][which]}


def lws_errors(lws: dict[str, Any], versions: tuple[str, ...] = ()) -> list[str]:
    """[] when the LeaderWorkerSet is valid: its own schema, then each pod template strictly
    on each Kubernetes version (the newest kubernetes-validate ships when none is given)."""
    problems = [f"{'.'.join(map(str, e.absolute_path))}: {e.message}"
                for e in _VALIDATOR.iter_errors(lws)]
    if problems:
        return problems
    spec = lws["spec"]
    if spec["leaderWorkerTemplate"].get("size", 1) * spec.get("replicas", 1) > 2**31 - 1:
        problems.append("spec.replicas x size exceeds 2^31 - 1")
    rolling = (spec.get("rolloutStrategy") or {}).get("rollingUpdateConfiguration") or {}
    if rolling.get("maxUnavailable", 1) in (0, "0%") and rolling.get("maxSurge", 0) in (0, "0%"):
        problems.append("maxUnavailable must not be 0 when maxSurge is 0")
    for which in ("leaderTemplate", "workerTemplate"):
        if which in spec["leaderWorkerTemplate"]:
            template = _pod_template(lws, which)
            for version in versions or (None,):
                problems += kube_errors(template, version)
    return problems
