"""Turn one `SchedulerOutput` plus the runner's per-request state into device tensors.

Requests are laid out in the order new-then-cached, as the scheduler listed them. Every token
gets its input id, position and KV slot; every request its query range, context length and
block table. A request samples only if this step reaches the end of its known tokens (a partial
prefill chunk does not); its logits come from its last token. A request verifying k draft tokens
feeds its last known token and the drafts, and samples at each of those 1 + k positions: row j
is sampled as if the drafts before it were its outputs already (penalties, min_tokens, the
seeded draw of output number n + j), exactly as a step without speculation would. A request that asks for prompt
logprobs also gets a `PromptSpan`: the rows of this chunk whose logits score a later prompt token.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvasir_engine.attention.metadata import (
    AttentionMetadata,
    build_attention_metadata,
    slot_mapping,
)
from kvasir_engine.core.outputs import SchedulerOutput
from kvasir_engine.core.request import LogprobsEntry, SamplingParams
from kvasir_engine.layers.sampler import SamplingTensors, step_seed


@dataclass
class RequestState:
    """What the runner remembers of one request between steps."""

    request_id: str
    token_ids: list[int]  # prompt + outputs, including the runner's own samples
    num_prompt_tokens: int
    sampling_params: SamplingParams
    block_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    # Prompt logprobs gathered so far (tokens 1..), while the request's prefill still owes them;
    # None when not asked for or already delivered (a request resumed after its first output).
    prompt_logprobs: list[LogprobsEntry] | None = None

    def __post_init__(self) -> None:
        if self.sampling_params.prompt_logprobs is not None and self.num_output_tokens == 0:
            if self.num_computed_tokens > 0:
                raise ValueError(f"request {self.request_id}: prompt logprobs need every prompt "
                                 f"position computed, but {self.num_computed_tokens} came from "
                                 f"the prefix cache")
            self.prompt_logprobs = []

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens


@dataclass(frozen=True)
class PromptSpan:
    """Rows [row_start, row_start + num_rows) of a batch whose logits score prompt tokens
    first_target, first_target + 1, ... of request_id."""

    request_id: str
    row_start: int
    num_rows: int
    first_target: int


@dataclass(frozen=True)
class PreparedBatch:
    req_ids: list[str]  # every scheduled request, in batch order
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    meta: AttentionMetadata
    logits_indices: torch.Tensor  # [S] int64: the rows sampled (below), in order
    # The sampling requests, with the drafts each verifies; request i owns 1 + len(drafts[i])
    # consecutive sample rows (a plain one: its last token's).
    sample_req_ids: list[str]
    sampling: SamplingTensors | None  # [S] rows; None when no request samples this step
    prompt_spans: list[PromptSpan] = field(default_factory=list)
    sample_spec_token_ids: list[list[int]] = field(default_factory=list)


def prepare_batch(so: SchedulerOutput, states: dict[str, RequestState], block_size: int,
                  device: torch.device, vocab_size: int,
                  eos_token_ids: frozenset[int]) -> PreparedBatch:
    req_ids = [r.request_id for r in so.scheduled_new_reqs]
    req_ids += [r.request_id for r in so.scheduled_cached_reqs]
    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    qsl, seq_lens, sample_rows = [0], [], []
    prompt_spans: list[PromptSpan] = []
    for req_id in req_ids:
        state, num_new = states[req_id], so.num_scheduled_tokens[req_id]
        start, end = state.num_computed_tokens, state.num_computed_tokens + num_new
        drafts = so.scheduled_spec_token_ids.get(req_id, [])
        token_ids = state.token_ids + drafts if drafts else state.token_ids
        if end > len(token_ids) or (drafts and start != len(state.token_ids) - 1):
            raise ValueError(f"request {req_id}: scheduled tokens {start}..{end} but "
                             f"{len(state.token_ids)} are known and {len(drafts)} drafted")
        input_ids += token_ids[start:end]
        slots += slot_mapping(state.block_ids, start, end, block_size)
        positions += range(start, end)
        # Position p's logits score token p + 1; the last prompt position's score the first output.
        num_scored = min(end, state.num_prompt_tokens - 1) - start
        if state.prompt_logprobs is not None and num_scored > 0:
            prompt_spans.append(PromptSpan(req_id, qsl[-1], num_scored, start + 1))
        qsl.append(qsl[-1] + num_new)
        seq_lens.append(end)
        if end == len(token_ids):
            sample_rows.append(len(seq_lens) - 1)
    meta = build_attention_metadata(slots, qsl, seq_lens,
                                    [states[r].block_ids for r in req_ids], device)

    def as_tensor(values: list[int], dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)

    sample_req_ids = [req_ids[i] for i in sample_rows]
    spec_token_ids = [so.scheduled_spec_token_ids.get(r, []) for r in sample_req_ids]
    logits_indices = [row for i, drafts in zip(sample_rows, spec_token_ids, strict=True)
                      for row in range(qsl[i + 1] - 1 - len(drafts), qsl[i + 1])]
    sampling = None
    if sample_req_ids:
        sampling = build_sampling_tensors(sample_row_states(
            [states[r] for r in sample_req_ids], spec_token_ids), device, vocab_size,
            eos_token_ids)
    return PreparedBatch(
        req_ids=req_ids,
        input_ids=as_tensor(input_ids, torch.int64),
        positions=as_tensor(positions, torch.int64),
        meta=meta,
        logits_indices=as_tensor(logits_indices, torch.int64),
        sample_req_ids=sample_req_ids,
        sampling=sampling,
        prompt_spans=prompt_spans,
        sample_spec_token_ids=spec_token_ids,
    )


def sample_row_states(states: list[RequestState],
                       spec_token_ids: list[list[int]]) -> list[RequestState]:
    """One state per sample row: a verifying request's row j sees drafts[:j] as its outputs."""
    if not any(spec_token_ids):
        return states
    rows: list[RequestState] = []
    for state, drafts in zip(states, spec_token_ids, strict=True):
        rows.append(state)
        rows += [RequestState(state.request_id, state.token_ids + drafts[:j],
                              state.num_prompt_tokens, state.sampling_params)
                 for j in range(1, len(drafts) + 1)]
    return rows


