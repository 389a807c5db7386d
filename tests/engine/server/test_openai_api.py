"""The OpenAI API through the official `openai` client against a live server (tiny random model)."""

from __future__ import annotations

import string

import openai
import pytest
from harness import LiveServer, live_server, tiny_config

PROMPT = "The quick brown fox jumps over the lazy dog."
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello world!"}]


def greedy(server: LiveServer, prompt: str = PROMPT, **kw: object):  # type: ignore[no-untyped-def]
    return server.client().completions.create(model="test", prompt=prompt, temperature=0,
                                              **{"max_tokens": 16, **kw})


def test_completion_shape_usage_and_fingerprint(server: LiveServer) -> None:
    r = greedy(server, max_tokens=12, extra_body={"ignore_eos": True})
    prompt_ids = server.post("/tokenize", json={"prompt": PROMPT}).json()["tokens"]
    assert r.object == "text_completion" and r.model == "test" and len(r.choices) == 1
    assert r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens == len(prompt_ids)
    assert r.usage.completion_tokens == 12
    assert r.usage.total_tokens == len(prompt_ids) + 12
    assert r.usage.prompt_tokens_details.cached_tokens == 0
    assert r.system_fingerprint.startswith("fp_") and len(r.system_fingerprint) == 15
    timings = r.model_extra["kvasir"]
    assert set(timings) == {"queue_seconds", "prefill_seconds", "decode_seconds", "e2e_seconds"}
    assert all(v >= 0 for v in timings.values())
    assert timings["e2e_seconds"] >= timings["decode_seconds"]


