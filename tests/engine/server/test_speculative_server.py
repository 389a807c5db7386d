"""Speculative decoding behind the HTTP API: streaming, n > 1, stop strings, logprobs, and vLLM's
spec-decode counters on /metrics (a real server on 127.0.0.1, a tiny random checkpoint)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path

import pytest
from harness import LiveServer, live_server, tiny_config
from kvasir_engine.config import SpeculativeConfig
from metrics_table import SPECULATIVE, documented_metrics, problems

PROMPT = "Hello world! Hello world! Hello world! Hello world! Hello"


@pytest.fixture(scope="module")
def servers(tiny_model: Path) -> Iterator[tuple[LiveServer, LiveServer]]:
    plain = tiny_config(tiny_model, prefix_caching=True)
    spec = dataclasses.replace(plain, speculative=SpeculativeConfig(
        "ngram", 4, prompt_lookup_max=3, prompt_lookup_min=1, disable_by_batch_size=64))
    with live_server(plain) as a, live_server(spec) as b:
        yield a, b


def test_streamed_and_n_choices_are_the_same_with_speculation(
        servers: tuple[LiveServer, LiveServer]) -> None:
    plain, spec = servers
    spec.wait_idle()
    before = spec.metrics()
    answers = []
    for live in servers:
        client = live.client()
        stream = client.completions.create(model="test", prompt=PROMPT, max_tokens=24,
                                           temperature=0, stream=True,
                                           extra_body={"ignore_eos": True})
        streamed = "".join(chunk.choices[0].text for chunk in stream if chunk.choices)
        many = client.completions.create(model="test", prompt=PROMPT, max_tokens=16, n=2,
                                         temperature=0.8, seed=5, logprobs=1,
                                         extra_body={"ignore_eos": True})
        answers.append((streamed, [(c.text, c.logprobs.tokens) for c in many.choices]))
    assert answers[0] == answers[1]
    spec.wait_idle()
    after = spec.metrics()

    def delta(name: str, **labels: str) -> float:
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0.0) - before.get(key, 0.0)

    num_drafts = delta("vllm:spec_decode_num_drafts_total")
    num_draft_tokens = delta("vllm:spec_decode_num_draft_tokens_total")
    num_accepted = delta("vllm:spec_decode_num_accepted_tokens_total")
    per_pos = [delta("vllm:spec_decode_num_accepted_tokens_per_pos_total", position=str(p))
               for p in range(4)]
    assert num_drafts > 0 and 0 < num_accepted <= num_draft_tokens <= 4 * num_drafts
    assert sum(per_pos) == num_accepted and per_pos == sorted(per_pos, reverse=True)
    assert per_pos[0] <= num_drafts


def test_spec_decode_metrics_are_as_documented(servers: tuple[LiveServer, LiveServer]) -> None:
    """docs/metrics.md's speculative rows (test_metrics_parity.py holds the others): exported
    with their type and labels, one series per draft position from the start."""
    rows = [row for row in documented_metrics() if row.series == SPECULATIVE]
    assert rows and not problems(servers[1].get("/metrics").text, rows,
                                 need_series={SPECULATIVE})


def test_a_stop_string_cuts_accepted_drafts(servers: tuple[LiveServer, LiveServer]) -> None:
    plain, spec = servers
    full = plain.client().completions.create(model="test", prompt=PROMPT, max_tokens=24,
                                             temperature=0, extra_body={"ignore_eos": True})
    text = full.choices[0].text
    stop = text[len(text) // 2:len(text) // 2 + 3]
    if not stop.strip():
        pytest.skip("the tiny model's answer has no usable stop string here")
    results = [live.client().completions.create(
        model="test", prompt=PROMPT, max_tokens=24, temperature=0, stop=[stop],
        extra_body={"ignore_eos": True}).choices[0] for live in servers]
    assert results[0].text == results[1].text == text[:text.index(stop)]
    assert results[0].finish_reason == results[1].finish_reason == "stop"
    spec.wait_idle()
    assert spec.metric("vllm:kv_cache_usage_perc") == 0
