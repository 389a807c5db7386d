"""Quantized weights for the CPU linears and LM head (`--quantization int8 | int4`).

Each weight matrix is quantized once, after loading and before the cast to the compute dtype,
and its float copy freed:

- int8: symmetric per output channel, `W[n, :] ~= scale[n] * q[n, :]`, q in [-127, 127];
- int4: llama.cpp's Q4_1 along K, groups of 32 with a scale and a minimum each,
  `W[n, g*32 + j] ~= scale[n, g] * q + minimum[n, g]`, q in [0, 15], scale and minimum in
  float16 (0.625 bytes a weight in all). Re-quantizing the
  dequantized weights of a Q4_1 GGUF gives back its codes, so the default model runs with the
  weights it was shipped with. The LM head of an int4 model is int8 (GGUF files keep it 8-bit).

The products run in the native kernels of kernels/cpu.py: activations are quantized to
int8 on the fly (per row for int8 weights, per group of 32 for int4) and multiplied with integer
dot products; the relative error of a product is about 1% (bfloat16: 0.2%). A weight-only
checkpoint's layers (W4A16, W8A16: layers/prequantized.py) take `Int4WeightOnly` /
`Int8WeightOnly` instead: the same codes times float activations, no activation rounding.
Our int4's prompt rows take that path too where the kernel choice says so (`int4_prefill`:
bfloat16 on a CPU with AVX512-BF16 or AMX): above 16 rows the same codes, dequantized in
chunks, times the bfloat16 activations through oneDNN (0.24-0.76x the tile's time from 24
rows); its decode rows stay on the tile, faster there (the weight-only streaming kernel takes
1.2-1.7x its time at 1-16 rows). Which of the two
runs is the process's `KernelChoice.matmul` (kernels/choice.py), passed in as `native`; where
those kernels cannot be built the layers fall back to torch ops with the same weights: int8 through
`torch._weight_int8pack_mm` (<= 4 rows) or `torch._int_mm` (fast only with AVX-512 VNNI or
AMX), int4 as a float matmul over the dequantized weights (no faster than float, same
quantization error).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from kvasir_engine.config import QUANTIZATIONS
from kvasir_engine.kernels import cpu, fp8, reference
from kvasir_engine.layers.dense import DenseForm

# Torch fallback only: at or below this many rows a product is bound by reading the weights.
_W8A16_MAX_ROWS = 4
# Rows up to which an int4 product with bfloat16 activations stays on the tile where the
# weight-only chunks are chosen (`Int4Weight.prefill_minimum`): measured on 2 EPYC cores over
# the default model's four shapes, cpu_quant_wo.cpp (which streams 16 rows or fewer) took
# 1.2-1.7x the tile's time at 1-16 rows; its chunks, summed, 0.93x at 17 rows, 0.76x at 24,
# 0.24-0.4x at 512.
INT4_TILE_MAX_ROWS = 16


@dataclass(frozen=True)
class Int8Weight:
    # [N, Kp] int8, zero past K ([N, K] in the torch fallback); native on a host with AVX-512
    # VNNI: cpu.pack_int8_vnni's [ceil(N / 16), Kp / 4, 64] uint8 of it (cpu.int8_rows undoes it)
    rows: torch.Tensor
    scale: torch.Tensor  # [N] float32
    in_features: int  # K
    # Torch fallback only (no native kernels): [K, N] int8 for _int_mm, scale in compute dtype.
    cols: torch.Tensor | None = None
    scale_compute: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.cols is None:  # native: checked once here, not on every product
            cpu.check_int8_weight(self.rows, self.scale, self.in_features)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:  # [M, K] -> [M, N]
        if self.cols is None or self.scale_compute is None:
            return cpu.int8_linear(x, self.rows, self.scale, self.in_features, checked=True)
        if x.shape[0] <= _W8A16_MAX_ROWS:
            return torch._weight_int8pack_mm(x, self.rows, self.scale_compute)
        row_max = x.abs().amax(dim=1, keepdim=True).float().clamp_(min=1e-12)
        xq = torch.round(x * (127.0 / row_max)).to(torch.int8)
        y = torch._int_mm(xq, self.cols)
        return torch.mul(y, row_max.div_(127.0)).mul_(self.scale).to(x.dtype)


@dataclass(frozen=True)
class Int4Weight:
    packed: torch.Tensor  # [N, Kp / 2] uint8: two codes a byte (kernels.reference.unpack_int4)
    scale: torch.Tensor  # [N, Kp / 32] float16
    minimum: torch.Tensor  # [N, Kp / 32] float16
    in_features: int  # K
    dequantized: torch.Tensor | None = None  # [N, K] compute dtype: torch fallback only
    # The minimum in float32 where bfloat16 prompt rows take the weight-only products
    # (`KernelChoice.int4_prefill`): `scale * code + minimum` times the activations as they are.
    prefill_minimum: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.dequantized is None:  # native: checked once here, not on every product
            cpu.check_int4_weight(self.packed, self.scale, self.minimum, self.in_features)
            if self.prefill_minimum is not None:
                cpu.check_int4_wo_weight(self.packed, self.scale, self.prefill_minimum,
                                         self.in_features)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:  # [M, K] -> [M, N]
        if self.dequantized is not None:
            return F.linear(x, self.dequantized)
        if (self.prefill_minimum is not None and x.shape[0] > INT4_TILE_MAX_ROWS
                and x.dtype == torch.bfloat16):
            return cpu.int4_linear_wo(x, self.packed, self.scale, self.prefill_minimum,
                                      self.in_features, checked=True)
        return cpu.int4_linear(x, self.packed, self.scale, self.minimum, self.in_features,
                               checked=True)


@dataclass(frozen=True)
class Int4WeightOnly:
    """A weight-only int4 checkpoint's weight (W4A16, GPTQ, AWQ): activations stay float.
    Its weights are `scale * code + minimum` rounded to the scale's dtype, what the
    checkpoint's library dequantizes them to (kernels/cpu.py int4_linear_wo)."""

    packed: torch.Tensor  # [N, Kp / 2] uint8, as Int4Weight's
    scale: torch.Tensor  # [N, Kp / 32] in the checkpoint's dtype (bfloat16, float16, float32)
    minimum: torch.Tensor  # [N, Kp / 32] float32: -scale * (8 + zero point), exact
    in_features: int  # K
    dequantized: torch.Tensor | None = None  # [N, K] compute dtype: torch fallback only

    def __post_init__(self) -> None:
        if self.dequantized is None:  # native: checked once here, not on every product
            cpu.check_int4_wo_weight(self.packed, self.scale, self.minimum, self.in_features)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:  # [M, K] -> [M, N]
        if self.dequantized is not None:
            return F.linear(x, self.dequantized)
        return cpu.int4_linear_wo(x, self.packed, self.scale, self.minimum, self.in_features,
                                  checked=True)


