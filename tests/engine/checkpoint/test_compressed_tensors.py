"""Pre-quantized checkpoints loaded onto our native kernels (weight-only W4A16 / W8A16: int4 /
int8 weights times float activations; W8A8: the int8 tile; FP8: dequantized on CPU,
`_scaled_mm` on GPU): compressed-tensors ones written by the library itself
(tests/engine/ct_checkpoints.py), AutoAWQ / AutoGPTQ ones (tests/engine/legacy_checkpoints.py).

Three levels: the weights our kernels multiply against the library's own dequantized weights
(bit for bit: the weight-only kernels round `scale * code + minimum` to the scale's dtype as
the library does; W8A8's tile once rounded to bfloat16); the logits of a prefill against the
library's float32 model (transformers, dequantized): weight-only schemes to float32 summation
order (1e-4 relative), W8A8 within its int8 activations' error (3%), next to what the
checkpoint's unquantized original gives, so the test proves we run the checkpoint's weights and
not merely something close to the model; and the refusals, each one line naming the scheme.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from ct_checkpoints import reference_greedy, reference_model, write_compressed_checkpoint
from helpers import prefill_logits
from kvasir_engine.args import add_engine_args, engine_config_from_args
from kvasir_engine.checkpoint.metadata import read_checkpoint_quantization
from kvasir_engine.config import EngineConfig
from kvasir_engine.core.request import SamplingParams
from kvasir_engine.frontend.llm_engine import LLMEngine
from kvasir_engine.kernels import cpu
from kvasir_engine.kernels import reference as ref
from kvasir_engine.layers.quantization import (
    Int4Weight,
    Int4WeightOnly,
    Int8Weight,
    Int8WeightOnly,
)
from kvasir_engine.worker.model_runner import ModelRunner

pytest.importorskip("compressed_tensors")

WEIGHT_ONLY = ["w4a16", "w4a16_g64", "w4a16_asym", "w4a16_channel", "w8a16"]
INT_SCHEMES = [*WEIGHT_ONLY, "w8a8"]
# Prefill logits against the library's float32 model: weight-only schemes multiply the very
# weights it does, float activations, float32 sums in another order (measured ~1e-6);
# W8A8's int8 tile adds its per-row int8 activations (~1%; the reference keeps them float).
WEIGHT_ONLY_LOGITS_RTOL = 1e-4
INT8_TILE_LOGITS_RTOL = 0.03
# K is 64 (hidden) or 128 (intermediate): every group size here divides both.
SHAPE = {"intermediate_size": 128}
PROMPT = [5, 17, 42, 99, 120, 7, 250, 33, 64, 301, 12, 88]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("ct")
    return {s: write_compressed_checkpoint(root / s, s, **SHAPE)
            for s in [*INT_SCHEMES, "fp8"]}


def engine_config(model: Path, *flags: str) -> EngineConfig:
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    return engine_config_from_args(parser.parse_args(
        [str(model), "--device", "cpu", "--max-model-len", "64", "--block-size", "16",
         "--kv-cache-memory", str(8 << 20), *flags]))


def tile_weight(form: object) -> torch.Tensor:
    """The float64 weights [N, K] a native kernel multiplies with (float32 activations)."""
    if isinstance(form, Int4WeightOnly):
        return ref.dequantize_int4_wo(form.packed, form.scale, form.minimum, form.in_features,
                                      torch.float32).double()
    if isinstance(form, Int8WeightOnly):
        return ref.dequantize_int8_wo(form.rows, form.scale, form.in_features,
                                      torch.float32).double()
    if isinstance(form, Int4Weight):
        codes = ref.unpack_int4(form.packed).double()  # [N, Kp]
        n = codes.shape[0]
        w = (codes.view(n, -1, 32) * form.scale.double().unsqueeze(-1)
             + form.minimum.double().unsqueeze(-1)).view(n, -1)
        return w[:, :form.in_features]
    assert isinstance(form, Int8Weight)
    rows = cpu.int8_rows(form.rows, form.scale.shape[0]).double()
    return (rows * form.scale.double().unsqueeze(1))[:, :form.in_features]


@pytest.mark.parametrize("scheme", INT_SCHEMES)
def test_config_says_what_the_checkpoint_runs_as(checkpoints: dict[str, Path],
                                                 scheme: str) -> None:
    quant = read_checkpoint_quantization(checkpoints[scheme])
    assert quant is not None and quant.quant_method == "compressed-tensors"
    assert quant.kernel == ("int4" if scheme.startswith("w4") else "int8")
    assert not quant.is_quantized("lm_head") and quant.is_quantized("model.layers.0.mlp.up_proj")
    config = engine_config(checkpoints[scheme])
    assert config.model.quantization == quant.kernel
    assert config.model.checkpoint_quantization == quant


@pytest.mark.skipif(not cpu.available(), reason="native CPU kernels unavailable here")
@pytest.mark.parametrize("scheme", INT_SCHEMES)
def test_tiles_hold_the_library_dequantized_weights_and_logits_match(
        checkpoints: dict[str, Path], scheme: str) -> None:
    directory = checkpoints[scheme]
    runner = ModelRunner(engine_config(directory, "--dtype", "float32"))
    reference = reference_model(directory)
    ours = runner.model.model.layers
    for index, layer in enumerate(reference.model.layers):
        expected = {
            "self_attn.qkv_proj": torch.cat([layer.self_attn.q_proj.weight,
                                             layer.self_attn.k_proj.weight,
                                             layer.self_attn.v_proj.weight]),
            "self_attn.o_proj": layer.self_attn.o_proj.weight,
            "mlp.gate_up_proj": torch.cat([layer.mlp.gate_proj.weight, layer.mlp.up_proj.weight]),
            "mlp.down_proj": layer.mlp.down_proj.weight}
        for name, weight in expected.items():
            module = ours[index].get_submodule(name)
            assert module.weight.numel() == 0, f"{name}: a float copy kept"
            form = module.quantized
            assert isinstance(form, Int4WeightOnly | Int8WeightOnly if scheme in WEIGHT_ONLY
                              else Int8Weight), (name, scheme, type(form))
            # The library rounds its (q - zp) * scale to the checkpoint's bfloat16: the
            # weight-only kernels do too; the int8 tile keeps the exact product, which
            # rounded the same way is the library's weight.
            got = tile_weight(form)
            if scheme not in WEIGHT_ONLY:
                got = got.bfloat16().double()
            want = weight.detach().double()
            assert torch.equal(got, want), (name, scheme, (got - want).abs().max())
    assert runner.kernels.fused_decode
    with torch.inference_mode():
        want = reference(torch.tensor([PROMPT])).logits[0].double()
    got = prefill_logits(runner, PROMPT).double()
    error = float((got - want).norm() / want.norm())
    # The reference multiplies float activations (W8A8's included, ct_checkpoints.py).
    bound = WEIGHT_ONLY_LOGITS_RTOL if scheme in WEIGHT_ONLY else INT8_TILE_LOGITS_RTOL
    assert error < bound, (scheme, error)


@pytest.mark.parametrize("path", ["torch", "avx2"])
@pytest.mark.parametrize("scheme", ["w4a16_asym", "w8a16", "w8a8"])
def test_torch_fallback_and_avx2_int8_layout_match_too(checkpoints: dict[str, Path], scheme: str,
                                                       path: str,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the native kernels the same codes run through torch ops (weight-only schemes:
    the same weights, dequantized at load); on a host without AVX-512 VNNI the int8 tile
    takes rows, where a -128 code runs as -127 (the weight-only kernels keep it)."""
    if path == "torch":
        monkeypatch.setenv("KVASIR_NATIVE_CPU_KERNELS", "0")
    elif not cpu.available():
        pytest.skip("native CPU kernels unavailable here")
    else:
        monkeypatch.setattr(cpu, "int8_vnni_supported", lambda: False)
    directory = checkpoints[scheme]
    runner = ModelRunner(engine_config(directory, "--dtype", "float32"))
    assert runner.kernels.matmul == ("torch" if path == "torch" else "native")
    with torch.inference_mode():
        want = reference_model(directory)(torch.tensor([PROMPT])).logits[0].double()
    got = prefill_logits(runner, PROMPT).double()
    bound = WEIGHT_ONLY_LOGITS_RTOL if scheme in WEIGHT_ONLY else INT8_TILE_LOGITS_RTOL
    assert float((got - want).norm() / want.norm()) < bound, scheme


