"""The gateway end to end on 127.0.0.1: real gateway (uvicorn), fake engines, real redis-server.

Every bad input and every limit answers with a clear status and OpenAI's error shape, never a
500 or a hang; streams pass through event by event; a client leaving cancels the upstream.
"""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path

import httpx
import pytest
from gateway_support import (
    KEYS,
    FakeEngine,
    fake_engines,
    free_port,
    gateway,
    post,
    replace_file,
    wait_until,
)
from kvasir_gateway.config import QuotaLimits

COMPLETION = {"model": "tiny", "prompt": "hello there", "max_tokens": 5}


def error_of(resp: httpx.Response) -> dict[str, object]:
    body = resp.json()
    assert set(body) == {"error"} and {"message", "type", "param", "code"} <= set(body["error"])
    return body["error"]  # type: ignore[no-any-return]


def test_keys_body_and_model_errors(key_file: Path) -> None:
    with fake_engines(FakeEngine()) as [engine], gateway(
            backends=(engine.url,), api_key_file=str(key_file), max_body_bytes=2000) as gw:
        resp = post(gw.url, "/v1/completions", COMPLETION)
        assert resp.status_code == 401 and "missing API key" in error_of(resp)["message"]
        assert resp.headers["www-authenticate"] == "Bearer"
        resp = post(gw.url, "/v1/completions", COMPLETION, key="sk-wrong")
        assert resp.status_code == 401 and error_of(resp)["message"] == "invalid API key"
        alice = KEYS["alice"]
        resp = post(gw.url, "/v1/completions", b"{not json", key=alice)
        assert resp.status_code == 400 and "not valid JSON" in error_of(resp)["message"]
        resp = post(gw.url, "/v1/completions", [1, 2], key=alice)
        assert resp.status_code == 400 and "JSON object" in error_of(resp)["message"]
        resp = post(gw.url, "/v1/completions", {"prompt": "x"}, key=alice)
        assert resp.status_code == 400 and error_of(resp)["param"] == "model"
        resp = post(gw.url, "/v1/completions", {**COMPLETION, "max_tokens": -3}, key=alice)
        assert resp.status_code == 400 and error_of(resp)["param"] == "max_tokens"
        resp = post(gw.url, "/v1/completions", {**COMPLETION, "stream": "yes"}, key=alice)
        assert resp.status_code == 400 and error_of(resp)["param"] == "stream"
        resp = post(gw.url, "/v1/chat/completions", {"model": "tiny", "messages": []}, key=alice)
        assert resp.status_code == 400 and error_of(resp)["param"] == "messages"
        resp = post(gw.url, "/v1/completions", {**COMPLETION, "prompt": "x" * 5000}, key=alice)
        assert resp.status_code == 413 and "--max-body-bytes" in error_of(resp)["message"]
        resp = post(gw.url, "/v1/completions", {**COMPLETION, "model": "huge"}, key=alice)
        assert resp.status_code == 404 and error_of(resp)["code"] == "model_not_found"
        resp = httpx.get(gw.url + "/v1/completions")
        assert resp.status_code == 405 and error_of(resp)
        resp = httpx.get(gw.url + "/nowhere")
        assert resp.status_code == 404 and error_of(resp)
        assert httpx.get(gw.url + "/v1/models").status_code == 401
        models = httpx.get(gw.url + "/v1/models", headers={"authorization": f"Bearer {alice}"})
        assert [m["id"] for m in models.json()["data"]] == ["tiny"]
        resp = post(gw.url, "/v1/completions", COMPLETION, key=alice)
        assert resp.status_code == 200 and resp.json()["usage"]["total_tokens"] == 13


def test_key_file_reloads_without_restart(key_file: Path) -> None:
    with fake_engines(FakeEngine()) as [engine], gateway(
            backends=(engine.url,), api_key_file=str(key_file), key_reload_seconds=0.1) as gw:
        assert post(gw.url, "/v1/completions", COMPLETION, key="sk-carol").status_code == 401
        replace_file(key_file, key_file.read_text() + "carol:sk-carol\n")
        wait_until(lambda: post(gw.url, "/v1/completions", COMPLETION,
                                key="sk-carol").status_code == 200, what="reloaded keys")
        replace_file(key_file, "carol:sk-carol\nbroken line with: \n:nokey\n")  # invalid: kept
        time.sleep(0.4)
        assert post(gw.url, "/v1/completions", COMPLETION, key=KEYS["alice"]).status_code == 200
        key_file.write_text("")  # emptied in place, as a rewrite is for a moment: kept too
        time.sleep(0.4)
        assert post(gw.url, "/v1/completions", COMPLETION, key=KEYS["alice"]).status_code == 200


