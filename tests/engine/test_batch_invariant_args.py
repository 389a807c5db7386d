"""`--batch-invariant` at start (args.py, config.py): its environment fallback, and the
combinations it refuses in one line with exit 2, before any weight loads."""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import pytest
from helpers import write_checkpoint
from kvasir_engine.args import add_engine_args, apply_env_defaults, engine_config_from_args
from kvasir_engine.config import DeviceConfig
from kvasir_engine.main import main


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("llama"), "llama")


def _config(model: Path, *flags: str, environ: dict[str, str] | None = None):  # type: ignore[no-untyped-def]
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    apply_env_defaults(parser, environ or {})
    return engine_config_from_args(parser.parse_args([str(model), "--device", "cpu", *flags]))


def test_off_by_default_and_from_the_environment(model: Path) -> None:
    assert _config(model).device.batch_invariant is False
    config = _config(model, "--batch-invariant")
    assert config.device.batch_invariant is True
    assert config.scheduler.interject_first_tokens  # interjection keeps it (test_batch_invariant)
    from_env = _config(model, environ={"KVASIR_BATCH_INVARIANT": "1"})
    assert from_env.device.batch_invariant is True


@pytest.mark.parametrize(("flags", "named"), [
    (["--tensor-parallel-size", "2"], "more than one process"),
    (["--pipeline-parallel-size", "2"], "more than one process"),
])
def test_what_it_cannot_hold_is_refused_in_one_line(model: Path, flags: list[str], named: str,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["generate", str(model), "--device", "cpu", "--batch-invariant", *flags,
                 "--prompt", "hi"])
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert len(err.splitlines()) == 1 and "--batch-invariant" in err and named in err, err


def test_a_cuda_device_is_refused(model: Path) -> None:
    """The Triton kernels are not made invariant (nor is cuBLAS asked to be)."""
    config = _config(model, "--batch-invariant")
    with pytest.raises(ValueError, match="--batch-invariant does not run with a CUDA device"):
        dataclasses.replace(config, device=DeviceConfig(device="cuda", batch_invariant=True))


def test_quantization_without_the_native_kernels_is_refused(
        model: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """The torch int8/int4 products' sums follow the row count (the test of
    tests/engine/test_batch_invariant.py found a batch of two changing a logprob)."""
    monkeypatch.setenv("KVASIR_NATIVE_CPU_KERNELS", "0")
    code = main(["generate", str(model), "--device", "cpu", "--batch-invariant",
                 "--quantization", "int8", "--prompt", "hi"])
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert len(err.splitlines()) == 1 and "needs the native CPU kernels" in err, err


def test_a_draft_model_is_refused_and_ngrams_are_not(
        model: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """N-gram proposals are verified by the invariant rows (tests/engine/test_batch_invariant.py);
    a draft model's own process is not tested under the flag."""
    ngram = json.dumps({"method": "ngram", "num_speculative_tokens": 3})
    assert _config(model, "--batch-invariant", "--speculative-config", ngram).speculative
    draft = json.dumps({"model": str(model), "num_speculative_tokens": 3})
    code = main(["generate", str(model), "--device", "cpu", "--batch-invariant",
                 "--speculative-config", draft, "--prompt", "hi"])
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert len(err.splitlines()) == 1 and "a draft model" in err, err
