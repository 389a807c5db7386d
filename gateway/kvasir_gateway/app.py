"""The gateway's ASGI app: its state (`Gateway`) and routes, started and stopped by the lifespan.

Routes: `/v1/completions` and `/v1/chat/completions` (proxy.py), `/v1/models` (the union of the
ready replicas' models, then the routing file's aliases), `/health` (the process is alive), `/ready` (at least one replica can
take requests), `/metrics`. Every refusal is OpenAI's error shape, unknown paths included.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from kvasir_gateway.config import ANONYMOUS_TENANT, GatewayConfig
from kvasir_gateway.cost import CostModel
from kvasir_gateway.discovery import Discovery
from kvasir_gateway.errors import GatewayError, error_response
from kvasir_gateway.metrics import GatewayMetrics
from kvasir_gateway.proxy import ProxyRoute
from kvasir_gateway.quota import MemoryQuotaStore, QuotaStore
from kvasir_gateway.redis_quota import RedisQuotaStore
from kvasir_gateway.replicas import ReplicaSet
from kvasir_gateway.router import PrefixIndex
from kvasir_gateway.routing_file import RoutingFile
from kvasir_gateway.shadow import ShadowSampler
from kvasir_gateway.tenants import KeyFile

log = logging.getLogger("kvasir_gateway")
TENANT_HEADER = "x-kvasir-tenant"
# Below uvicorn's default keep-alive (5 s), which the engines (ours and vLLM) serve with.
UPSTREAM_KEEPALIVE_SECONDS = 4.0


class Gateway:
    """Everything the routes share; built before the app starts, its tasks run by `lifespan`."""

    def __init__(self, config: GatewayConfig) -> None:
        self.config = config
        self.metrics = GatewayMetrics(config.max_tenant_labels)
        self.keys = KeyFile(config.api_key_file) if config.api_key_file else None
        self.store: QuotaStore = (
            RedisQuotaStore(config.redis_url, self.metrics,
                            timeout_seconds=config.redis_timeout_seconds,
                            fail_open=config.redis_fail_open, lease_seconds=config.lease_seconds)
            if config.redis_url else MemoryQuotaStore(config.lease_seconds))
        auth = {"authorization": f"Bearer {config.upstream_key}"} if config.upstream_key else {}
        self.replicas = ReplicaSet(self.metrics, headers=auth,
                                   probe_interval=config.probe_interval_seconds,
                                   probe_timeout=config.probe_timeout_seconds,
                                   eject_seconds=config.eject_seconds,
                                   failure_threshold=config.probe_failure_threshold,
                                   poll_prefix_cache=config.routing == "precise")
        self.prefix_index = PrefixIndex(config.prefix_index_entries)
        # precise routing: the engines' block hashes sent lately, not yet reported (precise.py)
        self.pending_index = PrefixIndex(config.prefix_index_entries,
                                         horizon_seconds=config.prefix_pending_seconds)
        self.routing_file = (RoutingFile(config.routing_file, config.routing_table)
                             if config.routing_file else None)
        self.routing_table = config.routing_table  # in force now (routing_file.py reloads it)
        self.costs = CostModel(config.routing_table.pools, self.replicas)
        self.metrics.registry.register(self.costs)
        self.shadows = ShadowSampler(self)
        self.turns = itertools.count()  # round-robin's position (the comparison policy)
        self.open_leases: dict[str, str] = {}  # lease id -> tenant, of requests running now
        self.discovery = Discovery(config, self.replicas)
        self._client: aiohttp.ClientSession | None = None  # made in the lifespan (its loop)

    def authenticate(self, authorization: str) -> str:
        if self.keys is None:
            return ANONYMOUS_TENANT
        scheme, _, token = authorization.partition(" ")
        if not authorization:
            raise GatewayError(401, "missing API key: send 'Authorization: Bearer <key>'",
                               code="invalid_api_key")
        tenant = self.keys.ring.tenant_for(token.strip()) if scheme.lower() == "bearer" else None
        if tenant is None:
            raise GatewayError(401, "invalid API key", code="invalid_api_key")
        return tenant

    def upstream_headers(self, tenant: str) -> dict[str, str]:
        """The engine trusts the tenant header only with the gateway's own key."""
        if not self.config.upstream_key:
            return {}
        return {"authorization": f"Bearer {self.config.upstream_key}", TENANT_HEADER: tenant}

    def models(self) -> list[dict[str, Any]]:
        """The ready replicas' models, then every alias with the pools it may route to."""
        entries = self.replicas.models()
        served = {str(e.get("id")) for e in entries}
        for name in sorted(self.routing_table.aliases):
            alias = self.routing_table.aliases[name]
            if name not in served:
                entries.append({"id": name, "object": "model", "owned_by": "kvasir-gateway",
                                "created": 0, "kvasir_alias_of": sorted(alias.pools)})
        return entries

    def no_replica_error(self, model: str) -> GatewayError:
        routable = self.replicas.routable()
        if routable and not any(model in r.model_ids for r in routable):
            served = sorted({m for r in routable for m in r.model_ids})
            return GatewayError(404, f"model {model!r} is not served here (served: "
                                     f"{', '.join(served)})", param="model",
                                code="model_not_found")
        return GatewayError(503, f"no ready replica for model {model!r} "
                                 f"({len(self.replicas.replicas)} known, none ready)",
                            code="no_ready_replica", headers={"retry-after": "1"})

    async def _reload_keys(self) -> None:
        while self.keys is not None:
            await asyncio.sleep(self.config.key_reload_seconds)
            if self.keys.refresh():
                self.metrics.key_reloads.inc()

    async def _reload_routing(self) -> None:
        while self.routing_file is not None:
            await asyncio.sleep(self.config.key_reload_seconds)
            outcome = self.routing_file.refresh()
            if outcome is None:
                continue
            self.metrics.routing_reloads.labels("ok" if outcome else "error").inc()
            if outcome:
                self.routing_table = self.routing_file.table
                self.costs.pools = self.routing_table.pools

    async def _renew_leases(self) -> None:
        while True:
            await asyncio.sleep(self.config.lease_seconds / 3)
            tenant_to_leases: dict[str, list[str]] = {}
            for lease_id, tenant in self.open_leases.items():
                tenant_to_leases.setdefault(tenant, []).append(lease_id)
            if tenant_to_leases:
                await self.store.renew(tenant_to_leases)

    @property
    def client(self) -> aiohttp.ClientSession:
        if self._client is None:
            raise RuntimeError("the gateway's upstream client exists only while the app runs")
        return self._client

    def _session(self) -> aiohttp.ClientSession:
        """The upstream client: aiohttp (its C parser costs ~1 ms less a request than httpx's
        h11 here). Long generations: no overall deadline, but a connection must open fast and a
        replica that sends nothing for 300 s is given up. No pool limit: 1,000 streams are 1,000
        connections. Idle connections are dropped after `UPSTREAM_KEEPALIVE_SECONDS`, before
        the engine's uvicorn closes them (5 s, vLLM's too): reusing one the server is closing
        just then resets it, which ejected a healthy replica."""
        timeout = aiohttp.ClientTimeout(total=None, connect=self.config.connect_timeout_seconds,
                                        sock_read=300.0)
        return aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=UPSTREAM_KEEPALIVE_SECONDS),
            timeout=timeout, auto_decompress=False, skip_auto_headers=("User-Agent",),
            headers={"content-type": "application/json"})

    @contextlib.asynccontextmanager
    async def lifespan(self, app: Starlette) -> AsyncIterator[None]:
        self._client = self._session()
        self.replicas.open()
        await self.discovery.start()
        await self.replicas.probe_all()  # ready at once when the replicas are
        self.replicas.start()
        loop = asyncio.get_running_loop()
        tasks = [loop.create_task(self._reload_keys()), loop.create_task(self._renew_leases()),
                 loop.create_task(self._reload_routing())]
        try:
            yield
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await self.shadows.close()
            await self.discovery.close()
            await self.replicas.close()
            await self.client.close()
            await self.store.close()


