"""Fair share between tenants in the scheduler (core/fair_share.py): the virtual token counter,
its lift on arrival, weights, the per-tenant running bound and the preemption choice."""

from __future__ import annotations

import pytest
from fair_share_harness import Harness, make_harness
from kvasir_engine.core import fair_share as fair_share_module
from kvasir_engine.core.fair_share import W_OUTPUT, W_PROMPT
from kvasir_engine.core.request import Request, RequestStatus, SamplingParams
from kvasir_engine.core.waiting_queue import WaitingQueue


def _flood(harness: Harness, tenant_id: str, num: int, max_tokens: int = 8,
           prompt_len: int = 8) -> None:
    for i in range(num):
        harness.add(f"{tenant_id}-{i}", tenant_id, [hash((tenant_id, i)) % 900 + 1] * prompt_len,
                    max_tokens=max_tokens)


@pytest.mark.parametrize("policy", ["fair", "fcfs"])
def test_light_tenant_is_admitted_before_the_floods_backlog(policy: str) -> None:
    harness = make_harness(max_num_seqs=2, policy=policy)
    _flood(harness, "heavy", 20)
    for _ in range(3):
        harness.step()
    num_admitted_before = len(harness.admission_order)
    harness.add("light-0", "light", [5, 6, 7], max_tokens=8)
    harness.run()
    overtaken_by = harness.admission_order.index("light-0") - num_admitted_before
    if policy == "fair":
        # At most one heavy request on a tie of counters (the lift), never the backlog.
        assert overtaken_by <= 1
    else:
        assert overtaken_by == 20 - num_admitted_before  # FCFS: the whole backlog first
    harness.check_outputs({req_id: 8 for req_id in harness.prompts})


def test_weights_two_to_one_give_two_to_one_service() -> None:
    harness = make_harness(max_num_seqs=3, tenant_weights=(("a", 2.0), ("b", 1.0)))
    _flood(harness, "a", 120)
    _flood(harness, "b", 120)
    waiting = harness.scheduler.waiting
    while waiting.num_waiting("a") and waiting.num_waiting("b"):
        harness.step()
    assert harness.num_steps > 150
    served = {tenant: W_PROMPT * harness.tenant_to_num_computed[tenant]
              + W_OUTPUT * harness.tenant_to_num_sampled[tenant] for tenant in "ab"}
    assert 1.8 <= served["a"] / served["b"] <= 2.2
    fair_share = harness.scheduler.fair_share
    one_request = W_PROMPT * 8 + W_OUTPUT * 8
    assert abs(fair_share.counter("a") - fair_share.counter("b")) <= one_request


def test_a_newly_active_tenant_gets_no_banked_credit() -> None:
    harness = make_harness(max_num_seqs=2)
    _flood(harness, "a", 30)
    for _ in range(60):
        harness.step()
    fair_share = harness.scheduler.fair_share
    counter_a = fair_share.counter("a")
    assert counter_a > 6 * (W_PROMPT * 8 + W_OUTPUT * 8)  # more than b's next 6 requests cost
    _flood(harness, "b", 10)
    assert fair_share.counter("b") == counter_a  # lifted to the backlogged minimum
    start = len(harness.admission_order)
    while len(harness.admission_order) < start + 6:
        harness.step()
    next_six = [req_id.split("-")[0] for req_id in harness.admission_order[start:start + 6]]
    # Banked credit (a counter of 0) would give b all six; the lift makes them take turns.
    assert next_six.count("a") >= 2 and next_six.count("b") >= 2


def test_with_nobody_backlogged_a_newcomer_is_lifted_to_the_last_one_to_leave() -> None:
    harness = make_harness(max_num_seqs=4)
    _flood(harness, "a", 2)
    harness.step()  # both admitted: a left the backlog
    assert not harness.scheduler.waiting
    harness.run()
    fair_share = harness.scheduler.fair_share
    assert fair_share.counter("a") == 2 * (W_PROMPT * 8 + W_OUTPUT * 8)
    harness.add("b-0", "b", [1, 2, 3])
    assert fair_share.counter("b") == fair_share.counter("a")  # a's counter now, as the paper


