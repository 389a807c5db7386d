"""The gateway's ASGI app: builds the `GatewayContext` and the routes, runs the background tasks.

The one module that knows every part: it builds them once from the config (the routing policy's
router among them, chosen here and nowhere else), hands the request path one frozen
`GatewayContext` (context.py), and keeps the parts fresh while the app runs (the key file, the
routing file, the open leases' renewal, discovery and the probes). Nothing imports this module
but main.py.

Routes: `/v1/completions` and `/v1/chat/completions` (proxy.py), `/v1/models` (the union of the
ready replicas' models, then the routing file's aliases), `/health` (the process is alive),
`/ready` (at least one replica can take requests), `/metrics`. Every refusal is OpenAI's error
shape, unknown paths included.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

from opentelemetry.sdk.trace.export import SpanExporter
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from kvasir_gateway.client import UpstreamClient
from kvasir_gateway.config import GatewayConfig
from kvasir_gateway.context import GatewayContext
from kvasir_gateway.cost import CostModel
from kvasir_gateway.discovery import Discovery
from kvasir_gateway.errors import GatewayError, error_response
from kvasir_gateway.metrics import GatewayMetrics
from kvasir_gateway.placement import LeastLoadRouter, PrefixRouter, RoundRobinRouter, Router
from kvasir_gateway.precise import PreciseRouter
from kvasir_gateway.proxy import ProxyRoute
from kvasir_gateway.quota import MemoryQuotaStore, OpenLeases, QuotaStore
from kvasir_gateway.redis_quota import RedisQuotaStore
from kvasir_gateway.replicas import ReplicaSet
from kvasir_gateway.router import PrefixIndex, RoutingPolicy
from kvasir_gateway.routing_file import RoutingFile
from kvasir_gateway.shadow import ShadowSampler
from kvasir_gateway.tenants import KeyFile, authenticate
from kvasir_gateway.tracing import build_provider

log = logging.getLogger("kvasir_gateway")


def build_router(config: GatewayConfig, client: UpstreamClient, metrics: GatewayMetrics,
                 replicas: ReplicaSet, index: PrefixIndex | None = None) -> Router:
    """The routing policy's router: the one place that tests `--routing`. `index`: where
    this gateway's sendings are recorded (a new one when None)."""
    index = PrefixIndex(config.prefix_index_entries) if index is None else index
    if config.routing is RoutingPolicy.PRECISE:
        # the engines' block hashes sent lately, not yet reported (precise.py)
        pending = PrefixIndex(config.prefix_index_entries,
                              horizon_seconds=config.prefix_pending_seconds)
        return PreciseRouter(config, client, metrics, replicas, index, pending)
    if config.routing is RoutingPolicy.ROUND_ROBIN:
        return RoundRobinRouter(config, index)
    if config.routing is RoutingPolicy.LEAST_LOAD:
        return LeastLoadRouter(config, index)
    return PrefixRouter(config, index)


def build_context(config: GatewayConfig,
                  span_exporter: SpanExporter | None = None) -> GatewayContext:
    metrics = GatewayMetrics(config.max_tenant_labels)
    keys = KeyFile(config.api_key_file) if config.api_key_file else None
    store: QuotaStore = (
        RedisQuotaStore(config.redis_url, metrics,
                        timeout_seconds=config.redis_timeout_seconds,
                        fail_open=config.redis_fail_open, lease_seconds=config.lease_seconds)
        if config.redis_url else MemoryQuotaStore(config.lease_seconds))
    auth = {"authorization": f"Bearer {config.upstream_key}"} if config.upstream_key else {}
    replicas = ReplicaSet(metrics, headers=auth,
                          probe_interval=config.probe_interval_seconds,
                          probe_timeout=config.probe_timeout_seconds,
                          eject_seconds=config.eject_seconds,
                          failure_threshold=config.probe_failure_threshold,
                          poll_prefix_cache=config.routing is RoutingPolicy.PRECISE)
    client = UpstreamClient(config.upstream_key, config.connect_timeout_seconds)
    index = PrefixIndex(config.prefix_index_entries)
    router = build_router(config, client, metrics, replicas, index)
    routing_file = (RoutingFile(config.routing_file, config.routing_table)
                    if config.routing_file else None)
    costs = CostModel(config.routing_table.pools, replicas)
    metrics.registry.register(costs)
    provider = build_provider(config.otlp_traces_endpoint, config.otlp_traces_protocol,
                              config.otlp_traces_sample_ratio, config.service_name,
                              span_exporter)
    return GatewayContext(config=config, metrics=metrics, keys=keys, store=store,
                          leases=OpenLeases(), replicas=replicas, router=router,
                          decode_router=LeastLoadRouter(config, index),
                          routing_file=routing_file, costs=costs, client=client,
                          tracer=None if provider is None else provider.get_tracer("kvasir_gateway"),
                          tracer_provider=provider)


