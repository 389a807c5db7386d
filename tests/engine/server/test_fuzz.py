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
    content = json.dumps(body, allow_nan=True)
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
    for content in (b"{", b"[]", b"null", b"\xff\xfe", b'{"prompt": "x", "max_tokens": NaN}'):
        r = httpx.post(server.base_url + "/v1/completions", content=content, headers=headers)
        assert r.status_code == 400, (content, r.text)
        assert r.json()["error"]["type"] == "invalid_request_error"
