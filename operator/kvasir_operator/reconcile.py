"""One idempotent, level-based reconcile of an InferenceService: observe, plan, execute.

The spec is parsed once per reconcile (`parse`) and the typed result is shared by the model
probe, the plan and the status. `plan` is pure (kubeai's calculatePodPlan): from the CR and the
observed children it decides the manifests to server-side apply, the children to delete, the
status patch (None when nothing changed) and the Events to post. `execute` does the I/O: every
child is applied on its own (one refused Deployment does not keep the Service from being applied),
and the status is written whatever failed, with Ready=False naming the failed children and the
API server's message. An Event is posted only when a condition's message or generation changes,
so a failure retried with backoff explains itself once, not every retry.

The workload is a Deployment, or a LeaderWorkerSet when one replica spans several pods
(pipeline parallelism); the other kind, left from before a change of
`engine.pipelineParallelSize`, is deleted. A LeaderWorkerSet is rendered only where the server
serves its API (discovery, every reconcile, so installing LWS later needs no restart); where it
does not, nothing is created and Ready=False says what to install. A disaggregated service
(`spec.disaggregation`) has one Deployment per role instead (render_role_deployments); turning
it on or off deletes the workloads of the other shape once the new ones are applied.

What is observed comes from the informers' caches (informer.py: the client every caller gets is a
`CachedClient`), so a reconcile of a converged service makes no request at all; a child is
applied only when what the cache holds differs from what is rendered (`is_applied`), and the
status only when it changed. Children carry a controller ownerReference, so deleting the
InferenceService deletes them through the garbage collector, with no finalizer that could wedge
the deletion.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Awaitable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from kvasir_operator import k8s, labels
from kvasir_operator.capacity import CapacityReport, check_capacity
from kvasir_operator.disaggregation import ROLES, role_specs
from kvasir_operator.informer import POD_SCHEDULING_EVENTS
from kvasir_operator.modelprobe import ModelFacts, ModelProbe, facts_from_spec
from kvasir_operator.render import (
    Owner,
    render_pdb,
    render_role_deployments,
    render_service,
    render_workload,
    service_url,
)
from kvasir_operator.spec import InferenceServiceSpec, SpecError, spec_hash
from kvasir_operator.spec_parse import parse_spec
from kvasir_operator.status import Observed, derive_status, with_apply_failures, with_not_ready

Body = Mapping[str, Any]
log = logging.getLogger(__name__)
OPERATOR_STATUS_KEYS_SKIP = ("autoscaling", "cost")  # written by the metrics loop only
LWS_API_MISSING = "LeaderWorkerSetAPIMissing"
LWS_API_MISSING_MESSAGE = (
    f"spec.engine.pipelineParallelSize > 1 runs each replica as a LeaderWorkerSet group, and "
    f"this cluster does not serve {k8s.LEADERWORKERSETS.plural}.{labels.LWS_API_VERSION}: "
    f"install LeaderWorkerSet {labels.LWS_MIN_RELEASE} or newer "
    f"(https://github.com/kubernetes-sigs/lws, e.g. its Helm chart "
    f"oci://registry.k8s.io/lws/charts/lws); nothing is created until it is served")


@dataclass(frozen=True)
class Children:
    deployment: Body | None = None
    lws: Body | None = None  # the LeaderWorkerSet
    is_lws_served: bool = False  # whether the server serves the LeaderWorkerSet API
    service: Body | None = None
    pdb: Body | None = None
    pods: tuple[Body, ...] = ()
    events: tuple[Body, ...] = ()
    engine_service_account: str | None = None  # the chart's engine SA, when it exists here
    # A disaggregated service's Deployments, by role (present or left from before).
    role_to_deployment: Mapping[str, Body | None] = field(default_factory=dict)


@dataclass(frozen=True)
class Plan:
    apply: tuple[dict[str, Any], ...] = ()
    delete: tuple[tuple[k8s.Resource, str], ...] = ()
    status_patch: dict[str, Any] | None = None
    events: tuple[tuple[str, str, str], ...] = ()  # (type, reason, message)
    spec_error: str | None = None
    status: dict[str, Any] = field(default_factory=dict)
    # Set by `execute`: the children that could not be applied or deleted (what, HTTP status,
    # message); the caller retries with backoff while it is not empty.
    failures: tuple[tuple[str, int, str], ...] = ()


def owner_of(body: Body) -> Owner:
    meta = body["metadata"]
    return Owner(name=meta["name"], namespace=meta.get("namespace") or "default",
                 uid=meta.get("uid") or "")


def parse(body: Body) -> InferenceServiceSpec | SpecError:
    """The typed spec, or the error naming the bad field."""
    try:
        return parse_spec(owner_of(body).name, body.get("spec"))
    except SpecError as e:
        return e


def _is_new(old_status: Body, ctype: str, message: str, generation: int | None) -> bool:
    """Whether the condition's message or generation changed (i.e. an Event is due)."""
    old = next((c for c in old_status.get("conditions") or [] if c.get("type") == ctype), None)
    return old is None or old.get("message") != message[:2048] or (
        old.get("observedGeneration") != generation)


