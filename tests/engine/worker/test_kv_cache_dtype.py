"""`--kv-cache-dtype bfloat16` under float32 compute (CPU): half the KV bytes, float32 math.

The cache holds bfloat16 K and V; attention reads them back into float32 (the native decode
kernel converts as it loads, the torch paths cast what they gather). Logits stay within
bfloat16's rounding of the float32-cache run, through the native kernel and the torch
fallback alike, and the same budget holds twice the blocks.
"""

from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from helpers import prefill_output, tiny_engine_config, write_checkpoint
from kvasir_engine.args import add_engine_args, engine_config_from_args
from kvasir_engine.config import CacheConfig
from kvasir_engine.core.outputs import CachedRequestData, SchedulerOutput
from kvasir_engine.core.request import SamplingParams
from kvasir_engine.kernels import cpu
from kvasir_engine.server.fingerprint import system_fingerprint
from kvasir_engine.worker.model_runner import ModelRunner

GREEDY = SamplingParams(temperature=0, max_tokens=4)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("llama"), "llama")


def _config(model: Path, *flags: str):  # type: ignore[no-untyped-def]
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    return engine_config_from_args(parser.parse_args([str(model), *flags]))


def _prefill_then_decode(runner: ModelRunner) -> torch.Tensor:
    """Logits of a ragged prefill of three prompts, then of two decode steps: [9, vocab]."""
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, runner.arch.vocab_size, (n,), generator=g).tolist()
               for n in (5, 23, 12)]
    so = prefill_output(prompts, runner.block_size, GREEDY, spare_tokens=2)
    runner.update_states(so)
    logits = [runner.compute_logits(runner.prepare(so))]
    computed = dict(so.num_scheduled_tokens)
    for _ in range(2):
        for req_id in computed:  # feed back the float32 run's choice: same inputs for both
            runner.states[req_id].token_ids.append(7)
        so = SchedulerOutput([], [CachedRequestData(r, [], n) for r, n in computed.items()],
                             dict.fromkeys(computed, 1), len(computed))
        runner.update_states(so)
        logits.append(runner.compute_logits(runner.prepare(so)))
        computed = {r: n + 1 for r, n in computed.items()}
    return torch.cat(logits)


@pytest.mark.parametrize("native", [True, False])
def test_bfloat16_cache_under_float32_compute(checkpoint: Path, native: bool,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    if native and not cpu.available():
        pytest.skip("native CPU kernels unavailable")
    if not native:
        monkeypatch.setattr(cpu, "available", lambda: False)
    base = tiny_engine_config(checkpoint)
    float_runner = ModelRunner(base)
    float_info = float_runner.initialize_kv_cache()
    bf16_runner = ModelRunner(replace(base, cache=replace(base.cache,
                                                          kv_cache_dtype="bfloat16")))
    bf16_info = bf16_runner.initialize_kv_cache()
    assert bf16_runner.kv_caches[0][0].dtype == torch.bfloat16
    assert bf16_runner.block_bytes() * 2 == float_runner.block_bytes()
    assert bf16_info.num_kv_blocks == 2 * float_info.num_kv_blocks
    expected, got = _prefill_then_decode(float_runner), _prefill_then_decode(bf16_runner)
    assert got.dtype == torch.float32
    # bfloat16 keeps 8 bits of mantissa: K and V move by <= 0.4%, the logits by about as much.
    scale = expected.abs().max()
    torch.testing.assert_close(got, expected, atol=2e-2 * float(scale), rtol=0)
    assert not torch.equal(got, expected)  # the cache really is bfloat16


def test_flag_resolves_validates_and_enters_the_fingerprint(checkpoint: Path) -> None:
    config = _config(checkpoint, "--device", "cpu", "--dtype", "float32")
    assert config.cache.kv_cache_dtype == "auto"
    assert config.cache.resolved_kv_cache_dtype(config.model.dtype) == "float32"
    halved = _config(checkpoint, "--device", "cpu", "--dtype", "float32",
                     "--kv-cache-dtype", "bfloat16")
    assert halved.cache.resolved_kv_cache_dtype("float32") == "bfloat16"
    assert system_fingerprint(halved, "cpu") != system_fingerprint(config, "cpu")
    explicit = _config(checkpoint, "--device", "cpu", "--dtype", "float32",
                       "--kv-cache-dtype", "float32")
    assert system_fingerprint(explicit, "cpu") == system_fingerprint(config, "cpu")
    with pytest.raises(ValueError, match="--kv-cache-dtype float32 needs --dtype float32"):
        _config(checkpoint, "--device", "cpu", "--dtype", "bfloat16", "--kv-cache-dtype",
                "float32")
    with pytest.raises(ValueError, match="--kv-cache-dtype bfloat16"):
        _config(checkpoint, "--device", "cuda", "--dtype", "float32", "--kv-cache-dtype",
                "bfloat16")
    with pytest.raises(ValueError, match="--kv-cache-dtype must be one of"):
        CacheConfig(kv_cache_dtype="fp8")
