"""The InferenceService spec, parsed once into frozen dataclasses and validated.

The CRD schema (crds/) already rejects most bad input at admission; this module repeats the
checks because the operator must also be safe against servers that skipped validation (an old
CRD, an emulator) and because the cross-field rules give a better message here. Every error is a
`SpecError` (a `kopf.PermanentError`: retrying cannot fix a spec) naming the field.

`spec_hash` covers what shapes the pods, and excludes replicas and autoscaling, so scaling never
rolls pods.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

import kopf

DEFAULT_ENGINE_IMAGE = "ghcr.io/kvasir-ai/kvasir-engine:0.1.0"
DEFAULT_FETCH_IMAGE = "ghcr.io/kvasir-ai/kvasir-operator:0.1.0"
URI_SCHEMES = ("s3://", "pvc://", "/")


class SpecError(kopf.PermanentError):
    """A spec that cannot work; the message names the field."""


@dataclass(frozen=True)
class Architecture:
    num_layers: int
    num_kv_heads: int
    head_dim: int


@dataclass(frozen=True)
class ModelSpec:
    uri: str
    name: str
    credentials_secret: str | None = None
    allow_unverified: bool = False
    size_bytes: int | None = None
    architecture: Architecture | None = None

    def __post_init__(self) -> None:
        if not self.uri.startswith(URI_SCHEMES):
            raise SpecError(f"spec.model.uri: must start with s3://, pvc:// or /, got {self.uri!r}")
        if self.uri.startswith("pvc://") and not self.uri[6:].split("/")[0]:
            raise SpecError(f"spec.model.uri: pvc:// needs a claim name, got {self.uri!r}")


@dataclass(frozen=True)
class EngineSpec:
    image: str = DEFAULT_ENGINE_IMAGE
    image_pull_policy: str = "IfNotPresent"
    tp_size: int = 1
    max_model_len: int | None = None
    gpu_memory_utilization: float = 0.9
    max_num_seqs: int | None = None
    enable_prefix_caching: bool = True
    dtype: str = "auto"
    quantization: str | None = None
    kv_cache_dtype: str = "auto"
    shutdown_grace_seconds: int = 30
    extra_args: tuple[str, ...] = ()
    env: tuple[Mapping[str, Any], ...] = ()


@dataclass(frozen=True)
class ResourcesSpec:
    num_gpus: int
    gpu_resource_name: str = "nvidia.com/gpu"
    gpu_type: str | None = None
    gpu_memory_bytes: int | None = None
    cpu: int | str | None = None
    memory: int | str | None = None


@dataclass(frozen=True)
class CacheSpec:
    type: str = "emptyDir"
    path: str | None = None
    claim_name: str | None = None
    size_limit: int | str | None = None

    def __post_init__(self) -> None:
        if self.type == "hostPath" and not self.path:
            raise SpecError("spec.cache.path: required when spec.cache.type is hostPath")
        if self.type == "pvc" and not self.claim_name:
            raise SpecError("spec.cache.claimName: required when spec.cache.type is pvc")


@dataclass(frozen=True)
class FetchSpec:
    image: str = DEFAULT_FETCH_IMAGE
    endpoint_url: str | None = None
    region: str | None = None
    addressing_style: str = "auto"
    concurrency: int | None = None
    part_size_bytes: int | None = None
    stall_timeout_seconds: int | None = None
    retries: int | None = None


@dataclass(frozen=True)
class AutoscalingSpec:
    mode: str = "builtin"
    min_replicas: int = 1
    max_replicas: int = 1
    target_requests_waiting: float = 2.0
    target_kv_cache_usage: float = 0.8
    target_requests: float | None = None
    scale_down_delay_seconds: int = 300
    tolerance: float = 0.1
    interval_seconds: int = 15

    def __post_init__(self) -> None:
        if self.min_replicas > self.max_replicas:
            raise SpecError(f"spec.autoscaling.minReplicas ({self.min_replicas}) must be <= "
                            f"spec.autoscaling.maxReplicas ({self.max_replicas})")


@dataclass(frozen=True)
class ProbeSpec:
    period_seconds: int = 10
    timeout_seconds: int = 5
    failure_threshold: int = 3


@dataclass(frozen=True)
class StartupSpec:
    timeout_seconds: int | None = None
    load_bytes_per_second: int = 1_000_000_000
    overhead_seconds: int = 120


@dataclass(frozen=True)
class DisruptionSpec:
    enabled: bool = True
    min_available: int | str | None = None
    max_unavailable: int | str | None = None


@dataclass(frozen=True)
class PodSpecExtras:
    node_selector: Mapping[str, str] = field(default_factory=dict)
    tolerations: tuple[Mapping[str, Any], ...] = ()
    affinity: Mapping[str, Any] = field(default_factory=dict)
    priority_class_name: str | None = None
    service_account_name: str | None = None
    image_pull_secrets: tuple[str, ...] = ()
    annotations: Mapping[str, str] = field(default_factory=dict)
    labels: Mapping[str, str] = field(default_factory=dict)
    template: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class InferenceServiceSpec:
    model: ModelSpec
    engine: EngineSpec
    resources: ResourcesSpec
    cache: CacheSpec
    fetch: FetchSpec
    autoscaling: AutoscalingSpec
    readiness: ProbeSpec
    startup: StartupSpec
    pre_stop_seconds: int
    termination_grace_seconds: int
    disruption: DisruptionSpec
    service_type: str
    service_port: int
    pod: PodSpecExtras
    replicas: int | None = None

    def __post_init__(self) -> None:
        if self.resources.num_gpus % self.engine.tp_size:
            raise SpecError(f"spec.resources.gpus ({self.resources.num_gpus}) must be a multiple "
                            f"of spec.engine.tensorParallelSize ({self.engine.tp_size})")
        drain = self.pre_stop_seconds + self.engine.shutdown_grace_seconds
        if self.termination_grace_seconds < drain:
            raise SpecError(f"spec.drain.terminationGracePeriodSeconds "
                            f"({self.termination_grace_seconds}) must be >= preStopSeconds + "
                            f"engine.shutdownGraceSeconds ({drain})")

    @property
    def desired_replicas(self) -> int:
        """The Deployment's replicas (see the contract on spec.replicas and autoscaling)."""
        a = self.autoscaling
        if a.mode == "builtin":
            want = a.min_replicas if self.replicas is None else self.replicas
            return max(a.min_replicas, min(a.max_replicas, want))
        return 1 if self.replicas is None else self.replicas


def spec_hash(spec: InferenceServiceSpec) -> str:
    """Hash of everything that shapes the pods: replicas and autoscaling excluded."""
    shape = asdict(spec)
    for key in ("replicas", "autoscaling", "disruption"):
        shape.pop(key)
    text = json.dumps(shape, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]
