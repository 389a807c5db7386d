"""A first token interjected between two decoder layers of the step in flight (scheduler.py,
"Interjection"), with a real tiny model: the newcomer's first token comes out while the step
waits (also a lone step of another newcomer), every request's greedy tokens are those it gets
alone, and what must not cut in does not (fcfs, prompts beyond the step's token budget, a
prefix hit on blocks the step is still writing, the option turned off)."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from helpers import tiny_engine_config, write_checkpoint
from kvasir_engine.core.request import SamplingParams
from kvasir_engine.frontend.engine_thread import EngineThread
from kvasir_engine.frontend.engine_types import RequestSpec
from kvasir_engine.frontend.llm_engine import LLMEngine
from kvasir_engine.frontend.request_group import RequestGroup
from kvasir_engine.frontend.request_output import RequestOutput

PARAMS = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
HEAVY = {f"heavy-{i}": [3 + i, 4, 5, 6, 7, 8, 9] for i in range(3)}
LIGHT = [11, 12, 13, 14, 15, 16]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("interject"), "llama", num_hidden_layers=4)


def make_engine(model: Path, policy: str = "fair", interject: bool = True,
                max_num_seqs: int = 3, max_num_batched_tokens: int = 2048) -> LLMEngine:
    base = tiny_engine_config(model)
    return LLMEngine.from_config(dataclasses.replace(base, scheduler=dataclasses.replace(
        base.scheduler, max_num_seqs=max_num_seqs, policy=policy,
        interject_first_tokens=interject, max_num_batched_tokens=max_num_batched_tokens)))


def alone(model: Path, prompt: list[int]) -> list[int]:
    engine = make_engine(model)
    try:
        return engine.generate([prompt], PARAMS)[0].token_ids
    finally:
        engine.shutdown()


def step_with(engine: LLMEngine, between_layers: Callable[[], None]) -> list[RequestOutput]:
    """One step run a decoder layer at a time with `between_layers` called between two of
    them, as the server's engine thread runs it (`EngineThread._step`)."""
    step = engine.begin_step()
    while step.advance():
        between_layers()
    return engine.end_step(step)


class Hook:
    """Called between two layers: at its first call in a step it adds `arrivals`, and each
    call interjects; it records what each call returned."""

    def __init__(self, engine: LLMEngine, arrivals: Callable[[], None]) -> None:
        self.engine, self.arrivals = engine, arrivals
        self.calls = 0
        self.results: list[list[RequestOutput] | None] = []

    def __call__(self) -> None:
        self.calls += 1
        if self.calls == 1:
            self.arrivals()
        self.results.append(self.engine.interject())


def run_to_end(engine: LLMEngine, tokens: dict[str, list[int]]) -> None:
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)


def test_first_token_cuts_in_and_every_output_is_unchanged(model: Path) -> None:
    engine = make_engine(model)
    tokens: dict[str, list[int]] = {}
    for req_id, prompt in HEAVY.items():
        engine.add_request(req_id, prompt, PARAMS, tenant_id="heavy")
    for out in engine.step():  # the heavy prompts, then they decode
        tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    hook = Hook(engine, lambda: engine.add_request("light-0", LIGHT, PARAMS,
                                                   tenant_id="light"))
    step_outputs = step_with(engine, hook)
    for out in step_outputs:
        tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    # Four layers, three points between them: it cut in at the first, and only once.
    assert hook.calls == 3
    interjected = hook.results[0]
    assert interjected is not None and [o.request_id for o in interjected] == ["light-0"]
    assert len(interjected[0].new_token_ids) == 1
    assert hook.results[1:] == [None, None]
    assert {o.request_id for o in step_outputs} == set(HEAVY)  # the step's own rows only
    tokens["light-0"] = list(interjected[0].new_token_ids)
    scheduler = engine.core.scheduler
    assert len(scheduler.running) == 4  # one slot beyond --max-num-seqs, until the next step
    for out in engine.step():  # gives it back: a heavy request is preempted, light-0 stays
        tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    assert len(scheduler.running) == 3
    assert "light-0" in {r.request_id for r in scheduler.running}
    assert engine.last_stats.num_preemptions == 1
    run_to_end(engine, tokens)  # the preempted one recomputed: each as it is alone
    engine.shutdown()
    assert tokens["light-0"] == alone(model, LIGHT)
    assert all(tokens[req_id] == alone(model, prompt) for req_id, prompt in HEAVY.items())