async def _reload_keys(ctx: GatewayContext) -> None:
    while ctx.keys is not None:
        await asyncio.sleep(ctx.config.key_reload_seconds)
        if ctx.keys.refresh():
            ctx.metrics.key_reloads.inc()


async def _reload_routing(ctx: GatewayContext) -> None:
    while ctx.routing_file is not None:
        await asyncio.sleep(ctx.config.key_reload_seconds)
        outcome = ctx.routing_file.refresh()
        if outcome is None:
            continue
        ctx.metrics.routing_reloads.labels("ok" if outcome else "error").inc()
        if outcome:
            ctx.costs.pools = ctx.routing_file.table.pools


async def _renew_leases(ctx: GatewayContext) -> None:
    while True:
        await asyncio.sleep(ctx.config.lease_seconds / 3)
        tenant_to_leases = ctx.leases.tenant_to_leases()
        if tenant_to_leases:
            await ctx.store.renew(tenant_to_leases)


def lifespan(ctx: GatewayContext, shadows: ShadowSampler, discovery: Discovery
             ) -> Callable[[Starlette], contextlib.AbstractAsyncContextManager[None]]:
    @contextlib.asynccontextmanager
    async def run(app: Starlette) -> AsyncIterator[None]:
        ctx.client.open()
        ctx.replicas.open()
        await discovery.start()
        await ctx.replicas.probe_all()  # ready at once when the replicas are
        ctx.replicas.start()
        loop = asyncio.get_running_loop()
        tasks = [loop.create_task(_reload_keys(ctx)), loop.create_task(_renew_leases(ctx)),
                 loop.create_task(_reload_routing(ctx))]
        try:
            yield
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await shadows.close()
            await discovery.close()
            await ctx.replicas.close()
            await ctx.client.close()
            await ctx.store.close()
            if ctx.tracer_provider is not None:
                ctx.tracer_provider.shutdown()  # the batched spans still held go out

    return run


def models(ctx: GatewayContext) -> list[dict[str, Any]]:
    """The ready replicas' models, then every alias with the pools it may route to."""
    entries = ctx.replicas.models()
    served = {str(e.get("id")) for e in entries}
    table = ctx.routing_table
    for name in sorted(table.aliases):
        alias = table.aliases[name]
        if name not in served:
            entries.append({"id": name, "object": "model", "owned_by": "kvasir-gateway",
                            "created": 0, "kvasir_alias_of": sorted(alias.pools)})
    return entries


def create_app(config: GatewayConfig, span_exporter: SpanExporter | None = None) -> Starlette:
    """`span_exporter` replaces the OTLP exporter when tracing is on (tests)."""
    ctx = build_context(config, span_exporter)
    shadows = ShadowSampler(ctx)
    discovery = Discovery(config, ctx.replicas)

    async def list_models(request: Request) -> Response:
        authenticate(ctx.keys, request.headers.get("authorization", ""))
        return JSONResponse({"object": "list", "data": models(ctx)})

    async def health(request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def ready(request: Request) -> Response:
        n = len(ctx.replicas.routable())
        if n == 0:
            raise GatewayError(503, f"no ready replica ({len(ctx.replicas.replicas)} known)",
                               code="no_ready_replica")
        return JSONResponse({"status": "ready", "replicas": n})

    async def metrics(request: Request) -> Response:
        return Response(generate_latest(ctx.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    async def on_gateway_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, GatewayError)
        return error_response(exc)

    async def on_http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        return error_response(GatewayError(exc.status_code, str(exc.detail)))

    routes = [
        Route("/v1/completions", ProxyRoute(ctx, shadows, chat=False), methods=["POST"]),
        Route("/v1/chat/completions", ProxyRoute(ctx, shadows, chat=True), methods=["POST"]),
        Route("/v1/models", list_models, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/ready", ready, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
    ]
    app = Starlette(routes=routes, lifespan=lifespan(ctx, shadows, discovery),
                    exception_handlers={GatewayError: on_gateway_error,
                                        HTTPException: on_http_error})
    app.state.gateway = ctx  # tests and bench/ read the gateway's state here
    app.state.shadows = shadows
    return app