@dataclass(frozen=True)
class Int8WeightOnly:
    """A weight-only int8 checkpoint's weight (W8A16): activations stay float; weights
    `scale * code` rounded to the scale's dtype (kernels/cpu.py int8_linear_wo)."""

    rows: torch.Tensor  # [N, Kp] int8, zero past K (plain rows, not the VNNI packing)
    scale: torch.Tensor  # [N] in the checkpoint's dtype
    in_features: int  # K
    dequantized: torch.Tensor | None = None  # [N, K] compute dtype: torch fallback only

    def __post_init__(self) -> None:
        if self.dequantized is None:
            cpu.check_int8_wo_weight(self.rows, self.scale, self.in_features)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:  # [M, K] -> [M, N]
        if self.dequantized is not None:
            return F.linear(x, self.dequantized)
        return cpu.int8_linear_wo(x, self.rows, self.scale, self.in_features, checked=True)


@dataclass(frozen=True)
class Fp8Weight:
    """A pre-quantized FP8 checkpoint's weight on a GPU with FP8 products (kernels/fp8.py)."""

    weight: torch.Tensor  # [N, K] float8_e4m3fn
    scale: torch.Tensor  # [N] float32

    def matmul(self, x: torch.Tensor) -> torch.Tensor:  # [M, K] -> [M, N]
        return fp8.fp8_linear(x, self.weight, self.scale)


