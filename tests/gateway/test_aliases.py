"""Model aliases: the routing file's rules (prompt length, tenant, header, classifier), its errors
naming the field, `/v1/models` listing aliases, and the answer naming the model and the rule."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest
from gateway_support import (
    KEYS,
    FakeEngine,
    fake_engines,
    gateway,
    post,
    replace_file,
    wait_until,
)
from kvasir_gateway.aliases import load_routing_file, parse_routing, resolve
from kvasir_gateway.classify import heuristic
from kvasir_gateway.config import config_from_args

TABLE: dict[str, Any] = {
    "aliases": {"auto": {
        "default": "small",
        "rules": [
            {"name": "long", "min_prompt_tokens": 50, "model": "large"},
            {"name": "team-b", "tenants": ["bob"], "model": "large"},
            {"name": "premium", "header": {"name": "X-Tier", "match": "premium|gold"},
             "model": "large"},
            {"name": "hard", "classifier": "kvasir_gateway.classify:heuristic",
             "labels": {"hard": "large", "easy": "small"}},
        ]}},
    "pools": {"small": {"cost_per_hour": 1.0}, "large": {"cost_per_hour": 4.0}},
}


def route_of(body: dict[str, Any], tokens: int = 3, tenant: str = "alice",
             headers: dict[str, str] | None = None) -> tuple[str, tuple[str, ...]]:
    alias = parse_routing(TABLE).aliases["auto"]
    route = resolve(alias, body, tokens, tenant, headers or {})
    return route.rule, route.models


def test_every_rule_kind() -> None:
    easy = {"prompt": "hi"}
    assert route_of(easy) == ("hard", ("small",))  # the classifier says easy
    assert route_of(easy, tokens=80) == ("long", ("large",))
    assert route_of(easy, tenant="bob") == ("team-b", ("large",))
    assert route_of(easy, headers={"x-tier": "gold"}) == ("premium", ("large",))
    assert route_of(easy, headers={"x-tier": "basic"}) == ("hard", ("small",))
    assert route_of({"prompt": "Prove that sqrt(2) is irrational"}) == ("hard", ("large",))
    assert heuristic({"messages": [{"role": "user", "content": "```py\nx=1\n```"}]}) == "hard"
    assert heuristic({"messages": [{"role": "user", "content": "What is 2+2?"}]}) == "easy"


def unknown_answer(body: dict[str, Any]) -> str:
    return "a-model-the-alias-does-not-know"


def test_a_classifier_naming_an_unknown_pool_falls_through() -> None:
    table = {"aliases": {"a": {"default": "small", "rules": [
        {"classifier": f"{__name__}:unknown_answer"}]}}}
    route = resolve(parse_routing(table).aliases["a"], {}, 1, "t", {})
    assert (route.rule, route.models) == ("default", ("small",))


@pytest.mark.parametrize(("table", "field"), [
    ({"aliases": {"a": {}}}, "aliases.a.default: required"),
    ({"aliases": {"a": {"default": 3}}}, "aliases.a.default: expected a string"),
    ({"aliases": {"a": {"default": "m", "bogus": 1}}}, "aliases.a.bogus: unknown field"),
    ({"aliases": {"a": {"default": "m", "rules": [{"model": "x", "min_prompt_tokens": -1}]}}},
     "aliases.a.rules[0].min_prompt_tokens: must be >= 0"),
    ({"aliases": {"a": {"default": "m", "rules": [{"name": "r"}]}}},
     "aliases.a.rules[0]: exactly one of 'model' or 'classifier'"),
    ({"aliases": {"a": {"default": "m", "rules": [{"classifier": "no.such.module:f"}]}}},
     "aliases.a.rules[0].classifier: cannot load"),
    ({"aliases": {"a": {"default": "m", "rules": [{"model": "x", "header": {"match": "("}}]}}},
     "aliases.a.rules[0].header.name: required"),
    ({"aliases": {"a": {"default": "cascade"}}}, "aliases.a.cascade is not set"),
    ({"aliases": {"a": {"cascade": ["s"]}}}, "aliases.a.cascade: needs at least two"),
    ({"aliases": {"a": {"cascade": ["s", "l"], "checks": {"length": False}}}},
     "aliases.a.checks: a cascade needs at least one check"),
    ({"aliases": {"a": {"cascade": ["s", "l"], "checks": {"min_mean_logprob": 1}}}},
     "aliases.a.checks.min_mean_logprob: expected a number <= 0"),
    ({"aliases": {"a": {"cascade": ["s", "l"], "checks": {"regex": "("}}}},
     "aliases.a.checks.regex: not a regex"),
    ({"aliases": {"a": {"cascade": ["s", "l"], "checks": {"json_schema": {"type": 5}}}}},
     "aliases.a.checks.json_schema: not a valid schema"),
    ({"aliases": {"a": {"cascade": ["s", "l"], "shadow": {"fraction": 2}}}},
     "aliases.a.shadow.fraction: must be in [0.0, 1.0]"),
    ({"aliases": {"a": {"default": "m", "shadow": {"fraction": 0.5}}}},
     "aliases.a.shadow.model: required"),
    ({"pools": {"p": {"cost_per_hour": -1}}}, "pools.p.cost_per_hour: must be >= 0"),
    ({"pools": {"p": {"cost_per_hour": 1, "full_load_tokens_per_second": 0}}},
     "pools.p.full_load_tokens_per_second: must be > 0"),
])
def test_bad_routing_names_the_field(table: dict[str, Any], field: str) -> None:
    with pytest.raises(ValueError, match="routing file") as info:
        parse_routing(table)
    assert field in str(info.value)


def test_routing_file_flag(tmp_path: Path) -> None:
    path = tmp_path / "routing.yaml"
    path.write_text("aliases:\n  auto:\n    cascade: [small, large]\n"
                    "    checks: {min_mean_logprob: -1.5}\n")
    config = config_from_args(["--routing-file", str(path)])
    alias = config.routing_table.aliases["auto"]
    assert alias.cascade == ("small", "large") and alias.checks.min_mean_logprob == -1.5
    assert alias.shadow.model == "large"  # the cascade's last is the reference
    path.write_text("aliases:\n  auto:\n    default: [1]\n")
    with pytest.raises(ValueError, match=f"--routing-file {path}: aliases.auto.default"):
        load_routing_file(str(path))
    with pytest.raises(ValueError, match="--routing-file /nonexistent"):
        load_routing_file("/nonexistent")


def test_alias_end_to_end(key_file: Path) -> None:
    small, large = FakeEngine(model="small", text="small says"), FakeEngine(
        model="large", text="large says")
    with fake_engines(small, large) as servers, gateway(
            backends=tuple(s.url for s in servers), api_key_file=str(key_file),
            routing_table=parse_routing(TABLE)) as gw:
        auth = {"authorization": f"Bearer {KEYS['alice']}"}
        models = httpx.get(gw.url + "/v1/models", headers=auth).json()["data"]
        assert [m["id"] for m in models] == ["large", "small", "auto"]
        assert models[2]["kvasir_alias_of"] == ["large", "small"]
        body = {"model": "auto", "prompt": "hi", "max_tokens": 4}
        resp = post(gw.url, "/v1/completions", body, key=KEYS["alice"])
        assert resp.status_code == 200, resp.text
        assert resp.json()["model"] == "small" and resp.headers["x-kvasir-model"] == "small"
        assert resp.headers["x-kvasir-route"] == "hard"
        assert small.received[-1]["body"]["model"] == "small"  # the pool's name upstream
        resp = post(gw.url, "/v1/completions", body, key=KEYS["bob"])
        assert resp.json()["model"] == "large" and resp.headers["x-kvasir-route"] == "team-b"
        resp = httpx.post(gw.url + "/v1/completions", json=body,
                          headers={**auth, "x-tier": "premium"})
        assert resp.headers["x-kvasir-route"] == "premium"
        # a plain model name still routes as before, and says which model answered
        resp = post(gw.url, "/v1/completions", {**body, "model": "large"}, key=KEYS["alice"])
        assert resp.headers["x-kvasir-model"] == "large" and "x-kvasir-route" not in resp.headers
        page = httpx.get(gw.url + "/metrics").text
        assert 'kvasir_gateway_pool_requests_total{alias="auto",model="small",rule="hard"} 1.0' \
            in page
        assert 'kvasir_gateway_pool_requests_total{alias="auto",model="large",rule="team-b"} 1.0' \
            in page


def broken_classifier(body: dict[str, Any]) -> str:
    raise RuntimeError("a bug in the user's classifier")


def test_a_failing_classifier_is_no_opinion() -> None:
    table = {"aliases": {"a": {"default": "small", "rules": [
        {"classifier": f"{__name__}:broken_classifier"}]}}}
    route = resolve(parse_routing(table).aliases["a"], {}, 1, "t", {})
    assert (route.rule, route.models) == ("default", ("small",))


def test_the_routing_file_reloads_and_a_bad_version_keeps_the_table(tmp_path: Path) -> None:
    path = tmp_path / "routing.yaml"
    path.write_text("aliases:\n  auto: {default: small}\n")
    small, large = FakeEngine(model="small"), FakeEngine(model="large")
    body = {"model": "auto", "prompt": "hi", "max_tokens": 4}
    with fake_engines(small, large) as servers, gateway(
            backends=tuple(s.url for s in servers), routing_file=str(path),
            routing_table=load_routing_file(str(path)), key_reload_seconds=0.05) as gw:
        registry = gw.app.state.gateway.metrics.registry

        def reloads(outcome: str) -> float:
            return registry.get_sample_value("kvasir_gateway_routing_reloads_total",
                                             {"outcome": outcome}) or 0.0

        assert post(gw.url, "/v1/completions", body).json()["model"] == "small"
        replace_file(path, "aliases:\n  auto: {default: large}\n  other: {default: small}\n")
        wait_until(lambda: reloads("ok") == 1, what="the reload")
        assert post(gw.url, "/v1/completions", body).json()["model"] == "large"
        ids = [m["id"] for m in httpx.get(gw.url + "/v1/models").json()["data"]]
        assert "other" in ids
        replace_file(path, "aliases:\n  auto: {default: [1]}\n")  # refused: the table stays
        wait_until(lambda: reloads("error") == 1, what="the refusal")
        assert post(gw.url, "/v1/completions", body).json()["model"] == "large"
        replace_file(path, "aliases:\n  auto: {default: small}\n")  # fixed again
        wait_until(lambda: reloads("ok") == 2, what="the second reload")
        assert post(gw.url, "/v1/completions", body).json()["model"] == "small"
        # Emptied in place (an editor, `>`: the moment before the new text): refused, not an
        # empty table that would drop every alias until the next poll.
        path.write_text("")
        wait_until(lambda: reloads("error") == 2, what="the empty version refused")
        assert post(gw.url, "/v1/completions", body).json()["model"] == "small"
