"""oneDNN-packed bfloat16 linears (layers/onednn.py): the same numbers as `F.linear`, for every
row count a step may have, with and without a bias, and only for what they can take."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from kvasir_engine.layers.linear import ColumnParallelLinear
from kvasir_engine.layers.onednn import OneDnnWeight, pack_model
from kvasir_engine.layers.quantization import linear

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(),
                                reason="PyTorch built without oneDNN")


@pytest.mark.parametrize("rows", [1, 3, 16, 77, 512])
def test_packed_products_equal_f_linear(rows: int) -> None:
    g = torch.Generator().manual_seed(rows)
    weight = torch.randn(200, 96, generator=g).bfloat16()
    bias = torch.randn(200, generator=g).bfloat16()
    x = torch.randn(rows, 96, generator=g).bfloat16()
    form = OneDnnWeight.pack(weight)
    assert torch.equal(form.matmul(x), F.linear(x, weight))
    assert torch.equal(linear(x, weight, form, bias), F.linear(x, weight) + bias)
    assert torch.equal(linear(x.view(1, rows, 96), weight, form).view(rows, 200),
                       F.linear(x, weight))


def test_pack_model_swaps_the_weights_of_unquantized_linears() -> None:
    layer = ColumnParallelLinear(64, 32).bfloat16()
    torch.nn.init.normal_(layer.weight)
    plain = layer.weight.data.clone()
    x = torch.randn(5, 64).bfloat16()
    expected = layer(x)
    assert pack_model(torch.nn.Sequential(layer)) == 1
    assert isinstance(layer.quantized, OneDnnWeight) and layer.weight.numel() == 0
    assert torch.equal(layer(x), expected) and torch.equal(expected, F.linear(x, plain))


@pytest.mark.parametrize("weight", [torch.randn(8, 8), torch.randn(8).bfloat16()])
def test_only_2d_bfloat16_cpu_weights_are_packed(weight: torch.Tensor) -> None:
    with pytest.raises(ValueError, match="2-D bfloat16 CPU weight"):
        OneDnnWeight.pack(weight)
