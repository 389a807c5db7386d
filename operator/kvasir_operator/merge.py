"""Strategic merge of the `podTemplate` escape hatch onto the rendered pod template.

A subset of Kubernetes' strategic merge patch, enough for pod templates: maps merge recursively;
lists whose items carry a merge key (containers/initContainers/volumes/env/ports by `name`,
volumeMounts by `mountPath`, imagePullSecrets by `name`) merge item by item; other lists are
replaced; `null` deletes a key; an item `{"name": x, "$patch": "delete"}` removes item x.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

MERGE_KEYS = {
    "containers": "name", "initContainers": "name", "ephemeralContainers": "name",
    "volumes": "name", "env": "name", "ports": "containerPort", "volumeMounts": "mountPath",
    "imagePullSecrets": "name", "tolerations": "key", "hostAliases": "ip",
}


def _merge_list(base: list[Any], patch: list[Any], key: str) -> list[Any]:
    if not all(isinstance(i, Mapping) and key in i for i in [*base, *patch]):
        return copy.deepcopy(patch)
    result = [copy.deepcopy(i) for i in base]
    for item in patch:
        index = next((n for n, b in enumerate(result) if b[key] == item[key]), None)
        if item.get("$patch") == "delete":
            if index is not None:
                result.pop(index)
        elif index is None:
            result.append(copy.deepcopy(dict(item)))
        else:
            result[index] = strategic_merge(result[index], item)
    return result


def strategic_merge(base: Mapping[str, Any], patch: Mapping[str, Any]) -> dict[str, Any]:
    """A new dict: `patch` merged onto `base` (neither is modified)."""
    result = copy.deepcopy(dict(base))
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        elif isinstance(value, Mapping) and isinstance(result.get(key), Mapping):
            result[key] = strategic_merge(result[key], value)
        elif isinstance(value, list) and isinstance(result.get(key), list) and key in MERGE_KEYS:
            result[key] = _merge_list(result[key], value, MERGE_KEYS[key])
        else:
            result[key] = copy.deepcopy(value)
    return result
