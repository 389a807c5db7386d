"""The request lifecycle: `SamplingParams`, `RequestStatus` and `Request`.

One file owns the state machine so that every layer agrees on it. Only the scheduler changes a
request's `status`; output tokens grow through `Request.append_output_token_ids` alone.
"""

from __future__ import annotations

import enum
import math
import time
from dataclasses import dataclass, field


class RequestStatus(enum.IntEnum):
    """Ordered: every status above PREEMPTED is a finished one."""

    WAITING = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_ERROR = enum.auto()

    @property
    def is_finished(self) -> bool:
        return self > RequestStatus.PREEMPTED

    @property
    def finish_reason(self) -> str | None:
        """The OpenAI `finish_reason` of a finished status, None while unfinished."""
        return _STATUS_TO_FINISH_REASON.get(self)


_STATUS_TO_FINISH_REASON = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH_CAPPED: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


@dataclass(frozen=True)
class KVLoadSpec:
    """A consumer's request whose prompt K/V arrived from a producer (disaggregated prefill,
    kv_transfer/): staged outside the cache until the scheduler admits the request, then written
    into its blocks by the runner, before the step that decodes from them."""

    staging_id: str  # the staged blocks' key in the connector
    first_block: int  # block index of the prompt the first staged block belongs at
    num_blocks: int  # staged blocks, for indices [first_block, first_block + num_blocks)
    # Tokens whose K/V the staged blocks (with the prefix-cache hits before them) hold: the
    # prompt's all but last, which the consumer recomputes for its logits, as a prefix-cache
    # hit never covers a whole prompt.
    num_tokens: int


# The tenant of a request when the server has no API keys (and of offline use).
ANONYMOUS_TENANT = "anonymous"


# The most top alternatives a request may ask for, per position (OpenAI's and vLLM's default).
MAX_LOGPROBS = 20

# The widths the runner's tensors hold these in: counts and token ids int32, seeds int64.
INT32_MAX = 2**31 - 1
INT64_MAX = 2**63 - 1


