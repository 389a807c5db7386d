"""Pure rendering of the engine pod template: fetch initContainer, engine container, volumes.

The initContainer writes verified weights into the cache volume; the engine mounts the same
volume read-only. One pod holds all tensor-parallel ranks, so TP traffic stays on one node's
NVLink; /dev/shm is a memory emptyDir because NCCL uses it and the container default is 64 MiB.
Probes: readiness on /ready (a real generation), liveness on /health, and a startup probe whose
budget is estimated from the weights' size (initContainers run before it starts, so the budget
covers loading from local disk to GPU, not the download; a pipeline's leader adds its wait at
the rendezvous, below).

A pipeline-parallel replica spans several pods (a LeaderWorkerSet group, render.py): every pod
gets this same template, fetch initContainer and cache volume included, and the same engine
arguments, its node rank and the leader's address filled in by Kubernetes from the variables
the LWS controller puts in every container. Only the leader (node rank 0) serves HTTP, so a
worker's template has no port and no probes; its readiness is its container running, and the
group's readiness is the leader's real generation, which goes through every stage. Each pod's
engine starts when its own fetch is done, and the first up waits at the rendezvous for the
others: `--rendezvous-timeout` is rendered from the slowest fetch the size allows
(`rendezvous_timeout_seconds`), so a cold cache on one node does not fail the whole group.
"""

from __future__ import annotations

import hashlib
import json
import math
from typing import Any

from kvasir_operator import labels
from kvasir_operator.merge import strategic_merge
from kvasir_operator.spec import InferenceServiceSpec

MODELS_DIR = "/models"
SOURCE_DIR = "/source"
STARTUP_PERIOD_SECONDS = 10
UNKNOWN_SIZE_STARTUP_SECONDS = 600  # the habitual 10 minutes, when the weights' size is unknown
# A CPU engine (no GPUs) compiles its native kernels at its first start into the pod's /tmp
# (docs/images.md): 27 s of a 44 s start on 2 idle cores, a minute on a busy node; every new pod
# pays it, so the startup budget carries it.
CPU_KERNEL_BUILD_SECONDS = 120
# The pod does not automount its API token: only the fetch initContainer gets one (projected,
# short-lived), for its progress annotation; the engine, which runs model code, has no API access.
API_TOKEN_VOLUME = "kube-api-access"
API_TOKEN_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"
_API_TOKEN = {"name": API_TOKEN_VOLUME, "projected": {"defaultMode": 0o444, "sources": [
    {"serviceAccountToken": {"path": "token", "expirationSeconds": 3607}},
    {"configMap": {"name": "kube-root-ca.crt", "items": [{"key": "ca.crt", "path": "ca.crt"}]}},
    {"downwardAPI": {"items": [{"path": "namespace",
                                "fieldRef": {"fieldPath": "metadata.namespace"}}]}}]}}
# torch.distributed's rendezvous on the leader (torchrun's default port).
MASTER_PORT = 29500
# The engine's own --rendezvous-timeout: what pods of one group starting apart need (image
# pulls, scheduling) before any fetch is counted.
MIN_RENDEZVOUS_SECONDS = 300
# The fetch throughput the rendezvous timeout assumes, deliberately low: one S3 GET connection
# does 50-100 MB/s, and kvasir-fetch's parallel ranges several times that (docs/fetch.md). Too
# low only makes a node that never comes be named later; too high fails and recreates a group
# whose slowest pod is still fetching. `engine.extraArgs: [--rendezvous-timeout, N]` overrides.
FETCH_BYTES_PER_SECOND = 50 * 10**6
_RESTRICTED = {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
               "capabilities": {"drop": ["ALL"]}}