async def observe(client: k8s.K8sClient, owner: Owner,
                  engine_service_account: str = labels.ENGINE_SERVICE_ACCOUNT) -> Children:
    name, ns = labels.child_name(owner.name), owner.namespace
    pods = await client.list(k8s.PODS, ns, label_selector=labels.managed_pod_labels(owner.name))
    pod_names = {p["metadata"]["name"] for p in pods}
    events = [e for e in await client.list(k8s.EVENTS, ns, field_selector=POD_SCHEDULING_EVENTS)
              if (e.get("involvedObject") or {}).get("name") in pod_names]
    sa_name = engine_service_account
    # Pods naming a missing ServiceAccount are never created: check before rendering it.
    engine_sa = sa_name if await client.get(k8s.SERVICEACCOUNTS, ns, sa_name) else None
    is_lws_served = await client.is_served(k8s.LEADERWORKERSETS)
    lws = (await client.get(k8s.LEADERWORKERSETS, ns, labels.group_set_name(owner.name))
           if is_lws_served else None)
    role_to_deployment = {role: await client.get(k8s.DEPLOYMENTS, ns,
                                                 labels.role_workload_name(owner.name, role))
                          for role in ROLES}
    return Children(deployment=await client.get(k8s.DEPLOYMENTS, ns, name), lws=lws,
                    role_to_deployment=role_to_deployment,
                    is_lws_served=is_lws_served,
                    service=await client.get(k8s.SERVICES, ns, name),
                    pdb=await client.get(k8s.PDBS, ns, name),
                    pods=tuple(pods), events=tuple(events), engine_service_account=engine_sa)


def _capacity(spec: InferenceServiceSpec, facts: ModelFacts) -> CapacityReport | None:
    """The capacity check; of a disaggregated service, each role's pods (their own GPUs): the
    first role that does not fit, else the decode role's figures."""
    weights = facts.weights_bytes
    if weights is None:
        return None
    role_to_spec = role_specs(spec) or {"": spec}
    reports = [(role, report) for role, s in role_to_spec.items()
               if (report := check_capacity(s, weights, facts.architecture)) is not None]
    if not reports:
        return None  # CPU pods, no GPU memory figure or no shape: not judged
    role, report = next(((r, c) for r, c in reports if not c.fits), reports[-1])
    return replace(report, message=f"{role}: {report.message}") if role else report


def _status_patch(old: Body, new: Mapping[str, Any]) -> dict[str, Any] | None:
    clean = {k: v for k, v in new.items() if v is not None}
    current = {k: v for k, v in old.items() if k not in OPERATOR_STATUS_KEYS_SKIP}
    if clean == current:
        return None
    return {**{k: None for k in current if k not in clean}, **clean}


def observed_workload(children: Children, spec: InferenceServiceSpec) -> Body | None:
    """The observed Deployment or LeaderWorkerSet, whichever the spec renders (for a
    disaggregated service: the decode role's, else the prefill role's)."""
    if spec.disaggregation is not None:
        roles = children.role_to_deployment
        return roles.get("decode") or roles.get("prefill")
    return children.lws if spec.is_multi_node else children.deployment


def _observed_workloads(children: Children, spec: InferenceServiceSpec,
                        workloads: Mapping[str | None, dict[str, Any]]
                        ) -> dict[str | None, Body | None]:
    """Key (a role, or None for the one workload) -> what is there for it."""
    if spec.disaggregation is not None:
        return {role: children.role_to_deployment.get(str(role)) for role in workloads}
    return {None: observed_workload(children, spec)}