def test_outputs_equal_each_prompt_alone(model: Path) -> None:
    engine = make_engine(model, max_num_seqs=4)  # room for the newcomer: nothing preempted
    tokens: dict[str, list[int]] = {}
    for req_id, prompt in HEAVY.items():
        engine.add_request(req_id, prompt, PARAMS, tenant_id="heavy")
    for out in engine.step():
        tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    hook = Hook(engine, lambda: engine.add_request("light-0", LIGHT, PARAMS,
                                                   tenant_id="light"))
    for out in step_with(engine, hook):
        tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    interjected = hook.results[0]
    assert interjected is not None
    tokens["light-0"] = list(interjected[0].new_token_ids)
    run_to_end(engine, tokens)
    assert engine.last_stats.num_preemptions == 0
    engine.shutdown()
    expected = {req_id: alone(model, prompt) for req_id, prompt in
                {**HEAVY, "light-0": LIGHT}.items()}
    assert tokens == expected


@pytest.mark.parametrize(("policy", "interject"), [("fcfs", True), ("fair", False)])
def test_nobody_cuts_in_under_fcfs_or_when_turned_off(model: Path, policy: str,
                                                      interject: bool) -> None:
    engine = make_engine(model, policy=policy, interject=interject)
    for req_id, prompt in HEAVY.items():
        engine.add_request(req_id, prompt, PARAMS, tenant_id="heavy")
    engine.step()
    hook = Hook(engine, lambda: engine.add_request("light-0", LIGHT, PARAMS,
                                                   tenant_id="light"))
    step_with(engine, hook)
    assert hook.results == [None, None, None]
    assert "light-0" not in {r.request_id for r in engine.core.scheduler.running}
    engine.shutdown()


def test_no_interjection_without_a_step_in_flight(model: Path) -> None:
    engine = make_engine(model)
    engine.add_request("light-0", LIGHT, PARAMS, tenant_id="light")
    assert engine.interject() is None  # between steps the scheduler plans it as usual
    engine.shutdown()


def test_a_hit_on_blocks_the_step_is_writing_does_not_cut_in(model: Path) -> None:
    """The light tenant's second request shares its first one's prompt, whose blocks the step
    in flight is computing (cached at allocation, half written): it waits for the step."""
    engine = make_engine(model, max_num_seqs=4)
    long_prompt = list(range(20, 40))
    for req_id, prompt in HEAVY.items():
        engine.add_request(req_id, prompt, PARAMS, tenant_id="heavy")
    engine.add_request("light-0", long_prompt, PARAMS, tenant_id="light")
    tokens: dict[str, list[int]] = {}
    hook = Hook(engine, lambda: engine.add_request("light-1", long_prompt + [41], PARAMS,
                                                   tenant_id="light"))
    for out in step_with(engine, hook):  # every prompt, light-0's among them; light-1 arrives
        tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    assert hook.results == [None, None, None]
    assert "light-1" not in {r.request_id for r in engine.core.scheduler.running}
    run_to_end(engine, tokens)
    engine.shutdown()
    assert tokens["light-1"] == alone(model, long_prompt + [41])


