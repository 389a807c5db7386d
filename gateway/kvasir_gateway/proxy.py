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
attempts used.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import MutableMapping
from typing import TYPE_CHECKING, Any

import aiohttp
import anyio
from starlette.types import Receive, Scope, Send

from kvasir_gateway.aliases import Route, resolve
from kvasir_gateway.body import ParsedRequest, parse_request_off_loop, read_body, reservation
from kvasir_gateway.cascade import account_cost, attempt, completion_tokens, send_buffered
from kvasir_gateway.checks import answer_text
from kvasir_gateway.errors import GatewayError, send_error
from kvasir_gateway.quota import UNLIMITED
from kvasir_gateway.sse import StreamUsage, usage_tokens
from kvasir_gateway.upstream import Upstream, json_object, open_upstream

if TYPE_CHECKING:
    from kvasir_gateway.app import Gateway

log = logging.getLogger("kvasir_gateway.proxy")
MODEL_HEADER = "x-kvasir-model"  # the pool (model) that answered
ROUTE_HEADER = "x-kvasir-route"  # the alias's rule that chose it ("default" when none did)
ESCALATIONS_HEADER = "x-kvasir-escalations"  # "small=logprob,...": the checks that failed
# The engine's own headers worth passing on (a queue-full 429's Retry-After, its request id).
PASSED_HEADERS = ("retry-after", "x-request-id")


class Exchange:
    """What one request has consumed, for the settlement."""

    def __init__(self) -> None:
        self.status = 0
        self.used_tokens: int | None = None
        self.answered = False  # a replica answered with headers (no more retries)
        self.started = False  # the response's start went to the client
        self.prompt_tokens = 0  # the prompt's estimate (body.py), charged for cut-off attempts
        self.spent_tokens = 0  # of a cascade's escalated attempts, settled with the answer
        self.attempts: list[tuple[str, int]] = []  # (model, completion tokens) of each answer
        self.final_completion_tokens: int | None = None
        self.answer: str | None = None  # the answer's text, for the shadow comparison


