"""Disaggregated prefill and decode with tensor parallelism: a producer process and a consumer
server of two ranks each (CPU, gloo), each rank moving its own KV shard
(kv_transfer/tensor_parallel.py): the consumer decodes as it would alone; a broken stream of
one rank, or one rank's server out of reach, costs a local prefill and leaks nothing; a pair of
unequal layouts (two ranks here, one there) is refused by the handshake, one line each side.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Iterator
from pathlib import Path

import pytest
from disagg_pair import (
    Producer,
    Relay,
    consumer_config,
    consumer_server,
    decode,
    fallback_case,
    free_blocks,
    free_port_run,
    leave_before_first_step,
    producer_process,
)
from harness import LiveServer
from prometheus_client.parser import text_string_to_metric_families

TP = 2
# 10, 13 and 19 tokens: with blocks of 4 the last needed block is partial, full, or the last
# token opens a block of its own.
PROMPTS = [[(7 * i + 3 * j) % 300 + 5 for j in range(n)] for i, n in enumerate((10, 13, 19))]
PROMPT = PROMPTS[1]


@pytest.fixture(scope="module")
def producer(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Producer]:
    # Holds nobody fetches whole are freed after 3 s.
    with producer_process(tiny_model, tmp_path_factory.mktemp("logs"), tp_size=TP,
                          hold_timeout_s=3.0) as live:
        yield live


@pytest.fixture(scope="module")
def consumer(tiny_model: Path) -> Iterator[LiveServer]:
    # No prefix cache: every request here fetches (or computes) its whole prompt.
    with consumer_server(consumer_config(tiny_model, tp_size=TP)) as live:
        yield live


def _sent(producer: Producer, name: str) -> float:
    return next(s.value for family in text_string_to_metric_families(producer.metrics_page())
                for s in family.samples
                if s.name == name and s.labels.get("direction") == "sent")


def test_greedy_output_is_the_consumers_own(consumer: LiveServer, producer: Producer) -> None:
    connector = consumer.state.kv_connector
    assert connector is not None and connector.block_nbytes == TP * connector.shard_nbytes
    num_free = free_blocks(consumer)
    alone = [decode(consumer, prompt, None, cache_salt="local") for prompt in PROMPTS]
    received_before = connector.stats.num_blocks["received"]
    with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
        answers = list(pool.map(lambda p: producer.prefill(p, cache_salt="remote"), PROMPTS))
        params = [a["kv_transfer_params"] for a in answers]
        assert all(p["tp_size"] == TP and p["remote_port"] == producer.kv_port for p in params)
        disaggregated = list(pool.map(lambda pp: decode(consumer, *pp, cache_salt="remote"),
                                      zip(PROMPTS, params, strict=True)))
    assert disaggregated == alone
    assert sum(connector.stats.fallbacks.values()) == 0
    # Every block of every prompt arrived, each rank's shard of it; both sides count as much.
    received = connector.stats.num_blocks["received"] - received_before
    assert received == sum(-(-(len(p) - 1) // 4) for p in PROMPTS)
    producer.wait_kv_usage_zero()
    assert _sent(producer, "kvasir:kv_transfer_blocks_total") == received
    assert _sent(producer, "kvasir:kv_transfer_bytes_total") == \
        consumer.metric("kvasir:kv_transfer_bytes_total", direction="received") == \
        received * connector.block_nbytes
    assert free_blocks(consumer) == num_free and connector.num_staged == 0


@pytest.mark.parametrize(("mode", "reason"), [
    ("corrupt", "checksum"),  # rank 1's first block is not what its crc32 says
    ("cut", "connection"),  # rank 1's stream ends in the middle of a block
])
def test_one_ranks_broken_stream_costs_a_local_prefill(
        consumer: LiveServer, producer: Producer, mode: str, reason: str) -> None:
    params = producer.prefill(PROMPT)["kv_transfer_params"]
    port = free_port_run(TP)
    relays = [Relay(params["remote_port"], "pass", port),
              Relay(params["remote_port"] + 1, mode, port + 1)]
    try:
        fallback_case(consumer, producer, PROMPT, {**params, "remote_port": port}, reason)
    finally:
        for relay in relays:
            relay.close()


def test_one_ranks_server_out_of_reach_costs_a_local_prefill(
        consumer: LiveServer, producer: Producer) -> None:
    """Rank 0's shard arrives, rank 1's server cannot be reached: the request prefills here;
    the producer's rank 1 frees its part after hold_timeout_s, and only then the blocks."""
    params = producer.prefill(PROMPT)["kv_transfer_params"]
    port = free_port_run(TP)  # nothing listens on port + 1
    relay = Relay(params["remote_port"], "pass", port)
    try:
        fallback_case(consumer, producer, PROMPT, {**params, "remote_port": port}, "connection")
    finally:
        relay.close()