def test_the_engine_thread_streams_it_before_the_step_ends(model: Path) -> None:
    """The server's engine thread: a request submitted while a step waits between two layers
    gets its first token dispatched before that step's own outputs."""
    engine = make_engine(model, max_num_seqs=4)
    paused, submitted = threading.Event(), threading.Event()
    begin_step = engine.begin_step

    def begin_step_that_waits():  # type: ignore[no-untyped-def]
        step = begin_step()
        advance = step.advance

        def advance_then_hold() -> bool:
            more = advance()
            if more and engine.core.step_index == 1 and not paused.is_set():
                paused.set()  # the second step is mid-forward: the test submits now
                assert submitted.wait(30)
                time.sleep(0.05)  # the submission reaches the inbox (it holds the lock)
            return more

        step.advance = advance_then_hold  # type: ignore[method-assign]
        return step

    engine.begin_step = begin_step_that_waits  # type: ignore[method-assign]
    batches: list[list[str]] = []

    async def main() -> None:
        thread = EngineThread(engine, on_outputs=lambda outputs, _: batches.append(
            [o.request_id for o in outputs]))
        thread.start()
        try:
            heavy = [RequestSpec(req_id, prompt, PARAMS, tenant_id="heavy")
                     for req_id, prompt in HEAVY.items()]
            heavy_group = RequestGroup([s.request_id for s in heavy])
            await thread.submit(heavy, heavy_group, time.monotonic())
            await asyncio.get_running_loop().run_in_executor(None, paused.wait, 30)
            light_group = RequestGroup(["light-0"])
            done = thread.submit([RequestSpec("light-0", LIGHT, PARAMS, tenant_id="light")],
                                 light_group, time.monotonic())
            submitted.set()
            await done
            async for _ in light_group.outputs():
                pass
            async for _ in heavy_group.outputs():
                pass
        finally:
            thread.stop()

    asyncio.run(main())
    engine.shutdown()
    # The prompts' step, then the interjection inside the second step, then that step.
    assert batches[0] == list(HEAVY)
    assert batches[1] == ["light-0"]
    assert set(batches[2]) == set(HEAVY)


def test_a_second_newcomer_cuts_into_the_first_ones_lone_step(model: Path) -> None:
    engine = make_engine(model, max_num_seqs=5)
    tokens: dict[str, list[int]] = {}
    for req_id, prompt in HEAVY.items():
        engine.add_request(req_id, prompt, PARAMS, tenant_id="heavy")
    run_steps = [engine.step(), engine.step()]  # the prompts, then one decode step
    engine.add_request("light-0", LIGHT, PARAMS, tenant_id="light")
    hook = Hook(engine, lambda: engine.add_request("other-0", LIGHT[::-1], PARAMS,
                                                   tenant_id="other"))
    run_steps.append(step_with(engine, hook))  # light-0's prefill alone; other-0 cuts into it
    assert [o.request_id for o in run_steps[-1]] == ["light-0"]
    interjected = hook.results[0]
    assert interjected is not None and interjected[0].request_id == "other-0"
    assert engine.core.scheduler.get_num_unfinished_requests() == 5
    for outputs in [*run_steps, interjected]:
        for out in outputs:
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    run_to_end(engine, tokens)
    engine.shutdown()
    assert tokens["other-0"] == alone(model, LIGHT[::-1])
    assert tokens["light-0"] == alone(model, LIGHT)


@pytest.mark.parametrize(("budget", "num_cut_in"), [(64, 2), (10, 1)])
def test_newcomers_cut_in_while_the_token_budget_lasts(model: Path, budget: int,
                                                       num_cut_in: int) -> None:
    """Two newcomers (6 prompt tokens each) arrive during one step: both cut in when the step's
    budget holds both prompts, only the first when it holds one."""
    engine = make_engine(model, max_num_seqs=5, max_num_batched_tokens=budget)
    for req_id, prompt in HEAVY.items():
        engine.add_request(req_id, prompt, PARAMS, tenant_id="heavy")
    while len(engine.core.scheduler.running) < len(HEAVY) or any(
            r.num_computed_tokens < r.num_prompt_tokens for r in engine.core.scheduler.running):
        engine.step()
    interjected: list[str] = []
    arrived = threading.Event()

    def hook() -> None:
        if not arrived.is_set():  # both during the step's first pause
            arrived.set()
            engine.add_request("light-0", LIGHT, PARAMS, tenant_id="light")
            engine.add_request("other-0", LIGHT[::-1], PARAMS, tenant_id="other")
        while (outputs := engine.interject()) is not None:
            interjected.extend(o.request_id for o in outputs)

    step_with(engine, hook)
    assert interjected == ["light-0", "other-0"][:num_cut_in]
    engine.shutdown()