@pytest.mark.skipif(not cpu.available(), reason="native CPU kernels unavailable here")
def test_the_checkpoint_and_not_its_float_original_is_what_runs(tmp_path: Path) -> None:
    """The W4A16 checkpoint's logits are closer to its dequantized reference than the float
    model it came from is: a loader that dropped or scrambled the codes would not be."""
    from helpers import write_checkpoint

    original = write_checkpoint(tmp_path / "float", "llama", shard=False, **SHAPE)
    quantized = write_compressed_checkpoint(tmp_path / "q", "w4a16", **SHAPE)
    with torch.inference_mode():
        want = reference_model(quantized)(torch.tensor([PROMPT])).logits[0].double()
    got = prefill_logits(ModelRunner(engine_config(quantized, "--dtype", "float32")), PROMPT)
    float_logits = prefill_logits(ModelRunner(engine_config(original, "--dtype", "float32")),
                                  PROMPT)
    ours = float((got.double() - want).norm() / want.norm())
    theirs = float((float_logits.double() - want).norm() / want.norm())
    assert ours < theirs / 3, (ours, theirs)


def test_unsupported_schemes_are_refused_with_one_line(tmp_path: Path) -> None:
    directory = write_compressed_checkpoint(tmp_path / "g16", "w4a16_g16", **SHAPE)
    with pytest.raises(ValueError, match=r"config.json: .*int4 needs groups of a multiple of "
                                         r"32 weights.*group_size 16"):
        engine_config(directory)
    config_file = directory / "config.json"
    config = json.loads(config_file.read_text())
    config["quantization_config"]["quant_method"] = "bitsandbytes"
    config_file.write_text(json.dumps(config))
    with pytest.raises(ValueError, match="quant_method 'bitsandbytes' is not supported"):
        engine_config(directory)


