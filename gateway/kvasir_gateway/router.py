"""Which replica gets a request: the least expected work to its first token, prefix included.

The prompt's leading text is cut into blocks of `prefix_block_chars` characters and hashed as a
chain (block i's hash covers blocks 0..i), salted with the tenant and the model: the engine salts
its prefix cache per tenant, so two tenants' identical prompts never share blocks there either.
`PrefixIndex` remembers, for the most recent block hashes, the replicas the gateway last sent them
to (an approximation of what each engine's cache holds: it ages out with LRU like theirs). Which
blocks a replica holds comes from a `PrefixScorer`: the `PrefixIndex` here (approximate, "prefix"
routing) or precise.py's `HeldBlocks` (what the engines report, "precise" routing).

`pick` scores each replica in prompt tokens of work (`Costs`):

    pending prefill on it + miss_weight x the prompt's tokens it does not hold
                          + tokens_per_request x its load (requests in flight)

and takes the lowest. Pending prefill is what this gateway sent it that has not produced a first
chunk yet (upstream.py). A miss counts `miss_weight` (2) times its tokens: it is computed now,
and on a replica whose cache is full it evicts about as many tokens of other prefixes, which
their next requests compute again. A request in flight costs `tokens_per_request`: its decode
shares every step. So a request stays where its prefix is unless that replica's queued work
exceeds what a miss elsewhere costs; a prompt nobody holds goes where the least work waits. Ties
go to the replica with more free KV cache (`vllm:kv_cache_usage_perc`), then to the rendezvous-
hash order of the prompt's first block, so gateways agree. Measured against the
request-count bound alone in docs/performance.md ("Gateway"): moving a request off its prefix
because of a count costs a whole prefill and an eviction, more than the wait it saves.

On top, consistent hashing's bounded loads (CHWBL, as KubeAI does) stay as the hard guard: a
replica may take a request only while its load stays within ceil((1 + eps) x mean load after the
request), so no prefix, however cheap to keep home, piles onto one replica beyond that.
Reasons (the `kvasir_gateway_routing_decisions_total` label): "prefix" (the replica holding the
longest prefix), "moved" (one holding more was passed over for its load), "new" (nobody holds
any of it), "least_load" (no prompt blocks).
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Protocol

from kvasir_gateway.replicas import Replica


class RoutingPolicy(StrEnum):
    """`--routing`, read once (config.py); app.py builds the policy's router from it once
    (placement.py, precise.py)."""

    PREFIX = "prefix"  # approximate: where this gateway sent each prefix (`PrefixIndex`)
    PRECISE = "precise"  # what the engines report their caches hold (precise.py)
    LEAST_LOAD = "least_load"  # the two comparison policies (bench/gateway.py)
    ROUND_ROBIN = "round_robin"


def _head(value: Any, max_chars: int) -> Any:
    """Enough of `value` for the first `max_chars` characters of its JSON: a list item takes at
    least one, so the first `max_chars` items."""
    return value[:max_chars] if isinstance(value, (str, list)) else value


def prompt_text(body: dict[str, Any], max_chars: int) -> str:
    """The leading `max_chars` of the text whose blocks decide the prefix: the prompt, or the
    messages in order. The work stays bounded whatever the body's size: the rest decides
    nothing."""
    if "messages" in body:
        parts, size = [], 0
        for message in body.get("messages") or []:
            if size >= max_chars:
                break
            if isinstance(message, dict):
                content = _head(message.get("content"), max_chars)
                text = content if isinstance(content, str) else json.dumps(content)
                parts.append(f"<{message.get('role')}>{text}")
                size += len(parts[-1])
        return "".join(parts)[:max_chars]
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return prompt[:max_chars]
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
        return prompt[0][:max_chars]  # a batch: route by its first prompt
    return json.dumps(_head(prompt, max_chars))[:max_chars] if prompt is not None else ""


def block_hashes(text: str, salt: str, block_chars: int, max_blocks: int) -> list[bytes]:
    """Chained hashes of the full leading blocks (a partial last block is not cacheable)."""
    hashes: list[bytes] = []
    previous = hashlib.blake2b(salt.encode(), digest_size=12).digest()
    for start in range(0, min(len(text), block_chars * max_blocks) - block_chars + 1,
                       block_chars):
        block = text[start:start + block_chars].encode("utf-8", "surrogatepass")
        previous = hashlib.blake2b(previous + block, digest_size=12).digest()
        hashes.append(previous)
    return hashes


class PrefixScorer(Protocol):
    def matched_blocks(self, hashes: Sequence[bytes], url: str) -> int:
        """How many of the prompt's leading blocks the replica at `url` holds (or will)."""
        ...


