"""RMSNorm, computed in float32 whatever the activation dtype (as transformers' Llama does).

`impl` comes from the process's `KernelChoice` (kernels/choice.py), given at construction:
"triton" (the Triton attention backend on CUDA) runs the residual add and the norm as one fused
Triton kernel, one read and one write of the row instead of three round trips through memory;
"native" (x86 CPUs, float32/bfloat16 rows [T, H]) runs the same fusion as one call of
kernels/cpu.py; "torch", the code below, is the reference and the path everywhere else.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from kvasir_engine.kernels import cpu


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6, impl: str = "torch"):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.kernel: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = None
        if impl == "triton":
            # Imported here: triton is only needed (and only present) where kernels run.
            from kvasir_engine.kernels.rmsnorm import rms_norm

            self.kernel = rms_norm
        elif impl == "native":
            self.kernel = cpu.rms_norm
        elif impl != "torch":
            raise ValueError(f"RMSNorm impl must be torch, native or triton, got {impl!r}")

    def forward(self, x: torch.Tensor,
                residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (normed, new residual): with a residual, x + residual is normed and returned
        as the next residual, fusing the skip connection into the norm call."""
        if self.kernel is not None:
            return self.kernel(x, self.weight, self.eps, residual)
        if residual is not None:
            x = x + residual
        residual = x
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(dtype), residual
