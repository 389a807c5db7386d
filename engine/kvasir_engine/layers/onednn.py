"""Unquantized bfloat16 linears on CPU through oneDNN with weights packed once at load.

`F.linear` on a bfloat16 CPU tensor goes to oneDNN too, but hands it the weight in PyTorch's
plain [N, K] layout, and oneDNN reorders it into its blocked AMX/AVX-512 layout on every call:
for the small products of a decode step that copy costs more than the product (measured on a
2-core Xeon with AMX, the 121 products of a SmolLM2 decode step: 20-21 ms plain, 13-16 ms
packed, at 1 to 16 rows; the same at 512 rows). Packing once, with
`mkldnn._reorder_linear_weight`, and multiplying with `mkldnn._linear_pointwise` (the pair
PyTorch's own inductor uses for CPU linears) gives bit-identical results to `F.linear`.

Whether the process packs for oneDNN is its `KernelChoice.dense_matmul` (kernels/choice.py);
layers/dense.py packs each layer in the form chosen.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# The row count oneDNN is told to expect when it packs (a hint to its blocking: any count
# works, and 1 to 512 rows ran within noise of each other with any of the hints tried).
PACK_ROWS_HINT = 16


@dataclass(frozen=True)
class OneDnnWeight:
    packed: torch.Tensor  # [N, K] bfloat16 in oneDNN's blocked layout (an mkldnn tensor)
    in_features: int  # K

    @classmethod
    def pack(cls, weight: torch.Tensor) -> OneDnnWeight:
        if weight.dtype != torch.bfloat16 or weight.device.type != "cpu" or weight.dim() != 2:
            raise ValueError(f"oneDNN packing takes a 2-D bfloat16 CPU weight, got "
                             f"{weight.dtype} {tuple(weight.shape)} on {weight.device}")
        packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(),
                                                         PACK_ROWS_HINT)
        return cls(packed, weight.shape[1])

    def matmul(self, x: torch.Tensor) -> torch.Tensor:  # [M, K] -> [M, N]
        result: torch.Tensor = torch.ops.mkldnn._linear_pointwise(
            x.contiguous(), self.packed, None, "none", [], "")
        return result