QuantizedWeight = Int8Weight | Int4Weight
WeightOnlyForm = Int4WeightOnly | Int8WeightOnly  # a weight-only checkpoint's (prequantized.py)
# What a linear multiplies with in place of its plain weight, when it has one.
WeightForm = Int8Weight | Int4Weight | Int4WeightOnly | Int8WeightOnly | Fp8Weight | DenseForm


def _pad_k(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] float32 -> [N, Kp] with zero columns up to the kernels' multiple of 32."""
    k = weight.shape[1]
    return F.pad(weight.detach().float(), (0, cpu.padded_k(k) - k))


def quantize_int8(weight: torch.Tensor, dtype: torch.dtype | None = None,
                  native: bool = False) -> Int8Weight:
    """weight [N, K] (any float dtype) -> per-output-channel symmetric int8; `dtype` is the
    compute dtype (the torch fallback keeps its scale in it); `native`: laid out for the
    native kernels, else for the torch fallback."""
    w = _pad_k(weight)
    scale = w.abs().amax(dim=1).clamp_(min=1e-12).div_(127.0)
    rows = torch.round(w / scale.unsqueeze(1)).clamp_(-127, 127).to(torch.int8)
    return int8_weight(rows, scale, weight.shape[1], dtype or weight.dtype, native)


def int8_weight(rows: torch.Tensor, scale: torch.Tensor, k: int, dtype: torch.dtype,
                native: bool) -> Int8Weight:
    """Codes [N, Kp] int8 (zero past K) and scale [N] float32 laid out for the native
    kernels (`native`) or the torch fallback (compute `dtype`)."""
    if native:
        return Int8Weight(cpu.pack_int8_vnni(rows) if cpu.int8_vnni_supported() else rows,
                          scale, k)
    rows = rows[:, :k].contiguous()
    return Int8Weight(rows, scale, k, rows.t().contiguous(), scale.to(dtype))


def quantize_int4(weight: torch.Tensor, dtype: torch.dtype | None = None,
                  native: bool = False, weight_only_prefill: bool = False) -> Int4Weight:
    """weight [N, K] -> Q4_1 groups of 32 along K: float16 scale = (max - min) / 15 and
    minimum (as GGUF stores them), codes rounded against the stored values; `native` as for
    quantize_int8; `weight_only_prefill` (native only): bfloat16 prompt rows through the
    weight-only products (`Int4Weight.prefill_minimum`)."""
    n, k = weight.shape
    groups = _pad_k(weight).view(n, -1, cpu.GROUP_SIZE)  # [N, G, 32]
    minimum = groups.amin(dim=-1).half().float()
    scale = ((groups.amax(dim=-1) - minimum) / 15.0).half().float()
    inverse = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
    codes = torch.round((groups - minimum.unsqueeze(-1)) * inverse.unsqueeze(-1)).clamp_(0, 15)
    form = int4_weight(codes.to(torch.uint8).view(n, -1), scale.half(), minimum.half(), k,
                       dtype or weight.dtype, native)
    if native and weight_only_prefill:
        return replace(form, prefill_minimum=minimum.contiguous())  # float16 values, exact
    return form


