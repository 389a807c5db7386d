"""Cost per million output tokens, from the pods' own token counters: `status.cost`.

cost per million output tokens = the replicas' price per hour / (output tokens/s x 3600) x 1e6.

- **measured**: the price of every pod that holds a node (scheduled and not being deleted: it is
  paid for whether it serves or still loads) over the output tokens/s its ready pods generated in
  the last `RATE_WINDOW_SECONDS`, the rate of `vllm:generation_tokens_total` per pod (a counter
  that went down is a restarted engine: its new value is the increase, as Prometheus' `rate()`
  counts it). An idle service has no finite cost per token: the field is left out and `idle` says
  so, rather than writing an infinity or a misleading zero.
- **at full load**: `spec.cost.perHour / (spec.cost.fullLoadTokensPerSecond x 3600) x 1e6`, one
  replica's price over its benchmarked capacity; the floor the measured figure approaches when
  every replica is busy.

Pure functions of plain values; the autoscaler's tick (autoscale/actuator.py) scrapes the pods and
writes the record, on the same interval, whether or not it also scales (spec.autoscaling.mode).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ..spec import CostSpec
from .history import iso_time
from .signals import PodSample

RATE_WINDOW_SECONDS = 300.0  # the rate is averaged over the last five minutes, like rate(..[5m])
MIN_SPAN_SECONDS = 1.0  # two samples closer than this give no rate


def pod_tokens_per_second(samples: Sequence[PodSample]) -> tuple[float, float] | None:
    """(tokens, seconds) the pod's counter grew by over its samples, oldest first; None when
    fewer than two samples carry the counter."""
    counted = [s for s in samples if s.generation_tokens is not None]
    if len(counted) < 2 or counted[-1].timestamp - counted[0].timestamp < MIN_SPAN_SECONDS:
        return None
    tokens = 0.0
    for before, after in zip(counted, counted[1:], strict=False):
        assert before.generation_tokens is not None and after.generation_tokens is not None
        step = after.generation_tokens - before.generation_tokens
        tokens += step if step >= 0 else after.generation_tokens  # a reset counts from zero
    return tokens, counted[-1].timestamp - counted[0].timestamp


def tokens_per_second(pod_to_samples: Mapping[str, Sequence[PodSample]]) -> float | None:
    """The service's output tokens/s: the sum of its pods' rates; None when no pod has two
    samples yet (the first tick after a start or an operator restart)."""
    rates = [tokens / seconds for tokens, seconds in
             filter(None, map(pod_tokens_per_second, pod_to_samples.values()))]
    return sum(rates) if rates else None


def per_million(per_hour: float, tokens_per_second: float) -> float:
    return per_hour / (tokens_per_second * 3600.0) * 1e6


def cost_status(cost: CostSpec, *, num_paid_replicas: int, measured_tokens_per_second:
                float | None, now: float) -> dict[str, Any] | None:
    """The `status.cost` record; None when the service declares no price."""
    if cost.per_hour is None:
        return None
    record: dict[str, Any] = {"perHour": cost.per_hour, "currency": cost.currency,
                              "paidReplicas": num_paid_replicas, "measuredAt": iso_time(now)}
    if cost.full_load_tokens_per_second is not None:
        record["perMillionOutputTokensAtFullLoad"] = round(
            per_million(cost.per_hour, cost.full_load_tokens_per_second), 4)
    if measured_tokens_per_second is not None:
        record["outputTokensPerSecond"] = round(measured_tokens_per_second, 2)
        if measured_tokens_per_second > 0:
            record["perMillionOutputTokens"] = round(
                per_million(cost.per_hour * num_paid_replicas, measured_tokens_per_second), 4)
        record["idle"] = measured_tokens_per_second == 0 and num_paid_replicas > 0
    return record


def holds_a_node(pod: Mapping[str, Any]) -> bool:
    """A pod the cluster pays for: bound to a node and not being deleted."""
    return (bool((pod.get("spec") or {}).get("nodeName"))
            and not (pod.get("metadata") or {}).get("deletionTimestamp"))
