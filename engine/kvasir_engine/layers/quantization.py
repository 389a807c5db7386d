"""Int8 weights for the CPU linears and LM head (`--quantization int8`).

Each weight matrix is quantized once, after loading, symmetrically per output channel:
`W[n, :] ~= scale[n] * q[n, :]` with q in [-127, 127]. Two kernels then read it, chosen per
call by the number of rows:

- few rows (single-sequence decode, memory-bound): `torch._weight_int8pack_mm`, int8 weights
  times activations in the compute dtype (W8A16): one op, half the bytes of bfloat16;
- more rows (batched decode, prefill, compute-bound): activations are quantized per row
  (per token) on the fly and multiplied with `torch._int_mm`, int8 x int8 -> int32 (W8A8,
  AVX-512 VNNI on x86), about twice the bfloat16 matmul rate on CPUs without AMX.

The int8 matrix is kept in both layouts ([N, K] for the first kernel, [K, N] for the second:
each is the layout its kernel reads fastest); together they weigh what the bfloat16 weight did,
which is freed. The relative error of a W8A8 product is about 1% (bfloat16: 0.2%), the usual
price of dynamic per-token int8.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvasir_engine.config import QUANTIZATIONS

# At or below this many rows a product is bound by reading the weights: use the W8A16 kernel.
_W8A16_MAX_ROWS = 4


@dataclass(frozen=True)
class Int8Weight:
    rows: torch.Tensor  # [N, K] int8
    cols: torch.Tensor  # [K, N] int8, contiguous
    scale: torch.Tensor  # [N] float32
    scale_compute: torch.Tensor  # [N] in the compute dtype, for the W8A16 kernel


def quantize_int8(weight: torch.Tensor) -> Int8Weight:
    """weight [N, K] (any float dtype) -> per-output-channel symmetric int8."""
    w = weight.detach().float()
    scale = w.abs().amax(dim=1).clamp_(min=1e-12).div_(127.0)
    rows = torch.round(w / scale.unsqueeze(1)).clamp_(-127, 127).to(torch.int8)
    return Int8Weight(rows, rows.t().contiguous(), scale, scale.to(weight.dtype))


def int8_linear(x: torch.Tensor, weight: Int8Weight,
                bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] -> x W^T (+ bias) [..., N] in x's dtype."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    if x2.shape[0] <= _W8A16_MAX_ROWS:
        y = torch._weight_int8pack_mm(x2, weight.rows, weight.scale_compute)
    else:
        # Per-row max |x| (exact in any dtype), then x * 127 / max rounded to int8.
        # (linalg.vector_norm(inf) is one op but ~10x slower on CPU than abs + amax.)
        row_max = x2.abs().amax(dim=1, keepdim=True).float().clamp_(min=1e-12)
        xq = torch.round(x2 * (127.0 / row_max)).to(torch.int8)
        y = torch._int_mm(xq, weight.cols)
        y = torch.mul(y, row_max.div_(127.0)).mul_(weight.scale).to(x.dtype)
    if bias is not None:
        y = y + bias
    return y.view(*shape[:-1], y.shape[-1])


def linear(x: torch.Tensor, weight: torch.Tensor, int8: Int8Weight | None,
           bias: torch.Tensor | None = None) -> torch.Tensor:
    """The product of a layer that may have been quantized: its int8 form when it has one."""
    if int8 is not None:
        return int8_linear(x, int8, bias)
    return F.linear(x, weight, bias)


def quantize_model(model: torch.nn.Module, method: str) -> int:
    """Quantize every layer that knows how (`quantize_int8()`); returns how many did."""
    if method not in QUANTIZATIONS:
        raise ValueError(f"unknown quantization {method!r}; known: {QUANTIZATIONS}")
    layers = [m for m in model.modules() if callable(getattr(m, "quantize_int8", None))]
    for layer in layers:
        layer.quantize_int8()
    return len(layers)