def test_a_decode_whose_client_left_before_its_first_step_leaks_nothing(
        consumer: LiveServer, producer: Producer, caplog: pytest.LogCaptureFixture) -> None:
    """Its shards were dropped before the step that admits it: the ranks write nothing, the
    request fails alone after that step, and the engine serves on."""
    leave_before_first_step(consumer, producer, PROMPT, lambda: caplog.text)
    assert decode(consumer, PROMPT, None) == decode(consumer, PROMPT, None)


def test_two_ranks_here_and_one_there_are_refused_by_the_handshake_on_both_sides(
        tiny_model: Path, producer: Producer, caplog: pytest.LogCaptureFixture) -> None:
    with consumer_server(consumer_config(tiny_model)) as one_rank:
        params = producer.prefill(PROMPT)["kv_transfer_params"]
        fallback_case(one_rank, producer, PROMPT, params, "handshake")
    assert [r.getMessage() for r in caplog.records if "refused" in r.getMessage()] == [
        f"KV transfer refused: producer {params['remote_engine_id']} differs: "
        f"tensor_parallel_size 1 here, 2 there"]
    refusals = [line for line in producer.node.log.splitlines()
                if "KV transfer refused: consumer 127.0.0.1:" in line]
    assert len(refusals) == 1 and "tensor_parallel_size 2 here, 1 there" in refusals[0]


def test_bfloat16_answers_as_the_consumers_cached_prefix(tiny_model: Path,
                                                         tmp_path: Path) -> None:
    """In bfloat16 the reference is the consumer's own answer with the prompt's prefix cached
    (test_disaggregation.py says why)."""
    config = consumer_config(tiny_model, dtype="bfloat16", prefix_caching=True, tp_size=TP)
    with producer_process(tiny_model, tmp_path, dtype="bfloat16", tp_size=TP) as producer, \
            consumer_server(config) as consumer:
        prompt = PROMPTS[2]
        decode(consumer, prompt, None, cache_salt="local")
        cached = decode(consumer, prompt, None, cache_salt="local")
        params = producer.prefill(prompt, cache_salt="remote")["kv_transfer_params"]
        assert decode(consumer, prompt, params, cache_salt="remote") == cached
        connector = consumer.state.kv_connector
        assert connector is not None and sum(connector.stats.fallbacks.values()) == 0
        assert connector.stats.num_blocks["received"] == -(-(len(prompt) - 1) // 4)
        producer.wait_kv_usage_zero()


def test_torch_dist_connector_moves_each_ranks_shard_over_its_own_group(
        tiny_model: Path, tmp_path: Path) -> None:
    config = consumer_config(tiny_model, tp_size=TP, connector="TorchDistConnector")
    with producer_process(tiny_model, tmp_path, tp_size=TP,
                          connector="TorchDistConnector") as producer, \
            consumer_server(config) as consumer:
        alone = decode(consumer, PROMPT, None)
        params = producer.prefill(PROMPT)["kv_transfer_params"]
        assert decode(consumer, PROMPT, params) == alone
        connector = consumer.state.kv_connector
        assert connector is not None and sum(connector.stats.fallbacks.values()) == 0
        assert connector.stats.num_blocks["received"] == -(-(len(PROMPT) - 1) // 4)
        producer.wait_kv_usage_zero()
