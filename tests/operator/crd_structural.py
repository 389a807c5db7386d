"""A CRD schema checked the way apiextensions v1 checks it when the CRD is created.

The rules, from Kubernetes' "structural schema" definition and the apiextensions validation:
every node holds only JSONSchemaProps keys (the set is read from kubernetes-validate's own copy
of the API, so a split YAML description, which leaves keys such as `L4: null`, fails here);
every node has a type except under x-kubernetes-int-or-string / preserve-unknown-fields;
additionalProperties never beside properties and never false; no id, $ref, definitions,
dependencies, patternProperties, additionalItems or uniqueItems; the logical junctors carry no
type, default, description, nullable or additionalProperties (except the int-or-string
anyOf); the x-kubernetes-* extensions only where they are legal; the root only holds what a CRD
with a status subresource may have there, and metadata at most name/generateName restrictions;
every pattern is an RE2 expression (the API server's regex engine).
"""

from __future__ import annotations

from functools import cache
from typing import Any

import re2
from crd_schema import JUNCTORS
from kubernetes_validate import utils
from kubeval import latest

PROPS = "io.k8s.apiextensions-apiserver.pkg.apis.apiextensions.v1.JSONSchemaProps"
FORBIDDEN = ("id", "$ref", "$schema", "definitions", "dependencies", "patternProperties",
             "additionalItems")
TYPES = ("object", "array", "string", "integer", "number", "boolean")
ROOT_ALLOWED = {"description", "type", "format", "title", "maximum", "exclusiveMaximum",
                "minimum", "exclusiveMinimum", "maxLength", "minLength", "pattern", "maxItems",
                "minItems", "multipleOf", "required", "items", "properties", "externalDocs",
                "example", "x-kubernetes-preserve-unknown-fields", "x-kubernetes-validations"}
INT_OR_STRING = [{"type": "integer"}, {"type": "string"}]
NOT_IN_JUNCTOR = ("type", "default", "description", "nullable", "additionalProperties")


@cache
def props_keys() -> frozenset[str]:
    """The JSONSchemaProps fields of the newest Kubernetes that kubernetes-validate ships."""
    defs = utils.schema_contents(f"kubernetes-json-schema/v{latest()}-local-strict/"
                                 "_definitions.json", latest())
    return frozenset(defs["$defs"][PROPS]["properties"])


def _junctor_errors(node: dict[str, Any], path: str) -> list[str]:
    errors: list[str] = []
    for key in JUNCTORS + ("not",):
        subs = node.get(key)
        subs = [subs] if isinstance(subs, dict) else subs or []
        if node.get("x-kubernetes-int-or-string") and key in ("anyOf", "allOf"):
            if key in node and subs != INT_OR_STRING:
                errors.append(f"{path}.{key}: int-or-string allows only {INT_OR_STRING}")
            continue
        for i, sub in enumerate(subs):
            errors += [f"{path}.{key}[{i}].{k}: not allowed inside {key}"
                       for k in NOT_IN_JUNCTOR if k in sub]
    return errors


def _extension_errors(node: dict[str, Any], path: str) -> list[str]:
    errors: list[str] = []
    kind = node.get("type")
    if node.get("x-kubernetes-preserve-unknown-fields") is False:
        errors.append(f"{path}: x-kubernetes-preserve-unknown-fields must be true or absent")
    if node.get("x-kubernetes-int-or-string") and kind:
        errors.append(f"{path}: x-kubernetes-int-or-string needs an empty type, got {kind}")
    if "x-kubernetes-map-type" in node and (kind != "object" or node[
            "x-kubernetes-map-type"] not in ("atomic", "granular")):
        errors.append(f"{path}: x-kubernetes-map-type needs type object, atomic or granular")
    list_type = node.get("x-kubernetes-list-type")
    if list_type is not None and (kind != "array" or list_type not in ("atomic", "set", "map")):
        errors.append(f"{path}: x-kubernetes-list-type needs type array, atomic/set/map")
    keys = node.get("x-kubernetes-list-map-keys") or []
    if (list_type == "map") != bool(keys):
        errors.append(f"{path}: x-kubernetes-list-type map and list-map-keys go together")
    items = node.get("items") if isinstance(node.get("items"), dict) else {}
    for key in keys:
        prop = (items.get("properties") or {}).get(key)
        if items.get("type") != "object" or prop is None:
            errors.append(f"{path}: list-map key {key} is not a property of the object items")
        elif prop.get("type") in ("object", "array") or prop.get("nullable"):
            errors.append(f"{path}: list-map key {key} must be a non-nullable scalar")
        elif key not in (items.get("required") or []) and "default" not in prop:
            errors.append(f"{path}: list-map key {key} must be required or defaulted")
    return errors


