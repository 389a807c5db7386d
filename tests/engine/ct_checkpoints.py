"""Pre-quantized checkpoints written by the real compressed-tensors library, not by our code.

`write_compressed_checkpoint(dir, scheme)` saves a tiny random Llama (tests/engine/helpers.py)
in bfloat16, attaches compressed-tensors' scheme to every Linear but the LM head, computes each
weight's scale (and zero point) with the library's own `calculate_qparams` from the weight's
min / max (round-to-nearest, what llm-compressor's observers do without GPTQ), compresses with
`ModelCompressor` and saves with `save_pretrained` + `update_config`, as llm-compressor does.
`reference_model(dir)` is transformers' own reading of it, weights dequantized by the library
(`dequantize=True`): plain float32 Linears. With transformers 5.25 that model no longer keeps
compressed-tensors' input quantize-dequantize of W8A8 / FP8 (checked: `run_compressed=False`
gives the same logits), so it is the scheme's weights with float activations.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from helpers import write_checkpoint

# scheme -> (weights, input activations, storage format)
SCHEMES: dict[str, tuple[dict[str, Any], dict[str, Any] | None, str]] = {
    "w4a16": ({"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
               "group_size": 32}, None, "pack-quantized"),
    "w4a16_g64": ({"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
                   "group_size": 64}, None, "pack-quantized"),
    "w4a16_asym": ({"num_bits": 4, "type": "int", "symmetric": False, "strategy": "group",
                    "group_size": 32}, None, "pack-quantized"),
    "w4a16_channel": ({"num_bits": 4, "type": "int", "symmetric": True,
                       "strategy": "channel"}, None, "pack-quantized"),
    "w8a16": ({"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"}, None,
              "int-quantized"),
    "w8a8": ({"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"},
             {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token",
              "dynamic": True}, "int-quantized"),
    "fp8": ({"num_bits": 8, "type": "float", "symmetric": True, "strategy": "channel"},
            {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "token",
             "dynamic": True}, "float-quantized"),
    "w4a16_g16": ({"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
                   "group_size": 16}, None, "pack-quantized"),
}


def quantize_and_save(model, directory: Path, scheme: str,  # type: ignore[no-untyped-def]
                      ignore: tuple[str, ...] = ("lm_head",)) -> Path:
    """Quantize a loaded transformers `model` in place with compressed-tensors and save it."""
    import torch
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationArgs,
        QuantizationConfig,
        QuantizationScheme,
        apply_quantization_config,
    )
    from compressed_tensors.quantization.utils import calculate_qparams

    weights, activations, storage = SCHEMES[scheme]
    config = QuantizationConfig(config_groups={"group_0": QuantizationScheme(
        targets=["Linear"], weights=QuantizationArgs(**weights),
        input_activations=None if activations is None else QuantizationArgs(**activations),
        format=storage)}, ignore=list(ignore))
    apply_quantization_config(model, config, show_progress=False)
    with torch.no_grad():
        for module in model.modules():
            args = getattr(getattr(module, "quantization_scheme", None), "weights", None)
            if args is None:
                continue
            w = module.weight.float()
            if args.strategy == "group":
                w = w.view(w.shape[0], -1, args.group_size)
            scale, zero_point = calculate_qparams(w.amin(-1), w.amax(-1), args)
            module.weight_scale.copy_(scale.reshape(module.weight_scale.shape))
            if hasattr(module, "weight_zero_point"):
                module.weight_zero_point.copy_(
                    zero_point.reshape(module.weight_zero_point.shape))
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format=storage)
    compressor.compress_model(model)
    model.save_pretrained(str(directory))
    compressor.update_config(str(directory))
    return directory


def write_compressed_checkpoint(directory: Path, scheme: str, seed: int = 0,
                                ignore: tuple[str, ...] = ("lm_head",), **overrides: Any) -> Path:
    """A tiny random Llama in `directory`, quantized by compressed-tensors as `scheme`, but for
    the modules `ignore` names (compressed-tensors' grammar: names, "re:" regexes)."""
    import torch
    import transformers

    write_checkpoint(directory, "llama", seed=seed, shard=False, **overrides)
    model = transformers.LlamaForCausalLM.from_pretrained(str(directory), dtype=torch.bfloat16)
    for stale in directory.glob("*.safetensors*"):
        stale.unlink()
    return quantize_and_save(model, directory, scheme, ignore)


def reference_model(directory: Path):  # type: ignore[no-untyped-def]
    """transformers' float32 model of the checkpoint, dequantized by compressed-tensors."""
    import torch
    import transformers
    from transformers.utils.quantization_config import CompressedTensorsConfig

    return transformers.AutoModelForCausalLM.from_pretrained(
        str(directory), dtype=torch.float32,
        quantization_config=CompressedTensorsConfig(dequantize=True)).eval()
