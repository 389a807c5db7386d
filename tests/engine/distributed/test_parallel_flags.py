"""The pipeline and multi-node flags (args.py, config.py): torchrun's environment names, flags
winning over them, and the sizes that cannot work refused with one line naming the flag."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest
from helpers import write_checkpoint
from kvasir_engine.args import add_engine_args, apply_env_defaults, engine_config_from_args
from kvasir_engine.config import EngineConfig
from kvasir_engine.distributed.bootstrap import config_fields


def _config(model: Path, *flags: str, environ: dict[str, str] | None = None) -> EngineConfig:
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    apply_env_defaults(parser, environ or {})
    return engine_config_from_args(parser.parse_args([str(model), "--device", "cpu", *flags]))


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("flags") / "llama", "llama",
                            num_hidden_layers=4)


def test_multinode_flags_and_their_torchrun_environment(model: Path) -> None:
    env = {"NNODES": "2", "NODE_RANK": "1", "MASTER_ADDR": "10.0.0.7", "MASTER_PORT": "29511"}
    parallel = _config(model, "-pp", "2", environ=env).parallel
    assert (parallel.nnodes, parallel.node_rank, parallel.master_addr, parallel.master_port) \
        == (2, 1, "10.0.0.7", 29511)
    assert parallel.world_size == 2 and list(parallel.node_ranks) == [1]
    # An explicit flag wins over the environment; KVASIR_* wins over torchrun's name.
    parallel = _config(model, "-pp", "2", "--node-rank", "0",
                       environ={**env, "KVASIR_MASTER_PORT": "30000"}).parallel
    assert parallel.node_rank == 0 and parallel.master_port == 30000
    assert parallel.node_heartbeat_timeout_s == 5.0
    parallel = _config(model, "-pp", "2",
                       environ={**env, "KVASIR_NODE_HEARTBEAT_TIMEOUT": "2.5"}).parallel
    assert parallel.node_heartbeat_timeout_s == 2.5


@pytest.mark.parametrize(("flags", "message"), [
    (["-pp", "2", "--nnodes", "3"], "--nnodes 3 does not divide the 2 ranks"),
    (["--nnodes", "2", "--node-rank", "2", "-tp", "2"], "--node-rank must be in [0, 2)"),
    (["-pp", "5"], "--pipeline-parallel-size 5 exceeds the model's 4 layers"),
    (["-pp", "0"], "--pipeline-parallel-size must be >= 1"),
    (["-pp", "2", "--pipeline-micro-batches", "0"], "--pipeline-micro-batches must be >= 1"),
    (["-pp", "2", "--master-port", "70000"], "--master-port must be in [1, 65535]"),
    (["-pp", "2", "--node-heartbeat-timeout", "0"], "--node-heartbeat-timeout must be > 0"),
])
def test_sizes_that_cannot_work_fail_naming_the_flag(model: Path, flags: list[str],
                                                     message: str) -> None:
    with pytest.raises(ValueError, match="^" + re.escape(message)):
        _config(model, *flags)


def test_the_compared_config_ignores_only_the_node_rank(model: Path) -> None:
    zero = _config(model, "-pp", "2", "--nnodes", "2")
    one = _config(model, "-pp", "2", "--nnodes", "2", "--node-rank", "1",
                  "--rendezvous-timeout", "5")
    assert config_fields(zero) == config_fields(one)
    other = _config(model, "-pp", "2", "--nnodes", "2", "--max-model-len", "64")
    assert config_fields(other)["model.max_model_len"] == "64"
    assert config_fields(other) != config_fields(zero)