# The uid and gid every Kvasir container runs as (the images' USER 1000:1000).
POD_UID = 1000
# A hostPath cache that does not exist yet is created by the kubelet as root, mode 0755, and
# fsGroup does not apply to hostPath volumes: kvasir-fetch (uid 1000) could not write it. This
# initContainer, first in the pod, gives the volume's root to uid 1000 (not recursively: what is
# below was written by kvasir-fetch already). Root with CAP_CHOWN alone; a namespace that allows
# hostPath volumes is not under the restricted Pod Security level anyway.
CACHE_OWNER_CONTAINER = "cache-owner"


def model_dir(spec: InferenceServiceSpec) -> str:
    """Where the engine reads the weights: the source path, or a per-URI cache directory."""
    source = spec.model.source
    if source.is_local:
        return source.path
    # A hostPath cache is shared by every model on the node: one directory per source URI.
    return f"{MODELS_DIR}/{hashlib.sha256(source.uri.encode()).hexdigest()[:16]}"


def _weights_size(spec: InferenceServiceSpec, weights_bytes: int | None) -> int | None:
    return weights_bytes if weights_bytes is not None else spec.model.size_bytes


def rendezvous_timeout_seconds(spec: InferenceServiceSpec, weights_bytes: int | None) -> int:
    """How long the nodes of a pipeline group wait for each other. Every pod fetches the whole
    model into its own node's cache before its engine starts, so the first engine up (a warm
    cache) may wait for a whole download elsewhere (a cold one): the floor plus that download at
    the assumed throughput. A local source or an unknown size: the floor."""
    size = _weights_size(spec, weights_bytes)
    if size is None or spec.model.source.is_local:
        return MIN_RENDEZVOUS_SECONDS
    return MIN_RENDEZVOUS_SECONDS + math.ceil(size / FETCH_BYTES_PER_SECOND)


def startup_budget_seconds(spec: InferenceServiceSpec, weights_bytes: int | None) -> int:
    """The startup probe's budget: loading the weights from local disk, plus, on a pipeline's
    leader, the wait at the rendezvous (its port opens only after both), plus, on CPU, the
    native kernels' compile. A fixed `startup.timeoutSeconds` wins."""
    if spec.startup.timeout_seconds is not None:
        return spec.startup.timeout_seconds
    wait = rendezvous_timeout_seconds(spec, weights_bytes) if spec.is_multi_node else 0
    if spec.resources.num_gpus == 0:
        wait += CPU_KERNEL_BUILD_SECONDS
    size = _weights_size(spec, weights_bytes)
    if size is None:
        return UNKNOWN_SIZE_STARTUP_SECONDS + wait
    load = math.ceil(size / spec.startup.load_bytes_per_second)
    return load + spec.startup.overhead_seconds + wait


# Of kubelet's readiness timeoutSeconds, the share the engine may spend before answering 503.
READY_TIMEOUT_FRACTION = 0.8


def ready_timeout_seconds(spec: InferenceServiceSpec) -> float:
    """The engine's own bound on one /ready answer, inside kubelet's probe timeout.

    The engine answers /ready at once while it makes progress; only an idle or stalled engine
    waits for a token step, and it must give up (503 with the reason) before kubelet does, or the
    pod's events show a bare timeout instead of why it is not ready.
    """
    return READY_TIMEOUT_FRACTION * spec.readiness.timeout_seconds


