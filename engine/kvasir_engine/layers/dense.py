"""Unquantized bfloat16 linears on CPU with their weights packed once at load, in one of two
forms (`KernelChoice.dense_matmul`, kernels/choice.py):

- "onednn": `OneDnnWeight` (layers/onednn.py), oneDNN's blocked layout, multiplied by oneDNN;
  hosts with AMX (whose tiles oneDNN uses) or without AVX512-BF16;
- "native": `Bf16PairWeight`, the layout of kernels/csrc/cpu_bf16.cpp, multiplied with
  AVX512-BF16 dot products. On a 2-core AVX512-BF16 EPYC without AMX, the 120 products of a
  SmolLM2 decode step, cold, took 5.8 ms at 16 rows against oneDNN's 8.5 (4.5 against 6.4 at
  one row): each weight is read once, as its prefetched stream arrives, for every row of the
  step. At prefill sizes (128 to 2048 rows) the two run within ~5% of each other. Its sums run
  along K in order, one per output, whatever the row count: a row's output does not depend on
  the rows beside it (oneDNN's blocking, and so its sums, follow the row count).

The model runner calls `pack_model` once, after the cast to the compute dtype; each layer's
`pack(method)` calls `pack_dense`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvasir_engine.kernels import cpu
from kvasir_engine.layers.onednn import OneDnnWeight


@dataclass(frozen=True)
class Bf16PairWeight:
    packed: torch.Tensor  # [N / 16, K / 2, 32] bfloat16 (kernels/cpu.py pack_bf16_pairs)
    out_features: int  # N
    in_features: int  # K

    @staticmethod
    def fits(weight: torch.Tensor) -> bool:
        """Whether the layout takes this weight: [N, K] bfloat16 on the CPU, N a multiple of 16
        (models/fused_decode.py's kernel reads N off the packed blocks), K even (pairs)."""
        return (weight.dim() == 2 and weight.dtype == torch.bfloat16
                and weight.device.type == "cpu" and weight.shape[0] % cpu.BF16_BLOCK == 0
                and weight.shape[1] % 2 == 0)

    @classmethod
    def pack(cls, weight: torch.Tensor) -> Bf16PairWeight:
        if not cls.fits(weight):
            raise ValueError(f"the bfloat16 pair layout takes a 2-D bfloat16 CPU weight with N a "
                             f"multiple of {cpu.BF16_BLOCK} and K even, got {weight.dtype} "
                             f"{tuple(weight.shape)} on {weight.device}")
        n, k = weight.shape
        return cls(cpu.pack_bf16_pairs(weight), n, k)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:  # [M, K] -> [M, N]
        return cpu.bf16_linear(x, self.packed, self.out_features)


DenseForm = OneDnnWeight | Bf16PairWeight


def pack_dense(weight: torch.Tensor, method: str) -> DenseForm:
    """`weight` packed for `method` ("onednn" | "native"); a weight the pair layout does not
    take (a shard of an odd width, say) is packed for oneDNN instead."""
    if method == "native" and Bf16PairWeight.fits(weight):
        return Bf16PairWeight.pack(weight)
    if method not in ("native", "onednn"):
        raise ValueError(f"pack_dense: method must be native or onednn, got {method!r}")
    return OneDnnWeight.pack(weight)


def pack_model(model: torch.nn.Module, method: str) -> int:
    """Pack every layer that knows how (a `pack(method)` method); returns how many did."""
    packers = [p for p in (getattr(m, "pack", None) for m in model.modules()) if callable(p)]
    for pack in packers:
        pack(method)
    return len(packers)
