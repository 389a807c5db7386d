"""Model aliases: a name a client may send as `model`, mapped by rules to the pools that serve it.

A pool is a model id the replicas list in `/v1/models` (one InferenceService, one served model
name). The routing file (`--routing-file`, YAML or JSON) declares, per alias, an ordered list of
rules (first match wins: prompt length, tenant, a request header, a classifier), a `default`, an
optional `cascade` (pools tried small to large, escalating when a check fails, checks.py), an
optional `shadow` sample (shadow.py), and per pool its price (cost.py). Every field is checked
once at start; an error names the file and the field (`aliases.chat.rules[1].min_prompt_tokens`).

A rule's target is a pool (`model: NAME`) or the alias's cascade (`model: cascade`). A
classifier is a dotted path `module:function`, called with the request body; it returns a pool,
`cascade`, a key of the rule's `labels` (mapped to one of those), or None (no match: the next
rule). Its answer must name one of the alias's pools, so metric labels stay bounded; an answer
that does not, or an exception (logged), counts as None.
"""

from __future__ import annotations

import importlib
import json
import logging
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from kvasir_gateway.checks import CascadeChecks, parse_checks

log = logging.getLogger("kvasir_gateway.aliases")
CASCADE = "cascade"  # the target naming the alias's cascade
Classifier = Callable[[dict[str, Any]], str | None]
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/-]{0,127}")


@dataclass(frozen=True)
class Rule:
    name: str  # the `x-kvasir-route` header and the `rule` label
    target: str | None = None  # a pool or CASCADE; None: the classifier decides
    min_prompt_tokens: int | None = None  # estimated prompt tokens (chars / chars_per_token)
    max_prompt_tokens: int | None = None
    tenants: frozenset[str] | None = None
    header: str | None = None  # lower-case request header name
    header_pattern: re.Pattern[str] | None = None  # fullmatch; None: the header is present
    classifier: Classifier | None = None
    labels: Mapping[str, str] = field(default_factory=dict)  # classifier answer -> target

    def matches(self, prompt_tokens: int, tenant: str, headers: Mapping[str, str]) -> bool:
        if self.min_prompt_tokens is not None and prompt_tokens < self.min_prompt_tokens:
            return False
        if self.max_prompt_tokens is not None and prompt_tokens > self.max_prompt_tokens:
            return False
        if self.tenants is not None and tenant not in self.tenants:
            return False
        if self.header is not None:
            value = headers.get(self.header)
            if value is None:
                return False
            if self.header_pattern is not None and not self.header_pattern.fullmatch(value):
                return False
        return True


@dataclass(frozen=True)
class Shadow:
    fraction: float = 0.0  # of the requests another pool answered, re-sent to `model`
    model: str = ""  # the reference pool (default: the cascade's last)
    similarity_threshold: float = 0.8  # free text: difflib ratio at or above it agrees
    max_concurrent: int = 4  # shadows running at once; more are dropped and counted


@dataclass(frozen=True)
class Alias:
    name: str
    rules: tuple[Rule, ...] = ()
    default: str = CASCADE
    cascade: tuple[str, ...] = ()  # pools, cheapest first
    checks: CascadeChecks = CascadeChecks()
    shadow: Shadow = Shadow()

    @property
    def pools(self) -> frozenset[str]:
        targets = {r.target for r in self.rules} | set(self.cascade) | {self.default}
        targets |= {t for r in self.rules for t in r.labels.values()}
        return frozenset(t for t in targets if t and t != CASCADE)

    def pools_of(self, target: str) -> tuple[str, ...]:
        return self.cascade if target == CASCADE else (target,)


@dataclass(frozen=True)
class Pool:
    cost_per_hour: float | None = None  # the price of one replica's hardware, any currency
    full_load_tokens_per_second: float | None = None  # one replica's measured capacity


@dataclass(frozen=True)
class RoutingTable:
    aliases: Mapping[str, Alias] = field(default_factory=dict)
    pools: Mapping[str, Pool] = field(default_factory=dict)


@dataclass(frozen=True)
class Route:
    alias: Alias
    rule: str  # the rule that chose, or "default"
    models: tuple[str, ...]  # one pool, or the cascade's pools in order