def _child_events(workloads: Mapping[str | None, dict[str, Any]],
                  observed: Mapping[str | None, Body | None], service: Body,
                  seen_service: Body | None) -> list[tuple[str, str, str]]:
    events: list[tuple[str, str, str]] = []
    pairs = [(w, observed[key]) for key, w in workloads.items()] + [(service, seen_service)]
    for child, seen in pairs:
        if seen is None:
            events.append(("Normal", "Created",
                           f"created {child['kind']} {child['metadata']['name']}"))
    for key, workload in workloads.items():
        seen = observed[key]
        if seen is None:
            continue
        kind, name = workload["kind"], workload["metadata"]["name"]
        old_hash = (seen["metadata"].get("labels") or {}).get(labels.SPEC_HASH)
        new_hash = workload["metadata"]["labels"][labels.SPEC_HASH]
        if old_hash != new_hash:
            events.append(("Normal", "RollingOut", f"spec changed ({old_hash} -> {new_hash}): "
                                                   f"rolling the pods of {kind} {name}"))
        old_replicas, replicas = (seen.get("spec") or {}).get("replicas"), workload["spec"][
            "replicas"]
        if old_replicas != replicas:
            events.append(("Normal", "Scaled", f"{kind} {name} replicas {old_replicas} -> "
                                               f"{replicas}"))
    return events


def _last_apply_failed(old_status: Body) -> bool:
    ready = next((c for c in old_status.get("conditions") or [] if c.get("type") == "Ready"),
                 None)
    return ready is not None and ready.get("reason") in ("ApplyFailed", "InvalidSpec")


def stamped(rendered: dict[str, Any] | None) -> dict[str, Any] | None:
    """`rendered` carrying a digest of itself (the APPLIED_HASH annotation): a child that still
    carries it was applied from this very form, so a field we stopped rendering changes it."""
    if rendered is not None:
        digest = hashlib.sha256(json.dumps(rendered, sort_keys=True).encode()).hexdigest()[:16]
        rendered["metadata"].setdefault("annotations", {})[labels.APPLIED_HASH] = digest
    return rendered


def is_applied(rendered: dict[str, Any], seen: Body | None) -> bool:
    """Whether `seen` is the `stamped` form as last applied, unchanged since: every rendered
    field (its digest included) has its value, so a field someone else changed is applied
    back."""
    return seen is not None and contains(seen, rendered)


def contains(have: Any, want: Any) -> bool:
    """Whether `have` holds every field of `want` with the same value (lists item by item): an
    object as the API server keeps it (with its defaults and metadata) against what we apply."""
    if isinstance(want, dict):
        return isinstance(have, dict) and all(
            key in have and contains(have[key], value) for key, value in want.items())
    if isinstance(want, list):
        return (isinstance(have, list) and len(have) == len(want)
                and all(contains(h, w) for h, w in zip(have, want, strict=True)))
    return bool(have == want)


def _problem_events(status: Mapping[str, Any], old_status: Body,
                    generation: int | None) -> list[tuple[str, str, str]]:
    """What blocks the rollout (an engine crash loop, an image that cannot be pulled, a failed
    fetch, no GPU) as one Warning Event per distinct message, so `kubectl describe` shows it."""
    progressing = next((c for c in status.get("conditions") or []
                        if c.get("type") == "Progressing"), None)
    if (progressing is None or progressing.get("status") != "False"
            or progressing.get("reason") == "Complete"):
        return []
    message = str(progressing.get("message") or "")
    if not _is_new(old_status, "Progressing", message, generation):
        return []
    return [("Warning", str(progressing["reason"]), message or str(progressing["reason"]))]


def _stale_workload(children: Children, spec: InferenceServiceSpec, owner: Owner
                    ) -> list[tuple[k8s.Resource, str]]:
    """The workloads of the other shape, left from before pipelineParallelSize or
    disaggregation changed."""
    is_disaggregated = spec.disaggregation is not None
    stale: list[tuple[k8s.Resource, str]] = []
    if (spec.is_multi_node or is_disaggregated) and children.deployment is not None:
        stale.append((k8s.DEPLOYMENTS, labels.child_name(owner.name)))
    if not spec.is_multi_node and children.lws is not None:
        stale.append((k8s.LEADERWORKERSETS, labels.group_set_name(owner.name)))
    if not is_disaggregated:
        stale += [(k8s.DEPLOYMENTS, labels.role_workload_name(owner.name, role))
                  for role, seen in sorted(children.role_to_deployment.items())
                  if seen is not None]
    return stale


