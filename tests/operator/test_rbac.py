"""The chart's RBAC against what the code uses (rbac_table.py): every (apiGroup, resource, verb)
granted in each install mode, no wildcard, cluster-scoped rights only where needed, and the
engine pods' ServiceAccount with exactly get/patch on pods in every namespace it serves."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import pytest
from helm_support import template
from rbac_table import CLUSTER_SCOPED, ENGINE_RULES, OPERATOR_RULES, request_attributes

Grant = tuple[str, str, str]


def _grants(role: dict[str, Any]) -> set[Grant]:
    out: set[Grant] = set()
    for rule in role["rules"]:
        for field in ("apiGroups", "resources", "verbs"):
            assert "*" not in rule[field], (role["metadata"]["name"], rule)
        out |= {(g, r, v) for g in rule["apiGroups"] for r in rule["resources"]
                for v in rule["verbs"]}
    return out


def _bound(docs: list[dict[str, Any]], sa: str, sa_ns: str
           ) -> tuple[set[Grant], dict[str, set[Grant]]]:
    """(cluster-wide grants, namespace -> grants) of a ServiceAccount, through its bindings."""
    roles = {(d["kind"], d["metadata"].get("namespace"), d["metadata"]["name"]): d
             for d in docs if d["kind"] in ("Role", "ClusterRole")}
    cluster: set[Grant] = set()
    per_ns: dict[str, set[Grant]] = {}
    for b in (d for d in docs if d["kind"] in ("RoleBinding", "ClusterRoleBinding")):
        if {"kind": "ServiceAccount", "name": sa, "namespace": sa_ns} not in b["subjects"]:
            continue
        ref, ns = b["roleRef"], b["metadata"].get("namespace")
        role = roles[(ref["kind"], ns if ref["kind"] == "Role" else None, ref["name"])]
        if b["kind"] == "ClusterRoleBinding":
            cluster |= _grants(role)
        else:
            per_ns.setdefault(ns, set()).update(_grants(role))
    return cluster, per_ns


def _missing(needed: Iterable[Grant], granted: set[Grant]) -> list[Grant]:
    return sorted(set(needed) - granted)


def test_request_attributes_mapping() -> None:
    assert request_attributes("GET", "/api/v1/namespaces", {"watch": "true"}) == (
        "", "namespaces", "watch")
    assert request_attributes("GET", "/api/v1/namespaces/a/pods/p:8000/proxy/metrics", {}) == (
        "", "pods/proxy", "get")
    assert request_attributes("PATCH", "/apis/kvasir.dev/v1alpha1/namespaces/a/"
                              "inferenceservices/m/scale", {}) == (
        "kvasir.dev", "inferenceservices/scale", "patch")
    assert request_attributes("GET", "/apis/apps/v1", {}) is None


def test_all_namespaces_clusterrole_grants_every_used_verb(helm: str) -> None:
    docs = template(helm)
    cluster, per_ns = _bound(docs, "kv-operator", "kvasir")
    assert per_ns == {}
    assert _missing(OPERATOR_RULES, cluster) == []
    # Nothing beyond the table but the read-only extras kubectl users expect.
    extras = cluster - OPERATOR_RULES
    assert {v for _g, _r, v in extras} <= {"get", "list", "watch", "patch"}, sorted(extras)
    assert not any(r == "secrets" and v != "get" for _g, r, v in cluster)
    # No namespaces listed: no engine ServiceAccount (the operator then renders none).
    assert not [d for d in docs if d["kind"] == "ServiceAccount"
                and d["metadata"]["name"] == "kvasir-engine"]
    env = {e["name"]: e["value"] for e in next(d for d in docs if d["kind"] == "Deployment")[
        "spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["KVASIR_ENGINE_SERVICE_ACCOUNT"] == "kvasir-engine"
    assert env["AWS_EC2_METADATA_DISABLED"] == "true"


@pytest.mark.parametrize("read_secrets", [True, False])
def test_namespaced_roles_and_engine_service_accounts(helm: str, read_secrets: bool) -> None:
    docs = template(helm, "watchNamespaces={a,b}",
                    f"capacityProbe.readCredentialsSecrets={str(read_secrets).lower()}")
    cluster, per_ns = _bound(docs, "kv-operator", "kvasir")
    namespaced = {g for g in OPERATOR_RULES if (g[0], g[1]) not in CLUSTER_SCOPED}
    if not read_secrets:
        namespaced -= {("", "secrets", "get")}
    assert sorted(per_ns) == ["a", "b"]
    for ns, grants in per_ns.items():
        assert _missing(namespaced, grants) == [], ns
        assert (("", "secrets", "get") in grants) is read_secrets
    # Cluster-wide: only kopf's read-only discovery of namespaces and CRDs.
    assert _missing((g for g in OPERATOR_RULES if (g[0], g[1]) in CLUSTER_SCOPED), cluster) == []
    assert {(g, r) for g, r, _v in cluster} <= CLUSTER_SCOPED
    assert {v for _g, _r, v in cluster} <= {"get", "list", "watch"}
    for ns in ("a", "b"):
        engine_cluster, engine_ns = _bound(docs, "kvasir-engine", ns)
        assert engine_cluster == set() and engine_ns == {ns: set(ENGINE_RULES)}
        sa = next(d for d in docs if d["kind"] == "ServiceAccount"
                  and d["metadata"] == {**d["metadata"], "name": "kvasir-engine",
                                        "namespace": ns})
        assert sa["automountServiceAccountToken"] is False
    assert not any(b["roleRef"]["name"] in ("cluster-admin", "admin", "edit")
                   for b in docs if b["kind"].endswith("Binding"))