def resolve(alias: Alias, body: dict[str, Any], prompt_tokens: int, tenant: str,
            headers: Mapping[str, str]) -> Route:
    for rule in alias.rules:
        if not rule.matches(prompt_tokens, tenant, headers):
            continue
        target = rule.target
        if rule.classifier is not None:
            try:
                answer = rule.classifier(body)
            except Exception:  # the user's code: its failure is no opinion, not a 500
                log.exception("classifier of rule %s (alias %s) failed", rule.name, alias.name)
                continue
            target = rule.labels.get(answer, answer) if answer is not None else None
            if target is None or (target != CASCADE and target not in alias.pools):
                continue  # no opinion, or a pool the alias does not know: the next rule
        if target is not None:
            return Route(alias, rule.name, alias.pools_of(target))
    return Route(alias, "default", alias.pools_of(alias.default))


class _Fields:
    """Reads one mapping of the file, naming the path of each field in errors."""

    def __init__(self, where: str, value: Any, allowed: set[str]) -> None:
        if not isinstance(value, dict):
            raise ValueError(f"{where}: expected a mapping, got {type(value).__name__}")
        unknown = set(value) - allowed
        if unknown:
            raise ValueError(f"{where}.{sorted(unknown)[0]}: unknown field (known: "
                             f"{', '.join(sorted(allowed))})")
        self.where, self.value = where, value

    def get(self, name: str, kind: type | tuple[type, ...], default: Any = None) -> Any:
        value = self.value.get(name, default)
        if value is not None and (not isinstance(value, kind) or isinstance(value, bool)
                                  and kind is not bool):
            raise ValueError(f"{self.where}.{name}: expected {_kind_name(kind)}, got {value!r}")
        return value

    def number(self, name: str, low: float, default: float | None = None,
               high: float | None = None) -> float | None:
        value = self.get(name, (int, float), default)
        if value is not None and (value < low or (high is not None and value > high)):
            bound = f"in [{low}, {high}]" if high is not None else f">= {low}"
            raise ValueError(f"{self.where}.{name}: must be {bound}, got {value!r}")
        return None if value is None else float(value)

    def pool(self, name: str, default: str | None = None) -> str | None:
        value = self.get(name, str, default)
        if value is not None and not _NAME.fullmatch(value):
            raise ValueError(f"{self.where}.{name}: {value!r} is not a model name")
        return None if value is None else str(value)


def _kind_name(kind: type | tuple[type, ...]) -> str:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if set(kinds) == {int, float}:
        return "a number"
    return " or ".join({"str": "a string", "int": "an integer", "float": "a number",
                        "list": "a list", "dict": "a mapping", "bool": "true or false"}
                       .get(k.__name__, k.__name__) for k in kinds)


def load_classifier(where: str, path: str) -> Classifier:
    module_name, colon, function = path.partition(":")
    if not colon or not module_name or not function:
        raise ValueError(f"{where}: expected 'module:function', got {path!r}")
    try:
        found = getattr(importlib.import_module(module_name), function)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"{where}: cannot load {path!r}: {exc}") from None
    if not callable(found):
        raise ValueError(f"{where}: {path!r} is not callable")
    return found  # type: ignore[no-any-return]


def _rule(where: str, value: Any, index: int) -> Rule:
    f = _Fields(where, value, {"name", "model", "min_prompt_tokens", "max_prompt_tokens",
                               "tenants", "header", "classifier", "labels"})
    tenants = f.get("tenants", list)
    if tenants is not None and not all(isinstance(t, str) for t in tenants):
        raise ValueError(f"{where}.tenants: expected a list of tenant names")
    header, pattern = f.value.get("header"), None
    if header is not None:
        h = _Fields(f"{where}.header", header, {"name", "match"})
        header = h.get("name", str)
        if not header:
            raise ValueError(f"{where}.header.name: required")
        if h.get("match", str) is not None:
            try:
                pattern = re.compile(h.value["match"])
            except re.error as exc:
                raise ValueError(f"{where}.header.match: not a regex: {exc}") from None
    labels = f.get("labels", dict) or {}
    for key, target in labels.items():
        if not isinstance(target, str) or not _NAME.fullmatch(target):
            raise ValueError(f"{where}.labels.{key}: expected a model name or 'cascade'")
    classifier_path = f.get("classifier", str)
    target = f.pool("model")
    if (target is None) == (classifier_path is None):
        raise ValueError(f"{where}: exactly one of 'model' or 'classifier' is required")
    low, high = f.get("min_prompt_tokens", int), f.get("max_prompt_tokens", int)
    for name, bound in (("min_prompt_tokens", low), ("max_prompt_tokens", high)):
        if bound is not None and bound < 0:
            raise ValueError(f"{where}.{name}: must be >= 0, got {bound}")
    return Rule(name=f.pool("name", f"rule-{index}") or "", target=target,
                min_prompt_tokens=low, max_prompt_tokens=high,
                tenants=frozenset(tenants) if tenants is not None else None,
                header=header.lower() if header else None, header_pattern=pattern,
                classifier=(load_classifier(f"{where}.classifier", classifier_path)
                            if classifier_path else None), labels=dict(labels))


