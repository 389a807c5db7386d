"""A transfer that fails never costs the request: the consumer prefills locally instead, gives
the same answer, counts the reason, and neither side keeps a block (a real producer process,
a consumer server, and a relay between them that breaks the stream on purpose)."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from disagg_pair import (
    Producer,
    Relay,
    consumer_config,
    consumer_server,
    decode,
    fallback_case,
    free_blocks,
    leave_before_first_step,
    producer_process,
)
from harness import LiveServer
from kvasir_engine.main import main
from processes import free_port

PROMPT = [(5 * j) % 300 + 11 for j in range(14)]


@pytest.fixture(scope="module")
def producer(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Producer]:
    # Blocks nobody fetches are freed after 2 s.
    with producer_process(tiny_model, tmp_path_factory.mktemp("logs"),
                          hold_timeout_s=2.0) as live:
        yield live


@pytest.fixture(scope="module")
def consumer(tiny_model: Path) -> Iterator[LiveServer]:
    with consumer_server(consumer_config(tiny_model, transfer_timeout_s=1.0)) as live:
        yield live


def _fallback_case(consumer: LiveServer, producer: Producer, params: dict[str, Any],
                   reason: str) -> None:
    fallback_case(consumer, producer, PROMPT, params, reason)


@pytest.mark.parametrize(("mode", "reason"), [
    ("cut", "connection"),  # the producer's stream ends in the middle of a block
    ("corrupt", "checksum"),  # a block's bytes are not what its crc32 says
    ("stall", "timeout"),  # nothing arrives within transfer_timeout_s
])
def test_a_broken_transfer_falls_back_to_a_local_prefill(
        consumer: LiveServer, producer: Producer, mode: str, reason: str) -> None:
    params = producer.prefill(PROMPT)["kv_transfer_params"]
    relay = Relay(params["remote_port"], mode)
    try:
        _fallback_case(consumer, producer, {**params, "remote_port": relay.port}, reason)
    finally:
        relay.close()


def test_a_producer_that_died_costs_a_local_prefill(
        tiny_model: Path, tmp_path: Path, consumer: LiveServer) -> None:
    with producer_process(tiny_model, tmp_path) as dying:
        params = dying.prefill(PROMPT)["kv_transfer_params"]
        dying.node.stop()
        connector = consumer.state.kv_connector
        assert connector is not None
        before = connector.stats.fallbacks["connection"]
        num_free = free_blocks(consumer)
        assert decode(consumer, PROMPT, params) == decode(consumer, PROMPT, None)
        assert connector.stats.fallbacks["connection"] == before + 1
        assert free_blocks(consumer) == num_free and connector.num_staged == 0


def test_a_transfer_asked_twice_is_served_once(consumer: LiveServer,
                                               producer: Producer) -> None:
    params = producer.prefill(PROMPT)["kv_transfer_params"]
    decode(consumer, PROMPT, params)
    _fallback_case(consumer, producer, params, "unknown_transfer")


def test_a_full_receive_buffer_prefills_locally_and_the_producer_frees_the_blocks_unasked(
        tiny_model: Path, producer: Producer) -> None:
    with consumer_server(consumer_config(tiny_model, kv_buffer_size=1)) as small:
        params = producer.prefill(PROMPT)["kv_transfer_params"]
        # Nobody fetches them: the producer frees them after its hold_timeout_s.
        _fallback_case(small, producer, params, "cache_full")


def test_a_pair_that_disagrees_is_refused_by_the_handshake_on_both_sides(
        tiny_model: Path, producer: Producer, caplog: pytest.LogCaptureFixture) -> None:
    config = consumer_config(tiny_model)
    config = dataclasses.replace(config, cache=dataclasses.replace(config.cache, block_size=8))
    with consumer_server(config) as other:
        params = producer.prefill(PROMPT)["kv_transfer_params"]
        _fallback_case(other, producer, params, "handshake")
        # Known to differ: the next request does not even ask.
        _fallback_case(other, producer, producer.prefill(PROMPT)["kv_transfer_params"],
                       "handshake")
    assert [r.getMessage() for r in caplog.records if "refused" in r.getMessage()] == [
        f"KV transfer refused: producer {params['remote_engine_id']} differs: "
        f"block_size 8 here, 4 there"]
    assert "KV transfer refused: consumer 127.0.0.1:" in producer.node.log
    assert "block_size 4 here, 8 there" in producer.node.log


def test_a_known_producer_that_differs_fails_the_consumers_start_in_one_line(
        tiny_model: Path, producer: Producer, capsys: pytest.CaptureFixture[str]) -> None:
    transfer = {"kv_connector": "TCPConnector", "kv_role": "kv_consumer",
                "kv_connector_extra_config": {"producers": [f"127.0.0.1:{producer.kv_port}"]}}
    code = main(["serve", str(tiny_model), "--device", "cpu", "--dtype", "float32",
                 "--served-model-name", "test", "--block-size", "8", "--port", "0",
                 "--kv-transfer-config", json.dumps(transfer)])
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert code == 2
    assert last == (f"kvasir-engine: error: --kv-transfer-config: producer 127.0.0.1:"
                    f"{producer.kv_port} differs from this engine: block_size 8 here, 4 there")
    assert "block_size 4 here, 8 there" in producer.node.log


def test_known_producers_that_agree_or_are_not_up_yet_let_the_consumer_start(
        tiny_model: Path, producer: Producer, caplog: pytest.LogCaptureFixture) -> None:
    config = consumer_config(tiny_model)
    assert config.kv_transfer is not None
    absent = f"127.0.0.1:{free_port()}"
    config = dataclasses.replace(config, kv_transfer=dataclasses.replace(
        config.kv_transfer, producers=(f"127.0.0.1:{producer.kv_port}", absent)))
    with consumer_server(config) as live:
        params = producer.prefill(PROMPT)["kv_transfer_params"]
        assert decode(live, PROMPT, params) == decode(live, PROMPT, None)
    assert f"producer {absent} not reachable at start" in caplog.text


def test_a_decode_whose_client_left_before_its_first_step_leaks_nothing(
        consumer: LiveServer, producer: Producer, caplog: pytest.LogCaptureFixture) -> None:
    leave_before_first_step(consumer, producer, PROMPT, lambda: caplog.text)