def engine_args(spec: InferenceServiceSpec, weights_bytes: int | None = None) -> list[str]:
    e = spec.engine
    args = ["serve", model_dir(spec), "--host", "0.0.0.0", "--port", str(labels.HTTP_PORT),
            "--served-model-name", spec.model.name, "--tensor-parallel-size", str(e.tp_size),
            "--gpu-memory-utilization", str(e.gpu_memory_utilization), "--dtype", e.dtype,
            "--shutdown-grace-seconds", str(e.shutdown_grace_seconds),
            "--ready-timeout-seconds", f"{ready_timeout_seconds(spec):g}",
            "--enable-prefix-caching" if e.enable_prefix_caching
            else "--no-enable-prefix-caching"]
    if e.max_model_len is not None:
        args += ["--max-model-len", str(e.max_model_len)]
    if e.max_num_seqs is not None:
        args += ["--max-num-seqs", str(e.max_num_seqs)]
    if e.quantization:
        args += ["--quantization", e.quantization]
    if e.kv_cache_dtype != "auto":
        args += ["--kv-cache-dtype", e.kv_cache_dtype]
    if e.batch_invariant:
        args.append("--batch-invariant")
    if spec.is_multi_node:
        # $(VAR): expanded by the kubelet from the env the LWS controller injects in each pod.
        args += ["--pipeline-parallel-size", str(e.pp_size), "--nnodes", "$(LWS_GROUP_SIZE)",
                 "--node-rank", "$(LWS_WORKER_INDEX)", "--master-addr", "$(LWS_LEADER_ADDRESS)",
                 "--master-port", str(MASTER_PORT), "--rendezvous-timeout",
                 str(rendezvous_timeout_seconds(spec, weights_bytes))]
    if e.speculative is not None:
        args += ["--speculative-config", e.speculative.as_flag_json()]
    if e.kv_transfer is not None:
        # `$(POD_IP)` in a producer's kv_ip is expanded by the kubelet (_kv_transfer_env).
        args += ["--kv-transfer-config", json.dumps(e.kv_transfer, sort_keys=True)]
    return args + list(e.extra_args)