def test_counters_charge_what_each_step_computed() -> None:
    # Chunked prefill (8 tokens a step) is paid chunk by chunk; prefix-cache hits cost nothing.
    harness = make_harness(max_num_batched_tokens=8, enable_caching=True)
    prompt = list(range(1, 31))
    harness.add("a-0", "a", prompt, max_tokens=5)
    fair_share = harness.scheduler.fair_share
    harness.step()
    assert fair_share.counter("a") == W_PROMPT * 8
    harness.run()
    assert fair_share.counter("a") == W_PROMPT * 30 + W_OUTPUT * 5
    harness.add("b-0", "b", prompt, max_tokens=5)  # 28 of 30 tokens are cached blocks
    harness.run()
    num_cached = harness.scheduler.kv_cache_manager.block_size * 7
    assert fair_share.counter("b") >= fair_share.counter("a")  # lifted to a's at arrival
    assert fair_share.counter("b") - fair_share.counter("a") == \
        W_PROMPT * (30 - num_cached) + W_OUTPUT * 5


def test_fcfs_admits_in_arrival_order_across_tenants() -> None:
    harness = make_harness(max_num_seqs=2, policy="fcfs")
    arrivals = []
    for i in range(12):
        tenant_id = "light" if i % 4 == 3 else "heavy"
        harness.add(f"{tenant_id}-{i}", tenant_id, [i + 1] * 5, max_tokens=3 + i % 3)
        arrivals.append(f"{tenant_id}-{i}")
    harness.run()
    assert harness.admission_order == arrivals


def test_one_tenant_fair_is_exactly_fcfs_even_with_preemption() -> None:
    histories = []
    for policy in ("fair", "fcfs"):
        harness = make_harness(num_blocks=9, max_num_seqs=4, max_num_batched_tokens=16,
                               policy=policy)
        for i in range(8):
            harness.add(f"r{i}", "only", [i * 10 + j for j in range(3 + i)], max_tokens=6 + i)
        harness.run()
        assert harness.num_preemptions > 0
        harness.check_outputs({f"r{i}": 6 + i for i in range(8)})
        histories.append(harness.plans)
    assert histories[0] == histories[1]


@pytest.mark.parametrize("policy", ["fair", "fcfs"])
def test_a_tenant_at_its_running_bound_waits_while_others_proceed(policy: str) -> None:
    harness = make_harness(max_num_seqs=8, max_running_seqs_per_tenant=2, policy=policy)
    _flood(harness, "a", 5)
    _flood(harness, "b", 2)
    harness.step()
    running = sorted(r.request_id for r in harness.scheduler.running)
    assert running == ["a-0", "a-1", "b-0", "b-1"]
    assert harness.scheduler.waiting.num_waiting("a") == 3
    harness.add("c-0", "c", [3, 3, 3])
    harness.step()  # a's head still waits; c overtakes it
    assert "c-0" in harness.admitted_at and "a-2" not in harness.admitted_at
    harness.run()  # Harness.step checks the bound at every step
    harness.check_outputs({req_id: 8 if req_id != "c-0" else 4 for req_id in harness.prompts})


