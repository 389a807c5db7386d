"""The scheduler's side of disaggregated prefill (core/remote_kv.py), with plain block counts:
a producer's finished request keeps its prompt's blocks until released; a consumer's request
admitted with staged K/V counts it as computed and hands the runner where to write it, and
prefills itself when the prefix cache lost a block before the staged ones."""

from __future__ import annotations

from kvasir_engine.config import SchedulerConfig
from kvasir_engine.core.outputs import ModelRunnerOutput
from kvasir_engine.core.request import KVLoadSpec, Request, SamplingParams
from kvasir_engine.core.scheduler import Scheduler

BLOCK_SIZE = 4


def _scheduler(enable_caching: bool = True) -> Scheduler:
    return Scheduler(SchedulerConfig(max_model_len=64), num_kv_blocks=16, block_size=BLOCK_SIZE,
                     enable_caching=enable_caching)


def _sampled(req_id: str, token_id: int = 7) -> ModelRunnerOutput:
    return ModelRunnerOutput([req_id], [[token_id]], [None])


def test_a_producers_finished_request_holds_its_prompts_blocks_until_released() -> None:
    scheduler = _scheduler()
    kv = scheduler.kv_cache_manager
    num_free = kv.num_free_blocks
    request = Request("p", list(range(10, 23)), SamplingParams(max_tokens=1, ignore_eos=True),
                      do_remote_decode=True)
    scheduler.add_request(request)
    plan = scheduler.schedule()
    [out] = scheduler.update_from_output(plan, _sampled("p"))
    assert out.finish_reason == "length" and out.kv_hold is not None
    # 13 prompt tokens: the consumer needs the K/V of 12, in 3 blocks, all full.
    assert len(out.kv_hold.block_ids) == 3 and len(out.kv_hold.block_hashes) == 3
    assert out.kv_hold.num_tokens == 12 and out.kv_hold.token_ids == request.prompt_token_ids
    assert kv.num_free_blocks == num_free - 3  # the 4th block (the last token's) is free
    kv.release_held("p")
    assert kv.num_free_blocks == num_free
    assert not kv.release_held("p")  # released once


def test_a_consumers_request_counts_the_staged_tokens_as_computed() -> None:
    scheduler = _scheduler(enable_caching=False)
    prompt = list(range(30, 43))  # 13 tokens: 12 arrive, the last is recomputed
    scheduler.add_request(Request("c", prompt, SamplingParams(max_tokens=2, ignore_eos=True),
                                  kv_load=KVLoadSpec("kv-0", 0, 3, 12)))
    plan = scheduler.schedule()
    [new] = plan.scheduled_new_reqs
    assert plan.num_scheduled_tokens == {"c": 1} and new.num_computed_tokens == 12
    assert new.kv_load is not None and new.kv_load.staging_id == "kv-0"
    assert new.kv_load.block_ids == new.block_ids[:3] and new.kv_load.first_staged == 0
    assert len(new.block_ids) == 4
    scheduler.update_from_output(plan, _sampled("c"))
    # After a preemption it would be recomputed like any other: the load is taken off it.
    assert scheduler.requests["c"].kv_load is None


def test_staged_blocks_after_a_lost_prefix_block_are_dropped_and_the_prompt_prefills() -> None:
    scheduler = _scheduler()
    prompt = list(range(50, 63))
    # Fetched when the cache held the prompt's first block; that block is gone since.
    scheduler.add_request(Request("c", prompt, SamplingParams(max_tokens=1, ignore_eos=True),
                                  kv_load=KVLoadSpec("kv-1", 1, 2, 12)))
    plan = scheduler.schedule()
    [new] = plan.scheduled_new_reqs
    assert plan.num_scheduled_tokens == {"c": 13} and new.num_computed_tokens == 0
    assert new.kv_load is not None and new.kv_load.block_ids == [] and new.kv_load.is_evicted


def test_staged_blocks_start_after_the_prefix_cache_hits() -> None:
    scheduler = _scheduler()
    prompt = list(range(70, 83))
    scheduler.add_request(Request("a", prompt[:9], SamplingParams(max_tokens=1)))
    plan = scheduler.schedule()
    scheduler.update_from_output(plan, _sampled("a"))  # blocks 0 and 1 now cached
    # Fetched when only block 0 was held: blocks 1 and 2 arrived; block 1 is a hit now too.
    scheduler.add_request(Request("c", prompt, SamplingParams(max_tokens=1, ignore_eos=True),
                                  kv_load=KVLoadSpec("kv-2", 1, 2, 12)))
    plan = scheduler.schedule()
    [new] = plan.scheduled_new_reqs
    assert new.num_computed_tokens == 12 and plan.num_scheduled_tokens == {"c": 1}
    assert new.kv_load is not None
    assert new.kv_load.block_ids == [new.block_ids[2]] and new.kv_load.first_staged == 1


def test_staged_blocks_the_prefix_cache_now_holds_are_dropped_without_a_fallback() -> None:
    scheduler = _scheduler()
    prompt = list(range(90, 103))
    scheduler.add_request(Request("a", prompt, SamplingParams(max_tokens=1)))
    scheduler.update_from_output(scheduler.schedule(), _sampled("a"))  # 3 blocks cached
    scheduler.add_request(Request("c", prompt, SamplingParams(max_tokens=1, ignore_eos=True),
                                  kv_load=KVLoadSpec("kv-3", 0, 3, 12)))
    plan = scheduler.schedule()
    [new] = plan.scheduled_new_reqs
    assert new.num_computed_tokens == 12 and plan.num_scheduled_tokens == {"c": 1}
    assert new.kv_load is not None
    assert new.kv_load.block_ids == [] and not new.kv_load.is_evicted
