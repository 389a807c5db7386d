"""CR `spec` (camelCase dict) -> `InferenceServiceSpec`, with the CRD's defaults.

Kept apart from spec.py so the dataclasses stay readable. Defaults come from spec_defaults.py
(the same values as the CRD's). Beyond types and ranges, this checks what the schema states
only as an enum or a pattern and an older CRD or an emulator may not enforce: the quantizations
and tensor-parallel sizes the engine accepts, and Kubernetes quantities for cpu, memory and the
cache's size limit, so a bad value is an InvalidSpec naming the field, not a failed apply.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from kvasir_operator.labels import HTTP_PORT
from kvasir_operator.spec import (
    Architecture,
    AutoscalingSpec,
    CacheSpec,
    CostSpec,
    DisaggregationSpec,
    DisruptionSpec,
    EngineSpec,
    FetchSpec,
    InferenceServiceSpec,
    ModelSource,
    ModelSpec,
    PodSpecExtras,
    ProbeSpec,
    ResourcesSpec,
    RoleSpec,
    SpecError,
    SpeculativeSpec,
    StartupSpec,
)
from kvasir_operator.spec_defaults import DEFAULTS, TERMINATION_GRACE_MARGIN_SECONDS

# What the engine accepts (engine/kvasir_engine/config.py QUANTIZATIONS, quantized after loading,
# then CHECKPOINT_QUANTIZATIONS, vLLM's names for a pre-quantized checkpoint's format; the
# operator does not import the engine, a test compares them and the CRD's enum).
QUANTIZATIONS = ("int8", "int4", "compressed-tensors", "gptq", "awq", "fp8")
# Tensor-parallel sizes: one rank per GPU of one node, a power of two dividing the heads.
TP_SIZES = (1, 2, 4, 8)
DTYPES = ("auto", "float32", "bfloat16", "float16")
PULL_POLICIES = ("Always", "IfNotPresent", "Never")
# Pipeline stages, one pod each: a bound far above what one model needs, so a typo is caught.
MAX_PP_SIZE = 64
# A LeaderWorkerSet's name must be a DNS-1035 label, and it prefixes its StatefulSets, pods and
# their revision-hash labels (at most 63 characters): leave room for those suffixes.
MAX_MULTI_NODE_NAME = 40
DNS_1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
SPECULATIVE_METHODS = ("ngram", "draft_model")
# The engine's connectors (engine/kvasir_engine/kv_transfer: CONNECTORS; a test compares them).
KV_CONNECTORS = ("TCPConnector", "TorchDistConnector")
PERCENT = re.compile(r"^(100|[1-9]?[0-9])%$")
# apimachinery's resource.Quantity grammar, without a sign (requests cannot be negative).
QUANTITY = re.compile(r"^(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))"
                      r"(([KMGTPE]i)|[numkMGTPE]|([eE][+-]?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$")


class _Reader:
    """Typed access to one object of the spec, with the field path for messages."""

    def __init__(self, data: Any, path: str) -> None:
        if data is None:
            data = {}
        if not isinstance(data, Mapping):
            raise SpecError(f"{path}: must be an object, got {type(data).__name__}")
        self.data, self.path = data, path
        self.defaults: Mapping[str, Any] = DEFAULTS.get(path.removeprefix("spec."), {})

    def _get(self, key: str, kinds: tuple[type, ...], what: str) -> Any:
        value = self.data.get(key)
        if value is not None and (not isinstance(value, kinds) or isinstance(value, bool)
                                  and bool not in kinds):
            raise SpecError(f"{self.path}.{key}: must be {what}, got {value!r}")
        return value

    def get_int(self, key: str, default: int | None = None, lo: int | None = None,
            hi: int | None = None) -> int | None:
        value: int | None = self._get(key, (int,), "an integer")
        value = default if value is None else value
        if value is not None and ((lo is not None and value < lo)
                                  or (hi is not None and value > hi)):
            raise SpecError(f"{self.path}.{key}: must be in [{lo}, {hi}], got {value}")
        return value

    def get_num(self, key: str, default: float | None, lo: float, hi: float | None = None,
            lo_open: bool = False) -> float | None:
        raw = self._get(key, (int, float), "a number")
        value = default if raw is None else float(raw)
        if value is not None and (value < lo or (lo_open and value == lo)
                                  or (hi is not None and value > hi)):
            low = f"({lo}" if lo_open else f"[{lo}"
            raise SpecError(f"{self.path}.{key}: must be in {low}, {hi}], got {value}")
        return value

    def get_str(self, key: str, default: str | None = None,
            choices: tuple[str, ...] | None = None) -> str | None:
        value: str | None = self._get(key, (str,), "a string")
        value = default if value is None else value
        if value is not None and choices is not None and value not in choices:
            raise SpecError(f"{self.path}.{key}: must be one of {list(choices)}, got {value!r}")
        return value

    def get_bool(self, key: str) -> bool:
        value = self._get(key, (bool,), "true or false")
        return bool(self.defaults[key]) if value is None else bool(value)

    def get_int_or_str(self, key: str) -> int | str | None:
        value: int | str | None = self._get(key, (int, str), "an integer or a quantity string")
        return value

    def _get_pattern(self, key: str, pattern: re.Pattern[str], what: str) -> int | str | None:
        value = self.get_int_or_str(key)
        if isinstance(value, int) and value < 0 or isinstance(value, str) and not pattern.match(
                value):
            raise SpecError(f"{self.path}.{key}: must be {what}, got {value!r}")
        return value

    def get_quantity(self, key: str) -> int | str | None:
        """A Kubernetes quantity: a non-negative integer or a string like 500m, 16Gi, 1e3."""
        return self._get_pattern(key, QUANTITY, "a Kubernetes quantity (e.g. 500m, 4, 16Gi)")

    def get_int_or_percent(self, key: str) -> int | str | None:
        """A PodDisruptionBudget count: a non-negative integer or a percentage like 50%."""
        return self._get_pattern(key, PERCENT, "a count or a percentage (e.g. 1, 50%)")

    def get_choice(self, key: str, choices: tuple[Any, ...]) -> Any:
        """One of `choices` (strings or integers), else the section's default, else None."""
        value = self.data.get(key)
        if value is None:
            return self.defaults.get(key)
        if value not in choices or isinstance(value, bool):
            raise SpecError(f"{self.path}.{key}: must be one of {list(choices)}, got {value!r}")
        return value

    def get_obj(self, key: str) -> _Reader:
        return _Reader(self.data.get(key), f"{self.path}.{key}")

    def get_raw(self, key: str) -> dict[str, Any]:
        return dict(self.get_obj(key).data)

    def get_str_map(self, key: str) -> dict[str, str]:
        mapping = self.get_raw(key)
        for k, v in mapping.items():
            if not isinstance(v, str):
                raise SpecError(f"{self.path}.{key}.{k}: must be a string, got {v!r}")
        return dict(sorted(mapping.items()))

    def get_list(self, key: str, item_kind: type) -> tuple[Any, ...]:
        value = self._get(key, (list,), "a list") or []
        for i, item in enumerate(value):
            if not isinstance(item, item_kind):
                raise SpecError(f"{self.path}.{key}[{i}]: must be a {item_kind.__name__}")
        return tuple(value)