@pytest.mark.parametrize(("policy", "admission_order", "victim"), [
    ("fair", ["heavy-0", "light-0", "heavy-1"], "heavy-1"),
    ("fcfs", ["heavy-0", "heavy-1", "light-0"], "light-0"),
])
def test_preemption_takes_the_most_served_tenants_latest_request(
        policy: str, admission_order: list[str], victim: str) -> None:
    # 6 usable blocks of 4: heavy's two 8-token prompts and light's 4-token one take 5; the
    # next decodes need 3 more. Under fair, light is admitted second (heavy was served 8
    # tokens) but heavy's latest is preempted; FCFS preempts the last admitted, light.
    harness = make_harness(num_blocks=7, max_num_seqs=3, policy=policy)
    harness.add("heavy-0", "heavy", [1] * 8, max_tokens=6)
    harness.add("heavy-1", "heavy", [2] * 8, max_tokens=6)
    harness.add("light-0", "light", [3] * 4, max_tokens=6)
    harness.step()
    assert harness.admission_order == admission_order
    plan = harness.step()
    assert victim in plan.finished_req_ids and victim not in plan.num_scheduled_tokens
    harness.run()
    harness.check_outputs({req_id: 6 for req_id in harness.prompts})


def test_a_victim_planned_earlier_in_the_step_leaves_the_plan() -> None:
    # 3 usable blocks: heavy's 7-token prompt takes 2, light's 4-token one 1. Next step heavy's
    # decode fits its block and is planned first; light's needs a block, so heavy is preempted.
    harness = make_harness(num_blocks=4, max_num_seqs=2)
    harness.add("heavy-0", "heavy", [1] * 7, max_tokens=4)
    harness.add("light-0", "light", [2] * 4, max_tokens=4)
    harness.step()
    plan = harness.step()
    assert plan.num_scheduled_tokens == {"light-0": 1}
    assert [c.request_id for c in plan.scheduled_cached_reqs] == ["light-0"]
    assert "heavy-0" in plan.finished_req_ids
    harness.run()
    harness.check_outputs({"heavy-0": 4, "light-0": 4})


def test_waiting_queue_keeps_fcfs_order_across_tenants() -> None:
    def request(req_id: str, tenant_id: str) -> Request:
        return Request(req_id, [1], SamplingParams(), tenant_id=tenant_id)

    queue = WaitingQueue()
    a0, b0, a1, b1 = (request("a0", "a"), request("b0", "b"), request("a1", "a"),
                      request("b1", "b"))
    assert [queue.add(r) for r in (a0, b0, a1)] == [True, True, False]
    assert queue.add(b1, front=True) is False  # preempted: ahead of everyone
    assert [r.request_id for r in queue] == ["b1", "a0", "b0", "a1"]
    assert queue[2] is b0 and len(queue) == 4
    assert queue.first(["a"]) is a0 and queue.first(["a", "b"]) is b1 and queue.first([]) is None
    assert queue.remove(a0) is False and queue.remove(a1) is True
    assert list(queue.tenant_ids) == ["b"] and queue.num_waiting("a") == 0
    with pytest.raises(IndexError, match="out of range"):
        queue[2]


def test_idle_tenants_counters_are_dropped_without_changing_any_decision(
        monkeypatch: pytest.MonkeyPatch) -> None:
    def run(max_idle_counters: int) -> tuple[list[dict[str, int]], float, int]:
        monkeypatch.setattr(fair_share_module, "_MAX_IDLE_COUNTERS", max_idle_counters)
        harness = make_harness(max_num_seqs=4)
        _flood(harness, "heavy", 30, max_tokens=30)
        for i in range(400):  # many one-off tenants, some while heavy is backlogged
            harness.add(f"t{i}-0", f"t{i}", [i % 50 + 1] * (1 + i % 5), max_tokens=1 + i % 3)
            harness.step()
        num_counters = harness.scheduler.fair_share.num_counters
        harness.run()
        harness.add("t3-1", "t3", [1, 2])  # a tenant that may have been forgotten comes back
        _flood(harness, "t7", 3)
        harness.run()
        return harness.plans, harness.scheduler.fair_share.counter("t3"), num_counters

    plans, counter, num_counters = run(max_idle_counters=50)
    reference_plans, reference_counter, reference_num_counters = run(max_idle_counters=10**9)
    assert num_counters <= 60 < reference_num_counters
    assert plans == reference_plans and counter == reference_counter