def _kv_transfer_env(spec: InferenceServiceSpec) -> list[dict[str, Any]]:
    """A KV producer advertises its pod's own address: POD_IP from the downward API."""
    kv = spec.engine.kv_transfer
    if kv is None or "kv_ip" not in kv:
        return []
    return [{"name": labels.POD_IP_ENV,
             "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}]


def _kv_transfer_ports(spec: InferenceServiceSpec) -> list[dict[str, Any]]:
    """A KV producer's block server ports, declared (consumers dial the pod's address): one per
    tensor-parallel rank r, kv_port + r (`kv-transfer`, then `kv-transfer-1`, ...)."""
    kv = spec.engine.kv_transfer
    if kv is None or "kv_port" not in kv:
        return []
    return [{"name": labels.KV_PORT_NAME + (f"-{rank}" if rank else ""),
             "containerPort": int(kv["kv_port"]) + rank, "protocol": "TCP"}
            for rank in range(spec.engine.tp_size)]


def fetch_source(spec: InferenceServiceSpec) -> str:
    source = spec.model.source
    if source.is_pvc:
        return f"{SOURCE_DIR}/{source.path}".rstrip("/")
    return source.uri


def _fetch_container(spec: InferenceServiceSpec) -> dict[str, Any]:
    f = spec.fetch
    args = [fetch_source(spec), model_dir(spec)]
    for flag, value in (("--endpoint-url", f.endpoint_url), ("--region", f.region),
                        ("--concurrency", f.concurrency), ("--part-size", f.part_size_bytes),
                        ("--stall-timeout", f.stall_timeout_seconds), ("--retries", f.retries)):
        if value is not None:
            args += [flag, str(value)]
    if f.addressing_style != "auto":
        args += ["--addressing-style", f.addressing_style]
    if spec.model.allow_unverified:
        args.append("--allow-unverified")
    mounts: list[dict[str, Any]] = [{"name": "cache", "mountPath": MODELS_DIR},
                                    {"name": "tmp", "mountPath": "/tmp"}]
    if spec.model.source.is_pvc:
        mounts.append({"name": "source", "mountPath": SOURCE_DIR, "readOnly": True})
    container: dict[str, Any] = {
        "name": labels.FETCH_CONTAINER, "image": f.image,
        "imagePullPolicy": spec.engine.image_pull_policy,
        "command": ["kvasir-fetch"], "args": args,
        "env": [{"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
                {"name": "POD_NAMESPACE",
                 "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}}],
        "volumeMounts": mounts,
        "resources": {"requests": {"cpu": "500m", "memory": "512Mi"}},
        "securityContext": dict(_RESTRICTED),
        "terminationMessagePath": "/dev/termination-log",
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }
    mounts.append({"name": API_TOKEN_VOLUME, "mountPath": API_TOKEN_DIR, "readOnly": True})
    if spec.model.credentials_secret:
        container["envFrom"] = [{"secretRef": {"name": spec.model.credentials_secret}}]
    return container


def _cache_owner_container(spec: InferenceServiceSpec) -> dict[str, Any]:
    return {
        "name": CACHE_OWNER_CONTAINER, "image": spec.fetch.image,
        "imagePullPolicy": spec.engine.image_pull_policy,
        "command": ["chown", f"{POD_UID}:{POD_UID}", MODELS_DIR],
        "volumeMounts": [{"name": "cache", "mountPath": MODELS_DIR}],
        "resources": {"requests": {"cpu": "10m", "memory": "16Mi"}},
        "securityContext": {**_RESTRICTED, "runAsUser": 0, "runAsNonRoot": False,
                            "capabilities": {"drop": ["ALL"], "add": ["CHOWN"]}},
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }


def _engine_container(spec: InferenceServiceSpec, weights_bytes: int | None,
                      is_worker: bool) -> dict[str, Any]:
    e, r = spec.engine, spec.resources
    limits: dict[str, Any] = {}
    if r.num_gpus:
        limits[r.gpu_resource_name] = str(r.num_gpus)
    for key, value in (("cpu", r.cpu), ("memory", r.memory)):
        if value is not None:
            limits[key] = str(value)
    http = {"path": "/ready", "port": labels.HTTP_PORT_NAME}
    budget = startup_budget_seconds(spec, weights_bytes)
    container: dict[str, Any] = {
        "name": labels.ENGINE_CONTAINER, "image": e.image,
        "imagePullPolicy": e.image_pull_policy,
        "command": ["kvasir-engine"], "args": engine_args(spec, weights_bytes),
        "ports": [{"name": labels.HTTP_PORT_NAME, "containerPort": labels.HTTP_PORT,
                   "protocol": "TCP"}, *_kv_transfer_ports(spec)],
        "env": sorted([{"name": "HOME", "value": "/tmp"}, *_kv_transfer_env(spec),
                       *map(dict, e.env)],
                      key=lambda v: str(v.get("name"))),
        "resources": {"limits": limits, "requests": dict(limits)} if limits else {},
        "volumeMounts": [{"name": "cache", "mountPath": MODELS_DIR, "readOnly": True},
                         {"name": "dshm", "mountPath": "/dev/shm"},
                         {"name": "tmp", "mountPath": "/tmp"}],
        "readinessProbe": {"httpGet": http, "periodSeconds": spec.readiness.period_seconds,
                           "timeoutSeconds": spec.readiness.timeout_seconds,
                           "failureThreshold": spec.readiness.failure_threshold},
        "livenessProbe": {"httpGet": {**http, "path": "/health"}, "periodSeconds": 10,
                          "timeoutSeconds": 5, "failureThreshold": 3},
        "startupProbe": {"httpGet": {**http, "path": "/health"},
                         "periodSeconds": STARTUP_PERIOD_SECONDS, "timeoutSeconds": 5,
                         "failureThreshold": max(1, math.ceil(budget / STARTUP_PERIOD_SECONDS))},
        "securityContext": dict(_RESTRICTED),
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }
    if spec.model.source.is_local:
        container["volumeMounts"] = container["volumeMounts"][1:]
    pre_stop = spec.pre_stop_seconds
    if is_worker:
        for key in ("ports", "readinessProbe", "livenessProbe", "startupProbe"):
            del container[key]
        # A worker outlives the leader's drain (preStop, then the engine's grace), which needs
        # every stage; it exits by itself once the leader is gone.
        pre_stop += spec.engine.shutdown_grace_seconds
    if pre_stop:
        container["lifecycle"] = {"preStop": {"exec": {"command": ["sleep", str(pre_stop)]}}}
    return container


def _volumes(spec: InferenceServiceSpec) -> list[dict[str, Any]]:
    c = spec.cache
    cache: dict[str, Any]
    if c.type == "hostPath":
        cache = {"hostPath": {"path": c.path, "type": "DirectoryOrCreate"}}
    elif c.type == "pvc":
        cache = {"persistentVolumeClaim": {"claimName": c.claim_name}}
    else:
        cache = {"emptyDir": {} if c.size_limit is None else {"sizeLimit": c.size_limit}}
    volumes = [{"name": "cache", **cache}, {"name": "dshm", "emptyDir": {"medium": "Memory"}},
               {"name": "tmp", "emptyDir": {}}]
    if spec.model.source.is_pvc:
        volumes.append({"name": "source", "persistentVolumeClaim": {
            "claimName": spec.model.source.claim, "readOnly": True}})
    if not spec.model.source.is_local:
        volumes.append(_API_TOKEN)
    return volumes


def render_pod_template(spec: InferenceServiceSpec, isvc_name: str, spec_hash: str,
                        weights_bytes: int | None = None,
                        service_account: str | None = None,
                        is_worker: bool = False, role: str | None = None) -> dict[str, Any]:
    """`service_account`: the engine pods' default one (the chart's), when it exists; the
    spec's `serviceAccountName` wins over it. `is_worker`: a pipeline stage other than the
    first (node rank > 0), which serves no HTTP. `role`: a disaggregated pool's, labelled."""
    p, r = spec.pod, spec.resources
    tolerations = [dict(t) for t in p.tolerations]
    if r.num_gpus and not any(t.get("key") == r.gpu_resource_name for t in tolerations):
        tolerations.append({"key": r.gpu_resource_name, "operator": "Exists",
                            "effect": "NoSchedule"})
    affinity = dict(p.affinity) or {"podAntiAffinity": {
        "preferredDuringSchedulingIgnoredDuringExecution": [{"weight": 100, "podAffinityTerm": {
            "topologyKey": "kubernetes.io/hostname",
            "labelSelector": {"matchLabels": labels.selector_labels(isvc_name)}}}]}}
    pod_spec: dict[str, Any] = {
        "containers": [_engine_container(spec, weights_bytes, is_worker)],
        "volumes": _volumes(spec),
        "terminationGracePeriodSeconds": spec.termination_grace_seconds,
        "enableServiceLinks": False,
        "securityContext": {"runAsNonRoot": True, "runAsUser": POD_UID, "runAsGroup": POD_UID,
                            "fsGroup": POD_UID, "seccompProfile": {"type": "RuntimeDefault"}},
        "affinity": affinity,
        "automountServiceAccountToken": False,
    }
    if not spec.model.source.is_local:
        owner = [_cache_owner_container(spec)] if spec.cache.type == "hostPath" else []
        pod_spec["initContainers"] = [*owner, _fetch_container(spec)]
    for key, value in (("nodeSelector", dict(p.node_selector)), ("tolerations", tolerations),
                       ("priorityClassName", p.priority_class_name),
                       ("serviceAccountName", p.service_account_name or service_account),
                       ("imagePullSecrets", [{"name": n} for n in p.image_pull_secrets])):
        if value:
            pod_spec[key] = value
    own_labels = labels.pod_labels(isvc_name, spec_hash, role)
    template = {"metadata": {"labels": {**p.labels, **own_labels},
                             "annotations": dict(p.annotations)},
                "spec": pod_spec}
    merged = strategic_merge(template, p.template) if p.template else template
    # The escape hatch may not take away the labels the selector and the rollouts depend on.
    merged.setdefault("metadata", {}).setdefault("labels", {}).update(own_labels)
    return merged