def _rule_errors(node: dict[str, Any], path: str, correlatable: bool) -> list[str]:
    errors: list[str] = []
    for i, rule in enumerate(node.get("x-kubernetes-validations") or []):
        where = f"{path}.x-kubernetes-validations[{i}]"
        text, message = str(rule.get("rule", "")).strip(), str(rule.get("message", ""))
        if not text:
            errors.append(f"{where}: rule is empty")
        if "\n" in message or ("\n" in text and not message.strip()):
            errors.append(f"{where}: message must be one line, and set when the rule is not")
        if "oldSelf" in text and not correlatable:
            errors.append(f"{where}: oldSelf under an uncorrelatable path (list items)")
    return errors


def node_errors(node: Any, path: str, *, root: bool = False, correlatable: bool = True,
                in_meta: bool = False) -> list[str]:
    """Every structural violation of the node and below, each naming its schema path."""
    if not isinstance(node, dict):
        return [f"{path}: a schema must be an object, got {node!r}"]
    errors = [f"{path}.{k}: not a JSONSchemaProps field" for k in node if k not in props_keys()]
    errors += [f"{path}.{k}: not supported by apiextensions v1" for k in FORBIDDEN if k in node]
    if node.get("uniqueItems"):
        errors.append(f"{path}.uniqueItems: cannot be true")
    kind = node.get("type")
    if kind is not None and kind not in TYPES:
        errors.append(f"{path}.type: {kind!r} is not one of {TYPES}")
    if kind is None and not (node.get("x-kubernetes-int-or-string")
                             or node.get("x-kubernetes-preserve-unknown-fields")):
        errors.append(f"{path}: type is required (structural schema)")
    if "additionalProperties" in node and (node.get("properties")
                                           or node["additionalProperties"] is False):
        errors.append(f"{path}: additionalProperties must be a schema, and not beside properties")
    for pattern in [node["pattern"]] if "pattern" in node else []:
        try:
            re2.compile(pattern)
        except re2.error as exc:
            errors.append(f"{path}.pattern: not an RE2 expression: {exc}")
    if in_meta and "default" in node:
        errors.append(f"{path}.default: no defaults in apiVersion, kind or metadata")
    errors += _junctor_errors(node, path) + _extension_errors(node, path)
    errors += _rule_errors(node, path, correlatable)
    for key, sub in (node.get("properties") or {}).items():
        meta = root and key in ("metadata", "apiVersion", "kind")
        if root and key == "metadata":
            errors += _metadata_errors(sub, f"{path}.metadata")
        errors += node_errors(sub, f"{path}.{key}", correlatable=correlatable and node.get(
            "x-kubernetes-map-type") != "atomic", in_meta=in_meta or meta)
    if isinstance(node.get("items"), dict):
        errors += node_errors(node["items"], f"{path}[]", in_meta=in_meta,
                              correlatable=correlatable and node.get(
                                  "x-kubernetes-list-type") == "map")
    elif "items" in node:
        errors.append(f"{path}.items: must be one schema, not a list")
    if isinstance(node.get("additionalProperties"), dict):
        errors += node_errors(node["additionalProperties"], f"{path}.additionalProperties",
                              correlatable=correlatable, in_meta=in_meta)
    return errors


def _metadata_errors(node: dict[str, Any], path: str) -> list[str]:
    extra = set(node.get("properties") or {}) - {"name", "generateName"}
    keys = set(node) - {"type", "properties", "description"}
    return [f"{path}: only name and generateName may be restricted, got {sorted(extra | keys)}"
            ] if extra or keys else []


def schema_errors(schema: dict[str, Any], *, with_status: bool = True) -> list[str]:
    """The structural check of one version's openAPIV3Schema."""
    errors = node_errors(schema, "", root=True)
    if schema.get("type") != "object":
        errors.append("<root>: type must be object")
    if with_status:
        errors += [f"<root>.{k}: not allowed at the root with a status subresource"
                   for k in schema if k not in ROOT_ALLOWED]
    return errors
