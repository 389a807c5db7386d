"""Past replica recommendations, for HPA-style scale-down stabilization.

Scale-down goes to the MAXIMUM recommendation seen over the last `scaleDownDelaySeconds`, so it
happens only after demand has stayed lower for the whole delay. Only the non-dominated entries
are kept (a monotone queue: replicas strictly decreasing as time increases), because an entry
followed by a later one at least as large can never be that maximum again. So the history holds
at most maxReplicas - minReplicas + 1 entries and fits in `status.autoscaling`, which is how a
restarted operator keeps a pending scale-down timer.

`started_at` is when this run of observations began. Until it is a full delay old the history
does not cover the window, and the caller must not scale down on it.
"""

from __future__ import annotations

import datetime
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Recommendation:
    time: float  # seconds since the epoch
    replicas: int


@dataclass(frozen=True)
class History:
    started_at: float | None = None
    recommendations: tuple[Recommendation, ...] = ()

    def __post_init__(self) -> None:
        for older, newer in zip(self.recommendations, self.recommendations[1:], strict=False):
            if not (older.time <= newer.time and older.replicas > newer.replicas):
                raise ValueError("recommendations: must be time-ordered with strictly "
                                 "decreasing replicas")

    def record(self, now: float, replicas: int, horizon_seconds: float) -> History:
        """Add a recommendation and forget what is older than the horizon."""
        kept = tuple(r for r in self.recommendations
                     if r.replicas > replicas and r.time >= now - horizon_seconds)
        started = self.started_at if self.started_at is not None else now
        return History(started_at=started,
                       recommendations=(*kept, Recommendation(now, replicas)))

    def max_since(self, since: float) -> int | None:
        """The largest recommendation made at or after `since`; None if there is none."""
        recent = [r.replicas for r in self.recommendations if r.time >= since]
        return max(recent) if recent else None

    def covers(self, since: float) -> bool:
        return self.started_at is not None and self.started_at <= since

    def to_status(self) -> dict[str, Any]:
        return {
            "startedAt": iso_time(self.started_at) if self.started_at is not None else None,
            "recommendations": [{"time": iso_time(r.time), "replicas": r.replicas}
                                for r in self.recommendations],
        }

    @classmethod
    def from_status(cls, record: Mapping[str, Any] | None, *, now: float,
                    max_gap_seconds: float) -> History:
        """Restore from `status.autoscaling.history`, or start afresh.

        A record whose last decision is older than `max_gap_seconds` is dropped: nobody watched
        the load during the gap, so a new full delay window must pass before a scale-down.
        Anything unreadable also starts afresh; it only delays a scale-down.
        """
        if not record:
            return cls()
        try:
            history = record.get("history") or {}
            last = _epoch(record["lastDecisionTime"])
            if not math.isfinite(last) or now - last > max_gap_seconds or last > now:
                return cls()
            started = history.get("startedAt")
            entries = tuple(Recommendation(_epoch(e["time"]), int(e["replicas"]))
                            for e in history.get("recommendations") or [])
            return cls(started_at=_epoch(started) if started else None,
                       recommendations=entries)
        except (KeyError, TypeError, ValueError):
            return cls()


def iso_time(epoch: float) -> str:
    moment = datetime.datetime.fromtimestamp(epoch, datetime.UTC)
    return moment.isoformat(timespec="milliseconds").replace("+00:00", "Z")


def _epoch(text: str) -> float:
    return datetime.datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()