def _need_int(r: _Reader, key: str, lo: int, hi: int | None = None) -> int:
    value = r.get_int(key, r.defaults[key], lo, hi)
    assert value is not None  # a default was given
    return value


def _need_num(r: _Reader, key: str, lo: float, hi: float | None = None,
              lo_open: bool = False) -> float:
    value = r.get_num(key, float(r.defaults[key]), lo, hi, lo_open)
    assert value is not None
    return value


def _need_str(r: _Reader, key: str, choices: tuple[str, ...] | None = None) -> str:
    value = r.get_str(key, r.defaults[key], choices)
    assert value is not None
    return value


def _model(r: _Reader, isvc_name: str) -> ModelSpec:
    uri = r.get_str("uri")
    if not uri:
        raise SpecError("spec.model.uri: required (s3://bucket/prefix, pvc://claim/path or /path)")
    arch = None
    if r.data.get("architecture") is not None:
        a = r.get_obj("architecture")
        layers, heads, dim = a.get_int("numLayers", lo=1), a.get_int("numKVHeads", lo=1), a.get_int(
            "headDim", lo=1)
        if layers is None or heads is None or dim is None:
            raise SpecError("spec.model.architecture: needs numLayers, numKVHeads and headDim")
        arch = Architecture(layers, heads, dim, a.get_int("numAttentionHeads", lo=1))
    return ModelSpec(source=ModelSource.parse(uri), name=r.get_str("name") or isvc_name,
                     credentials_secret=r.get_str("credentialsSecret"),
                     allow_unverified=r.get_bool("allowUnverified"),
                     size_bytes=r.get_int("sizeBytes", lo=0), architecture=arch)


