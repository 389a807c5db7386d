"""The limits a request can never or not yet pass: one check each, with one message.

`fit_error` is the one "can this request ever be scheduled" check (context length, then the
whole KV cache): the scheduler raises it as a ValueError, the server answers it with a 400
naming the field at fault, before queueing. `queue_full` is the one `--max-queue-len` check
(a 429, `QueueFullError`), for the scheduler offline and for the server's admission ledger,
which also counts the sequences still being handed to the engine thread. Torch-free.
"""

from __future__ import annotations

import dataclasses

from kvasir_engine.kv.kv_cache_manager import KVCacheManager


class QueueFullError(RuntimeError):
    """A queue bound is reached: the scheduler's `--max-queue-len`, or one the server counts
    (admission.py); admitting is possible once others finish (the API answers 429 with
    Retry-After). The message names the bound."""


def queue_full(num_held: int, num_new: int, max_num_seqs: int,
               max_queue_len: int | None) -> QueueFullError | None:
    """The one `--max-queue-len` check, for the scheduler (offline) and the server's ledger
    (which also counts what is still being handed to the engine thread): `num_new` more
    sequences beside `num_held` admitted ones exceed the running slots plus the queue."""
    if max_queue_len is None or num_held + num_new - max_num_seqs <= max_queue_len:
        return None
    return QueueFullError(f"the waiting queue is full ({num_held} sequences admitted, "
                          f"{max_num_seqs} running slots + {max_queue_len} waiting, "
                          f"--max-queue-len)")


@dataclasses.dataclass(frozen=True)
class FitError:
    """Why a request of this size could never be scheduled (`Scheduler.fit_error`)."""

    message: str
    field: str  # the number at fault: "prompt" (alone too long) or "max_tokens"


def fit_error(num_prompt_tokens: int, max_tokens: int, max_model_len: int,
              kv: KVCacheManager) -> FitError | None:
    """Why a request of this size could never be scheduled, naming the numbers (vLLM's
    wording for the context length); None if it can be, now or once others finish."""
    if num_prompt_tokens >= max_model_len:
        return FitError(f"the prompt has {num_prompt_tokens} tokens, but this model's "
                        f"maximum context length is {max_model_len} tokens", "prompt")
    num_total = num_prompt_tokens + max_tokens
    if num_total > max_model_len:
        return FitError(f"this model's maximum context length is {max_model_len} tokens, but "
                        f"{num_total} were requested ({num_prompt_tokens} in the prompt + "
                        f"{max_tokens} max_tokens)", "max_tokens")
    # The last sampled token is never fed back, so it needs no KV slot.
    if not kv.can_ever_hold(num_total - 1):
        return FitError(f"prompt ({num_prompt_tokens} tokens) + max_tokens ({max_tokens}) "
                        f"needs {kv.num_blocks_for(num_total - 1)} KV blocks of "
                        f"{kv.block_size} tokens, but the whole KV cache has "
                        f"{kv.block_pool.num_usable_blocks} blocks ({kv.max_num_tokens} tokens)",
                        "max_tokens")
    return None
