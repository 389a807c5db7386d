"""`checkpoint_format` is the one answer to "which kind of checkpoint is this path", and every
reader (architecture, EOS ids, weights, tokenizer, served name) follows it."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import EOS_TOKEN_ID, default_gguf_path, tiny_engine_config, write_checkpoint
from kvasir_engine.checkpoint.format import (
    CheckpointFormat,
    checkpoint_format,
    default_served_name,
    resolve_model_path,
)
from kvasir_engine.checkpoint.metadata import read_eos_token_ids, read_model_arch
from kvasir_engine.tokenizer import load_tokenizer
from kvasir_engine.worker.model_runner import ModelRunner


def test_a_gguf_file_and_a_hugging_face_directory(tmp_path: Path) -> None:
    assert checkpoint_format(default_gguf_path()) is CheckpointFormat.GGUF_FILE
    assert checkpoint_format(str(default_gguf_path())) is CheckpointFormat.GGUF_FILE
    directory = write_checkpoint(tmp_path / "m", "llama", shard=False)
    assert checkpoint_format(directory) is CheckpointFormat.HF_DIR


def test_neither_names_the_path(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=f"model path does not exist: {tmp_path / 'nope'}"):
        checkpoint_format(tmp_path / "nope")
    with pytest.raises(ValueError, match=f"model path does not exist: {tmp_path / 'x.gguf'}"):
        checkpoint_format(tmp_path / "x.gguf")
    loose = tmp_path / "model.safetensors"
    loose.write_bytes(b"\0" * 16)
    with pytest.raises(ValueError, match="must be a Hugging Face directory or a .gguf file"):
        checkpoint_format(loose)


def test_a_directory_holding_one_gguf_is_that_file(tmp_path: Path) -> None:
    # What kvasir-fetch leaves of a GGUF upload: the file and its manifest in the cache directory.
    fetched = tmp_path / "fetched"
    fetched.mkdir()
    (fetched / "model.gguf").symlink_to(default_gguf_path())
    (fetched / "kvasir-manifest.json").write_text("{}")
    assert resolve_model_path(fetched) == fetched / "model.gguf"
    assert checkpoint_format(resolve_model_path(fetched)) is CheckpointFormat.GGUF_FILE
    (fetched / "second.gguf").symlink_to(default_gguf_path())
    assert resolve_model_path(fetched) == fetched  # two: not guessed
    directory = write_checkpoint(tmp_path / "m", "llama", shard=False)
    assert resolve_model_path(directory) == directory
    assert resolve_model_path(default_gguf_path()) == default_gguf_path()


def test_served_name_defaults() -> None:
    assert default_served_name(default_gguf_path()) == "SmolLM2-135M-Instruct.Q4_1"


def test_eos_ids_of_either_format(tmp_path: Path) -> None:
    directory = write_checkpoint(tmp_path / "m", "llama", shard=False)
    assert read_eos_token_ids(directory) == frozenset({EOS_TOKEN_ID})
    eos = load_tokenizer(default_gguf_path()).eos_token_id
    assert eos is not None and read_eos_token_ids(default_gguf_path()) == frozenset({eos})


def test_a_directory_named_like_a_gguf_file_is_a_directory_for_every_reader(
        tmp_path: Path) -> None:
    """Before one function decided, the loader and the tokenizer tested the suffix alone and
    would have opened this directory as a GGUF file while the arch reader did not."""
    directory = write_checkpoint(tmp_path / "odd.gguf", "llama", shard=False)
    assert checkpoint_format(directory) is CheckpointFormat.HF_DIR
    assert default_served_name(directory) == "odd.gguf"
    assert read_model_arch(directory).architecture == "LlamaForCausalLM"
    assert read_eos_token_ids(directory) == frozenset({EOS_TOKEN_ID})
    assert load_tokenizer(directory).eos_token_id == EOS_TOKEN_ID
    runner = ModelRunner(tiny_engine_config(directory))
    assert runner.eos_token_ids == frozenset({EOS_TOKEN_ID})
