"""One autoscaling tick for one InferenceService: observe, decide, plan, then execute.

`tick` lists the service's pods by `kvasir.dev/inferenceservice=<name>`, scrapes the ready ones,
feeds the in-memory `SampleWindow` and `History`, calls the pure `decide`, turns the decision into
a `Plan` (a plain value: `make_plan`) and only then talks to the API (`execute`), in this order:
pod-deletion-cost annotations (before a scale-down, least busy pod lowest, so the ReplicaSet
deletes it first and the engine's drain finishes the in-flight streams of the others), the CR's
scale subresource, an Event, and a merge patch of `status.autoscaling` only.

The state lives in the operator's memory and is rebuilt after a restart: the sample window
refills in one tick, and the history (the pending scale-down timer) is read back from
`status.autoscaling.history`. The status is written when the decision or the history changes,
and at most every `STATUS_HEARTBEAT_SECONDS` when only the signals moved; never when only the
clock did (an idle service writes nothing). A restart after a long quiet spell therefore finds
a stale `lastDecisionTime`, drops the history and waits a full scale-down delay: conservative.

A pipeline-parallel service (a LeaderWorkerSet) counts groups, not pods: only the group leaders
serve HTTP, so only they are scraped and count as ready replicas; a group with an unschedulable
pod counts once; the replicas set on the CR become the LeaderWorkerSet's groups. No deletion
costs there: LeaderWorkerSet removes the highest-numbered groups first, whatever the annotation.

A disaggregated service (spec.disaggregation) is two pools, each decided on its own: one scrape
of every ready pod, then per role (`kvasir.dev/role`) its own window, history and policy
(`disaggregation.role_spec`: the role's bounds and targets, and the signals of its role in
decision.py); the new count goes to `spec.disaggregation.<role>.replicas` (a merge patch of the
CR: the scale subresource has one count) and the record to `status.autoscaling.roles.<role>`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from .. import k8s, labels
from ..disaggregation import role_specs
from ..spec import CostSpec, InferenceServiceSpec, SpecError
from ..spec_parse import parse_spec
from .cost import RATE_WINDOW_SECONDS, cost_status, holds_a_node, tokens_per_second
from .decision import Decision, Reason, decide, stale_after_seconds
from .history import History, iso_time
from .scrape import ScrapeSettings, scrape_pods
from .window import SampleWindow

DELETION_COST = "controller.kubernetes.io/pod-deletion-cost"
STATUS_HEARTBEAT_SECONDS = 60.0
UNKNOWN_LOAD_COST = 1_000_000  # a pod whose load is unknown may be busy: delete it last
LIMITED = (Reason.INSUFFICIENT_GPU, Reason.AT_MAX_REPLICAS)
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class AutoscalerState:
    window: SampleWindow = field(default_factory=SampleWindow)
    history: History | None = None  # None until restored from status on the first tick
    last_record: Mapping[str, Any] | None = None  # the status.autoscaling last written
    last_written_at: float | None = None
    cost_record: Mapping[str, Any] | None = None  # the status.cost last written
    cost_written_at: float | None = None
    # A disaggregated service: each role's own history and last record (window unused there).
    role_to_state: Mapping[str, AutoscalerState] = field(default_factory=dict)


@dataclass(frozen=True)
class Plan:
    pod_to_deletion_cost: Mapping[str, str]  # annotations to set first (before a scale-down)
    replicas: int | None  # the new spec.replicas; None leaves it alone
    event: tuple[str, str, str] | None  # (type, reason, message)
    status: Mapping[str, Any] | None  # the new status.autoscaling; None: nothing to write


def is_ready(pod: Mapping[str, Any]) -> bool:
    status = pod.get("status") or {}
    return (not (pod.get("metadata") or {}).get("deletionTimestamp")
            and bool(status.get("podIP"))
            and any(c.get("type") == "Ready" and c.get("status") == "True"
                    for c in status.get("conditions") or []))


def is_unschedulable(pod: Mapping[str, Any]) -> bool:
    return (not (pod.get("metadata") or {}).get("deletionTimestamp")
            and any(c.get("type") == "PodScheduled" and c.get("status") == "False"
                    for c in (pod.get("status") or {}).get("conditions") or []))


def deletion_costs(ready_pods: Sequence[Mapping[str, Any]], window: SampleWindow,
                   now: float, max_age_seconds: float) -> dict[str, str]:
    """Cost = requests in flight (running + waiting); lowest goes first. Only changed values."""
    pod_to_cost: dict[str, str] = {}
    for pod in ready_pods:
        meta = pod.get("metadata") or {}
        sample = window.latest_usable(str(meta.get("name")), (), now=now,
                                      max_age_seconds=max_age_seconds)
        if sample is None or sample.num_running is None:
            cost = UNKNOWN_LOAD_COST
        else:
            cost = round(sample.num_running + (sample.num_waiting or 0))
        if (meta.get("annotations") or {}).get(DELETION_COST) != str(cost):
            pod_to_cost[str(meta.get("name"))] = str(cost)
    return pod_to_cost


def make_plan(decision: Decision, *, ready_pods: Sequence[Mapping[str, Any]],
              window: SampleWindow, history: History, state: AutoscalerState,
              previous: Mapping[str, Any] | None, now: float, max_age_seconds: float) -> Plan:
    """`previous`: the record in `status.autoscaling` (what an operator before a restart
    wrote), compared when this loop has written nothing yet, so a restart writes nothing new."""
    record = {
        "lastDecisionTime": iso_time(now),
        "desiredReplicas": decision.desired,
        "currentReplicas": decision.current,
        "reason": decision.reason.value,
        "message": decision.message,
        "signals": decision.signals.to_status(),
        "history": history.to_status(),
    }
    last = state.last_record or previous or {}
    previous_reason = last.get("reason")
    event: tuple[str, str, str] | None = None
    if decision.desired > decision.current:
        event = ("Normal", "ScaledUp", decision.message)
    elif decision.desired < decision.current:
        event = ("Normal", "ScaledDown", decision.message)
    elif decision.reason in LIMITED and previous_reason != decision.reason.value:
        event = ("Warning", "ScalingLimited", f"{decision.reason.value}: {decision.message}")
    elif (decision.reason is Reason.METRICS_UNAVAILABLE
          and previous_reason != decision.reason.value):
        event = ("Warning", Reason.METRICS_UNAVAILABLE.value, decision.message)
    steady = ("desiredReplicas", "currentReplicas", "reason")
    is_heartbeat_due = (state.last_written_at is None
                        or now - state.last_written_at >= STATUS_HEARTBEAT_SECONDS)
    is_due = (any(last.get(k) != record[k] for k in steady)
              or [r["replicas"] for r in last.get("history", {}).get("recommendations", [])]
              != [r.replicas for r in history.recommendations]
              or (is_heartbeat_due and _untimed(last) != _untimed(record)))
    costs = (deletion_costs(ready_pods, window, now, max_age_seconds)
             if decision.desired < decision.current else {})
    return Plan(pod_to_deletion_cost=costs,
                replicas=decision.desired if decision.is_change else None,
                event=event, status=record if is_due or event else None)


# The keys of a whole service's record, cleared when its roles' records are written instead.
SERVICE_RECORD_KEYS = ("lastDecisionTime", "desiredReplicas", "currentReplicas", "reason",
                       "message", "signals", "history")


async def execute(client: k8s.K8sClient, isvc: Mapping[str, Any], plan: Plan,
                  role: str | None = None) -> None:
    """`role`: a disaggregated role's plan (its replicas and record live under the role)."""
    meta = isvc["metadata"]
    namespace, name = meta.get("namespace"), meta["name"]
    for pod_name, cost in sorted(plan.pod_to_deletion_cost.items()):
        try:
            await client.patch_pod_annotations(namespace, pod_name, {DELETION_COST: cost})
        except k8s.ApiError as exc:
            if exc.status != 404:  # a pod that is already gone needs no cost
                raise
    if plan.replicas is not None and role is not None:
        await client.patch_merge(k8s.INFERENCESERVICES, namespace, name, {
            "spec": {"disaggregation": {role: {"replicas": plan.replicas}}}})
    elif plan.replicas is not None:
        await client.patch_scale(k8s.INFERENCESERVICES, namespace, name, plan.replicas)
    if plan.event is not None:
        event_type, reason, message = plan.event
        await client.post_event(isvc, event_type, reason,
                                message if role is None else f"{role}: {message}")
    if plan.status is not None:
        record = dict(plan.status) if role is None else {
            **dict.fromkeys(SERVICE_RECORD_KEYS), "roles": {role: dict(plan.status)}}
        await client.patch_status(k8s.INFERENCESERVICES, namespace, name,
                                  {"autoscaling": record})


