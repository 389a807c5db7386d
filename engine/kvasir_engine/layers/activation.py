"""SwiGLU's gate: silu(gate) * up over the merged [gate | up] projection output.

On x86 CPUs with the native kernels (kernels/cpu.py) it is one call for float32/bfloat16 rows
instead of three operator calls (chunk, silu, mul) and an intermediate; the torch code below is
the reference and the path everywhere else.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvasir_engine.kernels import cpu


class SiluAndMul(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, 2 * I] -> [T, I]
        if cpu.takes_rows(x):
            return cpu.silu_and_mul(x)
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up
