"""Linear layers sharded for tensor parallelism, each parameter with its own `weight_loader`.

Column-parallel layers split the output features across ranks, row-parallel ones the input
features (then sum partial results across ranks). Each `weight_loader(param, loaded, shard_id)`
copies only this rank's slice of a full checkpoint tensor, so no rank ever holds the whole
model (docs/architecture.md, rule 9). At tp_size == 1 every layer is a plain `F.linear`, or with
`--quantization int8/int4` a quantized product (layers/quantization.py) on the same shard, or
unquantized bfloat16 on CPU a product with weights packed once (layers/dense.py).
"""

from __future__ import annotations

import torch
from torch import nn

from kvasir_engine.layers.dense import pack_dense
from kvasir_engine.layers.parallel import TensorParallelGroup, divide
from kvasir_engine.layers.quantization import WeightForm, linear, quantize


class LinearBase(nn.Module):
    def __init__(self, input_size: int, output_size: int, bias: bool, tp_dim: int | None,
                 tp_rank: int = 0, tp_size: int = 1, group: TensorParallelGroup | None = None):
        super().__init__()
        self.tp_dim, self.tp_rank, self.tp_size, self.group = tp_dim, tp_rank, tp_size, group
        self.weight = nn.Parameter(torch.empty(output_size, input_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader  # type: ignore[attr-defined]
        if bias:
            self.bias: nn.Parameter | None = nn.Parameter(torch.empty(output_size),
                                                          requires_grad=False)
            self.bias.weight_loader = self.weight_loader  # type: ignore[attr-defined]
        else:
            self.bias = None
        # The weight's quantized (--quantization) or packed (layers/dense.py) form, if any.
        self.quantized: WeightForm | None = None

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return linear(x, self.weight, self.quantized, bias)

    def pack(self, method: str) -> None:
        """Swap the cast bfloat16 weight for its packed form (layers/dense.py), free it
        (unquantized only)."""
        if self.quantized is None:
            self.quantized = pack_dense(self.weight.data, method)
            self.weight.data = self.weight.data.new_empty(0)

    def quantize(self, method: str, dtype: torch.dtype | None = None,
                 native: bool = False, weight_only_prefill: bool = False) -> None:
        """Swap the loaded weight for its quantized form (layers/quantization.py), free it."""
        self.quantized = quantize(self.weight.data, method, dtype, native, weight_only_prefill)
        self.weight.data = self.weight.data.new_empty(0)

    def _shard(self, loaded: torch.Tensor, dim: int, size: int, index: int) -> torch.Tensor:
        return loaded.narrow(dim, index * size, size)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor,
                      shard_id: str | int | None = None) -> None:
        if self.tp_dim is not None and (self.tp_dim == 0 or loaded.dim() > 1):
            size = param.shape[self.tp_dim]
            loaded = self._shard(loaded, self.tp_dim, size, self.tp_rank)
        _copy(param, loaded)


def _copy(target: torch.Tensor, loaded: torch.Tensor) -> None:
    if target.shape != loaded.shape:
        raise ValueError(f"weight shape mismatch: checkpoint {tuple(loaded.shape)}, "
                         f"model {tuple(target.shape)}")
    target.data.copy_(loaded)


class ReplicatedLinear(LinearBase):
    def __init__(self, input_size: int, output_size: int, bias: bool = False):
        super().__init__(input_size, output_size, bias, tp_dim=None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x, self.bias)


class ColumnParallelLinear(LinearBase):
    """y = x W^T with W split by output rows; each rank returns its slice of y."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False, tp_rank: int = 0,
                 tp_size: int = 1, group: TensorParallelGroup | None = None):
        super().__init__(input_size, divide(output_size, tp_size, "output size"), bias, 0,
                         tp_rank, tp_size, group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x, self.bias)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs in one matmul (gate and up of SwiGLU); shard_id = index."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False,
                 tp_rank: int = 0, tp_size: int = 1, group: TensorParallelGroup | None = None):
        self.output_sizes = output_sizes
        super().__init__(input_size, sum(output_sizes), bias, tp_rank, tp_size, group)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor,
                      shard_id: str | int | None = None) -> None:
        if not isinstance(shard_id, int):
            raise ValueError(f"merged linear needs an integer shard_id, got {shard_id!r}")
        offset = sum(self.output_sizes[:shard_id]) // self.tp_size
        size = self.output_sizes[shard_id] // self.tp_size
        target = param.data.narrow(0, offset, size)
        _copy(target, self._shard(loaded, 0, size, self.tp_rank))


class QKVParallelLinear(ColumnParallelLinear):
    """Q, K and V projections fused; heads split across ranks, K/V heads replicated when
    tp_size exceeds their count (GQA with few KV heads)."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int,
                 bias: bool = False, tp_rank: int = 0, tp_size: int = 1,
                 group: TensorParallelGroup | None = None):
        self.head_dim = head_dim
        self.num_heads = divide(num_heads, tp_size, "num_attention_heads")
        if tp_size >= num_kv_heads:
            self.num_kv_heads, self.kv_head_index = 1, tp_rank * num_kv_heads // tp_size
        else:
            self.num_kv_heads = divide(num_kv_heads, tp_size, "num_key_value_heads")
            self.kv_head_index = tp_rank * self.num_kv_heads
        output = (self.num_heads + 2 * self.num_kv_heads) * head_dim
        super().__init__(hidden_size, output * tp_size, bias, tp_rank, tp_size, group)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor,
                      shard_id: str | int | None = None) -> None:
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        if shard_id == "q":
            offset, size, start = 0, q_size, self.tp_rank * q_size
        elif shard_id == "k":
            offset, size, start = q_size, kv_size, self.kv_head_index * self.head_dim
        elif shard_id == "v":
            offset, size, start = q_size + kv_size, kv_size, self.kv_head_index * self.head_dim
        else:
            raise ValueError(f"QKV shard_id must be 'q', 'k' or 'v', got {shard_id!r}")
        _copy(param.data.narrow(0, offset, size), loaded.narrow(0, start, size))


class RowParallelLinear(LinearBase):
    """y = x W^T with W split by input columns; partial sums are all-reduced across ranks."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False, tp_rank: int = 0,
                 tp_size: int = 1, group: TensorParallelGroup | None = None):
        super().__init__(divide(input_size, tp_size, "input size"), output_size, bias, 1,
                         tp_rank, tp_size, group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The bias is added once, after the sum, not once per rank.
        y = self.matmul(x, self.bias if self.tp_rank == 0 else None)
        if self.tp_size > 1:
            if self.group is None:
                raise ValueError("RowParallelLinear with tp_size > 1 needs a group")
            y = self.group.all_reduce(y)
        return y
