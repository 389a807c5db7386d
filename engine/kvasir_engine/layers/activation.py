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

_NATIVE_DTYPES = (torch.float32, torch.bfloat16)


class SiluAndMul(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, 2 * I] -> [T, I]
        if x.device.type == "cpu" and x.dim() == 2 and x.dtype in _NATIVE_DTYPES \
                and cpu.available():
            return cpu.silu_and_mul(x)
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up
