"""The autoscaling decision: a pure function of what was observed, no I/O, no clock.

    per signal:  replicas_needed = pool_total / per_replica_target
    demand      = max over signals of replicas_needed
    recommended = current if |demand / current - 1| <= tolerance else ceil(demand)
                  (never below current while a pod is stale or still starting; never 0 while a
                  pod reports any waiting or running request), clamped to [min, max]
    scale up    : at once, to min(recommended, max(2 * current, 1))   (x2 per step at most)
                  held at current while pods are unschedulable (reason InsufficientGPU)
    scale down  : to the largest recommendation of the last scaleDownDelaySeconds, and only once
                  the history covers that whole window (HPA-style stabilization)

Pool totals versus per-pod means: `pool_total` sums every ready pod's value (waiting requests,
running requests, KV-cache fraction); the targets are per replica, so the KV target 0.8 means
"pool mean usage 0.8" and `ceil(total / 0.8)` is the number of pods that keeps the mean at 0.8.
A stale pod (no good sample for `stale_after_seconds`) is counted as saturated, i.e. exactly at
every target: it keeps its own replica, cannot dilute the load of the others, and blocks scale-down.
A pod that is not ready yet carries no load and blocks scale-down too.

The signals depend on the pool (`policy.role`, `ROLE_TO_SIGNALS`): a whole service scales on its
queue and its KV cache; a disaggregated prefill pool on its queue only (its engines run prompts
and hold their blocks only until a consumer fetches them), a decode pool on its KV cache only
(what it decodes lives there); each on running requests too when `targetRequests` is set. A
prefill pool with `targetTimeToFirstTokenSeconds` also scales on its engines' mean time to first
token over the last `ttft_span_seconds`: summed over the pods and divided by the target, as
the other signals are, which is the HPA's `current x mean / target` for a latency.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass
from typing import Any

from ..spec import AutoscalingSpec
from .history import History
from .signals import Signal
from .window import SampleWindow


class Reason(enum.Enum):
    SCALE_UP = "ScaleUp"
    SCALE_UP_LIMITED = "ScaleUpLimited"  # the x2-per-step limit held it back
    SCALE_DOWN = "ScaleDown"
    SCALE_DOWN_DELAYED = "ScaleDownDelayed"  # lower demand, waiting for scaleDownDelaySeconds
    SCALE_DOWN_BLOCKED = "ScaleDownBlocked"  # lower demand, but a pod is stale or starting
    STABLE = "Stable"
    AT_MAX_REPLICAS = "AtMaxReplicas"
    INSUFFICIENT_GPU = "InsufficientGPU"
    OUT_OF_RANGE = "OutOfRange"  # current replicas outside [min, max]: clamped at once
    # Every ready pod's metrics are stale (each scrape failed): no decision on stale data.
    METRICS_UNAVAILABLE = "MetricsUnavailable"


@dataclass(frozen=True)
class SignalReading:
    signal: Signal
    pool_total: float  # sum over ready pods (stale pods counted at the target)
    per_pod_mean: float  # pool_total / number of ready pods (0 with none)
    target: float  # per replica
    replicas_needed: float  # pool_total / target, before rounding

    def to_status(self) -> dict[str, float]:
        return {"total": round(self.pool_total, 4), "perPodMean": round(self.per_pod_mean, 4),
                "target": self.target, "replicasNeeded": round(self.replicas_needed, 4)}


@dataclass(frozen=True)
class Signals:
    readings: tuple[SignalReading, ...]
    num_pods_fresh: int
    stale_pod_names: tuple[str, ...]
    num_pods_starting: int  # counted in spec.replicas but not ready, and schedulable
    num_pods_unschedulable: int

    def to_status(self) -> dict[str, Any]:
        return {
            **{r.signal.value: r.to_status() for r in self.readings},
            "podsFresh": self.num_pods_fresh,
            "podsStale": len(self.stale_pod_names),
            "podsStarting": self.num_pods_starting,
            "podsUnschedulable": self.num_pods_unschedulable,
        }


@dataclass(frozen=True)
class Decision:
    current: int
    desired: int
    recommendation: int  # this tick's un-stabilized recommendation, for the history
    reason: Reason
    message: str
    signals: Signals

    @property
    def is_change(self) -> bool:
        return self.desired != self.current


def clamp(policy: AutoscalingSpec, replicas: int) -> int:
    return max(policy.min_replicas, min(policy.max_replicas, replicas))


def stale_after_seconds(policy: AutoscalingSpec) -> float:
    """A pod's last good sample is trusted for two missed scrapes; after that it is stale."""
    return 2.5 * policy.interval_seconds


ROLE_TO_SIGNALS: dict[str | None, tuple[Signal, ...]] = {
    None: (Signal.WAITING, Signal.KV_CACHE_USAGE),
    "prefill": (Signal.WAITING,),
    "decode": (Signal.KV_CACHE_USAGE,),
}


def ttft_span_seconds(policy: AutoscalingSpec) -> float:
    """The interval the mean time to first token is taken over: four ticks, at least 60 s."""
    return max(60.0, 4.0 * policy.interval_seconds)


def _signals_of(policy: AutoscalingSpec) -> dict[Signal, float]:
    targets = {Signal.WAITING: policy.target_requests_waiting,
               Signal.KV_CACHE_USAGE: policy.target_kv_cache_usage}
    signal_to_target = {s: targets[s] for s in ROLE_TO_SIGNALS[policy.role]}
    if policy.target_time_to_first_token_seconds is not None:
        signal_to_target[Signal.TIME_TO_FIRST_TOKEN] = policy.target_time_to_first_token_seconds
    if policy.target_requests is not None:
        signal_to_target[Signal.RUNNING] = policy.target_requests
    return signal_to_target


