"""Autoscaling policies on synthetic traffic: queueing delay versus replica-hours.

A discrete-time (1 s) model: Poisson arrivals at a rate that follows a trace (ramp, bursts, a
compressed diurnal curve); each replica serves up to SLOTS requests at once (its batch / KV
capacity), each taking an exponential service time; requests beyond the free slots wait in one
FIFO queue (a least-loaded router). A new replica serves only after COLD_START seconds; a replica
chosen for scale-down stops admitting and drains its requests (never cutting one), and it costs
replica-time while booting and draining. Every INTERVAL seconds a policy sets the replica count:

- kvasir: the operator's own `decide()` (waiting requests per replica 2, KV usage 0.8, x2 up per
  step, 300 s stabilized scale-down), fed per-pod samples like the real scraper.
- kubeai: KubeAI's habit: a moving average over 10 min of active (running + waiting) requests,
  ceil(avg / target per replica), 30 s scale-down delay.
- hpa: an HPA on the per-pod average of active requests: ceil(sum over ready pods / target),
  tolerance 0.1, up at most max(2x, +4) per 15 s, 300 s scale-down stabilization; unready pods
  count as zero load.

Run: `python bench/autoscale_sim.py` (about 20 s); writes bench/results/autoscale_sim.{json,png}.
"""

from __future__ import annotations

import argparse
import json
import math
import random
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from kvasir_operator.autoscale.decision import decide, stale_after_seconds
from kvasir_operator.autoscale.history import History
from kvasir_operator.autoscale.signals import PodSample
from kvasir_operator.autoscale.window import SampleWindow
from kvasir_operator.spec import AutoscalingSpec

SLOTS = 16  # concurrent requests per replica
SERVICE_S = 30.0  # mean seconds per request (a long streamed generation)
COLD_START_S = 90  # pod scheduled -> model loaded and ready
INTERVAL_S = 15
DURATION_S = 7200
MIN_REPLICAS, MAX_REPLICAS = 1, 20
TARGET_ACTIVE = 0.8 * SLOTS  # per-replica target of the kubeai and hpa policies


def ramp(t: float) -> float:
    up, hold = 3600, 1800
    peak = 5.0
    if t < up:
        return 0.3 + (peak - 0.3) * t / up
    if t < up + hold:
        return peak
    return max(0.3, peak - (peak - 0.3) * (t - up - hold) / (DURATION_S - up - hold))


def burst(t: float) -> float:
    return 6.0 if any(s <= t < s + 300 for s in (900, 3300, 5700)) else 1.0


def diurnal(t: float) -> float:
    return 2.6 - 2.3 * math.cos(2 * math.pi * t / DURATION_S)


TRACES: dict[str, Callable[[float], float]] = {"ramp": ramp, "burst": burst, "diurnal": diurnal}


@dataclass
class Replica:
    ready_at: float
    finish_times: list[float] = field(default_factory=list)
    draining: bool = False


@dataclass
class Pool:
    replicas: list[Replica]
    queue: deque[float] = field(default_factory=deque)  # arrival times
    delays: list[float] = field(default_factory=list)
    replica_seconds: float = 0.0

    def ready(self, now: float) -> list[Replica]:
        return [r for r in self.replicas if r.ready_at <= now and not r.draining]

    def active(self) -> list[Replica]:
        return [r for r in self.replicas if not r.draining]

    def scale_to(self, desired: int, now: float) -> None:
        active = self.active()
        for _ in range(desired - len(active)):
            self.replicas.append(Replica(ready_at=now + COLD_START_S))
        # Unready pods go first, then the least busy (what pod-deletion-cost asks for).
        victims = sorted(active, key=lambda r: (r.ready_at <= now, len(r.finish_times)))
        for replica in victims[:max(0, len(active) - desired)]:
            replica.draining = True
        self.replicas = [r for r in self.replicas
                         if not (r.draining and (not r.finish_times or r.ready_at > now))]


def kvasir_policy() -> Callable[[Pool, float], int]:
    policy = AutoscalingSpec(min_replicas=MIN_REPLICAS, max_replicas=MAX_REPLICAS,
                               interval_seconds=INTERVAL_S)
    history, window = History(), SampleWindow()

    def step(pool: Pool, now: float) -> int:
        nonlocal history, window
        ready = pool.ready(now)
        per_pod_waiting = len(pool.queue) / max(1, len(ready))
        samples = [PodSample(f"r{id(r)}", now, num_waiting=per_pod_waiting,
                             num_running=len(r.finish_times),
                             kv_cache_usage=len(r.finish_times) / SLOTS) for r in ready]
        window = window.record(samples, ready_pod_names=[s.pod_name for s in samples], now=now,
                               horizon_seconds=stale_after_seconds(policy))
        decision = decide(policy, len(pool.active()), window, 0, history, now)
        history = history.record(now, decision.recommendation, policy.scale_down_delay_seconds)
        return decision.desired

    return step


