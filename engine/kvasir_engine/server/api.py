"""The FastAPI app: OpenAI routes, tokenizer utilities, honest probes and metrics.

`create_app` wires an already-loaded `LLMEngine` into the app; the engine thread starts with the
app's lifespan, and a warm-up generation runs before the first 200 from `/ready`. Routes are thin:
the endpoint modules do the work, `generation.py` holds what both generation routes share.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from opentelemetry.sdk.trace.export import SpanExporter
from prometheus_client import disable_created_metrics

from kvasir_engine import __version__
from kvasir_engine.config import EngineConfig, RuntimeInfo
from kvasir_engine.core.request import SamplingParams
from kvasir_engine.frontend.engine_types import RequestSpec
from kvasir_engine.frontend.kv_transfer_metrics import KVTransferCollector
from kvasir_engine.frontend.metrics import EngineMetrics
from kvasir_engine.frontend.request_group import INTERNAL_PREFIX
from kvasir_engine.server.admission import resolve_limits
from kvasir_engine.server.async_engine import AsyncEngine
from kvasir_engine.server.auth import ApiKeyMiddleware, is_bearer
from kvasir_engine.server.body_limit import BodySizeLimitMiddleware
from kvasir_engine.server.chat import create_chat_completion, encode_messages
from kvasir_engine.server.completions import create_completion
from kvasir_engine.server.config import ServerConfig
from kvasir_engine.server.errors import error_response, install_error_handlers
from kvasir_engine.server.fingerprint import system_fingerprint
from kvasir_engine.server.generation import check_in_vocab, check_model
from kvasir_engine.server.http_metrics import HttpMetrics, HttpMetricsMiddleware
from kvasir_engine.server.prefix_cache import held_blocks, prompt_block_hashes
from kvasir_engine.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeChatRequest,
    TokenizeRequest,
)
from kvasir_engine.server.responses import (
    DetokenizeResponse,
    ModelCard,
    ModelList,
    TokenizeResponse,
)
from kvasir_engine.server.state import ServerState
from kvasir_engine.server.tenants import KeyRing
from kvasir_engine.server.text_work import TextWork
from kvasir_engine.server.tracing import build_request_tracer

logger = logging.getLogger(__name__)

PROMETHEUS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def _probe_token_ids(tokenizer: Any) -> list[int]:
    ids = list(tokenizer.encode("Hello", add_special_tokens=False))
    return ids or [0]


async def warm_up(state: ServerState) -> None:
    """A short real generation (allocates, compiles, fills caches) before the first ready 200."""
    engine = state.async_engine
    spec = RequestSpec(engine.new_request_id(f"{INTERNAL_PREFIX}warmup"),
                       _probe_token_ids(state.tokenizer) * 4,
                       SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    try:
        group = await engine.add([spec])
        async for _ in group.outputs():
            pass
        engine.release(group)
    except Exception:
        logger.exception("warm-up generation failed; /ready stays 503")
        return
    state.is_warm = True
    logger.info("warm-up done; ready")


def create_app(engine_config: EngineConfig, server_config: ServerConfig, engine: Any,
               on_fatal: Callable[[str], None] | None = None,
               span_exporter: SpanExporter | None = None) -> FastAPI:
    """The app over a loaded engine. `on_fatal` is told when the engine itself failed (its
    loop died): the process owner exits then, so the orchestrator restarts it rather than
    leaving a dead engine behind an open port (launch.py). `span_exporter` replaces the OTLP
    exporter when tracing is on (tests)."""
    runtime = engine.runtime
    # No `_created` series beside every counter and histogram, as vLLM turns them off: they
    # double the series count and no dashboard reads them. The switch is prometheus_client's,
    # for the whole process; an engine server is its process's only exporter.
    disable_created_metrics()  # type: ignore[no-untyped-call]
    metrics = EngineMetrics(engine_config.model.served_model_name,
                            engine_config.model.max_model_len,
                            engine_config.scheduler.max_num_seqs,
                            max_tenant_labels=server_config.max_tenant_metric_labels,
                            cache_info=cache_config_info(engine_config, runtime),
                            num_speculative_tokens=(
                                0 if engine_config.speculative is None
                                else engine_config.speculative.num_speculative_tokens))
    metrics.reserve_tenant_labels(sorted({k.tenant_id for k in server_config.api_keys}))
    limits = resolve_limits(engine_config.scheduler,
                            max_request_sequences=server_config.max_request_sequences,
                            max_waiting_seqs_per_tenant=server_config.max_waiting_seqs_per_tenant,
                            is_multi_tenant=server_config.is_multi_tenant)
    async_engine = AsyncEngine(engine, metrics, limits=limits,
                               probe_token_ids=_probe_token_ids(engine.tokenizer),
                               on_death=on_fatal)
    state = ServerState(engine_config=engine_config, server_config=server_config,
                        async_engine=async_engine, tokenizer=engine.tokenizer, metrics=metrics,
                        system_fingerprint=system_fingerprint(engine_config, runtime.device),
                        fit_error=engine.fit_error,
                        admission_limits=limits, kernels=dict(runtime.kernels),
                        text_work=TextWork(engine.tokenizer,
                                           engine_config.model.max_model_len),
                        prefix_cache_view=(engine.prefix_cache_view
                                           if engine_config.cache.enable_prefix_caching
                                           else None),
                        kv_connector=getattr(engine, "kv_connector", None),
                        tracer=build_request_tracer(server_config.tracing,
                                                    engine_config.model.served_model_name,
                                                    span_exporter))

    if state.kv_connector is not None:  # released holds are freed by a step, even when idle
        state.kv_connector.set_wake(async_engine.engine_thread.poke)
        metrics.registry.register(KVTransferCollector(state.kv_connector,
                                                      engine_config.model.served_model_name))

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        async_engine.start()
        warm = (asyncio.get_running_loop().create_task(warm_up(state))
                if server_config.warmup else None)
        if warm is None:
            state.is_warm = True
        try:
            yield
        finally:
            if warm is not None:
                warm.cancel()
            async_engine.stop()
            state.text_work.shutdown()
            if state.tracer is not None:
                state.tracer.shutdown()  # the batched spans still held go out

    app = FastAPI(title="Kvasir engine", version=__version__, lifespan=lifespan)
    app.state.kvasir = state
    install_error_handlers(app)
    # The middleware added last runs first: the key is checked from the headers before any
    # body is read, so nobody without a key gets a byte buffered; then the size limit.
    app.add_middleware(BodySizeLimitMiddleware, max_body_bytes=server_config.max_body_bytes,
                       body_timeout_s=server_config.request_body_timeout_seconds)
    app.add_middleware(ApiKeyMiddleware, api_keys=KeyRing(server_config.api_keys),
                       gateway_keys=KeyRing(server_config.trusted_gateway_keys),
                       body_timeout_s=server_config.request_body_timeout_seconds)
    # Outermost: every answer is counted, the refusals of the two above included.
    app.add_middleware(HttpMetricsMiddleware, metrics=HttpMetrics(metrics.registry),
                       routes=app.router.routes)
    _add_routes(app, state)
    return app


def cache_config_info(engine_config: EngineConfig, runtime: RuntimeInfo) -> dict[str, str]:
    """The labels of vllm:cache_config_info: the CacheConfig fields vLLM's has and Kvasir's
    means the same by (vLLM's names; its offloading and CPU-swap fields have no counterpart)."""
    cache = engine_config.cache
    return {"block_size": str(runtime.block_size),
            "cache_dtype": cache.kv_cache_dtype,
            "enable_prefix_caching": str(cache.enable_prefix_caching),
            "gpu_memory_utilization": str(cache.gpu_memory_utilization),
            "num_gpu_blocks": str(runtime.num_kv_blocks),
            "prefix_caching_hash_algo": "sha256"}


def _add_routes(app: FastAPI, state: ServerState) -> None:
    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, http_request: Request) -> Response:
        return await create_completion(state, req, http_request)

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, http_request: Request) -> Response:
        return await create_chat_completion(state, req, http_request)

    @app.get("/v1/models")
    async def models() -> ModelList:
        # The checkpoint's own name, not where it lies on this host.
        return ModelList(data=[ModelCard(id=state.model_name, created=state.created,
                                         root=Path(state.engine_config.model.model).name,
                                         max_model_len=state.max_model_len)])

    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest) -> TokenizeResponse:
        check_model(state, req.model)
        if isinstance(req, TokenizeChatRequest):
            ids = await state.text_work.run(encode_messages, state, req.messages,
                                            req.add_generation_prompt)
        else:
            state.text_work.check_fits(len(req.prompt), "prompt")
            ids = await state.text_work.run(state.tokenizer.encode, req.prompt,
                                            req.add_special_tokens)
        return TokenizeResponse(tokens=ids, count=len(ids), max_model_len=state.max_model_len)

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest) -> DetokenizeResponse:
        check_model(state, req.model)
        check_in_vocab(state, req.tokens, "tokens")
        return DetokenizeResponse(prompt=str(await state.text_work.run(state.tokenizer.decode,
                                                                       req.tokens)))

    @app.get("/kvasir/prefix-cache")
    async def prefix_cache(http_request: Request) -> dict[str, object]:
        return held_blocks(state, http_request)

    @app.post("/kvasir/prefix-hashes/completions")
    async def completion_hashes(req: CompletionRequest,
                                http_request: Request) -> dict[str, object]:
        return await state.text_work.run(prompt_block_hashes, state, http_request, req)

    @app.post("/kvasir/prefix-hashes/chat/completions")
    async def chat_hashes(req: ChatCompletionRequest,
                          http_request: Request) -> dict[str, object]:
        return await state.text_work.run(prompt_block_hashes, state, http_request, req)

    @app.get("/version")
    async def version() -> dict[str, object]:
        # kv_role: what the gateway routes by (docs/gateway.md, "Disaggregated prefill and
        # decode"): "kv_producer", "kv_consumer", "kv_both", or None without a KV transfer.
        transfer = state.engine_config.kv_transfer
        return {"version": __version__, "kernels": state.kernels,
                "kv_role": None if transfer is None else transfer.kv_role}

    # HEAD too, as vLLM answers it: load balancers and uptime checks probe with HEAD.
    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health() -> Response:
        ok, reason = state.async_engine.health(state.server_config.health_stall_seconds)
        body = {"status": "ok" if ok else "unhealthy", "reason": reason,
                **state.async_engine.snapshot()}
        return JSONResponse(body, status_code=200 if ok else 503)

    @app.api_route("/ready", methods=["GET", "HEAD"])
    async def ready() -> Response:
        if state.is_draining:
            return error_response(503, "draining: the server is shutting down", code="draining")
        if not state.is_warm:
            return error_response(503, "warming up", code="not_ready")
        ok, reason = await state.async_engine.probe_ready(
            state.server_config.ready_timeout_seconds, state.server_config.ready_recent_seconds)
        if not ok:
            return error_response(503, reason, code="not_ready")
        return JSONResponse({"status": "ready"})

    @app.api_route("/metrics", methods=["GET", "HEAD"])
    async def metrics(http_request: Request) -> Response:
        token = state.server_config.metrics_token
        if token is not None and not is_bearer(http_request, token):
            return error_response(401, "/metrics needs 'Authorization: Bearer <token>' "
                                       "(--metrics-token)", code="invalid_api_key",
                                  headers={"WWW-Authenticate": "Bearer"})
        return Response(state.metrics.render(), media_type=PROMETHEUS_CONTENT_TYPE)
