"""`RequestOutput`: what the engine hands its callers (offline `generate`, the HTTP layer) per step.

Produced by the output processor from `EngineCoreOutput`s: token ids become text here, after the
core. Deltas, so a stream can forward them as they come; the final one carries the finish reason,
usage counts, the per-phase timings that responses report and the stats the metrics observe.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvasir_engine.core.request import LogprobsEntry


@dataclass(frozen=True)
class RequestTimings:
    """Seconds spent in each phase (Ollama's prompt_eval_duration / eval_duration, in seconds)."""

    queue_seconds: float  # arrival -> first scheduled
    prefill_seconds: float  # first scheduled -> first token
    decode_seconds: float  # first token -> finished
    e2e_seconds: float


@dataclass(frozen=True)
class FinishedRequestStats:
    """What vLLM's metrics observe once per finished request (its FinishedRequestStats), from the
    scheduler's timestamps, in seconds. A phase the request never reached is None: the queue of
    one aborted while waiting, prefill and decode of one that ended before its first token."""

    e2e_seconds: float  # arrival -> finished
    queue_seconds: float | None  # arrival -> first scheduled
    prefill_seconds: float | None  # first scheduled -> first token (preemptions included)
    decode_seconds: float | None  # first token -> last token (preemptions included)
    max_tokens: int  # the request's max_tokens (the server always sets one)


@dataclass(frozen=True)
class RequestOutput:
    request_id: str
    # Text decoded since the previous RequestOutput of this request (never splits a UTF-8 char).
    text_delta: str
    # Token ids sampled since the previous RequestOutput.
    new_token_ids: list[int]
    # Logprobs of the tokens whose text is now out (text_delta), when asked for: a token whose
    # text a stop string removed never appears, and one whose text is held back comes later.
    new_logprobs: list[LogprobsEntry] | None
    # "stop", "length", "abort" or "error" on the last output of a request; None before.
    finish_reason: str | None
    # The stop string or stop token id that ended the request, when one did.
    stop_reason: str | int | None
    num_prompt_tokens: int
    num_output_tokens: int  # all output tokens so far
    num_cached_tokens: int  # prompt tokens served from the prefix cache
    timings: RequestTimings | None = None  # set on the final output
    finished: FinishedRequestStats | None = None  # set on the final output
    # Arrival -> first token, on the output that carries the request's first token.
    ttft_seconds: float | None = None
    # Logprobs of prompt tokens 1..P-1 (the first has none), on the first output, when asked for.
    prompt_logprobs: list[LogprobsEntry] | None = None
    # A producer's final output (disaggregated prefill): where its consumer fetches the K/V,
    # in vLLM's names (remote_engine_id, remote_host, remote_port, ...).
    kv_transfer_params: dict[str, Any] | None = None

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None
