"""Thin kopf handlers: every trigger calls the one level-based `reconcile`.

create/update/resume reconcile the InferenceService. Watching the Deployments, LeaderWorkerSets,
Services and PDBs (by the managed-by label, with `on.event`) brings a child deleted by hand back
at once and refreshes status when the workload's readiness moves. Where the LeaderWorkerSet API
is not installed kopf only logs that it cannot watch it, and starts watching once its CRD appears. A reconcile that could not apply a child
raises `kopf.TemporaryError` with an exponential, capped delay (`Settings.retry_delay`); the
status and one Event already say why.

No handler here needs a finalizer, so kopf adds none and removes the one older versions added:
there is no on.delete handler (owner references let the garbage collector delete the children),
and the periodic reconcile and the builtin autoscaler are `ObjectLoops` tasks started from the
InferenceService's own watch events instead of `@kopf.timer` / `@kopf.daemon`, which kopf guards
with a finalizer. Deleting an InferenceService therefore never waits for the operator.

The settings, the K8sClient (a `CachedClient`: reads from informers, see informer.py), the model
probe and the loops live in kopf's `memo`.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Mapping
from typing import Any

import kopf

from kvasir_operator import k8s, kubeauth, labels
from kvasir_operator.autoscale.loop import loop_policy, run_autoscaler
from kvasir_operator.autoscale.scrape import ScrapeSettings
from kvasir_operator.informer import CachedClient
from kvasir_operator.loops import ObjectLoops
from kvasir_operator.metrics import OperatorMetrics
from kvasir_operator.modelprobe import ModelProbe
from kvasir_operator.reconcile import Plan, reconcile
from kvasir_operator.settings import Settings

MANAGED = {labels.MANAGED_BY: labels.OPERATOR}
ISVC = (labels.GROUP, labels.VERSION, labels.PLURAL)
log = logging.getLogger(__name__)


@kopf.on.startup()
async def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    # Never added (no handler needs one); named so that kopf removes the one older versions put.
    settings.persistence.finalizer = f"{labels.KOPF_PREFIX}/kopf-finalizer"
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(
        prefix=labels.KOPF_PREFIX)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=labels.KOPF_PREFIX, key="last-handled-configuration")
    settings.posting.level = logging.WARNING  # our own Events say what was done
    settings.peering.standalone = True  # one replica with Recreate: peering is not needed
    if not isinstance(getattr(memo, "settings", None), Settings):
        # `kopf run -m kvasir_operator.handlers` (no main.py): the same settings, from the env.
        memo.settings = Settings.from_env(os.environ)
    if not hasattr(memo, "k8s"):
        # main.py says whether kopf serves every namespace: then one informer per resource.
        memo.k8s = CachedClient.from_settings(
            memo.settings, cluster_wide=bool(getattr(memo, "cluster_wide", False)))
    memo.locks = {}
    if not hasattr(memo, "model_probe"):
        memo.model_probe = ModelProbe.from_settings(memo.settings)
    if not hasattr(memo, "metrics"):  # main.py serves its own; `kopf run` gets one unserved
        memo.metrics = OperatorMetrics()
    memo.loops = ObjectLoops()


def _settings(memo: kopf.Memo) -> Settings:
    value = memo.settings
    assert isinstance(value, Settings)
    return value


@kopf.on.login()
def login(memo: kopf.Memo, **_: Any) -> kopf.ConnectionInfo:
    """kopf's own API access, from the same loader as our K8sClient, with a credential read
    now: kopf calls this again whenever the API server refuses the one it has (rotation)."""
    return kubeauth.kopf_connection(kubeauth.load_config(_settings(memo)))  # after startup


@kopf.on.cleanup()
async def close(memo: kopf.Memo, **_: Any) -> None:
    loops = getattr(memo, "loops", None)
    if isinstance(loops, ObjectLoops):
        await loops.close()
    client = getattr(memo, "k8s", None)
    if isinstance(client, k8s.K8sClient):
        await client.close()


def _metrics(memo: kopf.Memo) -> OperatorMetrics:
    value = memo.metrics
    assert isinstance(value, OperatorMetrics)
    return value


def _client(memo: kopf.Memo) -> k8s.K8sClient:
    client = memo.k8s
    assert isinstance(client, k8s.K8sClient)
    return client


async def _reconcile(memo: kopf.Memo, body: Mapping[str, Any]) -> Plan:
    """One reconcile at a time per InferenceService (handlers and child events overlap)."""
    meta = body["metadata"]
    locks: dict[str, asyncio.Lock] = memo.locks
    lock = locks.setdefault(f"{meta.get('namespace')}/{meta['name']}", asyncio.Lock())
    probe = getattr(memo, "model_probe", None)
    async with lock:
        # Re-read under the lock (from the cache, which holds what our last write returned):
        # the body a handler got may predate the status the previous reconcile wrote, and that
        # status is what says whether an Event was already posted.
        fresh = await _client(memo).get(k8s.INFERENCESERVICES, meta.get("namespace"),
                                        meta["name"])
        if fresh is None or (fresh.get("metadata") or {}).get("uid") != meta.get("uid"):
            return Plan()  # deleted (or replaced) meanwhile: nothing to do for this one
        try:
            done = await reconcile(_client(memo), fresh,
                                   probe if isinstance(probe, ModelProbe) else None,
                                   engine_service_account=_settings(memo).engine_service_account)
        except k8s.ApiError:
            _metrics(memo).observe_api_error(meta.get("namespace"), meta["name"])
            raise
        _metrics(memo).observe_reconcile(meta.get("namespace"), meta["name"], done.status,
                                         done.failures, done.spec_error)
        return done


async def _reconcile_or_retry(memo: kopf.Memo, body: Mapping[str, Any], retry: int) -> None:
    delay = _settings(memo).retry_delay(retry)
    try:
        the_plan = await _reconcile(memo, body)
    except k8s.ApiError as e:  # could not observe, or could not write the status
        raise kopf.TemporaryError(f"reconcile failed: {e}; retry in {delay:g} s",
                                  delay=delay) from e
    if the_plan.spec_error is not None:
        # Retrying cannot fix a spec; the condition and the Event are already written.
        raise kopf.PermanentError(the_plan.spec_error)
    if the_plan.failures:
        what = ", ".join(f[0] for f in the_plan.failures)
        raise kopf.TemporaryError(f"could not apply {what}; retry in {delay:g} s", delay=delay)


@kopf.on.create(*ISVC)
@kopf.on.update(*ISVC)
@kopf.on.resume(*ISVC)
async def on_change(body: kopf.Body, memo: kopf.Memo, retry: int, **_: Any) -> None:
    await _reconcile_or_retry(memo, body, retry)


async def _resync(memo: kopf.Memo, namespace: str | None, name: str, uid: str) -> None:
    """The slow safety net: reconcile every interval (longer while reconciles fail)."""
    settings, num_failures = _settings(memo), 0
    while True:
        await asyncio.sleep(max(settings.reconcile_interval_seconds,
                                settings.retry_delay(num_failures - 1) if num_failures else 0))
        try:
            body = await _client(memo).get(k8s.INFERENCESERVICES, namespace, name)
            if body is None or (body.get("metadata") or {}).get("uid") != uid:
                return
            the_plan = await _reconcile(memo, body)
            num_failures = num_failures + 1 if the_plan.failures else 0
        except asyncio.CancelledError:
            raise
        except Exception as e:  # API down, credentials unreadable: retried, never stops the loop
            num_failures += 1
            log.warning("%s/%s: periodic reconcile failed: %s", namespace, name, e)


@kopf.on.event(*ISVC)
async def on_isvc_event(event: kopf.RawEvent, memo: kopf.Memo, **_: Any) -> None:
    """Start the object's loops on its first event; stop them when it goes."""
    obj = event["object"]
    _seen(memo, event)
    meta = obj.get("metadata") or {}
    uid, name, namespace = str(meta.get("uid") or ""), str(meta.get("name")), meta.get("namespace")
    loops: ObjectLoops = memo.loops
    if event.get("type") == "DELETED" or meta.get("deletionTimestamp"):
        loops.stop(uid)
        _metrics(memo).forget(namespace, name)
        return
    loops.ensure(uid, "resync", lambda: _resync(memo, namespace, name, uid))
    if loop_policy(obj) is not None:
        scrape = ScrapeSettings.from_settings(_settings(memo))
        metrics = _metrics(memo)
        loops.ensure(uid, "autoscale", lambda: run_autoscaler(
            _client(memo), namespace, name, scrape,
            on_decision=lambda reason: metrics.observe_decision(namespace, name, reason)))
    else:
        loops.stop(uid, "autoscale")


