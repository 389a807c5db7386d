"""Everything we ship or render, validated as a real API server would (kubernetes-validate, strict:
an unknown field fails), on every Kubernetes minor version from the chart's `kubeVersion` floor
to the newest the installed kubernetes-validate ships: the CRD, every object of `helm template`
under several value sets, the objects the operator renders (representative specs and the
hypothesis specs of test_render.py), and the sample manifests (e2e/*.yaml, docs/examples/*.yaml),
whose InferenceServices are also admitted against the CRD's own schema and CEL rules.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from crd_schema import CRD, ROOT, admit
from helm_support import CHART, template
from hypothesis import HealthCheck, given, settings
from kubeval import FOREIGN_KINDS, chart_floor, errors, latest, supported_versions
from kvasir_operator.render import (
    Owner,
    render_pdb,
    render_role_deployments,
    render_service,
    render_workload,
)
from kvasir_operator.spec import spec_hash
from kvasir_operator.spec_parse import parse_spec
from lws_schema import lws_errors
from test_render import specs

VERSIONS = supported_versions()
MANIFESTS = sorted([*ROOT.glob("e2e/*.yaml"), *ROOT.glob("docs/examples/*.yaml")])
VALUE_SETS = {
    "default": (),
    "namespaced+monitoring": ("watchNamespaces={a,b}", "metrics.serviceMonitor.enabled=true",
                              "metrics.prometheusRule.enabled=true"),
    "existing-accounts": ("serviceAccount.create=false", "serviceAccount.name=ops",
                          "engineServiceAccount.create=false",
                          "capacityProbe.readCredentialsSecrets=false",
                          "imagePullSecrets[0].name=reg", "priorityClassName=system-cluster-critical",
                          "nodeSelector.role=ops", "extraArgs={--verbose}"),
}
OWNER = Owner("llm", "team-a", "0b7c1a52-6d4e-4b1f-9a0c-1e2f3a4b5c6d")
REPRESENTATIVE = {
    "s3-gpu-tp4": {"model": {"uri": "s3://models/llama-70b", "credentialsSecret": "s3-creds",
                             "sizeBytes": 140 * 10**9},
                   "engine": {"tensorParallelSize": 4, "maxModelLen": 32768},
                   "resources": {"gpus": 4, "cpu": "32", "memory": "256Gi"},
                   "cache": {"type": "hostPath", "path": "/mnt/nvme/kvasir"},
                   "autoscaling": {"minReplicas": 2, "maxReplicas": 6}, "replicas": 3,
                   "tolerations": [{"key": "gpu", "operator": "Exists", "effect": "NoSchedule"}],
                   "fetch": {"endpointUrl": "http://minio.minio:9000", "concurrency": 16}},
    "pvc-source-pvc-cache": {"model": {"uri": "pvc://weights/qwen"},
                             "cache": {"type": "pvc", "claimName": "nvme-cache"},
                             "disruptionBudget": {"maxUnavailable": "50%"},
                             "priorityClassName": "inference", "serviceAccountName": "engine",
                             "imagePullSecrets": ["registry"]},
    "cpu-local-int8": {"model": {"uri": "/opt/models/SmolLM2-135M-Instruct.Q4_1.gguf"},
                       "engine": {"quantization": "int8", "dtype": "float32",
                                  "kvCacheDtype": "bfloat16",
                                  "env": [{"name": "OMP_NUM_THREADS", "value": "4"}]},
                       "resources": {"gpus": 0, "cpu": 4, "memory": "8Gi"},
                       "service": {"type": "NodePort", "port": 8080}},
    "s3-gpu-pp2-tp8": {"model": {"uri": "s3://models/llama-405b", "credentialsSecret": "s3-creds",
                                 "sizeBytes": 800 * 10**9},
                       "engine": {"tensorParallelSize": 8, "pipelineParallelSize": 2},
                       "cache": {"type": "hostPath", "path": "/mnt/nvme/kvasir"},
                       "autoscaling": {"minReplicas": 1, "maxReplicas": 2}},
    "speculative-ngram": {"model": {"uri": "s3://models/m"},
                          "engine": {"speculative": {"numSpeculativeTokens": 4,
                                                     "promptLookupMax": 4,
                                                     "promptLookupMin": 2}}},
    "disaggregated": {"model": {"uri": "s3://models/llama-8b", "sizeBytes": 16 * 10**9},
                      "resources": {"gpus": 1, "cpu": "8", "memory": "64Gi"},
                      "disaggregation": {"enabled": True, "holdTimeoutSeconds": 30,
                                         "prefill": {"maxReplicas": 4,
                                                     "resources": {"cpu": "16"}},
                                         "decode": {"minReplicas": 2, "maxReplicas": 8,
                                                    "resources": {"memory": "96Gi"}}}},
    "escape-hatch": {"model": {"uri": "s3://models/m"},
                     "cache": {"type": "emptyDir", "sizeLimit": "200Gi"},
                     "disruptionBudget": {"minAvailable": 1},
                     "podTemplate": {"spec": {"hostIPC": True, "containers": [
                         {"name": "engine", "env": [{"name": "NCCL_DEBUG", "value": "INFO"}]},
                         {"name": "sidecar", "image": "busybox:1.36", "args": ["sleep", "1d"]}]}},
                     "podLabels": {"team": "search"}, "podAnnotations": {"a": "b c"}},
}


def rendered(raw: dict[str, Any]) -> list[dict[str, Any]]:
    spec = parse_spec(OWNER.name, raw)
    workloads = (list(render_role_deployments(spec, OWNER, 16 * 10**9, "kvasir-engine").values())
                 if spec.disaggregation is not None else
                 [render_workload(spec, OWNER, spec_hash(spec), 16 * 10**9, "kvasir-engine")])
    objects = [*workloads, render_service(spec, OWNER), render_pdb(spec, OWNER)]
    return [o for o in objects if o is not None]


def rendered_errors(obj: dict[str, Any], version: str) -> list[str]:
    """A LeaderWorkerSet against its API's schema, its pod templates strictly on `version`."""
    if obj["kind"] == "LeaderWorkerSet":
        return lws_errors(obj, (version,))
    return errors(obj, version)


