"""Scheduler unit tests, driven step by step with the fake paged-cache executor."""

import pytest
from kvasir_engine.config import SchedulerConfig
from kvasir_engine.core.limits import QueueFullError
from kvasir_engine.core.outputs import EngineCoreOutput, SchedulerOutput
from kvasir_engine.core.request import Request, RequestStatus, SamplingParams
from kvasir_engine.core.scheduler import Scheduler
from scheduler_fakes import EOS_TOKEN_ID, FakeExecutor, hash_next_token, reference_continuation


def _make(num_blocks: int = 64, block_size: int = 4, max_model_len: int = 128,
          max_num_seqs: int = 8, max_num_batched_tokens: int = 64,
          max_queue_len: int | None = None,
          enable_caching: bool = True) -> tuple[Scheduler, FakeExecutor]:
    config = SchedulerConfig(max_model_len=max_model_len, max_num_seqs=max_num_seqs,
                             max_num_batched_tokens=max_num_batched_tokens,
                             max_queue_len=max_queue_len)
    return (Scheduler(config, num_blocks, block_size, enable_caching),
            FakeExecutor(num_blocks, block_size))


def _request(req_id: str, prompt: list[int], max_tokens: int = 4, **params: object) -> Request:
    return Request(req_id, prompt, SamplingParams(max_tokens=max_tokens, **params),  # type: ignore[arg-type]
                   eos_token_ids=frozenset({EOS_TOKEN_ID}))


def _step(scheduler: Scheduler, executor: FakeExecutor
          ) -> tuple[SchedulerOutput, list[EngineCoreOutput]]:
    plan = scheduler.schedule()
    assert plan.total_num_scheduled_tokens <= scheduler.config.max_num_batched_tokens
    assert len(scheduler.running) <= scheduler.config.max_num_seqs
    if plan.is_empty:
        return plan, []
    return plan, scheduler.update_from_output(plan, executor.execute_model(plan))


def _run(scheduler: Scheduler, executor: FakeExecutor, max_steps: int = 500
         ) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {}
    for _ in range(max_steps):
        if not scheduler.has_unfinished_requests():
            return tokens
        for output in _step(scheduler, executor)[1]:
            tokens.setdefault(output.request_id, []).extend(output.new_token_ids)
    raise AssertionError("requests did not finish")


def test_continuous_batching_admits_into_a_running_batch() -> None:
    scheduler, executor = _make()
    scheduler.add_request(_request("a", [1, 2, 3], max_tokens=10))
    _step(scheduler, executor)
    _step(scheduler, executor)
    scheduler.add_request(_request("b", [4, 5], max_tokens=3))
    plan, outputs = _step(scheduler, executor)
    assert plan.num_scheduled_tokens == {"a": 1, "b": 2}
    assert [r.request_id for r in plan.scheduled_new_reqs] == ["b"]
    assert [r.request_id for r in plan.scheduled_cached_reqs] == ["a"]
    first_b = [o.new_token_ids for o in outputs if o.request_id == "b"]
    assert first_b[0] + _run(scheduler, executor)["b"] == reference_continuation([4, 5], 3)


def test_fcfs_and_max_num_seqs() -> None:
    scheduler, executor = _make(max_num_seqs=2)
    for i in range(5):
        scheduler.add_request(_request(f"r{i}", [i + 1] * 3, max_tokens=2 + i % 2))
    first_scheduled = []
    for _ in range(40):
        plan, _ = _step(scheduler, executor)
        first_scheduled += [r.request_id for r in plan.scheduled_new_reqs]
        assert len(plan.num_scheduled_tokens) <= 2
    assert first_scheduled == [f"r{i}" for i in range(5)]


def test_chunked_prefill_interleaves_with_decodes() -> None:
    scheduler, executor = _make(max_num_batched_tokens=8)
    scheduler.add_request(_request("short", [1, 2], max_tokens=12))
    _step(scheduler, executor)
    long_prompt = list(range(10, 40))
    scheduler.add_request(_request("long", long_prompt, max_tokens=2))
    chunks = []
    while "long" not in executor.requests or executor.requests["long"].num_computed_tokens < 30:
        plan, outputs = _step(scheduler, executor)
        assert plan.num_scheduled_tokens["short"] == 1  # the decode never stalls
        chunks.append(plan.num_scheduled_tokens["long"])
        assert [o.request_id for o in outputs if o.new_token_ids] == (
            ["short", "long"] if sum(chunks) == 30 else ["short"])
    assert chunks == [7, 7, 7, 7, 2]
    assert _run(scheduler, executor)["long"] == reference_continuation(long_prompt, 2)[1:]


