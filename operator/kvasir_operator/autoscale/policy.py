"""`spec.autoscaling` as one frozen, validated value.

The CRD schema validates the same ranges first; this module is the second line, so a bad object
(an emulator, an older CRD) gives a clear error naming the field instead of a crash. KServe and
KubeAI users: `minReplicas`/`maxReplicas` are read from `spec.autoscaling` only.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

FIELD = "spec.autoscaling"


class Mode(enum.Enum):
    BUILTIN = "builtin"  # this operator scrapes the pods and patches spec.replicas
    EXTERNAL = "external"  # an HPA or KEDA ScaledObject drives the scale subresource
    NONE = "none"  # spec.replicas is left to the user


@dataclass(frozen=True)
class AutoscalingPolicy:
    mode: Mode = Mode.BUILTIN
    min_replicas: int = 1
    max_replicas: int = 1
    target_requests_waiting: float = 2.0  # per replica
    target_kv_cache_usage: float = 0.8  # per-replica mean fraction of the KV cache in use
    target_requests: float | None = None  # running requests per replica (KubeAI's habit); off
    scale_down_delay_seconds: int = 300
    tolerance: float = 0.1  # |demand/current - 1| within this band changes nothing
    interval_seconds: int = 15

    def __post_init__(self) -> None:
        if self.min_replicas < 0:
            raise ValueError(f"{FIELD}.minReplicas: must be >= 0, got {self.min_replicas}")
        if self.max_replicas < 1:
            raise ValueError(f"{FIELD}.maxReplicas: must be >= 1, got {self.max_replicas}")
        if self.min_replicas > self.max_replicas:
            raise ValueError(f"{FIELD}.minReplicas ({self.min_replicas}) must be <= "
                             f"maxReplicas ({self.max_replicas})")
        if not self.target_requests_waiting > 0:
            raise ValueError(f"{FIELD}.targetRequestsWaiting: must be > 0, "
                             f"got {self.target_requests_waiting}")
        if not 0 < self.target_kv_cache_usage <= 1:
            raise ValueError(f"{FIELD}.targetKVCacheUsage: must be in (0, 1], "
                             f"got {self.target_kv_cache_usage}")
        if self.target_requests is not None and not self.target_requests > 0:
            raise ValueError(f"{FIELD}.targetRequests: must be > 0, got {self.target_requests}")
        if self.scale_down_delay_seconds < 0:
            raise ValueError(f"{FIELD}.scaleDownDelaySeconds: must be >= 0, "
                             f"got {self.scale_down_delay_seconds}")
        if not 0 <= self.tolerance < 1:
            raise ValueError(f"{FIELD}.tolerance: must be in [0, 1), got {self.tolerance}")
        if self.interval_seconds < 1:
            raise ValueError(f"{FIELD}.intervalSeconds: must be >= 1, got {self.interval_seconds}")

    @property
    def stale_after_seconds(self) -> float:
        """A pod's last good sample is trusted for two missed scrapes; after that it is stale."""
        return 2.5 * self.interval_seconds

    def clamp(self, replicas: int) -> int:
        return max(self.min_replicas, min(self.max_replicas, replicas))

    @classmethod
    def from_spec(cls, autoscaling: Mapping[str, Any] | None) -> AutoscalingPolicy:
        """Parse `spec.autoscaling` (camelCase, as in the CRD); absent keys take the defaults."""
        raw = dict(autoscaling or {})
        mode_text = raw.get("mode", Mode.BUILTIN.value)
        try:
            mode = Mode(mode_text)
        except ValueError:
            raise ValueError(f"{FIELD}.mode: must be one of builtin|external|none, "
                             f"got {mode_text!r}") from None
        target_requests = raw.get("targetRequests")
        return cls(
            mode=mode,
            min_replicas=_int(raw, "minReplicas", 1),
            max_replicas=_int(raw, "maxReplicas", 1),
            target_requests_waiting=_number(raw, "targetRequestsWaiting", 2.0),
            target_kv_cache_usage=_number(raw, "targetKVCacheUsage", 0.8),
            target_requests=None if target_requests is None
            else _number(raw, "targetRequests", 0.0),
            scale_down_delay_seconds=_int(raw, "scaleDownDelaySeconds", 300),
            tolerance=_number(raw, "tolerance", 0.1),
            interval_seconds=_int(raw, "intervalSeconds", 15),
        )


def _int(raw: Mapping[str, Any], key: str, default: int) -> int:
    value = raw.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{FIELD}.{key}: must be an integer, got {value!r}")
    return value


def _number(raw: Mapping[str, Any], key: str, default: float) -> float:
    value = raw.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"{FIELD}.{key}: must be a finite number, got {value!r}")
    return float(value)
