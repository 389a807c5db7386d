"""Equality-based label/field selectors: parsed (for lightkube) and evaluated on a cached object.

The informers (informer.py) watch one broad selector per resource and namespace (every pod the
operator manages, say); a read for one InferenceService's pods is that cache filtered by the
narrower selector here, as client-go's indexers do. A set-based selector (`in`, `!=`, `!key`)
does not parse here and is sent to the server instead.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def parse_selector(selector: str | Mapping[str, str] | None) -> dict[str, str] | None:
    """Equality-only selectors as a dict; None if absent or not purely equality-based."""
    if selector is None:
        return None
    if isinstance(selector, Mapping):
        return dict(selector)
    terms: dict[str, str] = {}
    for term in filter(None, (t.strip() for t in selector.split(","))):
        key, sep, value = term.partition("=")
        if not sep or key.endswith("!") or any(c in term for c in " ()"):
            return None
        terms[key] = value.lstrip("=")
    return terms


def _dig(obj: Mapping[str, Any], dotted: str) -> str | None:
    cur: Any = obj
    for part in dotted.split("."):
        if not isinstance(cur, Mapping) or part not in cur:
            return None
        cur = cur[part]
    return None if cur is None else str(cur)


def matches(obj: Mapping[str, Any], labels: dict[str, str] | None,
             fields: dict[str, str] | None) -> bool:
    obj_labels = (obj.get("metadata") or {}).get("labels") or {}
    if labels and any(obj_labels.get(k) != v for k, v in labels.items()):
        return False
    return not fields or all(_dig(obj, k) == v for k, v in fields.items())
