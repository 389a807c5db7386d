"""Speculative decoding in the scheduler, driven by the fake paged-cache executor.

The fake verifies drafts against its deterministic model and reads every token it attends to
back from its KV slots, so a rejected draft whose K/V stayed "computed", a block table that
missed a trim, or a trimmed block another request reuses all change the output.
"""

from __future__ import annotations

import pytest
from kvasir_engine.config import SchedulerConfig, SpeculativeConfig
from kvasir_engine.core.request import Request, RequestStatus, SamplingParams
from kvasir_engine.core.scheduler import Scheduler
from kvasir_engine.core.spec_policy import FIRST_PROBE_AFTER_STEPS
from scheduler_fakes import EOS_TOKEN_ID, FakeExecutor, hash_next_token, reference_continuation


def _oracle_with_errors(token_ids: list[int], num: int) -> list[int]:
    """The true continuation, with a wrong token at a place that depends on the history, so
    some verifications accept everything, some nothing, most something in between."""
    drafts = reference_continuation(token_ids, num)
    wrong_at = hash_next_token(token_ids) % (num + 2)
    if wrong_at < num:
        drafts[wrong_at] = (drafts[wrong_at] + 1) % EOS_TOKEN_ID
    return drafts


def _make(num_blocks: int = 64, block_size: int = 4, max_num_seqs: int = 8,
          max_num_batched_tokens: int = 64, k: int = 3, disable_by_batch_size: int | None = None,
          min_acceptance_rate: float = 0.0, propose=_oracle_with_errors,  # type: ignore[no-untyped-def]
          enable_caching: bool = True, max_model_len: int = 128
          ) -> tuple[Scheduler, FakeExecutor]:
    config = SchedulerConfig(max_model_len=max_model_len, max_num_seqs=max_num_seqs,
                             max_num_batched_tokens=max_num_batched_tokens)
    spec = SpeculativeConfig("ngram", k, disable_by_batch_size=disable_by_batch_size,
                             min_acceptance_rate=min_acceptance_rate)
    return (Scheduler(config, num_blocks, block_size, enable_caching, spec),
            FakeExecutor(num_blocks, block_size, propose=propose))


def _request(req_id: str, prompt: list[int], max_tokens: int, **params: object) -> Request:
    return Request(req_id, prompt, SamplingParams(max_tokens=max_tokens, **params),  # type: ignore[arg-type]
                   eos_token_ids=frozenset({EOS_TOKEN_ID}))


def _run(scheduler: Scheduler, executor: FakeExecutor, max_steps: int = 1000,
         abort_at: dict[int, list[str]] | None = None) -> tuple[dict[str, list[int]], dict[str, int]]:
    tokens: dict[str, list[int]] = {}
    totals = {"drafts": 0, "draft_tokens": 0, "accepted": 0, "preemptions": 0, "steps": 0}
    for step in range(max_steps):
        if not scheduler.has_unfinished_requests():
            return tokens, totals
        if abort_at and step in abort_at:
            scheduler.finish_requests(abort_at[step], RequestStatus.FINISHED_ABORTED)
        plan = scheduler.schedule()
        assert plan.total_num_scheduled_tokens <= scheduler.config.max_num_batched_tokens
        for req_id, drafts in plan.scheduled_spec_token_ids.items():
            assert plan.num_scheduled_tokens[req_id] == 1 + len(drafts)
        outputs = ([] if plan.is_empty
                   else scheduler.update_from_output(plan, executor.execute_model(plan)))
        stats = scheduler.make_stats()
        assert stats.num_spec_accepted_tokens == sum(stats.num_spec_accepted_tokens_per_pos)
        assert list(stats.num_spec_accepted_tokens_per_pos) == sorted(
            stats.num_spec_accepted_tokens_per_pos, reverse=True)
        totals["drafts"] += stats.num_spec_drafts
        totals["draft_tokens"] += stats.num_spec_draft_tokens
        totals["accepted"] += stats.num_spec_accepted_tokens
        totals["preemptions"] += stats.num_preemptions
        totals["steps"] += 1
        for output in outputs:
            tokens.setdefault(output.request_id, []).extend(output.new_token_ids)
    raise AssertionError("requests did not finish")


