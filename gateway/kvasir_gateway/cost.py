"""Cost per million output tokens of each priced pool, at its measured rate and at full load.

cost per million tokens = hourly price / (tokens/s x 3600) x 1e6. The price is one replica's
(`pools.NAME.cost_per_hour` in the routing file, which the operator's `spec.cost.perHour`
documents on the InferenceService); the measured rate is the pool's ready replicas' summed
`vllm:generation_tokens_total` rate over the last scrapes (replicas.py), against the price of
that many replicas, so an idle card shows what it really costs per token (nothing generated: no
sample, the series is absent rather than infinite). `full_load_tokens_per_second` (one replica's
capacity, from bench/serving.py) gives the price at full load, the floor.

Computed when Prometheus scrapes, from the replicas' state: no timer, never stale.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from kvasir_gateway.aliases import Pool

if TYPE_CHECKING:
    from kvasir_gateway.replicas import ReplicaSet


def cost_per_million(cost_per_hour: float, tokens_per_second: float) -> float | None:
    if tokens_per_second <= 0:
        return None
    return cost_per_hour / (tokens_per_second * 3600.0) * 1e6


class CostModel(Collector):
    def __init__(self, pools: Mapping[str, Pool], replicas: ReplicaSet) -> None:
        self.pools, self.replicas = pools, replicas

    def measured(self, model: str) -> tuple[int, float]:
        """(ready replicas serving `model`, their summed output tokens/s)."""
        serving = [r for r in self.replicas.routable() if model in r.model_ids]
        return len(serving), sum(r.output_tokens_per_second for r in serving)

    def cost_per_token(self, model: str) -> float | None:
        """What one output token of `model` costs now: at full load when the capacity is
        declared (stable, what the cascade's savings use), else at the measured rate."""
        pool = self.pools.get(model)
        if pool is None or pool.cost_per_hour is None:
            return None
        if pool.full_load_tokens_per_second:
            per_million = cost_per_million(pool.cost_per_hour, pool.full_load_tokens_per_second)
        else:
            num_replicas, rate = self.measured(model)
            per_million = cost_per_million(pool.cost_per_hour * num_replicas, rate)
        return None if per_million is None else per_million / 1e6

    def collect(self) -> Iterator[GaugeMetricFamily]:
        rate = GaugeMetricFamily("kvasir_gateway_pool_output_tokens_per_second",
                                 "Output tokens/s of the pool's ready replicas (measured)",
                                 labels=["pool"])
        cost = GaugeMetricFamily("kvasir_gateway_cost_per_million_output_tokens",
                                 "Hourly price / (tokens/s x 3600) x 1e6 (load: measured, full)",
                                 labels=["pool", "load"])
        for model in sorted(self.pools):
            pool = self.pools[model]
            num_replicas, tokens_per_second = self.measured(model)
            rate.add_metric([model], tokens_per_second)
            if pool.cost_per_hour is None:
                continue
            measured = cost_per_million(pool.cost_per_hour * num_replicas, tokens_per_second)
            if measured is not None:
                cost.add_metric([model, "measured"], measured)
            if pool.full_load_tokens_per_second:
                full = cost_per_million(pool.cost_per_hour, pool.full_load_tokens_per_second)
                cost.add_metric([model, "full"], full or 0.0)
        yield rate
        yield cost