def test_quantization_flag_must_agree_with_the_checkpoint(checkpoints: dict[str, Path]) -> None:
    assert engine_config(checkpoints["w4a16"], "--quantization", "int4").model.quantization \
        == "int4"
    with pytest.raises(ValueError, match=r"--quantization int8 disagrees with the checkpoint's "
                                         r"compressed-tensors W4A16 .* runs as int4"):
        engine_config(checkpoints["w4a16"], "--quantization", "int8")
    with pytest.raises(ValueError, match="--quantization int4 disagrees .* FP8"):
        engine_config(checkpoints["fp8"], "--quantization", "int4")
    # vLLM's names for the formats assert what the checkpoint is.
    assert engine_config(checkpoints["w8a8"], "--quantization", "compressed-tensors") \
        .model.quantization == "int8"
    assert engine_config(checkpoints["fp8"], "--quantization", "fp8").model.quantization is None
    with pytest.raises(ValueError, match="--quantization awq disagrees with the checkpoint's "
                                         "compressed-tensors W8A8"):
        engine_config(checkpoints["w8a8"], "--quantization", "awq")
    with pytest.raises(ValueError, match="--quantization fp8 disagrees"):
        engine_config(checkpoints["w4a16"], "--quantization", "fp8")


def test_a_format_name_for_an_unquantized_checkpoint_is_refused(tmp_path: Path) -> None:
    from helpers import write_checkpoint

    plain = write_checkpoint(tmp_path / "plain", "llama", shard=False)
    with pytest.raises(ValueError, match="--quantization gptq names a pre-quantized checkpoint "
                                         "format, but .* has no quantization_config"):
        engine_config(plain, "--quantization", "gptq")