def _assert_no_block_leaked(scheduler: Scheduler) -> None:
    kv = scheduler.kv_cache_manager
    assert kv.num_free_blocks == kv.block_pool.num_usable_blocks
    assert not kv.req_to_blocks
    assert all(block.ref_cnt == 0 for block in kv.block_pool.blocks[1:])


@pytest.mark.parametrize("k", [1, 3, 6])
def test_outputs_match_the_model_and_blocks_come_back(k: int) -> None:
    scheduler, executor = _make(k=k)
    prompts = {f"r{i}": [i * 7 + j for j in range(3 + 2 * i)] for i in range(5)}
    for req_id, prompt in prompts.items():
        scheduler.add_request(_request(req_id, prompt, max_tokens=17))
    tokens, totals = _run(scheduler, executor)
    for req_id, prompt in prompts.items():
        assert tokens[req_id] == reference_continuation(prompt, 17), req_id
    assert totals["drafts"] > 0 and 0 < totals["accepted"] < totals["draft_tokens"]
    # Speculation saved steps: 5 requests of 17 tokens took fewer than 17 decode steps.
    assert totals["steps"] < 17
    _assert_no_block_leaked(scheduler)


def test_preemption_under_a_tiny_cache_with_drafts() -> None:
    scheduler, executor = _make(num_blocks=9, max_num_seqs=4, max_num_batched_tokens=32, k=4)
    prompts = {f"r{i}": [i * 10 + j for j in range(5 + i)] for i in range(4)}
    for req_id, prompt in prompts.items():
        scheduler.add_request(_request(req_id, prompt, max_tokens=12))
    tokens, totals = _run(scheduler, executor)
    assert totals["preemptions"] > 0 and totals["drafts"] > 0
    for req_id, prompt in prompts.items():
        assert tokens[req_id] == reference_continuation(prompt, 12), req_id
    _assert_no_block_leaked(scheduler)


def test_aborts_between_verifications_leak_nothing() -> None:
    scheduler, executor = _make(k=4)
    for i in range(6):
        scheduler.add_request(_request(f"r{i}", [i + 1, i + 2, i + 3], max_tokens=40))
    tokens, _ = _run(scheduler, executor, abort_at={3: ["r0", "r1"], 6: ["r2", "r5"]})
    assert tokens["r3"] == reference_continuation([4, 5, 6], 40)
    _assert_no_block_leaked(scheduler)


def test_nothing_is_emitted_past_a_stop() -> None:
    # A model that says EOS after 5 outputs: drafts that run past it are cut at the EOS.
    def next_token(token_ids: list[int]) -> int:
        return EOS_TOKEN_ID if len(token_ids) == 3 + 5 else hash_next_token(token_ids)

    def oracle(token_ids: list[int], num: int) -> list[int]:
        return reference_continuation(token_ids, num, next_token)

    scheduler, executor = _make(k=6, propose=oracle)
    executor.next_token = next_token
    scheduler.add_request(_request("eos", [1, 2, 3], max_tokens=30))
    scheduler.add_request(_request("len", [1, 2, 3], max_tokens=4, ignore_eos=True))
    scheduler.add_request(_request("stop", [1, 2, 3], max_tokens=30,
                                   stop_token_ids=(reference_continuation([1, 2, 3], 3)[2],)))
    tokens, totals = _run(scheduler, executor)
    expected = reference_continuation([1, 2, 3], 30, next_token, EOS_TOKEN_ID)
    assert tokens["eos"] == expected and expected[-1] == EOS_TOKEN_ID and len(expected) == 6
    assert tokens["len"] == expected[:4]
    assert tokens["stop"] == expected[:3]
    assert totals["accepted"] > 0
    _assert_no_block_leaked(scheduler)


