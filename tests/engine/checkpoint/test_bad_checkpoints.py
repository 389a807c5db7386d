"""Broken or unsupported checkpoints fail with one clear line naming the file or field."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import (
    default_gguf_path,
    tiny_engine_config,
    write_checkpoint,
    write_corrupt_safetensors,
)
from kvasir_engine.checkpoint.metadata import read_model_arch
from kvasir_engine.tokenizer import load_tokenizer
from kvasir_engine.worker.model_runner import ModelRunner


def test_unknown_model_path(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="does not exist"):
        read_model_arch(tmp_path / "nope")


def test_corrupt_safetensors_names_the_file(tmp_path: Path) -> None:
    weights = write_corrupt_safetensors(tmp_path / "m")
    with pytest.raises(ValueError, match=f"{weights}: corrupt or truncated safetensors"):
        ModelRunner(tiny_engine_config(tmp_path / "m"))


def test_missing_shard_names_the_file(tmp_path: Path) -> None:
    directory = write_checkpoint(tmp_path / "m", "llama")
    victim = sorted(directory.glob("model-*.safetensors"))[-1]
    victim.unlink()
    with pytest.raises(ValueError, match=f"{victim.name}: listed in the index but missing"):
        ModelRunner(tiny_engine_config(directory))


def test_truncated_gguf_names_the_file(tmp_path: Path) -> None:
    broken = tmp_path / "broken.gguf"
    with default_gguf_path().open("rb") as source:
        broken.write_bytes(source.read(1 << 20))
    with pytest.raises(ValueError, match=f"{broken}: not a readable GGUF file"):
        read_model_arch(broken)
    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(b"definitely not gguf" * 100)
    with pytest.raises(ValueError, match="not a readable GGUF file"):
        load_tokenizer(garbage)


def test_unknown_architecture(tmp_path: Path) -> None:
    directory = write_checkpoint(tmp_path / "m", "llama", shard=False)
    config = json.loads((directory / "config.json").read_text())
    config["architectures"], config["model_type"] = ["GPTNeoXForCausalLM"], "gpt_neox"
    (directory / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="unsupported architecture.*GPTNeoXForCausalLM"):
        read_model_arch(directory)


def test_config_missing_a_field(tmp_path: Path) -> None:
    directory = write_checkpoint(tmp_path / "m", "llama", shard=False)
    config = json.loads((directory / "config.json").read_text())
    del config["hidden_size"]
    (directory / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="missing required field 'hidden_size'"):
        read_model_arch(directory)