def _speculative(r: _Reader) -> SpeculativeSpec:
    num = r.get_int("numSpeculativeTokens", lo=1, hi=16)
    if num is None:
        raise SpecError(f"{r.path}.numSpeculativeTokens: required")
    method = r.get_str("method", "ngram", SPECULATIVE_METHODS) or "ngram"
    model = r.get_str("model")
    if (model is not None) != (method == "draft_model"):
        raise SpecError(f"{r.path}.model: required for method draft_model and only for it")
    lookup_max, lookup_min = r.get_int("promptLookupMax", lo=1), r.get_int("promptLookupMin", lo=1)
    if lookup_max is not None and lookup_min is not None and lookup_min > lookup_max:
        raise SpecError(f"{r.path}.promptLookupMin: must be <= promptLookupMax")
    return SpeculativeSpec(num_speculative_tokens=num, method=method,
                           prompt_lookup_max=lookup_max, prompt_lookup_min=lookup_min,
                           model=model, disable_by_batch_size=r.get_int("disableByBatchSize", lo=1))


def _engine(r: _Reader) -> EngineSpec:
    return EngineSpec(
        image=_need_str(r, "image"),
        image_pull_policy=_need_str(r, "imagePullPolicy", PULL_POLICIES),
        tp_size=int(r.get_choice("tensorParallelSize", TP_SIZES)),
        pp_size=_need_int(r, "pipelineParallelSize", 1, MAX_PP_SIZE),
        max_model_len=r.get_int("maxModelLen", lo=16),
        gpu_memory_utilization=_need_num(r, "gpuMemoryUtilization", 0.0, 1.0, True),
        max_num_seqs=r.get_int("maxNumSeqs", lo=1),
        enable_prefix_caching=r.get_bool("enablePrefixCaching"),
        dtype=_need_str(r, "dtype", DTYPES),
        quantization=r.get_choice("quantization", QUANTIZATIONS),
        kv_cache_dtype=_need_str(r, "kvCacheDtype", DTYPES),
        shutdown_grace_seconds=_need_int(r, "shutdownGraceSeconds", 0, 3600),
        speculative=(_speculative(r.get_obj("speculative"))
                     if r.data.get("speculative") is not None else None),
        batch_invariant=r.get_bool("batchInvariant"),
        extra_args=r.get_list("extraArgs", str),
        env=r.get_list("env", Mapping),
    )


def _autoscaling(r: _Reader) -> AutoscalingSpec:
    return AutoscalingSpec(
        mode=_need_str(r, "mode", ("builtin", "external", "none")),
        min_replicas=_need_int(r, "minReplicas", 0),
        max_replicas=_need_int(r, "maxReplicas", 1),
        target_requests_waiting=_need_num(r, "targetRequestsWaiting", 0.0, None, True),
        target_kv_cache_usage=_need_num(r, "targetKVCacheUsage", 0.0, 1.0, True),
        target_requests=r.get_num("targetRequests", None, 0.0, None, True),
        scale_down_delay_seconds=_need_int(r, "scaleDownDelaySeconds", 0),
        tolerance=_need_num(r, "tolerance", 0.0, 1.0),
        interval_seconds=_need_int(r, "intervalSeconds", 1),
    )


