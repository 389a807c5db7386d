"""Sampling as a pure function: `sample(logits, SamplingTensors) -> SamplerOutput`.

Order (vLLM v1's): min_tokens mask -> repetition/frequency/presence penalties -> greedy argmax
for temperature-0 rows -> temperature -> min-p -> top-k -> top-p -> draw. Penalties follow vLLM:
repetition over prompt + output tokens (divide positive logits, multiply negative ones),
frequency (per occurrence) and presence (once) over output tokens only.

Logprobs are those of the raw model distribution, log_softmax of the logits before penalties
and temperature, as vLLM v1 returns by default: they describe the model, not the sampler
settings, so they are comparable across requests.

Randomness: a row with a seed draws from its own generator, reseeded from (seed, number of
output tokens so far) each step. Its tokens therefore depend only on its seed and its history,
not on the batch it shares nor on preemption (a recomputed request redraws the same numbers).
Unseeded rows share the engine's generator.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvasir_engine.core.request import LogprobsEntry

# Mixes (seed, step) into one 63-bit generator seed; any odd 64-bit constant works.
_SEED_MIX = 0x9E3779B97F4A7C15
_MASK63 = (1 << 63) - 1


@dataclass(frozen=True)
class SamplingTensors:
    """Per-row sampling settings of one batch, R rows (one per request that samples)."""

    temperature: torch.Tensor  # [R] float32; 0 marks a greedy row
    top_k: torch.Tensor  # [R] int64; vocab size where disabled
    top_p: torch.Tensor  # [R] float32; 1.0 where disabled
    min_p: torch.Tensor  # [R] float32; 0.0 where disabled
    presence_penalty: torch.Tensor  # [R] float32
    frequency_penalty: torch.Tensor  # [R] float32
    repetition_penalty: torch.Tensor  # [R] float32
    # [R, L] int64 prompt+output / output token ids, padded with vocab_size (an id never drawn).
    # None when no row has a penalty.
    prompt_token_ids: torch.Tensor | None
    output_token_ids: torch.Tensor | None
    # [R, V] bool: tokens banned this step (EOS and stop ids before min_tokens); None if none.
    banned_mask: torch.Tensor | None
    # Per row: a seed for this step's draw (already mixed with the step), None = engine generator.
    step_seeds: list[int | None]
    # Largest number of top alternatives any row wants; None when no row wants logprobs.
    max_num_logprobs: int | None
    all_greedy: bool
    all_random: bool


@dataclass(frozen=True)
class TokenLogprobs:
    """Logprobs of given tokens, one per row, and each row's top alternatives."""

    logprobs: torch.Tensor  # [R] float32 raw logprob of each row's token
    ranks: torch.Tensor  # [R] int64: 1 + the number of tokens strictly more likely
    top_token_ids: torch.Tensor | None  # [R, k] int64, best first; None when k == 0
    top_logprobs: torch.Tensor | None  # [R, k] float32


@dataclass(frozen=True)
class SamplerOutput:
    token_ids: torch.Tensor  # [R] int64
    # The raw logprobs of the sampled tokens; None when no row wants logprobs.
    logprobs: TokenLogprobs | None


def step_seed(seed: int, num_output_tokens: int) -> int:
    return ((seed & _MASK63) * _SEED_MIX + num_output_tokens) & _MASK63


def sample(logits: torch.Tensor, st: SamplingTensors,
           generator: torch.Generator | None = None) -> SamplerOutput:
    """logits [R, V] (any float dtype) -> tokens [R] and optional logprobs."""
    logits = logits.float()
    raw_logprobs = torch.log_softmax(logits, dim=-1) if st.max_num_logprobs is not None else None
    if st.banned_mask is not None:
        logits = logits.masked_fill(st.banned_mask, float("-inf"))
    logits = apply_penalties(logits, st)
    greedy_tokens = logits.argmax(dim=-1)
    if st.all_greedy:
        tokens = greedy_tokens
    else:
        probs = filtered_probs(logits, st)
        random_tokens = draw(probs, st.step_seeds, generator)
        tokens = torch.where(st.temperature == 0, greedy_tokens, random_tokens)
    return _with_logprobs(tokens, raw_logprobs, st.max_num_logprobs)


