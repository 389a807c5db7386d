"""Shared fixtures for the autoscaler tests: sample windows and a tick-by-tick driver."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from kvasir_operator.autoscale.decision import Decision, decide
from kvasir_operator.autoscale.history import History
from kvasir_operator.autoscale.signals import PodSample, failed_sample
from kvasir_operator.autoscale.window import SampleWindow
from kvasir_operator.spec import AutoscalingSpec


@dataclass(frozen=True)
class Load:
    waiting: float = 0.0
    running: float = 0.0
    kv: float = 0.0


def window_of(now: float, pods: Mapping[str, Load | None], age: float = 0.0) -> SampleWindow:
    """One sample per pod taken `age` seconds ago; None stands for a failed scrape."""
    samples: list[PodSample] = []
    for name, load in pods.items():
        if load is None:
            samples.append(failed_sample(name, now - age, "connection refused"))
        else:
            samples.append(PodSample(name, now - age, num_waiting=load.waiting,
                                     num_running=load.running, kv_cache_usage=load.kv))
    return SampleWindow().record(samples, ready_pod_names=pods, now=now, horizon_seconds=1e9)


def spread(total: Load, num_pods: int) -> dict[str, Load | None]:
    """A pool total shared evenly by `num_pods` ready pods (KV capped at a full cache)."""
    if num_pods == 0:
        return {}
    return {f"p{i}": Load(total.waiting / num_pods, total.running / num_pods,
                          min(1.0, total.kv / num_pods)) for i in range(num_pods)}


def on_one_pod(total: Load, num_pods: int) -> dict[str, Load | None]:
    """The whole load queued on the first pod; the others idle (a skewed router)."""
    return {f"p{i}": total if i == 0 else Load() for i in range(num_pods)}


def long_history(now: float, policy: AutoscalingSpec) -> History:
    """A history that began long ago and holds no recent recommendation."""
    return History(started_at=now - 10 * policy.scale_down_delay_seconds - 1)


def run_ticks(policy: AutoscalingSpec, start_replicas: int, totals: Sequence[Load],
              *, start: float = 1_000_000.0, spread_waiting: bool = True) -> list[Decision]:
    """Drive decide() one interval at a time; new replicas are ready by the next tick."""
    share = spread if spread_waiting else on_one_pod
    replicas, history, now = start_replicas, long_history(start, policy), start
    decisions: list[Decision] = []
    for total in totals:
        decision = decide(policy, replicas, window_of(now, share(total, replicas)), 0,
                          history, now)
        history = history.record(now, decision.recommendation, policy.scale_down_delay_seconds)
        decisions.append(decision)
        replicas = decision.desired
        now += policy.interval_seconds
    return decisions
