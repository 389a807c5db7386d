"""SwiGLU's gate: silu(gate) * up over the merged [gate | up] projection output.

With `impl="native"` (from the process's `KernelChoice`: x86 CPUs with the native kernels of
kernels/cpu.py, float32/bfloat16) it is one call instead of three operator calls (chunk, silu,
mul) and an intermediate; the torch code below is the reference and the path everywhere else.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvasir_engine.kernels import cpu


class SiluAndMul(nn.Module):
    def __init__(self, impl: str = "torch"):
        super().__init__()
        if impl not in ("torch", "native"):
            raise ValueError(f"SiluAndMul impl must be torch or native, got {impl!r}")
        self.is_native = impl == "native"

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, 2 * I] -> [T, I]
        if self.is_native:
            return cpu.silu_and_mul(x)
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up
