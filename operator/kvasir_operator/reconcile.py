"""One idempotent, level-based reconcile of an InferenceService: observe, plan, execute.

`plan` is pure (kubeai's calculatePodPlan): from the CR and the observed children it decides the
manifests to server-side apply, the children to delete, the status patch (None when nothing
changed) and the Events to post. `execute` does the I/O. Applying every time is deliberate: SSA
with force is a no-op when nothing differs and repairs hand-made drift when something does.
Children carry a controller ownerReference, so deleting the InferenceService deletes them through
the garbage collector, with no finalizer that could wedge the deletion.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kvasir_operator import k8s, labels
from kvasir_operator.capacity import CapacityReport, check_capacity
from kvasir_operator.modelprobe import ModelFacts, ModelProbe, facts_from_spec
from kvasir_operator.render import Owner, render_deployment, render_pdb, render_service, service_url
from kvasir_operator.spec import InferenceServiceSpec, SpecError, spec_hash
from kvasir_operator.spec_parse import parse_spec
from kvasir_operator.status import Observed, derive_status

Body = Mapping[str, Any]
OPERATOR_STATUS_KEYS_SKIP = ("autoscaling",)  # written by the autoscaler only


@dataclass(frozen=True)
class Children:
    deployment: Body | None = None
    service: Body | None = None
    pdb: Body | None = None
    pods: tuple[Body, ...] = ()
    events: tuple[Body, ...] = ()
    engine_service_account: str | None = None  # the chart's engine SA, when it exists here


@dataclass(frozen=True)
class Plan:
    apply: tuple[dict[str, Any], ...] = ()
    delete: tuple[tuple[k8s.Resource, str], ...] = ()
    status_patch: dict[str, Any] | None = None
    events: tuple[tuple[str, str, str], ...] = ()  # (type, reason, message)
    spec_error: str | None = None
    status: dict[str, Any] = field(default_factory=dict)


def owner_of(body: Body) -> Owner:
    meta = body["metadata"]
    return Owner(name=meta["name"], namespace=meta.get("namespace") or "default",
                 uid=meta.get("uid") or "")


async def observe(client: k8s.K8sClient, owner: Owner) -> Children:
    name, ns = labels.child_name(owner.name), owner.namespace
    pods = await client.list(k8s.PODS, ns, label_selector=labels.selector_labels(owner.name))
    pod_names = {p["metadata"]["name"] for p in pods}
    events = [e for e in await client.list(k8s.EVENTS, ns, field_selector="involvedObject.kind=Pod")
              if (e.get("involvedObject") or {}).get("name") in pod_names]
    sa_name = os.environ.get("KVASIR_ENGINE_SERVICE_ACCOUNT", labels.ENGINE_SERVICE_ACCOUNT)
    # Pods naming a missing ServiceAccount are never created: check before rendering it.
    engine_sa = sa_name if await client.get(k8s.SERVICEACCOUNTS, ns, sa_name) else None
    return Children(deployment=await client.get(k8s.DEPLOYMENTS, ns, name),
                    service=await client.get(k8s.SERVICES, ns, name),
                    pdb=await client.get(k8s.PDBS, ns, name),
                    pods=tuple(pods), events=tuple(events), engine_service_account=engine_sa)


def _capacity(spec: InferenceServiceSpec, facts: ModelFacts) -> CapacityReport | None:
    weights = facts.weights_bytes
    return None if weights is None else check_capacity(spec, weights, facts.architecture)


def _status_patch(old: Body, new: Mapping[str, Any]) -> dict[str, Any] | None:
    clean = {k: v for k, v in new.items() if v is not None}
    current = {k: v for k, v in old.items() if k not in OPERATOR_STATUS_KEYS_SKIP}
    if clean == current:
        return None
    return {**{k: None for k in current if k not in clean}, **clean}


def _child_events(children: Children, deployment: Body, spec: InferenceServiceSpec
                  ) -> list[tuple[str, str, str]]:
    name = deployment["metadata"]["name"]
    events: list[tuple[str, str, str]] = []
    for kind, observed in (("Deployment", children.deployment), ("Service", children.service)):
        if observed is None:
            events.append(("Normal", "Created", f"created {kind} {name}"))
    dep = children.deployment
    if dep is not None:
        old_hash = (dep["metadata"].get("labels") or {}).get(labels.SPEC_HASH)
        new_hash = deployment["metadata"]["labels"][labels.SPEC_HASH]
        if old_hash != new_hash:
            events.append(("Normal", "RollingOut", f"spec changed ({old_hash} -> {new_hash}): "
                                                   f"rolling the pods of Deployment {name}"))
        old_replicas = (dep.get("spec") or {}).get("replicas")
        if old_replicas != spec.desired_replicas:
            events.append(("Normal", "Scaled", f"Deployment {name} replicas {old_replicas} -> "
                                               f"{spec.desired_replicas}"))
    return events


def plan(body: Body, children: Children, facts: ModelFacts | None = None) -> Plan:
    """`facts`: the model's size and shape read from its source (None: the spec's fields)."""
    owner = owner_of(body)
    meta, old_status = body["metadata"], body.get("status") or {}
    generation = meta.get("generation")
    try:
        spec = parse_spec(owner.name, body.get("spec"))
    except SpecError as e:
        status = derive_status(Observed(spec_error=str(e)), desired=0, generation=generation,
                               is_local_model=False, gpu_resource="", old=old_status)
        patch = _status_patch(old_status, status)
        old_msg = next((c.get("message") for c in old_status.get("conditions") or []
                        if c.get("type") == "SpecValid"), None)
        events = () if old_msg == str(e) else (("Warning", "InvalidSpec", str(e)),)
        return Plan(status_patch=patch, events=events, spec_error=str(e), status=status)
    digest = spec_hash(spec)
    if facts is None:
        facts = facts_from_spec(spec, "NotInspected", "the source was not read")
    report = _capacity(spec, facts)
    extra = {"selector": labels.selector_string(owner.name), "url": service_url(spec, owner),
             "specHash": digest}
    capacity = report.to_status() if report else None
    if capacity is not None:
        capacity["inputsFrom"] = "source" if facts.from_source else "spec"
    obs = Observed(deployment=children.deployment, pods=children.pods, events=children.events,
                   capacity=capacity, capacity_fits=report.fits if report else None,
                   inspection=(facts.from_source, facts.reason, facts.message), extra=extra)
    status = derive_status(obs, desired=spec.desired_replicas, generation=generation,
                           is_local_model=spec.model.uri.startswith("/"),
                           gpu_resource=spec.resources.gpu_resource_name, old=old_status)
    patch = _status_patch(old_status, status)
    if report is not None and not report.fits:
        # Refuse before any GPU is spent: nothing is rendered while the model cannot fit.
        was = any(c.get("type") == "CapacityFits" and c.get("status") == "False"
                  for c in old_status.get("conditions") or [])
        refusal = () if was else (("Warning", "InsufficientGPUMemory", report.message),)
        return Plan(status_patch=patch, events=refusal, status=status)
    deployment = render_deployment(spec, owner, digest, facts.weights_bytes,
                                   service_account=children.engine_service_account)
    apply: list[dict[str, Any]] = [deployment, render_service(spec, owner)]
    delete: list[tuple[k8s.Resource, str]] = []
    pdb = render_pdb(spec, owner)
    if pdb is not None:
        apply.append(pdb)
    elif children.pdb is not None:
        delete.append((k8s.PDBS, labels.child_name(owner.name)))
    child_events = _child_events(children, deployment, spec)
    return Plan(apply=tuple(apply), delete=tuple(delete), status_patch=patch,
                events=tuple(child_events), status=status)


async def execute(client: k8s.K8sClient, body: Body, the_plan: Plan) -> None:
    owner = owner_of(body)
    for manifest in the_plan.apply:
        await client.apply(manifest)
    for res, name in the_plan.delete:
        await client.delete(res, owner.namespace, name)
    for type_, reason, message in the_plan.events:
        await client.post_event(body, type_, reason, message)
    if the_plan.status_patch is not None:
        await client.patch_status(k8s.INFERENCESERVICES, owner.namespace, owner.name,
                                  the_plan.status_patch)


async def _facts(client: k8s.K8sClient, body: Body, probe: ModelProbe | None
                 ) -> ModelFacts | None:
    owner = owner_of(body)
    try:
        spec = parse_spec(owner.name, body.get("spec"))
    except SpecError:
        return None  # plan() reports it
    if probe is None:
        return None
    return await probe.facts(client, owner.namespace, owner.name,
                             body["metadata"].get("generation"), spec)


async def reconcile(client: k8s.K8sClient, body: Body, probe: ModelProbe | None = None) -> Plan:
    """Observe, plan, execute; returns the plan (its spec_error says if the spec is invalid).

    With a `probe`, the model's size and shape are read from its source first (cached)."""
    children = await observe(client, owner_of(body))
    the_plan = plan(body, children, await _facts(client, body, probe))
    await execute(client, body, the_plan)
    return the_plan
