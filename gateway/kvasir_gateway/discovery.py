"""Where the replicas are: the static `--backend` list and/or the EndpointSlices of Services.

For each `--endpoint-slices NAMESPACE/SERVICE[:PORT]` a task lists the Service's EndpointSlices
(label `kubernetes.io/service-name`), then watches them from that list's resourceVersion; a
broken or expired watch lists again. Only ready endpoints count (`conditions.ready` absent means
ready, as the API says); the address and the slice's port (the one named by PORT, else its first)
make the replica's URL. The server filters by the selector (the tests' kmock does too, as a server
would: tests/kmock_server.py). The client is lightkube's AsyncClient, as in the operator: its
credentials (in-cluster service account, kubeconfig token/exec/certs), its list and its watch
(which resumes a stream the server ends from the last version seen; an error, 410 Gone among
them, ends it and we list again).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import httpx2
import lightkube
from lightkube.config.kubeconfig import KubeConfig
from lightkube.config.models import Cluster, User
from lightkube.resources.discovery_v1 import EndpointSlice

from kvasir_gateway.config import EndpointSliceSource, GatewayConfig
from kvasir_gateway.replicas import ReplicaSet

log = logging.getLogger("kvasir_gateway.discovery")
SERVICE_LABEL = "kubernetes.io/service-name"
WATCH_SECONDS = 300  # the server ends each watch after this; we then resume from the last version


def ready_urls(slice_obj: dict[str, Any], port: int | None) -> set[str]:
    ports = [p for p in slice_obj.get("ports") or [] if isinstance(p.get("port"), int)]
    chosen = port if port is not None else (ports[0]["port"] if ports else None)
    if chosen is None:
        return set()
    urls = set()
    for endpoint in slice_obj.get("endpoints") or []:
        if (endpoint.get("conditions") or {}).get("ready") is False:
            continue
        for address in endpoint.get("addresses") or []:
            host = f"[{address}]" if ":" in address else address
            urls.add(f"http://{host}:{chosen}")
    return urls


class SliceWatch:
    def __init__(self, client: lightkube.AsyncClient, source: EndpointSliceSource,
                 on_change: Any) -> None:
        self.client, self.source, self.on_change = client, source, on_change
        self.slices: dict[str, set[str]] = {}
        self.labels = {SERVICE_LABEL: source.service}

    def urls(self) -> set[str]:
        return set().union(*self.slices.values()) if self.slices else set()

    async def list(self) -> str:
        listing = self.client.list(EndpointSlice, namespace=self.source.namespace,
                                   labels=dict(self.labels))
        slices = {}
        async for item in listing:
            obj = item.to_dict()
            slices[obj["metadata"]["name"]] = ready_urls(obj, self.source.port)
        self.slices = slices
        self.on_change()
        try:
            return str(listing.resourceVersion)
        except lightkube.NotReadyError:  # the server sent no version: watch from now
            return ""

    async def watch(self, version: str) -> None:
        async for kind, item in self.client.watch(
                EndpointSlice, namespace=self.source.namespace, labels=dict(self.labels),
                server_timeout=WATCH_SECONDS, resource_version=version or None):
            obj = item.to_dict()
            name = obj["metadata"]["name"]
            if kind == "DELETED":
                self.slices.pop(name, None)
            elif kind in ("ADDED", "MODIFIED"):
                self.slices[name] = ready_urls(obj, self.source.port)
            else:
                continue
            self.on_change()

    async def run(self) -> None:
        delay = 0.5
        while True:
            try:
                await self.watch(await self.list())
                delay = 0.5
            except (httpx2.HTTPError, ValueError, KeyError) as exc:  # lightkube.ApiError too
                log.warning("EndpointSlices of %s/%s: %s; retrying in %.1fs",
                            self.source.namespace, self.source.service,
                            str(exc) or type(exc).__name__, delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 10.0)


class Discovery:
    def __init__(self, config: GatewayConfig, replicas: ReplicaSet) -> None:
        self.config, self.replicas = config, replicas
        self.watches: list[SliceWatch] = []
        self._tasks: list[asyncio.Task[None]] = []
        self._client: lightkube.AsyncClient | None = None

    def _changed(self) -> None:
        urls = set(self.config.backends)
        for w in self.watches:
            urls |= w.urls()
        self.replicas.set_urls(urls)

    async def start(self) -> None:
        self._changed()
        if not self.config.endpoint_slices:
            return
        if self.config.kube_api_server:  # an API server that needs no credentials (tests)
            kube = KubeConfig.from_one(cluster=Cluster(server=self.config.kube_api_server),
                                       user=User())
        else:
            kube = KubeConfig.from_env()
        single = kube.get()
        if single is None:
            raise ValueError("--endpoint-slices: the kubeconfig has no current context")
        self._client = lightkube.AsyncClient(single, timeout=httpx2.Timeout(10.0),
                                             trust_env=False)
        loop = asyncio.get_running_loop()
        for source in self.config.endpoint_slices:
            watch = SliceWatch(self._client, source, self._changed)
            self.watches.append(watch)
            self._tasks.append(loop.create_task(watch.run()))

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._client is not None:
            await self._client.close()