def _alias(where: str, name: str, value: Any) -> Alias:
    f = _Fields(where, value, {"rules", "default", "cascade", "checks", "shadow"})
    cascade = f.get("cascade", list) or []
    if not all(isinstance(m, str) and _NAME.fullmatch(m) for m in cascade):
        raise ValueError(f"{where}.cascade: expected a list of model names")
    if len(cascade) == 1:
        raise ValueError(f"{where}.cascade: needs at least two pools (cheapest first)")
    rules = tuple(_rule(f"{where}.rules[{i}]", r, i)
                  for i, r in enumerate(f.get("rules", list) or []))
    default = f.pool("default", CASCADE if cascade else None)
    if default is None:
        raise ValueError(f"{where}.default: required when the alias has no cascade")
    uses_cascade = default == CASCADE or any(
        CASCADE in (r.target, *r.labels.values()) for r in rules)
    if uses_cascade and not cascade:
        raise ValueError(f"{where}: a target is 'cascade' but {where}.cascade is not set")
    if len({r.name for r in rules}) != len(rules):
        raise ValueError(f"{where}.rules: rule names must be unique")
    s = _Fields(f"{where}.shadow", f.value.get("shadow") or {},
                {"fraction", "model", "similarity_threshold", "max_concurrent"})
    shadow = Shadow(fraction=s.number("fraction", 0.0, 0.0, 1.0) or 0.0,
                    model=s.pool("model", cascade[-1] if cascade else None) or "",
                    similarity_threshold=s.number("similarity_threshold", 0.0, 0.8, 1.0) or 0.0,
                    max_concurrent=int(s.number("max_concurrent", 1, 4) or 1))
    if shadow.fraction > 0 and not shadow.model:
        raise ValueError(f"{where}.shadow.model: required when the alias has no cascade")
    checks = parse_checks(f"{where}.checks", f.value.get("checks") or {})
    if checks.is_empty and cascade:
        raise ValueError(f"{where}.checks: a cascade needs at least one check")
    return Alias(name, rules, default, tuple(cascade), checks, shadow)


def parse_routing(value: Any, where: str = "routing file") -> RoutingTable:
    """Errors read `WHERE: aliases.NAME.FIELD: what is wrong`."""
    try:
        return _table(value)
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from None


def _table(value: Any) -> RoutingTable:
    f = _Fields("(top level)", value, {"aliases", "pools"})
    aliases = {}
    for name, spec in (f.get("aliases", dict) or {}).items():
        if not isinstance(name, str) or not _NAME.fullmatch(name) or name == CASCADE:
            raise ValueError(f"aliases: {name!r} is not a valid alias name")
        aliases[name] = _alias(f"aliases.{name}", name, spec)
    pools = {}
    for name, spec in (f.get("pools", dict) or {}).items():
        p = _Fields(f"pools.{name}", spec, {"cost_per_hour", "full_load_tokens_per_second"})
        pools[str(name)] = Pool(p.number("cost_per_hour", 0.0),
                                p.number("full_load_tokens_per_second", 0.0))
        if pools[str(name)].full_load_tokens_per_second == 0:
            raise ValueError(f"pools.{name}.full_load_tokens_per_second: must be > 0")
    for alias in aliases.values():
        if alias.name in pools:
            raise ValueError(f"aliases.{alias.name}: also declared as a pool")
    return RoutingTable(aliases, pools)


def load_routing_file(path: str) -> RoutingTable:
    """YAML (JSON is YAML too); errors start with `--routing-file PATH`."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, ValueError) as exc:
        raise ValueError(f"--routing-file {path}: {exc}") from None
    return parse_routing_text(text, path)


def parse_routing_text(text: str, path: str) -> RoutingTable:
    where = f"--routing-file {path}"
    try:
        value = json.loads(text) if path.endswith(".json") else yaml.safe_load(text)
    except (ValueError, yaml.YAMLError) as exc:
        raise ValueError(f"{where}: {exc}") from None
    return parse_routing(value or {}, where)