class ProxyRoute:
    """The ASGI endpoint of /v1/completions and /v1/chat/completions."""

    def __init__(self, gateway: Gateway, chat: bool) -> None:
        self.gateway, self.chat = gateway, chat

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        g, tenant = self.gateway, "unauthenticated"
        exchange = Exchange()
        sent: list[int] = []

        async def tracked_send(message: MutableMapping[str, Any]) -> None:
            if message["type"] == "http.response.start":
                sent.append(message["status"])
            await send(message)

        try:
            headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
            if scope["method"] != "POST":
                raise GatewayError(405, f"{scope['path']} accepts POST only")
            tenant = g.authenticate(headers.get("authorization", ""))
            raw = await read_body(receive, headers, g.config.max_body_bytes)
            request = await parse_request_off_loop(raw, self.chat, g.config.chars_per_token)
            await self._admitted(scope, receive, tracked_send, tenant, request, headers, exchange)
        except GatewayError as exc:
            if not sent and exc.status != 499:
                await send_error(tracked_send, exc)
        except Exception:  # a bug of ours: still OpenAI's shape, and a traceback in the log
            log.exception("proxying %s failed", scope["path"])
            if not sent:
                await send_error(tracked_send, GatewayError(500, "internal gateway error"))
        finally:
            code = str(sent[0]) if sent else "499"
            g.metrics.requests.labels(g.metrics.tenant_label(tenant), code).inc()

    async def _admitted(self, scope: Scope, receive: Receive, send: Send, tenant: str,
                        request: ParsedRequest, headers: dict[str, str],
                        exchange: Exchange) -> None:
        g, cfg, body = self.gateway, self.gateway.config, request.body
        model = str(body["model"])
        exchange.prompt_tokens = request.prompt_tokens
        alias = g.routing_table.aliases.get(model)
        route = resolve(alias, body, request.prompt_tokens, tenant, headers) if alias else None
        models = route.models if route else (model,)
        if not any(m in r.model_ids for r in g.replicas.routable() for m in models):
            error = g.no_replica_error(models[0])  # before admission: costs the tenant nothing
            if route is not None:
                error.message = f"alias {model!r} (rule {route.rule}): {error.message}"
            raise error
        limits = cfg.limits_for(tenant)
        cost = reservation(request, cfg.default_max_tokens)
        lease_id = uuid.uuid4().hex
        # No limit, nothing to count: no store call, so Redis down never delays or refuses it.
        admission = (UNLIMITED if limits.is_unlimited
                     else await g.store.admit(tenant, limits, cost, lease_id))
        label = g.metrics.tenant_label(tenant)
        if limits.tokens_per_minute > 0 and admission.enforced:
            g.metrics.quota_remaining.labels(label).set(max(0.0, admission.tokens_remaining))
        if not admission.allowed:
            g.metrics.tokens_refused.labels(label, admission.refused_by or "store").inc(cost)
            raise _refusal(admission.refused_by, cost, limits.tokens_per_minute,
                           admission.headers())
        stream = StreamUsage(keep_usage=bool((body.get("stream_options") or {})
                                             .get("include_usage")))
        refusal: GatewayError | None = None
        if limits.max_concurrent > 0:
            g.open_leases[lease_id] = tenant
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
            used = exchange.used_tokens if exchange.used_tokens is not None else stream.used_tokens
            if used is None:
                # An engine's 4xx consumed nothing; a broken stream, what it had relayed.
                is_charged = exchange.answered and exchange.status < 400
                used = request.prompt_tokens + stream.num_chunks if is_charged else 0
            used += exchange.spent_tokens
            g.open_leases.pop(lease_id, None)
            if not limits.is_unlimited:
                with anyio.CancelScope(shield=True):
                    await g.store.settle(tenant, limits, used - cost, lease_id,
                                         admission.window_second)
            g.metrics.tokens_admitted.labels(label).inc(used)

    async def _forward(self, scope: Scope, send: Send, tenant: str, body: dict[str, Any],
                       route: Route | None, quota_headers: dict[str, str], stream: StreamUsage,
                       exchange: Exchange) -> None:
        if route is None:
            await self._relay_from(scope, send, tenant, body, str(body["model"]),
                                   quota_headers, stream, exchange)
            return
        g, alias = self.gateway, route.alias
        extra = {**quota_headers, ROUTE_HEADER: route.rule}
        started = time.perf_counter()
        escalations = []
        for model in route.models[:-1]:
            answer, failed = await attempt(g, scope["path"], tenant, body, model, self.chat,
                                           alias.checks, exchange)
            if failed is None and answer is not None:
                await send_buffered(send, answer, self.chat, body, model, extra, exchange)
                self._finish(scope, route, model, tenant, body, exchange)
                return
            g.metrics.escalations.labels(alias.name, model, failed or "error").inc()
            escalations.append(f"{model}={failed or 'error'}")
            extra[ESCALATIONS_HEADER] = ",".join(escalations)
        model = route.models[-1]
        if len(route.models) > 1:
            g.metrics.escalation_added.labels(alias.name).observe(time.perf_counter() - started)
        if alias.shadow.fraction > 0 and model != alias.shadow.model:
            stream.texts = []
        await self._relay_from(scope, send, tenant, body, model, extra, stream, exchange)
        if exchange.status == 200:
            if exchange.final_completion_tokens is None:
                exchange.final_completion_tokens = stream.completion_tokens
            if stream.texts is not None and exchange.answer is None:
                exchange.answer = "".join(stream.texts)
            self._finish(scope, route, model, tenant, body, exchange)

    def _finish(self, scope: Scope, route: Route, model: str, tenant: str, body: dict[str, Any],
                exchange: Exchange) -> None:
        g = self.gateway
        g.metrics.pool_requests.labels(route.alias.name, route.rule, model).inc()
        exchange.attempts.append((model, exchange.final_completion_tokens or 0))
        account_cost(g, route.alias, exchange.attempts)
        if exchange.answer is not None:
            g.shadows.maybe_shadow(route, model, scope["path"], tenant, body,
                                   exchange.prompt_tokens, exchange.answer)

    async def _relay_from(self, scope: Scope, send: Send, tenant: str, body: dict[str, Any],
                          model: str, extra_headers: dict[str, str], stream: StreamUsage,
                          exchange: Exchange) -> None:
        upstream_body = {**body, "model": model}
        if body.get("stream"):
            upstream_body["stream_options"] = {**(body.get("stream_options") or {}),
                                               "include_usage": True}
        async with open_upstream(self.gateway, scope["path"], tenant, upstream_body,
                                 exchange.prompt_tokens) as upstream:
            exchange.answered = True
            try:
                await self._relay(upstream, send, {**extra_headers, MODEL_HEADER: model},
                                  stream, exchange, bool(body.get("stream")))
            except (aiohttp.ClientError, TimeoutError) as exc:  # broke off mid-answer
                self.gateway.metrics.upstream_errors.labels("broken").inc()
                log.warning("a replica of %s broke off a response: %s", model,
                            str(exc) or type(exc).__name__)
                if not exchange.started:
                    raise GatewayError(502, f"a replica of {model!r} broke off its answer",
                                       code="upstream_error") from None
                await send({"type": "http.response.body", "body": b""})
                exchange.status = 0  # incomplete: no shadow, no cost accounting
            except OSError:  # the client went away while we wrote (uvicorn says so)
                log.info("client left during a response from %s", model)
                exchange.status = 0

    async def _relay(self, upstream: Upstream, send: Send, extra_headers: dict[str, str],
                     stream: StreamUsage, exchange: Exchange, is_stream: bool) -> None:
        response = upstream.response
        exchange.status = response.status
        headers = [(b"content-type", response.headers.get("content-type", "application/json")
                    .encode())]
        headers += [(k.encode(), v.encode()) for k, v in extra_headers.items()]
        headers += [(name.encode(), response.headers[name].encode())
                    for name in PASSED_HEADERS if name in response.headers]
        if not is_stream or response.status != 200:
            data = await response.read()
            if response.status == 200:
                try:
                    answer = json_object(data)
                    exchange.used_tokens = usage_tokens(answer.get("usage"))
                    exchange.final_completion_tokens = completion_tokens(answer)
                    exchange.answer = answer_text(answer)
                except ValueError:
                    pass
            headers.append((b"content-length", str(len(data)).encode()))
            exchange.started = True
            await send({"type": "http.response.start", "status": response.status,
                        "headers": headers})
            await send({"type": "http.response.body", "body": data})
            return
        headers += [(b"cache-control", b"no-cache"), (b"x-accel-buffering", b"no")]
        exchange.started = True
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        async for data in response.content.iter_any():
            events = stream.feed(data)
            if stream.num_chunks > upstream.num_opening_chunks:
                upstream.first_chunk()
            for event in events:
                await send({"type": "http.response.body", "body": event, "more_body": True})
        await send({"type": "http.response.body", "body": stream.flush()})


def _refusal(refused_by: str | None, cost: int, tpm: int,
             headers: dict[str, str]) -> GatewayError:
    if refused_by == "store":
        return GatewayError(503, "the quota store is unreachable and the gateway fails closed "
                                 "(--redis-failure closed); retry shortly",
                            code="quota_store_unavailable", headers={"retry-after": "1"})
    messages = {
        "too_large": (f"request needs {cost} tokens (prompt estimate + max_tokens), more than "
                      f"the tenant's limit of {tpm} tokens per minute; lower max_tokens"),
        "tokens": f"rate limit reached for tokens per minute (this request reserves {cost})",
        "requests": "rate limit reached for requests per minute",
        "concurrent": "too many concurrent requests for this tenant",
    }
    return GatewayError(429, messages.get(refused_by or "", "rate limited"),
                        code=f"rate_limit_{refused_by}", headers=headers)