def test_tenant_forwarded_with_the_gateways_key(key_file: Path) -> None:
    fake = FakeEngine()
    with fake_engines(fake) as [engine], gateway(
            backends=(engine.url,), api_key_file=str(key_file), upstream_key="gw-secret") as gw:
        resp = httpx.post(gw.url + "/v1/completions", json=COMPLETION, timeout=10, headers={
            "authorization": f"Bearer {KEYS['bob']}", "x-kvasir-tenant": "alice"})
        assert resp.status_code == 200
        sent = fake.received[-1]["headers"]
        assert sent["authorization"] == "Bearer gw-secret"
        assert sent["x-kvasir-tenant"] == "bob"  # the key's tenant, never the client's claim


def test_upstream_down_and_all_replicas_unready() -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    with gateway(backends=(dead,)) as gw:
        resp = post(gw.url, "/v1/completions", COMPLETION)
        assert resp.status_code == 503 and error_of(resp)["code"] == "no_ready_replica"
        assert resp.headers["retry-after"] == "1"
        assert httpx.get(gw.url + "/ready").status_code == 503
        assert httpx.get(gw.url + "/health").status_code == 200
    fake = FakeEngine(is_ready=False)
    with fake_engines(fake) as [engine], gateway(backends=(engine.url,)) as gw:
        resp = post(gw.url, "/v1/completions", COMPLETION)
        assert resp.status_code == 503 and "none ready" in error_of(resp)["message"]
        fake.is_ready = True
        wait_until(lambda: httpx.get(gw.url + "/ready").status_code == 200, what="ready")
        assert post(gw.url, "/v1/completions", COMPLETION).status_code == 200


def test_retry_on_another_replica_before_the_first_byte() -> None:
    failing, good = FakeEngine(status=503), FakeEngine()
    with fake_engines(failing, good) as [a, b], gateway(backends=(a.url, b.url)) as gw:
        for i in range(6):
            resp = post(gw.url, "/v1/completions", {**COMPLETION, "prompt": f"{i}" * 600})
            assert resp.status_code == 200
        assert len(good.received) == 6
    # every replica answers 503: the last answer goes to the client as it is (no 500)
    with fake_engines(FakeEngine(status=503)) as [a], gateway(backends=(a.url,)) as gw:
        resp = post(gw.url, "/v1/completions", COMPLETION)
        assert resp.status_code == 503 and error_of(resp)["message"] == "fake failure"
        assert resp.headers["retry-after"] == "7"  # the engine's own, passed on


def test_connection_failure_ejects_and_retries(tmp_path: Path) -> None:
    good = FakeEngine()
    with fake_engines(FakeEngine(), good) as [a, b], gateway(
            backends=(a.url, b.url), probe_interval_seconds=30, eject_seconds=30) as gw:
        wait_until(lambda: httpx.get(gw.url + "/ready").json().get("replicas") == 2)
        a.server.should_exit = True  # the replica dies between probes
        a.thread.join(timeout=10)
        # Each prompt's first choice is a rendezvous hash over the (random) ports: send until
        # one picked the dead replica (4 prompts all missed it 1 time in 16).
        for i in range(32):
            resp = post(gw.url, "/v1/completions", {**COMPLETION, "prompt": f"{i}" * 600})
            assert resp.status_code == 200
            if httpx.get(gw.url + "/ready").json()["replicas"] == 1:
                break
        assert httpx.get(gw.url + "/ready").json()["replicas"] == 1  # ejected
        text = httpx.get(gw.url + "/metrics").text
        assert 'kvasir_gateway_upstream_errors_total{kind="connect"} 1.0' in text
        b.server.should_exit = True  # the last one dies too, before a probe notices
        b.thread.join(timeout=10)
        resp = post(gw.url, "/v1/completions", COMPLETION)
        assert resp.status_code == 502 and error_of(resp)["code"] == "upstream_unavailable"
        assert "ConnectionError" in str(error_of(resp)["message"]) or "Connect" in str(
            error_of(resp)["message"])


def read_events(resp: httpx.Response) -> list[str]:
    return [line[6:] for line in resp.iter_lines() if line.startswith("data: ")]


@pytest.mark.parametrize("client_wants_usage", [False, True])
def test_sse_pass_through_and_usage(client_wants_usage: bool) -> None:
    fake = FakeEngine(num_chunks=4)
    with fake_engines(fake) as [engine], gateway(backends=(engine.url,)) as gw:
        body = {**COMPLETION, "stream": True}
        if client_wants_usage:
            body["stream_options"] = {"include_usage": True}
        with httpx.stream("POST", gw.url + "/v1/completions", json=body, timeout=10) as resp:
            assert resp.status_code == 200
            assert resp.headers["content-type"].startswith("text/event-stream")
            events = read_events(resp)
        assert fake.received[-1]["body"]["stream_options"] == {"include_usage": True}
        assert events[-1] == "[DONE]"
        texts = [json.loads(e)["choices"][0]["text"] for e in events[:4]]
        assert texts == ["t0", "t1", "t2", "t3"]
        usage_events = [e for e in events[:-1] if json.loads(e).get("usage")]
        assert len(usage_events) == (1 if client_wants_usage else 0)
        assert len(events) == (6 if client_wants_usage else 5)


