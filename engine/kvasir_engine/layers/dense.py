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

Under --batch-invariant (docs/batch_invariance.md) the products whose sums follow the row
count, oneDNN's and `F.linear`'s, run as `FixedRowsWeight`: always `FIXED_ROWS` rows a call,
the last call padded with zero rows, so a row's sums are those of the same product whatever
came with it (methods "onednn_rows" and "torch_rows").

The model runner calls `pack_model` once, after the cast to the compute dtype; each layer's
`pack(method)` calls `pack_dense`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

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


# Rows of every product of a `FixedRowsWeight`: oneDNN's packing hint, and few enough that
# a decode step of one row pads little.
FIXED_ROWS = 16


@dataclass(frozen=True)
class FixedRowsWeight:
    """A product run FIXED_ROWS rows at a time (--batch-invariant), through oneDNN's packed
    weight or `F.linear` over the [N, K] weight itself."""

    inner: OneDnnWeight | torch.Tensor

    def matmul(self, x: torch.Tensor) -> torch.Tensor:  # [M, K] -> [M, N]
        num_rows = x.shape[0]
        padding = -num_rows % FIXED_ROWS
        if padding or num_rows == 0:
            x = torch.cat([x, x.new_zeros(padding or FIXED_ROWS, x.shape[1])])
        tiles = [self._product(x[start:start + FIXED_ROWS])
                 for start in range(0, x.shape[0], FIXED_ROWS)]
        return torch.cat(tiles)[:num_rows]

    def _product(self, x: torch.Tensor) -> torch.Tensor:
        if isinstance(self.inner, OneDnnWeight):
            return self.inner.matmul(x)
        return F.linear(x, self.inner)


DenseForm = OneDnnWeight | Bf16PairWeight | FixedRowsWeight
PACK_METHODS = ("native", "onednn", "onednn_rows", "torch_rows")


def pack_dense(weight: torch.Tensor, method: str) -> DenseForm:
    """`weight` packed for `method` (`PACK_METHODS`); a weight the pair layout does not take
    (a shard of an odd width, say) is packed for oneDNN instead."""
    if method not in PACK_METHODS:
        raise ValueError(f"pack_dense: method must be one of {PACK_METHODS}, got {method!r}")
    if method == "torch_rows":
        return FixedRowsWeight(weight.detach())
    if method == "onednn_rows":
        return FixedRowsWeight(OneDnnWeight.pack(weight))
    if method == "native" and Bf16PairWeight.fits(weight):
        return Bf16PairWeight.pack(weight)
    return OneDnnWeight.pack(weight)


def pack_model(model: torch.nn.Module, method: str) -> int:
    """Pack every layer that knows how (a `pack(method)` method); returns how many did."""
    packers = [p for p in (getattr(m, "pack", None) for m in model.modules()) if callable(p)]
    for pack in packers:
        pack(method)
    return len(packers)