def sample_rows(sample_req_ids: list[str],
                spec_token_ids: list[list[int]]) -> dict[str, tuple[int, int]]:
    """{request id: (first, end) of its sample rows}: one row, or 1 + its drafts verifying."""
    rows: dict[str, tuple[int, int]] = {}
    row = 0
    for i, req_id in enumerate(sample_req_ids):
        num_rows = 1 + (len(spec_token_ids[i]) if spec_token_ids else 0)
        rows[req_id] = (row, row + num_rows)
        row += num_rows
    return rows


def _padded(rows: list[list[int]], pad: int, device: torch.device) -> torch.Tensor:
    width = max(1, max(len(r) for r in rows))
    return torch.tensor([r + [pad] * (width - len(r)) for r in rows], dtype=torch.int64,
                        device=device)


def build_sampling_tensors(states: list[RequestState], device: torch.device, vocab_size: int,
                           eos_token_ids: frozenset[int]) -> SamplingTensors:
    params = [s.sampling_params for s in states]

    def floats(values: list[float]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.float32, device=device)

    has_penalty = any(p.repetition_penalty != 1 or p.presence_penalty or p.frequency_penalty
                      for p in params)
    prompt_ids = output_ids = None
    if has_penalty:
        prompt_ids = _padded([s.token_ids for s in states], vocab_size, device)
        output_ids = _padded([s.token_ids[s.num_prompt_tokens:] for s in states], vocab_size,
                             device)
    banned = None
    if any(s.num_output_tokens < s.sampling_params.min_tokens for s in states):
        banned = torch.zeros(len(states), vocab_size, dtype=torch.bool, device=device)
        for row, s in enumerate(states):
            p = s.sampling_params
            if s.num_output_tokens < p.min_tokens:
                ids = set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos_token_ids))
                banned[row, [i for i in ids if i < vocab_size]] = True
    wanted = [p.logprobs for p in params if p.logprobs is not None]
    return SamplingTensors(
        temperature=floats([p.temperature for p in params]),
        top_k=torch.tensor([min(p.top_k, vocab_size) if p.top_k > 0 else vocab_size
                            for p in params],
                           dtype=torch.int64, device=device),
        top_p=floats([p.top_p for p in params]),
        min_p=floats([p.min_p for p in params]),
        presence_penalty=floats([p.presence_penalty for p in params]),
        frequency_penalty=floats([p.frequency_penalty for p in params]),
        repetition_penalty=floats([p.repetition_penalty for p in params]),
        prompt_token_ids=prompt_ids,
        output_token_ids=output_ids,
        banned_mask=banned,
        step_seeds=[None if s.sampling_params.seed is None
                    else step_seed(s.sampling_params.seed, s.num_output_tokens) for s in states],
        max_num_logprobs=max(wanted) if wanted else None,
        all_greedy=all(p.is_greedy for p in params),
        all_random=not any(p.is_greedy for p in params),
    )
