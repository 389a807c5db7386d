"""`--kv-transfer-config`: vLLM's JSON, every mistake one line naming the key before any load;
and the handshake that refuses a producer / consumer pair whose blocks would mean different
things."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import pytest
from helpers import write_checkpoint
from kvasir_engine.kv_transfer.wire import layout_mismatch, layout_of
from kvasir_engine.main import main

sys.path.insert(0, str(Path(__file__).parents[1]))
from test_engine_args import _config  # noqa: E402


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("llama"), "llama")


def test_roles_as_vllm_spells_them(model: Path) -> None:
    flag = json.dumps({"kv_connector": "TCPConnector", "kv_role": "kv_producer",
                       "kv_ip": "127.0.0.1", "kv_port": 15000, "engine_id": "prefill-0",
                       "kv_connector_extra_config": {"hold_timeout_s": 5}})
    transfer = _config(model, "--kv-transfer-config", flag).kv_transfer
    assert transfer is not None and transfer.is_producer and not transfer.is_consumer
    assert (transfer.kv_port, transfer.hold_timeout_s) == (15000, 5.0)
    assert transfer.resolved_engine_id == "prefill-0"
    both = _config(model, "--kv-transfer-config",
                   '{"kv_connector": "TCPConnector", "kv_role": "kv_both"}').kv_transfer
    assert both is not None and both.is_producer and both.is_consumer
    assert both.resolved_engine_id == "127.0.0.1:14579"
    dist = _config(model, "--kv-transfer-config",
                   '{"kv_connector": "TorchDistConnector", "kv_role": "kv_consumer"}').kv_transfer
    assert dist is not None and dist.kv_connector == "TorchDistConnector"
    assert _config(model).kv_transfer is None


@pytest.mark.parametrize(("given", "message"), [
    ("{not json", "not valid JSON"),
    ('["kv_producer"]', "must be a JSON object"),
    ('{"kv_role": "kv_producer"}', "kv_connector is required"),
    ('{"kv_connector": "TCPConnector"}', "kv_role is required"),
    ('{"kv_connector": "NixlConnector", "kv_role": "kv_producer"}', "kv_connector must be one of"),
    ('{"kv_connector": "TCPConnector", "kv_role": "prefill"}', "kv_role must be one of"),
    ('{"kv_connector": "TCPConnector", "kv_role": "kv_both", "kv_rank": 0}',
     "unknown key 'kv_rank'"),
    ('{"kv_connector": "TCPConnector", "kv_role": "kv_both", "kv_port": "1"}',
     "kv_port must be an int"),
    ('{"kv_connector": "TCPConnector", "kv_role": "kv_both", "kv_port": 70000}',
     "kv_port must be in [1, 65535]"),
    ('{"kv_connector": "TCPConnector", "kv_role": "kv_both", "kv_buffer_size": 0}',
     "kv_buffer_size must be > 0"),
    ('{"kv_connector": "TCPConnector", "kv_role": "kv_both", '
     '"kv_connector_extra_config": {"hold_timeout_s": -1}}', "hold_timeout_s must be > 0"),
    ('{"kv_connector": "TCPConnector", "kv_role": "kv_both", '
     '"kv_connector_extra_config": {"retries": 3}}', "unknown key 'retries'"),
    ('{"kv_connector": "TCPConnector", "kv_role": "kv_consumer", '
     '"kv_connector_extra_config": {"producers": ["prefill-0"]}}', "each must be host:port"),
    ('{"kv_connector": "TCPConnector", "kv_role": "kv_consumer", '
     '"kv_connector_extra_config": {"producers": [8100]}}', "a list of host:port strings"),
])
def test_bad_configs_fail_at_start_with_one_line(model: Path, given: str, message: str,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["generate", str(model), "--device", "cpu", "--kv-transfer-config", given,
                 "--prompt", "hi"])
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert len(err.splitlines()) == 1 and "--kv-transfer-config" in err and message in err, err


@pytest.mark.parametrize("flags", [["--pipeline-parallel-size", "2"],
                                   ["--tensor-parallel-size", "2", "--nnodes", "2"]])
def test_a_transfer_across_stages_or_nodes_is_refused_at_start(
        model: Path, flags: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["generate", str(model), "--device", "cpu", *flags,
                 "--kv-transfer-config", '{"kv_connector": "TCPConnector", "kv_role": "kv_both"}',
                 "--prompt", "hi"])
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert len(err.splitlines()) == 1 and "with tensor parallelism on one node only" in err, err


def test_tensor_parallel_ranks_serve_on_consecutive_kv_ports(model: Path) -> None:
    flag = '{"kv_connector": "TCPConnector", "kv_role": "kv_producer", "kv_port": %d}'
    config = _config(model, "--tensor-parallel-size", "2", "--kv-transfer-config", flag % 65534)
    assert config.kv_transfer is not None and config.kv_transfer.kv_port == 65534
    with pytest.raises(ValueError, match="kv_port \\+ --tensor-parallel-size - 1 must be <= 65535"):
        _config(model, "--tensor-parallel-size", "2", "--kv-transfer-config", flag % 65535)


def test_the_handshake_names_every_field_the_pair_disagrees_on(model: Path) -> None:
    config = _config(model, "--block-size", "4", "--dtype", "float32")
    mine = layout_of(config)
    assert layout_mismatch(mine, dict(mine)) is None
    other = layout_of(dataclasses.replace(
        config, cache=dataclasses.replace(config.cache, block_size=8, kv_cache_dtype="bfloat16")))
    mismatch = layout_mismatch(mine, other)
    assert mismatch is not None and "\n" not in mismatch
    assert "block_size 4 here, 8 there" in mismatch
    assert "kv_cache_dtype 'float32' here, 'bfloat16' there" in mismatch
    assert "model" not in mismatch and "head_dim" not in mismatch
    assert layout_mismatch(mine, "garbage") == "the peer sent no layout"