def create_app(config: GatewayConfig) -> Starlette:
    gateway = Gateway(config)

    async def models(request: Request) -> Response:
        gateway.authenticate(request.headers.get("authorization", ""))
        return JSONResponse({"object": "list", "data": gateway.models()})

    async def health(request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def ready(request: Request) -> Response:
        n = len(gateway.replicas.routable())
        if n == 0:
            raise GatewayError(503, f"no ready replica ({len(gateway.replicas.replicas)} known)",
                               code="no_ready_replica")
        return JSONResponse({"status": "ready", "replicas": n})

    async def metrics(request: Request) -> Response:
        return Response(generate_latest(gateway.metrics.registry),
                        media_type=CONTENT_TYPE_LATEST)

    async def on_gateway_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, GatewayError)
        return error_response(exc)

    async def on_http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        return error_response(GatewayError(exc.status_code, str(exc.detail)))

    routes = [
        Route("/v1/completions", ProxyRoute(gateway, chat=False), methods=["POST"]),
        Route("/v1/chat/completions", ProxyRoute(gateway, chat=True), methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/ready", ready, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
    ]
    app = Starlette(routes=routes, lifespan=gateway.lifespan,
                    exception_handlers={GatewayError: on_gateway_error,
                                        HTTPException: on_http_error})
    app.state.gateway = gateway
    return app
