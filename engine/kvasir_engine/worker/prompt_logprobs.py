"""Prompt logprobs: how likely the model finds each prompt token given the tokens before it.

What lm-evaluation-harness's loglikelihood tasks (and OpenAI's `echo` with `logprobs`) read. The
hidden state of prompt position p, through the LM head, scores token p + 1; the runner keeps the
rows of a prefill chunk that score prompt tokens (`PromptSpan`s), and this module turns them into
`LogprobsEntry`s, appended to the request's state chunk by chunk, so a chunked prefill over
several steps scores every position exactly once. The values are the raw model distribution,
like the sampled tokens' logprobs (see layers/sampler.py).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kvasir_engine.layers.sampler import logprobs_entries, token_logprobs
from kvasir_engine.worker.input_batch import PromptSpan, RequestState

# Rows of logits made at a time: 256 rows of a 49k vocabulary are 50 MB of float32.
_MAX_ROWS = 256


def gather_prompt_logprobs(compute_logits: Callable[[torch.Tensor], torch.Tensor],
                           hidden: torch.Tensor, spans: list[PromptSpan],
                           states: dict[str, RequestState]) -> None:
    """hidden [T, hidden] of this step's batch; appends each span's entries to its state."""
    for span in spans:
        state = states[span.request_id]
        owed = state.prompt_logprobs
        num_top = state.sampling_params.prompt_logprobs
        if owed is None or num_top is None:
            continue
        if len(owed) + 1 != span.first_target:
            raise RuntimeError(f"request {span.request_id}: prompt logprobs scored up to token "
                               f"{len(owed)}, but this chunk starts at {span.first_target}")
        for offset in range(0, span.num_rows, _MAX_ROWS):
            num_rows = min(_MAX_ROWS, span.num_rows - offset)
            start = span.row_start + offset
            logprobs = torch.log_softmax(compute_logits(hidden[start:start + num_rows]).float(),
                                         dim=-1)  # [num_rows, vocab]
            first = span.first_target + offset
            targets = state.token_ids[first:first + num_rows]
            scored = token_logprobs(logprobs, torch.tensor(targets, device=logprobs.device),
                                    num_top)
            owed.extend(logprobs_entries(targets, scored, [num_top] * num_rows))
