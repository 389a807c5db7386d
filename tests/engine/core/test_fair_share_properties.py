"""Property: under the fair policy (any tenants, weights, bound, prefill cap, arrivals, aborts
and a KV cache small enough to preempt) every request still finishes with its exact continuation and no block,
running count or waiting entry is left behind."""

from __future__ import annotations

from fair_share_harness import make_harness
from hypothesis import given, settings
from hypothesis import strategies as st
from kvasir_engine.core.request import RequestStatus

_request = st.tuples(
    st.sampled_from(["a", "b", "c", "d"]),        # tenant
    st.integers(min_value=1, max_value=14),        # prompt length
    st.integers(min_value=1, max_value=10),        # max_tokens
    st.integers(min_value=0, max_value=6),         # steps before it arrives
    st.booleans(),                                 # aborted a few steps after arrival
)


@settings(max_examples=80, deadline=None)
@given(requests=st.lists(_request, min_size=1, max_size=14),
       num_blocks=st.integers(min_value=8, max_value=24),
       max_num_seqs=st.integers(min_value=1, max_value=6),
       max_num_batched_tokens=st.integers(min_value=6, max_value=32),
       bound=st.one_of(st.none(), st.integers(min_value=1, max_value=3)),
       weight_a=st.sampled_from([0.5, 1.0, 3.0]),
       enable_caching=st.booleans(),
       prefill_cap=st.sampled_from([0, 1, 3, 8]))
def test_fair_policy_finishes_everything_and_leaks_nothing(
        requests: list[tuple[str, int, int, int, bool]], num_blocks: int, max_num_seqs: int,
        max_num_batched_tokens: int, bound: int | None, weight_a: float,
        enable_caching: bool, prefill_cap: int) -> None:
    max_num_batched_tokens = max(max_num_batched_tokens, max_num_seqs)
    clock = [0.0]  # 0.7 s a step: a tenant stays present for about 7 steps after its last request
    harness = make_harness(num_blocks=num_blocks, block_size=2, max_num_seqs=max_num_seqs,
                           max_num_batched_tokens=max_num_batched_tokens,
                           tenant_weights=(("a", weight_a),),
                           max_running_seqs_per_tenant=bound, enable_caching=enable_caching,
                           max_prefill_tokens_over_share=prefill_cap, clock=lambda: clock[0])
    scheduler = harness.scheduler
    # 2-token blocks, every block but the null one usable: at most 2 * (num_blocks - 1) - 1.
    max_tokens_fit = 2 * (num_blocks - 1)
    pending = sorted(enumerate(requests), key=lambda item: item[1][3])
    expected: dict[str, int] = {}
    to_abort: dict[str, int] = {}
    step = 0
    while pending or scheduler.has_unfinished_requests():
        while pending and pending[0][1][3] <= step:
            i, (tenant_id, prompt_len, max_tokens, _, abort) = pending.pop(0)
            prompt_len = min(prompt_len, max_tokens_fit - max_tokens)
            req_id = f"{tenant_id}-{i}"
            harness.add(req_id, tenant_id, [(i * 7 + j) % 50 + 1 for j in range(prompt_len)],
                        max_tokens=max_tokens)
            if abort:
                to_abort[req_id] = step + 2
            else:
                expected[req_id] = max_tokens
        for req_id in [r for r, at in to_abort.items() if at <= step]:
            scheduler.finish_requests(req_id, RequestStatus.FINISHED_ABORTED)
            del to_abort[req_id]
        harness.step()
        clock[0] += 0.7
        step += 1
        assert step < 3000, "requests did not finish"
    harness.prompts = {r: p for r, p in harness.prompts.items() if r in expected}
    harness.check_outputs(expected)
    kv = scheduler.kv_cache_manager
    assert kv.usage == 0.0 and kv.num_free_blocks == kv.block_pool.num_usable_blocks
    assert not scheduler.waiting and not scheduler.running and not scheduler.requests
    fair_share = scheduler.fair_share
    assert all(fair_share.num_running(t) == 0 for t in "abcd")
    assert all(fair_share.counter(t) >= 0 for t in "abcd")
