"""One upstream exchange for one pool: pick a replica, send, retry before the first byte.

`open_upstream` is an async context manager around the engine's response (an `Upstream`): a
connection that fails (the replica is ejected) or a 502/503/504 answer moves the request to
another replica of the same pool, up to `max_attempts` (a 503 with no other replica left is
yielded as the engine sent it). While the request waits for its first chunk, the prompt tokens
the replica is expected to compute count as its pending prefill (router.py weighs it); the
reader calls `first_chunk()` when output arrives, exit does it otherwise. On exit the
connection is released when the answer was read whole, else closed (a cancelled or broken
exchange never goes back into the pool), and the replica's in-flight count drops. The proxy
relays what it yields, a cascade reads it whole, a shadow compares it.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

import aiohttp

from kvasir_gateway.errors import GatewayError
from kvasir_gateway.precise import HeldBlocks, prompt_hashes
from kvasir_gateway.replicas import Replica
from kvasir_gateway.router import (
    Costs,
    PrefixIndex,
    PromptBlocks,
    block_hashes,
    pick,
    pick_baseline,
    prompt_text,
)

if TYPE_CHECKING:
    from kvasir_gateway.app import Gateway

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


def approximate_prompt(g: Gateway, tenant: str, model: str, body: dict[str, Any],
                       prompt_tokens: int) -> PromptBlocks:
    """The prompt's leading text blocks (router.py); its size, the admission's estimate."""
    cfg = g.config
    text = prompt_text(body, cfg.prefix_block_chars * cfg.prefix_max_blocks)
    return PromptBlocks(block_hashes(text, f"{tenant}\x00{model}", cfg.prefix_block_chars,
                                     cfg.prefix_max_blocks),
                        prompt_tokens, cfg.prefix_block_chars / cfg.chars_per_token)


@contextlib.asynccontextmanager
async def open_upstream(g: Gateway, path: str, tenant: str, body: dict[str, Any],
                        prompt_tokens: int, is_shadow: bool = False) -> AsyncIterator[Upstream]:
    """`prompt_tokens`: the estimate of body.py, the prefill a replica is expected to do."""
    cfg = g.config
    model = str(body["model"])
    index: PrefixIndex = g.prefix_index
    prompt: PromptBlocks | None = None
    if cfg.routing == "precise":
        pool = [r for r in g.replicas.routable() if model in r.model_ids]
        prompt = await prompt_hashes(g, path, tenant, body, pool)
    is_precise = prompt is not None
    if is_precise:
        index = g.pending_index
    if prompt is None:  # approximate, also precise's fallback
        prompt = approximate_prompt(g, tenant, model, body, prompt_tokens)
    costs = Costs(cfg.prefix_miss_weight, cfg.load_tokens_per_request)
    tried: set[str] = set()
    last_error = ""
    data = json.dumps(body)  # once for every attempt: O(body), C code on the loop
    for attempt in range(cfg.max_attempts):
        candidates = [r for r in g.replicas.routable()
                      if model in r.model_ids and r.url not in tried]
        if cfg.routing in ("prefix", "precise"):
            scorer = HeldBlocks(candidates, index) if is_precise else index
            choice = pick(candidates, prompt, scorer, cfg.load_bound, costs)
        else:
            choice = pick_baseline(cfg.routing, candidates, next(g.turns))
        if choice is None:
            break
        replica = choice.replica
        tried.add(replica.url)
        # Recorded at the send, not at the answer: the requests right behind this one (a tenant's
        # burst) then find its prefix here instead of each placing it anew.
        index.record(prompt.hashes, replica.url)
        replica.num_in_flight += 1
        g.metrics.in_flight.inc()
        started = time.perf_counter()
        upstream = Upstream(replica, choice.uncached_tokens, path)
        try:
            try:
                response = await g.client.post(replica.url.rstrip("/") + path,
                                               data=data,
                                               headers=g.upstream_headers(tenant))
            except (aiohttp.ClientError, TimeoutError) as exc:
                kind = "timeout" if isinstance(exc, TimeoutError) else "connect"
                g.metrics.upstream_errors.labels(kind).inc()
                g.replicas.eject(replica, f"{type(exc).__name__}: {exc}")
                last_error = f"{replica.url}: {type(exc).__name__}"
                continue
            try:
                g.metrics.upstream_first_byte.observe(time.perf_counter() - started)
                can_retry = attempt + 1 < cfg.max_attempts and any(
                    model in r.model_ids and r.url not in tried for r in g.replicas.routable())
                if response.status in RETRY_STATUSES and can_retry:
                    g.metrics.upstream_errors.labels(str(response.status)).inc()
                    last_error = f"{replica.url}: HTTP {response.status}"
                    continue
                if not is_shadow:
                    g.metrics.routing.labels(choice.reason if attempt == 0 else "retry").inc()
                    g.metrics.prefix_hit.observe(choice.hit_fraction)
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
            g.metrics.in_flight.dec()
            g.metrics.upstream_latency.observe(time.perf_counter() - started)
    if last_error:
        raise GatewayError(502, f"no replica answered for model {model!r} "
                                f"(last: {last_error})", code="upstream_unavailable")
    raise g.no_replica_error(model)


def json_object(data: bytes) -> dict[str, Any]:
    value = json.loads(data)
    if not isinstance(value, dict):
        raise ValueError("not an object")
    return value