def _light_joins_a_flood(policy: str, max_num_seqs: int, num_heavy: int) -> Harness:
    """heavy's 30-token requests run for three steps, then light's first request arrives."""
    harness = make_harness(max_num_seqs=max_num_seqs, policy=policy)
    _flood(harness, "heavy", num_heavy, max_tokens=30)
    for _ in range(3):
        harness.step()
    harness.add("light-0", "light", [5, 6, 7], max_tokens=8)
    return harness


@pytest.mark.parametrize("policy", ["fair", "fcfs"])
def test_a_light_tenant_takes_a_slot_from_the_flood_that_holds_them_all(policy: str) -> None:
    # Both slots run heavy's long requests; light arrives. Under fair it takes heavy's latest
    # slot at the next step (heavy was served more and holds 2 of 2); under FCFS it waits for
    # a heavy request to finish.
    harness = _light_joins_a_flood(policy, max_num_seqs=2, num_heavy=4)
    plan = harness.step()
    if policy == "fair":
        assert "light-0" in plan.num_scheduled_tokens
        assert "heavy-1" in plan.finished_req_ids and "heavy-1" not in plan.num_scheduled_tokens
        assert harness.num_preemptions == 1
    else:
        assert "light-0" not in plan.num_scheduled_tokens and harness.num_preemptions == 0
    harness.run()
    assert harness.num_preemptions == (1 if policy == "fair" else 0)
    harness.check_outputs({req_id: 8 if req_id == "light-0" else 30 for req_id in harness.prompts})


def test_tenants_at_their_share_of_the_slots_never_trade_them() -> None:
    # Two slots, two backlogged tenants: a's requests are long, b's short, so their counters
    # cross again and again; each keeps its one slot (a freed slot goes back to its tenant) and
    # nobody is preempted.
    harness = make_harness(max_num_seqs=2)
    _flood(harness, "a", 6, max_tokens=12)
    _flood(harness, "b", 6, max_tokens=3)
    harness.run()
    assert harness.num_preemptions == 0
    harness.check_outputs({req_id: 12 if req_id.startswith("a") else 3
                           for req_id in harness.prompts})


def test_slots_follow_the_weights() -> None:
    # a (weight 3) holds all 4 slots alone; b (weight 1) arrives and takes one (its share of 4
    # is 1), and only one, however many of its requests wait.
    harness = make_harness(max_num_seqs=4, tenant_weights=(("a", 3.0),))
    _flood(harness, "a", 6, max_tokens=30)
    harness.step()
    _flood(harness, "b", 3, max_tokens=30)
    plan = harness.step()
    assert "b-0" in plan.num_scheduled_tokens and "a-3" in plan.finished_req_ids
    for _ in range(10):
        harness.step()
    assert harness.num_preemptions == 1
    assert sorted(r.tenant_id for r in harness.scheduler.running) == ["a", "a", "a", "b"]
    harness.run()
    harness.check_outputs({req_id: 30 for req_id in harness.prompts})


def test_many_tenants_each_get_a_slot_before_anyone_gets_two() -> None:
    # 3 slots held by one flood; 5 tenants arrive: the flood keeps one (everyone is entitled to
    # at least one), two newcomers take the others at once, the rest wait for a slot to free.
    harness = make_harness(max_num_seqs=3)
    _flood(harness, "flood", 6, max_tokens=20)
    harness.step()
    for tenant_id in "bcdef":
        harness.add(f"{tenant_id}-0", tenant_id, [3, 4, 5], max_tokens=20)
    for _ in range(3):
        harness.step()
    assert harness.num_preemptions == 2
    assert sorted(r.tenant_id for r in harness.scheduler.running) == ["b", "c", "flood"]
    harness.run()
    harness.check_outputs({req_id: 20 for req_id in harness.prompts})


