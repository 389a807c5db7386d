"""Table tests of the pure decision, the policy parser and the history."""

from __future__ import annotations

import pytest
from autoscale_fakes import Load, long_history, run_ticks, window_of
from kvasir_operator.autoscale.decision import Reason, decide, stale_after_seconds
from kvasir_operator.autoscale.history import History, Recommendation
from kvasir_operator.autoscale.signals import PodSample
from kvasir_operator.autoscale.window import SampleWindow
from kvasir_operator.spec import AutoscalingSpec

NOW = 1_700_000_000.0
POLICY = AutoscalingSpec(min_replicas=1, max_replicas=10, scale_down_delay_seconds=300)
IDLE = Load()


def pods(*loads: Load | None) -> dict[str, Load | None]:
    return {f"p{i}": load for i, load in enumerate(loads)}


CASES = [
    # (name, policy, current, pods, unschedulable, desired, reason)
    ("idle at min", POLICY, 1, pods(IDLE), 0, 1, Reason.STABLE),
    ("queue doubles at most", POLICY, 2, pods(Load(5), Load(5)), 0, 4, Reason.SCALE_UP_LIMITED),
    ("queue scales at once", POLICY, 2, pods(Load(3), Load(3)), 0, 3, Reason.SCALE_UP),
    ("kv mean above target", POLICY, 3, pods(*[Load(kv=0.9)] * 3), 0, 4, Reason.SCALE_UP),
    ("kv inside tolerance", POLICY, 3, pods(*[Load(kv=0.85)] * 3), 0, 3, Reason.STABLE),
    ("running requests when asked",
     AutoscalingSpec(max_replicas=10, target_requests=10), 2,
     pods(Load(running=15), Load(running=15)), 0, 3, Reason.SCALE_UP),
    ("running ignored by default", POLICY, 2, pods(Load(running=15), Load(running=15)), 0, 1,
     Reason.SCALE_DOWN),
    ("stale pod counts saturated", POLICY, 2, pods(Load(4), None), 0, 3, Reason.SCALE_UP),
    ("stale pod blocks scale-down", POLICY, 2, pods(IDLE, None), 0, 2,
     Reason.SCALE_DOWN_BLOCKED),
    ("starting pods add no load", POLICY, 4, pods(Load(8)), 0, 4, Reason.STABLE),
    ("starting pods block scale-down", POLICY, 4, pods(IDLE), 0, 4, Reason.SCALE_DOWN_BLOCKED),
    ("unschedulable holds scale-up", POLICY, 2, pods(Load(10), Load(10)), 1, 2,
     Reason.INSUFFICIENT_GPU),
    ("unschedulable does not hold scale-down", POLICY, 3, pods(IDLE, IDLE), 1, 1,
     Reason.SCALE_DOWN),
    ("at max", AutoscalingSpec(max_replicas=2), 2, pods(Load(10), Load(10)), 0, 2,
     Reason.AT_MAX_REPLICAS),
    ("above max is clamped at once", AutoscalingSpec(max_replicas=3), 5, pods(*[Load(4)] * 5),
     0, 3, Reason.OUT_OF_RANGE),
    ("below min is raised at once", AutoscalingSpec(min_replicas=4, max_replicas=8), 1,
     pods(IDLE), 0, 4, Reason.OUT_OF_RANGE),
    ("below min beats the x2 limit", AutoscalingSpec(min_replicas=4, max_replicas=8), 1,
     pods(Load(20)), 0, 4, Reason.SCALE_UP_LIMITED),
    ("scale to zero when idle", AutoscalingSpec(min_replicas=0, max_replicas=4), 1, pods(IDLE),
     0, 0, Reason.SCALE_DOWN),
    ("never zero under load", AutoscalingSpec(min_replicas=0, max_replicas=4), 1,
     pods(Load(running=1)), 0, 1, Reason.STABLE),
    ("zero stays zero without pods", AutoscalingSpec(min_replicas=0, max_replicas=4), 0,
     pods(), 0, 0, Reason.STABLE),
]


@pytest.mark.parametrize(("name", "policy", "current", "loads", "unschedulable", "desired",
                          "reason"), CASES, ids=[c[0] for c in CASES])
