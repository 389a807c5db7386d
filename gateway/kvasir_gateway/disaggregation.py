"""Whether a request's prompt is run on a prefill replica or on its decode replica (pure).

A pool whose replicas report KV-transfer roles (replicas.py, from each engine's `/version`)
serves a request in two stages (docs/gateway.md, "Disaggregated prefill and decode"): a
producer runs the prompt and keeps its blocks, then a consumer fetches them and decodes. That
pays when the prompt's computation, taken off the decode replica (where it stalls every stream
it decodes for as long), is worth more than the second call and the transfer. `decide` says
when:

- `never` (`--disaggregation`): every prompt is computed on the decode replica (`forced`);
- a request the engines cannot transfer (several prompts, `n` above 1, prompt logprobs) is
  local (`unsupported`), and so is any while no prefill replica is ready (`no_prefill`);
- `auto` (the default) also keeps local a prompt shorter than `--disaggregation-min-prompt-tokens`
  (`short`: computing it costs less than moving it, measured in docs/gateway.md), and a prompt
  while the least busy prefill replica has more prompt tokens queued than the prompt itself
  (`queue`: waiting there costs more than the decode replica computing it);
- `always` disaggregates every request that can be.

A pool without a consumer is served as before (no decision, nothing counted). The prompt size
is the gateway's estimate (body.py: characters / 4, or the count of token ids), as routing's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from kvasir_gateway.replicas import DECODE_ROLES, PREFILL_ROLES, Replica

REMOTE, LOCAL = "remote", "local"


class DisaggregationMode(StrEnum):
    """`--disaggregation`, read once (config.py)."""

    AUTO = "auto"
    ALWAYS = "always"
    NEVER = "never"


@dataclass(frozen=True)
class Decision:
    path: str  # REMOTE: prefill replica, then decode replica; LOCAL: the decode replica only
    # why (the metric's label): "prefill" for REMOTE; short, queue, forced, unsupported,
    # no_prefill for LOCAL, and prefill_failed when the prefill stage did not answer (proxy)
    reason: str


def is_transferable(body: dict[str, Any]) -> bool:
    """What the engines take with kv_transfer_params: one prompt, one choice, no prompt
    logprobs (docs/disaggregation.md, "The request protocol")."""
    prompt = body.get("prompt")
    is_batch = isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], (str, list))
    is_prompt_logprobs = (body.get("prompt_logprobs") is not None
                          or (bool(body.get("echo")) and body.get("logprobs") is not None))
    return body.get("n", 1) in (None, 1) and not is_batch and not is_prompt_logprobs


def queued_prefill_tokens(replica: Replica, tokens_per_other_request: float) -> float:
    """Prompt tokens a prefill replica will compute before a new one: what this gateway sent it
    that has not answered yet, plus the requests waiting in its engine that others sent, each
    counted as `tokens_per_other_request` (their size is not known here)."""
    others_waiting = max(0.0, replica.num_waiting - replica.in_flight_at_scrape)
    return replica.pending_prefill_tokens + others_waiting * tokens_per_other_request


def decide(mode: DisaggregationMode, min_prompt_tokens: int, prompt_tokens: int,
           body: dict[str, Any], pool: Sequence[Replica]) -> Decision | None:
    """`pool`: the routable replicas of the request's model. None: no consumer among them, the
    pool is served whole as without disaggregation."""
    if not any(r.kv_role in DECODE_ROLES for r in pool):
        return None
    prefill = [r for r in pool if r.kv_role in PREFILL_ROLES]
    if mode is DisaggregationMode.NEVER:
        return Decision(LOCAL, "forced")
    if not is_transferable(body):
        return Decision(LOCAL, "unsupported")
    if not prefill:
        return Decision(LOCAL, "no_prefill")
    if mode is DisaggregationMode.AUTO:
        if prompt_tokens < min_prompt_tokens:
            return Decision(LOCAL, "short")
        queued = min(queued_prefill_tokens(r, min_prompt_tokens) for r in prefill)
        if queued > prompt_tokens:
            return Decision(LOCAL, "queue")
    return Decision(REMOTE, "prefill")