def _dense_weights(runner: ModelRunner, reference) -> list[tuple[str, torch.Tensor, torch.Tensor]]:  # type: ignore[no-untyped-def]
    """(name, ours, library's) float weights of every decoder projection."""
    pairs = []
    for index, layer in enumerate(reference.model.layers):
        ours = runner.model.model.layers[index]
        pairs += [
            ("qkv", ours.self_attn.qkv_proj.weight, torch.cat([
                layer.self_attn.q_proj.weight, layer.self_attn.k_proj.weight,
                layer.self_attn.v_proj.weight])),
            ("o", ours.self_attn.o_proj.weight, layer.self_attn.o_proj.weight),
            ("gate_up", ours.mlp.gate_up_proj.weight, torch.cat([layer.mlp.gate_proj.weight,
                                                                 layer.mlp.up_proj.weight])),
            ("down", ours.mlp.down_proj.weight, layer.mlp.down_proj.weight)]
    return pairs


def test_fp8_on_cpu_is_dequantized_at_load_and_says_so(checkpoints: dict[str, Path],
                                                       caplog: pytest.LogCaptureFixture) -> None:
    directory = checkpoints["fp8"]
    config = engine_config(directory, "--dtype", "float32")
    assert config.model.quantization is None
    assert config.model.checkpoint_quantization is not None
    assert config.model.checkpoint_quantization.scheme == "FP8"
    with caplog.at_level("INFO"):
        runner = ModelRunner(config)
    assert runner.kernels.fp8_matmul == "dequantized"
    assert "FP8 checkpoint: 8 layers' weights dequantized to float32 at load (no FP8 products " \
           "on this device)" in caplog.text
    reference = reference_model(directory)
    for name, ours, theirs in _dense_weights(runner, reference):
        # e4m3 (4 bits) times a bfloat16 scale (8 bits) is exact in float32; the library
        # rounds it to bfloat16.
        assert torch.equal(ours.detach().bfloat16().float(), theirs.detach()), name
    with torch.inference_mode():
        want = reference(torch.tensor([PROMPT])).logits[0].double()
    got = prefill_logits(runner, PROMPT).double()
    # Measured 0.2%: the same weights, float activations on both sides.
    assert float((got - want).norm() / want.norm()) < 0.05


