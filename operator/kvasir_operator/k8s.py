"""The only module that talks to the Kubernetes API.

REST paths over an httpx client that lightkube builds from the credentials (kubeauth.py): token,
rotating token file, exec plugins, client certificates and the in-cluster service account are
lightkube's, and every request carries them. The same code runs against a real API server and
against kmock on loopback (which the tests teach to filter selectors and to create on apply, as a
server does: nothing here is emulator-specific). Create/update goes through server-side apply with
the field manager "kvasir-operator"; status and scale go through merge patches on their
subresources so the autoscaler's `status.autoscaling` and the operator's status never overwrite
each other. `list_versioned` and `watch` are what the informers (informer.py) are made of.
"""

from __future__ import annotations

import datetime
import json
import uuid
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import httpx2
from lightkube.config.kubeconfig import SingleConfig

from kvasir_operator import kubeauth, labels
from kvasir_operator.selectors import selector_text
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


class K8sClient:
    """An async Kubernetes client; one per event loop (it owns an httpx connection pool)."""

    def __init__(self, config: SingleConfig | str, *, timeout_seconds: float = 30.0,
                 user_agent: str = COMPONENT) -> None:
        """`config`: lightkube's loaded config, or a bare server URL (no credentials)."""
        self.config = kubeauth.server_config(config) if isinstance(config, str) else config
        self.server = self.config.cluster.server.rstrip("/")
        self.user_agent = user_agent  # names the operator in the API server's audit log
        self._timeout_seconds = timeout_seconds
        self._http: httpx2.AsyncClient | None = None

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
        if self._http is not None:
            await self._http.aclose()
            self._http = None

    async def _request(self, method: str, path: str, *, params: Mapping[str, str] | None = None,
                       body: Any = None, content_type: str = "application/json",
                       raw: bool = False) -> Any:
        if self._http is None or self._http.is_closed:
            self._http = kubeauth.http_client(self.config, timeout_seconds=self._timeout_seconds)
        headers = {"Accept": "application/json", "User-Agent": self.user_agent}
        content = None
        if body is not None:
            headers["Content-Type"] = content_type
            content = json.dumps(body)
        try:
            resp = await self._http.request(method, path, params=dict(params or {}),
                                            content=content, headers=headers)
        except httpx2.HTTPError as exc:  # unreachable, TLS, timeout: no HTTP status
            raise ApiError(0, type(exc).__name__, str(exc) or type(exc).__name__) from exc
        text = resp.text
        if resp.status_code >= 400:
            raise _api_error(resp.status_code, resp.reason_phrase or "", text)
        if raw:
            return text
        return json.loads(text) if text else {}

    async def get(self, res: Resource, namespace: str | None, name: str) -> Body | None:
        """The object, or None when it does not exist."""
        try:
            obj: Body = await self._request("GET", res.path(namespace, name))
        except ApiError as e:
            if e.status == 404:
                return None
            raise
        return obj

    async def is_served(self, res: Resource) -> bool:
        """API discovery: whether the server serves this resource (its CRD is installed)."""
        root = f"/apis/{res.group}/{res.version}" if res.group else f"/api/{res.version}"
        try:
            found = await self._request("GET", root)
        except ApiError as e:
            if e.status == 404:
                return False
            raise
        return any(r.get("name") == res.plural for r in found.get("resources") or [])

    @staticmethod
    def _selector_params(label_selector: str | Mapping[str, str] | None,
                         field_selector: str | None) -> dict[str, str]:
        params: dict[str, str] = {}
        if label_selector:
            params["labelSelector"] = selector_text(label_selector)
        if field_selector:
            params["fieldSelector"] = field_selector
        return params

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
        result = await self._request("GET", res.path(namespace),
                                     params=self._selector_params(label_selector, field_selector))
        version = str((result.get("metadata") or {}).get("resourceVersion") or "")
        return list(result.get("items") or []), version

    async def watch(self, res: Resource, namespace: str | None, *, resource_version: str,
                    label_selector: str | Mapping[str, str] | None = None,
                    field_selector: str | None = None,
                    timeout_seconds: int = 300) -> AsyncIterator[Body]:
        """The watch events ({"type", "object"}) after `resource_version`, until the server
        ends the stream (after about `timeout_seconds`, as client-go asks) or fails it."""
        if self._http is None or self._http.is_closed:
            self._http = kubeauth.http_client(self.config, timeout_seconds=self._timeout_seconds)
        params = {**self._selector_params(label_selector, field_selector), "watch": "true",
                  "allowWatchBookmarks": "true", "timeoutSeconds": str(timeout_seconds)}
        if resource_version:
            params["resourceVersion"] = resource_version
        headers = {"Accept": "application/json", "User-Agent": self.user_agent}
        # No read timeout of its own: the server ends the stream; a dead peer ends it too.
        timeout = httpx2.Timeout(self._timeout_seconds, read=timeout_seconds + 60.0)
        try:
            async with self._http.stream("GET", res.path(namespace), params=params,
                                         headers=headers, timeout=timeout) as resp:
                if resp.status_code >= 400:
                    text = (await resp.aread()).decode(errors="replace")
                    raise _api_error(resp.status_code, resp.reason_phrase or "", text)
                async for line in resp.aiter_lines():
                    if line.strip():
                        event: Body = json.loads(line)
                        yield event
        except httpx2.HTTPError as exc:
            raise ApiError(0, type(exc).__name__, str(exc) or type(exc).__name__) from exc

    async def apply(self, body: Body, *, field_manager: str = FIELD_MANAGER,
                    force: bool = True) -> Body:
        """Server-side apply: creates the object, or patches the fields this manager owns."""
        res = resource_of(body)
        meta = body["metadata"]
        params = {"fieldManager": field_manager, "force": "true" if force else "false"}
        obj: Body = await self._request("PATCH", res.path(meta.get("namespace"), meta["name"]),
                                        params=params, body=body,
                                        content_type="application/apply-patch+yaml")
        return obj

    async def delete(self, res: Resource, namespace: str | None, name: str, *,
                     propagation: str = "Background") -> bool:
        """True if deleted, False if it was already gone."""
        try:
            await self._request("DELETE", res.path(namespace, name),
                                body={"propagationPolicy": propagation})
        except ApiError as e:
            if e.status == 404:
                return False
            raise
        return True

    async def patch_merge(self, res: Resource, namespace: str | None, name: str,
                          patch: Mapping[str, Any], *, subresource: str | None = None) -> Body:
        obj: Body = await self._request("PATCH", res.path(namespace, name, subresource),
                                        body=patch, content_type="application/merge-patch+json")
        return obj

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
        obj: Body = await self._request("POST", EVENTS.path(namespace), body=event)
        return obj

    async def proxy_get(self, namespace: str, pod: str, port: int | str, path: str) -> str:
        """GET through the API server's pod proxy (reaching /metrics from outside the cluster)."""
        url = PODS.path(namespace, f"{pod}:{port}", "proxy") + "/" + path.lstrip("/")
        text: str = await self._request("GET", url, raw=True)
        return text
