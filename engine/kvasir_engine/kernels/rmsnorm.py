"""Fused RMSNorm, optionally with the residual add before it: one read and one write per row.

With a residual, h = x + residual is both normalised and returned (the next layer's residual),
so the add costs no extra round trip through memory. Statistics are in float32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvasir_engine.kernels.checks import FLOAT_DTYPES, check_last_dim_contiguous, check_tensor


@triton.jit
def _rms_norm_kernel(
    out_ptr, residual_out_ptr, x_ptr, residual_ptr, weight_ptr,
    stride_x, stride_r, stride_o, stride_ro,
    eps,
    HIDDEN: tl.constexpr, BLOCK: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < HIDDEN
    h = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        h += tl.load(residual_ptr + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(residual_out_ptr + row * stride_ro + cols,
                 h.to(residual_out_ptr.dtype.element_ty), mask=mask)
    inv_rms = 1.0 / tl.sqrt(tl.sum(h * h, 0) / HIDDEN + eps)
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (h * inv_rms * w).to(out_ptr.dtype.element_ty),
             mask=mask)


def rms_norm(
    x: torch.Tensor,  # [T, hidden]
    weight: torch.Tensor,  # [hidden]
    eps: float,
    residual: torch.Tensor | None = None,  # [T, hidden]
) -> tuple[torch.Tensor, torch.Tensor]:  # (normed, new residual); (normed, x) without one
    check_tensor("x", x, (None, None), FLOAT_DTYPES)
    num_tokens, hidden = x.shape
    check_tensor("weight", weight, (hidden,), FLOAT_DTYPES, x.device)
    check_last_dim_contiguous("x", x)
    check_last_dim_contiguous("weight", weight)
    if residual is not None:
        check_tensor("residual", residual, tuple(x.shape), (x.dtype,), x.device)
        check_last_dim_contiguous("residual", residual)
    if eps <= 0:
        raise ValueError(f"eps must be positive, got {eps}")
    out = torch.empty_like(x)
    residual_out = torch.empty_like(x) if residual is not None else x
    if num_tokens == 0:
        return out, residual_out
    _rms_norm_kernel[(num_tokens,)](
        out, residual_out, x, residual if residual is not None else x, weight,
        x.stride(0), residual.stride(0) if residual is not None else 0, out.stride(0),
        residual_out.stride(0),
        eps,
        HIDDEN=hidden, BLOCK=triton.next_power_of_2(hidden), HAS_RESIDUAL=residual is not None,
    )
    return out, residual_out
