"""Pre-quantized checkpoints written by the real compressed-tensors library, not by our code.

`write_compressed_checkpoint(dir, scheme)` saves a tiny random Llama (tests/engine/helpers.py)
in bfloat16, attaches compressed-tensors' scheme to every Linear but the LM head, computes each
weight's scale (and zero point) with the library's own `calculate_qparams` from the weight's
min / max (round-to-nearest, what llm-compressor's observers do without GPTQ), compresses with
`ModelCompressor` and saves with `save_pretrained` + `update_config`, as llm-compressor does.
`reference_model(dir)` is transformers' own reading of it, weights dequantized by the library
(`dequantize=True`): plain float32 Linears. `export_default_bf16(dir)` writes the default model
(its Q4_1 GGUF) as the bfloat16 Hugging Face checkpoint the schemes quantize on the default
model (bench/quality.py, tests/engine/checkpoint/test_weight_only_default_model.py), and
`quantize_export(bf16, dir, scheme)` quantizes it into a servable directory. With transformers 5.25 that model no longer keeps
compressed-tensors' input quantize-dequantize of W8A8 / FP8 (checked: `run_compressed=False`
gives the same logits), so it is the scheme's weights with float activations.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from helpers import default_gguf_path, write_checkpoint

# Prompts the default-model checks continue greedily (bench/quality.py, the acceptance test).
DEFAULT_MODEL_PROMPTS = ["The capital of France is", "def fibonacci(n):",
                         "Once upon a time, in a small", "The three primary colors are"]

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


def reference_greedy(model, prompt: list[int], max_tokens: int) -> list[int]:  # type: ignore[no-untyped-def]
    """`model` (transformers) continued greedily by `max_tokens` tokens, the argmax of its own
    forward at each step, EOS taken like any other token as our engine's `ignore_eos` does
    (`generate(min_new_tokens=...)` would forbid EOS instead and part from us there)."""
    import torch

    ids = list(prompt)
    with torch.inference_mode():
        for _ in range(max_tokens):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


def export_default_bf16(directory: Path) -> Path:
    """The default GGUF as a bfloat16 Hugging Face directory (weights, config, tokenizer):
    transformers reads the GGUF and its state dict goes into a fresh model."""
    import torch
    import transformers

    gguf = default_gguf_path()
    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(gguf.parent),
                                                               gguf_file=gguf.name)
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = transformers.AutoModelForCausalLM.from_config(config)
    model.load_state_dict(loaded.state_dict())
    model.to(torch.bfloat16).save_pretrained(str(directory))
    transformers.AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name) \
        .save_pretrained(str(directory))
    return directory


def quantize_export(bf16: Path, directory: Path, scheme: str) -> Path:
    """export_default_bf16's checkpoint quantized by compressed-tensors as `scheme`, with its
    tokenizer and chat template."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(bf16), dtype=torch.bfloat16)
    quantize_and_save(model, directory, scheme)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (bf16 / name).exists():
            (directory / name).write_bytes((bf16 / name).read_bytes())
    return directory