def test_fp8_products_path_matches_the_reference(checkpoints: dict[str, Path],
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """The GPU's path, run where torch's `_scaled_mm` also runs (CPU): the weights stay FP8
    (`Fp8Weight`) and activations are quantized to e4m3 per token, as the scheme says."""
    from kvasir_engine.layers.quantization import Fp8Weight
    from kvasir_engine.worker import model_runner

    choose = model_runner.build_kernel_choice
    monkeypatch.setattr(model_runner, "build_kernel_choice",
                        lambda *a, **k: replace(choose(*a, **k), fp8_matmul="scaled_mm"))
    directory = checkpoints["fp8"]
    runner = ModelRunner(engine_config(directory, "--dtype", "float32"))
    down = runner.model.model.layers[0].mlp.down_proj
    assert isinstance(down.quantized, Fp8Weight) and down.weight.numel() == 0
    with torch.inference_mode():
        want = reference_model(directory)(torch.tensor([PROMPT])).logits[0].double()
    got = prefill_logits(runner, PROMPT).double()
    # Measured 2.5%: e4m3 keeps 3 bits of each activation (the scheme's per-token FP8
    # activations; the reference multiplies float activations, see ct_checkpoints.py).
    assert float((got - want).norm() / want.norm()) < 0.05


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_fp8_checkpoint_on_gpu(checkpoints: dict[str, Path]) -> None:
    from kvasir_engine.kernels import fp8

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    config = engine_config_from_args(parser.parse_args(
        [str(checkpoints["fp8"]), "--device", "cuda", "--dtype", "bfloat16",
         "--max-model-len", "64", "--enforce-eager", "--gpu-memory-utilization", "0.2"]))
    runner = ModelRunner(config)
    supported = fp8.fp8_supported(torch.device("cuda"))
    assert runner.kernels.fp8_matmul == ("scaled_mm" if supported else "dequantized")
    with torch.inference_mode():
        want = reference_model(checkpoints["fp8"])(torch.tensor([PROMPT])).logits[0].double()
    got = prefill_logits(runner, PROMPT).double().cpu()
    assert float((got - want).norm() / want.norm()) < 0.05


@pytest.mark.skipif(not cpu.available(), reason="native CPU kernels unavailable here")
@pytest.mark.parametrize("method", ["awq", "gptq"])
def test_autoawq_and_autogptq_layouts_load_onto_the_int4_tile(tmp_path: Path,
                                                              method: str) -> None:
    """qweight / qzeros / scales (/ g_idx) read into the weight-only int4 kernel: its weights
    are the format's own dequantization, float16 arithmetic (AutoGPTQ's kernels; AutoAWQ's
    `dequantize_gemm`), bit for bit, and the logits those of transformers running them."""
    from legacy_checkpoints import write_legacy_checkpoint

    if method == "awq":
        pytest.importorskip("awq")
    directory = tmp_path / method
    weights = write_legacy_checkpoint(directory, method, group_size=32, **SHAPE)
    # The formats dequantize `scale * (q - zero)` in float16: rounded once to it.
    weights = {name: w.half().float() for name, w in weights.items()}
    config = engine_config(directory, "--dtype", "float32")
    assert config.model.quantization == "int4"
    runner = ModelRunner(config)
    assert runner.kernels.fused_decode
    reference = _float_model(directory, weights)
    for index in range(len(reference.model.layers)):
        prefix = f"model.layers.{index}."
        ours = runner.model.model.layers[index]
        for name, parts in [("self_attn.qkv_proj", ["self_attn.q_proj", "self_attn.k_proj",
                                                    "self_attn.v_proj"]),
                            ("mlp.gate_up_proj", ["mlp.gate_proj", "mlp.up_proj"]),
                            ("mlp.down_proj", ["mlp.down_proj"])]:
            want = torch.cat([weights[prefix + p] for p in parts]).double()
            form = ours.get_submodule(name).quantized
            assert isinstance(form, Int4WeightOnly) and form.scale.dtype == torch.float16
            got = tile_weight(form)
            assert torch.equal(got, want), (name, method, (got - want).abs().max())
    with torch.inference_mode():
        want_logits = reference(torch.tensor([PROMPT])).logits[0].double()
    got_logits = prefill_logits(runner, PROMPT).double()
    error = float((got_logits - want_logits).norm() / want_logits.norm())
    assert error < WEIGHT_ONLY_LOGITS_RTOL, (method, error)


def _float_model(directory: Path, weights: dict[str, torch.Tensor]):  # type: ignore[no-untyped-def]
    """transformers' Llama of `directory`'s config with the dequantized linears."""
    import transformers
    from safetensors.torch import load_file

    config = transformers.AutoConfig.from_pretrained(str(directory))
    del config.quantization_config
    model = transformers.LlamaForCausalLM(config).to(torch.float32).eval()
    state = {n: t.float() for n, t in load_file(str(directory / "model.safetensors")).items()
             if n.rsplit(".", 1)[-1] not in ("qweight", "qzeros", "scales", "g_idx")}
    state.update({f"{m}.weight": w.float() for m, w in weights.items()})
    model.load_state_dict(state, strict=True)
    return model


def _ct(weights: dict[str, object], **group: object) -> dict[str, object]:
    return {"quant_method": "compressed-tensors", "format": "pack-quantized",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, **group}}}


_INT4 = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 128}