def test_a_replica_breaking_off_mid_stream_ends_the_stream_cleanly() -> None:
    with fake_engines(FakeEngine(num_chunks=5, break_after=2)) as [engine], gateway(
            backends=(engine.url,)) as gw:
        with httpx.stream("POST", gw.url + "/v1/completions", timeout=10,
                          json={**COMPLETION, "stream": True}) as resp:
            assert resp.status_code == 200
            events = read_events(resp)
        assert [json.loads(e)["choices"][0]["text"] for e in events] == ["t0", "t1"]
        text = httpx.get(gw.url + "/metrics").text
        assert 'kvasir_gateway_upstream_errors_total{kind="broken"} 1.0' in text


def test_events_arrive_as_they_are_made() -> None:
    with fake_engines(FakeEngine(num_chunks=3, chunk_delay=0.4)) as [engine], gateway(
            backends=(engine.url,)) as gw:
        started = time.monotonic()
        with httpx.stream("POST", gw.url + "/v1/completions",
                          json={**COMPLETION, "stream": True}, timeout=10) as resp:
            lines = resp.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            first_at = time.monotonic() - started
            rest = list(lines)
        assert json.loads(first[6:])["choices"][0]["text"] == "t0"
        assert first_at < 0.35  # not buffered behind the 1.2 s the stream takes
        assert "data: [DONE]" in rest


def test_client_disconnect_cancels_upstream_at_once() -> None:
    fake = FakeEngine(num_chunks=100, chunk_delay=0.1)
    with fake_engines(fake) as [engine], gateway(backends=(engine.url,)) as gw:
        with socket.create_connection(("127.0.0.1", gw.port)) as sock:
            payload = json.dumps({**COMPLETION, "stream": True}).encode()
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: "
                         b"application/json\r\ncontent-length: " + str(len(payload)).encode()
                         + b"\r\n\r\n" + payload)
            assert b"200" in sock.recv(4096)
            closed_at = time.monotonic()
        wait_until(lambda: fake.cancelled, timeout=5, what="upstream cancelled")
        assert fake.cancelled[0] - closed_at < 1.0
        wait_until(lambda: 'kvasir_gateway_in_flight_requests 0.0'
                   in httpx.get(gw.url + "/metrics").text, what="in-flight released")


def test_disconnect_before_the_engine_answers_cancels_too() -> None:
    fake = FakeEngine(answer_delay=10.0)
    with fake_engines(fake) as [engine], gateway(backends=(engine.url,)) as gw:
        with pytest.raises(httpx.ReadTimeout):  # the client gives up while the engine waits
            post(gw.url, "/v1/completions", COMPLETION, timeout=httpx.Timeout(5, read=0.5))
        gave_up_at = time.monotonic()
        wait_until(lambda: fake.cancelled, timeout=5, what="upstream cancelled")
        assert fake.cancelled[0] - gave_up_at < 1.0
        wait_until(lambda: 'kvasir_gateway_in_flight_requests 0.0'
                   in httpx.get(gw.url + "/metrics").text, what="in-flight released")


def test_token_quota_429_headers_and_settlement(redis_url: str, key_file: Path) -> None:
    with fake_engines(FakeEngine(num_chunks=3)) as [engine], gateway(
            backends=(engine.url,), api_key_file=str(key_file), redis_url=redis_url,
            tenant_limits={"alice": QuotaLimits(tokens_per_minute=300)}) as gw:
        body = {**COMPLETION, "max_tokens": 200}  # reserves ~3 + 200; usage says 13
        first = post(gw.url, "/v1/completions", body, key=KEYS["alice"])
        assert first.status_code == 200
        assert first.headers["x-ratelimit-limit-tokens"] == "300"
        assert int(first.headers["x-ratelimit-remaining-tokens"]) <= 100
        # settled at 13 used: a second 203-token reservation now fits
        second = post(gw.url, "/v1/completions", body, key=KEYS["alice"])
        assert second.status_code == 200
        # 26 used, ~274 left (+5/s refill): a 293-token reservation must wait
        third = post(gw.url, "/v1/completions", {**COMPLETION, "max_tokens": 290},
                     key=KEYS["alice"])
        assert third.status_code == 429
        err = error_of(third)
        assert err["type"] == "rate_limit_error" and "tokens per minute" in str(err["message"])
        assert int(third.headers["retry-after"]) >= 1
        assert third.headers["x-ratelimit-reset-tokens"].endswith("s")
        too_big = post(gw.url, "/v1/completions", {**COMPLETION, "max_tokens": 400},
                       key=KEYS["alice"])
        assert too_big.status_code == 429 and "lower max_tokens" in error_of(too_big)["message"]
        # bob has no quota of his own and the default is unlimited
        assert post(gw.url, "/v1/completions", body, key=KEYS["bob"]).status_code == 200
        text = httpx.get(gw.url + "/metrics").text
        assert 'kvasir_gateway_tokens_refused_total{limit="tokens",tenant="alice"}' in text
        assert 'kvasir_gateway_requests_total{code="429",tenant="alice"} 2.0' in text


