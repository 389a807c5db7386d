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

from kvasir_operator.fetch.uri import LOCAL, PVC, S3, ModelUriError, parse_model_uri
from kvasir_operator.labels import HTTP_PORT
from kvasir_operator.spec_defaults import (
    AUTOSCALING_DEFAULTS,
    CACHE_DEFAULTS,
    COST_DEFAULTS,
    DISAGGREGATION_DEFAULTS,
    DISAGGREGATION_ROLE_DEFAULTS,
    DISRUPTION_DEFAULTS,
    ENGINE_DEFAULTS,
    FETCH_DEFAULTS,
    READINESS_DEFAULTS,
    RESOURCES_DEFAULTS,
    STARTUP_DEFAULTS,
)

# Quantizations (spec.engine.quantization) a GPU engine may run: names of a pre-quantized
# checkpoint's format that can be FP8, which GPUs multiply (or dequantize); int8, int4, gptq and
# awq run on the engine's CPU tiles only. Whether a compressed-tensors checkpoint is FP8 or an
# integer scheme is read from its config.json by the capacity check (modelconfig.py).
GPU_QUANTIZATIONS = ("compressed-tensors", "fp8")
# Quantizations the engine applies to unquantized weights as it loads them (the others name a
# pre-quantized checkpoint's format).
LOAD_QUANTIZATIONS = ("int8", "int4")


class SpecError(kopf.PermanentError):
    """A spec that cannot work; the message names the field."""


@dataclass(frozen=True)
class CheckpointQuantization:
    """What a pre-quantized checkpoint's config.json says its weights are (modelconfig.py)."""

    method: str  # quant_method: "compressed-tensors" | "gptq" | "awq" | another the engine refuses
    weight_type: str  # "int" (the engine's CPU tiles) | "float" (FP8: GPUs too)
    bits: int  # bits a weight on disk

    def describe(self) -> str:
        return f"{self.method} {'FP' if self.weight_type == 'float' else 'INT'}{self.bits}"


@dataclass(frozen=True)
class Architecture:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    num_heads: int | None = None  # query heads; None when the spec gave no numAttentionHeads
    # From config.json's quantization_config; None: unquantized, or the spec gave the shape.
    quantization: CheckpointQuantization | None = None

    def tensor_parallel_error(self, tp_size: int) -> str | None:
        """Why tensorParallelSize cannot shard this model, as the engine would refuse it (it
        splits the query heads evenly, and the KV heads evenly or, at or beyond their number,
        one replicated per group of ranks)."""
        where = "spec.engine.tensorParallelSize"
        if self.num_heads is not None and self.num_heads % tp_size:
            return f"{where} ({tp_size}) must divide the model's {self.num_heads} attention heads"
        kv = self.num_kv_heads
        if (kv % tp_size if tp_size < kv else tp_size % kv):
            return (f"{where} ({tp_size}) must divide the model's {kv} KV heads, or be a "
                    f"multiple of them")
        return None


@dataclass(frozen=True)
class ModelSource:
    """`spec.model.uri`, parsed once: where the weights come from."""

    kind: str  # S3, PVC or LOCAL (fetch/uri.py)
    uri: str
    claim: str | None = None  # pvc: the PersistentVolumeClaim's name
    path: str = ""  # pvc: the path inside the claim; local: the absolute path in the image

    @property
    def is_local(self) -> bool:
        """Baked into the engine image: no fetch initContainer, no cache volume."""
        return self.kind == LOCAL

    @property
    def is_pvc(self) -> bool:
        return self.kind == PVC

    @property
    def is_s3(self) -> bool:
        return self.kind == S3

    @classmethod
    def parse(cls, uri: str) -> ModelSource:
        """The fetcher's parser (fetch/uri.py), and a local path must be absolute: it is one
        inside the engine image."""
        unknown = f"spec.model.uri: must start with s3://, pvc:// or /, got {uri!r}"
        try:
            parsed = parse_model_uri(uri)
        except ModelUriError as exc:
            raise SpecError(unknown if exc.is_unknown_scheme
                            else f"spec.model.uri: {exc.reason}, got {uri!r}") from None
        if parsed.kind == PVC:
            return cls(PVC, uri, claim=parsed.authority, path=parsed.path.strip("/"))
        if parsed.kind == LOCAL:
            if not uri.startswith("/"):
                raise SpecError(unknown)
            return cls(LOCAL, uri, path=uri)
        return cls(S3, uri)


