"""Replicas from EndpointSlices: the gateway lists and watches them on kmock's Kubernetes
emulator (127.0.0.1), keeps only ready endpoints of its Service, follows changes and deletions,
and routes to what it found."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import pytest
import pytest_asyncio
import uvicorn
from gateway_support import FakeEngine, fake_engines
from kvasir_gateway.app import create_app
from kvasir_gateway.config import EndpointSliceSource, GatewayConfig, parse_endpoint_slice
from kvasir_gateway.discovery import ready_urls

SLICES = "/apis/discovery.k8s.io/v1/namespaces/ns1/endpointslices"


def endpoint_slice(name: str, service: str, port: int, ready: bool) -> dict[str, Any]:
    return {"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
            "metadata": {"name": name, "namespace": "ns1",
                         "labels": {"kubernetes.io/service-name": service}},
            "addressType": "IPv4", "ports": [{"name": "http", "port": port, "protocol": "TCP"}],
            "endpoints": [{"addresses": ["127.0.0.1"], "conditions": {"ready": ready}}]}


def test_ready_urls_keep_ready_endpoints_and_bracket_ipv6() -> None:
    body = {"ports": [{"port": 8000}], "endpoints": [
        {"addresses": ["10.0.0.1"], "conditions": {"ready": True}},
        {"addresses": ["10.0.0.2"], "conditions": {"ready": False}},
        {"addresses": ["fd00::3"]}]}  # no condition: ready, as the API says
    assert ready_urls(body, None) == {"http://10.0.0.1:8000", "http://[fd00::3]:8000"}
    assert ready_urls(body, 9000) == {"http://10.0.0.1:9000", "http://[fd00::3]:9000"}
    assert ready_urls({"endpoints": body["endpoints"]}, None) == set()
    assert parse_endpoint_slice("ns1/svc:8000") == EndpointSliceSource("ns1", "svc", 8000)
    with pytest.raises(ValueError, match="NAMESPACE/SERVICE"):
        parse_endpoint_slice("svc")


@pytest_asyncio.fixture()
async def served_gateway(kmock: Any) -> AsyncIterator[Callable[..., Any]]:
    info = kmock.ResourceInfo
    kmock.resources["discovery.k8s.io/v1/endpointslices"] = info(
        kind="EndpointSlice", namespaced=True, verbs={"get", "list", "watch", "create", "patch",
                                                       "delete"})
    servers: list[tuple[uvicorn.Server, asyncio.Task[None]]] = []

    async def start() -> str:
        config = GatewayConfig(host="127.0.0.1", port=0, probe_interval_seconds=0.2,
                               endpoint_slices=(EndpointSliceSource("ns1", "engine"),),
                               kube_api_server=str(kmock.url).rstrip("/"))
        server = uvicorn.Server(uvicorn.Config(create_app(config), host="127.0.0.1", port=0,
                                               log_level="warning", lifespan="on"))
        task = asyncio.get_running_loop().create_task(server.serve())
        servers.append((server, task))
        while not server.started:
            await asyncio.sleep(0.01)
        return f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"

    yield start
    for server, task in servers:
        server.should_exit = True
        await asyncio.wait_for(task, 10)


async def wait_for_replicas(client: httpx.AsyncClient, url: str, n: int) -> None:
    for _ in range(500):
        resp = await client.get(url + "/ready")
        if (resp.json().get("replicas") or 0) == n:
            return
        await asyncio.sleep(0.02)
    raise TimeoutError(f"never {n} ready replicas: {resp.text}")


@pytest.mark.asyncio
async def test_endpointslice_watch_follows_ready_endpoints(
        kmock: Any, served_gateway: Callable[..., Any]) -> None:
    first, second = FakeEngine(), FakeEngine()
    with fake_engines(first, second) as [a, b]:
        async with httpx.AsyncClient(base_url=str(kmock.url), timeout=5) as api:
            created = await api.post(SLICES, json=endpoint_slice("engine-a", "engine", a.port,
                                                                 True))
            assert created.status_code < 300, created.text
            await api.post(SLICES, json=endpoint_slice("engine-b", "engine", b.port, False))
            await api.post(SLICES, json=endpoint_slice("other-x", "other", b.port, True))
            url = await served_gateway()
            async with httpx.AsyncClient(timeout=5) as client:
                await wait_for_replicas(client, url, 1)  # from the list: a only
                body = {"model": "tiny", "prompt": "hi", "max_tokens": 2}
                assert (await client.post(url + "/v1/completions", json=body)).status_code == 200
                assert len(first.received) == 1 and not second.received
                # the watch: b turns ready, then a's slice goes away
                patch = {"endpoints": [{"addresses": ["127.0.0.1"], "conditions": {"ready": True}}]}
                resp = await api.patch(f"{SLICES}/engine-b", json=patch,
                                       headers={"content-type": "application/merge-patch+json"})
                assert resp.status_code < 300, resp.text
                await wait_for_replicas(client, url, 2)
                assert (await api.delete(f"{SLICES}/engine-a")).status_code < 300
                await wait_for_replicas(client, url, 1)
                assert (await client.post(url + "/v1/completions", json=body)).status_code == 200
                assert len(first.received) == 1 and len(second.received) == 1