def _pod(r: _Reader) -> PodSpecExtras:
    return PodSpecExtras(
        node_selector=r.get_str_map("nodeSelector"), tolerations=r.get_list("tolerations", Mapping),
        affinity=r.get_raw("affinity"), priority_class_name=r.get_str("priorityClassName"),
        service_account_name=r.get_str("serviceAccountName"),
        image_pull_secrets=r.get_list("imagePullSecrets", str),
        annotations=r.get_str_map("podAnnotations"), labels=r.get_str_map("podLabels"),
        template=r.get_raw("podTemplate"),
    )


def parse_spec(isvc_name: str, spec: Mapping[str, Any] | None) -> InferenceServiceSpec:
    """Parse and validate; raises SpecError naming the first bad field."""
    r = _Reader(spec, "spec")
    if "model" not in r.data:
        raise SpecError("spec.model: required (at least spec.model.uri)")
    engine = _engine(r.get_obj("engine"))
    if engine.pp_size > 1:
        _check_multi_node_name(isvc_name)
    res = r.get_obj("resources")
    cache, fetch = r.get_obj("cache"), r.get_obj("fetch")
    startup, drain, pdb = r.get_obj("startup"), r.get_obj("drain"), r.get_obj("disruptionBudget")
    readiness, service = r.get_obj("readiness"), r.get_obj("service")
    if pdb.data.get("minAvailable") is not None and pdb.data.get("maxUnavailable") is not None:
        raise SpecError("spec.disruptionBudget: set at most one of minAvailable, maxUnavailable")
    pre_stop = _need_int(drain, "preStopSeconds", 0, 600)
    grace = drain.get_int("terminationGracePeriodSeconds", lo=1)
    return InferenceServiceSpec(
        model=_model(r.get_obj("model"), isvc_name),
        engine=engine,
        resources=ResourcesSpec(
            num_gpus=res.get_int("gpus", engine.tp_size, 0, 64) or 0,
            gpu_resource_name=_need_str(res, "gpuResourceName"),
            gpu_type=res.get_str("gpuType"), gpu_memory_bytes=res.get_int("gpuMemoryBytes", lo=1),
            cpu=res.get_quantity("cpu"), memory=res.get_quantity("memory")),
        cache=CacheSpec(
            type=_need_str(cache, "type", ("hostPath", "emptyDir", "pvc")),
            path=cache.get_str("path"), claim_name=cache.get_str("claimName"),
            size_limit=cache.get_quantity("sizeLimit")),
        fetch=FetchSpec(
            image=_need_str(fetch, "image"),
            endpoint_url=fetch.get_str("endpointUrl"), region=fetch.get_str("region"),
            addressing_style=_need_str(fetch, "addressingStyle", ("auto", "path", "virtual")),
            concurrency=fetch.get_int("concurrency", lo=1, hi=256),
            part_size_bytes=fetch.get_int("partSizeBytes", lo=1 << 20),
            stall_timeout_seconds=fetch.get_int("stallTimeoutSeconds", lo=1),
            retries=fetch.get_int("retries", lo=0, hi=100)),
        autoscaling=_autoscaling(r.get_obj("autoscaling")),
        readiness=ProbeSpec(
            period_seconds=_need_int(readiness, "periodSeconds", 1),
            timeout_seconds=_need_int(readiness, "timeoutSeconds", 1),
            failure_threshold=_need_int(readiness, "failureThreshold", 1)),
        startup=StartupSpec(
            timeout_seconds=startup.get_int("timeoutSeconds", lo=10),
            load_bytes_per_second=_need_int(startup, "loadBytesPerSecond", 1),
            overhead_seconds=_need_int(startup, "overheadSeconds", 0)),
        pre_stop_seconds=pre_stop,
        termination_grace_seconds=(grace if grace is not None else pre_stop
                                   + engine.shutdown_grace_seconds
                                   + TERMINATION_GRACE_MARGIN_SECONDS),
        disruption=DisruptionSpec(
            enabled=pdb.get_bool("enabled"), min_available=pdb.get_int_or_percent("minAvailable"),
            max_unavailable=pdb.get_int_or_percent("maxUnavailable")),
        service_type=_need_str(service, "type", ("ClusterIP", "NodePort", "LoadBalancer")),
        service_port=_need_int(service, "port", 1, 65535),
        pod=_pod(r),
        replicas=r.get_int("replicas", lo=0),
        cost=_cost(r.get_obj("cost")),
        disaggregation=_disaggregation(r.get_obj("disaggregation")),
    )