@dataclass(frozen=True)
class ModelSpec:
    source: ModelSource
    name: str
    credentials_secret: str | None = None
    allow_unverified: bool = False
    size_bytes: int | None = None
    architecture: Architecture | None = None

    @property
    def uri(self) -> str:
        return self.source.uri


@dataclass(frozen=True)
class SpeculativeSpec:
    """spec.engine.speculative: the engine's --speculative-config, in vLLM's keys."""

    num_speculative_tokens: int
    method: str = "ngram"
    prompt_lookup_max: int | None = None
    prompt_lookup_min: int | None = None
    model: str | None = None
    disable_by_batch_size: int | None = None

    def as_flag_json(self) -> str:
        """The flag's JSON: set keys only, sorted, so the rendered pod is deterministic."""
        values = {"method": self.method, "num_speculative_tokens": self.num_speculative_tokens,
                  "prompt_lookup_max": self.prompt_lookup_max,
                  "prompt_lookup_min": self.prompt_lookup_min, "model": self.model,
                  "disable_by_batch_size": self.disable_by_batch_size}
        return json.dumps({k: v for k, v in values.items() if v is not None}, sort_keys=True)


@dataclass(frozen=True)
class EngineSpec:
    image: str = ENGINE_DEFAULTS["image"]
    image_pull_policy: str = ENGINE_DEFAULTS["imagePullPolicy"]
    tp_size: int = ENGINE_DEFAULTS["tensorParallelSize"]
    pp_size: int = ENGINE_DEFAULTS["pipelineParallelSize"]  # pipeline stages, one pod each
    max_model_len: int | None = None
    gpu_memory_utilization: float = ENGINE_DEFAULTS["gpuMemoryUtilization"]
    max_num_seqs: int | None = None
    enable_prefix_caching: bool = ENGINE_DEFAULTS["enablePrefixCaching"]
    dtype: str = ENGINE_DEFAULTS["dtype"]
    quantization: str | None = None
    kv_cache_dtype: str = ENGINE_DEFAULTS["kvCacheDtype"]
    shutdown_grace_seconds: int = ENGINE_DEFAULTS["shutdownGraceSeconds"]
    speculative: SpeculativeSpec | None = None
    batch_invariant: bool = ENGINE_DEFAULTS["batchInvariant"]  # --batch-invariant
    extra_args: tuple[str, ...] = ()
    env: tuple[Mapping[str, Any], ...] = ()
    # The engine's --kv-transfer-config, vLLM's keys: set only on a disaggregated role's spec
    # (disaggregation.role_spec), never parsed from the CR.
    kv_transfer: Mapping[str, Any] | None = None


@dataclass(frozen=True)
class ResourcesSpec:
    num_gpus: int
    gpu_resource_name: str = RESOURCES_DEFAULTS["gpuResourceName"]
    gpu_type: str | None = None
    gpu_memory_bytes: int | None = None
    cpu: int | str | None = None
    memory: int | str | None = None


@dataclass(frozen=True)
class CacheSpec:
    type: str = CACHE_DEFAULTS["type"]
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
    image: str = FETCH_DEFAULTS["image"]
    endpoint_url: str | None = None
    region: str | None = None
    addressing_style: str = FETCH_DEFAULTS["addressingStyle"]
    concurrency: int | None = None
    part_size_bytes: int | None = None
    stall_timeout_seconds: int | None = None
    retries: int | None = None