def plan(body: Body, children: Children, facts: ModelFacts | None = None,
         spec: InferenceServiceSpec | SpecError | None = None) -> Plan:
    """`facts`: the model's size and shape read from its source (None: the spec's fields);
    `spec`: the parsed spec (None: parse it here)."""
    owner = owner_of(body)
    meta, old_status = body["metadata"], body.get("status") or {}
    generation = meta.get("generation")
    spec = parse(body) if spec is None else spec
    if isinstance(spec, SpecError):
        return _refused(str(spec), old_status, generation)
    digest = spec_hash(spec)
    if facts is None:
        facts = facts_from_spec(spec, "NotInspected", "the source was not read")
    # A parallel layout the model's shape forbids would crash-loop on its GPUs: refused before.
    shape_error = (facts.architecture.tensor_parallel_error(spec.engine.tp_size)
                   if facts.architecture is not None else None)
    if shape_error is not None:
        return _refused(shape_error, old_status, generation)
    # The CRD's CEL rule keeps model.uri immutable where the API server runs CEL (1.25+);
    # this holds it everywhere else.
    served = ((observed_workload(children, spec) or {}).get("metadata", {})
              .get("annotations") or {}).get(labels.MODEL_URI)
    if served is not None and served != spec.model.uri:
        return _refused(f"spec.model.uri is immutable: this service serves {served}; create a "
                        f"new InferenceService to serve {spec.model.uri}", old_status,
                        generation)
    report = _capacity(spec, facts)
    extra = {"selector": labels.selector_string(owner.name, spec.is_multi_node),
             "url": service_url(spec, owner), "specHash": digest}
    capacity = report.to_status() if report else None
    if capacity is not None:
        capacity["inputsFrom"] = "source" if facts.from_source else "spec"
    workloads: dict[str | None, dict[str, Any]]
    if spec.disaggregation is not None:
        workloads = {role: w for role, w in render_role_deployments(
            spec, owner, facts.weights_bytes,
            service_account=children.engine_service_account).items()}
    else:
        workloads = {None: render_workload(spec, owner, digest, facts.weights_bytes,
                                           service_account=children.engine_service_account)}
    observed = _observed_workloads(children, spec, workloads)
    roles = {str(role): (seen, int(workloads[role]["spec"]["replicas"]))
             for role, seen in observed.items() if role is not None}
    obs = Observed(deployment=observed_workload(children, spec), roles=roles,
                   pods=children.pods, events=children.events,
                   capacity=capacity, capacity_fits=report.fits if report else None,
                   inspection=(facts.from_source, facts.reason, facts.message), extra=extra)
    desired = sum(int(w["spec"]["replicas"]) for w in workloads.values())
    status = derive_status(obs, desired=desired, generation=generation,
                           is_local_model=spec.model.source.is_local,
                           gpu_resource=spec.resources.gpu_resource_name, old=old_status)
    patch = _status_patch(old_status, status)
    if report is not None and not report.fits:
        # Refuse before any GPU is spent: nothing is rendered while the model cannot fit.
        was = any(c.get("type") == "CapacityFits" and c.get("status") == "False"
                  for c in old_status.get("conditions") or [])
        refusal = () if was else (("Warning", "InsufficientGPUMemory", report.message),)
        return Plan(status_patch=patch, events=refusal, status=status)
    if spec.is_multi_node and not children.is_lws_served:
        status = with_not_ready(status, LWS_API_MISSING, LWS_API_MISSING_MESSAGE, old_status,
                                generation)
        is_new = _is_new(old_status, "Ready", LWS_API_MISSING_MESSAGE, generation)
        missing = (("Warning", LWS_API_MISSING, LWS_API_MISSING_MESSAGE),) if is_new else ()
        return Plan(status_patch=_status_patch(old_status, status), events=missing,
                    status=status)
    service = render_service(spec, owner)
    delete = _stale_workload(children, spec, owner)
    pdb = render_pdb(spec, owner)
    if pdb is None and children.pdb is not None:
        delete.append((k8s.PDBS, labels.child_name(owner.name)))
    # Written only where what is there differs from what we render: a server-side apply of an
    # unchanged child still bumps its resourceVersion (managedFields' time), a write per child
    # and tick while nothing changes (issue 35). Drift by anyone else is a difference; after a
    # failed apply every child is applied again.
    retry_all = _last_apply_failed(old_status)
    pairs = [(stamped(w), observed[key]) for key, w in workloads.items()]
    pairs += [(stamped(service), children.service), (stamped(pdb), children.pdb)]
    apply = [rendered for rendered, seen in pairs
             if rendered is not None and (retry_all or not is_applied(rendered, seen))]
    child_events = _child_events(workloads, observed, service, children.service)
    child_events += _problem_events(status, old_status, generation)
    return Plan(apply=tuple(apply), delete=tuple(delete), status_patch=patch,
                events=tuple(child_events), status=status)


