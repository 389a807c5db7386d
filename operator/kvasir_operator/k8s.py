"""The only module that talks to the Kubernetes API: lightkube's AsyncClient.

Every object call (get, list, watch, server-side apply, merge patches of the object and of its
status and scale subresources, delete, Event creation) is lightkube's typed client, with the
credentials lightkube loads (kubeauth.py: token, rotating token file, exec plugins, client
certificates, the in-cluster service account). Resources are lightkube generic resources, so
objects stay the API server's own JSON (a dict each; no model round trip drops a field the
models do not know). Two requests lightkube has no API for go over its own authenticated
transport: API discovery (is a group served?) and the pod proxy (/metrics from outside the
cluster).

The same code runs against a real API server and against kmock on loopback (which the tests
teach to filter selectors and to create on apply, as a server does: nothing here is
emulator-specific). Create/update goes through server-side apply with the field manager
"kvasir-operator"; status and scale go through merge patches on their subresources so the
autoscaler's `status.autoscaling` and the operator's status never overwrite each other.
`list_versioned` and `watch` are what the informers (informer.py) are made of.
"""

from __future__ import annotations

import datetime
import functools
import json
import uuid
from collections.abc import AsyncIterator, Awaitable, Mapping
from dataclasses import dataclass
from types import TracebackType
from typing import Any, TypeVar

import httpx2
import lightkube
from lightkube.config.kubeconfig import SingleConfig
from lightkube.generic_resource import GenericNamespacedResource, create_namespaced_resource
from lightkube.types import CascadeType, PatchType

from kvasir_operator import kubeauth, labels
from kvasir_operator.selectors import parse_selector
from kvasir_operator.settings import Settings

FIELD_MANAGER = "kvasir-operator"
COMPONENT = "kvasir-operator"

Body = dict[str, Any]
Items = list[Body]  # (named here: inside K8sClient, `list` is the method)


@dataclass(frozen=True)
class Resource:
    group: str  # "" for the core API
    version: str
    plural: str
    kind: str
    namespaced: bool = True

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version

    def path(self, namespace: str | None = None, name: str | None = None,
             subresource: str | None = None) -> str:
        root = f"/apis/{self.group}/{self.version}" if self.group else f"/api/{self.version}"
        parts = [root]
        if self.namespaced and namespace is not None:
            parts.append(f"namespaces/{namespace}")
        parts.append(self.plural)
        if name is not None:
            parts.append(name)
            if subresource is not None:
                parts.append(subresource)
        return "/".join(parts)


INFERENCESERVICES = Resource("kvasir.dev", "v1alpha1", "inferenceservices", "InferenceService")
DEPLOYMENTS = Resource("apps", "v1", "deployments", "Deployment")
SERVICES = Resource("", "v1", "services", "Service")
CONFIGMAPS = Resource("", "v1", "configmaps", "ConfigMap")
PDBS = Resource("policy", "v1", "poddisruptionbudgets", "PodDisruptionBudget")
PODS = Resource("", "v1", "pods", "Pod")
EVENTS = Resource("", "v1", "events", "Event")
PVCS = Resource("", "v1", "persistentvolumeclaims", "PersistentVolumeClaim")
SECRETS = Resource("", "v1", "secrets", "Secret")
SERVICEACCOUNTS = Resource("", "v1", "serviceaccounts", "ServiceAccount")
LEADERWORKERSETS = Resource(labels.LWS_GROUP, labels.LWS_VERSION, "leaderworkersets",
                            "LeaderWorkerSet")

KNOWN_RESOURCES = (INFERENCESERVICES, DEPLOYMENTS, SERVICES, CONFIGMAPS, PDBS, PODS, EVENTS,
                   PVCS, SECRETS, SERVICEACCOUNTS, LEADERWORKERSETS)


@functools.cache
def _generic(res: Resource) -> type[GenericNamespacedResource]:
    """lightkube's generic resource class for `res` (objects as plain dicts)."""
    return create_namespaced_resource(res.group, res.version, res.kind, res.plural)


def _selector(selector: str | Mapping[str, str] | None) -> dict[str, Any] | None:
    """An equality selector as lightkube takes it (a dict)."""
    if selector is None or isinstance(selector, Mapping):
        return dict(selector) if selector else None
    parsed = parse_selector(selector)
    if parsed is None:
        raise ValueError(f"only equality selectors are supported, got {selector!r}")
    return parsed or None


def resource_of(body: Mapping[str, Any]) -> Resource:
    """The resource of a manifest, from its apiVersion and kind."""
    api_version, kind = body.get("apiVersion"), body.get("kind")
    for res in KNOWN_RESOURCES:
        if res.api_version == api_version and res.kind == kind:
            return res
    raise ValueError(f"unknown resource apiVersion={api_version!r} kind={kind!r}")


