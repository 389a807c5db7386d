"""One upstream exchange for one pool: pick a replica, send, retry before the first byte.

`open_upstream` is an async context manager around the engine's response (an `Upstream`): a
connection that fails (the replica is ejected) or a 502/503/504 answer moves the request to
another replica of the same pool, up to `max_attempts` (a 503 with no other replica left is
yielded as the engine sent it). Which replica each attempt goes to is the routing policy's
(`GatewayContext.router`, placement.py). While the request waits for its first chunk, the prompt
tokens the replica is expected to compute count as its pending prefill (router.py weighs it);
the reader calls `first_chunk()` when output arrives, exit does it otherwise. On exit the
connection is released when the answer was read whole, else closed (a cancelled or broken
exchange never goes back into the pool), and the replica's in-flight count drops. The proxy
relays what it yields, a cascade reads it whole, a shadow compares it.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
from opentelemetry.trace import SpanKind, StatusCode

from kvasir_gateway.context import GatewayContext
from kvasir_gateway.errors import GatewayError
from kvasir_gateway.placement import Placement
from kvasir_gateway.replicas import Replica, ReplicaSet
from kvasir_gateway.router import Choice
from kvasir_gateway.tracing import inject, span

RETRY_STATUSES = frozenset({502, 503, 504})


class Upstream:
    """One replica's answer, and the prefill it was expected to compute before answering
    (counted on the replica from the send until `first_chunk`)."""

    response: aiohttp.ClientResponse  # set once the replica answered with headers

    def __init__(self, replica: Replica, pending_tokens: float, path: str) -> None:
        # Data events a stream opens with before any output: chat's role chunk (OpenAI's and
        # vLLM's streams send it before the prompt is computed).
        self.num_opening_chunks = 1 if path.endswith("/chat/completions") else 0
        self._replica = replica
        self._pending_tokens = pending_tokens
        replica.pending_prefill_tokens += pending_tokens

    def first_chunk(self) -> None:
        """Output arrived: the prompt is computed, no longer pending work (idempotent)."""
        self._replica.pending_prefill_tokens = max(
            0.0, self._replica.pending_prefill_tokens - self._pending_tokens)
        self._pending_tokens = 0.0


@contextlib.asynccontextmanager
async def open_upstream(ctx: GatewayContext, path: str, tenant: str, body: dict[str, Any],
                        prompt_tokens: int, is_shadow: bool = False) -> AsyncIterator[Upstream]:
    """`prompt_tokens`: the estimate of body.py, the prefill a replica is expected to do."""
    cfg, metrics, replicas, tracer = ctx.config, ctx.metrics, ctx.replicas, ctx.tracer
    model = str(body["model"])
    tried: set[str] = set()
    with span(tracer, "gateway.route") as routed:
        placement = await ctx.router.place(path, tenant, body, prompt_tokens)
        choice = _pick(placement, replicas, model, tried)
        if routed is not None:
            routed.set_attributes({"kvasir.routing.policy": cfg.routing.value,
                                   "kvasir.pool": model, **_described(choice)})
    last_error = ""
    data = json.dumps(body)  # once for every attempt: O(body), C code on the loop
    for attempt in range(cfg.max_attempts):
        if attempt > 0:
            choice = _pick(placement, replicas, model, tried)
        if choice is None:
            break
        replica = choice.replica
        tried.add(replica.url)
        placement.record(replica.url)
        replica.num_in_flight += 1
        metrics.in_flight.inc()
        started = time.perf_counter()
        upstream = Upstream(replica, choice.uncached_tokens, path)
        with span(tracer, "gateway.attempt", SpanKind.CLIENT) as sending:
            headers = ctx.client.headers(tenant)
            if sending is not None:
                sending.set_attributes({"kvasir.pool": model, "kvasir.attempt": attempt,
                                        **_described(choice)})
                inject(tracer, headers)  # the engine's span is this attempt's child
            try:
                try:
                    response = await ctx.client.session.post(replica.url.rstrip("/") + path,
                                                             data=data, headers=headers)
                except (aiohttp.ClientError, TimeoutError) as exc:
                    kind = "timeout" if isinstance(exc, TimeoutError) else "connect"
                    metrics.upstream_errors.labels(kind).inc()
                    replicas.eject(replica, f"{type(exc).__name__}: {exc}")
                    last_error = f"{replica.url}: {type(exc).__name__}"
                    if sending is not None:
                        sending.set_attribute("error.type", kind)
                        sending.set_status(StatusCode.ERROR)
                    continue
                try:
                    metrics.upstream_first_byte.observe(time.perf_counter() - started)
                    if sending is not None:
                        sending.set_attribute("http.response.status_code", response.status)
                    can_retry = attempt + 1 < cfg.max_attempts and any(
                        model in r.model_ids and r.url not in tried for r in replicas.routable())
                    if response.status in RETRY_STATUSES and can_retry:
                        metrics.upstream_errors.labels(str(response.status)).inc()
                        last_error = f"{replica.url}: HTTP {response.status}"
                        if sending is not None:
                            sending.set_status(StatusCode.ERROR)
                        continue
                    if not is_shadow:
                        metrics.routing.labels(choice.reason if attempt == 0 else "retry").inc()
                        metrics.prefix_hit.observe(choice.hit_fraction)
                    upstream.response = response
                    yield upstream
                    return
                finally:
                    if response.content.at_eof():
                        response.release()
                    else:
                        response.close()
            finally:
                upstream.first_chunk()
                replica.num_in_flight -= 1
                metrics.in_flight.dec()
                metrics.upstream_latency.observe(time.perf_counter() - started)
    if last_error:
        raise GatewayError(502, f"no replica answered for model {model!r} "
                                f"(last: {last_error})", code="upstream_unavailable")
    raise replicas.no_replica_error(model)


def _pick(placement: Placement, replicas: ReplicaSet, model: str,
          tried: set[str]) -> Choice | None:
    """The policy's choice among the ready replicas of the pool not tried yet."""
    return placement.pick([r for r in replicas.routable()
                           if model in r.model_ids and r.url not in tried])


def _described(choice: Choice | None) -> dict[str, str | float]:
    """A choice as span attributes (tracing.py)."""
    if choice is None:
        return {}
    return {"kvasir.replica": choice.replica.url, "kvasir.routing.reason": choice.reason,
            "kvasir.routing.hit_fraction": choice.hit_fraction}
