"""`kvasir:kv_transfer_*`: what disaggregated prefill moved and why it fell back (docs/metrics.md).

Read at scrape time from the connector's `TransferStats` (kv_transfer/connector.py), which the
block server's threads and the event loop feed; only an engine started with
`--kv-transfer-config` exports them. vLLM's own transfer metrics are its NIXL connector's
(`vllm:nixl_xfer_time_seconds`, ...), about NIXL's descriptors and posts, which a TCP block
stream does not have: these are ours, labelled `direction` (`sent` by a producer, `received`
by a consumer) and, for fallbacks, `reason`.
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Iterator

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from kvasir_engine.kv_transfer.connector import FALLBACK_REASONS, KVConnector

# One transfer's seconds: a few blocks on the loopback take a millisecond, a long prompt's
# across nodes seconds.
TRANSFER_SECONDS_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
                            2.5, 5.0, 10.0, 30.0)
DIRECTIONS = ("sent", "received")


class KVTransferCollector(Collector):
    def __init__(self, connector: KVConnector, model_name: str) -> None:
        self._connector = connector
        self._model_name = model_name
        self._lock = threading.Lock()
        # Per direction: observations per bucket (the last is +Inf), their sum.
        self._buckets = {d: [0] * (len(TRANSFER_SECONDS_BUCKETS) + 1) for d in DIRECTIONS}
        self._sums = dict.fromkeys(DIRECTIONS, 0.0)

    def collect(self) -> Iterator[Metric]:
        stats, name = self._connector.stats, self._model_name
        labels = ["model_name", "direction"]
        blocks = CounterMetricFamily("kvasir:kv_transfer_blocks",
                                     "KV blocks sent (producer) or received (consumer)", labels=labels)
        num_bytes = CounterMetricFamily("kvasir:kv_transfer_bytes",
                                        "Bytes of KV blocks sent or received", labels=labels)
        for direction in DIRECTIONS:
            blocks.add_metric([name, direction], stats.num_blocks[direction])
            num_bytes.add_metric([name, direction], stats.num_bytes[direction])
        yield blocks
        yield num_bytes
        yield self._seconds(stats.take_seconds())
        fallbacks = CounterMetricFamily(
            "kvasir:kv_transfer_fallbacks",
            "Decode requests that prefilled locally because their KV transfer failed, by reason",
            labels=["model_name", "reason"])
        for reason in FALLBACK_REASONS:
            fallbacks.add_metric([name, reason], stats.fallbacks[reason])
        yield fallbacks
        server = self._connector.server
        held = GaugeMetricFamily("kvasir:kv_transfer_held_requests",
                                 "Finished prompts whose blocks a producer holds for a consumer",
                                 labels=["model_name"])
        held.add_metric([name], server.num_held if server is not None else 0)
        yield held

    def _seconds(self, observed: list[tuple[str, float]]) -> HistogramMetricFamily:
        family = HistogramMetricFamily("kvasir:kv_transfer_seconds",
                                       "Time of one KV transfer, header to last block",
                                       labels=["model_name", "direction"])
        with self._lock:
            for direction, seconds in observed:
                self._buckets[direction][bisect.bisect_left(TRANSFER_SECONDS_BUCKETS,
                                                            seconds)] += 1
                self._sums[direction] += seconds
            for direction in DIRECTIONS:
                cumulative, rows = 0, []
                for bound, count in zip((*TRANSFER_SECONDS_BUCKETS, float("inf")),
                                        self._buckets[direction], strict=True):
                    cumulative += count
                    rows.append((str(bound) if bound != float("inf") else "+Inf", cumulative))
                family.add_metric([self._model_name, direction], rows, self._sums[direction])
        return family