def test_streaming_equals_non_streaming_and_ends_with_usage(server: LiveServer) -> None:
    whole = greedy(server, max_tokens=20, extra_body={"ignore_eos": True}).choices[0].text
    chunks = list(server.client().completions.create(
        model="test", prompt=PROMPT, max_tokens=20, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 20
    assert all(c.usage is None for c in chunks[:-1])


def test_chat_streaming_and_not(server: LiveServer) -> None:
    client = server.client()
    r = client.chat.completions.create(model="test", messages=MESSAGES, max_tokens=10,
                                       temperature=0, extra_body={"ignore_eos": True})
    assert r.object == "chat.completion" and r.choices[0].message.role == "assistant"
    assert r.usage.completion_tokens == 10
    templated = server.post("/tokenize", json={"messages": MESSAGES}).json()
    assert r.usage.prompt_tokens == templated["count"]
    stream = list(client.chat.completions.create(
        model="test", messages=MESSAGES, max_tokens=10, temperature=0, stream=True,
        extra_body={"ignore_eos": True}))
    assert stream[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in stream) == r.choices[0].message.content
    assert stream[-1].choices[0].finish_reason == "length"


def _printable_stop(text: str) -> tuple[str, int] | None:
    allowed = set(string.ascii_letters + string.digits + " .,")
    for i in range(2, len(text) - 2):
        candidate = text[i:i + 2]
        if set(candidate) <= allowed and text.find(candidate) == i:
            return candidate, i
    return None


def test_stop_string_cuts_the_text_and_names_itself(server: LiveServer) -> None:
    for prompt in (PROMPT, "Hello world!", "Paged attention keeps", "Continuous batching"):
        text = greedy(server, prompt, max_tokens=24, extra_body={"ignore_eos": True}
                      ).choices[0].text
        found = _printable_stop(text)
        if found:
            break
    assert found, "no printable 2-char substring in any greedy output"
    stop, index = found
    for stream in (False, True):
        r = server.client().completions.create(model="test", prompt=prompt, max_tokens=24,
                                               temperature=0, stop=[stop, "never-seen"],
                                               stream=stream, extra_body={"ignore_eos": True})
        choices = [c.choices[0] for c in r if c.choices] if stream else r.choices
        assert "".join(c.text for c in choices) == text[:index]
        assert choices[-1].finish_reason == "stop"
        assert choices[-1].model_extra["stop_reason"] == stop


def test_n_choices_and_seed_reproducibility(server: LiveServer) -> None:
    client = server.client()

    def sample(seed: int, n: int = 3):  # type: ignore[no-untyped-def]
        return client.completions.create(model="test", prompt=PROMPT, max_tokens=8, n=n,
                                         temperature=1.0, seed=seed,
                                         extra_body={"ignore_eos": True})

    a, b, c = sample(42), sample(42), sample(43)
    assert [ch.index for ch in a.choices] == [0, 1, 2]
    assert [ch.text for ch in a.choices] == [ch.text for ch in b.choices]
    assert [ch.text for ch in a.choices] != [ch.text for ch in c.choices]
    assert len({ch.text for ch in a.choices}) > 1, "n choices must be distinct samples"
    assert a.usage.completion_tokens == 24
    assert a.usage.prompt_tokens == sample(42, n=1).usage.prompt_tokens


def test_logprobs_completion_and_chat(server: LiveServer) -> None:
    r = greedy(server, max_tokens=6, logprobs=3, extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    assert all(x <= 0 for x in lp.token_logprobs)
    for chosen, tops in zip(lp.token_logprobs, lp.top_logprobs, strict=True):
        assert 1 <= len(tops) <= 3
        assert chosen >= max(tops.values()) - 1e-4  # greedy picks the most likely token
    assert lp.text_offset == sorted(lp.text_offset)
    chat = server.client().chat.completions.create(
        model="test", messages=MESSAGES, max_tokens=5, temperature=0, logprobs=True,
        top_logprobs=2, extra_body={"ignore_eos": True})
    content = chat.choices[0].logprobs.content
    assert len(content) == 5 and all(len(t.top_logprobs) == 2 for t in content)
    assert all(t.bytes == list(t.token.encode()) for t in content)


def test_models_tokenize_detokenize_version(server: LiveServer) -> None:
    models = server.client().models.list()
    assert [m.id for m in models.data] == ["test"]
    assert models.data[0].model_extra["max_model_len"] == 256
    ids = server.post("/tokenize", json={"prompt": PROMPT}).json()["tokens"]
    assert server.post("/detokenize", json={"tokens": ids}).json()["prompt"] == PROMPT
    assert server.get("/version", headers={"Authorization": "Bearer test-key-1"}).json()["version"]
    assert server.get("/version").status_code == 401


@pytest.mark.parametrize(("kwargs", "param"), [
    ({"temperature": 3}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"n": 5}, "n"),
    ({"logprobs": 50}, "logprobs"),
    ({"stop": [""]}, "stop.0"),
    ({"max_tokens": 300}, "max_tokens"),
    ({"extra_body": {"no_such_param": 1}}, "no_such_param"),
    ({"extra_body": {"stop_token_ids": [-1]}}, "stop_token_ids.0"),
])
def test_bad_completion_input_is_400_naming_the_param(server: LiveServer, kwargs: dict[str, object],
                                                      param: str) -> None:
    args = {"model": "test", "prompt": PROMPT, "max_tokens": 4, **kwargs}
    with pytest.raises(openai.BadRequestError) as info:
        server.client().completions.create(**args)  # type: ignore[call-overload]
    assert info.value.status_code == 400
    assert info.value.body["param"] == param
    assert info.value.body["type"] == "invalid_request_error"


def test_context_overflow_names_both_numbers(server: LiveServer) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        server.client().chat.completions.create(model="test", messages=MESSAGES, max_tokens=250)
    message = info.value.body["message"]
    assert "256" in message and "250" in message


def test_bad_chat_input(server: LiveServer) -> None:
    client = server.client()
    for kwargs in ({"messages": []}, {"messages": [{"role": "wizard", "content": "x"}]},
                   {"messages": MESSAGES, "top_logprobs": 2}):
        with pytest.raises(openai.BadRequestError):
            client.chat.completions.create(model="test", max_tokens=4, **kwargs)


def test_auth_not_found_and_body_limit(server: LiveServer) -> None:
    with pytest.raises(openai.AuthenticationError) as info:
        server.client(api_key="wrong").completions.create(model="test", prompt="x", max_tokens=2)
    assert info.value.body["code"] == "invalid_api_key"
    assert server.post("/v1/completions", api_key=None, json={"prompt": "x"}).status_code == 401
    for path in ("/health", "/ready", "/metrics"):
        assert server.get(path).status_code == 200
    with pytest.raises(openai.NotFoundError):
        server.client().models.retrieve("nope")
    with pytest.raises(openai.APIStatusError) as big:
        server.client().completions.create(model="test", prompt="x" * 70_000, max_tokens=2)
    assert big.value.status_code == 413


def test_draining_refuses_with_503(server: LiveServer) -> None:
    server.state.is_draining = True
    try:
        with pytest.raises(openai.InternalServerError) as info:
            greedy(server, max_tokens=2)
        assert info.value.status_code == 503
        assert server.get("/ready").status_code == 503
        assert server.get("/health").status_code == 200
    finally:
        server.state.is_draining = False


def test_prefix_cache_hits_show_in_usage(tiny_model) -> None:  # type: ignore[no-untyped-def]
    prompt = " ".join(["Paged attention keeps the key value cache in fixed size blocks."] * 4)
    with live_server(tiny_config(tiny_model, prefix_caching=True)) as live:
        first = greedy(live, prompt, max_tokens=4)
        second = greedy(live, prompt, max_tokens=4)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert 0 < cached < second.usage.prompt_tokens and cached % 4 == 0
    assert second.choices[0].text == first.choices[0].text
