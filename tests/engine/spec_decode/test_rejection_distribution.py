"""Statistical check: tokens emitted by a verification follow the target model's distribution.

A tiny random Llama whose LM head is scaled up (peaked next-token distributions, so drafts are
both accepted and rejected often) verifies the same drafts [d0, d1] after the same prompt for
thousands of unseeded requests (the engine generator; its seed is fixed, so the test is
deterministic). Without speculation the first token would be drawn from p0 = p(. | prompt), the
second from p1 = p(. | prompt, d0). So:

- the first emitted token must follow p0 (whether it is the accepted d0 or a correction);
- among requests that accepted d0, the second emitted token must follow p1 (whether it is the
  accepted d1 or a correction);

both checked with Pearson's chi-square goodness-of-fit test at a false-alarm rate of 1e-3 per
check (cells with fewer than 5 expected draws are pooled), under temperature 1 and under
temperature 0.8 with top-p 0.95 and top-k 20 (the expected distribution then being the sampler's
filtered one, `filtered_probs`, of the reference logits).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import tiny_engine_config, write_checkpoint
from kvasir_engine.core.outputs import CachedRequestData, NewRequestData, SchedulerOutput
from kvasir_engine.core.request import SamplingParams
from kvasir_engine.layers.sampler import filtered_probs
from kvasir_engine.worker.input_batch import RequestState, build_sampling_tensors
from kvasir_engine.worker.model_runner import ModelRunner

FALSE_ALARM_RATE = 1e-3
PROMPT = [5, 17, 33, 9, 80, 41, 7]
NUM_REQUESTS = 3000
BATCH = 500
BLOCK_SIZE = 4


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from safetensors.torch import load_file, save_file

    directory = write_checkpoint(tmp_path_factory.mktemp("peaked"), "llama", seed=3, shard=False)
    weights = load_file(str(directory / "model.safetensors"))
    weights["lm_head.weight"] = weights["lm_head.weight"] * 30.0
    save_file(weights, str(directory / "model.safetensors"), metadata={"format": "pt"})
    return directory


def _reference_probs(runner: ModelRunner, token_ids: list[int],
                     params: SamplingParams) -> torch.Tensor:
    """The sampler's distribution after `token_ids`, from a plain forward of the transformers
    model (the engine matches it in float32, tests/engine/test_end_to_end.py)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(runner.config.model.model,
                                                 dtype=torch.float32).eval()
    with torch.inference_mode():
        logits = model(torch.tensor([token_ids])).logits[0, -1:].float()
    state = RequestState("ref", list(token_ids), len(PROMPT), params)
    tensors = build_sampling_tensors([state], torch.device("cpu"), logits.shape[-1], frozenset())
    return filtered_probs(logits, tensors)[0]


def _verify_many(runner: ModelRunner, params: SamplingParams,
                 drafts: list[int]) -> list[list[int]]:
    """Every request: prefill all but the last prompt token, then verify `drafts` after it."""
    emitted: list[list[int]] = []
    num_blocks = -(-(len(PROMPT) + len(drafts)) // BLOCK_SIZE)
    for first in range(0, NUM_REQUESTS, BATCH):
        ids = [f"q{first + i}" for i in range(BATCH)]
        new = [NewRequestData(req_id, list(PROMPT), len(PROMPT), params,
                              list(range(1 + i * num_blocks, 1 + (i + 1) * num_blocks)), 0)
               for i, req_id in enumerate(ids)]
        runner.execute_model(SchedulerOutput(new, [], {r: len(PROMPT) - 1 for r in ids},
                                             BATCH * (len(PROMPT) - 1)))
        cached = [CachedRequestData(r, [], len(PROMPT) - 1) for r in ids]
        out = runner.execute_model(SchedulerOutput(
            [], cached, {r: 1 + len(drafts) for r in ids}, BATCH * (1 + len(drafts)),
            scheduled_spec_token_ids={r: list(drafts) for r in ids}))
        emitted += out.sampled_token_ids
        runner.execute_model(SchedulerOutput([], [], {}, 0, finished_req_ids=set(ids)))
    return emitted


def _chi_square_p_value(draws: list[int], probs: torch.Tensor) -> float:
    counts = torch.bincount(torch.tensor(draws), minlength=probs.numel()).double()
    expected = probs.double() * len(draws)
    big = expected >= 5
    observed_cells = torch.cat([counts[big], counts[~big].sum().unsqueeze(0)])
    expected_cells = torch.cat([expected[big], expected[~big].sum().unsqueeze(0)])
    if float(expected_cells[-1]) < 5:  # too little pooled mass: fold it into the smallest cell
        observed_cells = torch.cat([observed_cells[:-2], observed_cells[-2:].sum().unsqueeze(0)])
        expected_cells = torch.cat([expected_cells[:-2], expected_cells[-2:].sum().unsqueeze(0)])
    assert counts.sum() == len(draws) and len(expected_cells) >= 2
    statistic = float(((observed_cells - expected_cells) ** 2 / expected_cells).sum())
    # the chi-square survival function: the upper regularised gamma Q(df/2, x/2)
    df = len(expected_cells) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(statistic / 2, dtype=torch.float64)))


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0, max_tokens=16),
    SamplingParams(temperature=0.8, top_p=0.95, top_k=20, max_tokens=16),
], ids=["t1", "t0.8-top-p-top-k"])
def test_emitted_tokens_follow_the_target_distribution(model_dir: Path,
                                                       params: SamplingParams) -> None:
    runner = ModelRunner(tiny_engine_config(model_dir, block_size=BLOCK_SIZE, kv_bytes=8 << 20))
    runner.initialize_kv_cache()
    p0 = _reference_probs(runner, PROMPT, params)
    d0 = int(p0.argmax())
    p1 = _reference_probs(runner, PROMPT + [d0], params)
    d1 = int(p1.argsort(descending=True)[1])  # the runner-up: rejected often, accepted often
    assert 0.2 < float(p0[d0]) < 0.95 and 0.05 < float(p1[d1]) < 0.6, "not peaked as planned"

    emitted = _verify_many(runner, params, [d0, d1])
    assert all(1 <= len(e) <= 3 for e in emitted)
    first = [e[0] for e in emitted]
    after_d0 = [e[1] for e in emitted if e[0] == d0]
    assert all(len(e) == 1 for e in emitted if e[0] != d0)  # a correction ends the draft
    assert len(after_d0) > 500
    assert _chi_square_p_value(first, p0) > FALSE_ALARM_RATE
    assert _chi_square_p_value(after_d0, p1) > FALSE_ALARM_RATE
    # The acceptance of d0 is a Binomial(N, p0(d0)): within 4.5 standard deviations.
    n, p = len(first), float(p0[d0])
    assert abs(len(after_d0) - n * p) < 4.5 * (n * p * (1 - p)) ** 0.5
