"""The routing policy in force: where each attempt of a request goes (`Router`, `Placement`).

`--routing` is read once into a `RoutingPolicy` (config.py) and app.py builds its router once:
`PrefixRouter` (approximate: where this gateway sent each prefix, router.py's `PrefixIndex`),
precise.py's `PreciseRouter` (what the engines report holding), or a comparison policy of
bench/gateway.py (`RoundRobinRouter`, `LeastLoadRouter`). Nothing else tests the policy.

Before a request's first attempt its router makes a `Placement`: the prompt's leading blocks and
the policy's choice among candidates. upstream.py asks it for a replica at every attempt
(`pick`, among the replicas not tried yet) and tells it where the request went (`record`, at
the send, not at the answer: the requests right behind this one, a tenant's burst, then find its
prefix there instead of each placing it anew). The comparison policies record too, so the
`PrefixIndex` holds the same whatever the policy.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from kvasir_gateway.config import GatewayConfig
from kvasir_gateway.replicas import Replica
from kvasir_gateway.router import (
    Choice,
    Costs,
    PrefixIndex,
    PrefixScorer,
    PromptBlocks,
    block_hashes,
    pick,
    pick_least_load,
    pick_round_robin,
    prompt_text,
)


@dataclass(frozen=True)
class Placement:
    """One request's routing over its attempts."""

    prompt: PromptBlocks
    index: PrefixIndex  # where its sendings are recorded
    # the policy's choice among the candidates of one attempt; None: none may take it
    pick: Callable[[Sequence[Replica]], Choice | None]

    def record(self, url: str) -> None:
        self.index.record(self.prompt.hashes, url)


class Router(Protocol):
    async def place(self, path: str, tenant: str, body: dict[str, Any],
                    prompt_tokens: int) -> Placement:
        """`prompt_tokens`: the estimate of body.py, the prefill a replica is expected to do."""
        ...


def approximate_prompt(config: GatewayConfig, tenant: str, body: dict[str, Any],
                       prompt_tokens: int) -> PromptBlocks:
    """The prompt's leading text blocks (router.py); its size, the admission's estimate."""
    text = prompt_text(body, config.prefix_block_chars * config.prefix_max_blocks)
    return PromptBlocks(block_hashes(text, f"{tenant}\x00{body['model']}",
                                     config.prefix_block_chars, config.prefix_max_blocks),
                        prompt_tokens, config.prefix_block_chars / config.chars_per_token)


def bounded_placement(config: GatewayConfig, prompt: PromptBlocks, index: PrefixIndex,
                      scorer: Callable[[Sequence[Replica]], PrefixScorer]) -> Placement:
    """Prefix- and load-aware under the load bound (router.py's `pick`), the prompt's matches
    counted by `scorer` for the candidates of each attempt."""
    costs = Costs(config.prefix_miss_weight, config.load_tokens_per_request)
    return Placement(prompt, index, lambda candidates: pick(
        candidates, prompt, scorer(candidates), config.load_bound, costs))


class PrefixRouter:
    """"prefix": scored by what this gateway sent where (also precise routing's fallback)."""

    def __init__(self, config: GatewayConfig, index: PrefixIndex) -> None:
        self.config, self.index = config, index

    async def place(self, path: str, tenant: str, body: dict[str, Any],
                    prompt_tokens: int) -> Placement:
        prompt = approximate_prompt(self.config, tenant, body, prompt_tokens)
        return bounded_placement(self.config, prompt, self.index, lambda _: self.index)


class ComparisonRouter:
    """A comparison policy: no prefix, no bound; `pick` decides among the candidates."""

    def __init__(self, config: GatewayConfig, index: PrefixIndex) -> None:
        self.config, self.index = config, index

    def pick(self, candidates: Sequence[Replica]) -> Choice | None:
        raise NotImplementedError

    async def place(self, path: str, tenant: str, body: dict[str, Any],
                    prompt_tokens: int) -> Placement:
        prompt = approximate_prompt(self.config, tenant, body, prompt_tokens)
        return Placement(prompt, self.index, self.pick)


class RoundRobinRouter(ComparisonRouter):
    """"round_robin": every attempt takes the next turn, gateway-wide."""

    def __init__(self, config: GatewayConfig, index: PrefixIndex) -> None:
        super().__init__(config, index)
        self.turns = itertools.count()

    def pick(self, candidates: Sequence[Replica]) -> Choice | None:
        return pick_round_robin(candidates, next(self.turns))


class LeastLoadRouter(ComparisonRouter):
    """"least_load": the least load."""

    def pick(self, candidates: Sequence[Replica]) -> Choice | None:
        return pick_least_load(candidates)
