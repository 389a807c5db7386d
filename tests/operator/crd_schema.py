"""The CRD's schema applied to an object the way the API server applies it, without a server.

The order is the API server's: nulls of non-nullable fields are pruned, structural defaults are
applied (recursively: a defaulted `{}` gets its own fields' defaults), the OpenAPI v3 schema is
checked (jsonschema, Draft 4 semantics as OpenAPI 3.0 has them: boolean exclusiveMinimum), then
every x-kubernetes-validations CEL rule is evaluated with cel-python, transition rules (oldSelf)
only on updates. A rule that fails to evaluate (`no such key`) is reported as an error of its
own, distinct from a rule that evaluates to false.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import celpy
import jsonschema
import yaml

ROOT = Path(__file__).resolve().parents[2]
CRD_PATH = ROOT / "crds" / "inferenceservices.kvasir.dev.yaml"
CRD: dict[str, Any] = yaml.safe_load(CRD_PATH.read_text())
SCHEMA: dict[str, Any] = CRD["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
CEL = celpy.Environment()
JUNCTORS = ("allOf", "anyOf", "oneOf")


def children(schema: dict[str, Any], value: Any) -> Iterator[tuple[str, dict[str, Any], Any]]:
    """(key, sub-schema, sub-value) of the value's fields or items that the schema describes."""
    if isinstance(value, dict):
        extra = schema.get("additionalProperties")
        for key, sub in value.items():
            node = (schema.get("properties") or {}).get(key)
            node = node if node is not None else extra if isinstance(extra, dict) else None
            if node is not None:
                yield str(key), node, sub
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        for i, sub in enumerate(value):
            yield str(i), schema["items"], sub


def prune_nulls(schema: dict[str, Any], value: Any) -> Any:
    """A null in a field that is not nullable is dropped before defaulting (then defaulted)."""
    if isinstance(value, dict):
        for key, sub, item in list(children(schema, value)):
            if item is None and not sub.get("nullable"):
                del value[key]
            else:
                prune_nulls(sub, item)
    elif isinstance(value, list):
        for _, sub, item in children(schema, value):
            prune_nulls(sub, item)
    return value


def apply_defaults(schema: dict[str, Any], value: Any) -> Any:
    if isinstance(value, dict):
        for key, sub in (schema.get("properties") or {}).items():
            if key not in value and "default" in sub:
                value[key] = copy.deepcopy(sub["default"])
    for key, sub, item in list(children(schema, value)):
        value[int(key) if isinstance(value, list) else key] = apply_defaults(sub, item)
    return value


def as_jsonschema(schema: Any) -> Any:
    """The Kubernetes extensions jsonschema does not know, spelled as plain JSON Schema."""
    if isinstance(schema, list):
        return [as_jsonschema(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: as_jsonschema(v) for k, v in schema.items()
           if k not in ("default", "x-kubernetes-validations")}
    if schema.get("x-kubernetes-int-or-string"):
        out["type"] = ["integer", "string"]
    if schema.get("nullable") and "type" in out:
        out["type"] = [*([out["type"]] if isinstance(out["type"], str) else out["type"]), "null"]
    if isinstance(schema.get("properties"), dict):
        out["properties"] = {k: as_jsonschema(v) for k, v in schema["properties"].items()}
    return out


def unknown_fields(schema: dict[str, Any], value: Any, path: str = "") -> list[str]:
    """Fields the schema does not declare: kubectl's default (strict) field validation refuses
    them, where the API server alone would prune them silently. ObjectMeta is not the CRD's."""
    errors: list[str] = []
    if isinstance(value, dict) and not schema.get("x-kubernetes-preserve-unknown-fields"):
        declared = schema.get("properties") or {}
        if "additionalProperties" not in schema:
            errors += [f"{path}{k}: field not declared in schema" for k in value
                       if k not in declared]
    for key, sub, item in children(schema, value):
        if not (path == "" and key == "metadata"):
            errors += unknown_fields(sub, item, f"{path}{key}.")
    return errors


def openapi_errors(schema: dict[str, Any], value: Any) -> list[str]:
    validator = jsonschema.Draft4Validator(as_jsonschema(schema))
    return [f"{'.'.join(map(str, e.absolute_path))}: {e.message}"
            for e in validator.iter_errors(value)]


def compile_rule(rule: str) -> Any:
    return CEL.program(CEL.compile(rule))


def evaluate(rule: str, value: Any, old: Any = None) -> bool | str:
    """True/False, or the evaluation error as a string (e.g. a field read without has())."""
    activation = {"self": celpy.json_to_cel(value)}
    if old is not None:
        activation["oldSelf"] = celpy.json_to_cel(old)
    try:
        result = compile_rule(rule).evaluate(activation)
    except celpy.CELEvalError as exc:
        return f"evaluation error: {exc.args[0] if exc.args else exc}"
    if isinstance(result, celpy.CELEvalError):
        return f"evaluation error: {result.args[0] if result.args else result}"
    return bool(result)


def is_transition(rule: str) -> bool:
    return "oldSelf" in rule


def cel_errors(schema: dict[str, Any], value: Any, old: Any = None, path: str = "") -> list[str]:
    """Every rule of the subtree on the value; `old` (an update) also runs transition rules."""
    errors: list[str] = []
    for rule in schema.get("x-kubernetes-validations") or []:
        if is_transition(rule["rule"]) and old is None:
            continue
        outcome = evaluate(rule["rule"], value, old if is_transition(rule["rule"]) else None)
        if outcome is not True:
            detail = rule.get("message", rule["rule"]) if outcome is False else outcome
            errors.append(f"{path or '<root>'}: {detail}")
    for key, sub, item in children(schema, value):
        old_item = old.get(key) if isinstance(old, dict) else None
        errors += cel_errors(sub, item, old_item, f"{path}.{key}" if path else key)
    return errors


def admit(obj: dict[str, Any], old: dict[str, Any] | None = None) -> tuple[dict[str, Any], list[str]]:
    """(the object as stored, the errors the API server would answer), like a create/update."""
    obj = apply_defaults(SCHEMA, prune_nulls(SCHEMA, copy.deepcopy(obj)))
    if old is not None:
        old = apply_defaults(SCHEMA, prune_nulls(SCHEMA, copy.deepcopy(old)))
    errors = unknown_fields(SCHEMA, obj) + openapi_errors(SCHEMA, obj)
    return obj, errors or cel_errors(SCHEMA, obj, old)


def validate(obj: dict[str, Any], old: dict[str, Any] | None = None) -> list[str]:
    return admit(obj, old)[1]


def isvc(spec: dict[str, Any], name: str = "m") -> dict[str, Any]:
    return {"apiVersion": "kvasir.dev/v1alpha1", "kind": "InferenceService",
            "metadata": {"name": name}, "spec": spec}


def nodes(schema: dict[str, Any], path: str = "") -> Iterator[tuple[str, dict[str, Any]]]:
    """Every schema node with its path (`.spec.engine`, `.spec.tolerations[]`, `...anyOf[0]`)."""
    yield path, schema
    for key, sub in (schema.get("properties") or {}).items():
        if isinstance(sub, dict):
            yield from nodes(sub, f"{path}.{key}")
    for key in ("items", "additionalProperties", "not"):
        if isinstance(schema.get(key), dict):
            yield from nodes(schema[key], f"{path}[]" if key == "items" else f"{path}.{key}")
    for key in JUNCTORS:
        for i, sub in enumerate(schema.get(key) or []):
            yield from nodes(sub, f"{path}.{key}[{i}]")
