"""Cascades through the gateway with fake pools (the logic under test is the gateway's): every
check escalates, a passing small answer is returned (buffered, also as SSE), logprobs asked for
the check are stripped, the quota is charged both attempts exactly once, shadows compare."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from gateway_support import KEYS, FakeEngine, fake_engines, gateway, post, wait_until
from kvasir_gateway.aliases import Pool, parse_routing
from kvasir_gateway.checks import failed_check, parse_checks
from kvasir_gateway.config import QuotaLimits
from kvasir_gateway.cost import CostModel, cost_per_million
from kvasir_gateway.replicas import RATE_WINDOW_SECONDS, Replica
from kvasir_gateway.shadow import compare


def answer(text: str, finish: str = "stop", logprobs: list[float] | None = None,
           chat: bool = False) -> dict[str, Any]:
    choice: dict[str, Any] = {"index": 0, "finish_reason": finish}
    if chat:
        choice["message"] = {"role": "assistant", "content": text}
        if logprobs is not None:
            choice["logprobs"] = {"content": [{"logprob": v} for v in logprobs]}
    else:
        choice["text"] = text
        if logprobs is not None:
            choice["logprobs"] = {"token_logprobs": logprobs}
    return {"choices": [choice]}


def test_every_check() -> None:
    checks = parse_checks("c", {"min_mean_logprob": -1.0, "refusal_regex": r"(?i)\bI can't\b",
                                "json_schema": {"type": "object", "required": ["x"]}})
    good = answer('{"x": 1}', logprobs=[-0.1, -0.5])
    assert failed_check(checks, good) is None
    assert failed_check(checks, answer('{"x": 1}', "length", [-0.1])) == "length"
    assert failed_check(checks, answer("Sorry, I can't help", logprobs=[-0.1])) == "refusal"
    assert failed_check(checks, answer('{"y": 1}', logprobs=[-0.1])) == "json_schema"
    assert failed_check(checks, answer("not json", logprobs=[-0.1])) == "json_schema"
    assert failed_check(checks, answer('{"x": 1}', logprobs=[-3.0, -0.1])) == "logprob"
    assert failed_check(checks, answer('{"x": 1}')) == "logprob"  # no logprobs: cannot pass
    assert failed_check(checks, answer('{"x": 1}', logprobs=[-0.2], chat=True)) is None
    regex = parse_checks("c", {"regex": r"\d+", "length": False})
    assert failed_check(regex, answer(" 42\n", "length")) is None
    assert failed_check(regex, answer("forty-two")) == "regex"
    assert failed_check(regex, {"choices": []}) == "empty"


def test_shadow_comparison() -> None:
    assert compare('{"a": 1, "b": 2}', '{"b": 2, "a": 1}', True, 0.8)[0]
    assert not compare("4", "5", True, 0.8)[0]
    agree, score = compare("the cat sat on the mat", "the cat sat on a mat", False, 0.8)
    assert agree and 0.8 <= score < 1
    assert not compare("the cat sat", "dogs bark loudly at night", False, 0.8)[0]


def routing(**alias: Any) -> Any:
    spec = {"cascade": ["small", "large"], "checks": {"min_mean_logprob": -1.0}, **alias}
    return parse_routing({"aliases": {"auto": spec}, "pools": {
        "small": {"cost_per_hour": 1.0, "full_load_tokens_per_second": 1000},
        "large": {"cost_per_hour": 8.0, "full_load_tokens_per_second": 1000}}})


def sample(gw: Any, name: str, **labels: str) -> float:
    value = gw.app.state.gateway.metrics.registry.get_sample_value(name, labels)
    return 0.0 if value is None else float(value)


BODY = {"model": "auto", "prompt": "what is two and two", "max_tokens": 8, "temperature": 0}


@pytest.mark.parametrize("chat", [False, True])
def test_a_confident_small_answer_is_returned_without_its_logprobs(chat: bool) -> None:
    small = FakeEngine(model="small", text="four", logprob=-0.2)
    large = FakeEngine(model="large", text="4")
    path = "/v1/chat/completions" if chat else "/v1/completions"
    body: dict[str, Any] = dict(BODY)
    if chat:
        body = {"model": "auto", "max_tokens": 8,
                "messages": [{"role": "user", "content": "two and two?"}]}
    with fake_engines(small, large) as servers, gateway(
            backends=tuple(s.url for s in servers), routing_table=routing()) as gw:
        resp = post(gw.url, path, body)
        assert resp.status_code == 200, resp.text
        assert resp.json()["model"] == "small" and resp.headers["x-kvasir-model"] == "small"
        assert resp.headers["x-kvasir-route"] == "default"
        assert resp.json()["choices"][0]["logprobs"] is None  # asked upstream, stripped
        assert small.received[-1]["body"]["logprobs"] == (True if chat else 1)
        assert not large.received
        # a client that asked for logprobs keeps them
        resp = post(gw.url, path, {**body, "logprobs": True if chat else 2})
        assert resp.json()["choices"][0]["logprobs"] is not None
        # a streaming client gets the buffered answer as a normal SSE stream
        with httpx.stream("POST", gw.url + path, timeout=10,
                          json={**body, "stream": True,
                                "stream_options": {"include_usage": True}}) as stream:
            assert stream.headers["content-type"].startswith("text/event-stream")
            events = [line[6:] for line in stream.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        piece = chunks[0]["choices"][0]
        assert (piece["delta"]["content"] if chat else piece["text"]) == "four"
        assert chunks[-1]["usage"]["total_tokens"] > 0 and chunks[-1]["choices"] == []
        assert "stream" not in small.received[-1]["body"]  # the small one is never streamed


@pytest.mark.parametrize(("small", "checks", "check"), [
    (FakeEngine(model="small", text="four", logprob=-3.0), {"min_mean_logprob": -1.0},
     "logprob"),
    (FakeEngine(model="small", num_chunks=8), {"length": True}, "length"),
    (FakeEngine(model="small", text="I cannot answer that."),
     {"refusal_regex": "(?i)I cannot"}, "refusal"),
    (FakeEngine(model="small", text="four"), {"regex": r"\d+"}, "regex"),
    (FakeEngine(model="small", text="four"), {"json_schema": {"type": "integer"}},
     "json_schema"),
    (FakeEngine(model="small", status=400), {"length": True}, "error"),
])
def test_each_failed_check_escalates(small: FakeEngine, checks: dict[str, Any],
                                     check: str) -> None:
    large = FakeEngine(model="large", text="4", chunk_delay=0.0)
    with fake_engines(small, large) as servers, gateway(
            backends=tuple(s.url for s in servers), routing_table=routing(checks=checks)) as gw:
        resp = post(gw.url, "/v1/completions", BODY)
        assert resp.status_code == 200, resp.text
        assert resp.json()["model"] == "large" and resp.headers["x-kvasir-model"] == "large"
        assert resp.json()["choices"][0]["text"] == "4"
        assert resp.headers["x-kvasir-escalations"] == f"small={check}"
        assert large.received[-1]["body"]["model"] == "large"
        assert "logprobs" not in large.received[-1]["body"]  # the last pool is not checked
        assert sample(gw, "kvasir_gateway_cascade_escalations_total", alias="auto",
                      model="small", check=check) == 1
        assert sample(gw, "kvasir_gateway_cascade_escalation_added_seconds_count",
                      alias="auto") == 1
        wait_until(lambda: sample(gw, "kvasir_gateway_pool_requests_total", alias="auto",
                                  rule="default", model="large") == 1, what="counted")


def test_an_escalated_stream_is_streamed_from_the_large_pool() -> None:
    small = FakeEngine(model="small", text="four", logprob=-5.0)
    large = FakeEngine(model="large", num_chunks=3)
    with fake_engines(small, large) as servers, gateway(
            backends=tuple(s.url for s in servers), routing_table=routing()) as gw:
        with httpx.stream("POST", gw.url + "/v1/completions", timeout=10,
                          json={**BODY, "stream": True}) as stream:
            assert stream.headers["x-kvasir-model"] == "large"
            events = [line[6:] for line in stream.iter_lines() if line.startswith("data: ")]
        text = "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1])
        assert text == "t0t1t2" and events[-1] == "[DONE]"


def test_the_quota_is_charged_for_both_attempts_exactly_once() -> None:
    # usage: the fakes report prompt 10 + completion = their answer's chunks (3 each)
    small = FakeEngine(model="small", num_chunks=3)  # finish_reason length: escalates
    large = FakeEngine(model="large", num_chunks=3)
    limits = {"anonymous": QuotaLimits(tokens_per_minute=1000)}
    with fake_engines(small, large) as servers, gateway(
            backends=tuple(s.url for s in servers), tenant_limits=limits,
            routing_table=routing(checks={"length": True})) as gw:
        first = post(gw.url, "/v1/completions", BODY)
        assert first.status_code == 200 and first.json()["model"] == "large"
        wait_until(lambda: sample(gw, "kvasir_gateway_tokens_admitted_total",
                                  tenant="anonymous") == 26, what="the first settlement")
        second = post(gw.url, "/v1/completions", BODY)
        reserved = int(first.headers["x-ratelimit-remaining-tokens"]) - int(
            second.headers["x-ratelimit-remaining-tokens"])
        cost = 5 + 8  # the reservation: prompt estimate (19 chars / 4) + max_tokens
        assert reserved == (26 - cost) + cost  # the first's excess, then the second's hold
        # streamed: the same two attempts
        with httpx.stream("POST", gw.url + "/v1/completions", timeout=10,
                          json={**BODY, "stream": True}) as stream:
            list(stream.iter_lines())
        wait_until(lambda: sample(gw, "kvasir_gateway_tokens_admitted_total",
                                  tenant="anonymous") == 78, what="three settlements")


def test_cost_and_savings_against_always_large() -> None:
    small = FakeEngine(model="small", text="four", logprob=-0.1)
    large = FakeEngine(model="large", text="4")
    with fake_engines(small, large) as servers, gateway(
            backends=tuple(s.url for s in servers), routing_table=routing()) as gw:
        assert post(gw.url, "/v1/completions", BODY).json()["model"] == "small"
        wait_until(lambda: sample(gw, "kvasir_gateway_cascade_cost_total", alias="auto",
                                  kind="actual") > 0, what="the cost counted")
        actual = sample(gw, "kvasir_gateway_cascade_cost_total", alias="auto", kind="actual")
        large_cost = sample(gw, "kvasir_gateway_cascade_cost_total", alias="auto",
                            kind="always_large")
        # completion tokens: 3 (the fake's usage); 1/h and 8/h at 1000 tokens/s
        assert actual == pytest.approx(3 * 1.0 / 3.6e6)
        assert large_cost == pytest.approx(3 * 8.0 / 3.6e6)
        page = httpx.get(gw.url + "/metrics").text
        assert ('kvasir_gateway_cost_per_million_output_tokens{load="full",pool="large"}'
                in page)


def test_shadows_measure_disagreement_and_are_bounded() -> None:
    small = FakeEngine(model="small", text="four", logprob=-0.1)
    large = FakeEngine(model="large", text="4", answer_delay=0.3)
    table = routing(shadow={"fraction": 1.0, "max_concurrent": 1})
    with fake_engines(small, large) as servers, gateway(
            backends=tuple(s.url for s in servers), routing_table=table) as gw:
        started = time.monotonic()
        assert post(gw.url, "/v1/completions", BODY).json()["model"] == "small"
        assert time.monotonic() - started < 0.3  # the shadow is off the client's path
        assert post(gw.url, "/v1/completions", BODY).status_code == 200  # over the bound
        wait_until(lambda: sample(gw, "kvasir_gateway_shadow_comparisons_total", alias="auto",
                                  rule="default", outcome="disagree") == 1, what="a shadow")
        assert sample(gw, "kvasir_gateway_shadow_tenant_comparisons_total", alias="auto",
                      tenant="anonymous", outcome="disagree") == 1
        assert sample(gw, "kvasir_gateway_shadow_dropped_total", alias="auto",
                      reason="over_bound") == 1
        assert large.received[0]["body"]["model"] == "large"
        assert "logprobs" not in large.received[0]["body"]
        large.text = "four"
        assert post(gw.url, "/v1/completions", BODY).status_code == 200
        wait_until(lambda: sample(gw, "kvasir_gateway_shadow_comparisons_total", alias="auto",
                                  rule="default", outcome="agree") == 1, what="agreement")


def test_per_tenant_shadow_series_are_bounded(key_file: Path) -> None:
    small = FakeEngine(model="small", text="four", logprob=-0.1)
    large = FakeEngine(model="large", text="four")
    with fake_engines(small, large) as servers, gateway(
            backends=tuple(s.url for s in servers), api_key_file=str(key_file),
            routing_table=routing(shadow={"fraction": 1.0}), max_tenant_labels=1) as gw:
        for tenant in ("alice", "bob"):
            assert post(gw.url, "/v1/completions", BODY, key=KEYS[tenant]).status_code == 200
            wait_until(lambda: not gw.app.state.shadows.tasks, what="the shadow")
        assert sample(gw, "kvasir_gateway_shadow_tenant_comparisons_total", alias="auto",
                      tenant="alice", outcome="agree") == 1
        assert sample(gw, "kvasir_gateway_shadow_tenant_comparisons_total", alias="auto",
                      tenant="other", outcome="agree") == 1  # past --max-tenant-labels


def test_a_pool_with_no_replica_is_escalated_past(key_file: Path) -> None:
    large = FakeEngine(model="large", text="4")
    with fake_engines(large) as [server], gateway(
            backends=(server.url,), api_key_file=str(key_file), routing_table=routing()) as gw:
        resp = post(gw.url, "/v1/completions", BODY, key=KEYS["alice"])
        assert resp.status_code == 200 and resp.json()["model"] == "large"
        assert sample(gw, "kvasir_gateway_cascade_escalations_total", alias="auto",
                      model="small", check="error") == 1
    with fake_engines(FakeEngine(model="other")) as [server], gateway(
            backends=(server.url,), routing_table=routing()) as gw:
        resp = post(gw.url, "/v1/completions", BODY)
        assert resp.status_code == 404
        assert resp.json()["error"]["message"].startswith("alias 'auto' (rule default): model")


def test_measured_rate_and_cost_per_million() -> None:
    replica = Replica("http://r", is_ready=True, model_ids=frozenset({"small"}))
    assert replica.output_tokens_per_second == 0.0  # one sample: no rate yet
    for second in range(0, 41, 10):
        replica.record_generation_tokens(float(second), 100.0 * second)
    assert replica.output_tokens_per_second == pytest.approx(100.0)
    assert replica.generation_samples[-1][0] - replica.generation_samples[0][0] \
        <= RATE_WINDOW_SECONDS + 10
    replica.record_generation_tokens(50.0, 5.0)  # the engine restarted: its counter too
    assert replica.output_tokens_per_second == 0.0

    class Replicas:
        def routable(self) -> list[Replica]:
            return [busy, busy_too]

    busy, busy_too = (Replica(f"http://{i}", is_ready=True, model_ids=frozenset({"small"}))
                      for i in range(2))
    for r in (busy, busy_too):
        r.record_generation_tokens(0.0, 0.0)
        r.record_generation_tokens(10.0, 10_000.0)  # 1,000 tokens/s each
    costs = CostModel({"small": Pool(cost_per_hour=3.6)}, Replicas())  # type: ignore[arg-type]
    assert costs.measured("small") == (2, 2000.0)
    # 2 replicas x 3.6/h over 2,000 tokens/s: 1.0 per million, the same as one at full load
    assert costs.cost_per_token("small") == pytest.approx(1.0 / 1e6)
    assert cost_per_million(3.6, 100.0) == pytest.approx(10.0)  # a tenth of the load: 10x
    assert cost_per_million(3.6, 0.0) is None
