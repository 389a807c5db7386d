"""The operator under kopf.testing.KopfRunner against kmock's Kubernetes emulator on 127.0.0.1,
serving one namespace (`--namespace ns1`, as the chart runs it with watchNamespaces), with the
model read from a moto S3 server on loopback.

kmock does not run the garbage collector, so "delete -> children gone" is shown by the children's
controller ownerReferences (what the real GC follows) and by the absence of any finalizer on them.
Every API request the operator made is checked against the RBAC table the chart is tested with.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
from kmock_namespaces import namespaces_served
from kopf.testing import KopfRunner
from kvasir_operator import k8s, labels
from operator_support import isvc, llama_files, secret, serve_operator_cluster, until
from rbac_table import unlisted

NS = "ns1"
TEST_AGENT = "kvasir-tests"


def _isvc(name: str, uid: str, spec: dict[str, Any], namespace: str = NS) -> dict[str, Any]:
    return isvc(name, namespace, uid, spec)


@pytest_asyncio.fixture
async def cluster(kmock: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                  ) -> AsyncIterator[tuple[Any, k8s.K8sClient]]:
    # kopf lists and watches namespaces to serve `--namespace`: kmock is taught that path.
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    serve_operator_cluster(kmock, (NS, "ns2"))
    config = tmp_path / "kubeconfig"
    config.write_text(
        "apiVersion: v1\nkind: Config\ncurrent-context: c\n"
        f"clusters: [{{name: k, cluster: {{server: '{kmock.url}'}}}}]\n"
        "users: [{name: u, user: {token: t}}]\n"
        "contexts: [{name: c, context: {cluster: k, user: u, namespace: ns1}}]\n")
    monkeypatch.setenv("KUBECONFIG", str(config))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    with namespaces_served(monkeypatch):
        # The test's own requests are told apart from the operator's by their user agent.
        async with k8s.K8sClient(str(kmock.url), user_agent=TEST_AGENT) as client:
            yield kmock, client


@contextlib.asynccontextmanager
async def running_operator() -> AsyncIterator[KopfRunner]:
    runner = KopfRunner(["run", "--standalone", "--namespace", NS, "-m",
                         "kvasir_operator.handlers"], timeout=30)
    runner.__enter__()
    try:
        yield runner
    finally:
        # __exit__ joins the operator's thread: keep this loop (kmock's server) serving meanwhile.
        await asyncio.to_thread(runner.__exit__, None, None, None)


@pytest.mark.asyncio
async def test_create_update_repair_restart_and_invalid(cluster: Any, aws_env: None,
                                                        upload: Any, moto_endpoint: str) -> None:
    kmock, client = cluster
    isvcs = "kvasir.dev/v1alpha1/inferenceservices"
    uri = upload(llama_files())
    kmock.objects["v1/secrets", NS, "creds"] = secret("creds", NS, {
        "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_ENDPOINT_URL": moto_endpoint})
    kmock.objects["v1/serviceaccounts", NS, labels.ENGINE_SERVICE_ACCOUNT] = {
        "apiVersion": "v1", "kind": "ServiceAccount",
        "metadata": {"name": labels.ENGINE_SERVICE_ACCOUNT, "namespace": NS}}
    kmock.objects[isvcs, NS, "llm"] = _isvc("llm", "uid-1", {
        "model": {"uri": uri, "name": "llama", "credentialsSecret": "creds"},
        "engine": {"tensorParallelSize": 2, "maxModelLen": 4096},
        "resources": {"gpuType": "L4"},
        "autoscaling": {"minReplicas": 1, "maxReplicas": 3}})
    # Another namespace: not served, never touched.
    kmock.objects[isvcs, "ns2", "other"] = _isvc("other", "uid-3", {
        "model": {"uri": "s3://m/x"}}, namespace="ns2")

    async def deployment() -> dict[str, Any] | None:
        return await client.get(k8s.DEPLOYMENTS, NS, "llm")

    async with running_operator():
        dep = await until("the Deployment", deployment)
        svc = await until("the Service", lambda: client.get(k8s.SERVICES, NS, "llm"))
        pdb = await until("the PDB", lambda: client.get(k8s.PDBS, NS, "llm"))
        for child in (dep, svc, pdb):
            assert child["metadata"]["ownerReferences"] == [{
                "apiVersion": "kvasir.dev/v1alpha1", "kind": "InferenceService", "name": "llm",
                "uid": "uid-1", "controller": True, "blockOwnerDeletion": True}]
            assert not child["metadata"].get("finalizers")
        pod = dep["spec"]["template"]["spec"]
        assert pod["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "2"
        assert pod["initContainers"][0]["args"][0] == uri
        assert pod["serviceAccountName"] == labels.ENGINE_SERVICE_ACCOUNT
        first_hash = dep["spec"]["template"]["metadata"]["labels"][labels.SPEC_HASH]

        async def status() -> dict[str, Any]:
            obj = await client.get(k8s.INFERENCESERVICES, NS, "llm")
            return dict((obj or {}).get("status") or {})

        st = await until("status", lambda: _has(status, "url"))
        # No finalizer: deleting it never waits for the operator (test_deletion.py).
        owner = await client.get(k8s.INFERENCESERVICES, NS, "llm")
        assert owner is not None and not owner["metadata"].get("finalizers")
        assert st["url"] == "http://llm.ns1.svc/v1"
        assert st["selector"] == "kvasir.dev/inferenceservice=llm"
        assert {c["type"] for c in st["conditions"]} >= {"ModelReady", "Available", "Progressing"}
        # The capacity check ran on config.json and the weight sizes read from S3.
        assert st["capacity"]["inputsFrom"] == "source" and st["capacity"]["fits"] is True
        assert st["capacity"]["kvBytesPerToken"] == 2 * 32 * 8 * 128 * 2
        assert st["capacity"]["weightsBytes"] == 500_000

        # update -> pods roll (spec hash changes), replicas untouched
        await client.patch_merge(k8s.INFERENCESERVICES, NS, "llm",
                                 {"spec": {"engine": {"maxModelLen": 8192}}})
        dep = await until("a new spec hash", lambda: _hash_changed(deployment, first_hash))
        assert "8192" in dep["spec"]["template"]["spec"]["containers"][0]["args"]

        # a child deleted by hand comes back
        assert await client.delete(k8s.SERVICES, NS, "llm")
        await until("the Service to come back", lambda: client.get(k8s.SERVICES, NS, "llm"))

        # an invalid spec -> a condition and an Event, no children
        kmock.objects[isvcs, NS, "bad"] = _isvc("bad", "uid-2", {
            "model": {"uri": "s3://m/x"}, "autoscaling": {"minReplicas": 3, "maxReplicas": 1}})
        await client.patch_merge(k8s.INFERENCESERVICES, NS, "bad", {"metadata": {"labels": {}}})
        bad = await until("the invalid condition", lambda: _invalid(client))
        assert "minReplicas (3) must be <= spec.autoscaling.maxReplicas (1)" in bad["message"]
        events = await client.list(k8s.EVENTS, NS)
        assert any(e["reason"] == "InvalidSpec" and "minReplicas" in e["message"] for e in events)
        assert await client.get(k8s.DEPLOYMENTS, NS, "bad") is None

    # scaled while the operator was down -> the restarted operator converges
    await client.patch_scale(k8s.INFERENCESERVICES, NS, "llm", 3)
    async with running_operator():
        await until("replicas=3", lambda: _replicas(deployment, 3))
    events = await client.list(k8s.EVENTS, NS)
    reasons = {e["reason"] for e in events if e["involvedObject"]["name"] == "llm"}
    assert {"Created", "RollingOut", "Scaled"} <= reasons
    assert await client.get(k8s.DEPLOYMENTS, "ns2", "other") is None
    requests = [r for r in kmock if r.headers.get("User-Agent") != TEST_AGENT]
    assert not [r for r in requests if "/namespaces/ns2/" in r.url.path], "ns2 is not served"
    watched = {r.url.path for r in requests if r.params.get("watch") == "true"}
    assert "/apis/kvasir.dev/v1alpha1/namespaces/ns1/inferenceservices" in watched
    # Every API call the operator made is in the RBAC table that the chart test checks.
    assert unlisted(requests) == set()


async def _has(status: Callable[[], Awaitable[dict[str, Any]]], key: str) -> dict[str, Any] | None:
    st = await status()
    return st if key in st else None


async def _hash_changed(deployment: Callable[[], Awaitable[dict[str, Any] | None]],
                        old: str) -> dict[str, Any] | None:
    dep = await deployment()
    if dep and dep["spec"]["template"]["metadata"]["labels"][labels.SPEC_HASH] != old:
        return dep
    return None


async def _replicas(deployment: Callable[[], Awaitable[dict[str, Any] | None]], n: int) -> bool:
    dep = await deployment()
    return bool(dep and dep["spec"]["replicas"] == n)


async def _invalid(client: k8s.K8sClient) -> dict[str, Any] | None:
    obj = await client.get(k8s.INFERENCESERVICES, NS, "bad")
    for cond in ((obj or {}).get("status") or {}).get("conditions") or []:
        if cond["type"] == "SpecValid" and cond["status"] == "False":
            return dict(cond)
    return None