def _refused(error: str, old_status: Body, generation: int | None) -> Plan:
    """An invalid spec: Ready=False InvalidSpec, nothing rendered, one Warning Event per
    distinct message."""
    status = derive_status(Observed(spec_error=error), desired=0, generation=generation,
                           is_local_model=False, gpu_resource="", old=old_status)
    patch = _status_patch(old_status, status)
    is_new = _is_new(old_status, "SpecValid", error, generation)
    events = (("Warning", "InvalidSpec", error),) if is_new else ()
    return Plan(status_patch=patch, events=events, spec_error=error, status=status)


async def _attempt(what: str, call: Awaitable[Any], failures: list[tuple[str, int, str]]
                   ) -> None:
    """Await one API call; an ApiError is recorded in `failures`, not raised."""
    try:
        await call
    except k8s.ApiError as e:
        log.warning("%s: HTTP %s %s: %s", what, e.status, e.reason, e.message)
        failures.append((what, e.status, e.message))


async def execute(client: k8s.K8sClient, body: Body, the_plan: Plan) -> Plan:
    """Apply every child independently, then post Events and write the status (always).

    Returns the plan as executed: with `failures`, and the status and Events that say so."""
    owner = owner_of(body)
    failures: list[tuple[str, int, str]] = []
    for manifest in the_plan.apply:
        what = f"{manifest['kind']} {manifest['metadata']['name']}"
        await _attempt(what, client.apply(manifest), failures)
    for res, name in the_plan.delete:
        await _attempt(f"{res.kind} {name} (delete)", client.delete(res, owner.namespace, name),
                       failures)
    done = the_plan
    if failures:
        old_status = body.get("status") or {}
        generation = body["metadata"].get("generation")
        status = with_apply_failures(the_plan.status, failures, old_status, generation)
        ready = next(c for c in status["conditions"] if c["type"] == "Ready")
        # Nothing was created, rolled or scaled where the apply failed.
        events = tuple(e for e in the_plan.events if not any(f[0] in e[2] for f in failures))
        if _is_new(old_status, "Ready", str(ready["message"]), generation):
            events += (("Warning", str(ready["reason"]), str(ready["message"])),)
        done = Plan(apply=the_plan.apply, delete=the_plan.delete, events=events,
                    status_patch=_status_patch(old_status, status), status=status,
                    spec_error=the_plan.spec_error, failures=tuple(failures))
    for type_, reason, message in done.events:
        await _attempt(f"Event {reason}", client.post_event(body, type_, reason, message), [])
    if done.status_patch is not None:
        await client.patch_status(k8s.INFERENCESERVICES, owner.namespace, owner.name,
                                  done.status_patch)
    return done


async def _facts(client: k8s.K8sClient, body: Body, spec: InferenceServiceSpec | SpecError,
                 probe: ModelProbe | None) -> ModelFacts | None:
    if probe is None or isinstance(spec, SpecError):
        return None  # plan() reports a bad spec
    owner = owner_of(body)
    return await probe.facts(client, owner.namespace, owner.name,
                             body["metadata"].get("generation"), spec)


async def reconcile(client: k8s.K8sClient, body: Body, probe: ModelProbe | None = None, *,
                    engine_service_account: str = labels.ENGINE_SERVICE_ACCOUNT) -> Plan:
    """Observe, plan, execute; returns the executed plan (its spec_error says if the spec is
    invalid, its failures which children could not be applied).

    With a `probe`, the model's size and shape are read from its source first (cached)."""
    spec = parse(body)
    children = await observe(client, owner_of(body), engine_service_account)
    the_plan = plan(body, children, await _facts(client, body, spec, probe), spec)
    return await execute(client, body, the_plan)
