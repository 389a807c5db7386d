"""Client mistakes that used to reach a 500 or pass silently: invalid Unicode text anywhere in a
body, out-of-vocabulary stop token ids, and a client that leaves before its answer (an INFO line,
never an ERROR traceback)."""

from __future__ import annotations

import logging
import threading
import time

import httpx
import pytest
from harness import API_KEY, LiveServer

LONE_SURROGATE = '"\\ud800"'  # JSON for a lone UTF-16 surrogate: valid JSON, invalid text


def _post_raw(server: LiveServer, path: str, body: str) -> httpx.Response:
    return httpx.post(server.base_url + path, content=body.encode(), timeout=30,
                      headers={"content-type": "application/json",
                               "authorization": f"Bearer {API_KEY}"})


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/chat/completions",
     '{"messages": [{"role": "user", "content": %s}], "max_tokens": 2}', "messages.0.content"),
    ("/v1/chat/completions",
     '{"messages": [{"role": "user", "content": [{"type": "text", "text": %s}]}]}',
     "messages.0.content.0.text"),
    ("/v1/chat/completions",
     '{"messages": [{"role": "user", "content": "hi", "name": %s}]}', "messages.0.name"),
    ("/tokenize", '{"messages": [{"role": "user", "content": %s}]}', "messages.0.content"),
    ("/tokenize", '{"prompt": %s}', "prompt"),
    ("/v1/completions", '{"prompt": "hi", "max_tokens": 2, "user": %s}', "user"),
    ("/v1/completions", '{"prompt": %s, "max_tokens": 2}', "prompt"),
    ("/v1/completions", '{"prompt": "hi", "stop": [%s]}', "stop"),
])
def test_invalid_unicode_text_is_400_naming_the_field(server: LiveServer, path: str, body: str,
                                                      param: str) -> None:
    resp = _post_raw(server, path, body % LONE_SURROGATE)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] is not None and error["param"].startswith(param), error
    assert error["type"] == "invalid_request_error"


def test_valid_non_ascii_text_still_works(server: LiveServer) -> None:
    # Surrogate *pairs* in JSON are one valid character (U+1F600), not an error.
    resp = _post_raw(server, "/tokenize", '{"prompt": "caf\\u00e9 \\ud83d\\ude00"}')
    assert resp.status_code == 200, resp.text
    assert resp.json()["count"] > 0


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_out_of_vocabulary_stop_token_ids_are_400(server: LiveServer, path: str) -> None:
    vocab = server.state.engine_config.model.arch.vocab_size
    body: dict[str, object] = {"max_tokens": 2, "stop_token_ids": [1, vocab]}
    if path == "/v1/completions":
        body["prompt"] = "hi"
    else:
        body["messages"] = [{"role": "user", "content": "hi"}]
    resp = server.post(path, json=body)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] == "stop_token_ids"
    assert str(vocab) in error["message"]
    body["stop_token_ids"] = [vocab - 1]
    assert server.post(path, json=body).status_code == 200


def test_non_streaming_disconnect_is_an_info_line(server: LiveServer,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    engine = server.state.async_engine
    caplog.set_level(logging.INFO)
    engine.engine_thread.step_gate.clear()
    try:
        def leave_early() -> None:
            with pytest.raises(httpx.ReadTimeout):
                server.post("/v1/completions", timeout=0.5, json={
                    "prompt": "Hello", "max_tokens": 8, "ignore_eos": True})

        client = threading.Thread(target=leave_early)
        client.start()
        client.join(timeout=30)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not any(
                "client disconnected" in r.getMessage() for r in caplog.records):
            time.sleep(0.05)
    finally:
        engine.engine_thread.step_gate.set()
    server.wait_idle()
    gone = [r for r in caplog.records if "client disconnected" in r.getMessage()]
    assert gone and all(r.levelno == logging.INFO and r.exc_info is None for r in gone)
    errors = [r for r in caplog.records
              if r.levelno >= logging.ERROR and r.name.startswith(("kvasir_engine", "uvicorn"))]
    assert not errors, [r.getMessage() for r in errors]
    # Its requests were aborted: nothing is left running or holding blocks.
    assert server.metric("vllm:num_requests_running") == 0
    assert server.metric("vllm:kv_cache_usage_perc") == 0


def test_a_bad_item_of_a_prompt_list_is_named_by_its_index(server: LiveServer) -> None:
    resp = _post_raw(server, "/v1/completions", '{"prompt": ["ok", "\\udfff"], "max_tokens": 2}')
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == "prompt.1", resp.json()


@pytest.mark.parametrize(("field", "value"), [("max_tokens", '"16"'), ("n", "1.0"),
                                              ("temperature", '"0.5"'), ("stream", '"true"')])
def test_numbers_and_booleans_are_not_coerced_from_strings(server: LiveServer, field: str,
                                                           value: str) -> None:
    resp = _post_raw(server, "/v1/completions",
                     f'{{"prompt": "hi", "max_tokens": 2, "{field}": {value}}}')
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == field


def test_min_tokens_above_max_tokens_is_400(server: LiveServer) -> None:
    resp = _post_raw(server, "/v1/completions", '{"prompt": "hi", "max_tokens": 2, "min_tokens": 5}')
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == "min_tokens"


@pytest.mark.parametrize("body", ['{"prompt": "hi", "max_tokens": 2, "temperature": 1e-40}',
                                  '{"prompt": "hi", "max_tokens": 2, "temperature": 0.001}'])
def test_a_tiny_temperature_is_raised_to_the_floor(server: LiveServer, body: str) -> None:
    """vLLM's rule: 0 < temperature < 0.01 samples at 0.01, not with overflowing scores."""
    resp = _post_raw(server, "/v1/completions", body)
    assert resp.status_code == 200, resp.text
    assert resp.json()["usage"]["completion_tokens"] >= 1


def test_a_tiny_repetition_penalty_is_400(server: LiveServer) -> None:
    resp = _post_raw(server, "/v1/completions",
                     '{"prompt": "hi", "max_tokens": 2, "repetition_penalty": 1e-40}')
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == "repetition_penalty"
