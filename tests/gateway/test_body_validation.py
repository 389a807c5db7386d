"""The gateway's own reading of a request body, on a real gateway on 127.0.0.1: a number it
cannot hold or JSON cannot carry is a 400 naming the field (never a 500, never sent on), the
largest counts it accepts still make a reservation the quota store and the metrics hold, and a
large body is parsed off the event loop."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest
from gateway_support import FakeEngine, Served, fake_engines, gateway, post
from kvasir_gateway import body as body_module
from kvasir_gateway.body import MAX_COUNT
from kvasir_gateway.config import QuotaLimits

PREFIX = b'{"model": "tiny", '
CHAT = b'"messages": [{"role": "user", "content": "x"}], '
# (route, the body's fields after "model", the field the 400 must name)
BAD_FIELDS = [
    ("/v1/completions", b'"prompt": "x", "max_tokens": 9223372036854775808', "max_tokens"),
    ("/v1/completions", b'"prompt": "x", "max_tokens": 2147483648', "max_tokens"),  # 2**31
    ("/v1/completions", b'"prompt": "x", "max_tokens": 1e308', "max_tokens"),
    ("/v1/completions", b'"prompt": "x", "max_tokens": NaN', "max_tokens"),
    ("/v1/completions", b'"prompt": "x", "max_tokens": ' + b"9" * 400, "max_tokens"),
    ("/v1/completions", b'"prompt": "x", "n": ' + b"9" * 5000, "n"),  # past int()'s digits
    ("/v1/completions", b'"prompt": "x", "n": Infinity', "n"),
    ("/v1/completions", b'"prompt": "x", "n": 0', "n"),
    ("/v1/chat/completions", CHAT + b'"max_completion_tokens": 9223372036854775808',
     "max_completion_tokens"),
    ("/v1/chat/completions", CHAT + b'"max_tokens": -1', "max_tokens"),
    ("/v1/chat/completions",
     b'"messages": [{"role": "user", "content": [{"type": "text", "text": "x", "w": 1e400}]}]',
     "messages[0].content[0].w"),
    ("/v1/completions", b'"prompt": [1, 2, -Infinity]', "prompt[2]"),
    ("/v1/completions", b'"prompt": "x", "temperature": NaN', "temperature"),
    ("/v1/completions", b'"prompt": "x", "seed": 1e999', "seed"),
    ("/v1/completions", b'"prompt": "x", "logit_bias": {"50256": -1e400}', "logit_bias.50256"),
]


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[FakeEngine, Served]]:
    fake = FakeEngine()
    with fake_engines(fake) as [engine], gateway(backends=(engine.url,),
                                                  max_body_bytes=16 << 20) as gw:
        yield fake, gw


@pytest.mark.parametrize(("path", "fields", "param"), BAD_FIELDS,
                         ids=[f"{c[2]}={c[1][-12:].decode()}" for c in BAD_FIELDS])
def test_a_number_out_of_bounds_is_a_400_naming_its_field(
        served: tuple[FakeEngine, Served], path: str, fields: bytes, param: str) -> None:
    fake, gw = served
    before = len(fake.received)
    resp = post(gw.url, path, PREFIX + fields + b"}")
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] == param and param in error["message"]
    assert len(fake.received) == before  # nothing went upstream


def test_deep_nesting_is_invalid_json_not_a_crash(served: tuple[FakeEngine, Served]) -> None:
    _, gw = served
    resp = post(gw.url, "/v1/completions", PREFIX + b'"prompt": ' + b"[" * 100_000)
    assert resp.status_code == 400 and resp.json()["error"]["code"] == "invalid_json"


def test_the_largest_counts_make_a_reservation_the_store_holds(redis_url: str) -> None:
    body = {"model": "tiny", "prompt": "hi", "max_tokens": MAX_COUNT, "n": MAX_COUNT}
    with fake_engines(FakeEngine()) as [engine], gateway(
            backends=(engine.url,), redis_url=redis_url, redis_fail_open=True,
            default_limits=QuotaLimits(tokens_per_minute=1000)) as gw:
        resp = post(gw.url, "/v1/completions", body)
        assert resp.status_code == 429  # refused as larger than a minute, not a store failure
        assert resp.json()["error"]["code"] == "rate_limit_too_large"


def test_a_large_body_is_parsed_off_the_event_loop(served: tuple[FakeEngine, Served],
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    fake, gw = served
    parsed_on: list[threading.Thread] = []
    parse = body_module.parse_request

    def recording(*args: Any) -> body_module.ParsedRequest:
        parsed_on.append(threading.current_thread())
        return parse(*args)

    monkeypatch.setattr(body_module, "parse_request", recording)
    prompt = "four " * ((8 << 20) // 5)  # an 8 MiB prompt
    assert post(gw.url, "/v1/completions", {"model": "tiny", "prompt": prompt,
                                            "max_tokens": 2}).status_code == 200
    assert post(gw.url, "/v1/completions", {"model": "tiny", "prompt": "small",
                                            "max_tokens": 2}).status_code == 200
    assert parsed_on[0] is not gw.thread  # uvicorn's loop runs in the server's thread
    assert parsed_on[1] is gw.thread  # a small body: a thread hop would cost more
    assert fake.received[-2]["body"]["prompt"] == prompt

