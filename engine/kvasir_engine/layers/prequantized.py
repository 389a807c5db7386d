"""Layers of a pre-quantized checkpoint (compressed-tensors int4 / int8 / FP8, GPTQ, AWQ):
integer weights loaded as they are and packed once for the native kernels, never dequantized
(but in the torch fallback); FP8 weights kept for a GPU's FP8 products, or dequantized once at
load where there are none (CPU).

`stage_model` runs before loading: each layer the checkpoint quantizes swaps its float weight
for staging parameters in the form checkpoint/quantized_tensors.py yields (int4: codes [N, K]
uint8, scale [N, K / 32] in the checkpoint's dtype, minimum [N, K / 32] float32; int8: codes
[N, K] int8, scale [N] in the checkpoint's dtype; FP8: [N, K] float8_e4m3fn, scale [N]
float32), whose shapes shard and fuse (q/k/v, gate/up) through the layer's own `weight_loader`
as the float weight would. A scale's staging takes the dtype the checkpoint gives it: the
library's dequantization rounds the weights to it, and so do our weight-only products.
`finish_model` runs after loading, in place of `quantize_model`: it packs each staged layer's
codes into the form the products use (layers/quantization.py), or dequantizes FP8, and frees
the staging:

- weight-only schemes (W4A16, GPTQ, AWQ, W8A16: `activation_bits` None) -> `Int4WeightOnly` /
  `Int8WeightOnly`: float activations as they are, the scheme's own arithmetic;
- W8A8 -> the int8 tile `Int8Weight` (its per-row int8 activations are the scheme's). Its AVX2
  layout (no AVX-512 VNNI) takes codes in [-127, 127]; compressed-tensors' symmetric int8 uses
  -128 too (its scale is max / 127.5), so there a -128 becomes -127 (at most a few weights a
  row move by one step, logged). The VNNI layout and the torch fallback keep it.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from kvasir_engine.checkpoint.quant_config import (
    KERNEL_FP8,
    KERNEL_INT4,
    KERNEL_INT8,
    CheckpointQuantization,
)
from kvasir_engine.kernels import cpu, fp8
from kvasir_engine.kernels.checks import FLOAT_DTYPES
from kvasir_engine.layers.quantization import (
    Fp8Weight,
    Int8Weight,
    WeightOnlyForm,
    int4_weight_only,
    int8_weight,
    int8_weight_only,
)

logger = logging.getLogger(__name__)

_CODE_DTYPES = {KERNEL_INT4: torch.uint8, KERNEL_INT8: torch.int8, KERNEL_FP8: torch.float8_e4m3fn}


def checkpoint_names(module_name: str, packed: dict[str, tuple[str, str | int]]) -> list[str]:
    """The checkpoint's module names a model module is loaded from (its q/k/v parts for a
    fused qkv_proj, through the model's `packed_modules_mapping`)."""
    parts = [module_name.replace(fused, part) for part, (fused, _) in packed.items()
             if module_name.endswith("." + fused)]
    return parts or [module_name]


def stage_model(model: nn.Module, quant: CheckpointQuantization) -> int:
    """Give every layer the checkpoint stores quantized its staging parameters; returns how
    many. A fused layer whose parts are not all quantized alike is refused."""
    packed: dict[str, tuple[str, str | int]] = getattr(model, "packed_modules_mapping", {})
    staged = 0
    for name, module in model.named_modules():
        if not callable(getattr(module, "quantize", None)):
            continue
        names = checkpoint_names(name, packed)
        flags = {quant.is_quantized(n) for n in names}
        if flags == {True} and _tied(model, module):
            raise ValueError(f"{quant.describe()}: the LM head is quantized but tied to the "
                             "embedding; not supported")
        if len(flags) > 1:
            raise ValueError(f"{quant.describe()}: {', '.join(names)} are fused in one layer "
                             "but not all quantized alike")
        if flags == {True}:
            _stage(module, quant)
            staged += 1
    return staged


def _tied(model: nn.Module, module: nn.Module) -> bool:
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    return embed is not None and getattr(embed, "weight", None) is module.weight


def _stage(module: nn.Module, quant: CheckpointQuantization) -> None:
    weight = module._parameters["weight"]
    if weight is None:
        raise ValueError("a quantized layer without a weight")
    n, k = weight.shape
    groups = cpu.padded_k(k) // cpu.GROUP_SIZE
    # The scale's dtype here is a placeholder: it becomes the checkpoint's (_checked).
    shapes: dict[str, tuple[tuple[int, ...], torch.dtype]] = (
        {"weight": ((n, k), torch.uint8), "weight_scale": ((n, groups), torch.float32),
         "weight_minimum": ((n, groups), torch.float32)} if quant.kernel == KERNEL_INT4 else
        {"weight": ((n, k), _CODE_DTYPES[quant.kernel]), "weight_scale": ((n,), torch.float32)})
    loader = weight.weight_loader  # type: ignore[attr-defined]
    for part, (shape, dtype) in shapes.items():
        param = nn.Parameter(torch.zeros(shape, dtype=dtype), requires_grad=False)
        param.weight_loader = _checked(loader, part, dtype)  # type: ignore[attr-defined]
        setattr(module, part, param)
    # Read by finish_model: W4A16 / W8A16 / GPTQ / AWQ keep float activations.
    module.weight_scale.is_weight_only = quant.activation_bits is None  # type: ignore[union-attr]