def apply_penalties(logits: torch.Tensor, st: SamplingTensors) -> torch.Tensor:
    num_rows, vocab = logits.shape
    if st.prompt_token_ids is not None:
        # A vocab + 1 wide scratch row absorbs the padding id (vocab_size) and is then dropped.
        seen = torch.zeros(num_rows, vocab + 1, dtype=torch.bool, device=logits.device)
        seen.scatter_(1, st.prompt_token_ids, True)
        seen = seen[:, :vocab]
        penalty = st.repetition_penalty.unsqueeze(1)
        penalized = torch.where(logits > 0, logits / penalty, logits * penalty)
        logits = torch.where(seen, penalized, logits)
    if st.output_token_ids is not None:
        counts = torch.zeros(num_rows, vocab + 1, dtype=logits.dtype, device=logits.device)
        counts.scatter_add_(1, st.output_token_ids, torch.ones_like(st.output_token_ids,
                                                                     dtype=logits.dtype))
        counts = counts[:, :vocab]
        logits = logits - st.frequency_penalty.unsqueeze(1) * counts
        logits = logits - st.presence_penalty.unsqueeze(1) * (counts > 0).to(logits.dtype)
    return logits


def filtered_probs(logits: torch.Tensor, st: SamplingTensors) -> torch.Tensor:
    """Probabilities after temperature, min-p, top-k and top-p; greedy rows are left at t=1."""
    temperature = torch.where(st.temperature == 0, 1.0, st.temperature).unsqueeze(1)
    logits = logits / temperature
    probs = torch.softmax(logits, dim=-1)
    if bool((st.min_p > 0).any()):
        threshold = probs.max(dim=-1, keepdim=True).values * st.min_p.unsqueeze(1)
        logits = logits.masked_fill(probs < threshold, float("-inf"))
    vocab = logits.shape[-1]
    if bool((st.top_k < vocab).any()) or bool((st.top_p < 1).any()):
        logits = _top_k_top_p(logits, st.top_k, st.top_p)
    return torch.softmax(logits, dim=-1)


def _top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    sorted_logits, order = logits.sort(dim=-1, descending=False)
    vocab = logits.shape[-1]
    # Ascending order: keep the last top_k entries, i.e. mask positions below vocab - k.
    kth = (vocab - top_k.clamp(1, vocab)).unsqueeze(1)
    positions = torch.arange(vocab, device=logits.device).unsqueeze(0)
    sorted_logits = sorted_logits.masked_fill(positions < kth, float("-inf"))
    # Drop the low tail whose total mass is <= 1 - p; the most likely token always survives.
    cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    drop = cumulative <= (1 - top_p).unsqueeze(1)
    drop[:, -1] = False
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def draw(probs: torch.Tensor, step_seeds: list[int | None],
         generator: torch.Generator | None) -> torch.Tensor:
    """One token per row, by the exponential race argmax(p / q), q ~ Exp(1) (= sampling from p)."""
    q = torch.empty_like(probs)
    seeded = [i for i, s in enumerate(step_seeds) if s is not None]
    if len(seeded) < len(step_seeds):
        q.exponential_(generator=generator)
    for i in seeded:
        row_generator = torch.Generator(device=probs.device)
        row_generator.manual_seed(step_seeds[i])  # type: ignore[arg-type]
        q[i].exponential_(generator=row_generator)
    return (probs / q).argmax(dim=-1)


def _with_logprobs(tokens: torch.Tensor, raw: torch.Tensor | None,
                   num_top: int | None) -> SamplerOutput:
    if raw is None or num_top is None:
        return SamplerOutput(tokens, None)
    return SamplerOutput(tokens, token_logprobs(raw, tokens, num_top))


def token_logprobs(logprobs: torch.Tensor, token_ids: torch.Tensor,
                   num_top: int) -> TokenLogprobs:
    """logprobs [R, V] (a log_softmax), token_ids [R] -> each token's logprob, rank, top-k."""
    chosen = logprobs.gather(1, token_ids.unsqueeze(1))
    ranks = (logprobs > chosen).sum(dim=-1) + 1
    if num_top == 0:
        return TokenLogprobs(chosen.squeeze(1), ranks, None, None)
    top = logprobs.topk(num_top, dim=-1)
    return TokenLogprobs(chosen.squeeze(1), ranks, top.indices, top.values)


def logprobs_entries(token_ids: list[int], lp: TokenLogprobs,
                     num_tops: list[int]) -> list[LogprobsEntry]:
    """Plain `LogprobsEntry`s of rows `token_ids`, row i keeping its first num_tops[i] tops."""
    chosen, ranks = lp.logprobs.tolist(), lp.ranks.tolist()
    top_ids = lp.top_token_ids.tolist() if lp.top_token_ids is not None else None
    top_lps = lp.top_logprobs.tolist() if lp.top_logprobs is not None else None
    return [LogprobsEntry(token_id, chosen[row],
                          tuple(top_ids[row][:k]) if top_ids else (),
                          tuple(top_lps[row][:k]) if top_lps else (), rank=ranks[row])
            for row, (token_id, k) in enumerate(zip(token_ids, num_tops, strict=True))]
