"""Derive the InferenceService status from what is observed: Deployment, pods, events.

Pure: the reconcile gathers the observations, this module decides what they mean. Problems are
read where Kubernetes and the fetcher report them: the fetch initContainer's exit code and
termination message (the fetcher's exit-code contract), container waiting reasons (image pulls),
the PodScheduled condition and FailedScheduling events (missing GPUs), and the
`kvasir.dev/fetch-progress` pod annotation (download progress and the verified digest).
`status.autoscaling` belongs to the autoscaler and is never produced here.
"""

from __future__ import annotations

import datetime
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvasir_operator import labels

FETCH_EXIT_REASONS = {2: "FetchMisconfigured", 3: "ModelNotFound", 4: "AccessDenied",
                      5: "ChecksumMismatch", 6: "InsufficientDisk", 7: "DownloadStalled",
                      8: "UnverifiedModel"}
IMAGE_PULL_REASONS = ("ImagePullBackOff", "ErrImagePull", "InvalidImageName")
# Pods waiting for a node (no free GPU, no node matching): Pending, as a Deployment's pods are,
# not Failed: they start by themselves when capacity appears.
WAITING_FOR_NODE_REASONS = ("InsufficientGPU", "Unschedulable")

Body = Mapping[str, Any]


@dataclass(frozen=True)
class Problem:
    reason: str
    message: str
    is_fetch: bool = False  # the weights could not be fetched (ModelReady=False)


@dataclass(frozen=True)
class Observed:
    deployment: Body | None = None
    pods: Sequence[Body] = ()
    events: Sequence[Body] = ()
    spec_error: str | None = None  # set when the spec is invalid: nothing else is rendered
    capacity: Mapping[str, Any] | None = None
    capacity_fits: bool | None = None
    inspection: tuple[bool, str, str] | None = None  # ModelInspected (status, reason, message)
    extra: Mapping[str, Any] = field(default_factory=dict)  # url, selector, specHash...
    # A disaggregated service: role -> (its Deployment as observed, its desired replicas);
    # `deployment` is then unused for the counts.
    roles: Mapping[str, tuple[Body | None, int]] = field(default_factory=dict)


@dataclass(frozen=True)
class Counts:
    """One workload's replicas as its controller reports them, and what is desired of it."""

    replicas: int
    ready: int
    updated: int
    desired: int

    @classmethod
    def of(cls, workload: Body | None, desired: int) -> Counts:
        st = (workload or {}).get("status") or {}
        return cls(int(st.get("replicas") or 0), int(st.get("readyReplicas") or 0),
                   int(st.get("updatedReplicas") or 0), desired)

    @property
    def is_available(self) -> bool:
        return self.ready >= 1 or self.desired == 0

    @property
    def is_settled(self) -> bool:
        return self.ready >= self.desired and self.updated >= self.desired

    def to_status(self) -> dict[str, int]:
        return {"replicas": self.replicas, "readyReplicas": self.ready,
                "desiredReplicas": self.desired}


def now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _fetch_problem(status: Body) -> Problem | None:
    term = (status.get("state") or {}).get("terminated") or (
        status.get("lastState") or {}).get("terminated")
    if not term or term.get("exitCode", 0) == 0:
        return None
    code = int(term["exitCode"])
    reason = FETCH_EXIT_REASONS.get(code, "DownloadFailed")
    text = (term.get("message") or term.get("reason") or "").strip()
    return Problem(reason, f"kvasir-fetch exited {code}: {text}", is_fetch=True)


def pod_problems(pod: Body, gpu_resource: str) -> list[Problem]:
    problems: list[Problem] = []
    st = pod.get("status") or {}
    for cs in st.get("initContainerStatuses") or []:
        if cs.get("name") == labels.FETCH_CONTAINER and (p := _fetch_problem(cs)):
            problems.append(p)
    for cs in [*(st.get("initContainerStatuses") or []), *(st.get("containerStatuses") or [])]:
        waiting = (cs.get("state") or {}).get("waiting") or {}
        if waiting.get("reason") in IMAGE_PULL_REASONS:
            problems.append(Problem("ImagePullBackOff", f"{cs.get('image')}: "
                                    f"{waiting.get('message') or waiting['reason']}"))
        elif waiting.get("reason") == "CrashLoopBackOff" and cs.get("name") == "engine":
            last = (cs.get("lastState") or {}).get("terminated") or {}
            problems.append(Problem("EngineCrashLoop", str(last.get("message") or
                                                           waiting.get("message") or "")))
    for cond in st.get("conditions") or []:
        if cond.get("type") == "PodScheduled" and cond.get("status") == "False":
            message = str(cond.get("message") or "")
            reason = "InsufficientGPU" if f"Insufficient {gpu_resource}" in message else (
                "Unschedulable")
            problems.append(Problem(reason, message))
    progress = fetch_progress(pod)
    if progress and progress.get("phase") == "Failed" and not any(p.is_fetch for p in problems):
        problems.append(Problem("DownloadFailed", str(progress.get("message", "")), True))
    return problems


