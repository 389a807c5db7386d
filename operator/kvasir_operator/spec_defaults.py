"""The one table of the InferenceService spec's defaults, by CRD path.

The CRD (crds/inferenceservices.kvasir.dev.yaml) declares the same values as `default:` in its
schema, so the API server fills them in; the parser (spec_parse.py) and the dataclasses
(spec.py) take theirs from here, for servers that skipped defaulting (an old CRD, an emulator).
A test walks the CRD's schema and checks every `default:` against this table, and back.
Only leaf values are listed: the CRD's `default: {}` on objects just makes their children apply.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

ENGINE_IMAGE = "ghcr.io/kvasir-ai/kvasir-engine:0.1.0"
FETCH_IMAGE = "ghcr.io/kvasir-ai/kvasir-operator:0.1.0"

MODEL_DEFAULTS: Mapping[str, Any] = {"allowUnverified": False}
ENGINE_DEFAULTS: Mapping[str, Any] = {
    "image": ENGINE_IMAGE, "imagePullPolicy": "IfNotPresent", "tensorParallelSize": 1,
    "pipelineParallelSize": 1,
    "gpuMemoryUtilization": 0.9, "enablePrefixCaching": True, "dtype": "auto",
    "kvCacheDtype": "auto", "shutdownGraceSeconds": 30, "batchInvariant": False,
}
RESOURCES_DEFAULTS: Mapping[str, Any] = {"gpuResourceName": "nvidia.com/gpu"}
CACHE_DEFAULTS: Mapping[str, Any] = {"type": "emptyDir"}
FETCH_DEFAULTS: Mapping[str, Any] = {"image": FETCH_IMAGE, "addressingStyle": "auto"}
AUTOSCALING_DEFAULTS: Mapping[str, Any] = {
    "mode": "builtin", "minReplicas": 1, "maxReplicas": 1, "targetRequestsWaiting": 2,
    "targetKVCacheUsage": 0.8, "scaleDownDelaySeconds": 300, "tolerance": 0.1,
    "intervalSeconds": 15,
}
READINESS_DEFAULTS: Mapping[str, Any] = {"periodSeconds": 10, "timeoutSeconds": 5,
                                         "failureThreshold": 3}
STARTUP_DEFAULTS: Mapping[str, Any] = {"loadBytesPerSecond": 1_000_000_000, "overheadSeconds": 120}
DRAIN_DEFAULTS: Mapping[str, Any] = {"preStopSeconds": 10}
DISRUPTION_DEFAULTS: Mapping[str, Any] = {"enabled": True}
SERVICE_DEFAULTS: Mapping[str, Any] = {"type": "ClusterIP", "port": 80}
COST_DEFAULTS: Mapping[str, Any] = {"currency": "USD"}
# The engine's TCP block stream (docs/disaggregation.md) and vLLM's default kv_port.
DISAGGREGATION_DEFAULTS: Mapping[str, Any] = {"enabled": False, "connector": "TCPConnector",
                                              "kvPort": 14579}
DISAGGREGATION_ROLE_DEFAULTS: Mapping[str, Any] = {"minReplicas": 1, "maxReplicas": 1}

# spec.<section> -> its defaults; the CRD test compares this with the schema.
DEFAULTS: Mapping[str, Mapping[str, Any]] = {
    "model": MODEL_DEFAULTS, "engine": ENGINE_DEFAULTS, "resources": RESOURCES_DEFAULTS,
    "cache": CACHE_DEFAULTS, "fetch": FETCH_DEFAULTS, "autoscaling": AUTOSCALING_DEFAULTS,
    "readiness": READINESS_DEFAULTS, "startup": STARTUP_DEFAULTS, "drain": DRAIN_DEFAULTS,
    "disruptionBudget": DISRUPTION_DEFAULTS, "service": SERVICE_DEFAULTS, "cost": COST_DEFAULTS,
    "disaggregation": DISAGGREGATION_DEFAULTS,
    "disaggregation.prefill": DISAGGREGATION_ROLE_DEFAULTS,
    "disaggregation.decode": DISAGGREGATION_ROLE_DEFAULTS,
}

# Not in the CRD as `default:` because they depend on other fields:
# resources.gpus = engine.tensorParallelSize; model.name = the InferenceService's name;
# drain.terminationGracePeriodSeconds = preStopSeconds + engine.shutdownGraceSeconds + this.
TERMINATION_GRACE_MARGIN_SECONDS = 10
