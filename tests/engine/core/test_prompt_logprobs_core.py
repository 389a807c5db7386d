"""Prompt logprobs in the core: a request that asks for them reads nothing from the prefix cache
(a cached block has no logits), still leaves its blocks for others, and the runner's prompt
logprobs reach the request's first `EngineCoreOutput`."""

from __future__ import annotations

import dataclasses

from kvasir_engine.config import SchedulerConfig
from kvasir_engine.core.outputs import EngineCoreOutput, ModelRunnerOutput
from kvasir_engine.core.request import LogprobsEntry, Request, SamplingParams
from kvasir_engine.core.scheduler import Scheduler
from scheduler_fakes import EOS_TOKEN_ID, FakeExecutor, reference_continuation

PREFIX = list(range(1, 18))


def _make(max_num_batched_tokens: int = 64) -> tuple[Scheduler, FakeExecutor]:
    config = SchedulerConfig(max_model_len=128, max_num_seqs=8,
                             max_num_batched_tokens=max_num_batched_tokens)
    return Scheduler(config, 64, 4, enable_caching=True), FakeExecutor(64, 4)


def _request(req_id: str, prompt: list[int], **params: object) -> Request:
    return Request(req_id, prompt, SamplingParams(max_tokens=2, **params),  # type: ignore[arg-type]
                   eos_token_ids=frozenset({EOS_TOKEN_ID}))


def _run(scheduler: Scheduler, executor: FakeExecutor,
         prompt_logprobs: dict[str, list[LogprobsEntry]] | None = None) -> list[EngineCoreOutput]:
    """Steps to the end; the fake runner attaches `prompt_logprobs[req]` to a request's first
    sample, as the model runner does."""
    outputs: list[EngineCoreOutput] = []
    while scheduler.has_unfinished_requests():
        plan = scheduler.schedule()
        result = executor.execute_model(plan)
        attached: list[list[LogprobsEntry] | None] = []
        for req_id, sampled in zip(result.req_ids, result.sampled_token_ids, strict=True):
            first = sampled and not any(o.request_id == req_id for o in outputs)
            attached.append((prompt_logprobs or {}).get(req_id) if first else None)
        result = dataclasses.replace(result, prompt_logprobs=attached)
        outputs += scheduler.update_from_output(plan, result)
    return outputs


def test_a_request_with_prompt_logprobs_reads_no_prefix_cache_hit() -> None:
    scheduler, executor = _make()
    scheduler.add_request(_request("a", PREFIX + [50]))
    _run(scheduler, executor)
    scheduler.add_request(_request("b", PREFIX + [60], prompt_logprobs=1))
    plan = scheduler.schedule()
    assert plan.scheduled_new_reqs[0].num_computed_tokens == 0
    assert plan.num_scheduled_tokens == {"b": len(PREFIX) + 1}
    scheduler.update_from_output(plan, executor.execute_model(plan))
    assert scheduler.requests["b"].num_cached_tokens == 0
    _run(scheduler, executor)
    # Its blocks are cached for the others all the same.
    scheduler.add_request(_request("c", PREFIX + [60, 61]))
    plan = scheduler.schedule()
    assert plan.scheduled_new_reqs[0].num_computed_tokens == 16


def test_prompt_logprobs_reach_the_first_output_only() -> None:
    scheduler, executor = _make(max_num_batched_tokens=8)  # a prefill over three steps
    scored = [LogprobsEntry(t, -0.5, rank=2) for t in PREFIX[1:]]
    scheduler.add_request(_request("a", PREFIX, prompt_logprobs=0))
    scheduler.add_request(_request("b", PREFIX[:5]))
    outputs = _run(scheduler, executor, {"a": scored})
    of_a = [o for o in outputs if o.request_id == "a"]
    assert of_a[0].prompt_logprobs == scored
    assert all(o.prompt_logprobs is None for o in of_a[1:])
    assert all(o.prompt_logprobs is None for o in outputs if o.request_id == "b")
    assert [t for o in of_a for t in o.new_token_ids] == reference_continuation(PREFIX, 2)


def test_a_runner_output_without_prompt_logprobs_is_accepted() -> None:
    scheduler, executor = _make()
    scheduler.add_request(_request("a", PREFIX))
    plan = scheduler.schedule()
    result = executor.execute_model(plan)
    bare = ModelRunnerOutput(result.req_ids, result.sampled_token_ids, result.logprobs)
    (output,) = scheduler.update_from_output(plan, bare)
    assert output.prompt_logprobs is None and output.new_token_ids
