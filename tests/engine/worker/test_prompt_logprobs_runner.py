"""The runner scores prompt tokens: once per position over a chunked prefill, delivered with the
first sampled token, never again after a preemption, equal to the model's own log_softmax."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import StepDriver, tiny_engine_config, write_checkpoint
from kvasir_engine.core.outputs import NewRequestData, RequestError, SchedulerOutput
from kvasir_engine.core.request import SamplingParams
from kvasir_engine.worker.model_runner import ModelRunner

PROMPT = [(11 * i + 5) % 370 + 3 for i in range(37)]
SCORED = SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=3)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("llama"), "llama", shard=False)


@pytest.fixture
def runner(model_dir: Path) -> ModelRunner:
    r = ModelRunner(tiny_engine_config(model_dir))
    r.initialize_kv_cache()
    return r


def reference_logprobs(model_dir: Path, token_ids: list[int]) -> torch.Tensor:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir),
                                                              dtype=torch.float32).eval()
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([token_ids])).logits[0], dim=-1)


def prefill(runner: ModelRunner, chunk: int, params: SamplingParams = SCORED) -> list[object]:
    """Prefills PROMPT in chunks; returns each step's prompt_logprobs list for the request."""
    driver = StepDriver(runner, runner.block_size)
    driver.tokens["p"], driver.computed["p"], driver.num_prompt["p"] = list(PROMPT), 0, len(PROMPT)
    delivered = []
    while driver.computed["p"] < len(PROMPT):
        n = min(chunk, len(PROMPT) - driver.computed["p"])
        out = driver.step({"p": n}, {"p": params})
        delivered.append(out.prompt_logprobs[0] if out.prompt_logprobs else None)
    out = driver.step({"p": 1}, {"p": params})  # a decode: nothing more to deliver
    delivered.append(out.prompt_logprobs[0] if out.prompt_logprobs else None)
    return delivered


@pytest.mark.parametrize("chunk", [len(PROMPT), 8, 1])
def test_every_position_is_scored_once_and_delivered_with_the_first_token(
        runner: ModelRunner, model_dir: Path, chunk: int) -> None:
    delivered = prefill(runner, chunk)
    # Only the step that samples the first token carries them.
    assert all(d is None for d in delivered[:-2]) and delivered[-1] is None
    entries = delivered[-2]
    assert isinstance(entries, list) and len(entries) == len(PROMPT) - 1
    ref = reference_logprobs(model_dir, PROMPT)
    for i, e in enumerate(entries, start=1):
        row = ref[i - 1]
        assert e.token_id == PROMPT[i]
        assert e.logprob == pytest.approx(row[PROMPT[i]].item(), abs=1e-4)
        assert e.rank == int((row > row[PROMPT[i]]).sum()) + 1
        top = row.topk(3)
        assert list(e.top_token_ids) == top.indices.tolist()
        assert list(e.top_logprobs) == pytest.approx(top.values.tolist(), abs=1e-4)


def test_requests_without_prompt_logprobs_get_none(runner: ModelRunner) -> None:
    delivered = prefill(runner, 8, SamplingParams(temperature=0, max_tokens=4))
    assert delivered == [None] * len(delivered)


def test_a_request_resumed_after_its_first_token_is_not_scored_again(runner: ModelRunner) -> None:
    resumed = PROMPT + [7, 9]  # recomputed from its tokens after a preemption
    so = SchedulerOutput([NewRequestData("p", resumed, len(PROMPT), SCORED,
                                         list(range(11)), 0, num_output_tokens=2)], [],
                         {"p": len(resumed)}, len(resumed))
    out = runner.execute_model(so)
    assert out.sampled_token_ids[0] and out.prompt_logprobs == []


def test_prompt_positions_from_the_prefix_cache_are_refused(runner: ModelRunner) -> None:
    so = SchedulerOutput([NewRequestData("p", PROMPT, len(PROMPT), SCORED, list(range(10)), 8)],
                         [], {"p": len(PROMPT) - 8}, len(PROMPT) - 8)
    with pytest.raises(RequestError, match="prefix cache") as refused:
        runner.execute_model(so)
    assert refused.value.request_ids == {"p"}  # the core fails that request alone


def test_a_one_token_prompt_has_nothing_to_score(runner: ModelRunner) -> None:
    so = SchedulerOutput([NewRequestData("p", [5], 1, SCORED, [0], 0)], [], {"p": 1}, 1)
    out = runner.execute_model(so)
    assert out.prompt_logprobs == [[]]
