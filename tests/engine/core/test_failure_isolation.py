"""Failure isolation in the engine (issue 39): a request whose own data breaks a step fails alone.

The poisoned requests below carry sampling values that `SamplingParams` would refuse (set past
its validation, as a value that slipped through a validator would arrive): a presence penalty no
float holds (it breaks the batch's tensor conversion, as top_k = 2**63 once did) and a logprobs
count beyond the vocabulary (it breaks the sampler's top-k). Each fails with finish_reason
"error"; every other request of the same steps finishes with the tokens it gets alone; the
blocks come back; and blocks the failed step was to write never serve as prefix-cache hits.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from helpers import tiny_engine_config, write_checkpoint
from kvasir_engine.core.request import SamplingParams
from kvasir_engine.frontend.llm_engine import LLMEngine

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13], [20, 21, 22], [30, 31, 32, 33, 34, 35]]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("isolation"), "llama")


def make_engine(model: Path, prefix_caching: bool = False) -> LLMEngine:
    base = tiny_engine_config(model)
    return LLMEngine.from_config(dataclasses.replace(
        base, cache=dataclasses.replace(base.cache, enable_prefix_caching=prefix_caching)))


def poisoned(**fields: object) -> SamplingParams:
    params = SamplingParams(temperature=0.5, max_tokens=6, ignore_eos=True)
    for name, value in fields.items():
        object.__setattr__(params, name, value)  # past __post_init__'s checks
    return params


def run(engine: LLMEngine, requests: dict[str, tuple[list[int], SamplingParams]]
        ) -> dict[str, tuple[list[int], str | None]]:
    for request_id, (prompt, params) in requests.items():
        engine.add_request(request_id, prompt, params)
    got: dict[str, tuple[list[int], str | None]] = {rid: ([], None) for rid in requests}
    for _ in range(200):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            tokens, _ = got[out.request_id]
            got[out.request_id] = (tokens + out.new_token_ids, out.finish_reason)
    assert not engine.has_unfinished_requests()
    return got


@pytest.fixture(scope="module")
def alone(model: Path) -> list[list[int]]:
    engine = make_engine(model)
    try:
        return [out.token_ids for out in engine.generate(PROMPTS, GREEDY)]
    finally:
        engine.shutdown()


@pytest.mark.parametrize("poison", [{"presence_penalty": 10**400}, {"logprobs": 10**6}],
                         ids=["float-overflow", "logprobs-beyond-vocab"])
def test_a_poisoned_request_fails_alone(model: Path, alone: list[list[int]],
                                        poison: dict[str, object]) -> None:
    engine = make_engine(model)
    try:
        requests = {f"ok-{i}": (prompt, GREEDY) for i, prompt in enumerate(PROMPTS)}
        requests["bad"] = ([40, 41, 42, 43], poisoned(**poison))
        got = run(engine, requests)
        assert got["bad"] == ([], "error")
        for i in range(len(PROMPTS)):
            assert got[f"ok-{i}"] == (alone[i], "length"), i
        # Every block came back, and the engine goes on serving.
        kv = engine.core.scheduler.kv_cache_manager
        assert kv.num_free_blocks == kv.block_pool.num_usable_blocks
        again = run(engine, {"later": (PROMPTS[0], GREEDY)})
        assert again["later"] == (alone[0], "length")
    finally:
        engine.shutdown()


def test_a_failed_steps_blocks_are_never_prefix_hits(model: Path,
                                                     alone: list[list[int]]) -> None:
    """Blocks are keyed in the prefix cache when allocated; the failed step never wrote them,
    so the same prompt afterwards must recompute, not read them."""
    engine = make_engine(model, prefix_caching=True)
    try:
        got = run(engine, {"bad": (PROMPTS[0], poisoned(presence_penalty=10**400)),
                           "ok": (PROMPTS[1], GREEDY)})
        assert got["bad"] == ([], "error") and got["ok"] == (alone[1], "length")
        again = run(engine, {"same-prompt": (PROMPTS[0], GREEDY)})
        assert again["same-prompt"] == (alone[0], "length")
    finally:
        engine.shutdown()


def test_an_engine_failure_is_not_blamed_on_a_request(model: Path) -> None:
    """When every request runs fine alone, the batch itself is broken: the step raises."""
    engine = make_engine(model)
    try:
        runner = engine.core.executor.runner  # type: ignore[attr-defined]

        def broken(*_: object, **__: object) -> None:
            raise RuntimeError("the device is gone")

        runner._start_forward = broken  # noqa: SLF001
        engine.add_request("a", PROMPTS[0], GREEDY)
        with pytest.raises(RuntimeError, match="the device is gone"):
            engine.step()
    finally:
        engine.shutdown()
