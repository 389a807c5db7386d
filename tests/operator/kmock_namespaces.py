"""Teach kmock 0.8 the core `namespaces` collection, which kopf lists and watches when it serves
named namespaces (`kvasir-operator run --namespace NS`).

kmock's path parser reads `/api/v1/namespaces/<ns>/<plural>` as a namespaced collection, so the
bare collection `/api/v1/namespaces` fails to unpack (HTTP 500) and `/api/v1/namespaces/<ns>` has
no plural. Both are cluster-scoped `namespaces` paths; this wrapper parses them as such and leaves
every other path to kmock. Everything else (listing, watching, the stored objects) is kmock's own.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from kmock._internal import parsing


def _parse_with_namespaces(original: Callable[[str], Any]) -> Callable[[str], Any]:
    def parse(path: str) -> Any:
        parts = path.strip("/").split("/")
        if parts[:3] == ["api", "v1", "namespaces"] and len(parts) <= 4:
            name = parts[3] if len(parts) == 4 else None
            return parsing.ParsedPath(group="", version="v1", plural="namespaces", name=name)
        return original(path)

    return parse


@contextmanager
def namespaces_served(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setattr(parsing, "parse_path", _parse_with_namespaces(parsing.parse_path))
    yield