def test_preemption_under_a_tiny_cache_loses_no_output() -> None:
    # 6 usable blocks of 4 tokens; four requests need 3-4 blocks each by the end.
    scheduler, executor = _make(num_blocks=7, max_num_seqs=4, max_num_batched_tokens=32)
    prompts = {f"r{i}": [i * 10 + j for j in range(5 + i)] for i in range(4)}
    for req_id, prompt in prompts.items():
        scheduler.add_request(_request(req_id, prompt, max_tokens=8))
    requests = dict(scheduler.requests)
    num_preemptions = 0
    tokens: dict[str, list[int]] = {}
    while scheduler.has_unfinished_requests():
        plan, outputs = _step(scheduler, executor)
        stats = scheduler.make_stats()
        num_preemptions += stats.num_preemptions
        if stats.num_preemptions:
            assert not plan.scheduled_new_reqs  # nothing admitted in a preempting step
        for output in outputs:
            tokens.setdefault(output.request_id, []).extend(output.new_token_ids)
    assert num_preemptions > 0
    assert sum(r.num_preemptions for r in requests.values()) == num_preemptions
    for req_id, prompt in prompts.items():
        assert tokens[req_id] == reference_continuation(prompt, 8), req_id
        assert requests[req_id].finished_time is not None
    assert scheduler.kv_cache_manager.usage == 0.0


def test_preempted_request_returns_first_and_with_all_its_tokens() -> None:
    scheduler, executor = _make(num_blocks=4, block_size=2, max_num_seqs=2)  # 3 usable blocks
    scheduler.add_request(_request("old", [1, 2], max_tokens=4))
    scheduler.add_request(_request("new", [3], max_tokens=4))
    scheduler.add_request(_request("later", [5], max_tokens=1))
    for _ in range(3):
        plan, _ = _step(scheduler, executor)
    assert "new" in plan.finished_req_ids and scheduler.waiting[0].request_id == "new"
    preempted = scheduler.waiting[0]
    assert preempted.status == RequestStatus.PREEMPTED and preempted.num_output_tokens == 2
    tokens_at_preemption = list(preempted.all_token_ids)
    while not any(r.request_id == "new" for r in plan.scheduled_new_reqs):
        plan, _ = _step(scheduler, executor)
    resumed = next(r for r in plan.scheduled_new_reqs if r.request_id == "new")
    assert resumed.token_ids == tokens_at_preemption and resumed.num_output_tokens == 2
    _run(scheduler, executor)
    assert preempted.output_token_ids == reference_continuation([3], 4)


def test_abort_frees_blocks_at_once() -> None:
    scheduler, executor = _make()
    scheduler.add_request(_request("a", list(range(1, 10)), max_tokens=20))
    scheduler.add_request(_request("b", [7], max_tokens=20))
    _step(scheduler, executor)
    assert scheduler.kv_cache_manager.usage > 0
    scheduler.finish_requests(["a", "b", "unknown"], RequestStatus.FINISHED_ABORTED)
    assert scheduler.kv_cache_manager.usage == 0.0 and not scheduler.has_unfinished_requests()
    scheduler.add_request(_request("c", [8], max_tokens=1))
    plan, _ = _step(scheduler, executor)
    assert plan.finished_req_ids == {"a", "b"}
    scheduler.add_request(_request("w", [9], max_tokens=1))
    scheduler.finish_requests("w", RequestStatus.FINISHED_STOPPED)  # still waiting
    assert not scheduler.waiting
    with pytest.raises(ValueError, match="finished"):
        scheduler.finish_requests("x", RequestStatus.RUNNING)


def test_queue_limit_and_admission_checks() -> None:
    # One running slot + 2 waiting: the first request takes the slot at the next step.
    scheduler, _ = _make(num_blocks=5, max_model_len=40, max_queue_len=2, max_num_seqs=1)
    for req_id in "abc":
        scheduler.add_request(_request(req_id, [1]))
    with pytest.raises(QueueFullError, match=r"3 sequences admitted, 1 running slots \+ 2 "
                                             r"waiting, --max-queue-len"):
        scheduler.add_request(_request("c2", [1]))
    with pytest.raises(ValueError, match="already in use"):
        scheduler.add_request(_request("a", [1]))
    scheduler, _ = _make(num_blocks=5, max_model_len=40)
    with pytest.raises(ValueError, match=r"maximum context length is 40 tokens, but 41 were "
                                         r"requested \(30 in the prompt \+ 11 max_tokens\)"):
        scheduler.add_request(_request("d", [1] * 30, max_tokens=11))
    with pytest.raises(ValueError, match=r"needs 5 KV blocks of 4 tokens, but the whole KV "
                                         r"cache has 4 blocks \(16 tokens\)"):
        scheduler.add_request(_request("e", [1] * 10, max_tokens=8))
    scheduler.add_request(_request("f", [1] * 10, max_tokens=7))  # 16 KV tokens: fits exactly


