"""Prompt logprobs over HTTP: `echo` with `logprobs`, vLLM's `prompt_logprobs`, `max_tokens: 0`,
the sampled token inside `top_logprobs`, and logprob arrays cut at a stop string like the text.

Every value is checked against the model's own log_softmax, computed here with transformers on
the very checkpoint the server loads (float32 both sides).
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from harness import API_KEY, LiveServer, live_server, tiny_config

TOL = 2e-4
PROMPT = [5, 17, 42, 99, 3, 250, 8, 77, 130, 64, 12, 201, 33, 90]


@pytest.fixture(scope="module")
def reference(tiny_model: Path) -> Any:
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(
        str(tiny_model), torch_dtype=torch.float32).eval()


def model_logprobs(reference: Any, token_ids: list[int]) -> torch.Tensor:
    """[len, vocab]: row i is the distribution of token i + 1 given tokens 0..i."""
    with torch.no_grad():
        logits = reference(torch.tensor([token_ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


@pytest.fixture(scope="module")
def chunked_server(tiny_model: Path) -> Iterator[LiveServer]:
    """Prefix caching on, 16-token steps: a long prompt is prefilled over several steps."""
    config = tiny_config(tiny_model, prefix_caching=True, max_num_seqs=8)
    config = dataclasses.replace(config, scheduler=dataclasses.replace(
        config.scheduler, max_num_batched_tokens=16))
    with live_server(config) as live:
        yield live


def complete(server: LiveServer, **body: Any) -> dict[str, Any]:
    r = server.post("/v1/completions", json={"temperature": 0, **body})
    assert r.status_code == 200, r.text
    return r.json()  # type: ignore[no-any-return]


def stream(server: LiveServer, **body: Any) -> list[dict[str, Any]]:
    chunks = []
    with httpx.stream("POST", f"{server.base_url}/v1/completions", timeout=60,
                      headers={"Authorization": f"Bearer {API_KEY}"},
                      json={"temperature": 0, "stream": True, **body}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
    return chunks


def joined(chunks: list[dict[str, Any]]) -> tuple[str, dict[str, list[Any]]]:
    text, arrays = "", {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for c in chunks:
        for choice in c["choices"]:
            text += choice["text"]
            for key in arrays:
                arrays[key] += (choice["logprobs"] or {}).get(key, [])
    return text, arrays


def expected_top(tokenizer: Any, row: torch.Tensor, token_id: int, k: int) -> dict[str, float]:
    """OpenAI's top_logprobs of one position: the top k, then the token itself if not among
    them, keyed by text (tokens of equal text, such as partial UTF-8 bytes, share a key)."""
    top = row.topk(k)
    text = {t: tokenizer.decode([t], skip_special_tokens=False) for t in top.indices.tolist()}
    expected: dict[str, float] = {}
    for t, lp in zip(top.indices.tolist(), top.values.tolist(), strict=True):
        expected.setdefault(text[t], lp)
    if token_id not in text:
        expected.setdefault(tokenizer.decode([token_id], skip_special_tokens=False),
                            row[token_id].item())
    return expected


def assert_scores_prompt(reference: Any, prompt: list[int], token_logprobs: list[float | None],
                         top_logprobs: list[dict[str, float] | None], k: int,
                         tokenizer: Any) -> None:
    ref = model_logprobs(reference, prompt)
    assert token_logprobs[0] is None and top_logprobs[0] is None
    for i in range(1, len(prompt)):
        assert math.isclose(token_logprobs[i], ref[i - 1, prompt[i]].item(), abs_tol=TOL), i
        top = top_logprobs[i]
        assert top is not None and len(top) <= k + 1
        expected = expected_top(tokenizer, ref[i - 1], prompt[i], k)
        assert top == pytest.approx(expected, abs=TOL), i


def test_echo_with_logprobs_scores_every_prompt_token(server: LiveServer, reference: Any) -> None:
    body = complete(server, prompt=PROMPT, echo=True, logprobs=2, max_tokens=3)
    choice = body["choices"][0]
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(PROMPT) + 3 == len(lp["token_logprobs"])
    assert_scores_prompt(reference, PROMPT, lp["token_logprobs"], lp["top_logprobs"], 2,
                         server.state.tokenizer)
    # The completion continues the arrays, its offsets after the echoed prompt text.
    echo = server.state.tokenizer.decode(PROMPT)
    assert choice["text"].startswith(echo)
    assert lp["text_offset"][len(PROMPT)] == len(echo)
    assert lp["text_offset"] == sorted(lp["text_offset"])
    full = PROMPT + [int(t) for t in server.state.tokenizer.encode(choice["text"][len(echo):])]
    ref = model_logprobs(reference, full)
    # The first completion token is scored by the last prompt position.
    first = lp["token_logprobs"][len(PROMPT)]
    assert math.isclose(first, ref[len(PROMPT) - 1].max().item(), abs_tol=TOL)


def test_echo_with_max_tokens_zero_returns_the_prompt_only(server: LiveServer,
                                                           reference: Any) -> None:
    # What lm-evaluation-harness's loglikelihood requests look like (with max_tokens 0 or 1).
    body = complete(server, prompt=PROMPT, echo=True, logprobs=1, max_tokens=0, seed=1234)
    choice = body["choices"][0]
    assert choice["text"] == server.state.tokenizer.decode(PROMPT)
    assert len(choice["logprobs"]["tokens"]) == len(PROMPT)
    assert choice["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 0
    assert body["usage"]["prompt_tokens"] == len(PROMPT)
    assert_scores_prompt(reference, PROMPT, choice["logprobs"]["token_logprobs"],
                         choice["logprobs"]["top_logprobs"], 1,
                         server.state.tokenizer)


def test_streamed_echo_with_max_tokens_zero(server: LiveServer) -> None:
    whole = complete(server, prompt=PROMPT, echo=True, logprobs=1, max_tokens=0)
    chunks = stream(server, prompt=PROMPT, echo=True, logprobs=1, max_tokens=0,
                    stream_options={"include_usage": True})
    text, arrays = joined(chunks)
    assert text == whole["choices"][0]["text"]
    assert arrays == {k: whole["choices"][0]["logprobs"][k] for k in arrays}
    reasons = [c["finish_reason"] for chunk in chunks for c in chunk["choices"]]
    assert reasons[-1] == "length" and reasons.count("length") == 1
    assert chunks[-1]["usage"]["completion_tokens"] == 0


def test_text_prompt_echo_and_batched_prompts(server: LiveServer, reference: Any) -> None:
    prompts = ["The quick brown fox", "Paged attention keeps"]
    body = complete(server, prompt=prompts, echo=True, logprobs=0, max_tokens=1)
    for choice, text in zip(sorted(body["choices"], key=lambda c: c["index"]), prompts,
                            strict=True):
        ids = [int(t) for t in server.state.tokenizer.encode(text)]
        assert choice["text"].startswith(text)
        lp = choice["logprobs"]
        assert_scores_prompt(reference, ids, lp["token_logprobs"][:len(ids)],
                             lp["top_logprobs"][:len(ids)], 0,
                             server.state.tokenizer)


def test_vllm_prompt_logprobs_field(server: LiveServer, reference: Any) -> None:
    body = complete(server, prompt=PROMPT, prompt_logprobs=3, max_tokens=1)
    scored = body["choices"][0]["prompt_logprobs"]
    assert len(scored) == len(PROMPT) and scored[0] is None
    ref = model_logprobs(reference, PROMPT)
    for i in range(1, len(PROMPT)):
        position = scored[i]
        actual = position[str(PROMPT[i])]
        assert math.isclose(actual["logprob"], ref[i - 1, PROMPT[i]].item(), abs_tol=TOL)
        assert actual["rank"] == int((ref[i - 1] > ref[i - 1, PROMPT[i]]).sum()) + 1
        top = ref[i - 1].topk(3)
        for rank, (token_id, logprob) in enumerate(zip(top.indices.tolist(), top.values.tolist(),
                                                       strict=True), start=1):
            assert position[str(token_id)]["rank"] == rank
            assert math.isclose(position[str(token_id)]["logprob"], logprob, abs_tol=TOL)
        assert len(position) in (3, 4)
    # Not asked for: no logprobs of either kind.
    plain = complete(server, prompt=PROMPT, max_tokens=1)["choices"][0]
    assert plain["prompt_logprobs"] is None and plain["logprobs"] is None


def test_chunked_prefill_and_prefix_cache_hit_score_every_position(
        chunked_server: LiveServer, reference: Any) -> None:
    long_prompt = [(7 * i + 3) % 380 + 3 for i in range(90)]  # 90 tokens: 6 steps of 16
    # Fill the prefix cache with this prompt first: the scored request must not reuse it.
    warm = complete(chunked_server, prompt=long_prompt, max_tokens=1)
    again = complete(chunked_server, prompt=long_prompt, max_tokens=1)
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0  # the cache works
    assert warm["choices"][0]["text"] == again["choices"][0]["text"]
    body = complete(chunked_server, prompt=long_prompt, echo=True, logprobs=1, max_tokens=1,
                    prompt_logprobs=2)
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    choice = body["choices"][0]
    assert_scores_prompt(reference, long_prompt, choice["logprobs"]["token_logprobs"][:90],
                         choice["logprobs"]["top_logprobs"][:90], 1,
                         chunked_server.state.tokenizer)
    assert len(choice["prompt_logprobs"]) == 90
    ref = model_logprobs(reference, long_prompt)
    for i in range(1, 90):
        got = choice["prompt_logprobs"][i][str(long_prompt[i])]["logprob"]
        assert math.isclose(got, ref[i - 1, long_prompt[i]].item(), abs_tol=TOL), i


def test_streamed_echo_equals_the_non_streamed_answer(server: LiveServer) -> None:
    body = dict(prompt=PROMPT, echo=True, logprobs=2, max_tokens=5)
    whole = complete(server, **body)["choices"][0]
    chunks = stream(server, **body)
    text, arrays = joined(chunks)
    assert text == whole["text"]
    assert arrays == {k: whole["logprobs"][k] for k in arrays}
    first = chunks[0]["choices"][0]
    assert len(first["logprobs"]["tokens"]) >= len(PROMPT)  # the prompt goes out at once


def test_sampled_token_is_in_top_logprobs(server: LiveServer) -> None:
    # Hot sampling picks tokens outside the top-1 often; OpenAI lists up to logprobs + 1 then.
    body = complete(server, prompt=PROMPT, logprobs=1, max_tokens=24, temperature=2.0, seed=3,
                    ignore_eos=True)
    lp = body["choices"][0]["logprobs"]
    outside = 0
    for token, logprob, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"],
                                   strict=True):
        # A likelier token of the same text (a lone byte shows as U+FFFD) keeps the key's value.
        assert token in top and top[token] >= logprob
        assert 1 <= len(top) <= 2
        outside += len(top) == 2
    assert outside > 0
    zero = complete(server, prompt=PROMPT, logprobs=0, max_tokens=4, ignore_eos=True)
    lp = zero["choices"][0]["logprobs"]
    assert all(list(top) == [token] for token, top in zip(lp["tokens"], lp["top_logprobs"],
                                                          strict=True))


def test_chat_top_logprobs_keep_openai_shape(server: LiveServer) -> None:
    r = server.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 6, "temperature": 2.0,
        "seed": 5, "logprobs": True, "top_logprobs": 2, "ignore_eos": True})
    assert r.status_code == 200, r.text
    for item in r.json()["choices"][0]["logprobs"]["content"]:
        assert len(item["top_logprobs"]) == 2


def _stop_case(server: LiveServer) -> tuple[dict[str, Any], int]:
    """A greedy answer and a token index j whose text first appears where token j starts."""
    base = complete(server, prompt=PROMPT, logprobs=1, max_tokens=16, ignore_eos=True)
    choice = base["choices"][0]
    lp, text = choice["logprobs"], choice["text"]
    for j in range(1, len(lp["tokens"])):
        token = lp["tokens"][j]
        if (token.strip() and "\ufffd" not in token
                and text.find(token) == lp["text_offset"][j]
                and text[:lp["text_offset"][j]] == "".join(lp["tokens"][:j])):
            return choice, j
    pytest.skip("no token of this greedy answer can serve as a stop string")


def test_logprob_arrays_end_at_the_stop_string(server: LiveServer) -> None:
    base, j = _stop_case(server)
    stop = base["logprobs"]["tokens"][j]
    cut = base["logprobs"]["text_offset"][j]
    body = dict(prompt=PROMPT, logprobs=1, max_tokens=16, ignore_eos=True, stop=[stop])
    choice = complete(server, **body)["choices"][0]
    assert choice["text"] == base["text"][:cut]
    assert choice["finish_reason"] == "stop" and choice["stop_reason"] == stop
    for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        assert choice["logprobs"][key] == base["logprobs"][key][:j], key
    text, arrays = joined(stream(server, **body))
    assert text == choice["text"]
    assert arrays == {k: choice["logprobs"][k] for k in arrays}


def test_logprob_arrays_keep_a_token_partly_before_the_stop_string(server: LiveServer) -> None:
    base, j = _stop_case(server)
    tokens = base["logprobs"]["tokens"]
    if len(tokens[j]) < 2 or j + 1 >= len(tokens):
        pytest.skip("token too short to split")
    stop = tokens[j][1:] + tokens[j + 1]  # starts inside token j
    cut = base["text"].find(stop)
    if cut != base["logprobs"]["text_offset"][j] + 1:
        pytest.skip("the stop string occurs earlier in the text")
    body = dict(prompt=PROMPT, logprobs=1, max_tokens=16, ignore_eos=True, stop=[stop])
    choice = complete(server, **body)["choices"][0]
    assert choice["text"] == base["text"][:cut]
    assert choice["logprobs"]["tokens"] == tokens[:j + 1]
    text, arrays = joined(stream(server, **body))
    assert text == choice["text"] and arrays["tokens"] == tokens[:j + 1]


@pytest.mark.parametrize(("body", "param", "says"), [
    ({"prompt_logprobs": -1}, "prompt_logprobs", "greater than or equal to 0"),
    ({"prompt_logprobs": 21}, "prompt_logprobs", "less than or equal to 20"),
    ({"prompt_logprobs": 21, "echo": True, "logprobs": 1}, "prompt_logprobs", "20"),
    ({"echo": True, "logprobs": 21}, "logprobs", "less than or equal to 20"),
    ({"max_tokens": 0}, "max_tokens", "unless echo is true"),
    ({"max_tokens": -1, "echo": True}, "max_tokens", "greater than or equal to 0"),
])
def test_bad_logprob_fields_are_400_naming_the_field(server: LiveServer, body: dict[str, Any],
                                                     param: str, says: str) -> None:
    r = server.post("/v1/completions", json={"prompt": PROMPT, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
    assert says in r.json()["error"]["message"]


def test_the_logprobs_limit_itself_is_accepted(server: LiveServer) -> None:
    body = complete(server, prompt=PROMPT, echo=True, logprobs=20, prompt_logprobs=20,
                    max_tokens=1)
    choice = body["choices"][0]
    # Keyed by text, tokens of equal text (partial UTF-8 bytes) share a key; by id, never.
    assert all(1 < len(top) <= 21 for top in choice["logprobs"]["top_logprobs"][1:])
    assert all(len(position) in (20, 21) for position in choice["prompt_logprobs"][1:])
