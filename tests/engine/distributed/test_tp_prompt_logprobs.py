"""Prompt logprobs under tensor parallelism: every rank gathers the vocab-sharded LM head over the
same prompt rows, and rank 0's answer equals the single-process one."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import write_checkpoint
from kvasir_engine.core.outputs import NewRequestData, SchedulerOutput
from kvasir_engine.core.request import LogprobsEntry, SamplingParams
from kvasir_engine.worker.executor import UniprocExecutor
from kvasir_engine.worker.multiproc_executor import MultiprocExecutor
from tp_driver import make_config

PROMPTS = [[5, 17, 33, 2, 91, 8, 14], list(range(10, 40))]
PARAMS = SamplingParams(temperature=0.0, max_tokens=2, logprobs=2, prompt_logprobs=3)


def score(config) -> list[list[LogprobsEntry] | None]:  # type: ignore[no-untyped-def]
    executor = UniprocExecutor(config) if config.parallel.tensor_parallel_size == 1 \
        else MultiprocExecutor(config)
    try:
        executor.initialize()
        new = [NewRequestData(f"r{i}", p, len(p), PARAMS, [1 + 4 * i + b for b in range(4)], 0)
               for i, p in enumerate(PROMPTS)]
        so = SchedulerOutput(new, [], {n.request_id: len(n.token_ids) for n in new},
                             sum(map(len, PROMPTS)))
        return executor.execute_model(so).prompt_logprobs
    finally:
        executor.shutdown()


def test_tp2_prompt_logprobs_match_tp1(tmp_path: Path) -> None:
    model = write_checkpoint(tmp_path / "llama", "llama", hidden_size=128, intermediate_size=256,
                             initializer_range=0.5)  # peaked: few near-ties
    one, two = score(make_config(model, 1)), score(make_config(model, 2))
    assert len(one) == len(two) == len(PROMPTS)
    for prompt, a, b in zip(PROMPTS, one, two, strict=True):
        assert a is not None and b is not None and len(a) == len(b) == len(prompt) - 1
        for x, y in zip(a, b, strict=True):
            assert x.token_id == y.token_id
            assert x.logprob == pytest.approx(y.logprob, abs=1e-4)
            assert list(x.top_logprobs) == pytest.approx(list(y.top_logprobs), abs=1e-4)
            # Ids and ranks agree up to the order of near-ties (summation order differs by rank).
            assert abs(x.rank - y.rank) <= 1
            assert sum(i != j for i, j in zip(x.top_token_ids, y.top_token_ids,
                                              strict=True)) <= 2
