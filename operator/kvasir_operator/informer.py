"""Informers: the operator reads what it reconciles from watch streams, not a GET per tick.

A reconcile used to read nine times (the InferenceService, its pods, their events, the engine's
ServiceAccount, API discovery, the Deployment or LeaderWorkerSet, the Service and the PDB), the
periodic resync and the autoscaler as often again: about 26 requests per object a minute while
nothing changed (issue 35). KServe and KubeAI read from client-go's informer caches instead; this
is the same idea, small.

`Informer`: LIST one resource in one namespace (or in all of them) with one broad selector (every pod the operator
manages, say), then WATCH from the list's resourceVersion, keeping a local copy; a stream the
server ends is resumed from the last version seen (lightkube does that, k8s.py), a 410 Gone
relists at once, any other failure relists after a capped backoff. Nothing reads a cache before its first list.

`CachedClient`: the `K8sClient` every part of the operator gets. A read a cache covers is
answered from it, narrowed by the caller's selector (`selectors.matches`); the others (a Secret
by name, discovery once a minute) go to the API server. Every write goes to the server, and what
the server answers is put into the cache at once ("read your writes"), so the next reconcile
does not plan the same write again before the watch event arrives; so is every event kopf's own
watches hand to a handler (`seen`), which can come before ours. An object is replaced only by one
of the same or a newer resourceVersion. Informers start on the first
read of a namespace, so `--namespace NS` needs no list of its own; with `--all-namespaces`
(`cluster_wide`) each resource has one informer over every namespace, as client-go's, rather
than one per namespace that holds an InferenceService.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping
from typing import Any

from lightkube.config.kubeconfig import SingleConfig

from kvasir_operator import k8s, kubeauth, labels
from kvasir_operator.selectors import matches, parse_selector
from kvasir_operator.settings import Settings

Body = dict[str, Any]
log = logging.getLogger(__name__)

MANAGED = {labels.MANAGED_BY: labels.OPERATOR}
# status.event_problems reads only these: a scheduler's word that a pod does not fit.
POD_SCHEDULING_EVENTS = "involvedObject.kind=Pod,reason=FailedScheduling"
DISCOVERY_TTL_SECONDS = 60.0  # a LeaderWorkerSet CRD installed later is seen within a minute


Key = tuple[str | None, str]  # (namespace, name)


def _key(obj: Mapping[str, Any]) -> Key | None:
    meta = obj.get("metadata") or {}
    name = meta.get("name")
    return (meta.get("namespace"), name) if isinstance(name, str) else None


def _version(obj: Mapping[str, Any]) -> int | None:
    text = (obj.get("metadata") or {}).get("resourceVersion")
    return int(text) if isinstance(text, str) and text.isdigit() else None


class Informer:
    """The objects of one resource in one namespace (None: all) that match one selector, kept
    current."""

    def __init__(self, client: k8s.K8sClient, res: k8s.Resource, namespace: str | None, *,
                 label_selector: Mapping[str, str] | None = None,
                 field_selector: str | None = None, watch_timeout_seconds: int = 300,
                 max_retry_seconds: float = 30.0) -> None:
        self.res, self.namespace = res, namespace
        self.label_selector = dict(label_selector) if label_selector else None
        self.field_selector = field_selector
        self._fields = parse_selector(field_selector) or {}  # equality terms only
        self.synced = asyncio.Event()  # set after the first list
        self.last_error: str | None = None
        self._client = client
        self._objects: dict[Key, Body] = {}
        self._watch_timeout_seconds = watch_timeout_seconds
        self._max_retry_seconds = max_retry_seconds
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(
                self._run(), name=f"informer {self.res.plural} {self.namespace}")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    def covers(self, label_selector: Mapping[str, str] | None,
               field_selector: Mapping[str, str] | None) -> bool:
        """Whether every object a read with these selectors wants is in this cache."""
        wanted_labels, wanted_fields = label_selector or {}, field_selector or {}
        return (all(wanted_labels.get(k) == v for k, v in (self.label_selector or {}).items())
                and all(wanted_fields.get(k) == v for k, v in self._fields.items()))

    def holds(self, name: str) -> bool:
        """Whether a get of `name` can be answered here: the children the operator renders all
        carry its label, so only a field selector (the one ServiceAccount) rules names out."""
        return all(k == "metadata.name" and v == name for k, v in self._fields.items())

    def get(self, namespace: str | None, name: str) -> Body | None:
        return self._objects.get((namespace, name))

    def items(self, namespace: str | None) -> list[Body]:
        return [obj for (ns, _name), obj in self._objects.items() if ns == namespace]

    def note(self, obj: Mapping[str, Any]) -> None:
        """An object a write of ours returned: newer than the cache unless its version is
        older than the one cached (the watch got there first)."""
        key = _key(obj)
        if key is None:
            return
        if not matches(obj, self.label_selector, self._fields):
            self._objects.pop(key, None)
            return
        new, old = _version(obj), _version(self._objects.get(key) or {})
        if new is None or old is None or new >= old:
            self._objects[key] = dict(obj)

    def forget(self, namespace: str | None, name: str) -> None:
        self._objects.pop((namespace, name), None)

    async def _run(self) -> None:
        delay = 0.5
        while True:
            try:
                version = await self._list()
                delay = 0.5
                while True:  # a stream that ends is resumed from the last version seen
                    version = await self._watch(version)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # an API error, a broken stream, a body that is not JSON
                self.last_error = str(e) or type(e).__name__
                if isinstance(e, k8s.ApiError) and e.status == 410:
                    continue  # the server forgot our version: list again, at once
                if isinstance(e, k8s.ApiError) and e.status == 404:
                    self._objects.clear()  # the resource is not served (its CRD went)
                    self.synced.set()
                log.warning("watch of %s in %s failed (%s); again in %.1f s", self.res.plural,
                            self.namespace or "all namespaces", e, delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, self._max_retry_seconds)

    async def _list(self) -> str:
        items, version = await self._client.list_versioned(
            self.res, self.namespace, label_selector=self.label_selector,
            field_selector=self.field_selector)
        self._objects = {key: obj for obj in items if (key := _key(obj)) is not None}
        self.last_error = None
        self.synced.set()
        return version

    async def _watch(self, version: str) -> str:
        """Follow one watch stream (an error event is raised by K8sClient.watch); the version
        to resume from."""
        async for event in self._client.watch(
                self.res, self.namespace, resource_version=version,
                label_selector=self.label_selector, field_selector=self.field_selector,
                timeout_seconds=self._watch_timeout_seconds):
            kind, obj = event.get("type"), event.get("object") or {}
            version = str((obj.get("metadata") or {}).get("resourceVersion") or version)
            key = _key(obj)
            if key is None:
                continue
            if kind == "DELETED":
                self._objects.pop(key, None)
            else:
                self.note(obj)
        return version


class CachedClient(k8s.K8sClient):
    """A K8sClient whose reads of what the operator reconciles come from informers."""

    def __init__(self, config: SingleConfig | str, *,
                 engine_service_account: str = labels.ENGINE_SERVICE_ACCOUNT,
                 cluster_wide: bool = False, sync_timeout_seconds: float = 30.0,
                 **kwargs: Any) -> None:
        """`cluster_wide`: one informer per resource over every namespace (the operator serves
        all of them); else one per resource and namespace, started on its first read."""
        super().__init__(config, **kwargs)
        self.cluster_wide = cluster_wide
        # The broad selector each cached resource is watched with (None: every object).
        self._watched: dict[k8s.Resource, tuple[dict[str, str] | None, str | None]] = {
            k8s.INFERENCESERVICES: (None, None),
            k8s.DEPLOYMENTS: (MANAGED, None),
            k8s.LEADERWORKERSETS: (MANAGED, None),
            k8s.SERVICES: (MANAGED, None),
            k8s.PDBS: (MANAGED, None),
            k8s.PODS: (MANAGED, None),
            k8s.EVENTS: (None, POD_SCHEDULING_EVENTS),
            k8s.SERVICEACCOUNTS: (None, f"metadata.name={engine_service_account}"),
        }
        self._informers: dict[tuple[k8s.Resource, str | None], Informer] = {}
        self._served: dict[k8s.Resource, tuple[asyncio.Future[bool], float]] = {}
        self._sync_timeout_seconds = sync_timeout_seconds

    @classmethod
    def from_settings(cls, settings: Settings, *, cluster_wide: bool = False) -> CachedClient:
        return cls(kubeauth.load_config(settings),
                   engine_service_account=settings.engine_service_account,
                   cluster_wide=cluster_wide)

    async def close(self) -> None:
        informers = list(self._informers.values())
        self._informers.clear()
        await asyncio.gather(*(i.stop() for i in informers))
        await super().close()

    def informers(self) -> list[Informer]:
        return list(self._informers.values())

    def _scope(self, namespace: str | None) -> str | None:
        """The namespace an informer of objects in `namespace` watches (None: all)."""
        return None if self.cluster_wide else namespace

    def _started(self, res: k8s.Resource, namespace: str | None) -> Informer | None:
        return self._informers.get((res, self._scope(namespace))) if namespace else None

    def _informer(self, res: k8s.Resource, namespace: str | None) -> Informer | None:
        if namespace is None or res not in self._watched:
            return None
        scope = self._scope(namespace)
        informer = self._informers.get((res, scope))
        if informer is None:
            label_selector, field_selector = self._watched[res]
            informer = Informer(self, res, scope, label_selector=label_selector,
                                field_selector=field_selector)
            self._informers[res, scope] = informer
            informer.start()
        return informer

    async def _synced(self, informer: Informer) -> Informer:
        try:
            await asyncio.wait_for(informer.synced.wait(), self._sync_timeout_seconds)
        except TimeoutError:
            raise k8s.ApiError(0, "CacheNotSynced", f"no list of {informer.res.plural} in "
                               f"{informer.namespace or 'all namespaces'} yet: "
                               f"{informer.last_error}") from None
        return informer

    async def get(self, res: k8s.Resource, namespace: str | None, name: str) -> Body | None:
        informer = self._informer(res, namespace)
        if informer is None or not informer.holds(name):
            return await super().get(res, namespace, name)
        found = (await self._synced(informer)).get(namespace, name)
        return None if found is None else dict(found)

    async def list(self, res: k8s.Resource, namespace: str | None = None, *,
                   label_selector: str | Mapping[str, str] | None = None,
                   field_selector: str | None = None) -> list[Body]:
        wanted_labels, wanted_fields = (parse_selector(label_selector),
                                        parse_selector(field_selector))
        informer = self._informer(res, namespace)
        is_parsed = ((label_selector is None or wanted_labels is not None)
                     and (field_selector is None or wanted_fields is not None))
        if informer is None or not is_parsed or not informer.covers(wanted_labels,
                                                                     wanted_fields):
            return await super().list(res, namespace, label_selector=label_selector,
                                      field_selector=field_selector)
        return [dict(obj) for obj in (await self._synced(informer)).items(namespace)
                if matches(obj, wanted_labels, wanted_fields)]

    async def is_served(self, res: k8s.Resource) -> bool:
        """Discovery, asked at most once a minute per resource (reconciles that ask at once,
        as after a restart, share the one request in flight)."""
        known = self._served.get(res)
        if known is None or time.monotonic() - known[1] >= DISCOVERY_TTL_SECONDS or (
                known[0].done() and known[0].exception() is not None):
            known = (asyncio.ensure_future(super().is_served(res)), time.monotonic())
            self._served[res] = known
        return await asyncio.shield(known[0])

    def _informer_of(self, obj: Mapping[str, Any]) -> Informer | None:
        """The running informer that would hold `obj`, if any."""
        try:
            res = k8s.resource_of(obj)
        except ValueError:
            return None
        return self._started(res, (obj.get("metadata") or {}).get("namespace"))

    def _note(self, obj: Mapping[str, Any]) -> None:
        informer = self._informer_of(obj)
        if informer is not None:
            informer.note(obj)

    def seen(self, event: Mapping[str, Any]) -> None:
        """A watch event kopf received (its handlers run before ours see the same event on
        our own stream): taken into the cache, so a handler never reconciles from an object
        older than the one that triggered it."""
        obj = event.get("object") or {}
        informer, key = self._informer_of(obj), _key(obj)
        if informer is None or key is None:
            return
        if event.get("type") == "DELETED":
            informer.forget(*key)
        else:
            informer.note(obj)

    async def apply(self, body: Body, *, field_manager: str = k8s.FIELD_MANAGER,
                    force: bool = True) -> Body:
        obj = await super().apply(body, field_manager=field_manager, force=force)
        self._note(obj)
        return obj

    async def delete(self, res: k8s.Resource, namespace: str | None, name: str, *,
                     propagation: str = "Background") -> bool:
        deleted = await super().delete(res, namespace, name, propagation=propagation)
        informer = self._started(res, namespace)
        if informer is not None:
            informer.forget(namespace, name)
        return deleted

    async def patch_merge(self, res: k8s.Resource, namespace: str | None, name: str,
                          patch: Mapping[str, Any], *, subresource: str | None = None) -> Body:
        obj = await super().patch_merge(res, namespace, name, patch, subresource=subresource)
        if subresource in (None, "status"):  # the scale subresource answers a Scale
            self._note(obj)
        return obj
