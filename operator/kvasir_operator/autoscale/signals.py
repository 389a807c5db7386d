"""Per-pod load signals read from an engine's Prometheus `/metrics` text.

Three signals drive the autoscaler. Each is read under its vLLM name first and, so that a renamed
or foreign metric never silently stops scaling, under the older or SGLang names:

- waiting requests: `vllm:num_requests_waiting`, `sglang:num_queue_reqs`
- running requests: `vllm:num_requests_running`, `sglang:num_running_reqs`
- KV-cache usage (fraction 0..1): `vllm:kv_cache_usage_perc`, `vllm:gpu_cache_usage_perc`,
  `sglang:token_usage`

A disaggregated prefill pool may also scale on its time to first token: the histogram
`vllm:time_to_first_token_seconds`, read as its `_sum` and `_count` counters (summed over the
served model's label sets); the mean over an interval needs two samples
(`SampleWindow.mean_time_to_first_token`), so a single sample carries the counters only.

One counter rides along for the cost per token (`cost.py`), not for scaling: the output tokens the
pod has generated, `vllm:generation_tokens_total` (`sglang:generation_tokens_total`), summed over
the served model's label sets.

Only the first name in that order that the pod exposes is used, so an engine that publishes both
the new and the deprecated name during a rename is not counted twice.

Per pod versus pool: a `PodSample` holds ONE pod's values. Within a pod, the request counts are
summed over all label sets of the served model (e.g. vLLM's data-parallel `engine="0"`,
`engine="1"` series), while the KV-cache usage is the maximum over those label sets (a pod is as
full as its fullest engine; a sum of fractions would mean nothing). Pool totals (the sum over
pods) and per-pod means are computed only in `decision.py`.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from types import MappingProxyType

from prometheus_client.parser import text_string_to_metric_families


class Signal(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    KV_CACHE_USAGE = "kvCacheUsage"
    TIME_TO_FIRST_TOKEN = "timeToFirstToken"  # seconds, mean over the recent interval


SIGNAL_TO_METRIC_NAMES: Mapping[Signal, tuple[str, ...]] = MappingProxyType({
    Signal.WAITING: ("vllm:num_requests_waiting", "sglang:num_queue_reqs"),
    Signal.RUNNING: ("vllm:num_requests_running", "sglang:num_running_reqs"),
    Signal.KV_CACHE_USAGE: ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc",
                            "sglang:token_usage"),
})

GENERATION_TOKENS_NAMES = ("vllm:generation_tokens_total", "sglang:generation_tokens_total")
TTFT_SUM_NAMES = ("vllm:time_to_first_token_seconds_sum",
                  "sglang:time_to_first_token_seconds_sum")
TTFT_COUNT_NAMES = ("vllm:time_to_first_token_seconds_count",
                    "sglang:time_to_first_token_seconds_count")
MODEL_LABELS = ("model_name", "model")


@dataclass(frozen=True)
class PodSample:
    """One scrape of one pod.

    `timestamp` is the operator's clock (seconds since the epoch) when the scrape completed; a
    sample whose scrape failed still has one, with `error` saying why and every value None. A
    value is None when the pod exposes none of that signal's names.
    """

    pod_name: str
    timestamp: float
    num_waiting: float | None = None  # requests queued in this pod, not yet scheduled
    num_running: float | None = None  # requests this pod is decoding or prefilling
    kv_cache_usage: float | None = None  # fraction 0..1 of this pod's KV cache in use
    generation_tokens: float | None = None  # counter: output tokens generated since the start
    ttft_sum: float | None = None  # counter: seconds to first token, summed over requests
    ttft_count: float | None = None  # counter: requests that got their first token
    error: str | None = None  # why the scrape or the parse failed; None when it worked

    def __post_init__(self) -> None:
        if not self.pod_name:
            raise ValueError("pod_name: must not be empty")
        if not math.isfinite(self.timestamp):
            raise ValueError(f"timestamp: must be finite, got {self.timestamp}")
        for name in ("num_waiting", "num_running", "kv_cache_usage", "generation_tokens",
                     "ttft_sum", "ttft_count"):
            value = getattr(self, name)
            if value is not None and not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{name}: must be a finite number >= 0, got {value}")
        if self.kv_cache_usage is not None and self.kv_cache_usage > 1:
            raise ValueError(f"kv_cache_usage: a fraction must be <= 1, got {self.kv_cache_usage}")
        if self.error is not None and self.has_any_value:
            raise ValueError("error: a failed scrape carries no values")

    @property
    def has_any_value(self) -> bool:
        return any(v is not None for v in (self.num_waiting, self.num_running,
                                           self.kv_cache_usage, self.generation_tokens,
                                           self.ttft_sum, self.ttft_count))

    def value(self, signal: Signal) -> float | None:
        """This scrape's value of `signal`; for the time to first token, the number of first
        tokens counted (whether the pod exports it: its mean takes two samples)."""
        if signal is Signal.TIME_TO_FIRST_TOKEN:
            return self.ttft_count
        if signal is Signal.WAITING:
            return self.num_waiting
        if signal is Signal.RUNNING:
            return self.num_running
        return self.kv_cache_usage

    def has(self, signals: Iterable[Signal]) -> bool:
        """True if the scrape worked and every one of `signals` has a value."""
        return self.error is None and all(self.value(s) is not None for s in signals)


def failed_sample(pod_name: str, timestamp: float, error: str) -> PodSample:
    return PodSample(pod_name=pod_name, timestamp=timestamp, error=error or "unknown error")


def _is_same_model(labels: Mapping[str, str], model_name: str | None) -> bool:
    if model_name is None:
        return True
    present = [labels[k] for k in MODEL_LABELS if k in labels]
    return not present or model_name in present


def parse_metrics(text: str, *, pod_name: str, timestamp: float,
                  model_name: str | None = None) -> PodSample:
    """Parse Prometheus exposition text into a `PodSample`; never raises on bad text.

    With `model_name`, only series labelled with that model (or with no model label) count.
    A malformed page, a NaN, a negative value or a KV fraction above 1 yields a sample with
    `error` set (the pod then counts as missing), naming the metric at fault.
    """
    name_groups = (*SIGNAL_TO_METRIC_NAMES.values(), GENERATION_TOKENS_NAMES, TTFT_SUM_NAMES,
                   TTFT_COUNT_NAMES)
    wanted = {name for names in name_groups for name in names}
    name_to_values: dict[str, list[float]] = {}
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name in wanted and _is_same_model(sample.labels, model_name):
                    name_to_values.setdefault(sample.name, []).append(float(sample.value))
    except (ValueError, TypeError, IndexError) as exc:
        return failed_sample(pod_name, timestamp, f"malformed /metrics text: {exc}")

    signal_to_value: dict[Signal, float | None] = {}
    for signal, names in SIGNAL_TO_METRIC_NAMES.items():
        name = next((n for n in names if n in name_to_values), None)
        if name is None:
            signal_to_value[signal] = None
            continue
        values = name_to_values[name]
        bad = [v for v in values if not (math.isfinite(v) and v >= 0)]
        if bad:
            return failed_sample(pod_name, timestamp, f"{name}: bad value {bad[0]}")
        if signal is Signal.KV_CACHE_USAGE:
            if max(values) > 1:
                return failed_sample(pod_name, timestamp,
                                     f"{name}: {max(values)} is not a fraction in 0..1")
            signal_to_value[signal] = max(values)
        else:
            signal_to_value[signal] = sum(values)
    counter_to_value: dict[str, float | None] = {}
    for key, names in (("tokens", GENERATION_TOKENS_NAMES), ("ttft_sum", TTFT_SUM_NAMES),
                       ("ttft_count", TTFT_COUNT_NAMES)):
        counter = next((n for n in names if n in name_to_values), None)
        values = name_to_values.get(counter or "", [])
        bad = [v for v in values if not (math.isfinite(v) and v >= 0)]
        if bad:
            return failed_sample(pod_name, timestamp, f"{counter}: bad value {bad[0]}")
        counter_to_value[key] = sum(values) if counter else None
    return PodSample(
        pod_name=pod_name,
        timestamp=timestamp,
        num_waiting=signal_to_value[Signal.WAITING],
        num_running=signal_to_value[Signal.RUNNING],
        kv_cache_usage=signal_to_value[Signal.KV_CACHE_USAGE],
        generation_tokens=counter_to_value["tokens"],
        ttft_sum=counter_to_value["ttft_sum"],
        ttft_count=counter_to_value["ttft_count"],
    )
