"""`kv_connector: TorchDistConnector`: the same protocol, the blocks over a two-rank
torch.distributed group (gloo on CPU) instead of TCP frames, between a real producer process and
a consumer server on 127.0.0.1."""

from __future__ import annotations

import concurrent.futures
from pathlib import Path

from disagg_pair import (
    consumer_config,
    consumer_server,
    decode,
    free_blocks,
    producer_process,
)

PROMPTS = [[(13 * i + 5 * j) % 300 + 3 for j in range(9 + 4 * i)] for i in range(3)]


def test_blocks_over_gloo_decode_the_same_greedy_tokens(tiny_model: Path,
                                                        tmp_path: Path) -> None:
    with producer_process(tiny_model, tmp_path, connector="TorchDistConnector") as producer, \
            consumer_server(consumer_config(tiny_model,
                                            connector="TorchDistConnector")) as consumer:
        connector = consumer.state.kv_connector
        assert connector is not None
        num_free = free_blocks(consumer)
        local = [decode(consumer, prompt, None) for prompt in PROMPTS]
        with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
            all_params = [a["kv_transfer_params"] for a in pool.map(producer.prefill, PROMPTS)]
            disaggregated = list(pool.map(lambda pp: decode(consumer, *pp),
                                          zip(PROMPTS, all_params, strict=True)))
        assert disaggregated == local
        assert sum(connector.stats.fallbacks.values()) == 0
        assert connector.stats.num_blocks["received"] == sum(
            -(-(len(prompt) - 1) // 4) for prompt in PROMPTS)
        assert free_blocks(consumer) == num_free and connector.num_staged == 0
        producer.wait_kv_usage_zero()


def test_a_tcp_consumer_and_a_torch_dist_producer_are_refused_by_the_handshake(
        tiny_model: Path, tmp_path: Path) -> None:
    # The refused transfer's blocks are freed at once (hold_timeout_s is far off).
    with producer_process(tiny_model, tmp_path, connector="TorchDistConnector") as producer, \
            consumer_server(consumer_config(tiny_model)) as consumer:
        connector = consumer.state.kv_connector
        assert connector is not None
        params = producer.prefill(PROMPTS[0])["kv_transfer_params"]
        assert decode(consumer, PROMPTS[0], params) == decode(consumer, PROMPTS[0], None)
        assert connector.stats.fallbacks["handshake"] == 1
        assert "kv_connector 'TorchDistConnector' here, 'TCPConnector' there" in producer.node.log
        producer.wait_kv_usage_zero()
