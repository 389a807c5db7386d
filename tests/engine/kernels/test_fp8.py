"""kernels/fp8.py's FP8 product (`torch._scaled_mm`, per-token activation and per-channel weight
scales) against its float64 twin, `reference.fp8_linear`: on CPU, where torch runs
`_scaled_mm` too, and on a CUDA device with FP8 products (marked gpu)."""

from __future__ import annotations

import pytest
import torch
from kvasir_engine.kernels import fp8
from kvasir_engine.kernels import reference as ref


def _weight(n: int, k: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    w = torch.randn(n, k, generator=g)
    scale = w.abs().amax(dim=1) / fp8.FP8_MAX
    return (w / scale.unsqueeze(1)).to(torch.float8_e4m3fn), scale


def _devices() -> list[str]:
    cuda = torch.cuda.is_available() and fp8.fp8_supported(torch.device("cuda"))
    return ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
        not cuda, reason="needs a CUDA device with FP8 products")])]


@pytest.mark.parametrize("device", _devices())
@pytest.mark.parametrize("rows", [1, 5, 33])
@pytest.mark.parametrize("n,k", [(16, 16), (48, 64), (128, 96)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_linear_matches_its_twin(device: str, rows: int, n: int, k: int,
                                     dtype: torch.dtype) -> None:
    if device == "cuda" and dtype == torch.float32:
        pytest.skip("cuBLASLt's row-wise scaled products write bfloat16")
    g = torch.Generator().manual_seed(rows * n + k)
    weight, scale = _weight(n, k, g)
    x = torch.randn(rows, k, generator=g).to(dtype)
    expected = ref.fp8_linear(x, weight, scale).double()
    out = fp8.fp8_linear(x.to(device), weight.to(device), scale.to(device)).cpu()
    assert out.shape == (rows, n) and out.dtype == dtype
    # The same codes on both sides: what differs is the order of float32 sums, and bfloat16's
    # rounding of the result (2^-8 relative).
    tolerance = 1e-5 if dtype == torch.float32 else 2.0 ** -8
    assert (out.double() - expected).abs().max() <= tolerance * expected.abs().max() + 1e-6


def test_fp8_linear_checks_its_operands() -> None:
    weight, scale = _weight(16, 32, torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="x must have shape"):
        fp8.fp8_linear(torch.randn(2, 16), weight, scale)
    with pytest.raises(ValueError, match="weight must have dtype|weight .*dtype"):
        fp8.fp8_linear(torch.randn(2, 32), weight.float(), scale)
    assert fp8.fits(weight) and not fp8.fits(torch.empty(16, 24))
    assert not fp8.fp8_supported(torch.device("cpu"))
