"""The fused native decode forward (models/fused_decode.py) against the eager layers.

Both chain the same native operators in the same order, so a decode step's logits must be
identical, through chunked prefill (eager), batched decodes of ragged contexts (fused),
qkv biases and a bfloat16 KV cache, for int8/int4 weights and for unquantized bfloat16 ones
packed for oneDNN or the AVX512-BF16 products (layers/dense.py); where the path does not apply
it is not built.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
from helpers import StepDriver, tiny_engine_config, write_checkpoint
from kvasir_engine.core.request import SamplingParams
from kvasir_engine.kernels import choice as choice_module
from kvasir_engine.kernels import cpu
from kvasir_engine.worker.model_runner import ModelRunner

pytestmark = pytest.mark.skipif(not cpu.available(), reason="native CPU kernels unavailable")
GREEDY = SamplingParams(temperature=0, max_tokens=8, min_tokens=8, logprobs=5)


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp(request.param), request.param)


def _runner(checkpoint: Path, quantization: str | None, kv_cache_dtype: str = "auto",
            dtype: str = "float32") -> ModelRunner:
    config = tiny_engine_config(checkpoint, dtype=dtype)
    config = replace(config, model=replace(config.model, quantization=quantization),
                     cache=replace(config.cache, kv_cache_dtype=kv_cache_dtype))
    runner = ModelRunner(config)
    runner.initialize_kv_cache()
    return runner


def _generate(runner: ModelRunner) -> dict[str, object]:
    """Greedy tokens and logprobs of three prompts: prefilled in chunks, then decoded together."""
    g = torch.Generator().manual_seed(4)
    prompts = {f"r{i}": torch.randint(3, runner.arch.vocab_size, (n,), generator=g).tolist()
               for i, n in enumerate((3, 19, 9))}
    driver = StepDriver(runner, runner.block_size)
    logprobs: list[object] = []
    step = driver.step

    def recording_step(plan, params, finished=None):  # type: ignore[no-untyped-def]
        out = step(plan, params, finished)
        logprobs.append(out.logprobs)
        return out

    driver.step = recording_step  # type: ignore[method-assign]
    tokens = driver.generate(prompts, dict.fromkeys(prompts, GREEDY), max_tokens=8, chunk=7)
    return {"tokens": tokens, "logprobs": logprobs}


@pytest.mark.parametrize("quantization", ["int8", "int4"])
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "bfloat16"])
def test_fused_decode_equals_the_eager_layers(checkpoint: Path, quantization: str,
                                              kv_cache_dtype: str) -> None:
    fused = _runner(checkpoint, quantization, kv_cache_dtype)
    assert fused.model.model.fused_decode is not None
    assert fused.model.model.fused_decode.method == quantization
    eager = _runner(checkpoint, quantization, kv_cache_dtype)
    eager.model.model.fused_decode = None
    calls = []
    original = cpu.decode_layers

    def counting(*args, **kwargs):  # type: ignore[no-untyped-def]
        calls.append(args[0].shape[0])
        return original(*args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(cpu, "decode_layers", counting)
        got = _generate(fused)
    assert calls and set(calls) <= {1, 2, 3}  # decode steps only, batched
    assert got == _generate(eager)


def test_bfloat16_compute_takes_the_fused_path_too(checkpoint: Path) -> None:
    fused = _runner(checkpoint, "int8", dtype="bfloat16")
    assert fused.model.model.fused_decode is not None
    eager = _runner(checkpoint, "int8", dtype="bfloat16")
    eager.model.model.fused_decode = None
    assert _generate(fused) == _generate(eager)


@pytest.mark.parametrize(("dense", "method"), [("onednn", "onednn"), ("native", "bf16")])
def test_unquantized_bfloat16_runs_fused_over_packed_weights(
        checkpoint: Path, dense: str, method: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Packed for oneDNN, or for the AVX512-BF16 products (layers/dense.py) where the host
    has them: the host's flags are what the kernel choice reads, so they are set here."""
    if dense == "native" and not cpu.bf16_dot_supported():
        pytest.skip("the AVX512-BF16 products need a host with AVX512-BF16")
    monkeypatch.setattr(choice_module, "cpu_has",
                        lambda *flags: dense == "native" and "amx_bf16" not in flags)
    fused = _runner(checkpoint, None, dtype="bfloat16")
    assert fused.kernels.dense_matmul == dense
    assert fused.model.model.fused_decode is not None
    assert fused.model.model.fused_decode.method == method
    eager = _runner(checkpoint, None, dtype="bfloat16")
    eager.model.model.fused_decode = None
    assert _generate(fused) == _generate(eager)


def test_not_built_where_it_does_not_apply(checkpoint: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    assert _runner(checkpoint, None).model.model.fused_decode is None  # unquantized float32
    monkeypatch.setattr(cpu, "available", lambda: False)  # torch fallback weights
    assert _runner(checkpoint, "int8").model.model.fused_decode is None
