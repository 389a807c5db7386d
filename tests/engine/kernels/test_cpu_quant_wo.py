"""The weight-only products (cpu_quant_wo.cpp: int4 / int8 weights times float activations)
against their twins in kernels/reference.py.

Both sides multiply the same dequantized weights (the product exact, rounded to the scale's
dtype, then to bfloat16 for bfloat16 activations) and sum in float32, in different orders, so
float32 agrees to summation rounding (rtol 1e-5 of the row's magnitude) and bfloat16 to one
rounding of the output. float32 rows and up to 16 bfloat16 ones take the streaming kernel,
more bfloat16 ones the chunked one (dequantized chunks through at::mm); K is not always a
multiple of 32; N spans several chunks and threads; scales in each dtype a checkpoint stores.
"""

from __future__ import annotations

import pytest
import torch
from kvasir_engine.kernels import cpu
from kvasir_engine.kernels import reference as ref

pytestmark = pytest.mark.skipif(not cpu.available(),
                                reason="native CPU kernels need x86-64 with AVX2 and a compiler")

ROWS = (1, 2, 3, 5, 8, 9, 16, 64, 300)
WIDTHS = ((7, 100), (70, 576), (300, 1000))  # (N, K): K not a multiple of 32 but 576


def _int4_case(m: int, n: int, k: int, scale_dtype: torch.dtype, seed: int,
               ) -> tuple[torch.Tensor, ...]:
    """Codes, scales in `scale_dtype` and minima -scale * (8 + zp) (float32, exact), as a
    compressed-tensors checkpoint with zero points gives them."""
    g = torch.Generator().manual_seed(seed)
    groups = cpu.padded_k(k) // 32
    packed = torch.randint(0, 256, (n, groups * 16), generator=g, dtype=torch.uint8)
    scale = (torch.rand(n, groups, generator=g) * 0.02 + 0.001).to(scale_dtype)
    zero = torch.randint(-8, 8, (n, groups), generator=g).float()
    minimum = -scale.float() * (8 + zero)
    return torch.randn(m, k, generator=g), packed, scale, minimum


def _int8_case(m: int, n: int, k: int, scale_dtype: torch.dtype, seed: int,
               ) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    rows = torch.randint(-128, 128, (n, cpu.padded_k(k)), generator=g, dtype=torch.int8)
    rows[:, k:] = 0
    scale = (torch.rand(n, generator=g) * 0.002 + 0.0001).to(scale_dtype)
    return torch.randn(m, k, generator=g), rows, scale


