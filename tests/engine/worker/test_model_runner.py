"""The runner's step protocol: partial prefills, prefix hits, preemption, seeds, logprobs."""

from __future__ import annotations

import pytest
import torch
from helpers import StepDriver, tiny_engine_config, write_checkpoint
from kvasir_engine.core.outputs import CachedRequestData, NewRequestData, SchedulerOutput
from kvasir_engine.core.request import SamplingParams
from kvasir_engine.worker.executor import UniprocExecutor
from kvasir_engine.worker.model_runner import ModelRunner

GREEDY = SamplingParams(temperature=0, max_tokens=8)
PROMPT = [5, 17, 33, 9, 80, 41, 7, 12, 99, 3, 61]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):  # type: ignore[no-untyped-def]
    return write_checkpoint(tmp_path_factory.mktemp("llama"), "llama", shard=False)


@pytest.fixture
def runner(model_dir) -> ModelRunner:  # type: ignore[no-untyped-def]
    r = ModelRunner(tiny_engine_config(model_dir))
    r.initialize_kv_cache()
    return r


def greedy_reference(runner: ModelRunner, n: int = 6) -> list[int]:
    return StepDriver(runner, 4).generate({"ref": PROMPT}, {"ref": GREEDY}, n)["ref"]


def test_executor_reports_runtime_info(model_dir) -> None:  # type: ignore[no-untyped-def]
    executor = UniprocExecutor(tiny_engine_config(model_dir, kv_bytes=1 << 20))
    info = executor.initialize()
    # 2 layers x K,V x 2 kv heads x 16 dims x 4 bytes x 4 tokens = 2048 bytes per block.
    assert info.num_kv_blocks == (1 << 20) // 2048 and info.block_size == 4
    assert info.eos_token_ids == frozenset({2}) and info.device == "cpu"
    executor.shutdown()


def test_partial_prefill_samples_nothing(runner: ModelRunner) -> None:
    so = SchedulerOutput([NewRequestData("a", PROMPT, len(PROMPT), GREEDY, [0, 1], 0)], [],
                         {"a": 6}, 6)
    out = runner.execute_model(so)
    assert out.req_ids == ["a"] and out.sampled_token_ids == [[]]
    so = SchedulerOutput([], [CachedRequestData("a", [2], 6)], {"a": 5}, 5)
    out = runner.execute_model(so)
    assert len(out.sampled_token_ids[0]) == 1


def test_prefix_cache_hit_reuses_blocks(runner: ModelRunner) -> None:
    expected = greedy_reference(runner, 1)
    # Request "b" shares the first 8 prompt tokens (two full blocks) written by "ref".
    so = SchedulerOutput([NewRequestData("b", PROMPT, len(PROMPT), GREEDY, [0, 1, 50], 8)], [],
                         {"b": 3}, 3, finished_req_ids={"ref"})
    assert runner.execute_model(so).sampled_token_ids == [expected]


def test_preempted_request_resumes_with_the_same_tokens(runner: ModelRunner) -> None:
    expected = greedy_reference(runner, 6)
    seeded = SamplingParams(temperature=1.0, seed=3, max_tokens=8)
    sampled = StepDriver(runner, 4).generate({"s": PROMPT}, {"s": seeded}, 6)["s"]
    # Resume both after 3 outputs, as a preempted request comes back: all tokens, no KV.
    for req_id, params, tokens in (("g", GREEDY, expected), ("t", seeded, sampled)):
        driver = StepDriver(runner, 4)
        driver.next_block = 100
        resumed = PROMPT + tokens[:3]
        driver.num_prompt[req_id] = len(PROMPT)
        driver.tokens[req_id], driver.computed[req_id] = list(resumed), 0
        driver.step({req_id: len(resumed)}, {req_id: params})
        for _ in range(2):
            driver.step({req_id: 1}, {req_id: params})
        assert driver.tokens[req_id][len(PROMPT):] == tokens, req_id


def test_logprobs_entries(runner: ModelRunner) -> None:
    params = SamplingParams(temperature=0, logprobs=3, max_tokens=4)
    so = SchedulerOutput([NewRequestData("l", PROMPT, len(PROMPT), params, [0, 1, 2], 0)], [],
                         {"l": len(PROMPT)}, len(PROMPT))
    out = runner.execute_model(so)
    (entry,) = out.logprobs[0]
    assert entry.token_id == out.sampled_token_ids[0][0] == entry.top_token_ids[0]
    assert len(entry.top_logprobs) == 3 and entry.logprob == entry.top_logprobs[0] <= 0
    assert list(entry.top_logprobs) == sorted(entry.top_logprobs, reverse=True)


def test_finished_requests_are_forgotten(runner: ModelRunner) -> None:
    greedy_reference(runner, 2)
    assert "ref" in runner.states
    runner.execute_model(SchedulerOutput([], [], {}, 0, finished_req_ids={"ref"}))
    assert "ref" not in runner.states


def test_bfloat16_runs_close_to_float32(model_dir) -> None:  # type: ignore[no-untyped-def]
    logits = {}
    for dtype in ("float32", "bfloat16"):
        r = ModelRunner(tiny_engine_config(model_dir, dtype=dtype))
        r.initialize_kv_cache()
        assert r.kv_caches[0][0].dtype == getattr(torch, dtype)
        so = SchedulerOutput([NewRequestData("x", PROMPT, len(PROMPT), GREEDY, [0, 1, 2], 0)],
                             [], {"x": len(PROMPT)}, len(PROMPT))
        r.update_states(so)
        logits[dtype] = r.compute_logits(r.prepare(so))
    torch.testing.assert_close(logits["bfloat16"], logits["float32"], atol=0.1, rtol=0.05)