@dataclass(frozen=True)
class AutoscalingSpec:
    mode: str = AUTOSCALING_DEFAULTS["mode"]
    min_replicas: int = AUTOSCALING_DEFAULTS["minReplicas"]
    max_replicas: int = AUTOSCALING_DEFAULTS["maxReplicas"]
    target_requests_waiting: float = AUTOSCALING_DEFAULTS["targetRequestsWaiting"]
    target_kv_cache_usage: float = AUTOSCALING_DEFAULTS["targetKVCacheUsage"]
    target_requests: float | None = None
    scale_down_delay_seconds: int = AUTOSCALING_DEFAULTS["scaleDownDelaySeconds"]
    tolerance: float = AUTOSCALING_DEFAULTS["tolerance"]
    interval_seconds: int = AUTOSCALING_DEFAULTS["intervalSeconds"]
    # A disaggregated role ("prefill" | "decode"), which picks the signals it scales on
    # (autoscale/decision.py); None: the whole service.
    role: str | None = None
    # A prefill role's target mean time to first token, seconds (None: not a signal).
    target_time_to_first_token_seconds: float | None = None
    path: str = "spec.autoscaling"  # where min/max come from, for the message

    def __post_init__(self) -> None:
        if self.min_replicas > self.max_replicas:
            raise SpecError(f"{self.path}.minReplicas ({self.min_replicas}) must be <= "
                            f"{self.path}.maxReplicas ({self.max_replicas})")


@dataclass(frozen=True)
class ProbeSpec:
    period_seconds: int = READINESS_DEFAULTS["periodSeconds"]
    timeout_seconds: int = READINESS_DEFAULTS["timeoutSeconds"]
    failure_threshold: int = READINESS_DEFAULTS["failureThreshold"]


@dataclass(frozen=True)
class StartupSpec:
    timeout_seconds: int | None = None
    load_bytes_per_second: int = STARTUP_DEFAULTS["loadBytesPerSecond"]
    overhead_seconds: int = STARTUP_DEFAULTS["overheadSeconds"]


@dataclass(frozen=True)
class DisruptionSpec:
    enabled: bool = DISRUPTION_DEFAULTS["enabled"]
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
class CostSpec:
    """What one replica costs; read by the gateway's cost per million tokens (routing file
    `pools.NAME.cost_per_hour`), shown by `kubectl get kisvc -o wide`; never rolls pods."""
    per_hour: float | None = None  # one replica's hardware, per hour, in `currency`
    currency: str = COST_DEFAULTS["currency"]
    full_load_tokens_per_second: float | None = None  # one replica's measured capacity


@dataclass(frozen=True)
class RoleSpec:
    """spec.disaggregation.prefill or .decode: one role's pool; None falls back to the
    service-wide value (resources, engine, autoscaling targets)."""

    min_replicas: int = DISAGGREGATION_ROLE_DEFAULTS["minReplicas"]
    max_replicas: int = DISAGGREGATION_ROLE_DEFAULTS["maxReplicas"]
    replicas: int | None = None  # as spec.replicas: set by hand or by the builtin autoscaler
    tp_size: int | None = None
    num_gpus: int | None = None
    cpu: int | str | None = None
    memory: int | str | None = None
    max_num_seqs: int | None = None
    target_requests_waiting: float | None = None
    target_kv_cache_usage: float | None = None
    target_requests: float | None = None
    target_time_to_first_token_seconds: float | None = None  # prefill only
    extra_args: tuple[str, ...] = ()  # after the service-wide engine.extraArgs


