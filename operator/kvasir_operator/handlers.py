"""Thin kopf handlers: every trigger calls the one level-based `reconcile`.

create/update/resume and a periodic timer reconcile the InferenceService. Watching the
Deployments, Services and PDBs (by the managed-by label, with `on.event`, so no finalizer is ever
put on them) brings a child deleted by hand back at once and refreshes status when the
Deployment's readiness moves. The K8sClient lives in kopf's `memo` (memo.k8s), created at startup.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Mapping
from typing import Any

import kopf

from kvasir_operator import k8s, labels
from kvasir_operator.modelprobe import ModelProbe
from kvasir_operator.reconcile import Plan, reconcile

# A slow safety net; children's events do the fast path. Env so tests can shorten it.
RECONCILE_INTERVAL_SECONDS = float(os.environ.get("KVASIR_RECONCILE_INTERVAL_SECONDS", "60"))
MANAGED = {labels.MANAGED_BY: labels.OPERATOR}
ISVC = (labels.GROUP, labels.VERSION, labels.PLURAL)


@kopf.on.startup()
async def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    settings.persistence.finalizer = f"{labels.KOPF_PREFIX}/kopf-finalizer"
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(
        prefix=labels.KOPF_PREFIX)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=labels.KOPF_PREFIX, key="last-handled-configuration")
    settings.posting.level = logging.WARNING  # our own Events say what was done
    settings.peering.standalone = True  # one replica with Recreate: peering is not needed
    if not hasattr(memo, "k8s"):
        memo.k8s = k8s.K8sClient.from_config()
    memo.locks = {}
    if not hasattr(memo, "model_probe"):
        memo.model_probe = ModelProbe.from_env()


async def _reconcile(memo: kopf.Memo, body: Mapping[str, Any]) -> Plan:
    """One reconcile at a time per InferenceService (handlers and child events overlap)."""
    meta = body["metadata"]
    locks: dict[str, asyncio.Lock] = memo.locks
    lock = locks.setdefault(f"{meta.get('namespace')}/{meta['name']}", asyncio.Lock())
    probe = getattr(memo, "model_probe", None)
    async with lock:
        return await reconcile(_client(memo), body,
                               probe if isinstance(probe, ModelProbe) else None)


@kopf.on.login()
def login(**_: Any) -> kopf.ConnectionInfo:
    """kopf's own API access, from the same configuration as our K8sClient."""
    cfg = k8s.load_config()
    auth = cfg.get_api_key_with_prefix("authorization")
    scheme, _sep, token = str(auth or "").partition(" ")
    return kopf.ConnectionInfo(
        server=cfg.host, ca_path=cfg.ssl_ca_cert, insecure=not cfg.verify_ssl,
        scheme=scheme or None, token=token or None, certificate_path=cfg.cert_file,
        private_key_path=cfg.key_file, default_namespace=None)


@kopf.on.cleanup()
async def close(memo: kopf.Memo, **_: Any) -> None:
    client = getattr(memo, "k8s", None)
    if isinstance(client, k8s.K8sClient):
        await client.close()


def _client(memo: kopf.Memo) -> k8s.K8sClient:
    client = memo.k8s
    assert isinstance(client, k8s.K8sClient)
    return client


@kopf.on.create(*ISVC, backoff=10)
@kopf.on.update(*ISVC, backoff=10)
async def on_change(body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    the_plan = await _reconcile(memo, body)
    if the_plan.spec_error is not None:
        # Retrying cannot fix a spec; the condition and the Event are already written.
        raise kopf.PermanentError(the_plan.spec_error)


@kopf.on.resume(*ISVC, backoff=10)
async def on_resume(body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    await _reconcile(memo, body)


@kopf.timer(*ISVC, interval=RECONCILE_INTERVAL_SECONDS, initial_delay=RECONCILE_INTERVAL_SECONDS)
async def on_timer(body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    await _reconcile(memo, body)


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
        if all(int(seen.get(k) or 0) == int(known.get(k) or 0)
               for k in ("replicas", "readyReplicas")):
            return
    await _reconcile(memo, owner)


@kopf.on.event("apps", "v1", "deployments", labels=MANAGED)
async def on_deployment(event: kopf.RawEvent, memo: kopf.Memo, **_: Any) -> None:
    await _reconcile_owner(event["object"], memo,
                           only_if_counts_moved=event.get("type") != "DELETED")


@kopf.on.event("", "v1", "services", labels=MANAGED)
@kopf.on.event("policy", "v1", "poddisruptionbudgets", labels=MANAGED)
async def on_other_child(event: kopf.RawEvent, memo: kopf.Memo, **_: Any) -> None:
    if event.get("type") == "DELETED":
        await _reconcile_owner(event["object"], memo, only_if_counts_moved=False)
