"""Plain data that crosses the scheduler / model-runner / API boundaries.

Everything here is ints, floats, strings and lists of them (docs/architecture.md, rule 6): no tensors, no `Request`
objects, so a step can be sent to other tensor-parallel ranks as it is.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field

from kvasir_engine.core.request import LogprobsEntry, SamplingParams


@dataclass(frozen=True)
class KVLoad:
    """Staged K/V blocks (a consumer's, kv_transfer/) the runner writes before the forward pass:
    staged block `first_staged + i` into `block_ids[i]`. Empty `block_ids`: nothing is used,
    the staging is dropped; `is_evicted` says why: the prefix cache lost a block before the
    staged ones (a fallback to a local prefill), else it holds them all by now."""

    staging_id: str
    block_ids: list[int]
    first_staged: int
    is_evicted: bool = False


@dataclass(frozen=True)
class KVHold:
    """A producer's finished request whose blocks stay held for its consumer (kv_transfer/),
    until `EngineCore.release_kv_holds`."""

    block_ids: list[int]  # the blocks holding the K/V of the prompt's first `num_tokens` tokens
    block_hashes: list[bytes]  # the prefix-cache hashes of its full blocks, in order
    token_ids: list[int]  # the prompt
    num_tokens: int  # prompt tokens whose K/V a consumer needs: all but the last


@dataclass(frozen=True)
class NewRequestData:
    """A request the runner has not seen yet (first admission, or resumed after preemption).

    `token_ids` holds every known token (prompt, plus outputs so far when resumed), so a resumed
    request is recomputed from its tokens. The first `num_computed_tokens` of them already have K/V
    in `block_ids` (prefix-cache hits).
    """

    request_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    # Output tokens already generated before a preemption (they count for penalties and seeds).
    num_output_tokens: int = 0
    # Received K/V to write into its blocks first (disaggregated prefill), or None.
    kv_load: KVLoad | None = None


@dataclass(frozen=True)
class CachedRequestData:
    """A request the runner already holds: only what changed since the last step."""

    request_id: str
    # Blocks appended to the request's block table this step.
    new_block_ids: list[int]
    # Tokens with K/V in the cache before this step's forward pass.
    num_computed_tokens: int
    # Blocks of the block table kept before `new_block_ids` are appended: fewer than the runner
    # holds after rejected draft tokens gave their blocks back (KVCacheManager.trim).
    num_kept_blocks: int | None = None


@dataclass(frozen=True)
class SchedulerOutput:
    """The plan of one step: which requests run and how many tokens each computes."""

    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: list[CachedRequestData]
    # {request_id: tokens to compute this step}; a decode is 1, a prefill chunk is its length.
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    # Requests the runner must forget (finished, aborted, or preempted since the last step).
    finished_req_ids: set[str] = field(default_factory=set)
    # Speculative decoding: {request_id: draft tokens verified this step, after its last known
    # token}; such a request's num_scheduled_tokens is 1 + len(drafts).
    scheduled_spec_token_ids: dict[str, list[int]] = field(default_factory=dict)
    # {request_id: draft tokens to propose after this step} (sampling requests only).
    num_spec_tokens_to_propose: dict[str, int] = field(default_factory=dict)

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0

    def restricted_to(self, req_ids: Collection[str]) -> SchedulerOutput:
        """The same plan for `req_ids` alone (the runner tries a request alone to find which
        one broke a batch, worker/blame.py)."""
        num_scheduled = {r: n for r, n in self.num_scheduled_tokens.items() if r in req_ids}
        return SchedulerOutput(
            [r for r in self.scheduled_new_reqs if r.request_id in req_ids],
            [r for r in self.scheduled_cached_reqs if r.request_id in req_ids],
            num_scheduled, sum(num_scheduled.values()), set(),
            {r: d for r, d in self.scheduled_spec_token_ids.items() if r in req_ids},
            {r: n for r, n in self.num_spec_tokens_to_propose.items() if r in req_ids})


@dataclass(frozen=True)
class ModelRunnerOutput:
    """What one forward pass produced, in the order of `req_ids`.

    A request whose scheduled tokens did not reach the end of its known tokens (a partial prefill
    chunk) gets an empty `sampled_token_ids` entry. A request that verified draft tokens gets the
    accepted drafts plus one token sampled after them (1 to 1 + len(drafts) tokens).
    """

    req_ids: list[str]
    sampled_token_ids: list[list[int]]
    # Parallel to sampled_token_ids; None where the request asked for no logprobs.
    logprobs: list[list[LogprobsEntry] | None]
    # Parallel to req_ids (or empty when no request asked): the logprobs of prompt tokens 1..P-1,
    # given once, with the first sampled token; None elsewhere. The runner gathers them chunk by
    # chunk over a chunked prefill.
    prompt_logprobs: list[list[LogprobsEntry] | None] = field(default_factory=list)
    # Parallel to req_ids (or empty): draft tokens proposed for the next step.
    spec_token_ids: list[list[int]] = field(default_factory=list)


@dataclass(frozen=True)
class EngineCoreOutput:
    """New tokens of one request after a step, and its finish reason once finished."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[LogprobsEntry] | None = None
    # Logprobs of prompt tokens 1..P-1, on the request's first output only, when asked for.
    prompt_logprobs: list[LogprobsEntry] | None = None
    # OpenAI finish_reason ("stop", "length", "abort", "error"), None while running.
    finish_reason: str | None = None
    # The stop token id that ended it, when one did.
    stop_reason: int | None = None
    num_cached_tokens: int = 0
    # A producer's finished request whose blocks stay held for its consumer, or None.
    kv_hold: KVHold | None = None

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True)
class SchedulerStats:
    """A snapshot of the scheduler after a step, for metrics and probes."""

    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    # Fraction of KV blocks in use by requests, 0..1 (cached-but-free blocks do not count).
    kv_cache_usage: float = 0.0
    prefix_cache_queries: int = 0  # tokens looked up in the prefix cache this step
    prefix_cache_hits: int = 0  # tokens found there this step
    num_preemptions: int = 0  # preemptions during this step
    num_scheduled_tokens: int = 0
    num_scheduled_reqs: int = 0
    # KV memory waste = 1 - num_kv_tokens_stored / (num_kv_blocks_in_use * block_size).
    num_kv_blocks_in_use: int = 0  # distinct blocks held by running requests
    num_kv_tokens_stored: int = 0  # tokens whose K/V those blocks hold
    # Speculative decoding this step: requests that verified drafts, draft tokens verified,
    # of which accepted, and accepted ones by position in the draft (index 0 = first).
    num_spec_drafts: int = 0
    num_spec_draft_tokens: int = 0
    num_spec_accepted_tokens: int = 0
    num_spec_accepted_tokens_per_pos: tuple[int, ...] = ()


@dataclass(frozen=True)
class EngineCoreOutputs:
    """Everything one `EngineCore.step()` returns to its caller."""

    outputs: list[EngineCoreOutput]
    scheduler_stats: SchedulerStats
    # Monotonic step counter, for liveness (/health) and readiness (/ready) probes.
    step_index: int = 0
    step_seconds: float = 0.0


class RequestError(Exception):
    """The plan could not run because of these requests' own data (a value no tensor holds, a
    sampling setting the math rejects): `EngineCore` fails them and carries on with the others.
    Any other exception from `execute_model` is fatal to the engine (docs/architecture.md,
    "Failure isolation")."""

    def __init__(self, request_ids: Collection[str], reason: str) -> None:
        super().__init__(f"requests {sorted(request_ids)}: {reason}")
        self.request_ids = frozenset(request_ids)
        self.reason = reason