@dataclass(frozen=True)
class DisaggregationSpec:
    """spec.disaggregation: a prefill pool (kv_producer) and a decode pool (kv_consumer),
    one Deployment each, behind the one Service (docs/operator.md)."""

    prefill: RoleSpec
    decode: RoleSpec
    connector: str = DISAGGREGATION_DEFAULTS["connector"]
    kv_port: int = DISAGGREGATION_DEFAULTS["kvPort"]
    hold_timeout_seconds: float | None = None  # kv_connector_extra_config.hold_timeout_s
    transfer_timeout_seconds: float | None = None  # kv_connector_extra_config.transfer_timeout_s
    kv_buffer_size_bytes: int | None = None  # the consumer's kv_buffer_size

    def role(self, name: str) -> RoleSpec:
        return self.prefill if name == "prefill" else self.decode


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
    cost: CostSpec = CostSpec()
    disaggregation: DisaggregationSpec | None = None  # None: one pool (disabled)

    def __post_init__(self) -> None:
        quantization = self.engine.quantization
        if quantization in GPU_QUANTIZATIONS:
            quantization = None
        if quantization is not None and self.resources.num_gpus > 0:
            raise SpecError(f"spec.engine.quantization ({quantization}) runs on CPU engines "
                            f"only (its kernels are CPU ones), but spec.resources.gpus is "
                            f"{self.resources.num_gpus}: omit it on GPUs")
        if quantization is not None and self.engine.tp_size * self.engine.pp_size > 1:
            raise SpecError(f"spec.engine.quantization ({quantization}) runs in one CPU "
                            f"process: tensorParallelSize and pipelineParallelSize must be 1")
        if self.resources.num_gpus % self.engine.tp_size:
            raise SpecError(f"spec.resources.gpus ({self.resources.num_gpus}) must be a multiple "
                            f"of spec.engine.tensorParallelSize ({self.engine.tp_size})")
        if self.engine.batch_invariant:
            self._check_batch_invariant()
        if self.disaggregation is not None:
            self._check_disaggregation(self.disaggregation)
        drain = self.pre_stop_seconds + self.engine.shutdown_grace_seconds
        if self.termination_grace_seconds < drain:
            raise SpecError(f"spec.drain.terminationGracePeriodSeconds "
                            f"({self.termination_grace_seconds}) must be >= preStopSeconds + "
                            f"engine.shutdownGraceSeconds ({drain})")

    def _check_batch_invariant(self) -> None:
        """What the engine refuses with --batch-invariant (docs/batch_invariance.md): a GPU,
        several processes, a pre-quantized checkpoint, a draft model. int8/int4 (quantized at
        load) and n-gram speculation it takes; int8/int4 only where its native kernels run,
        which the engine checks at start (one line naming the host's missing kernels)."""
        e, gpus = self.engine, [self.resources.num_gpus]
        if self.disaggregation is not None:
            gpus += [role.num_gpus for role in (self.disaggregation.prefill,
                                                self.disaggregation.decode)
                     if role.num_gpus is not None]
        speculative = e.speculative.method if e.speculative is not None else None
        conflicts = [f"{field} {value}" for field, value, bad in (
            ("spec.engine.quantization", e.quantization,
             e.quantization is not None and e.quantization not in LOAD_QUANTIZATIONS),
            ("spec.engine.speculative.method", speculative, speculative == "draft_model"),
            ("spec.engine.tensorParallelSize", e.tp_size, e.tp_size > 1),
            ("spec.engine.pipelineParallelSize", e.pp_size, e.pp_size > 1),
            ("spec.resources.gpus", max(gpus), max(gpus) > 0)) if bad]
        if conflicts:
            raise SpecError(f"spec.engine.batchInvariant runs on CPU engines of one process, "
                            f"without a pre-quantized checkpoint or a draft model, but: "
                            f"{', '.join(conflicts)}")

    def _check_disaggregation(self, d: DisaggregationSpec) -> None:
        """What the engine refuses with --kv-transfer-config (pipeline parallelism; a pair of
        unequal tensor-parallel layouts, which its handshake refuses; a producer rank's port
        kvPort + rank beyond 65535 or on the HTTP port), and a pool that cannot serve."""
        if self.engine.pp_size > 1:
            raise SpecError(f"spec.disaggregation.enabled with spec.engine.pipelineParallelSize "
                            f"{self.engine.pp_size}: the engine refuses KV transfer with "
                            f"pipeline parallelism; set it to 1 or disable disaggregation")
        tp_of = {}
        for name in ("prefill", "decode"):
            role = d.role(name)
            tp = tp_of[name] = self.engine.tp_size if role.tp_size is None else role.tp_size
            gpus = self.resources.num_gpus if role.num_gpus is None else role.num_gpus
            if gpus % tp:
                raise SpecError(f"spec.disaggregation.{name}.resources.gpus ({gpus}) must be a "
                                f"multiple of its tensorParallelSize ({tp})")
        if tp_of["prefill"] != tp_of["decode"]:
            raise SpecError(f"spec.disaggregation.prefill.tensorParallelSize ({tp_of['prefill']})"
                            f" and spec.disaggregation.decode.tensorParallelSize "
                            f"({tp_of['decode']}) (each defaults to spec.engine."
                            f"tensorParallelSize) differ: each rank moves its own KV shard, so "
                            f"the engines refuse a transfer between unequal layouts")
        last_port = d.kv_port + tp_of["prefill"] - 1
        if last_port > 65535 or d.kv_port <= HTTP_PORT <= last_port:
            raise SpecError(f"spec.disaggregation.kvPort ({d.kv_port}): the prefill engine's "
                            f"tensor-parallel rank r serves on kvPort + r, up to {last_port}, "
                            f"which must be <= 65535 and not the engine's HTTP port {HTTP_PORT}")
        # Counts set by hand (the builtin autoscaler keeps decode at 1 or more while prefill
        # runs: disaggregation.role_spec).
        if (self.autoscaling.mode != "builtin" and d.decode.replicas == 0
                and (d.prefill.replicas or 0) > 0):
            raise SpecError(f"spec.disaggregation.decode.replicas is 0 while "
                            f"spec.disaggregation.prefill.replicas is not (autoscaling.mode "
                            f"{self.autoscaling.mode}): every answer is decoded by the decode "
                            f"role, and prefill alone cannot serve")

    @property
    def num_nodes(self) -> int:
        """Pods per replica: one per pipeline stage, each with `resources.gpus` for its TP ranks
        (the engine's --nnodes). More than one: the replica is a LeaderWorkerSet group."""
        return self.engine.pp_size

    @property
    def is_multi_node(self) -> bool:
        return self.num_nodes > 1

    @property
    def desired_replicas(self) -> int:
        """The Deployment's replicas, or the LeaderWorkerSet's groups (see the contract on
        spec.replicas and autoscaling)."""
        a = self.autoscaling
        if a.mode == "builtin":
            want = a.min_replicas if self.replicas is None else self.replicas
            return max(a.min_replicas, min(a.max_replicas, want))
        return 1 if self.replicas is None else self.replicas


