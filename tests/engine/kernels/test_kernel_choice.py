"""The one kernel choice of a process (kernels/choice.py) for each host case, and the model
built from it: every layer gets the implementation the choice names, at construction."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
from helpers import tiny_engine_config, write_checkpoint
from kvasir_engine.config import DeviceConfig, EngineConfig
from kvasir_engine.kernels import choice as choice_module
from kvasir_engine.kernels.choice import KernelChoice, build_kernel_choice


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("llama"), "llama")


def _config(checkpoint: Path, dtype: str = "bfloat16", quantization: str | None = None,
            kv_cache_dtype: str = "auto") -> EngineConfig:
    config = tiny_engine_config(checkpoint, dtype=dtype)
    return replace(config, model=replace(config.model, quantization=quantization),
                   cache=replace(config.cache, kv_cache_dtype=kv_cache_dtype))


def _built() -> bool:
    return True


@pytest.fixture(autouse=True)
def no_amx(monkeypatch: pytest.MonkeyPatch) -> None:
    """The host's AMX decides one field (test_amx_hosts_run_half_precision_prefill_as_sdpa)."""
    monkeypatch.setattr(choice_module, "cpu_has", lambda *flags: False)


def test_amx_hosts_run_half_precision_prefill_as_sdpa(checkpoint: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    assert build_kernel_choice(_config(checkpoint), "cpu", _built, {}).prefill_attention == \
        "matmul"
    monkeypatch.setattr(choice_module, "cpu_has", lambda *flags: "amx_bf16" in flags)
    assert build_kernel_choice(_config(checkpoint), "cpu", _built, {}).prefill_attention == "sdpa"
    assert build_kernel_choice(_config(checkpoint), "cuda", _built, {}).prefill_attention == \
        "matmul"
    with pytest.raises(ValueError, match="prefill_attention must be one of"):
        KernelChoice(prefill_attention="flash")


def test_cpu_with_native_kernels_int8_runs_everything_native(checkpoint: Path) -> None:
    choice = build_kernel_choice(_config(checkpoint, quantization="int8"), "cpu", _built, {})
    assert choice == KernelChoice(attention_backend="torch", decode_attention="native",
                                  norm="native", rotary="native", activation="native",
                                  matmul="native", fused_decode=True, native_cpu_kernels=True)


def test_cpu_bf16_unquantized_packs_for_onednn_and_runs_fused_decode(checkpoint: Path) -> None:
    choice = build_kernel_choice(_config(checkpoint), "cpu", _built, {})
    assert choice.native_cpu_kernels and choice.norm == choice.rotary == "native"
    assert choice.decode_attention == choice.activation == "native"
    assert choice.matmul == "torch" and choice.dense_matmul == "onednn" and choice.fused_decode
    # Without the native kernels the products are still packed, but nothing is fused.
    plain = build_kernel_choice(_config(checkpoint), "cpu", lambda: False, {})
    assert plain.dense_matmul == "onednn" and not plain.fused_decode


def test_avx512_bf16_hosts_without_amx_run_bfloat16_prefill_natively(
        checkpoint: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Heads of 32, 64 or 128 dimensions (the tiny checkpoint's 16 are not taken)."""
    monkeypatch.setattr(choice_module, "cpu_has", lambda *flags: "avx512_bf16" in flags)

    def heads_of(dim: int, config: EngineConfig) -> EngineConfig:
        return replace(config, model=replace(config.model, arch=replace(config.model.arch,
                                                                        head_dim=dim)))

    assert build_kernel_choice(heads_of(64, _config(checkpoint)), "cpu", _built,
                               {}).prefill_attention == "native"
    # Not for float32 compute (over either cache), without the native kernels, other heads.
    for config, built in ((heads_of(64, _config(checkpoint, dtype="float32",
                                                kv_cache_dtype="bfloat16")), _built),
                          (heads_of(64, _config(checkpoint, dtype="float32")), _built),
                          (heads_of(64, _config(checkpoint)), lambda: False),
                          (_config(checkpoint), _built)):
        assert build_kernel_choice(config, "cpu", built, {}).prefill_attention == "matmul"
    with pytest.raises(ValueError, match="prefill_attention native without the native CPU"):
        KernelChoice(prefill_attention="native")


def test_avx512_bf16_hosts_without_amx_pack_for_the_native_products(
        checkpoint: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(choice_module, "cpu_has", lambda *flags: "avx512_bf16" in flags)
    choice = build_kernel_choice(_config(checkpoint), "cpu", _built, {})
    assert choice.dense_matmul == "native" and choice.fused_decode
    # Not without the native kernels, nor quantized, nor where a layer width is not a multiple
    # of 16 (the fused decode takes one form for every layer), nor with AMX (oneDNN's tiles).
    assert build_kernel_choice(_config(checkpoint), "cpu", lambda: False, {}).dense_matmul == \
        "onednn"
    assert build_kernel_choice(_config(checkpoint, quantization="int8"), "cpu", _built,
                               {}).dense_matmul == "torch"
    config = _config(checkpoint)
    odd = replace(config, model=replace(config.model, arch=replace(config.model.arch,
                                                                   intermediate_size=100)))
    assert build_kernel_choice(odd, "cpu", _built, {}).dense_matmul == "onednn"
    monkeypatch.setattr(choice_module, "cpu_has", lambda *flags: True)
    assert build_kernel_choice(_config(checkpoint), "cpu", _built, {}).dense_matmul == "onednn"


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_other_unquantized_dtypes_keep_f_linear_and_no_fused_decode(checkpoint: Path,
                                                                    dtype: str) -> None:
    choice = build_kernel_choice(_config(checkpoint, dtype=dtype), "cpu", _built, {})
    assert choice.dense_matmul == "torch" and not choice.fused_decode


def test_native_kernels_switched_off_by_the_environment_are_never_built(
        checkpoint: Path) -> None:
    def must_not_build() -> bool:
        raise AssertionError("the native kernels were built under KVASIR_NATIVE_CPU_KERNELS=0")

    config = _config(checkpoint, quantization="int8")
    choice = build_kernel_choice(config, "cpu", must_not_build,
                                 {"KVASIR_NATIVE_CPU_KERNELS": "0"})
    assert choice == KernelChoice(native_cpu_kernels=False)  # the torch reference throughout
    assert build_kernel_choice(config, "cpu", lambda: False, {}) == choice  # failed to build


def test_float16_keeps_the_torch_layers_but_not_the_native_matmuls(checkpoint: Path) -> None:
    """The row kernels take float32/bfloat16 only; quantized weights keep the native layout."""
    choice = build_kernel_choice(_config(checkpoint, dtype="float16", quantization="int4"),
                                 "cpu", _built, {})
    assert (choice.norm, choice.rotary, choice.activation, choice.decode_attention) == (
        "torch", "torch", "torch", "torch")
    assert choice.matmul == "native" and not choice.fused_decode


def test_float32_compute_with_a_bfloat16_cache_keeps_fused_decode(checkpoint: Path) -> None:
    config = _config(checkpoint, dtype="float32", quantization="int4",
                     kv_cache_dtype="bfloat16")
    choice = build_kernel_choice(config, "cpu", _built, {})
    assert choice.decode_attention == "native" and choice.fused_decode


def test_cuda_picks_triton_and_never_asks_for_the_cpu_kernels(checkpoint: Path) -> None:
    def must_not_build() -> bool:
        raise AssertionError("the CPU kernels were built for a CUDA process")

    choice = build_kernel_choice(_config(checkpoint), "cuda", must_not_build, {})
    assert choice == KernelChoice(attention_backend="triton", decode_attention="triton",
                                  norm="triton", rotary="triton")
    torch_config = replace(_config(checkpoint), device=DeviceConfig(attention_backend="torch"))
    assert build_kernel_choice(torch_config, "cuda", must_not_build, {}) == KernelChoice()


def test_triton_on_cpu_is_refused(checkpoint: Path) -> None:
    config = replace(_config(checkpoint), device=DeviceConfig(attention_backend="triton"))
    with pytest.raises(ValueError, match="needs a CUDA device"):
        build_kernel_choice(config, "cpu", _built, {})


def test_triton_interpret_is_reported(checkpoint: Path) -> None:
    choice = build_kernel_choice(_config(checkpoint), "cpu", lambda: False,
                                 {"TRITON_INTERPRET": "1"})
    assert choice.triton_interpret and choice.as_dict()["triton_interpret"] is True


def test_inconsistent_choices_are_refused() -> None:
    with pytest.raises(ValueError, match="native without the native CPU kernels"):
        KernelChoice(norm="native")
    with pytest.raises(ValueError, match="fused decode needs the native quantized matmuls"):
        KernelChoice(native_cpu_kernels=True, fused_decode=True)
    with pytest.raises(ValueError, match="dense_matmul must be one of"):
        KernelChoice(dense_matmul="mkl")
    with pytest.raises(ValueError, match="dense_matmul native without the native CPU kernels"):
        KernelChoice(dense_matmul="native")
    with pytest.raises(ValueError, match="triton without the triton backend"):
        KernelChoice(rotary="triton")
    with pytest.raises(ValueError, match="norm must be one of"):
        KernelChoice(norm="cuda")


def test_the_model_hands_each_layer_its_part(checkpoint: Path) -> None:
    from kvasir_engine.kernels import cpu
    from kvasir_engine.layers.norm import RMSNorm
    from kvasir_engine.models.llama import LlamaForCausalLM

    config = _config(checkpoint, quantization="int8")
    choice = build_kernel_choice(config, "cpu", _built, {})
    model = LlamaForCausalLM(config.model.arch, choice)
    norms = [m for m in model.modules() if isinstance(m, RMSNorm)]
    assert norms and all(m.kernel is cpu.rms_norm for m in norms)
    layer = model.model.layers[0]
    assert layer.self_attn.rotary.impl == "native" and layer.mlp.act_fn.is_native
    assert layer.self_attn.attn.backend.native_decode
    reference = LlamaForCausalLM(config.model.arch, KernelChoice())
    reference_layer = reference.model.layers[0]
    assert all(m.kernel is None for m in reference.modules() if isinstance(m, RMSNorm))
    assert reference_layer.self_attn.rotary.impl == "torch"
    assert not reference_layer.mlp.act_fn.is_native
    assert not reference_layer.self_attn.attn.backend.native_decode
    with pytest.raises(ValueError, match="fused decode was not chosen"):
        reference.enable_fused_decode()


def test_the_runner_builds_logs_and_reports_it_once(checkpoint: Path,
                                                    caplog: pytest.LogCaptureFixture,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    import logging

    from kvasir_engine.layers.norm import RMSNorm
    from kvasir_engine.worker.model_runner import ModelRunner

    monkeypatch.setenv("KVASIR_NATIVE_CPU_KERNELS", "0")
    config = _config(checkpoint, quantization="int8")
    with caplog.at_level(logging.INFO):
        runner = ModelRunner(config)
        info = runner.initialize_kv_cache()
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("kernels: ")]
    assert lines == [f"kernels: {runner.kernels.describe()}"]
    reference = KernelChoice(triton_interpret=runner.kernels.triton_interpret)
    assert runner.kernels == reference
    # RuntimeInfo carries the choice and, on CPU, the compute team (kernels/host.py, threads.py)
    assert info.kernels == {**reference.as_dict(), "cpu_threads": runner.cpu_threads}
    assert all(m.kernel is None for m in runner.model.modules() if isinstance(m, RMSNorm))
    assert runner.model.model.fused_decode is None


@pytest.mark.parametrize(("activation_bits", "bits", "weight_only"),
                         [(None, 4, True), (None, 8, True), (8, 8, False)])
def test_weight_only_checkpoints_say_their_activations_stay_float(
        checkpoint: Path, activation_bits: int | None, bits: int, weight_only: bool) -> None:
    """W4A16 / W8A16 (and GPTQ, AWQ) multiply float activations (layers/prequantized.py);
    W8A8 and --quantization the int8 ones of the tiles."""
    from kvasir_engine.checkpoint.quant_config import CheckpointQuantization

    quant = CheckpointQuantization(quant_method="compressed-tensors", weight_type="int",
                                   bits=bits, group_size=32 if bits == 4 else None,
                                   symmetric=True, storage="pack-quantized" if bits == 4
                                   else "int-quantized", activation_bits=activation_bits)
    method = "int4" if bits == 4 else "int8"
    for dtype in ("bfloat16", "float32"):
        config = _config(checkpoint, dtype=dtype, quantization=method)
        config = replace(config, model=replace(config.model, checkpoint_quantization=quant))
        choice = build_kernel_choice(config, "cpu", _built, {})
        assert choice.weight_only == weight_only and choice.as_dict()["weight_only"] is weight_only
    own = build_kernel_choice(_config(checkpoint, quantization="int4"), "cpu", _built, {})
    assert not own.weight_only  # no AVX512-BF16 (the no_amx fixture): the int4 tile


def test_own_int4_prompts_take_float_activations_where_bfloat16_products_are_fast(
        checkpoint: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """--quantization int4 in bfloat16 on an AVX512-BF16 (or AMX) CPU: its prompt rows through
    the weight-only products (oneDNN over dequantized chunks), its decode rows on the tile;
    float32, int8, no native kernels, --batch-invariant, or a CPU without those products: the
    tile for every row. Never `weight_only` (that is a checkpoint's scheme)."""
    def choice(config: EngineConfig, built: bool = True) -> KernelChoice:
        return build_kernel_choice(config, "cpu", lambda: built, {})

    for flag in ("avx512_bf16", "amx_bf16"):
        monkeypatch.setattr(choice_module, "cpu_has", lambda *flags, f=flag: f in flags)
        own = choice(_config(checkpoint, quantization="int4"))
        assert own.int4_prefill == "weight_only" and not own.weight_only
        assert own.as_dict()["int4_prefill"] == "weight_only"
    invariant = _config(checkpoint, quantization="int4")
    invariant = replace(invariant, device=replace(invariant.device, batch_invariant=True))
    for config, built in [(invariant, True),
                          (_config(checkpoint, dtype="float32", quantization="int4"), True),
                          (_config(checkpoint, quantization="int8"), True),
                          (_config(checkpoint, quantization="int4"), False),
                          (_config(checkpoint), True)]:
        assert choice(config, built).int4_prefill == "tile"
    monkeypatch.setattr(choice_module, "cpu_has", lambda *flags: False)
    assert choice(_config(checkpoint, quantization="int4")).int4_prefill == "tile"
    with pytest.raises(ValueError, match="int4_prefill"):
        KernelChoice(int4_prefill="int8")