def _role(r: _Reader) -> RoleSpec:
    res = r.get_obj("resources")
    role = RoleSpec(
        min_replicas=_need_int(r, "minReplicas", 0), max_replicas=_need_int(r, "maxReplicas", 1),
        replicas=r.get_int("replicas", lo=0),
        tp_size=r.get_choice("tensorParallelSize", TP_SIZES),
        num_gpus=res.get_int("gpus", None, 0, 64), cpu=res.get_quantity("cpu"),
        memory=res.get_quantity("memory"), max_num_seqs=r.get_int("maxNumSeqs", lo=1),
        target_requests_waiting=r.get_num("targetRequestsWaiting", None, 0.0, None, True),
        target_kv_cache_usage=r.get_num("targetKVCacheUsage", None, 0.0, 1.0, True),
        target_requests=r.get_num("targetRequests", None, 0.0, None, True),
        target_time_to_first_token_seconds=r.get_num("targetTimeToFirstTokenSeconds", None, 0.0,
                                                     None, True),
        extra_args=r.get_list("extraArgs", str))
    if role.min_replicas > role.max_replicas:
        raise SpecError(f"{r.path}.minReplicas ({role.min_replicas}) must be <= "
                        f"{r.path}.maxReplicas ({role.max_replicas})")
    return role


def _disaggregation(r: _Reader) -> DisaggregationSpec | None:
    """None unless `enabled`: a disabled section changes nothing (and is not validated
    further than its types)."""
    if not r.get_bool("enabled"):
        return None
    kv_port = _need_int(r, "kvPort", 1024, 65535)
    if kv_port == HTTP_PORT:
        raise SpecError(f"{r.path}.kvPort: must differ from the engine's HTTP port {HTTP_PORT}")
    return DisaggregationSpec(
        prefill=_role(r.get_obj("prefill")), decode=_role(r.get_obj("decode")),
        connector=_need_str(r, "connector", KV_CONNECTORS),
        kv_port=kv_port,
        hold_timeout_seconds=r.get_num("holdTimeoutSeconds", None, 0.0, None, True),
        transfer_timeout_seconds=r.get_num("transferTimeoutSeconds", None, 0.0, None, True),
        kv_buffer_size_bytes=r.get_int("kvBufferSizeBytes", lo=1))


def _check_multi_node_name(isvc_name: str) -> None:
    if not DNS_1035.match(isvc_name) or len(isvc_name) > MAX_MULTI_NODE_NAME:
        raise SpecError(
            f"metadata.name: {isvc_name!r} must be a DNS-1035 label (lower case letters, digits, "
            f"'-'; starting with a letter) of at most {MAX_MULTI_NODE_NAME} characters when "
            f"spec.engine.pipelineParallelSize > 1: the LeaderWorkerSet is named after it")


def _cost(c: _Reader) -> CostSpec:
    return CostSpec(per_hour=c.get_num("perHour", None, 0.0),
                    currency=_need_str(c, "currency"),
                    full_load_tokens_per_second=c.get_num("fullLoadTokensPerSecond", None, 0.0,
                                                          lo_open=True))