@pytest.mark.parametrize("raw,message", [
    ({"quant_method": "bitsandbytes"}, "quant_method 'bitsandbytes' is not supported"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": True},
     "gptq 4-bit group 128 with desc_act .* is not supported"),
    ({"quant_method": "gptq", "bits": 3, "group_size": 128}, "only 4-bit gptq"),
    ({"quant_method": "awq", "bits": 4, "group_size": 64, "version": "gemv"},
     "AWQ version 'gemv' is not supported"),
    (_ct({**_INT4, "group_size": 16}), "int4 needs groups of a multiple of 32"),
    (_ct({**_INT4, "actorder": "group"}), "actorder 'group'"),
    (_ct({**_INT4, "num_bits": 8, "symmetric": False, "strategy": "channel"},
         format="int-quantized"), "int8 runs symmetric"),
    (_ct(_INT4, input_activations={"num_bits": 8, "type": "int", "strategy": "tensor",
                                   "dynamic": False}), "static or tensor activation"),
    (_ct({**_INT4, "num_bits": 4, "type": "float"}, format="float-quantized"),
     "only FP8 .* are supported"),
    ({**_ct(_INT4), "kv_cache_scheme": {"num_bits": 8}}, "kv_cache_scheme"),
    ({"quant_method": "compressed-tensors", "config_groups": {}}, "0 config_groups"),
    ({"quant_method": "compressed-tensors", "config_groups": {"g": {"weights": {}}}},
     "without weight quantization"),
    ({"quant_method": "compressed-tensors",
      "config_groups": {"g": {"weights": {"num_bits": 4}}}}, "malformed .*'type'"),
])
def test_schemes_we_cannot_run_are_named_in_one_line(raw: dict[str, object],
                                                     message: str) -> None:
    from kvasir_engine.checkpoint.quant_config import parse_quantization_config

    with pytest.raises(ValueError, match=f"^model/config.json: .*{message}") as error:
        parse_quantization_config({"quantization_config": raw}, "model/config.json")
    assert "\n" not in str(error.value)


def test_gptq_with_a_permuting_g_idx_is_refused_at_load(tmp_path: Path) -> None:
    """A g_idx that is not k // g (act order proper, whatever the config says) is refused
    when the weights are read, naming the module."""
    from legacy_checkpoints import write_legacy_checkpoint
    from safetensors.torch import load_file, save_file

    directory = tmp_path / "gptq"
    write_legacy_checkpoint(directory, "gptq", **SHAPE)
    weights = directory / "model.safetensors"
    tensors = load_file(str(weights))
    name = "model.layers.1.mlp.down_proj.g_idx"
    tensors[name] = tensors[name].flip(0).contiguous()
    save_file(tensors, str(weights))
    with pytest.raises(ValueError, match="'model.layers.1.mlp.down_proj': g_idx assigns inputs "
                                         "to groups out of order"):
        ModelRunner(engine_config(directory, "--dtype", "float32"))