class PrefixIndex:
    """Recent block hash -> the last few replica URLs it was sent to, and when (LRU, `capacity`
    entries).

    A few, not one: when the bound sends a hot prefix elsewhere, the first replica still holds
    it, and both stay candidates for the prefix's next requests. `horizon_seconds` (None:
    forever) forgets a sending after that long: precise routing keeps only what the engines
    have not reported yet."""

    def __init__(self, capacity: int, num_replicas_per_block: int = 4,
                 horizon_seconds: float | None = None) -> None:
        self.capacity = capacity
        self.num_replicas_per_block = num_replicas_per_block
        self.horizon_seconds = horizon_seconds
        self._where: OrderedDict[bytes, tuple[tuple[str, float], ...]] = OrderedDict()

    def matched_blocks(self, hashes: Sequence[bytes], url: str) -> int:
        """How many leading blocks were recently sent to `url` (the chain makes it a prefix)."""
        oldest = (-math.inf if self.horizon_seconds is None
                  else time.monotonic() - self.horizon_seconds)
        for n in range(len(hashes), 0, -1):
            if any(u == url and at >= oldest for u, at in self._where.get(hashes[n - 1], ())):
                return n
        return 0

    def record(self, hashes: Sequence[bytes], url: str) -> None:
        now = time.monotonic()
        for h in hashes:
            others = tuple(e for e in self._where.get(h, ()) if e[0] != url)
            self._where[h] = ((url, now), *others)[:self.num_replicas_per_block]
            self._where.move_to_end(h)
        while len(self._where) > self.capacity:
            self._where.popitem(last=False)


@dataclass(frozen=True)
class PromptBlocks:
    """The prompt's leading block hashes and its size, in (estimated) tokens."""

    hashes: Sequence[bytes]
    num_tokens: float
    tokens_per_block: float

    def uncached_tokens(self, num_matched_blocks: int) -> float:
        return max(0.0, self.num_tokens - num_matched_blocks * self.tokens_per_block)


@dataclass(frozen=True)
class Costs:
    """How `pick` weighs a replica's work, in prompt tokens (the module's docstring)."""

    miss_weight: float = 2.0
    tokens_per_request: float = 16.0


@dataclass(frozen=True)
class Choice:
    replica: Replica
    reason: str
    hit_fraction: float  # matched blocks / blocks of the prompt (0 when it has none)
    uncached_tokens: float = 0.0  # the prompt's tokens the replica is expected to compute


def _rendezvous(key: bytes, url: str) -> bytes:
    return hashlib.blake2b(key + url.encode(), digest_size=8).digest()


def pick_round_robin(candidates: Sequence[Replica], turn: int) -> Choice | None:
    """A comparison policy: turn by turn, in the order of the URLs."""
    if not candidates:
        return None
    ordered = sorted(candidates, key=lambda r: r.url)
    return Choice(ordered[turn % len(ordered)], "round_robin", 0.0)


def pick_least_load(candidates: Sequence[Replica]) -> Choice | None:
    """A comparison policy: the least load, with no bound and no prefix."""
    if not candidates:
        return None
    ordered = sorted(candidates, key=lambda r: r.url)
    return Choice(min(ordered, key=lambda r: (r.load, r.kv_cache_usage)), "least_load", 0.0)


def pick(candidates: Sequence[Replica], prompt: PromptBlocks, index: PrefixScorer,
         load_bound: float, costs: Costs = Costs()) -> Choice | None:
    if not candidates:
        return None
    total = sum(r.load for r in candidates) + 1
    cap = math.ceil((1 + load_bound) * total / len(candidates))
    eligible = [r for r in candidates if r.load + 1 <= cap]
    if not eligible:  # the bound rounds up, so this only happens with fractional queue loads
        eligible = list(candidates)
    hashes = prompt.hashes
    matched = {r.url: index.matched_blocks(hashes, r.url) if hashes else 0 for r in candidates}
    first_block = hashes[0] if hashes else b""

    def cost(r: Replica) -> tuple[float, float, int]:
        work = (r.pending_prefill_tokens
                + costs.miss_weight * prompt.uncached_tokens(matched[r.url])
                + costs.tokens_per_request * r.load)
        return (work, r.kv_cache_usage,
                -int.from_bytes(_rendezvous(first_block, r.url), "big"))

    chosen = min(eligible, key=cost)
    best = max(matched.values())
    mine = matched[chosen.url]
    reason = ("least_load" if not hashes else "new" if best == 0
              else "prefix" if mine == best else "moved")
    return Choice(chosen, reason, mine / len(hashes) if hashes else 0.0,
                  prompt.uncached_tokens(mine))