@pytest.mark.parametrize("policy", ["fair", "fcfs"])
def test_a_newcomers_first_prefill_runs_alone(policy: str) -> None:
    # heavy decodes in 3 of 4 slots; light's first request arrives. Under fair its prefill is
    # the whole next step (its first token waits for no decode); the decodes resume at once.
    harness = _light_joins_a_flood(policy, max_num_seqs=4, num_heavy=3)
    plan = harness.step()
    heavy = {f"heavy-{i}" for i in range(3)}
    if policy == "fair":
        assert plan.num_scheduled_tokens == {"light-0": 3}
    else:
        assert set(plan.num_scheduled_tokens) == heavy | {"light-0"}
    assert set(harness.step().num_scheduled_tokens) == heavy | {"light-0"}
    harness.run()
    assert harness.num_preemptions == 0
    harness.check_outputs({req_id: 8 if req_id == "light-0" else 30 for req_id in harness.prompts})


def test_first_token_steps_never_come_two_in_a_row_nor_for_a_running_tenant() -> None:
    harness = make_harness(max_num_seqs=6)
    _flood(harness, "heavy", 2, max_tokens=30)
    harness.step()
    for tenant_id in "bc":
        harness.add(f"{tenant_id}-0", tenant_id, [3, 4, 5], max_tokens=20)
    assert set(harness.step().num_scheduled_tokens) == {"b-0"}
    # the next step is a full one: c's first prefill rides with every decode
    assert set(harness.step().num_scheduled_tokens) == {"heavy-0", "heavy-1", "b-0", "c-0"}
    # a tenant that runs a request already gets no step of its own for its next one
    harness.add("b-1", "b", [6, 7, 8], max_tokens=20)
    assert "heavy-0" in harness.step().num_scheduled_tokens
    harness.run()
    harness.check_outputs({req_id: 30 if req_id.startswith("heavy") else 20
                           for req_id in harness.prompts})


class _Clock:
    """A clock the test moves: the scheduler reads it for who is present."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _flood_with_light(cap: int, policy: str = "fair",
                      max_num_seqs: int = 4) -> tuple[Harness, _Clock]:
    # 4 slots: the flood's requests run 3 at a time and finish together, so without a cap their
    # successors' 8-token prompts prefill 3 at once; light holds one slot (below its share of 2).
    clock = _Clock()
    harness = make_harness(max_num_seqs=max_num_seqs, max_num_batched_tokens=64, policy=policy,
                           max_prefill_tokens_over_share=cap, clock=clock)
    harness.add("light-0", "light", [5, 6, 7], max_tokens=60)
    harness.step()
    _flood(harness, "heavy", 24, max_tokens=4)
    return harness, clock


def _decodes_held_back(harness: Harness) -> int:
    """Running requests with one token left to compute that the last plan left out."""
    plan = harness.plans[-1]
    return sum(1 for request in harness.scheduler.running
               if request.request_id not in plan and request.num_output_tokens > 0
               and not request.is_finished)


@pytest.mark.parametrize("cap", [0, 8])
def test_a_flood_over_its_share_gets_capped_prompt_tokens_while_a_light_tenant_is_present(
        cap: int) -> None:
    harness, clock = _flood_with_light(cap)
    harness.step()  # the flood's first prefill, alone (first token alone)
    fair_share = harness.scheduler.fair_share
    capped_steps, uncapped_prompt_tokens = [], []
    for _ in range(30):
        clock.now += 0.05
        # heavy holds 3 of the 4 slots (its share is 2), light 1: heavy's new prompts are capped
        is_capped = (fair_share.prefill_cap_shares(clock.now) == {"heavy": 2, "light": 2}
                     and fair_share.num_running("heavy") >= 2)
        harness.step()
        assert _decodes_held_back(harness) == 0
        num_heavy = harness.prompt_tokens_per_step[-1]["heavy"]
        (capped_steps if is_capped else uncapped_prompt_tokens).append(num_heavy)
    if cap:
        assert len(capped_steps) >= 15 and max(capped_steps) == cap
    else:
        assert not capped_steps and max(uncapped_prompt_tokens) >= 16  # prefilled together
    harness.run()
    harness.check_outputs({req_id: 60 if req_id == "light-0" else 4
                           for req_id in harness.prompts})


def test_the_cap_holds_while_the_light_tenant_is_present_and_lifts_after() -> None:
    harness, clock = _flood_with_light(8)
    fair_share = harness.scheduler.fair_share
    for _ in range(3):  # the flood takes the 3 slots light leaves
        harness.step()
    scheduler = harness.scheduler
    scheduler.finish_requests("light-0", RequestStatus.FINISHED_ABORTED)

    def burst() -> int:
        """The flood's slots beyond its share of 2 free at once: its prompt tokens next step."""
        scheduler.finish_requests([r.request_id for r in scheduler.running[:-2]],
                                  RequestStatus.FINISHED_ABORTED)
        harness.step()
        return harness.prompt_tokens_per_step[-1]["heavy"]

    for _ in range(4):  # light has no requests now: present until PRESENT_SECONDS later
        clock.now += (fair_share_module.PRESENT_SECONDS - 0.5) / 4
        assert fair_share.prefill_cap_shares(clock.now) == {"heavy": 2, "light": 2}
        assert burst() == 8
    clock.now += 1.0
    assert fair_share.prefill_cap_shares(clock.now) == {}
    assert burst() == 16
    harness.run()