def int4_weight(codes: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor, k: int,
                dtype: torch.dtype, native: bool) -> Int4Weight:
    """Codes [N, Kp] uint8 0..15 (any value past K), scale and minimum [N, Kp / 32] float16
    packed two codes a byte for the native kernels (`native`), or with the dequantized
    weights in the compute `dtype` for the torch fallback."""
    n = codes.shape[0]
    packed = cpu.pack_int4(codes)
    if native:
        return Int4Weight(packed, scale, minimum, k)
    groups = codes.view(n, -1, cpu.GROUP_SIZE)  # [N, G, 32]
    dequantized = (groups.float() * scale.float().unsqueeze(-1)
                   + minimum.float().unsqueeze(-1)).view(n, -1)
    return Int4Weight(packed, scale, minimum, k, dequantized[:, :k].to(dtype).contiguous())


def int4_weight_only(codes: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor, k: int,
                     dtype: torch.dtype, native: bool) -> Int4WeightOnly:
    """Codes [N, Kp] uint8 0..15, scale [N, Kp / 32] (checkpoint dtype), minimum [N, Kp / 32]
    float32 packed for the native kernels, or with the dequantized weights in the compute
    `dtype` for the torch fallback (the same weights: kernels/reference.py's dequantization)."""
    packed = cpu.pack_int4(codes)
    if native:
        return Int4WeightOnly(packed, scale, minimum, k)
    dequantized = reference.dequantize_int4_wo(packed, scale, minimum, k, dtype)
    return Int4WeightOnly(packed, scale, minimum, k, dequantized.contiguous())


def int8_weight_only(rows: torch.Tensor, scale: torch.Tensor, k: int, dtype: torch.dtype,
                     native: bool) -> Int8WeightOnly:
    """Codes [N, Kp] int8 (zero past K), scale [N] (checkpoint dtype), as int4_weight_only."""
    if native:
        return Int8WeightOnly(rows, scale, k)
    return Int8WeightOnly(rows, scale, k,
                          reference.dequantize_int8_wo(rows, scale, k, dtype).contiguous())


def quantize(weight: torch.Tensor, method: str, dtype: torch.dtype | None = None,
             native: bool = False, weight_only_prefill: bool = False) -> QuantizedWeight:
    """`weight_only_prefill`: int4's bfloat16 prompt rows through the weight-only products
    (`KernelChoice.int4_prefill`); int8 keeps its tile (VNNI dots beat float activations)."""
    if method == "int4":
        return quantize_int4(weight, dtype, native, weight_only_prefill)
    if method == "int8":
        return quantize_int8(weight, dtype, native)
    raise ValueError(f"unknown quantization {method!r}; known: {QUANTIZATIONS}")


def linear(x: torch.Tensor, weight: torch.Tensor, form: WeightForm | None,
           bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] -> [..., N]: the product of a layer, through its quantized or packed form if
    it has one (the bias added after the product, as models/fused_decode.py does too)."""
    if form is None:
        return F.linear(x, weight, bias)
    shape = x.shape
    y = form.matmul(x.reshape(-1, shape[-1]))
    if bias is not None:
        y = y + bias
    return y.view(*shape[:-1], y.shape[-1])


def quantize_model(model: torch.nn.Module, method: str, dtype: torch.dtype | None = None,
                   native: bool = False, weight_only_prefill: bool = False) -> int:
    """Quantize every layer that knows how (a `quantize(method, dtype, native,
    weight_only_prefill)` method); returns how many did. `dtype`: the compute dtype the model
    runs in (default: each weight's own); `native`: for the native kernels
    (`KernelChoice.matmul == "native"`); `weight_only_prefill`: int4's bfloat16 prompt rows
    through the weight-only products (`KernelChoice.int4_prefill == "weight_only"`)."""
    if method not in QUANTIZATIONS:
        raise ValueError(f"unknown quantization {method!r}; known: {QUANTIZATIONS}")
    quantizers = [q for q in (getattr(m, "quantize", None) for m in model.modules())
                  if callable(q)]
    for quantize in quantizers:
        quantize(method, dtype, native, weight_only_prefill)
    return len(quantizers)