def _check(ok: bool, name: str, message: str) -> None:
    if not ok:
        raise ValueError(f"{name}: {message}")


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling and stopping settings (OpenAI/vLLM names and meanings).

    `temperature == 0` means greedy. `top_k <= 0` and `top_p == 1` and `min_p == 0` disable those
    filters. `logprobs` is the number of top alternatives to return besides the sampled token
    (None: no logprobs at all). `prompt_logprobs` likewise for every prompt position after the
    first (vLLM's field; None: none, and the prefix cache is then read as usual). `n` is
    expanded into n requests by the API layer, never here.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    max_tokens: int = 16
    min_tokens: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        _check(math.isfinite(self.temperature) and self.temperature >= 0, "temperature",
               f"must be >= 0, got {self.temperature}")
        _check(0 < self.top_p <= 1, "top_p", f"must be in (0, 1], got {self.top_p}")
        _check(-1 <= self.top_k <= INT32_MAX, "top_k",
               f"must be -1, 0 (disabled) or positive up to {INT32_MAX}, got {self.top_k}")
        _check(self.seed is None or -INT64_MAX - 1 <= self.seed <= INT64_MAX, "seed",
               f"must fit in 64 bits, got {self.seed}")
        _check(0 <= self.min_p <= 1, "min_p", f"must be in [0, 1], got {self.min_p}")
        _check(-2 <= self.presence_penalty <= 2, "presence_penalty",
               f"must be in [-2, 2], got {self.presence_penalty}")
        _check(-2 <= self.frequency_penalty <= 2, "frequency_penalty",
               f"must be in [-2, 2], got {self.frequency_penalty}")
        _check(0 < self.repetition_penalty <= 2 and math.isfinite(self.repetition_penalty),
               "repetition_penalty", f"must be in (0, 2], got {self.repetition_penalty}")
        _check(1 <= self.max_tokens <= INT32_MAX, "max_tokens",
               f"must be in [1, {INT32_MAX}], got {self.max_tokens}")
        _check(0 <= self.min_tokens <= self.max_tokens, "min_tokens",
               f"must be in [0, max_tokens], got {self.min_tokens}")
        _check(self.logprobs is None or 0 <= self.logprobs <= MAX_LOGPROBS, "logprobs",
               f"must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")
        _check(self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= MAX_LOGPROBS,
               "prompt_logprobs", f"must be in [0, {MAX_LOGPROBS}], got {self.prompt_logprobs}")
        _check(all(s for s in self.stop), "stop", "stop strings must be non-empty")
        _check(all(0 <= t <= INT32_MAX for t in self.stop_token_ids), "stop_token_ids",
               f"token ids must be in [0, {INT32_MAX}]")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def skip_reading_prefix_cache(self) -> bool:
        # Prompt logprobs need the logits of every prompt position: a cached block has none.
        return self.prompt_logprobs is not None


@dataclass
class Request:
    """One sequence being generated. `n > 1` at the API becomes n Requests.

    Token accounting: `all_token_ids = prompt_token_ids + output_token_ids`;
    `num_computed_tokens` of them have K/V in the cache (including prefix-cache hits).
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: frozenset[int] = frozenset()
    cache_salt: str | None = None
    # Whose request this is: the scheduler's fair share and per-tenant bounds group by it.
    tenant_id: str = ANONYMOUS_TENANT
    arrival_time: float = field(default_factory=time.monotonic)
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    # Logprobs of each output token, parallel to output_token_ids when requested.
    output_logprobs: list[LogprobsEntry] = field(default_factory=list)
    num_computed_tokens: int = 0
    # Prompt tokens served from the prefix cache at first admission (for usage reporting).
    num_cached_tokens: int = -1
    num_preemptions: int = 0
    # Draft tokens proposed after its last token, to be verified at its next decode step.
    spec_token_ids: list[int] = field(default_factory=list)
    # Timestamps (time.monotonic) for the per-phase timings users and metrics see.
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None  # vLLM's decode time ends here, not at the finish
    finished_time: float | None = None
    # Disaggregated prefill (kv_transfer/): a producer's request keeps its blocks after it
    # finishes, for its consumer to fetch; a consumer's arrives with its prompt's K/V staged.
    do_remote_decode: bool = False
    kv_load: KVLoadSpec | None = None

    def __post_init__(self) -> None:
        _check(len(self.prompt_token_ids) > 0, "prompt", "must contain at least one token")
        _check(bool(self.tenant_id), "tenant_id", "must not be empty")

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def skip_reading_prefix_cache(self) -> bool:
        return self.sampling_params.skip_reading_prefix_cache

    def stop_status(self, max_model_len: int) -> tuple[RequestStatus | None, int | None]:
        """(finished status, stop token id) after the last appended token; (None, None) if it
        goes on."""
        params = self.sampling_params
        last_token_id = self.output_token_ids[-1]
        if self.num_output_tokens >= params.min_tokens:
            if not params.ignore_eos and last_token_id in self.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED, None
            if last_token_id in params.stop_token_ids:
                return RequestStatus.FINISHED_STOPPED, last_token_id
        if self.num_output_tokens >= params.max_tokens or self.num_tokens >= max_model_len:
            return RequestStatus.FINISHED_LENGTH_CAPPED, None
        return None, None

    def append_output_token_ids(self, token_ids: list[int],
                                logprobs: list[LogprobsEntry] | None = None) -> None:
        self.output_token_ids.extend(token_ids)
        if logprobs:
            self.output_logprobs.extend(logprobs)


@dataclass(frozen=True)
class LogprobsEntry:
    """Logprob of one token (sampled, or a prompt token) plus the top alternatives (ids and
    logprobs, best first), all from the raw model distribution at its position."""

    token_id: int
    logprob: float
    top_token_ids: tuple[int, ...] = ()
    top_logprobs: tuple[float, ...] = ()
    # 1 + the number of tokens strictly more likely than token_id (vLLM's rank); 0 if unknown.
    rank: int = 0