def _untimed(record: Mapping[str, Any]) -> dict[str, Any]:
    """A status record without its timestamps: what a heartbeat would change. Nothing is
    written while only the time moves (issue 35: a write a minute per idle object)."""
    untimed = {k: v for k, v in record.items()
               if k not in ("lastDecisionTime", "measuredAt", "history")}
    history = record.get("history") or {}
    untimed["history"] = [r.get("replicas") for r in history.get("recommendations") or []]
    return untimed


async def write_cost(client: k8s.K8sClient, isvc: Mapping[str, Any], cost: CostSpec,
                     pods: Sequence[Mapping[str, Any]], multi: bool, window: SampleWindow,
                     state: AutoscalerState, now: float,
                     ) -> tuple[Mapping[str, Any] | None, float | None]:
    """Merge-patch `status.cost` every heartbeat, and as soon as a first rate is measured;
    returns the record and the time last written."""
    paid = {labels.replica_of(p["metadata"]["name"], p["metadata"].get("labels") or {}, multi)
            for p in pods if holds_a_node(p)}  # a LeaderWorkerSet group is one replica
    record = cost_status(cost, num_paid_replicas=len(paid),
                         measured_tokens_per_second=tokens_per_second(window.pod_to_samples),
                         now=now)
    last = state.cost_record or {}
    is_due = record is not None and (
        state.cost_written_at is None
        or ("outputTokensPerSecond" in record) != ("outputTokensPerSecond" in last)
        or (now - state.cost_written_at >= STATUS_HEARTBEAT_SECONDS
            and _untimed(last) != _untimed(record)))
    if not is_due:
        return state.cost_record, state.cost_written_at
    meta = isvc["metadata"]
    await client.patch_status(k8s.INFERENCESERVICES, meta.get("namespace"), meta["name"],
                              {"cost": record})
    return record, now