def kubeai_policy(window_s: int = 600, delay_s: int = 30) -> Callable[[Pool, float], int]:
    averages: deque[float] = deque(maxlen=window_s // INTERVAL_S)
    below_since: float | None = None

    def step(pool: Pool, now: float) -> int:
        nonlocal below_since
        averages.append(len(pool.queue) + sum(len(r.finish_times) for r in pool.replicas))
        want = math.ceil(sum(averages) / len(averages) / TARGET_ACTIVE)
        want = max(MIN_REPLICAS, min(MAX_REPLICAS, want))
        current = len(pool.active())
        if want >= current:
            below_since = None
            return want
        below_since = now if below_since is None else below_since
        return want if now - below_since >= delay_s else current

    return step


def hpa_policy(stabilization_s: int = 300) -> Callable[[Pool, float], int]:
    recommendations: deque[tuple[float, int]] = deque()

    def step(pool: Pool, now: float) -> int:
        current = len(pool.active())
        load = len(pool.queue) + sum(len(r.finish_times) for r in pool.ready(now))
        ratio = load / (TARGET_ACTIVE * max(1, current))
        want = current if abs(ratio - 1) <= 0.1 else math.ceil(ratio * max(1, current))
        want = max(MIN_REPLICAS, min(MAX_REPLICAS, want))
        recommendations.append((now, want))
        while recommendations[0][0] < now - stabilization_s:
            recommendations.popleft()
        stabilized = max(r for _, r in recommendations) if want < current else want
        return min(stabilized, max(2 * current, current + 4))

    return step


POLICIES = {"kvasir": kvasir_policy, "kubeai": kubeai_policy, "hpa": hpa_policy}


def simulate(rate: Callable[[float], float], policy: Callable[[Pool, float], int],
             seed: int) -> tuple[dict[str, float], list[tuple[float, int, int]]]:
    rng = random.Random(seed)
    pool = Pool(replicas=[Replica(ready_at=0.0)])
    timeline: list[tuple[float, int, int]] = []
    for now in range(DURATION_S):
        for replica in pool.replicas:
            replica.finish_times = [f for f in replica.finish_times if f > now]
        pool.replicas = [r for r in pool.replicas if not (r.draining and not r.finish_times)]
        for _ in range(_poisson(rng, rate(now))):
            pool.queue.append(float(now))
        ready = pool.ready(now)
        while pool.queue and ready:
            replica = min(ready, key=lambda r: len(r.finish_times))
            if len(replica.finish_times) >= SLOTS:
                break
            pool.delays.append(now - pool.queue.popleft())
            replica.finish_times.append(now + rng.expovariate(1 / SERVICE_S))
        if now % INTERVAL_S == 0:
            pool.scale_to(policy(pool, float(now)), float(now))
        pool.replica_seconds += len(pool.replicas)
        timeline.append((now, len(pool.replicas), len(pool.queue)))
    delays = sorted(pool.delays + [DURATION_S - a for a in pool.queue])
    return {
        "mean_queue_delay_s": round(sum(delays) / len(delays), 2),
        "p95_queue_delay_s": round(delays[int(0.95 * (len(delays) - 1))], 2),
        "replica_hours": round(pool.replica_seconds / 3600, 2),
        "max_replicas": max(n for _, n, _ in timeline),
        "requests": len(delays),
    }, timeline


def _poisson(rng: random.Random, lam: float) -> int:
    limit, k, p = math.exp(-lam), 0, rng.random()
    while p > limit:
        k += 1
        p *= rng.random()
    return k


def plot(path: Path, timelines: dict[str, dict[str, list[tuple[float, int, int]]]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(timelines), 2, figsize=(13, 3.2 * len(timelines)))
    for row, (trace, by_policy) in enumerate(timelines.items()):
        needed = [TRACES[trace](t) * SERVICE_S / TARGET_ACTIVE for t in range(DURATION_S)]
        axes[row][0].plot([t / 60 for t in range(DURATION_S)], needed, "k:", label="needed @80%")
        for name, line in by_policy.items():
            minutes = [t / 60 for t, _, _ in line]
            axes[row][0].plot(minutes, [n for _, n, _ in line], label=name)
            axes[row][1].plot(minutes, [q for _, _, q in line], label=name)
        axes[row][0].set_title(f"{trace}: replicas (incl. booting, draining)")
        axes[row][1].set_title(f"{trace}: requests waiting")
        for ax in axes[row]:
            ax.set_xlabel("minutes")
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    parser.add_argument("--seed", type=int, default=7)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    results: dict[str, dict[str, dict[str, float]]] = {}
    timelines: dict[str, dict[str, list[tuple[float, int, int]]]] = {}
    for trace, rate in TRACES.items():
        for name, make in POLICIES.items():
            summary, line = simulate(rate, make(), args.seed)
            results.setdefault(trace, {})[name] = summary
            timelines.setdefault(trace, {})[name] = line
    params = {"slots_per_replica": SLOTS, "mean_service_s": SERVICE_S,
              "cold_start_s": COLD_START_S, "interval_s": INTERVAL_S, "duration_s": DURATION_S,
              "min_replicas": MIN_REPLICAS, "max_replicas": MAX_REPLICAS, "seed": args.seed}
    (args.out / "autoscale_sim.json").write_text(
        json.dumps({"params": params, "results": results}, indent=2) + "\n")
    plot(args.out / "autoscale_sim.png", timelines)
    print(f"{'trace':8} {'policy':7} {'mean s':>8} {'p95 s':>8} {'rep-h':>7} {'max':>4}")
    for trace, by_policy in results.items():
        for name, r in by_policy.items():
            print(f"{trace:8} {name:7} {r['mean_queue_delay_s']:8.2f} "
                  f"{r['p95_queue_delay_s']:8.2f} {r['replica_hours']:7.2f} "
                  f"{r['max_replicas']:4d}")


if __name__ == "__main__":
    main()