def test_streamed_usage_settles_the_reservation(redis_url: str) -> None:
    limits = QuotaLimits(tokens_per_minute=1000)
    with fake_engines(FakeEngine(num_chunks=3)) as [engine], gateway(
            backends=(engine.url,), redis_url=redis_url, default_limits=limits) as gw:
        for _ in range(10):  # 10 x ~803 reserved would need 8000; 10 x 13 used fits
            with httpx.stream("POST", gw.url + "/v1/completions", timeout=10,
                              json={**COMPLETION, "max_tokens": 800, "stream": True}) as resp:
                assert resp.status_code == 200
                list(resp.iter_lines())


def test_two_gateways_share_one_redis_budget(redis_url: str, key_file: Path) -> None:
    limits = {"alice": QuotaLimits(requests_per_minute=5)}
    with fake_engines(FakeEngine()) as [engine], gateway(
            backends=(engine.url,), api_key_file=str(key_file), redis_url=redis_url,
            tenant_limits=limits) as g1, gateway(
            backends=(engine.url,), api_key_file=str(key_file), redis_url=redis_url,
            tenant_limits=limits) as g2:
        codes = [post(gw.url, "/v1/completions", COMPLETION, key=KEYS["alice"]).status_code
                 for gw in [g1, g2] * 4]
        assert codes.count(200) == 5 and codes.count(429) == 3
        assert post(g2.url, "/v1/completions", COMPLETION, key=KEYS["bob"]).status_code == 200


def silent_port() -> tuple[socket.socket, int]:
    """A port that accepts connections and never answers (a hung Redis)."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    return sock, sock.getsockname()[1]


@pytest.mark.parametrize("fail_open", [True, False])
@pytest.mark.parametrize("how", ["refused", "silent"])
def test_redis_down_fails_open_or_closed_quickly(fail_open: bool, how: str) -> None:
    hung, port = silent_port() if how == "silent" else (None, free_port())
    try:
        with fake_engines(FakeEngine()) as [engine], gateway(
                backends=(engine.url,), redis_url=f"redis://127.0.0.1:{port}/0",
                redis_fail_open=fail_open, redis_timeout_seconds=0.2,
                default_limits=QuotaLimits(tokens_per_minute=10_000)) as gw:
            started = time.monotonic()
            resp = post(gw.url, "/v1/completions", COMPLETION)
            assert time.monotonic() - started < 2.0
            if fail_open:
                assert resp.status_code == 200
            else:
                assert resp.status_code == 503 and resp.headers["retry-after"] == "1"
                assert error_of(resp)["code"] == "quota_store_unavailable"
            action = "fail_open" if fail_open else "fail_closed"
            assert (f'kvasir_gateway_quota_store_errors_total{{action="{action}"}} 1.0'
                    in httpx.get(gw.url + "/metrics").text)
    finally:
        if hung is not None:
            hung.close()


def test_concurrency_limit_releases_when_requests_end(key_file: Path) -> None:
    fake = FakeEngine(num_chunks=5, chunk_delay=0.2)
    with fake_engines(fake) as [engine], gateway(
            backends=(engine.url,), api_key_file=str(key_file),
            tenant_limits={"alice": QuotaLimits(max_concurrent=1)}) as gw:
        auth = {"authorization": f"Bearer {KEYS['alice']}"}
        with httpx.stream("POST", gw.url + "/v1/completions", headers=auth, timeout=10,
                          json={**COMPLETION, "stream": True}) as resp:
            assert resp.status_code == 200
            busy = post(gw.url, "/v1/completions", COMPLETION, key=KEYS["alice"])
            assert busy.status_code == 429 and error_of(busy)["code"] == "rate_limit_concurrent"
            list(resp.iter_lines())
        assert post(gw.url, "/v1/completions", COMPLETION, key=KEYS["alice"]).status_code == 200
