"""Disaggregated prefill and decode: one InferenceService, two pools (issue 33).

`spec.disaggregation` (enabled) turns the one Deployment into one per role, `NAME-prefill` and
`NAME-decode`, both behind the one Service (the gateway learns each replica's role by probing
its engine). Each role is rendered by the ordinary renderers from a *role spec*: the service's
spec with the role's resources, tensor parallelism, replica bounds, autoscaling targets and
extra arguments put in place of the service-wide ones, and the engine's `--kv-transfer-config`
(vLLM's JSON, docs/disaggregation.md) set:

- prefill, `kv_producer`: its block server binds and advertises the pod's own address,
  `kv_ip: "$(POD_IP)"`, which the kubelet expands from the `POD_IP` variable (downward API,
  `status.podIP`) in the engine container; `kv_port` is declared as the container port
  `kv-transfer` (and `kv_port + r`, tensor-parallel rank r's, as `kv-transfer-r`). Consumers
  reach it by that address (it is in each answer's
  `kv_transfer_params`), not through the Service.
- decode, `kv_consumer`: pulls the blocks, then decodes.

Pure: no I/O; the reconcile renders the role Deployments from `role_spec`, the autoscaler
decides each role on its own policy (`role_spec(...).autoscaling`).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from kvasir_operator import labels
from kvasir_operator.spec import InferenceServiceSpec

PREFILL, DECODE = "prefill", "decode"
ROLES = (PREFILL, DECODE)
ROLE_TO_KV_ROLE = {PREFILL: "kv_producer", DECODE: "kv_consumer"}


def kv_transfer_config(spec: InferenceServiceSpec, role: str) -> dict[str, Any]:
    """The role's --kv-transfer-config, only the keys that differ from the engine's defaults
    beyond connector and role (the engine checks every one at start)."""
    d = spec.disaggregation
    assert d is not None
    config: dict[str, Any] = {"kv_connector": d.connector, "kv_role": ROLE_TO_KV_ROLE[role]}
    extra: dict[str, Any] = {}
    if role == PREFILL:
        config["kv_ip"] = f"$({labels.POD_IP_ENV})"
        config["kv_port"] = d.kv_port
        if d.hold_timeout_seconds is not None:
            extra["hold_timeout_s"] = d.hold_timeout_seconds
    else:
        if d.transfer_timeout_seconds is not None:
            extra["transfer_timeout_s"] = d.transfer_timeout_seconds
        if d.kv_buffer_size_bytes is not None:
            config["kv_buffer_size"] = d.kv_buffer_size_bytes
    if extra:
        config["kv_connector_extra_config"] = extra
    return config


def role_spec(spec: InferenceServiceSpec, role: str) -> InferenceServiceSpec:
    """The spec one role's Deployment is rendered from, and its autoscaler decides on."""
    d = spec.disaggregation
    assert d is not None, "role_spec of a service that is not disaggregated"
    r = d.role(role)
    e, res, a = spec.engine, spec.resources, spec.autoscaling
    engine = replace(e, tp_size=e.tp_size if r.tp_size is None else r.tp_size,
                     max_num_seqs=e.max_num_seqs if r.max_num_seqs is None else r.max_num_seqs,
                     extra_args=(*e.extra_args, *r.extra_args),
                     kv_transfer=kv_transfer_config(spec, role))
    resources = replace(res, num_gpus=res.num_gpus if r.num_gpus is None else r.num_gpus,
                        cpu=res.cpu if r.cpu is None else r.cpu,
                        memory=res.memory if r.memory is None else r.memory)

    def target(own: float | None, wide: float) -> float:
        return wide if own is None else own

    # Decode has no fallback: while prefill runs, the builtin autoscaler keeps one decode
    # replica at least (prefill alone answers nothing; decode alone prefills for itself).
    prefill = d.prefill
    is_prefill_running = (prefill.min_replicas if prefill.replicas is None
                          else prefill.replicas) > 0
    floor = max(r.min_replicas, 1) if role == DECODE and is_prefill_running else r.min_replicas
    autoscaling = replace(
        a, min_replicas=floor, max_replicas=r.max_replicas, role=role,
        path=f"spec.disaggregation.{role}",
        target_requests_waiting=target(r.target_requests_waiting, a.target_requests_waiting),
        target_kv_cache_usage=target(r.target_kv_cache_usage, a.target_kv_cache_usage),
        target_requests=a.target_requests if r.target_requests is None else r.target_requests,
        target_time_to_first_token_seconds=r.target_time_to_first_token_seconds)
    # Unset, a role runs its minReplicas (a whole service's spec.replicas unset runs 1 outside
    # builtin mode; a role's floor is what its owner asked for).
    replicas = r.min_replicas if r.replicas is None else r.replicas
    return replace(spec, engine=engine, resources=resources, autoscaling=autoscaling,
                   replicas=replicas, disaggregation=None)


def role_specs(spec: InferenceServiceSpec) -> dict[str, InferenceServiceSpec]:
    """Role -> its spec; empty for a service that is not disaggregated."""
    return {} if spec.disaggregation is None else {role: role_spec(spec, role)
                                                   for role in ROLES}
