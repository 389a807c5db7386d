"""K8sClient against kmock's Kubernetes emulator on 127.0.0.1."""

from __future__ import annotations

from typing import Any

import pytest
from kvasir_operator import k8s
from kvasir_operator.settings import Settings


def _cm(name: str, labels: dict[str, str]) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": name, "namespace": "ns1", "labels": labels},
            "data": {"k": name}}


@pytest.mark.asyncio
async def test_apply_creates_then_updates_get_list_delete(kmock: Any) -> None:
    kmock.resources["v1/configmaps"] = {}
    async with k8s.K8sClient(str(kmock.url)) as client:
        assert await client.get(k8s.CONFIGMAPS, "ns1", "a") is None
        await client.apply(_cm("a", {"x": "1"}))
        await client.apply(_cm("b", {"x": "2"}))
        body = _cm("a", {"x": "1"})
        body["data"] = {"k": "changed"}
        await client.apply(body)
        got = await client.get(k8s.CONFIGMAPS, "ns1", "a")
        assert got is not None and got["data"] == {"k": "changed"}
        listed = await client.list(k8s.CONFIGMAPS, "ns1", label_selector={"x": "2"})
        assert [o["metadata"]["name"] for o in listed] == ["b"]
        assert await client.delete(k8s.CONFIGMAPS, "ns1", "a") is True
        assert await client.delete(k8s.CONFIGMAPS, "ns1", "a") is False
    patches = [r for r in list(kmock) if r.method == "PATCH"]
    assert patches and all(r.params.get("fieldManager") == "kvasir-operator" for r in patches)
    assert patches[0].headers["Content-Type"] == "application/apply-patch+yaml"


@pytest.mark.asyncio
async def test_status_scale_annotations_event_proxy(kmock: Any) -> None:
    res = k8s.INFERENCESERVICES
    kmock.objects[f"{res.group}/{res.version}/{res.plural}", "ns1", "m"] = {
        "apiVersion": res.api_version, "kind": res.kind,
        "metadata": {"name": "m", "namespace": "ns1", "uid": "u1"},
        "spec": {"replicas": 1}, "status": {"autoscaling": {"reason": "kept"}}}
    kmock.objects["v1/pods", "ns1", "p"] = {"metadata": {"name": "p", "namespace": "ns1"}}
    kmock.resources["v1/events"] = {}
    kmock["get /api/v1/namespaces/ns1/pods/p:8000/proxy/metrics"] << b"vllm:x 1\n"
    async with k8s.K8sClient(str(kmock.url)) as client:
        await client.patch_status(res, "ns1", "m", {"replicas": 3})
        await client.patch_scale(res, "ns1", "m", 4)
        obj = await client.get(res, "ns1", "m")
        assert obj is not None
        assert obj["status"] == {"autoscaling": {"reason": "kept"}, "replicas": 3}
        assert obj["spec"]["replicas"] == 4
        await client.patch_pod_annotations("ns1", "p", {"kvasir.dev/a": "1"})
        pod = await client.get(k8s.PODS, "ns1", "p")
        assert pod is not None and pod["metadata"]["annotations"] == {"kvasir.dev/a": "1"}
        await client.post_event(obj, "Warning", "Testing", "hello")
        events = await client.list(k8s.EVENTS, "ns1", field_selector="involvedObject.uid=u1")
        assert [(e["reason"], e["message"], e["involvedObject"]["kind"]) for e in events] == [
            ("Testing", "hello", "InferenceService")]
        assert await client.proxy_get("ns1", "p", 8000, "/metrics") == "vllm:x 1\n"
    scale = [r for r in list(kmock) if r.method == "PATCH" and r.url.path.endswith("/scale")]
    assert scale and scale[0].headers["Content-Type"] == "application/merge-patch+json"


@pytest.mark.asyncio
async def test_errors_carry_status_and_message(kmock: Any) -> None:
    kmock.resources["v1/configmaps"] = {}
    async with k8s.K8sClient(str(kmock.url)) as client:
        with pytest.raises(k8s.ApiError) as info:
            await client.patch_status(k8s.CONFIGMAPS, "ns1", "missing", {"a": 1})
        assert info.value.status == 404
    with pytest.raises(ValueError, match="unknown resource"):
        k8s.resource_of({"apiVersion": "x/v1", "kind": "Y"})


def test_from_settings_reads_the_kubeconfig_named(tmp_path: Any) -> None:
    cfg = tmp_path / "kubeconfig"
    cfg.write_text(
        "apiVersion: v1\nkind: Config\ncurrent-context: c\n"
        "clusters: [{name: k, cluster: {server: 'http://127.0.0.1:1'}}]\n"
        "users: [{name: u, user: {token: abc}}]\n"
        "contexts: [{name: c, context: {cluster: k, user: u}}]\n")
    client = k8s.K8sClient.from_settings(Settings(kubeconfig=str(cfg)))
    assert client.server == "http://127.0.0.1:1"
    assert client.config.user is not None and client.config.user.token == "abc"