def _checked(loader, part: str, dtype: torch.dtype):  # type: ignore[no-untyped-def]
    """The layer's own loader, after checking the checkpoint gave this part its integer form
    (a float weight where quantization_config says quantized is refused, not cast). A scale
    is taken in whichever float dtype the checkpoint stores it (the staging adopts it)."""
    def load(param: nn.Parameter, loaded: torch.Tensor, shard_id: str | int | None = None) -> None:
        if part == "weight_scale" and loaded.dtype in FLOAT_DTYPES:
            if param.dtype != loaded.dtype:
                param.data = param.data.to(loaded.dtype)
        elif loaded.dtype != dtype:
            raise ValueError(f"checkpoint gives {part} as {loaded.dtype} where its "
                             f"quantization_config says quantized ({dtype} expected)")
        loader(param, loaded, shard_id)
    return load


def finish_model(model: nn.Module, dtype: torch.dtype, native: bool,
                 fp8_device: torch.device | None = None) -> int:
    """Pack every staged layer's codes for the products (native tiles when `native`, else the
    torch fallback in compute `dtype`) and free the staging; returns how many. FP8 weights
    stay FP8 on `fp8_device` (a GPU with FP8 products, kernels/fp8.py) where the layer's shape
    fits them, else they are dequantized here to `dtype`."""
    finished, clamped, dequantized, weight_only, bits = 0, 0, 0, 0, ""
    for module in model.modules():
        staged = module._parameters
        if "weight_scale" not in staged:
            continue
        is_weight_only = bool(getattr(staged["weight_scale"], "is_weight_only", False))
        codes, scale = _data(staged, "weight"), _data(staged, "weight_scale")
        del staged["weight_scale"]
        finished += 1
        if codes.dtype == torch.float8_e4m3fn:
            if fp8_device is not None and fp8.fits(codes):
                staged["weight"] = nn.Parameter(torch.empty(0), requires_grad=False)
                setattr(module, "quantized", Fp8Weight(  # noqa: B010 - as below
                    codes.to(fp8_device), scale.to(fp8_device)))
            else:
                # Straight to the compute dtype: the float32 product of a layer at a time, never
                # the whole model's (the runner's cast is then a no-op for these weights).
                staged["weight"] = nn.Parameter((codes.float() * scale.float().unsqueeze(1)).to(dtype),
                                                requires_grad=False)
                dequantized += 1
            continue
        n, k = codes.shape
        padded = torch.zeros(n, cpu.padded_k(k), dtype=codes.dtype)
        padded[:, :k] = codes
        form: WeightOnlyForm | Int8Weight
        if codes.dtype == torch.uint8:  # int4 schemes are all weight-only (quant_config.py)
            form = int4_weight_only(padded, scale, _data(staged, "weight_minimum"), k, dtype,
                                    native)
            del staged["weight_minimum"]
        elif is_weight_only:
            form = int8_weight_only(padded, scale, k, dtype, native)
        else:
            if native and not cpu.int8_vnni_supported():
                clamped += int((padded == -128).sum())
                padded.clamp_(min=-127)
            form = int8_weight(padded, scale.float(), k, dtype, native)
        if isinstance(form, WeightOnlyForm):
            weight_only += 1
            bits = "int4" if codes.dtype == torch.uint8 else "int8"
        staged["weight"] = nn.Parameter(torch.empty(0), requires_grad=False)
        setattr(module, "quantized", form)  # noqa: B010 - LinearBase's and the LM head's field
    if weight_only:
        logger.info("weight-only checkpoint: %d layers run as %s weights times %s activations "
                    "as they are, no activation quantization (%s)", weight_only, bits,
                    str(dtype).removeprefix("torch."),
                    "native weight-only kernels" if native
                    else "torch fallback: weights dequantized at load")
    if clamped:
        logger.info("int8 checkpoint: %d codes of -128 run as -127 (the AVX2 int8 tile's "
                    "range)", clamped)
    if dequantized:
        logger.info("FP8 checkpoint: %d layers' weights dequantized to %s at load (%s)",
                    dequantized, str(dtype).removeprefix("torch."),
                    "no FP8 products on this device" if fp8_device is None
                    else "their shapes do not fit the FP8 products")
    return finished


def _data(params: dict[str, nn.Parameter | None], name: str) -> torch.Tensor:
    param = params.get(name)
    if param is None:
        raise ValueError(f"staged layer lacks {name}")
    return param.data