def spec_hash(spec: InferenceServiceSpec) -> str:
    """Hash of everything that shapes the pods: replicas and autoscaling excluded."""
    shape = asdict(spec)
    for key in ("replicas", "autoscaling", "disruption", "cost"):
        shape.pop(key)
    if shape["disaggregation"] is None:
        del shape["disaggregation"]
    else:  # a role's scale and targets never roll its pods either
        for role in ("prefill", "decode"):
            for key in ("replicas", "min_replicas", "max_replicas", "target_requests_waiting",
                        "target_kv_cache_usage", "target_requests",
                        "target_time_to_first_token_seconds"):
                del shape["disaggregation"][role][key]
    if shape["engine"]["kv_transfer"] is None:
        del shape["engine"]["kv_transfer"]
    # The model as its URI, as before ModelSource: an operator upgrade does not roll pods.
    shape["model"]["uri"] = shape["model"].pop("source")["uri"]
    # Fields added since, while unset, leave the hash as it was (no rollout on upgrade).
    if shape["engine"]["pp_size"] == 1:
        del shape["engine"]["pp_size"]
    if shape["engine"]["speculative"] is None:
        del shape["engine"]["speculative"]
    if not shape["engine"]["batch_invariant"]:
        del shape["engine"]["batch_invariant"]
    text = json.dumps(shape, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]
