"""Draft-model speculative decoding: a tiny random draft sharing the target's tokenizer, and the
target as its own draft; greedy output token-identical to no speculation, no block leaked, and a
draft whose vocabulary differs refused at start in one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import write_checkpoint
from kvasir_engine.core.request import SamplingParams
from kvasir_engine.main import main
from test_end_to_end import BLOCK_BYTES, engine_for
from test_speculative import GREEDY, repetitive_prompts, run


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("target"), "llama", seed=7)


@pytest.fixture(scope="module")
def small_draft(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("draft"), "llama", seed=8, hidden_size=32,
                            intermediate_size=48, num_hidden_layers=1, num_attention_heads=2,
                            num_key_value_heads=1)


def _draft_flag(model: Path, k: int = 3) -> str:
    return json.dumps({"model": str(model), "num_speculative_tokens": k,
                       "disable_by_batch_size": 64, "min_acceptance_rate": 0.0})


@pytest.mark.parametrize("flags", [
    (),
    ("--max-num-batched-tokens", "16", "--max-num-seqs", "4"),
    ("--kv-cache-memory", str(14 * BLOCK_BYTES), "--no-enable-prefix-caching"),
], ids=["batched", "chunked", "preempting"])
def test_a_small_random_draft_keeps_greedy_output(target: Path, small_draft: Path,
                                                  flags: tuple[str, ...]) -> None:
    prompts = repetitive_prompts(6, seed=5)
    common = ("--max-model-len", "128", *flags)
    plain, _ = run(engine_for(target, *common), prompts, GREEDY)
    speculative, totals = run(engine_for(target, *common, "--speculative-config",
                                         _draft_flag(small_draft)), prompts, GREEDY)
    assert speculative == plain
    assert totals["drafts"] > 0


def test_the_target_as_its_own_draft_is_accepted_almost_always(target: Path) -> None:
    prompts = repetitive_prompts(4, seed=6)
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    plain, _ = run(engine_for(target, "--max-model-len", "128"), prompts, params)
    speculative, totals = run(engine_for(target, "--max-model-len", "128",
                                         "--speculative-config", _draft_flag(target, 4)),
                              prompts, params)
    assert speculative == plain
    assert totals["draft_tokens"] > 0 and totals["accepted"] >= 0.9 * totals["draft_tokens"]


def test_a_draft_with_another_vocabulary_is_refused_at_start(
        target: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    other = write_checkpoint(tmp_path / "other", "llama")
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "vocab_size": 400}))
    capsys.readouterr()  # the checkpoint writer's progress bars
    code = main(["generate", str(target), "--device", "cpu", "--prompt", "hi",
                 "--speculative-config", _draft_flag(other)])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1
    assert "vocabulary" in err and "400" in err, err
