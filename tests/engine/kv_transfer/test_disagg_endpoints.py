"""The consumer's side of a transfer on every way of asking: chat as well as completions, and a
streamed decode, each the same as the consumer's own answer (float32, no prefix caching)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from disagg_pair import (
    API_KEY,
    MODEL_NAME,
    Producer,
    consumer_config,
    consumer_server,
    free_blocks,
    post_ok,
    producer_process,
)
from harness import LiveServer
from helpers import write_checkpoint

MESSAGES = [{"role": "user", "content": "where do the blocks go when the prefill is done?"}]


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Producer, LiveServer]]:
    model = write_checkpoint(tmp_path_factory.mktemp("tiny-llama"), "llama")
    with producer_process(model, tmp_path_factory.mktemp("logs")) as producer, \
            consumer_server(consumer_config(model)) as consumer:
        yield producer, consumer


def _chat(base_url: str, params: dict[str, Any] | None, max_tokens: int) -> dict[str, Any]:
    body: dict[str, Any] = {"model": MODEL_NAME, "messages": MESSAGES, "max_tokens": max_tokens,
                            "temperature": 0, "ignore_eos": True}
    if params is not None:
        body["kv_transfer_params"] = params
    return post_ok(base_url, "/v1/chat/completions", body)


def test_a_chat_completion_is_disaggregated_as_vllms_proxy_does_it(
        pair: tuple[Producer, LiveServer]) -> None:
    producer, consumer = pair
    first = _chat(producer.base_url, {"do_remote_decode": True}, max_tokens=12)
    assert first["usage"]["completion_tokens"] == 1
    decoded = _chat(consumer.base_url, first["kv_transfer_params"], max_tokens=12)
    local = _chat(consumer.base_url, None, max_tokens=12)
    assert decoded["choices"][0]["message"] == local["choices"][0]["message"]
    # The producer's one token is the consumer's first.
    assert local["choices"][0]["message"]["content"].startswith(
        first["choices"][0]["message"]["content"])
    connector = consumer.state.kv_connector
    assert connector is not None and sum(connector.stats.fallbacks.values()) == 0


def test_a_streamed_decode_is_the_same_text(pair: tuple[Producer, LiveServer]) -> None:
    producer, consumer = pair
    prompt = [(11 * j) % 300 + 7 for j in range(17)]
    params = producer.prefill(prompt)["kv_transfer_params"]
    num_free = free_blocks(consumer)
    connector = consumer.state.kv_connector
    assert connector is not None
    num_received = connector.stats.num_blocks["received"]
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 10, "temperature": 0,
            "ignore_eos": True, "stream": True}
    text = []
    with httpx.stream("POST", f"{consumer.base_url}/v1/completions",
                      json={**body, "kv_transfer_params": params}, timeout=60,
                      headers={"Authorization": f"Bearer {API_KEY}"}) as resp:
        for line in resp.iter_lines():
            if line.startswith("data: {"):
                text.append(json.loads(line[6:])["choices"][0]["text"])
    local = consumer.post("/v1/completions", api_key=API_KEY, json={**body, "stream": False})
    assert "".join(text) == local.json()["choices"][0]["text"]
    assert connector.stats.num_blocks["received"] == num_received + 4  # 16 tokens' K/V
    assert sum(connector.stats.fallbacks.values()) == 0
    assert free_blocks(consumer) == num_free
    producer.wait_kv_usage_zero()