def test_wrong_drafts_turn_a_request_off_and_right_ones_back_on() -> None:
    is_right = {"now": False}

    def proposer(token_ids: list[int], num: int) -> list[int]:
        drafts = reference_continuation(token_ids, num)
        return drafts if is_right["now"] else [(t + 1) % EOS_TOKEN_ID for t in drafts]

    scheduler, executor = _make(k=3, propose=proposer, min_acceptance_rate=0.3,
                                max_model_len=256)
    scheduler.add_request(_request("a", [5, 6, 7], max_tokens=200))
    verified_steps = []
    for step in range(100):
        plan = scheduler.schedule()
        if plan.is_empty:
            break
        if "a" in plan.scheduled_spec_token_ids:
            verified_steps.append(step)
        scheduler.update_from_output(plan, executor.execute_model(plan))
        if step == 40:
            is_right["now"] = True
    wrong = [s for s in verified_steps if s <= 41]
    # Turned off after its first wrong verifications (the decision lags one step), then
    # probed now and then, each wait longer than the one before.
    gaps = [b - a for a, b in zip(wrong[2:], wrong[3:], strict=False)]
    assert wrong[:2] == [1, 2] and len(wrong) <= 6
    assert gaps and all(g > FIRST_PROBE_AFTER_STEPS for g in gaps) and gaps == sorted(gaps)
    right = [s for s in verified_steps if s > 41]
    # Once a probe finds the drafts right, it verifies at every step again.
    assert len(right) >= 3 and right[-3:] == list(range(right[-3], right[-3] + 3))
    assert "a" not in scheduler.requests  # finished early, at 4 tokens a step


def test_a_large_batch_proposes_nothing_until_it_shrinks() -> None:
    scheduler, executor = _make(k=3, disable_by_batch_size=3,
                                propose=lambda t, n: reference_continuation(t, n))
    for i in range(3):
        scheduler.add_request(_request(f"r{i}", [i + 1, 9], max_tokens=6 if i else 40))
    seen_drafts = []
    for _ in range(30):
        plan = scheduler.schedule()
        if plan.is_empty:
            break
        seen_drafts.append((len(scheduler.running), bool(plan.scheduled_spec_token_ids),
                            bool(plan.num_spec_tokens_to_propose)))
        scheduler.update_from_output(plan, executor.execute_model(plan))
    assert all(not drafts and not propose for running, drafts, propose in seen_drafts
               if running >= 3)
    assert any(drafts for running, drafts, _ in seen_drafts if running == 1)


def test_drafts_respect_the_budget_max_tokens_and_max_model_len() -> None:
    scheduler, executor = _make(k=8, max_num_batched_tokens=8, max_num_seqs=2,
                                propose=lambda t, n: reference_continuation(t, n))
    scheduler.add_request(_request("short", [1, 2], max_tokens=5))
    scheduler.add_request(_request("long", list(range(3, 100)), max_tokens=29))
    tokens, totals = _run(scheduler, executor)
    assert tokens["short"] == reference_continuation([1, 2], 5)
    assert tokens["long"] == reference_continuation(list(range(3, 100)), 29)
    assert totals["accepted"] == totals["draft_tokens"] > 0
    _assert_no_block_leaked(scheduler)


def test_runner_answers_that_are_not_a_verification_are_refused() -> None:
    scheduler, executor = _make(k=2, propose=lambda t, n: [1] * n)
    scheduler.add_request(_request("a", [3, 4], max_tokens=9))
    for _ in range(2):
        plan = scheduler.schedule()
        out = executor.execute_model(plan)
        if plan.scheduled_spec_token_ids:
            out.sampled_token_ids[0][:] = [7, 8, 9, 10]  # more than 1 + 2 drafts
            with pytest.raises(RuntimeError, match="drafts verified"):
                scheduler.update_from_output(plan, out)
            return
        scheduler.update_from_output(plan, out)
    raise AssertionError("no drafts were verified")