def test_tenants_within_their_shares_plan_as_without_a_cap() -> None:
    def plans(cap: int) -> list[dict[str, int]]:
        harness = make_harness(max_num_seqs=4, max_num_batched_tokens=64,
                               max_prefill_tokens_over_share=cap, clock=_Clock())
        _flood(harness, "a", 12, max_tokens=3)
        _flood(harness, "b", 12, max_tokens=3)
        harness.run()
        return harness.plans
    assert plans(4) == plans(0)
    assert max(len(plan) for plan in plans(4)) == 4


def test_fcfs_caps_nobody() -> None:
    def plans(cap: int) -> list[dict[str, int]]:
        harness, clock = _flood_with_light(cap, policy="fcfs")
        while harness.scheduler.has_unfinished_requests():
            clock.now += 0.05
            harness.step()
        return harness.plans
    assert plans(8) == plans(0)


def test_an_interactive_tenants_next_request_runs_alone_beside_a_flood_above_its_share() -> None:
    harness, _ = _flood_with_light(0, max_num_seqs=6)
    fair_share = harness.scheduler.fair_share
    for _ in range(10):
        if fair_share.num_running("heavy") == 5:
            break
        harness.step()
    assert fair_share.num_running("heavy") == 5 and fair_share.num_running("light") == 1
    # light takes a slot from heavy (the slot rule) and stays within its share of 3 with it;
    # heavy runs 4, above its own: light's prefill runs alone
    harness.add("light-1", "light", [8, 9, 10], max_tokens=5)
    assert harness.step().num_scheduled_tokens == {"light-1": 3}
    harness.run()
    harness.check_outputs({req_id: 60 if req_id == "light-0" else 5 if req_id == "light-1" else 4
                           for req_id in harness.prompts})


def test_no_step_alone_when_nobody_runs_above_its_share() -> None:
    harness = make_harness(max_num_seqs=4)
    _flood(harness, "a", 1, max_tokens=30)
    harness.add("b-0", "b", [3, 4, 5], max_tokens=30)
    for _ in range(3):
        harness.step()
    # a and b run one request each (shares 2 and 2): b's next one rides with the decodes
    harness.add("b-1", "b", [6, 7, 8], max_tokens=30)
    assert set(harness.step().num_scheduled_tokens) == {"a-0", "b-0", "b-1"}
    harness.run()
