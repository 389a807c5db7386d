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

Each call takes one `Stage` of its pool's replicas (replicas.py): a whole request, or the two
stages of a disaggregated one (disaggregation.py). `remote_prefill` is the first stage: the
prompt on a prefill replica, placed by the routing policy like any request, its answer's
`kv_transfer_params` for the decode replica, which the least loaded of the consumers gets
(`GatewayContext.decode_router`: its own prefix cache spares only the fetch, not a prefill).
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import anyio
from opentelemetry.trace import SpanKind, StatusCode

from kvasir_gateway.context import GatewayContext
from kvasir_gateway.errors import GatewayError
from kvasir_gateway.placement import Placement
from kvasir_gateway.replicas import Replica, ReplicaSet, Stage
from kvasir_gateway.router import Choice
from kvasir_gateway.sse import json_object
from kvasir_gateway.tracing import inject, span

log = logging.getLogger("kvasir_gateway.upstream")
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
                        prompt_tokens: int, is_shadow: bool = False,
                        stage: Stage = Stage.WHOLE) -> AsyncIterator[Upstream]:
    """`prompt_tokens`: the estimate of body.py, the prefill a replica is expected to do."""
    cfg, metrics, replicas, tracer = ctx.config, ctx.metrics, ctx.replicas, ctx.tracer
    model = str(body["model"])
    tried: set[str] = set()
    router = ctx.decode_router if stage is Stage.DECODE else ctx.router
    with span(tracer, "gateway.route") as routed:
        placement = await router.place(path, tenant, body, prompt_tokens)
        choice = _pick(placement, replicas, model, tried, stage)
        if routed is not None:
            routed.set_attributes({"kvasir.routing.policy": cfg.routing.value,
                                   "kvasir.pool": model, **_described(choice)})
    last_error = ""
    data = json.dumps(body)  # once for every attempt: O(body), C code on the loop
    for attempt in range(cfg.max_attempts):
        if attempt > 0:
            choice = _pick(placement, replicas, model, tried, stage)
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
                    can_retry = (attempt + 1 < cfg.max_attempts
                                 and bool(replicas.candidates(model, stage, tried)))
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


def _pick(placement: Placement, replicas: ReplicaSet, model: str, tried: set[str],
          stage: Stage) -> Choice | None:
    """The policy's choice among the ready replicas of the pool's stage not tried yet."""
    return placement.pick(replicas.candidates(model, stage, tried))


async def remote_prefill(ctx: GatewayContext, path: str, tenant: str, body: dict[str, Any],
                         prompt_tokens: int) -> dict[str, Any] | None:
    """The first stage of a disaggregated request (`body` as the decode replica gets it): the
    producer's `kv_transfer_params`, or None when no prefill replica gave them (none ready or
    reachable, an error answer, past `--disaggregation-prefill-timeout`): the decode replica
    then computes the prompt. Not streamed (the params are in the answer) and not charged (the
    decode answer's usage is the request's). A cancelled request cancels it (the connection
    closes, the producer aborts)."""
    prefill_body = {k: v for k, v in body.items() if k != "stream_options"}
    prefill_body.update(stream=False, kv_transfer_params={"do_remote_decode": True})
    try:
        with anyio.fail_after(ctx.config.disaggregation_prefill_timeout_seconds):
            async with open_upstream(ctx, path, tenant, prefill_body, prompt_tokens,
                                     stage=Stage.PREFILL) as upstream:
                status, data = upstream.response.status, await upstream.response.read()
    except (GatewayError, TimeoutError, aiohttp.ClientError) as exc:
        log.warning("prefill stage for %s failed, the decode replica computes the prompt: %s",
                    body["model"], str(exc) or type(exc).__name__)
        return None
    try:
        params = json_object(data).get("kv_transfer_params") if status == 200 else None
    except ValueError:
        params = None
    if not isinstance(params, dict) or not params.get("do_remote_prefill"):
        log.warning("prefill stage for %s answered %d without kv_transfer_params, the decode "
                    "replica computes the prompt: %r", body["model"], status, data[:200])
        return None
    return params


def _described(choice: Choice | None) -> dict[str, str | float]:
    """A choice as span attributes (tracing.py)."""
    if choice is None:
        return {}
    return {"kvasir.replica": choice.replica.url, "kvasir.routing.reason": choice.reason,
            "kvasir.routing.hit_fraction": choice.hit_fraction}
