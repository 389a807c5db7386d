"""Packed bfloat16 linears (layers/dense.py): oneDNN's form gives the numbers of `F.linear`;
the AVX512-BF16 pair form gives float32 sums of exact products rounded once, for every row
count a step may have, each row's the same whatever rows run beside it; each form takes only
what it can, and `pack_dense` falls back to oneDNN for what the pairs cannot take. Under
--batch-invariant oneDNN's and `F.linear`'s products run in fixed tiles of rows, so a row's
output is its own there too."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from kvasir_engine.kernels import cpu
from kvasir_engine.layers.dense import Bf16PairWeight, FixedRowsWeight, pack_dense, pack_model
from kvasir_engine.layers.linear import ColumnParallelLinear
from kvasir_engine.layers.onednn import OneDnnWeight
from kvasir_engine.layers.quantization import linear

needs_onednn = pytest.mark.skipif(not torch.backends.mkldnn.is_available(),
                                  reason="PyTorch built without oneDNN")
needs_bf16_dot = pytest.mark.skipif(not cpu.bf16_dot_supported(),
                                    reason="the pair layout's products need AVX512-BF16")


@needs_onednn
@pytest.mark.parametrize("rows", [1, 3, 16, 77, 512])
def test_onednn_products_equal_f_linear(rows: int) -> None:
    g = torch.Generator().manual_seed(rows)
    weight = torch.randn(200, 96, generator=g).bfloat16()
    bias = torch.randn(200, generator=g).bfloat16()
    x = torch.randn(rows, 96, generator=g).bfloat16()
    form = OneDnnWeight.pack(weight)
    assert torch.equal(form.matmul(x), F.linear(x, weight))
    assert torch.equal(linear(x, weight, form, bias), F.linear(x, weight) + bias)
    assert torch.equal(linear(x.view(1, rows, 96), weight, form).view(rows, 200),
                       F.linear(x, weight))


def _exact(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The products summed in float64, rounded once to bfloat16."""
    return (x.double() @ weight.double().T).bfloat16()


@needs_bf16_dot
@pytest.mark.parametrize(("n", "k"), [(16, 2), (48, 96), (64, 576), (32, 1536)])
@pytest.mark.parametrize("rows", [1, 2, 7, 8, 9, 16, 17, 77, 130])
def test_pair_products_round_float32_sums_once(rows: int, n: int, k: int) -> None:
    """Column tiles (<= 16 rows), 8 x 2 tiles past them with a last tile of one block (n 48),
    past a 64-row block (130); each row equals its product alone, bit for bit."""
    g = torch.Generator().manual_seed(rows * 7 + n)
    weight = torch.randn(n, k, generator=g).bfloat16()
    x = torch.randn(rows, k, generator=g).bfloat16()
    form = Bf16PairWeight.pack(weight)
    out = form.matmul(x)
    assert out.shape == (rows, n) and out.dtype == torch.bfloat16
    # float32 sums against float64 ones: at most one bfloat16 step apart where they differ
    torch.testing.assert_close(out.float(), _exact(x, weight).float(), rtol=2**-7, atol=1e-6)
    for i in {0, rows // 2, rows - 1}:
        assert torch.equal(form.matmul(x[i:i + 1]), out[i:i + 1])
    assert torch.equal(form.matmul(x[:5]), out[:5])
    bias = torch.randn(n, generator=g).bfloat16()
    assert torch.equal(linear(x.view(1, rows, k), weight, form, bias).view(rows, n), out + bias)


@needs_bf16_dot
def test_pair_layout_refuses_what_it_cannot_take() -> None:
    for weight in (torch.randn(20, 8).bfloat16(), torch.randn(16, 7).bfloat16(),
                   torch.randn(16, 8), torch.randn(16).bfloat16()):
        assert not Bf16PairWeight.fits(weight)
        with pytest.raises(ValueError, match="pair layout takes"):
            Bf16PairWeight.pack(weight)
    form = Bf16PairWeight.pack(torch.randn(32, 8).bfloat16())
    with pytest.raises(RuntimeError, match="bf16_linear: w must be"):
        cpu.bf16_linear(torch.randn(3, 10).bfloat16(), form.packed, 32)  # K 10 against 8
    with pytest.raises(RuntimeError, match="bf16_linear: x must be"):
        cpu.bf16_linear(torch.randn(3, 8), form.packed, 32)


@needs_onednn
@needs_bf16_dot
def test_pack_dense_falls_back_to_onednn_where_pairs_do_not_fit() -> None:
    assert isinstance(pack_dense(torch.randn(32, 8).bfloat16(), "native"), Bf16PairWeight)
    assert isinstance(pack_dense(torch.randn(20, 8).bfloat16(), "native"), OneDnnWeight)
    assert isinstance(pack_dense(torch.randn(32, 8).bfloat16(), "onednn"), OneDnnWeight)
    with pytest.raises(ValueError, match="method must be one of"):
        pack_dense(torch.randn(32, 8).bfloat16(), "torch")


@needs_onednn
@pytest.mark.parametrize("method", ["onednn", "native"])
def test_pack_model_swaps_the_weights_of_unquantized_linears(method: str) -> None:
    if method == "native" and not cpu.bf16_dot_supported():
        pytest.skip("the pair layout's products need AVX512-BF16")
    layer = ColumnParallelLinear(64, 32).bfloat16()
    torch.nn.init.normal_(layer.weight)
    plain = layer.weight.data.clone()
    x = torch.randn(5, 64).bfloat16()
    expected = F.linear(x, plain)
    assert pack_model(torch.nn.Sequential(layer), method) == 1
    form = layer.quantized
    assert isinstance(form, OneDnnWeight if method == "onednn" else Bf16PairWeight)
    assert layer.weight.numel() == 0
    if method == "onednn":
        assert torch.equal(layer(x), expected)
    else:
        torch.testing.assert_close(layer(x).float(), _exact(x, plain).float(), rtol=2**-7,
                                   atol=1e-6)


@needs_onednn
@pytest.mark.parametrize("weight", [torch.randn(8, 8), torch.randn(8).bfloat16()])
def test_only_2d_bfloat16_cpu_weights_are_packed_for_onednn(weight: torch.Tensor) -> None:
    with pytest.raises(ValueError, match="2-D bfloat16 CPU weight"):
        OneDnnWeight.pack(weight)


@pytest.mark.parametrize("method", ["onednn_rows", "torch_rows"])
def test_fixed_rows_give_a_row_the_same_bits_whatever_its_neighbours(method: str) -> None:
    if method == "onednn_rows" and not torch.backends.mkldnn.is_available():
        pytest.skip("PyTorch built without oneDNN")
    g = torch.Generator().manual_seed(3)
    weight = torch.randn(576, 576, generator=g).bfloat16()
    form = pack_dense(weight, method)
    assert isinstance(form, FixedRowsWeight)
    rows = torch.randn(300, 576, generator=g).bfloat16()
    alone = torch.cat([form.matmul(rows[i:i + 1]) for i in range(0, 300, 37)])
    for count in (2, 16, 17, 300):
        batch = form.matmul(rows[:count])
        assert torch.equal(batch[:1], alone[:1]), count
    assert torch.equal(form.matmul(rows)[::37], alone)
    torch.testing.assert_close(form.matmul(rows).float(), F.linear(rows, weight).float(),
                               atol=5e-2, rtol=2e-2)
    assert form.matmul(rows[:0]).shape == (0, 576)