def event_problems(events: Sequence[Body], gpu_resource: str) -> list[Problem]:
    return [Problem("InsufficientGPU", str(e.get("message")))
            for e in events if e.get("reason") == "FailedScheduling"
            and f"Insufficient {gpu_resource}" in str(e.get("message"))]


def fetch_progress(pod: Body) -> dict[str, Any] | None:
    raw = ((pod.get("metadata") or {}).get("annotations") or {}).get(labels.FETCH_PROGRESS)
    try:
        value = json.loads(raw) if raw else None
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def _download(pods: Sequence[Body]) -> tuple[dict[str, Any] | None, str | None]:
    """The slowest running download (or a finished one), and the verified digest."""
    records = [p for p in (fetch_progress(pod) for pod in pods) if p]
    digest = next((str(r["manifestDigest"]) for r in records
                   if r.get("phase") == "Done" and r.get("manifestDigest")), None)
    running = [r for r in records if r.get("phase") not in ("Done", "Failed")]

    def fraction(r: dict[str, Any]) -> float:
        return float(r.get("bytesDone") or 0) / max(1.0, float(r.get("bytesTotal") or 0))

    chosen = min(running, key=fraction) if running else (records[0] if records else None)
    return chosen, digest


def _fetch_done(pod: Body) -> bool:
    for cs in (pod.get("status") or {}).get("initContainerStatuses") or []:
        term = (cs.get("state") or {}).get("terminated") or {}
        if cs.get("name") == labels.FETCH_CONTAINER and term and term.get("exitCode") == 0:
            return True
    return (fetch_progress(pod) or {}).get("phase") == "Done"


def condition(ctype: str, status: bool | None, reason: str, message: str,
              old: Sequence[Body], generation: int | None) -> dict[str, Any]:
    text = "Unknown" if status is None else ("True" if status else "False")
    prev = next((c for c in old if c.get("type") == ctype), None)
    since = prev.get("lastTransitionTime") if prev and prev.get("status") == text else None
    return {"type": ctype, "status": text, "reason": reason, "message": message[:2048],
            "lastTransitionTime": since or now(), "observedGeneration": generation}


