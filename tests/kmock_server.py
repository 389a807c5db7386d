"""Teach kmock 0.8 what a real API server does, so production code needs no emulator
special cases (issue 35: no kmock-specific behaviour in the operator or the gateway):

- lists and watch streams honour `labelSelector` and `fieldSelector` (equality, `!=`, `in`,
  `notin`, existence), as the server filters them;
- a server-side apply (PATCH with `application/apply-patch+yaml`) of an object that does not
  exist creates it, as the server does;
- the scale subresource answers a Scale (autoscaling/v1), not the whole object;
- a JSON patch whose `test` fails (kopf tests the resourceVersion) is a 422, not a 500;
- every create, apply and merge patch gives the object a new, higher `metadata.resourceVersion`
  (what a cache compares to tell a late watch event from a newer write; the request log shows
  it in `request.data`), and a list reports the latest one (kmock's watch then replays every
  object from the start, which an informer takes as a relist). A JSON patch (kopf's, which
  tests the version first) leaves the version as it is.

Applied to kmock's class for the whole test session (tests/conftest.py), so every test tree's
kmock fixture behaves alike. Everything else (storage, watch buses, the requests log) is
kmock's own.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import jsonpatch
import pytest
from aiohttp import web

Term = Callable[[Mapping[str, Any]], bool]
_SET_TERM = re.compile(r"^\s*(!?)([\w./-]+)\s*(?:(notin|in)\s*\(([^)]*)\))?\s*$")


def _split_terms(text: str) -> list[str]:
    """Comma-separated terms; commas inside `in (a,b)` do not split."""
    terms, depth, current = [], 0, ""
    for char in text:
        depth += (char == "(") - (char == ")")
        if char == "," and depth == 0:
            terms.append(current)
            current = ""
        else:
            current += char
    return [t for t in (*terms, current) if t.strip()]


def _dig(obj: Mapping[str, Any], dotted: str) -> Any:
    cur: Any = obj
    for part in dotted.split("."):
        if not isinstance(cur, Mapping) or part not in cur:
            return None
        cur = cur[part]
    return cur


def _term(text: str, value_of: Callable[[Mapping[str, Any], str], Any]) -> Term:
    for op in ("!=", "==", "="):
        if op in text and "(" not in text:
            key, value = (s.strip() for s in text.split(op, 1))
            if op == "!=":
                return lambda obj: str(value_of(obj, key)) != value
            return lambda obj: value_of(obj, key) is not None and str(value_of(obj, key)) == value
    found = _SET_TERM.match(text)
    if found is None:
        raise ValueError(f"unparsable selector term {text!r}")
    negated, key, op, values = found.groups()
    if op is None:  # existence: `key` or `!key`
        return lambda obj: (value_of(obj, key) is None) == bool(negated)
    options = {v.strip() for v in values.split(",")}
    if op == "in":
        return lambda obj: value_of(obj, key) is not None and str(value_of(obj, key)) in options
    return lambda obj: value_of(obj, key) is None or str(value_of(obj, key)) not in options


def selector_predicate(label_selector: str | None, field_selector: str | None) -> Term:
    def label_of(obj: Mapping[str, Any], key: str) -> Any:
        return ((obj.get("metadata") or {}).get("labels") or {}).get(key)

    terms = [_term(t, label_of) for t in _split_terms(label_selector or "")]
    terms += [_term(t, _dig) for t in _split_terms(field_selector or "")]
    return lambda obj: all(term(obj) for term in terms)


def _wanted(request: Any) -> Term:
    params = request.params or {}
    return selector_predicate(params.get("labelSelector"), params.get("fieldSelector"))


_versions = itertools.count(1000)


def _scale_of(obj: Mapping[str, Any]) -> dict[str, Any]:
    """What the scale subresource answers: an autoscaling/v1 Scale of the object."""
    meta, status = obj.get("metadata") or {}, obj.get("status") or {}
    return {"apiVersion": "autoscaling/v1", "kind": "Scale",
            "metadata": {"name": meta.get("name"), "namespace": meta.get("namespace"),
                         "resourceVersion": meta.get("resourceVersion")},
            "spec": {"replicas": (obj.get("spec") or {}).get("replicas", 0)},
            "status": {"replicas": status.get("replicas", 0),
                       "selector": status.get("selector", "")}}


@contextmanager
def server_semantics(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    from kmock._internal import enums
    from kmock._internal.k8s import KubernetesEmulator

    serve_list, serve_watch, handle = (KubernetesEmulator._serve_list,
                                       KubernetesEmulator._serve_watch,
                                       KubernetesEmulator._handle)

    async def _serve_list(self: Any, request: Any) -> Any:
        result = await serve_list(self, request)
        wanted = _wanted(request)
        result["items"] = [obj for obj in result["items"] if wanted(obj)]
        result["metadata"]["resourceVersion"] = str(next(_versions))
        return result

    async def _serve_watch(self: Any, request: Any) -> AsyncIterator[Any]:
        wanted = _wanted(request)
        async for event in serve_watch(self, request):
            if not isinstance(event, Mapping) or wanted(event.get("object") or {}):
                yield event

    async def _handle(self: Any, request: Any) -> Any:
        headers = {k.lower(): v for k, v in (request.headers or {}).items()}
        is_apply = headers.get("content-type", "").startswith("application/apply-patch")
        if (request.action == enums.action.UPDATE and request.resource is not None
                and request.name is not None):
            key = (request.resource, request.namespace, request.name)
            if is_apply and (key not in self._objects or self._objects[key].deleted):
                object.__setattr__(request, "action", enums.action.CREATE)
        if request.action in (enums.action.CREATE, enums.action.UPDATE) and isinstance(
                request.data, dict):  # a JSON patch (a list) tests the version: left as it is
            meta = {**(request.data.get("metadata") or {}),
                    "resourceVersion": str(next(_versions))}
            object.__setattr__(request, "data", {**request.data, "metadata": meta})
        try:
            response = await handle(self, request)
            if request.subresource == "scale" and response.status < 300:
                stored = self._objects[request.resource, request.namespace, request.name]
                return web.json_response(_scale_of(stored.raw))
            return response
        except jsonpatch.JsonPatchTestFailed as exc:  # a stale `test` of resourceVersion
            status = {"apiVersion": "v1", "kind": "Status", "status": "Failure",
                      "reason": "Invalid", "message": str(exc), "code": 422}
            return web.json_response(status, status=422)

    monkeypatch.setattr(KubernetesEmulator, "_serve_list", _serve_list)
    monkeypatch.setattr(KubernetesEmulator, "_serve_watch", _serve_watch)
    monkeypatch.setattr(KubernetesEmulator, "_handle", _handle)
    yield
