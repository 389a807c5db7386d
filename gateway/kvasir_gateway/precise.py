"""Precise prefix routing: score replicas by the blocks their engines report holding.

llm-d's precise prefix-cache scorer subscribes to vLLM's KV cache events and tokenizes each
request in the endpoint picker. Here the engines keep the events (engine:
frontend/prefix_cache_view.py) and the probe loop polls the changes (`/kvasir/prefix-cache`,
replicas.py), so each `Replica.held_blocks` mirrors its cache within one probe interval. The
request's own block hashes come from one replica of the pool (`/kvasir/prefix-hashes/...`, the
same body as the generation request): tokenized, templated and tenant-salted by the engine's own
code, so the gateway needs no tokenizer and cannot drift from the engine's hashing.

A replica's match is the longer of the leading blocks it reports holding and the leading blocks
sent to it in the last `prefix_pending_seconds` (a `PrefixIndex` over the same hashes): an engine
reports a block only once it is computed, so the requests right behind a prefix's first would
otherwise miss it. After that horizon only the engine's word counts, which is what makes it
precise: a prefix the engine evicted stops attracting requests.

When the hashes cannot be had in `prefix_hash_timeout` (no replica answers the route, a timeout,
an error), the request is routed approximately (placement.py's `PrefixRouter`, router.py's text
blocks) and counted in `kvasir_gateway_precise_fallbacks_total{reason}`.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import aiohttp

from kvasir_gateway.client import UpstreamClient
from kvasir_gateway.config import GatewayConfig
from kvasir_gateway.metrics import GatewayMetrics
from kvasir_gateway.placement import Placement, PrefixRouter, bounded_placement
from kvasir_gateway.replicas import Replica, ReplicaSet
from kvasir_gateway.router import PrefixIndex, PromptBlocks

HASHES_PATH = "/kvasir/prefix-hashes"  # + /completions or /chat/completions


class HeldBlocks:
    """The `PrefixScorer` of precise routing, for one request's candidates."""

    def __init__(self, candidates: Sequence[Replica], pending: PrefixIndex) -> None:
        self.url_to_replica = {r.url: r for r in candidates}
        self.pending = pending

    def matched_blocks(self, hashes: Sequence[bytes], url: str) -> int:
        replica = self.url_to_replica.get(url)
        held = 0
        if replica is not None:
            for h in hashes:
                if h not in replica.held_blocks:
                    break
                held += 1
        return max(held, self.pending.matched_blocks(hashes, url))


class PreciseRouter:
    """"precise": the request's blocks as the engines hash them, scored by `HeldBlocks`;
    `pending` holds the sendings not reported yet. Without the hashes, `PrefixRouter` over
    `index` places the request."""

    def __init__(self, config: GatewayConfig, client: UpstreamClient, metrics: GatewayMetrics,
                 replicas: ReplicaSet, index: PrefixIndex, pending: PrefixIndex) -> None:
        self.config, self.client, self.metrics, self.replicas = config, client, metrics, replicas
        self.pending = pending
        self.approximate = PrefixRouter(config, index)

    async def place(self, path: str, tenant: str, body: dict[str, Any],
                    prompt_tokens: int) -> Placement:
        model = str(body["model"])
        pool = [r for r in self.replicas.routable() if model in r.model_ids]
        prompt = await self.prompt_hashes(path, tenant, body, pool)
        if prompt is None:
            return await self.approximate.place(path, tenant, body, prompt_tokens)
        return bounded_placement(self.config, prompt, self.pending,
                                 lambda candidates: HeldBlocks(candidates, self.pending))

    async def prompt_hashes(self, path: str, tenant: str, body: dict[str, Any],
                            candidates: Sequence[Replica]) -> PromptBlocks | None:
        """The request's leading block hashes as the pool's engines key them, and its size in
        tokens; None: fall back."""
        fallbacks = self.metrics.precise_fallbacks
        reporting = [r for r in candidates if r.prefix_cache_instance is not None]
        if not reporting:
            fallbacks.labels("no_report").inc()
            return None
        replica = min(reporting, key=lambda r: (r.load, r.url))
        url = (f"{replica.url.rstrip('/')}{HASHES_PATH}{path.removeprefix('/v1')}"
               f"?max_blocks={self.config.prefix_max_blocks}")
        timeout = aiohttp.ClientTimeout(total=self.config.prefix_hash_timeout_seconds)
        hashed = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
        try:
            async with self.client.session.post(url, data=json.dumps(hashed), timeout=timeout,
                                                headers=self.client.headers(tenant)) as response:
                if response.status != 200:
                    fallbacks.labels("refused" if response.status < 500 else "error").inc()
                    return None
                answer = await response.json(content_type=None)
                return PromptBlocks([bytes.fromhex(h) for h in answer["block_hashes"]],
                                    float(answer["num_tokens"]), float(answer["block_size"]))
        except TimeoutError:
            fallbacks.labels("timeout").inc()
        except (aiohttp.ClientError, ValueError, KeyError, TypeError):
            fallbacks.labels("error").inc()
        return None
