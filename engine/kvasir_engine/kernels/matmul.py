"""The one `tl.dot` the attention kernels use, with its precision choices in one place."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvasir_engine.kernels.choice import triton_interpreted


@triton.jit
def matmul(a, b, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """[M, K] @ [K, N] -> [M, N] float32 accumulate."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b, input_precision=PRECISION)


def dot_precision(dtype: torch.dtype) -> str:
    """float32 inputs get exact IEEE products; tf32 would cost ~1e-3 relative error."""
    return "ieee" if dtype == torch.float32 else "tf32"


def needs_upcast(dtype: torch.dtype) -> bool:
    """Triton 3.7's interpreter multiplies bfloat16 tiles wrongly (numpy has no bfloat16), so
    under TRITON_INTERPRET=1 bfloat16 products are done in float32; compiled kernels are untouched."""
    return dtype == torch.bfloat16 and triton_interpreted()
