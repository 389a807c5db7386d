"""The recent samples of an InferenceService's ready pods, kept in the operator's memory.

One scrape per pod per tick is recorded; samples older than the staleness horizon and pods that
are no longer ready are dropped. A failed scrape does not erase the pod's last good sample: that
sample stays usable until it is older than `AutoscalingPolicy.stale_after_seconds`, so one lost
scrape never counts the pod as stale. After an operator restart the window starts empty and fills
within one tick.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from .signals import PodSample, Signal


@dataclass(frozen=True)
class SampleWindow:
    pod_to_samples: Mapping[str, tuple[PodSample, ...]] = field(
        default_factory=lambda: MappingProxyType({}))

    def __post_init__(self) -> None:
        object.__setattr__(self, "pod_to_samples", MappingProxyType(dict(self.pod_to_samples)))

    @property
    def pod_names(self) -> tuple[str, ...]:
        return tuple(sorted(self.pod_to_samples))

    def record(self, samples: Iterable[PodSample], *, ready_pod_names: Iterable[str],
               now: float, horizon_seconds: float) -> SampleWindow:
        """The window after one tick: `samples` added, only `ready_pod_names` kept."""
        ready = set(ready_pod_names)
        pod_to_samples = {name: [s for s in self.pod_to_samples.get(name, ())
                                 if s.timestamp >= now - horizon_seconds]
                          for name in ready}
        for sample in samples:
            if sample.pod_name in ready:
                pod_to_samples[sample.pod_name].append(sample)
        return SampleWindow({name: tuple(sorted(items, key=lambda s: s.timestamp))
                             for name, items in pod_to_samples.items()})

    def only(self, pod_names: Iterable[str]) -> SampleWindow:
        """The samples of `pod_names` only (one disaggregated role's pods)."""
        keep = set(pod_names)
        return SampleWindow({n: s for n, s in self.pod_to_samples.items() if n in keep})

    def mean_time_to_first_token(self, pod_name: str, *, now: float,
                                 span_seconds: float) -> float:
        """The pod's mean time to first token (seconds) over the requests that got theirs in
        the last `span_seconds`: the growth of the histogram's sum over that of its count,
        between the oldest and the newest sample of the span (a count that went down is a
        restarted engine: its new counters are the growth). 0.0 when no request got a first
        token there (an idle pod, or one sample only)."""
        counters = [(s.ttft_sum, s.ttft_count) for s in self.pod_to_samples.get(pod_name, ())
                    if s.timestamp >= now - span_seconds and s.ttft_sum is not None
                    and s.ttft_count is not None]
        if len(counters) < 2:
            return 0.0
        (first_sum, first_count), (last_sum, last_count) = counters[0], counters[-1]
        restarted = last_count < first_count
        count = last_count if restarted else last_count - first_count
        total = last_sum if restarted else last_sum - first_sum
        return max(0.0, total / count) if count > 0 else 0.0

    def latest_usable(self, pod_name: str, signals: Iterable[Signal], *, now: float,
                      max_age_seconds: float) -> PodSample | None:
        """The newest sample of the pod that has all `signals` and is not stale, else None."""
        needed = tuple(signals)
        for sample in reversed(self.pod_to_samples.get(pod_name, ())):
            if now - sample.timestamp > max_age_seconds:
                return None
            if sample.has(needed):
                return sample
        return None