@pytest.mark.skipif(not cpu.available(), reason="native CPU kernels unavailable here")
def test_ignored_projections_stay_float_and_the_fused_decode_step_is_off(tmp_path: Path) -> None:
    """A checkpoint whose ignore list leaves every down_proj unquantized: those run as float
    Linears, the others on the weight-only int4 kernel, and the fused decode step (one weight
    form for every projection) is not chosen."""
    directory = write_compressed_checkpoint(tmp_path / "q", "w4a16",
                                            ignore=("lm_head", "re:.*down_proj$"), **SHAPE)
    runner = ModelRunner(engine_config(directory, "--dtype", "float32"))
    assert not runner.kernels.fused_decode
    layer = runner.model.model.layers[0]
    assert isinstance(layer.mlp.gate_up_proj.quantized, Int4WeightOnly)
    assert layer.mlp.down_proj.quantized is None and layer.mlp.down_proj.weight.numel() > 0
    with torch.inference_mode():
        want = reference_model(directory)(torch.tensor([PROMPT])).logits[0].double()
    got = prefill_logits(runner, PROMPT).double()
    assert float((got - want).norm() / want.norm()) < WEIGHT_ONLY_LOGITS_RTOL
    decoded = LLMEngine.from_config(engine_config(directory, "--dtype", "float32")).generate(
        [PROMPT], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    assert len(decoded[0].token_ids) == 6


def test_a_fused_projection_quantized_in_part_is_refused(tmp_path: Path) -> None:
    directory = write_compressed_checkpoint(tmp_path / "q", "w4a16",
                                            ignore=("lm_head", "re:.*k_proj$"), **SHAPE)
    with pytest.raises(ValueError, match=r"model.layers.0.self_attn.q_proj, "
                                         r"model.layers.0.self_attn.k_proj, "
                                         r"model.layers.0.self_attn.v_proj are fused in one "
                                         r"layer but not all quantized alike"):
        ModelRunner(engine_config(directory, "--dtype", "float32"))


def test_fp8_products_are_chosen_on_fp8_gpus_in_bfloat16_only(checkpoints: dict[str, Path]) -> None:
    from kvasir_engine.kernels.choice import build_kernel_choice

    def choice(device: str, dtype: str, has_fp8: bool) -> str:
        config = engine_config(checkpoints["fp8"], "--dtype", dtype)
        config = replace(config, device=replace(config.device, device=device))
        return build_kernel_choice(config, device, lambda: False, {},
                                   cuda_fp8=lambda: has_fp8).fp8_matmul

    assert choice("cuda", "bfloat16", True) == "scaled_mm"
    assert choice("cuda", "bfloat16", False) == "dequantized"  # an A100: no FP8 products
    assert choice("cuda", "float32", True) == "dequantized"
    assert choice("cpu", "bfloat16", True) == "dequantized"


@pytest.mark.skipif(not cpu.available(), reason="native CPU kernels unavailable here")
@pytest.mark.parametrize("scheme", WEIGHT_ONLY)
def test_weight_only_greedy_tokens_equal_the_library_reference(checkpoints: dict[str, Path],
                                                               scheme: str) -> None:
    """Prefill and the fused decode step (on for these checkpoints) through the weight-only
    kernels, float32: the greedy tokens are transformers' own on the dequantized model."""
    directory = checkpoints[scheme]
    config = engine_config(directory, "--dtype", "float32")
    engine = LLMEngine.from_config(config)
    got = engine.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=12,
                                                   ignore_eos=True))[0].token_ids
    assert list(got) == reference_greedy(reference_model(directory), PROMPT, 12), scheme


@pytest.mark.skipif(not cpu.available(), reason="native CPU kernels unavailable here")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("scheme", ["w4a16_asym", "w8a16"])
def test_weight_only_fused_decode_equals_the_eager_layers(checkpoints: dict[str, Path],
                                                          scheme: str, dtype: str) -> None:
    """The fused decode step's "int4wo" / "int8wo" products are the eager layers' own: three
    prompts decoded together give the same tokens and logprobs either way."""
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=5)
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, 300, (n,), generator=g).tolist() for n in (3, 19, 9)]

    def generate(fused: bool) -> list[tuple[object, object]]:
        engine = LLMEngine.from_config(engine_config(checkpoints[scheme], "--dtype", dtype))
        model = engine.core.executor.runner.model.model  # type: ignore[attr-defined]
        assert model.fused_decode.method == ("int4wo" if scheme.startswith("w4") else "int8wo")
        if not fused:
            model.fused_decode = None
        return [(o.token_ids, o.logprobs) for o in engine.generate(prompts, params)]

    assert generate(fused=True) == generate(fused=False)


@pytest.mark.skipif(not cpu.available(), reason="native CPU kernels unavailable here")
@pytest.mark.parametrize("scheme", ["w4a16", "w8a16"])
def test_weight_only_bfloat16_prefill_of_a_long_prompt(checkpoints: dict[str, Path],
                                                       scheme: str) -> None:
    """bfloat16 compute with more than 16 rows: the products dequantize chunks of weights to
    bfloat16 for oneDNN (as the engine runs them, under inference mode); the logits are the
    float32 reference's to bfloat16's rounding of activations and weights."""
    directory = checkpoints[scheme]
    prompt = PROMPT * 4  # 48 tokens
    runner = ModelRunner(engine_config(directory, "--dtype", "bfloat16"))
    got = prefill_logits(runner, prompt).double()
    with torch.inference_mode():
        want = reference_model(directory)(torch.tensor([prompt])).logits[0].double()
    assert float((got - want).norm() / want.norm()) < 0.05