def _close(got: torch.Tensor, want: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    """float32: within summation rounding, relative to sum |x| |w| of each output;
    bfloat16: within one rounding of the output (both round a float32 sum once)."""
    assert got.dtype == want.dtype == x.dtype and got.shape == want.shape
    if x.dtype == torch.float32:
        magnitude = x.abs().double() @ w.abs().double().t()
        assert ((got.double() - want.double()).abs() <= 1e-5 * magnitude + 1e-30).all()
    else:
        torch.testing.assert_close(got.float(), want.float(), rtol=2 ** -7, atol=1e-3)


def _products(method: str, m: int, n: int, k: int, scale_dtype: torch.dtype, dtype: torch.dtype,
              seed: int) -> tuple[torch.Tensor, ...]:
    """(x, kernel output, twin output, the dequantized weights) of one case."""
    if method == "int4":
        x, packed, scale, minimum = _int4_case(m, n, k, scale_dtype, seed)
        x = x.to(dtype)
        return (x, cpu.int4_linear_wo(x, packed, scale, minimum, k),
                ref.int4_linear_wo(x, packed, scale, minimum, k),
                ref.dequantize_int4_wo(packed, scale, minimum, k, dtype))
    x, rows, scale = _int8_case(m, n, k, scale_dtype, seed)
    x = x.to(dtype)
    return (x, cpu.int8_linear_wo(x, rows, scale, k), ref.int8_linear_wo(x, rows, scale, k),
            ref.dequantize_int8_wo(rows, scale, k, dtype))


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", ROWS)
@pytest.mark.parametrize("method", ["int4", "int8"])
def test_weight_only_products_match_twin(method: str, m: int, dtype: torch.dtype,
                                         threads: int) -> None:
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for index, (n, k) in enumerate(WIDTHS):
            for scale_dtype in (torch.bfloat16, torch.float16, torch.float32):
                x, got, want, w = _products(method, m, n, k, scale_dtype, dtype,
                                            seed=m + 97 * index)
                _close(got, want, x, w)
    finally:
        torch.set_num_threads(previous)


def test_weights_are_the_library_dequantization_rounded_to_the_scale_dtype() -> None:
    """One activation row of a unit vector picks a weight column out: the kernel's weights
    are exactly `scale * code + minimum` rounded to the scale's dtype (bfloat16 here, as
    compressed-tensors computes `(q - zp) * scale`), not the float32 product."""
    _, packed, scale, minimum = _int4_case(1, 40, 64, torch.bfloat16, seed=3)
    codes = ref.unpack_int4(packed).float().view(40, 2, 32)
    exact = codes * scale.float().unsqueeze(-1) + minimum.unsqueeze(-1)  # [N, G, 32]
    library = exact.bfloat16().float().view(40, 64)
    assert not torch.equal(library, exact.view(40, 64))  # the rounding is not a no-op here
    for j in (0, 5, 17, 31, 32, 63):
        x = torch.zeros(1, 64)
        x[0, j] = 1.0
        got = cpu.int4_linear_wo(x, packed, scale, minimum, 64)
        assert torch.equal(got[0], library[:, j])
        assert torch.equal(cpu.int4_linear_wo(x.repeat(9, 1), packed, scale, minimum, 64)[8],
                           library[:, j])


@pytest.mark.parametrize(("dtype", "m"), [(torch.float32, 300), (torch.bfloat16, 16)])
def test_streamed_rows_do_not_depend_on_the_batch(dtype: torch.dtype, m: int) -> None:
    """Streamed rows (float32 always, bfloat16 up to 16) sum in one order whatever the other
    rows: a row's output is the same alone, in a decode pair or in the whole batch."""
    x, packed, scale, minimum = _int4_case(m, 70, 600, torch.bfloat16, seed=8)
    x8, rows, scale8 = _int8_case(m, 70, 600, torch.bfloat16, seed=8)
    x, x8 = x.to(dtype), x8.to(dtype)
    batch4 = cpu.int4_linear_wo(x, packed, scale, minimum, 600)
    batch8 = cpu.int8_linear_wo(x8, rows, scale8, 600)
    for r in (0, 1, 5, m - 2):
        assert torch.equal(cpu.int4_linear_wo(x[r:r + 1], packed, scale, minimum, 600),
                           batch4[r:r + 1])
        assert torch.equal(cpu.int4_linear_wo(x[r:r + 2], packed, scale, minimum, 600),
                           batch4[r:r + 2])
        assert torch.equal(cpu.int8_linear_wo(x8[r:r + 1], rows, scale8, 600), batch8[r:r + 1])


@pytest.mark.parametrize("m", [1, 64])
def test_runs_under_inference_mode(m: int) -> None:
    """As the engine calls it: bfloat16 products of more than 16 rows write their output from
    the worker threads, which must share the caller's inference mode."""
    x, packed, scale, minimum = _int4_case(m, 300, 1000, torch.bfloat16, seed=9)
    x8, rows, scale8 = _int8_case(m, 300, 1000, torch.bfloat16, seed=9)
    with torch.inference_mode():
        for dtype in (torch.float32, torch.bfloat16):
            got = cpu.int4_linear_wo(x.to(dtype), packed, scale, minimum, 1000)
            assert torch.equal(got, cpu.int4_linear_wo(x.to(dtype).clone(), packed, scale,
                                                       minimum, 1000))
            assert cpu.int8_linear_wo(x8.to(dtype), rows, scale8, 1000).shape == (m, 300)


def test_zero_rows() -> None:
    _, packed, scale, minimum = _int4_case(1, 7, 100, torch.bfloat16, seed=4)
    assert cpu.int4_linear_wo(torch.zeros(0, 100), packed, scale, minimum, 100).shape == (0, 7)


def test_bad_arguments_are_refused_with_a_clear_error() -> None:
    x, packed, scale, minimum = _int4_case(2, 7, 100, torch.bfloat16, seed=6)
    with pytest.raises(ValueError, match="packed"):
        cpu.int4_linear_wo(x, packed[:, :8].contiguous(), scale, minimum, 100)
    with pytest.raises(ValueError, match="minimum"):
        cpu.int4_linear_wo(x, packed, scale, minimum.half(), 100)
    with pytest.raises(ValueError, match="scale"):
        cpu.int4_linear_wo(x, packed, scale.t().contiguous(), minimum, 100)
    with pytest.raises(RuntimeError, match="x must be"):
        cpu.int4_linear_wo(x[:, :50], packed, scale, minimum, 100)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        cpu.int4_linear_wo(x.half(), packed, scale, minimum, 100)
    with pytest.raises(RuntimeError, match="float32, bfloat16 or float16"):
        torch.ops.kvasir_cpu.int4_linear_wo(x, packed, scale.double(), minimum, 100)
    x8, rows, scale8 = _int8_case(2, 7, 100, torch.float32, seed=7)
    with pytest.raises(ValueError, match="rows"):
        cpu.int8_linear_wo(x8, rows[:, :100].contiguous(), scale8, 100)
    with pytest.raises(ValueError, match="scale"):
        cpu.int8_linear_wo(x8, rows, scale8[:3], 100)
    with pytest.raises(RuntimeError, match="Kp = "):
        torch.ops.kvasir_cpu.int8_linear_wo(x8, rows, scale8, 40)
