"""One proxied request: authenticate, check the body, admit against the quota, route, stream.

Raw ASGI rather than a Starlette response, for two reasons: the upstream response is written to
the client event by event as it arrives, and a watcher task waits for the client's
`http.disconnect` the whole time, from the body read until the last byte (also while the gateway
still waits for the engine's headers), and cancels the exchange at once, which closes the
upstream connection, so the engine aborts the request. Retries happen only before the first byte
went to the client: a connection that fails (the replica is ejected) or a 502/503/504 answer
moves the request to another replica, up to `max_attempts` (a 503 with no other replica left
goes to the client as the engine sent it).

A `model` that is an alias of the routing file is resolved first (aliases.py): its rule picks a
pool, or a cascade whose cheaper pools are asked and checked whole (cascade.py) before the last
one is relayed as above; the answer names its model (`x-kvasir-model`) and rule
(`x-kvasir-route`), and a sample of the small pools' answers is shadowed (shadow.py).

The reservation is settled exactly once, in a shielded `finally`: with the usage the engine
reported, or (no usage: the client left, the upstream broke) the prompt estimate plus the
chunks already relayed, or nothing when no replica answered; plus what a cascade's escalated
attempts used. The proxy owns the request's `Exchange` (exchange.py), which records all that.

A pool with prefill and decode replicas (disaggregation.py) answers in two stages: the prompt
on a prefill replica first (`upstream.remote_prefill`, not charged, never streamed), then the
request with its `kv_transfer_params` on a decode replica, relayed and settled as any request's
only call; short prompts, a long prefill queue, or a prefill stage that failed leave the prompt
to the decode replica (`_disaggregated`).

The proxy reads the gateway through the `GatewayContext` app.py hands it (context.py), and the
shadows through the `ShadowSampler` app.py made.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import MutableMapping
from typing import Any

import aiohttp
import anyio
from opentelemetry.trace import Span, SpanKind, StatusCode, get_current_span
from starlette.types import Receive, Scope, Send

from kvasir_gateway.aliases import Route, resolve
from kvasir_gateway.body import ParsedRequest, parse_request_off_loop, read_body, reservation
from kvasir_gateway.cascade import (
    NO_ANSWER,
    Verdict,
    account_cost,
    attempt_body,
    judge,
    send_buffered,
)
from kvasir_gateway.checks import CascadeChecks
from kvasir_gateway.context import GatewayContext
from kvasir_gateway.disaggregation import LOCAL, REMOTE, decide
from kvasir_gateway.errors import GatewayError, send_error
from kvasir_gateway.exchange import Exchange
from kvasir_gateway.quota import UNLIMITED, refusal_error
from kvasir_gateway.replicas import Stage
from kvasir_gateway.shadow import ShadowSampler
from kvasir_gateway.sse import StreamUsage, json_object
from kvasir_gateway.tenants import authenticate
from kvasir_gateway.tracing import parent_context, span
from kvasir_gateway.upstream import Upstream, open_upstream, remote_prefill

log = logging.getLogger("kvasir_gateway.proxy")
MODEL_HEADER = "x-kvasir-model"  # the pool (model) that answered
ROUTE_HEADER = "x-kvasir-route"  # the alias's rule that chose it ("default" when none did)
ESCALATIONS_HEADER = "x-kvasir-escalations"  # "small=logprob,...": the checks that failed
# The engine's own headers worth passing on (a queue-full 429's Retry-After, its request id).
PASSED_HEADERS = ("retry-after", "x-request-id")


class ProxyRoute:
    """The ASGI endpoint of /v1/completions and /v1/chat/completions."""

    def __init__(self, ctx: GatewayContext, shadows: ShadowSampler, chat: bool) -> None:
        self.ctx, self.shadows, self.chat = ctx, shadows, chat

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
        tracer = self.ctx.tracer
        parent = None if tracer is None else parent_context(headers)
        with span(tracer, "gateway.request", SpanKind.SERVER, parent) as root:
            await self._serve(scope, receive, send, headers, root)

    async def _serve(self, scope: Scope, receive: Receive, send: Send, headers: dict[str, str],
                     root: Span | None) -> None:
        ctx, tenant = self.ctx, "unauthenticated"
        sent: list[int] = []

        async def tracked_send(message: MutableMapping[str, Any]) -> None:
            if message["type"] == "http.response.start":
                sent.append(message["status"])
            await send(message)

        try:
            if scope["method"] != "POST":
                raise GatewayError(405, f"{scope['path']} accepts POST only")
            with span(ctx.tracer, "gateway.auth"):
                tenant = authenticate(ctx.keys, headers.get("authorization", ""))
            raw = await read_body(receive, headers, ctx.config.max_body_bytes)
            request = await parse_request_off_loop(raw, self.chat, ctx.config.chars_per_token)
            if root is not None:
                root.set_attribute("gen_ai.request.model", str(request.body["model"]))
            await self._admitted(scope, receive, tracked_send, tenant, request, headers)
        except GatewayError as exc:
            if not sent and exc.status != 499:
                await send_error(tracked_send, exc)
        except Exception:  # a bug of ours: still OpenAI's shape, and a traceback in the log
            log.exception("proxying %s failed", scope["path"])
            if not sent:
                await send_error(tracked_send, GatewayError(500, "internal gateway error"))
        finally:
            code = str(sent[0]) if sent else "499"
            ctx.metrics.requests.labels(ctx.metrics.tenant_label(tenant), code).inc()
            if root is not None:
                root.set_attributes({"http.route": scope["path"], "kvasir.tenant": tenant,
                                     "http.response.status_code": int(code)})
                if int(code) >= 500:
                    root.set_status(StatusCode.ERROR)

    async def _admitted(self, scope: Scope, receive: Receive, send: Send, tenant: str,
                        request: ParsedRequest, headers: dict[str, str]) -> None:
        ctx, cfg, body = self.ctx, self.ctx.config, request.body
        model = str(body["model"])
        exchange = Exchange(request.prompt_tokens)
        alias = ctx.routing_table.aliases.get(model)
        route = resolve(alias, body, request.prompt_tokens, tenant, headers) if alias else None
        if route is not None and ctx.tracer is not None:
            get_current_span().set_attribute("kvasir.route.rule", route.rule)
        models = route.models if route else (model,)
        if not any(m in r.model_ids for r in ctx.replicas.routable() for m in models):
            # before admission: costs the tenant nothing
            error = ctx.replicas.no_replica_error(models[0])
            if route is not None:
                error.message = f"alias {model!r} (rule {route.rule}): {error.message}"
            raise error
        limits = cfg.limits_for(tenant)
        cost = reservation(request, cfg.default_max_tokens)
        lease_id = uuid.uuid4().hex
        # No limit, nothing to count: no store call, so Redis down never delays or refuses it.
        with span(ctx.tracer, "gateway.quota") as quota_span:
            admission = (UNLIMITED if limits.is_unlimited
                         else await ctx.store.admit(tenant, limits, cost, lease_id))
            if quota_span is not None:
                quota_span.set_attributes({"kvasir.quota.reserved_tokens": cost,
                                           "kvasir.quota.allowed": admission.allowed,
                                           "kvasir.quota.unlimited": limits.is_unlimited})
                if admission.refused_by is not None:
                    quota_span.set_attribute("kvasir.quota.refused_by", admission.refused_by)
        label = ctx.metrics.tenant_label(tenant)
        if limits.tokens_per_minute > 0 and admission.enforced:
            ctx.metrics.quota_remaining.labels(label).set(max(0.0, admission.tokens_remaining))
        if not admission.allowed:
            ctx.metrics.tokens_refused.labels(label, admission.refused_by or "store").inc(cost)
            raise refusal_error(admission, cost)
        stream = StreamUsage(keep_usage=bool((body.get("stream_options") or {})
                                             .get("include_usage")))
        refusal: GatewayError | None = None
        if limits.max_concurrent > 0:
            ctx.leases.open(lease_id, tenant)
        try:
            async with anyio.create_task_group() as tg:
                async def watch_disconnect() -> None:
                    while (await receive())["type"] != "http.disconnect":
                        pass
                    tg.cancel_scope.cancel()

                tg.start_soon(watch_disconnect)
                try:
                    await self._forward(scope, send, tenant, body, route,
                                        admission.headers(), stream, exchange)
                except GatewayError as exc:  # raised below, not wrapped in an ExceptionGroup
                    refusal = exc
                tg.cancel_scope.cancel()
            if refusal is not None:
                raise refusal
        finally:
            used = exchange.tokens_to_settle(stream.used_tokens, stream.num_chunks)
            ctx.leases.close(lease_id)
            if not limits.is_unlimited:
                with anyio.CancelScope(shield=True):
                    await ctx.store.settle(tenant, limits, used - cost, lease_id,
                                           admission.window_second)
            ctx.metrics.tokens_admitted.labels(label).inc(used)

    async def _forward(self, scope: Scope, send: Send, tenant: str, body: dict[str, Any],
                       route: Route | None, quota_headers: dict[str, str], stream: StreamUsage,
                       exchange: Exchange) -> None:
        if route is None:
            await self._relay_from(scope, send, tenant, body, str(body["model"]),
                                   quota_headers, stream, exchange)
            return
        metrics, alias = self.ctx.metrics, route.alias
        extra = {**quota_headers, ROUTE_HEADER: route.rule}
        started = time.perf_counter()
        escalations = []
        for model in route.models[:-1]:
            verdict = await self._attempt(scope["path"], tenant, body, model, alias.checks,
                                          exchange)
            if verdict.failed is None and verdict.answer is not None:
                exchange.answered_whole(verdict.answer, verdict.used_tokens,
                                        verdict.num_completion_tokens)
                await send_buffered(send, verdict.answer, self.chat, body, model, extra)
                self._finish(scope, route, model, tenant, body, exchange)
                return
            metrics.escalations.labels(alias.name, model, verdict.failed or "error").inc()
            escalations.append(f"{model}={verdict.failed or 'error'}")
            extra[ESCALATIONS_HEADER] = ",".join(escalations)
        model = route.models[-1]
        if len(route.models) > 1:
            metrics.escalation_added.labels(alias.name).observe(time.perf_counter() - started)
        if alias.shadow.fraction > 0 and model != alias.shadow.model:
            stream.texts = []
        await self._relay_from(scope, send, tenant, body, model, extra, stream, exchange)
        if exchange.status == 200:
            exchange.streamed(stream.completion_tokens,
                              "".join(stream.texts) if stream.texts is not None else None)
            self._finish(scope, route, model, tenant, body, exchange)

    async def _attempt(self, path: str, tenant: str, body: dict[str, Any], model: str,
                       checks: CascadeChecks, exchange: Exchange) -> Verdict:
        """A cascade's cheaper pool, asked for its whole answer and judged (cascade.py). A
        failing answer is charged; a passing one is the exchange's once it is sent."""
        upstream_body, stage = await self._disaggregated(
            path, tenant, attempt_body(body, model, self.chat, checks), exchange.prompt_tokens)
        try:
            async with open_upstream(self.ctx, path, tenant, upstream_body,
                                     exchange.prompt_tokens, stage=stage) as upstream:
                exchange.hold_prompt()  # the engine read the prompt
                response = upstream.response
                data = await response.read()
        except GatewayError:
            return NO_ANSWER
        exchange.release_prompt()
        verdict = judge(response.status, data, checks, exchange.prompt_tokens)
        if verdict.failed is not None and verdict.answer is not None:
            exchange.escalated(model, verdict.used_tokens, verdict.num_completion_tokens)
        return verdict

    def _finish(self, scope: Scope, route: Route, model: str, tenant: str, body: dict[str, Any],
                exchange: Exchange) -> None:
        ctx = self.ctx
        ctx.metrics.pool_requests.labels(route.alias.name, route.rule, model).inc()
        account_cost(ctx.costs, ctx.metrics, route.alias, exchange.finish(model))
        if exchange.answer is not None:
            self.shadows.maybe_shadow(route, model, scope["path"], tenant, body,
                                      exchange.prompt_tokens, exchange.answer)

    async def _relay_from(self, scope: Scope, send: Send, tenant: str, body: dict[str, Any],
                          model: str, extra_headers: dict[str, str], stream: StreamUsage,
                          exchange: Exchange) -> None:
        upstream_body = {**body, "model": model}
        if body.get("stream"):
            upstream_body["stream_options"] = {**(body.get("stream_options") or {}),
                                               "include_usage": True}
        upstream_body, stage = await self._disaggregated(scope["path"], tenant, upstream_body,
                                                         exchange.prompt_tokens)
        async with open_upstream(self.ctx, scope["path"], tenant, upstream_body,
                                 exchange.prompt_tokens, stage=stage) as upstream:
            exchange.replica_answered()
            try:
                await self._relay(upstream, send, {**extra_headers, MODEL_HEADER: model},
                                  stream, exchange, bool(body.get("stream")))
            except (aiohttp.ClientError, TimeoutError) as exc:  # broke off mid-answer
                self.ctx.metrics.upstream_errors.labels("broken").inc()
                log.warning("a replica of %s broke off a response: %s", model,
                            str(exc) or type(exc).__name__)
                if not exchange.is_started:
                    raise GatewayError(502, f"a replica of {model!r} broke off its answer",
                                       code="upstream_error") from None
                await send({"type": "http.response.body", "body": b""})
                exchange.cut_off()
            except OSError:  # the client went away while we wrote (uvicorn says so)
                log.info("client left during a response from %s", model)
                exchange.cut_off()

    async def _disaggregated(self, path: str, tenant: str, body: dict[str, Any],
                             prompt_tokens: int) -> tuple[dict[str, Any], Stage]:
        """The body and stage of a pool's answering call: with a prefill replica's
        `kv_transfer_params` for a decode replica, or as it was for the replica that computes
        the prompt itself (a pool without roles: any replica, as without disaggregation)."""
        ctx, model = self.ctx, str(body["model"])
        decision = decide(ctx.config.disaggregation, ctx.config.disaggregation_min_prompt_tokens,
                          prompt_tokens, body, ctx.replicas.pool(model))
        if decision is None:
            return body, Stage.WHOLE
        reason = decision.reason
        if decision.path == REMOTE:
            params = await remote_prefill(ctx, path, tenant, body, prompt_tokens)
            if params is not None:
                ctx.metrics.disaggregation.labels(REMOTE, reason).inc()
                return {**body, "kv_transfer_params": params}, Stage.DECODE
            reason = "prefill_failed"
        ctx.metrics.disaggregation.labels(LOCAL, reason).inc()
        return body, Stage.WHOLE

    async def _relay(self, upstream: Upstream, send: Send, extra_headers: dict[str, str],
                     stream: StreamUsage, exchange: Exchange, is_stream: bool) -> None:
        response = upstream.response
        exchange.relaying(response.status)
        headers = [(b"content-type", response.headers.get("content-type", "application/json")
                    .encode())]
        headers += [(k.encode(), v.encode()) for k, v in extra_headers.items()]
        headers += [(name.encode(), response.headers[name].encode())
                    for name in PASSED_HEADERS if name in response.headers]
        if not is_stream or response.status != 200:
            data = await response.read()
            if response.status == 200:
                try:
                    exchange.read_whole(json_object(data))
                except ValueError:
                    pass
            headers.append((b"content-length", str(len(data)).encode()))
            exchange.response_started()
            await send({"type": "http.response.start", "status": response.status,
                        "headers": headers})
            await send({"type": "http.response.body", "body": data})
            return
        headers += [(b"cache-control", b"no-cache"), (b"x-accel-buffering", b"no")]
        exchange.response_started()
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        async for data in response.content.iter_any():
            events = stream.feed(data)
            if stream.num_chunks > upstream.num_opening_chunks:
                upstream.first_chunk()
            for event in events:
                await send({"type": "http.response.body", "body": event, "more_body": True})
        await send({"type": "http.response.body", "body": stream.flush()})
