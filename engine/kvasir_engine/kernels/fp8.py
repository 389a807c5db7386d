"""FP8 (e4m3) products of a pre-quantized FP8 checkpoint: `torch._scaled_mm` on GPUs with FP8
tensor cores (compute capability 8.9: Ada, Hopper and later), per-token dynamic activation
scales and per-channel weight scales, as compressed-tensors' FP8_DYNAMIC scheme defines them.

On CPU the weights are dequantized at load instead (layers/prequantized.py): CPUs have no FP8
products worth the name. `torch._scaled_mm` also runs on CPU, which is how the tests check this
launcher against its twin, `reference.fp8_linear`. Napkin maths on an H100: FP8 halves the
bytes a decode step reads per weight against bfloat16 (~3.35 TB/s: a 8B model's 8 GB of FP8
weights in ~2.4 ms a step instead of ~4.8) and doubles the dense FLOP/s of a prefill.
"""

from __future__ import annotations

import torch

from kvasir_engine.kernels.checks import check_tensor

FP8_MAX = 448.0  # the largest finite float8_e4m3fn
# cuBLASLt's FP8 products want K and N multiples of 16.
FP8_ALIGN = 16


def fp8_supported(device: torch.device) -> bool:
    """Whether `device` multiplies FP8 natively (a CUDA device of compute capability >= 8.9)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


def fits(weight: torch.Tensor) -> bool:
    """Whether an [N, K] weight has the shape the FP8 products take."""
    return weight.shape[0] % FP8_ALIGN == 0 and weight.shape[1] % FP8_ALIGN == 0


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (codes [M, K] float8_e4m3fn, scale [M, 1] float32), scale = row amax / 448."""
    scale = x.abs().amax(dim=1, keepdim=True).float().clamp_(min=1e-12) / FP8_MAX
    codes = (x.float() / scale).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return codes, scale


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [M, K] -> [M, N] in x's dtype; weight [N, K] float8_e4m3fn (row-major, so its
    transpose is the column-major operand cuBLASLt wants), scale [N] float32."""
    n, k = weight.shape
    check_tensor("x", x, (None, k), (torch.float32, torch.bfloat16, torch.float16))
    check_tensor("weight", weight, (n, k), (torch.float8_e4m3fn,))
    check_tensor("scale", scale, (n,), (torch.float32,))
    codes, x_scale = quantize_rows(x)
    result: torch.Tensor = torch._scaled_mm(codes, weight.t(), scale_a=x_scale,
                                            scale_b=scale.view(1, n), out_dtype=x.dtype)
    return result
