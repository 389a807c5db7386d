"""Property-based fuzz of request bodies: never a 5xx, never a hang, and the server still serves."""

from __future__ import annotations

import json
from typing import Any

import httpx
from harness import API_KEY, LiveServer
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

JUNK = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70),
                 st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=20),
                 st.lists(st.integers(-5, 500), max_size=4), st.dictionaries(
                     st.text(max_size=5), st.integers(), max_size=2))
SMALL_TOKENS = st.integers(-2, 8)
TOKEN_IDS = st.lists(st.integers(-3, 500), min_size=0, max_size=6)


def field(valid: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.one_of(valid, valid, JUNK)


SAMPLING = {
    "model": field(st.sampled_from(["test", "other"])),
    "n": field(st.integers(0, 5)),
    "temperature": field(st.floats(-1, 3)),
    "top_p": field(st.floats(-0.5, 1.5)),
    "top_k": field(st.integers(-3, 50)),
    "min_p": field(st.floats(-0.5, 1.5)),
    "presence_penalty": field(st.floats(-3, 3)),
    "frequency_penalty": field(st.floats(-3, 3)),
    "repetition_penalty": field(st.floats(-1, 3)),
    "seed": field(st.integers(-2**64, 2**64)),
    "stop": field(st.one_of(st.text(max_size=4), st.lists(st.text(max_size=4), max_size=20))),
    "stop_token_ids": field(TOKEN_IDS),
    "ignore_eos": field(st.booleans()),
    "min_tokens": field(st.integers(-1, 10)),
    "stream": field(st.booleans()),
    "stream_options": field(st.fixed_dictionaries({"include_usage": st.booleans()})),
    "max_tokens": field(SMALL_TOKENS),
    "logit_bias": field(st.dictionaries(st.text(max_size=3), st.floats(-5, 5), max_size=2)),
}
MESSAGE = st.fixed_dictionaries({
    "role": st.sampled_from(["system", "user", "assistant", "wizard"]),
    "content": st.one_of(st.text(max_size=30), st.lists(st.fixed_dictionaries(
        {"type": st.sampled_from(["text", "image_url"]), "text": st.text(max_size=10)}),
        max_size=2), JUNK)})
COMPLETION = st.fixed_dictionaries(
    {"prompt": field(st.one_of(st.text(max_size=40), TOKEN_IDS,
                               st.lists(st.text(max_size=10), max_size=3),
                               st.lists(TOKEN_IDS, max_size=2)))},
    optional={**SAMPLING, "logprobs": field(st.integers(-1, 25)), "echo": field(st.booleans()),
              "suffix": field(st.text(max_size=3)), "surprise": JUNK})
CHAT = st.fixed_dictionaries(
    {"messages": field(st.lists(MESSAGE, max_size=3))},
    optional={**SAMPLING, "logprobs": field(st.booleans()), "top_logprobs": field(
        st.integers(-1, 25)), "max_completion_tokens": field(SMALL_TOKENS), "surprise": JUNK})
# Bodies inside the documented ranges, so the fuzz reaches generation and streaming too.
VALID_SAMPLING = {
    "n": st.integers(1, 3), "temperature": st.floats(0, 2), "top_p": st.floats(0.05, 1),
    "top_k": st.integers(-1, 50), "min_p": st.floats(0, 1), "seed": st.integers(0, 2**40),
    "presence_penalty": st.floats(-2, 2), "repetition_penalty": st.floats(0.5, 2),
    "stop": st.lists(st.text(min_size=1, max_size=3), max_size=3),
    "stop_token_ids": st.lists(st.integers(0, 300), max_size=3), "ignore_eos": st.booleans(),
    "stream": st.booleans(), "max_tokens": st.integers(1, 6),
}
VALID = st.one_of(
    st.tuples(st.just("/v1/completions"), st.fixed_dictionaries(
        {"prompt": st.one_of(st.text(min_size=1, max_size=40),
                             st.lists(st.integers(0, 300), min_size=1, max_size=6))},
        optional={**VALID_SAMPLING, "logprobs": st.integers(0, 5), "echo": st.booleans()})),
    st.tuples(st.just("/v1/chat/completions"), st.fixed_dictionaries(
        {"messages": st.lists(st.fixed_dictionaries({
            "role": st.sampled_from(["system", "user", "assistant"]),
            "content": st.text(max_size=30)}), min_size=1, max_size=3)},
        optional={**VALID_SAMPLING, "logprobs": st.booleans()})))
BODY = st.one_of(VALID, st.tuples(st.just("/v1/completions"), COMPLETION),
                 st.tuples(st.just("/v1/chat/completions"), CHAT),
                 st.tuples(st.sampled_from(["/tokenize", "/detokenize"]),
                           st.one_of(COMPLETION, CHAT, st.fixed_dictionaries({
                               "tokens": field(TOKEN_IDS)}))))


def _post(server: LiveServer, path: str, body: Any) -> tuple[int, str]:
    # allow_nan: JSON with NaN/Infinity is what a sloppy client may send; it must be a 400.
    return _post_raw(server, path, json.dumps(body, allow_nan=True))


def _post_raw(server: LiveServer, path: str, content: str) -> tuple[int, str]:
    headers = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
    with httpx.stream("POST", server.base_url + path, content=content, headers=headers,
                      timeout=30) as resp:
        text = "".join(resp.iter_text())
        return resp.status_code, text


def test_fuzzed_bodies_never_5xx(server: LiveServer) -> None:
    statuses: list[int] = []

    @settings(max_examples=150, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(BODY)
    def check(case: tuple[str, Any]) -> None:
        path, body = case
        status, text = _post(server, path, body)
        statuses.append(status)
        assert status < 500, (status, text)
        if status >= 400:
            error = json.loads(text)["error"]
            assert error["message"] and error["type"]
        elif body.get("stream") is True and path.startswith("/v1"):
            assert text.rstrip().endswith("data: [DONE]"), text
        else:
            json.loads(text)

    check()
    # The fuzz reached generation as well as the validators.
    assert statuses.count(200) >= 5 and statuses.count(400) >= 5, sorted(set(statuses))
    server.wait_idle()
    assert server.metric("vllm:kv_cache_usage_perc") == 0
    r = server.client().completions.create(model="test", prompt="Hello", max_tokens=2)
    assert r.usage.completion_tokens >= 1


def test_raw_garbage_is_400(server: LiveServer) -> None:
    headers = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
    deep = b'{"prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}"
    for content in (b"{", b"[]", b"null", b"\xff\xfe", b'{"prompt": "x", "max_tokens": NaN}',
                    deep):
        r = httpx.post(server.base_url + "/v1/completions", content=content, headers=headers)
        assert r.status_code == 400, (content, r.text)
        assert r.json()["error"]["type"] == "invalid_request_error"


# -- extremes, field by field (issue 39: a top_k of 2**63 once killed the engine) -----------

EXTREME_INTS = st.sampled_from([2**31 - 1, 2**31, -(2**31) - 1, 2**63 - 1, 2**63, -(2**63) - 1,
                                2**64, 10**30, -(10**30), 10**400])
EXTREME_FLOATS = st.sampled_from([1e308, -1e308, 5e-324, -0.0, 1e-40, float("nan"),
                                  float("inf"), float("-inf"), 2.0**63])
EXTREME_TEXT = st.one_of(st.text(alphabet=st.characters(codec="utf-8"), max_size=50),
                         st.sampled_from(["\x00", "\u202e\u0644\u0627", "\U0001f600" * 200,
                                          "\ud800", "a\udfffb", "x" * 20000, ""]))


class Nested(int):
    """A JSON value nested `self` levels deep ({"k": [{"k": [...]}]}), sent as raw text: too
    deep for the client's own json.dumps."""

    def json(self) -> str:
        return '{"k": [' * (self // 2) + "1" + "]}" * (self // 2)


EXTREME = st.one_of(EXTREME_INTS, EXTREME_FLOATS, EXTREME_TEXT,
                    st.integers(2, 6000).map(Nested), st.lists(EXTREME_INTS, max_size=4))
INT_FIELDS = ["n", "best_of", "top_k", "seed", "min_tokens", "max_tokens", "logprobs",
              "prompt_logprobs", "stop_token_ids", "prompt"]
CHAT_FIELDS = ["n", "top_k", "seed", "max_tokens", "max_completion_tokens", "top_logprobs",
               "temperature", "messages"]
FLOAT_FIELDS = ["temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                "repetition_penalty"]
EXTREME_CASE = st.one_of(
    st.tuples(st.just("/v1/completions"), st.sampled_from(INT_FIELDS + FLOAT_FIELDS), EXTREME),
    st.tuples(st.just("/v1/chat/completions"), st.sampled_from(CHAT_FIELDS), EXTREME),
    st.tuples(st.just("/tokenize"), st.sampled_from(["prompt", "add_special_tokens"]), EXTREME),
    st.tuples(st.just("/detokenize"), st.just("tokens"), EXTREME))


def _base(path: str) -> dict[str, Any]:
    if path == "/v1/completions":
        return {"prompt": "Hello", "max_tokens": 2}
    if path == "/v1/chat/completions":
        return {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 2}
    if path == "/tokenize":
        return {"prompt": "Hello"}
    return {"tokens": [1, 2]}


def test_extreme_values_field_by_field_never_5xx_and_the_engine_lives(
        server: LiveServer) -> None:
    statuses: list[int] = []

    @settings(max_examples=200, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(EXTREME_CASE)
    def check(case: tuple[str, str, Any]) -> None:
        path, name, value = case
        if isinstance(value, Nested):
            status, text = _post_raw(server, path, json.dumps({**_base(path), name: "@"})
                                     .replace('"@"', value.json()))
        else:
            status, text = _post(server, path, {**_base(path), name: value})
        statuses.append(status)
        assert status < 500, (path, name, status, text[:300])
        if status >= 400:
            error = json.loads(text)["error"]
            assert error["message"] and error["type"]
        assert server.state.async_engine.engine_thread.is_alive, (path, name, value)

    check()
    assert server.get("/health").status_code == 200
    server.wait_idle()
    r = server.client().completions.create(model="test", prompt="Hello", max_tokens=2)
    assert r.usage.completion_tokens >= 1
