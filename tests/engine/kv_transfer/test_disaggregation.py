"""Disaggregated prefill and decode between a real producer process and a consumer server on
127.0.0.1, driven as vLLM's proxy drives them: the consumer decodes as if it had run the
prefill itself.

"As if" is exact: the blocks that arrive are bitwise the ones the consumer computes for the
same prompt, and the consumer then does what it does on a prefix-cache hit of the prompt's
all-but-last tokens (it recomputes the last one for its logits). So the reference is the
consumer's own answer with the prompt's prefix in its cache; under float32 that is also its
answer from a cold prefill. Under bfloat16 a prefix-cache hit itself may round the last
token's logits differently from a cold prefill (the engine's, not the transfer's), so there
the cold answer is not the reference.
"""

from __future__ import annotations

import concurrent.futures
from pathlib import Path

import pytest
from disagg_pair import (
    consumer_config,
    consumer_server,
    decode,
    free_blocks,
    producer_process,
)
from metrics_table import KV_TRANSFER, documented_metrics, problems
from prometheus_client.parser import text_string_to_metric_families

# Prompts of 10, 13, 16 and 19 tokens: with blocks of 4, the last needed block is partial,
# full, or the last token opens a block of its own.
PROMPTS = [[(7 * i + 3 * j) % 300 + 5 for j in range(10 + 3 * i)] for i in range(4)]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_greedy_output_is_the_same_with_and_without_disaggregation(
        tiny_model: Path, tmp_path: Path, dtype: str) -> None:
    config = consumer_config(tiny_model, dtype=dtype, prefix_caching=True)
    with producer_process(tiny_model, tmp_path, dtype=dtype) as producer, \
            consumer_server(config) as consumer:
        connector = consumer.state.kv_connector
        assert connector is not None
        num_free_before = free_blocks(consumer)
        # The consumer alone: cold, then with the prompt's prefix cached (salt "local").
        cold = [decode(consumer, prompt, None, cache_salt="local") for prompt in PROMPTS]
        cached = [decode(consumer, prompt, None, cache_salt="local") for prompt in PROMPTS]
        if dtype == "float32":
            assert cached == cold
        # One stream alone (salt "remote": nothing of it is cached on the consumer).
        answer = producer.prefill(PROMPTS[0], cache_salt="remote")
        params = answer["kv_transfer_params"]
        assert params["do_remote_prefill"] is True and params["remote_port"] == producer.kv_port
        assert answer["usage"]["completion_tokens"] == 1
        assert decode(consumer, PROMPTS[0], params, cache_salt="remote") == cached[0]
        assert connector.stats.num_blocks["received"] == -(-(len(PROMPTS[0]) - 1) // 4)
        # Several streams at once: the prefills together, then the decodes together.
        with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
            answers = pool.map(lambda p: producer.prefill(p, cache_salt="again"), PROMPTS)
            all_params = [a["kv_transfer_params"] for a in answers]
            disaggregated = list(pool.map(
                lambda pp: decode(consumer, *pp, cache_salt="again"),
                zip(PROMPTS, all_params, strict=True)))
        assert disaggregated == cached
        assert sum(connector.stats.fallbacks.values()) == 0
        # Nothing leaks: the consumer's blocks are free (or evictable cache) again, nothing
        # is left staged, and the producer holds no block once each was fetched.
        assert free_blocks(consumer) == num_free_before
        assert connector.num_staged == 0
        producer.wait_kv_usage_zero()
        # The metrics are as docs/metrics.md says, on both sides, and agree with each other.
        rows = [row for row in documented_metrics() if row.series == KV_TRANSFER]
        producer_page = producer.metrics_page()
        for page in (consumer.get("/metrics").text, producer_page):
            assert not problems(page, rows, need_series={KV_TRANSFER})
        received = connector.stats.num_blocks["received"]
        assert consumer.metric("kvasir:kv_transfer_blocks_total", direction="received") \
            == received == _sample(producer_page, "kvasir:kv_transfer_blocks_total", "sent")
        assert consumer.metric("kvasir:kv_transfer_seconds_count", direction="received") \
            == 1 + len(PROMPTS) == _sample(producer_page, "kvasir:kv_transfer_seconds_count",
                                           "sent")
        assert consumer.metric("kvasir:kv_transfer_bytes_total", direction="received") \
            == received * connector.block_nbytes


def _sample(page: str, name: str, direction: str) -> float:
    return next(s.value for family in text_string_to_metric_families(page)
                for s in family.samples
                if s.name == name and s.labels.get("direction") == direction)


def test_blocks_the_consumer_holds_by_prefix_hash_are_not_sent(tiny_model: Path,
                                                               tmp_path: Path) -> None:
    prompt = PROMPTS[3]  # 19 tokens: the K/V of 18 in 5 blocks
    config = consumer_config(tiny_model, prefix_caching=True)
    with producer_process(tiny_model, tmp_path) as producer, consumer_server(config) as consumer:
        connector = consumer.state.kv_connector
        assert connector is not None
        decode(consumer, prompt[:10], None, cache_salt="s")  # caches the first 2 blocks
        params = producer.prefill(prompt, cache_salt="s")["kv_transfer_params"]
        disaggregated = decode(consumer, prompt, params, cache_salt="s")
        assert connector.stats.num_blocks["received"] == 3
        assert sum(connector.stats.fallbacks.values()) == 0
        assert disaggregated == decode(consumer, prompt, None, cache_salt="s")
        assert disaggregated == decode(consumer, prompt, None, cache_salt="cold")
        producer.wait_kv_usage_zero()