def test_decision_table(name: str, policy: AutoscalingSpec, current: int,
                        loads: dict[str, Load | None], unschedulable: int, desired: int,
                        reason: Reason) -> None:
    window = window_of(NOW, {k: v for k, v in loads.items() if v is not None})
    stale = [k for k, v in loads.items() if v is None]
    window = window.record([], ready_pod_names=[*window.pod_names, *stale], now=NOW,
                           horizon_seconds=1e9)
    decision = decide(policy, current, window, unschedulable, long_history(NOW, policy), NOW)
    assert (decision.desired, decision.reason) == (desired, reason), decision.message
    assert decision.signals.stale_pod_names == tuple(stale)
    assert decision.message


def test_signals_report_pool_totals_and_per_pod_means() -> None:
    window = window_of(NOW, pods(Load(3, 5, 0.5), Load(1, 3, 0.7)))
    decision = decide(POLICY, 2, window, 0, long_history(NOW, POLICY), NOW)
    by_signal = {r.signal.value: r for r in decision.signals.readings}
    assert by_signal["waiting"].pool_total == 4 and by_signal["waiting"].per_pod_mean == 2
    assert by_signal["kvCacheUsage"].pool_total == pytest.approx(1.2)
    assert by_signal["kvCacheUsage"].replicas_needed == pytest.approx(1.5)
    status = decision.signals.to_status()
    assert status["waiting"]["total"] == 4 and status["podsFresh"] == 2


def test_one_failed_scrape_keeps_the_last_good_sample() -> None:
    good = PodSample("p0", NOW - POLICY.interval_seconds, num_waiting=0, kv_cache_usage=0)
    window = SampleWindow().record([good], ready_pod_names=["p0"], now=NOW - 15,
                                   horizon_seconds=60)
    window = window.record([PodSample("p0", NOW, error="timeout")], ready_pod_names=["p0"],
                           now=NOW, horizon_seconds=60)
    decision = decide(POLICY, 1, window, 0, long_history(NOW, POLICY), NOW)
    assert decision.signals.stale_pod_names == ()
    later = NOW + stale_after_seconds(POLICY)
    assert decide(POLICY, 1, window, 0, long_history(later, POLICY),
                  later).signals.stale_pod_names == ("p0",)


def test_scale_down_waits_for_the_delay_then_goes_to_the_window_maximum() -> None:
    busy, idle = Load(waiting=8), Load()
    ticks = [busy] * 4 + [Load(waiting=3)] * 10 + [idle] * 40
    decisions = run_ticks(POLICY, 1, ticks)
    desired = [d.desired for d in decisions]
    assert desired[:3] == [2, 4, 4]
    first_down = next(i for i, d in enumerate(desired) if i > 2 and d < 4)
    # Demand fell at tick 4; 300 s at 15 s per tick is 20 ticks of holding.
    assert first_down == 4 + 20
    assert desired[first_down] == 2  # the max over the window still holds the waiting=3 ticks
    assert desired[-1] == 1
    assert Reason.SCALE_DOWN_DELAYED in {d.reason for d in decisions[4:first_down]}


def test_a_fresh_history_does_not_allow_a_scale_down() -> None:
    window = window_of(NOW, pods(IDLE, IDLE))
    decision = decide(POLICY, 2, window, 0, History(), NOW)
    assert (decision.desired, decision.reason) == (2, Reason.SCALE_DOWN_DELAYED)


def test_history_keeps_only_non_dominated_entries_and_survives_the_status() -> None:
    history = History()
    for t, replicas in [(0, 3), (15, 5), (30, 4), (45, 2), (60, 4), (75, 1)]:
        history = history.record(NOW + t, replicas, horizon_seconds=300)
    assert [r.replicas for r in history.recommendations] == [5, 4, 1]
    assert history.max_since(NOW + 16) == 4
    record = {"lastDecisionTime": "2023-11-14T22:14:35Z", "history": history.to_status()}
    restored = History.from_status(record, now=NOW + 90, max_gap_seconds=600)
    assert restored.recommendations == tuple(
        Recommendation(round(r.time, 3), r.replicas) for r in history.recommendations)
    assert restored.started_at == NOW
    assert History.from_status(record, now=NOW + 10_000, max_gap_seconds=600) == History()
    assert History.from_status({"lastDecisionTime": "garbage"}, now=NOW,
                               max_gap_seconds=600) == History()
