"""The Helm chart: the CRD is the one in crds/, `helm lint` passes, `helm template` renders
least-privilege RBAC and one Recreate operator replica, with and without the optional monitors."""

from __future__ import annotations

import subprocess
from pathlib import Path

from helm_support import template

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "kvasir"


def test_chart_crd_is_identical_to_crds_dir() -> None:
    source = (ROOT / "crds" / "inferenceservices.kvasir.dev.yaml").read_bytes()
    assert (CHART / "crds" / "inferenceservices.kvasir.dev.yaml").read_bytes() == source


def test_helm_lint(helm: str) -> None:
    out = subprocess.run([helm, "lint", str(CHART), "--strict"], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr


def test_template_default_least_privilege(helm: str) -> None:
    docs = template(helm)
    kinds = sorted(d["kind"] for d in docs)
    assert kinds.count("CustomResourceDefinition") == 1
    assert "ServiceMonitor" not in kinds and "PrometheusRule" not in kinds
    dep = next(d for d in docs if d["kind"] == "Deployment")
    assert dep["spec"]["replicas"] == 1 and dep["spec"]["strategy"] == {"type": "Recreate"}
    container = dep["spec"]["template"]["spec"]["containers"][0]
    assert container["args"][:2] == ["run", "--all-namespaces"]
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    for role in (d for d in docs if d["kind"] in ("ClusterRole", "Role")):
        for rule in role["rules"]:
            assert "*" not in rule["verbs"] and "*" not in rule["resources"], rule
            assert "*" not in rule["apiGroups"], rule
    for binding in (d for d in docs if d["kind"].endswith("Binding")):
        assert binding["roleRef"]["name"] != "cluster-admin"


def test_template_namespaced_with_monitoring(helm: str) -> None:
    docs = template(helm, "watchNamespaces={a,b}", "metrics.serviceMonitor.enabled=true",
                     "metrics.prometheusRule.enabled=true")
    roles = [d for d in docs if d["kind"] == "Role" and d["metadata"]["name"] == "kv-operator"]
    assert sorted(r["metadata"]["namespace"] for r in roles) == ["a", "b"]
    dep = next(d for d in docs if d["kind"] == "Deployment")
    assert dep["spec"]["template"]["spec"]["containers"][0]["args"][1:3] == [
        "--namespace=a", "--namespace=b"]
    monitor = next(d for d in docs if d["kind"] == "ServiceMonitor")
    assert monitor["spec"]["endpoints"][0]["path"] == "/metrics"
    assert any(d["kind"] == "PrometheusRule" for d in docs)