def test_prefix_cache_hits_shorten_prefill() -> None:
    scheduler, executor = _make()
    prefix = list(range(1, 18))
    scheduler.add_request(_request("a", prefix + [50], max_tokens=2))
    _run(scheduler, executor)
    scheduler.make_stats()
    scheduler.add_request(_request("b", prefix + [60, 61], max_tokens=2))
    plan, _ = _step(scheduler, executor)
    assert plan.scheduled_new_reqs[0].num_computed_tokens == 16
    assert plan.num_scheduled_tokens == {"b": 3}
    stats = scheduler.make_stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (19, 16)
    request_b = scheduler.requests["b"]
    assert request_b.num_cached_tokens == 16
    assert _run(scheduler, executor)["b"] == reference_continuation(prefix + [60, 61], 2)[1:]


def test_stop_conditions() -> None:
    scheduler, executor = _make(max_model_len=20)
    executor.next_token = lambda token_ids: EOS_TOKEN_ID if len(token_ids) % 3 == 0 else 7
    scheduler.add_request(_request("eos", [1, 2], max_tokens=10))  # EOS as 2nd output
    scheduler.add_request(_request("min", [1, 2], max_tokens=10, min_tokens=3))
    scheduler.add_request(_request("ignore", [1, 2], max_tokens=5, ignore_eos=True))
    scheduler.add_request(_request("stop_id", [1], max_tokens=10, stop_token_ids=(7,)))
    scheduler.add_request(_request("len", [1] * 15, max_tokens=5, ignore_eos=True))
    finished: dict[str, EngineCoreOutput] = {}
    while scheduler.has_unfinished_requests():
        finished |= {o.request_id: o for o in _step(scheduler, executor)[1] if o.is_finished}
    assert (finished["eos"].finish_reason, finished["eos"].stop_reason) == ("stop", None)
    assert finished["min"].finish_reason == "stop"
    assert finished["ignore"].finish_reason == "length"
    assert (finished["stop_id"].finish_reason, finished["stop_id"].stop_reason) == ("stop", 7)
    assert finished["len"].finish_reason == "length"


def test_partial_prefill_must_not_sample() -> None:
    scheduler, executor = _make(max_num_batched_tokens=8)
    scheduler.add_request(_request("a", list(range(1, 20))))
    plan = scheduler.schedule()
    bogus = executor.execute_model(plan).__class__(req_ids=["a"], sampled_token_ids=[[5]],
                                                   logprobs=[None])
    with pytest.raises(RuntimeError, match="partial prefill"):
        scheduler.update_from_output(plan, bogus)


def test_requests_finish_in_any_order_and_free_everything() -> None:
    scheduler, executor = _make(num_blocks=20, max_num_seqs=6, max_num_batched_tokens=16)
    lengths = [9, 1, 5, 3, 7, 2]
    for i, max_tokens in enumerate(lengths):
        scheduler.add_request(_request(f"r{i}", [i + 1, i + 2], max_tokens=max_tokens))
    order = []
    while scheduler.has_unfinished_requests():
        order += [o.request_id for o in _step(scheduler, executor)[1] if o.is_finished]
    assert order == [f"r{i}" for i in sorted(range(6), key=lambda i: (lengths[i], i))]
    assert scheduler.kv_cache_manager.num_free_blocks == 19
    assert hash_next_token([1]) != hash_next_token([2])


def test_fit_error_counts_usable_blocks_only() -> None:
    # 5 blocks of 4 tokens, block 0 the null block: 4 usable blocks, 16 KV slots.
    scheduler, _ = _make(num_blocks=5, max_model_len=40)
    # The last sampled token needs no slot: 10 + 7 - 1 = 16 slots, exactly the usable ones.
    assert scheduler.fit_error(10, 7) is None
    never = scheduler.fit_error(10, 8)
    assert never is not None and "needs 5 KV blocks" in never.message
    assert "has 4 blocks" in never.message and never.field == "max_tokens"
    assert scheduler.fit_error(30, 11) is not None  # over max_model_len