class ApiError(Exception):
    def __init__(self, status: int, reason: str, message: str) -> None:
        super().__init__(f"HTTP {status} {reason}: {message}")
        self.status = status
        self.reason = reason
        self.message = message


def _api_error(status: int, reason: str, text: str) -> ApiError:
    """The error of a failed request, with the reason and message of its Status body."""
    message = text
    try:
        body = json.loads(text)
        reason, message = body.get("reason", reason), body.get("message", text)
    except (ValueError, AttributeError):
        pass
    return ApiError(status, str(reason), str(message))


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


T = TypeVar("T")


class K8sClient:
    """An async Kubernetes client; one per event loop (it owns an httpx connection pool)."""

    def __init__(self, config: SingleConfig | str, *, timeout_seconds: float = 30.0,
                 user_agent: str = COMPONENT) -> None:
        """`config`: lightkube's loaded config, or a bare server URL (no credentials)."""
        self.config = kubeauth.server_config(config) if isinstance(config, str) else config
        self.server = self.config.cluster.server.rstrip("/")
        self.user_agent = user_agent  # names the operator in the API server's audit log
        self._timeout_seconds = timeout_seconds
        self._client: lightkube.AsyncClient | None = None

    @classmethod
    def from_settings(cls, settings: Settings) -> K8sClient:
        """In-cluster service account, else the kubeconfig, as the settings say."""
        return cls(kubeauth.load_config(settings))

    async def __aenter__(self) -> K8sClient:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None,
                        exc: BaseException | None, tb: TracebackType | None) -> None:
        await self.close()

    async def close(self) -> None:
        if self._client is not None:
            await self._client.close()
            self._client = None

    @property
    def lightkube(self) -> lightkube.AsyncClient:
        if self._client is None:
            self._client = kubeauth.async_client(self.config, user_agent=self.user_agent,
                                                 timeout_seconds=self._timeout_seconds)
        return self._client

    async def _call(self, call: Awaitable[T]) -> T:
        """Await one lightkube call; its errors as ApiError (status 0: no HTTP answer)."""
        try:
            return await call
        except lightkube.ApiError as exc:
            status = exc.status
            raise ApiError(int(status.code or exc.response.status_code), str(status.reason or ""),
                           str(status.message or "")) from exc
        except httpx2.HTTPStatusError as exc:  # an error body that is not a Status
            raise _api_error(exc.response.status_code, exc.response.reason_phrase or "",
                             exc.response.text) from exc
        except httpx2.HTTPError as exc:  # unreachable, TLS, timeout: no HTTP status
            raise ApiError(0, type(exc).__name__, str(exc) or type(exc).__name__) from exc

    async def _raw_get(self, path: str) -> str:
        """GET a path lightkube has no API for, over its authenticated transport (its errors
        mapped by `_call`, as lightkube's are)."""
        http = kubeauth.transport_of(self.lightkube)

        async def text() -> str:
            resp = await http.get(path, headers={"Accept": "application/json"})
            if resp.status_code >= 400:
                resp.raise_for_status()
            return resp.text

        return await self._call(text())

    async def get(self, res: Resource, namespace: str | None, name: str) -> Body | None:
        """The object, or None when it does not exist."""
        try:
            obj = await self._call(self.lightkube.get(_generic(res), name, namespace=namespace))
        except ApiError as e:
            if e.status == 404:
                return None
            raise
        return dict(obj)

    async def is_served(self, res: Resource) -> bool:
        """API discovery: whether the server serves this resource (its CRD is installed)."""
        root = f"/apis/{res.group}/{res.version}" if res.group else f"/api/{res.version}"
        try:
            found = json.loads(await self._raw_get(root))
        except ApiError as e:
            if e.status == 404:
                return False
            raise
        return any(r.get("name") == res.plural for r in found.get("resources") or [])

    async def list(self, res: Resource, namespace: str | None = None, *,
                   label_selector: str | Mapping[str, str] | None = None,
                   field_selector: str | None = None) -> list[Body]:
        items, _version = await self.list_versioned(res, namespace, label_selector=label_selector,
                                                    field_selector=field_selector)
        return items

    async def list_versioned(self, res: Resource, namespace: str | None = None, *,
                             label_selector: str | Mapping[str, str] | None = None,
                             field_selector: str | None = None) -> tuple[Items, str]:
        """The objects and the list's resourceVersion (where a watch of it starts)."""
        listing = self.lightkube.list(_generic(res), namespace=namespace or lightkube.ALL_NS,
                                      labels=_selector(label_selector),
                                      fields=_selector(field_selector))

        async def collect() -> Items:
            return [dict(obj) async for obj in listing]

        items = await self._call(collect())
        try:
            version = str(listing.resourceVersion)
        except lightkube.NotReadyError:  # the server sent no version
            version = ""
        return items, version

    async def watch(self, res: Resource, namespace: str | None, *, resource_version: str,
                    label_selector: str | Mapping[str, str] | None = None,
                    field_selector: str | None = None,
                    timeout_seconds: int = 300) -> AsyncIterator[Body]:
        """The watch events ({"type", "object"}) after `resource_version`. The server ends each
        stream after about `timeout_seconds` (as client-go asks) and lightkube resumes it from
        the last version seen; an error (410 Gone: that version is forgotten) is raised."""
        events = self.lightkube.watch(
            _generic(res), namespace=namespace or lightkube.ALL_NS,
            labels=_selector(label_selector), fields=_selector(field_selector),
            server_timeout=timeout_seconds, resource_version=resource_version or None)
        iterator = aiter(events)
        while True:
            try:
                kind, obj = await self._call(anext(iterator))
            except StopAsyncIteration:
                return
            yield {"type": kind, "object": dict(obj)}

    async def apply(self, body: Body, *, field_manager: str = FIELD_MANAGER,
                    force: bool = True) -> Body:
        """Server-side apply: creates the object, or patches the fields this manager owns."""
        res = resource_of(body)
        meta = body["metadata"]
        kind = _generic(res)
        obj = await self._call(self.lightkube.patch(
            kind, meta["name"], kind.from_dict(dict(body)), namespace=meta.get("namespace"),
            patch_type=PatchType.APPLY, field_manager=field_manager, force=force))
        return dict(obj)

    async def delete(self, res: Resource, namespace: str | None, name: str, *,
                     propagation: str = "Background") -> bool:
        """True if deleted, False if it was already gone."""
        try:
            await self._call(self.lightkube.delete(_generic(res), name, namespace=namespace,
                                                   cascade=CascadeType(propagation)))
        except ApiError as e:
            if e.status == 404:
                return False
            raise
        return True

    async def patch_merge(self, res: Resource, namespace: str | None, name: str,
                          patch: Mapping[str, Any], *, subresource: str | None = None) -> Body:
        kind = _generic(res)
        target: Any = {None: kind, "status": kind.Status, "scale": kind.Scale}[subresource]
        obj: Any = await self._call(self.lightkube.patch(target, name, dict(patch),
                                                         namespace=namespace,
                                                         patch_type=PatchType.MERGE))
        return dict(obj) if isinstance(obj, dict) else dict(obj.to_dict())

    async def patch_status(self, res: Resource, namespace: str | None, name: str,
                           status: Mapping[str, Any]) -> Body:
        """Merge-patch `status` (keys set to None are removed; other keys are left alone)."""
        return await self.patch_merge(res, namespace, name, {"status": status},
                                      subresource="status")

    async def patch_scale(self, res: Resource, namespace: str | None, name: str,
                          replicas: int) -> Body:
        """Set spec.replicas through the scale subresource (what `kubectl scale` does)."""
        return await self.patch_merge(res, namespace, name, {"spec": {"replicas": replicas}},
                                      subresource="scale")

    async def patch_pod_annotations(self, namespace: str, name: str,
                                    annotations: Mapping[str, str | None]) -> Body:
        return await self.patch_merge(PODS, namespace, name,
                                      {"metadata": {"annotations": dict(annotations)}})

    async def post_event(self, involved: Mapping[str, Any], type_: str, reason: str,
                         message: str) -> Body:
        """A core/v1 Event about `involved` (a full object or an owner-reference-like dict)."""
        meta = involved.get("metadata") or involved
        namespace = meta.get("namespace") or "default"
        now = _now()
        event = {
            "apiVersion": "v1", "kind": "Event",
            "metadata": {"name": f"{meta['name']}.{uuid.uuid4().hex[:16]}",
                         "namespace": namespace},
            "involvedObject": {
                "apiVersion": involved.get("apiVersion"), "kind": involved.get("kind"),
                "name": meta["name"], "namespace": namespace, "uid": meta.get("uid"),
            },
            "type": type_, "reason": reason, "message": message[:1024],
            "source": {"component": COMPONENT}, "reportingComponent": COMPONENT,
            "firstTimestamp": now, "lastTimestamp": now, "count": 1,
        }
        obj = await self._call(self.lightkube.create(_generic(EVENTS).from_dict(event)))
        return dict(obj)

    async def proxy_get(self, namespace: str, pod: str, port: int | str, path: str) -> str:
        """GET through the API server's pod proxy (reaching /metrics from outside the cluster)."""
        return await self._raw_get(PODS.path(namespace, f"{pod}:{port}", "proxy") + "/"
                                   + path.lstrip("/"))