def derive_status(obs: Observed, *, desired: int, generation: int | None, is_local_model: bool,
                  gpu_resource: str, old: Body) -> dict[str, Any]:
    old_conds: Sequence[Body] = old.get("conditions") or []
    if obs.spec_error is not None:
        conds = [condition(ctype, False, "InvalidSpec", obs.spec_error, old_conds, generation)
                 for ctype in ("SpecValid", "Ready")]
        return {"observedGeneration": generation, "phase": "Failed", "reason": "InvalidSpec",
                "conditions": conds}
    role_to_counts = {role: Counts.of(seen, want) for role, (seen, want) in obs.roles.items()}
    counts = list(role_to_counts.values()) or [Counts.of(obs.deployment, desired)]
    ready, updated = sum(c.ready for c in counts), sum(c.updated for c in counts)
    problems = [p for pod in obs.pods for p in pod_problems(pod, gpu_resource)]
    problems += event_problems(obs.events, gpu_resource)
    download, digest = _download(obs.pods)
    digest = digest or old.get("modelDigest")  # model.uri is immutable: the digest stays valid
    fetch_fail = next((p for p in problems if p.is_fetch), None)
    blocking = problems[0] if problems else None
    model_ready = is_local_model or any(_fetch_done(p) for p in obs.pods)
    if fetch_fail and not model_ready:
        mr = condition("ModelReady", False, fetch_fail.reason, fetch_fail.message, old_conds,
                       generation)
    elif model_ready:
        mr = condition("ModelReady", True, "Verified", digest or "weights verified on local disk",
                       old_conds, generation)
    else:
        mr = condition("ModelReady", False, "Downloading",
                       str((download or {}).get("message") or "waiting for kvasir-fetch"),
                       old_conds, generation)
    # Disaggregated: a service serves only while every role that should run has a ready replica.
    available = all(c.is_available for c in counts)
    can_generate = (", ".join(f"{role} {c.ready}/{c.desired}"
                              for role, c in role_to_counts.items()) if role_to_counts
                    else f"{ready}/{desired}")
    av = condition("Available", available, "MinimumReplicasReady" if available else "NoneReady",
                   f"{can_generate} replicas can generate", old_conds, generation)
    settled = all(c.is_settled for c in counts)
    if blocking and not settled:
        pr = condition("Progressing", False, blocking.reason, blocking.message, old_conds,
                       generation)
    else:
        pr = condition("Progressing", not settled, "Complete" if settled else "RollingOut",
                       f"{updated} updated, {ready} ready of {desired}", old_conds, generation)
    conds = [mr, av, pr]
    if obs.inspection is not None:
        conds.append(condition("ModelInspected", *obs.inspection, old_conds, generation))
    if obs.capacity_fits is not None and obs.capacity is not None:
        conds.append(condition("CapacityFits", obs.capacity_fits,
                               "Fits" if obs.capacity_fits else "InsufficientGPUMemory",
                               str(obs.capacity.get("message", "")), old_conds, generation))
    autoscaling = old.get("autoscaling") or {}
    # The builtin autoscaler's last word on its metrics: the service's, or each role's.
    records = [r for r in [autoscaling, *(autoscaling.get("roles") or {}).values()]
               if isinstance(r, Mapping) and r.get("reason")]
    if records:
        stale = next((r for r in records if r["reason"] == "MetricsUnavailable"), None)
        conds.append(condition("MetricsAvailable", stale is None,
                               "Fresh" if stale is None else "MetricsUnavailable",
                               "metrics scraped from the ready pods" if stale is None
                               else str(stale.get("message") or ""), old_conds, generation))
    if obs.capacity_fits is False:
        phase, reason = "Failed", "InsufficientGPUMemory"
    elif settled:
        phase, reason = "Ready", ""
    elif blocking and ready:
        phase, reason = "Degraded", blocking.reason
    elif blocking:
        phase = "Pending" if blocking.reason in WAITING_FOR_NODE_REASONS else "Failed"
        reason = blocking.reason
    else:
        phase, reason = ("Loading" if obs.pods else "Pending"), str(pr["reason"])
    conds.append(condition("Ready", phase == "Ready", "Ready" if phase == "Ready"
                           else reason or phase, str(pr["message"]), old_conds, generation))
    roles = {role: c.to_status() for role, c in role_to_counts.items()} or None
    return {"observedGeneration": generation, "phase": phase, "reason": reason or None,
            "replicas": sum(c.replicas for c in counts), "readyReplicas": ready, "roles": roles,
            "desiredReplicas": desired, "modelDigest": digest, "download": download,
            "capacity": dict(obs.capacity) if obs.capacity else None,
            "conditions": conds, **obs.extra}


def with_apply_failures(status: Mapping[str, Any], failures: Sequence[tuple[str, int, str]],
                        old: Body, generation: int | None) -> dict[str, Any]:
    """`status` after child applies failed: Ready=False saying which and why.

    `failures`: (what, HTTP status, message), e.g. ("Deployment llm", 422, "...").
    A 422 is the API server refusing what the spec rendered: InvalidSpec, with its message.
    """
    invalid = [f for f in failures if f[1] == 422]
    reason = "InvalidSpec" if invalid else "ApplyFailed"
    message = "; ".join(f"{what}: {message}" for what, _code, message in (invalid or failures))
    # Never "Ready" beside a failure: the replicas that serve keep serving, but the spec is
    # not applied (phase and reason say the same thing in `kubectl get`).
    phase = "Failed" if invalid else ("Degraded" if status.get("phase") == "Ready"
                                      else status.get("phase"))
    return with_not_ready(status, reason, message, old, generation, phase)


def with_not_ready(status: Mapping[str, Any], reason: str, message: str, old: Body,
                   generation: int | None, phase: Any = "Failed") -> dict[str, Any]:
    """`status` with Ready=False for `reason` (what the operator refused or failed to do)."""
    ready = condition("Ready", False, reason, message, old.get("conditions") or [], generation)
    conds = [c for c in status.get("conditions") or [] if c.get("type") != "Ready"] + [ready]
    return {**status, "phase": phase, "reason": reason, "conditions": conds}