def _seen(memo: kopf.Memo, event: kopf.RawEvent) -> None:
    client = _client(memo)
    if isinstance(client, CachedClient):
        client.seen(event)


def _owner_name(child: Mapping[str, Any]) -> str | None:
    for ref in (child.get("metadata") or {}).get("ownerReferences") or []:
        if ref.get("kind") == labels.KIND and ref.get("apiVersion") == labels.API_VERSION:
            return str(ref["name"])
    return None


async def _reconcile_owner(child: Mapping[str, Any], memo: kopf.Memo, *,
                           only_if_counts_moved: bool) -> None:
    name, namespace = _owner_name(child), (child.get("metadata") or {}).get("namespace")
    if name is None:
        return
    client = _client(memo)
    owner = await client.get(k8s.INFERENCESERVICES, namespace, name)
    if owner is None or (owner.get("metadata") or {}).get("deletionTimestamp"):
        return
    if only_if_counts_moved:
        seen, known = child.get("status") or {}, owner.get("status") or {}
        role = labels.role_of((child.get("metadata") or {}).get("labels") or {})
        if role is not None:  # a disaggregated role's Deployment: its own counts
            known = (known.get("roles") or {}).get(role) or {}
        if all(int(seen.get(k) or 0) == int(known.get(k) or 0)
               for k in ("replicas", "readyReplicas")):
            return
    await _reconcile(memo, owner)


@kopf.on.event("apps", "v1", "deployments", labels=MANAGED)
@kopf.on.event(labels.LWS_GROUP, labels.LWS_VERSION, "leaderworkersets", labels=MANAGED)
async def on_workload(event: kopf.RawEvent, memo: kopf.Memo, **_: Any) -> None:
    _seen(memo, event)
    await _reconcile_owner(event["object"], memo,
                           only_if_counts_moved=event.get("type") != "DELETED")


@kopf.on.event("", "v1", "services", labels=MANAGED)
@kopf.on.event("policy", "v1", "poddisruptionbudgets", labels=MANAGED)
async def on_other_child(event: kopf.RawEvent, memo: kopf.Memo, **_: Any) -> None:
    _seen(memo, event)
    if event.get("type") == "DELETED":
        await _reconcile_owner(event["object"], memo, only_if_counts_moved=False)
