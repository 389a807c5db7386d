"""Inputs that cannot fit fail with one clear line naming the numbers."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import tiny_engine_config, write_checkpoint
from kvasir_engine.worker.model_runner import ModelRunner


def test_kv_budget_too_small_for_max_model_len(tmp_path: Path) -> None:
    directory = write_checkpoint(tmp_path / "m", "llama", shard=False)
    runner = ModelRunner(tiny_engine_config(directory, max_model_len=128, kv_bytes=4096))
    with pytest.raises(ValueError, match="--max-model-len 128 needs 32"):
        runner.initialize_kv_cache()
