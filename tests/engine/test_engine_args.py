"""Flag defaults that depend on the device (args.py)."""

from __future__ import annotations

import argparse
from pathlib import Path

from helpers import write_checkpoint
from kvasir_engine.args import (
    DEFAULT_CPU_BATCHED_TOKENS,
    add_engine_args,
    engine_config_from_args,
)


def _config(model: Path, *flags: str):  # type: ignore[no-untyped-def]
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    return engine_config_from_args(parser.parse_args([str(model), "--device", "cpu", *flags]))


def test_cpu_token_budget_defaults_small_but_never_below_max_num_seqs(tmp_path: Path) -> None:
    model = write_checkpoint(tmp_path / "llama", "llama")
    assert _config(model).scheduler.max_num_batched_tokens == DEFAULT_CPU_BATCHED_TOKENS == 512
    assert _config(model, "--max-num-seqs", "600").scheduler.max_num_batched_tokens == 600
    assert _config(model, "--max-num-batched-tokens", "4096").scheduler \
        .max_num_batched_tokens == 4096