def read_signals(policy: AutoscalingSpec, current_replicas: int, window: SampleWindow,
                 pending_unschedulable: int, now: float) -> tuple[Signals, bool]:
    """Pool readings, and whether any fresh pod reports a waiting or running request."""
    signal_to_target = _signals_of(policy)
    signal_to_total = dict.fromkeys(signal_to_target, 0.0)
    stale: list[str] = []
    is_busy = False
    for pod_name in window.pod_names:
        sample = window.latest_usable(pod_name, signal_to_target, now=now,
                                      max_age_seconds=stale_after_seconds(policy))
        if sample is None:
            stale.append(pod_name)
            for signal, target in signal_to_target.items():
                signal_to_total[signal] += target
            continue
        is_busy = is_busy or bool(sample.num_waiting) or bool(sample.num_running)
        for signal in signal_to_target:
            signal_to_total[signal] += (
                window.mean_time_to_first_token(pod_name, now=now,
                                                span_seconds=ttft_span_seconds(policy))
                if signal is Signal.TIME_TO_FIRST_TOKEN else sample.value(signal) or 0.0)
    num_ready = len(window.pod_names)
    readings = tuple(
        SignalReading(signal=s, pool_total=signal_to_total[s],
                      per_pod_mean=signal_to_total[s] / num_ready if num_ready else 0.0,
                      target=t, replicas_needed=signal_to_total[s] / t)
        for s, t in signal_to_target.items())
    starting = max(0, current_replicas - num_ready - pending_unschedulable)
    return Signals(readings=readings, num_pods_fresh=num_ready - len(stale),
                   stale_pod_names=tuple(stale), num_pods_starting=starting,
                   num_pods_unschedulable=pending_unschedulable), is_busy


def recommend(policy: AutoscalingSpec, current: int, signals: Signals, is_busy: bool) -> int:
    """What the load alone asks for, clamped; before blockers, rate limits and stabilization."""
    demand = max(r.replicas_needed for r in signals.readings)
    if current > 0 and abs(demand / current - 1) <= policy.tolerance:
        replicas = current
    else:
        replicas = math.ceil(demand - 1e-9)
    if is_busy:
        replicas = max(replicas, 1)
    return clamp(policy, replicas)


def decide(policy: AutoscalingSpec, current_replicas: int, samples_window: SampleWindow,
           pending_unschedulable: int, history: History, now: float) -> Decision:
    if current_replicas < 0 or pending_unschedulable < 0:
        raise ValueError("current_replicas and pending_unschedulable must be >= 0")
    signals, is_busy = read_signals(policy, current_replicas, samples_window,
                                    pending_unschedulable, now)
    current = current_replicas
    by_load = recommend(policy, current, signals, is_busy)
    is_blocked = bool(signals.stale_pod_names or signals.num_pods_starting)
    rec = clamp(policy, max(by_load, current)) if is_blocked else by_load

    def make(desired: int, reason: Reason, message: str) -> Decision:
        return Decision(current=current, desired=desired, recommendation=rec, reason=reason,
                        message=message, signals=signals)

    demand = max(r.replicas_needed for r in signals.readings)
    lead = max(signals.readings, key=lambda r: r.replicas_needed)
    why = (f"{lead.signal.value} total {lead.pool_total:.3g} / target {lead.target:g} "
           f"per replica = {demand:.3g} replicas")
    if current != clamp(policy, current) and rec == clamp(policy, current):
        return make(rec, Reason.OUT_OF_RANGE,
                    f"{current} replicas is outside [{policy.min_replicas}, "
                    f"{policy.max_replicas}]")
    if signals.stale_pod_names and signals.num_pods_fresh == 0:
        return make(current, Reason.METRICS_UNAVAILABLE,
                    f"holding at {current}: no fresh metrics from any ready pod "
                    f"({', '.join(signals.stale_pod_names)}) for "
                    f"{stale_after_seconds(policy):g}s; no decision on stale data")
    if rec > current:
        if pending_unschedulable and current >= policy.min_replicas:
            return make(current, Reason.INSUFFICIENT_GPU,
                        f"{pending_unschedulable} pod(s) unschedulable; holding at {current} "
                        f"instead of {rec} ({why})")
        desired = max(policy.min_replicas, min(rec, max(2 * current, 1)))
        if desired < rec:
            return make(desired, Reason.SCALE_UP_LIMITED,
                        f"{current} -> {desired} (x2 per step; {rec} recommended: {why})")
        return make(desired, Reason.SCALE_UP, f"{current} -> {desired} ({why})")

    window_start = now - policy.scale_down_delay_seconds
    stabilized = max(rec, history.max_since(window_start) or 0)
    if not history.covers(window_start):
        stabilized = max(stabilized, current)
    stabilized = clamp(policy, stabilized)
    if stabilized < current:
        return make(stabilized, Reason.SCALE_DOWN,
                    f"{current} -> {stabilized} after {policy.scale_down_delay_seconds}s of "
                    f"lower demand ({why})")
    if by_load < current and is_blocked:
        blockers = (f"stale metrics from {', '.join(signals.stale_pod_names)}"
                    if signals.stale_pod_names else f"{signals.num_pods_starting} pod(s) starting")
        return make(current, Reason.SCALE_DOWN_BLOCKED, f"holding at {current}: {blockers}")
    if rec < current:
        return make(current, Reason.SCALE_DOWN_DELAYED,
                    f"{rec} recommended, holding at {current} until demand has stayed lower "
                    f"for {policy.scale_down_delay_seconds}s ({why})")
    if demand > policy.max_replicas and current == policy.max_replicas:
        return make(current, Reason.AT_MAX_REPLICAS,
                    f"at maxReplicas {policy.max_replicas} ({why})")
    return make(current, Reason.STABLE, f"{current} replicas ({why})")