def test_versions_come_from_the_package_and_the_chart() -> None:
    assert VERSIONS[0].startswith(f"{chart_floor().major}.{chart_floor().minor}.")
    assert VERSIONS[-1] == latest() and len(VERSIONS) >= 2


@pytest.mark.parametrize("version", VERSIONS)
def test_the_crd_is_valid_on_every_supported_version(version: str) -> None:
    assert errors(CRD, version) == []


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("values", sorted(VALUE_SETS))
def test_every_chart_object_is_valid(helm: str, values: str, version: str) -> None:
    docs = template(helm, *VALUE_SETS[values], kube_version=version)
    assert {"CustomResourceDefinition", "Deployment"} <= {d["kind"] for d in docs}
    assert [e for d in docs for e in errors(d, version)] == []
    unknown = {(d["apiVersion"], d["kind"]) for d in docs} & FOREIGN_KINDS
    assert values == "namespaced+monitoring" or not unknown


def test_helm_template_piped_to_the_kubernetes_validate_cli_is_clean(helm: str) -> None:
    """The literal check of issue 13: `helm template | kubernetes-validate --strict`."""
    cli = Path(sys.executable).with_name("kubernetes-validate")
    rendered_chart = subprocess.run(
        [helm, "template", "kv", str(CHART), "--include-crds", "--kube-version", latest()],
        check=True, capture_output=True, text=True, timeout=120).stdout
    out = subprocess.run([str(cli), "--strict", "-k", latest(), "-"], input=rendered_chart,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "ERROR" not in out.stdout and "WARN" not in out.stdout, out.stdout
    assert out.stdout.count("passed for resource") == len(
        [d for d in yaml.safe_load_all(rendered_chart) if d])


def test_the_chart_refuses_a_cluster_older_than_its_floor_only(helm: str) -> None:
    too_old = f"{chart_floor().major}.{chart_floor().minor - 1}.0"
    out = subprocess.run([helm, "template", "kv", str(CHART), "--kube-version", too_old],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and "kubeVersion" in out.stderr, out.stderr
    # the "-0" of the constraint admits the pre-release-tagged versions of managed clusters
    managed = f"{chart_floor().major}.{chart_floor().minor}.3-eks-a5565ad"
    assert {d["kind"] for d in template(helm, kube_version=managed)} >= {"Deployment"}


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("name", sorted(REPRESENTATIVE))
def test_operator_rendered_objects_are_valid(name: str, version: str) -> None:
    raw = REPRESENTATIVE[name]
    assert admit({"apiVersion": "kvasir.dev/v1alpha1", "kind": "InferenceService",
                  "metadata": {"name": OWNER.name}, "spec": raw})[1] == []
    objects = rendered(raw)
    workload = "LeaderWorkerSet" if "pipelineParallelSize" in raw.get("engine", {}) else (
        "Deployment")
    assert {o["kind"] for o in objects} == {workload, "Service", "PodDisruptionBudget"}
    assert [e for o in objects for e in rendered_errors(o, version)] == []


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(raw=specs())
def test_hypothesis_rendered_objects_are_valid_on_floor_and_newest(raw: dict[str, Any]) -> None:
    assert admit({"apiVersion": "kvasir.dev/v1alpha1", "kind": "InferenceService",
                  "metadata": {"name": OWNER.name}, "spec": raw})[1] == []
    objects = rendered(raw)
    for version in (VERSIONS[0], VERSIONS[-1]):
        assert [e for o in objects for e in rendered_errors(o, version)] == []


def _documents(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


@pytest.mark.parametrize("path", MANIFESTS, ids=[str(p.relative_to(ROOT)) for p in MANIFESTS])
def test_sample_manifests_are_valid(path: Path) -> None:
    for doc in _documents(path):
        if doc["kind"] == "InferenceService":
            stored, problems = admit(doc)
            assert problems == [], problems
            objects = rendered(stored["spec"])
            assert [e for o in objects for e in rendered_errors(o, VERSIONS[-1])] == []
        else:
            assert (doc["apiVersion"], doc["kind"]) in FOREIGN_KINDS or errors(doc) == []


def test_the_samples_cover_gpu_cpu_and_keda_and_keda_targets_an_external_service() -> None:
    services = {d["metadata"]["name"]: d for p in MANIFESTS for d in _documents(p)
                if d["kind"] == "InferenceService"}
    assert {"llama-8b", "smollm2", "llama-3-8b"} <= set(services)
    for path in MANIFESTS:
        for doc in _documents(path):
            if doc["kind"] == "ScaledObject":
                target = services[doc["spec"]["scaleTargetRef"]["name"]]
                assert target["spec"]["autoscaling"]["mode"] == "external"