async def tick(client: k8s.K8sClient, isvc: Mapping[str, Any], state: AutoscalerState, *,
               settings: ScrapeSettings, clock: Callable[[], float],
               ) -> tuple[AutoscalerState, Decision | None]:
    """Observe, decide and act once; returns the new state and the decision (None: no-op)."""
    meta = isvc["metadata"]
    name, namespace = str(meta["name"]), meta.get("namespace")
    try:
        spec = parse_spec(name, isvc.get("spec"))
    except SpecError:
        return state, None  # the reconcile reports a bad spec; nothing to scale
    policy = spec.autoscaling
    if policy.mode != "builtin" and spec.cost.per_hour is None:
        return AutoscalerState(), None
    pods = await client.list(k8s.PODS, namespace,
                             label_selector=labels.managed_pod_labels(name))
    multi = spec.is_multi_node
    ready = [p for p in pods if is_ready(p)
             and labels.is_serving_pod(p["metadata"].get("labels") or {}, multi)]
    samples = await scrape_pods(client, ready, settings=settings, model_name=spec.model.name,
                                clock=clock)
    now = clock()
    max_age = stale_after_seconds(policy)
    window = state.window.record(samples, ready_pod_names=[p["metadata"]["name"] for p in ready],
                                 now=now, horizon_seconds=max(max_age, RATE_WINDOW_SECONDS))
    cost_record, cost_written_at = await write_cost(client, isvc, spec.cost, pods, multi,
                                                    window, state, now)
    if policy.mode != "builtin":
        return AutoscalerState(window=window, cost_record=cost_record,
                               cost_written_at=cost_written_at), None
    previous = (isvc.get("status") or {}).get("autoscaling") or {}
    done = AutoscalerState(window=window, cost_record=cost_record,
                           cost_written_at=cost_written_at)
    if spec.disaggregation is None:
        scaled, decision = await _scale(client, isvc, spec, None, pods, ready, window, state,
                                        previous, now)
        return replace(scaled, window=window, cost_record=cost_record,
                       cost_written_at=cost_written_at), decision
    role_to_state: dict[str, AutoscalerState] = {}
    last: Decision | None = None
    for role, rspec in role_specs(spec).items():
        mine = [p for p in pods if labels.role_of(p["metadata"].get("labels") or {}) == role]
        mine_ready = [p for p in ready
                      if labels.role_of(p["metadata"].get("labels") or {}) == role]
        role_to_state[role], last = await _scale(
            client, isvc, rspec, role, mine, mine_ready,
            window.only(p["metadata"]["name"] for p in mine_ready),
            state.role_to_state.get(role, AutoscalerState()),
            (previous.get("roles") or {}).get(role), now)
    return replace(done, role_to_state=role_to_state), last


async def _scale(client: k8s.K8sClient, isvc: Mapping[str, Any], spec: InferenceServiceSpec,
                 role: str | None, pods: Sequence[Mapping[str, Any]],
                 ready: Sequence[Mapping[str, Any]], window: SampleWindow,
                 state: AutoscalerState, previous: Mapping[str, Any] | None, now: float,
                 ) -> tuple[AutoscalerState, Decision]:
    """Decide and act for one pool: the service, or one role of it (`spec` its role spec)."""
    meta = isvc["metadata"]
    policy, multi = spec.autoscaling, spec.is_multi_node
    history = state.history if state.history is not None else History.from_status(
        previous, now=now, max_gap_seconds=STATUS_HEARTBEAT_SECONDS + 2 * policy.interval_seconds)
    current = spec.replicas if spec.replicas is not None else policy.min_replicas
    num_unschedulable = len({labels.replica_of(p["metadata"]["name"],
                                                p["metadata"].get("labels") or {}, multi)
                             for p in pods if is_unschedulable(p)})
    decision = decide(policy, current, window, num_unschedulable, history, now)
    history = history.record(now, decision.recommendation, policy.scale_down_delay_seconds)
    plan = make_plan(decision, ready_pods=[] if multi else ready, window=window,
                     history=history, state=state, previous=previous or None, now=now,
                     max_age_seconds=stale_after_seconds(policy))
    await execute(client, isvc, plan, role)
    if plan.event is not None:
        log.info("%s/%s: %s%s %s", meta.get("namespace"), meta["name"],
                 f"{role} " if role else "", plan.event[1], plan.event[2])
    written = plan.status is not None
    return AutoscalerState(history=history,
                           last_record=plan.status if written else state.last_record,
                           last_written_at=now if written else state.last_written_at), decision
