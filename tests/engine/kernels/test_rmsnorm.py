"""Fused (residual +) RMSNorm against its twin."""

from __future__ import annotations

import pytest
import torch
from kernel_cases import DEVICE, DTYPES, assert_close, to_device
from kvasir_engine.kernels import reference as ref
from kvasir_engine.kernels.rmsnorm import rms_norm


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [64, 576, 1000])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_matches_twin(dtype: torch.dtype, hidden: int, with_residual: bool) -> None:
    gen = torch.Generator().manual_seed(hidden)
    x = torch.randn(7, hidden, generator=gen).to(dtype)
    weight = (1 + 0.1 * torch.randn(hidden, generator=gen)).to(dtype)
    residual = torch.randn(7, hidden, generator=gen).to(dtype) if with_residual else None
    expected, expected_residual = ref.rms_norm(x, weight, 1e-5, residual)
    args = to_device(x, weight) + ([to_device(residual)[0]] if residual is not None else [None])
    out, new_residual = rms_norm(args[0], args[1], 1e-5, args[2])
    assert_close(out, expected)
    assert_close(new_residual, expected_residual)


def test_rms_norm_rejects_bad_arguments() -> None:
    x = torch.randn(3, 64, device=DEVICE)
    with pytest.raises(ValueError, match="weight"):
        rms_norm(x, torch.ones(32, device=DEVICE), 1e-5)
    with pytest.raises(ValueError, match="residual"):
        rms_norm(x, torch.ones(64, device=DEVICE), 1e-5, x.half())
    with pytest.raises(ValueError, match="eps"):
        rms_norm(x, torch.ones(64, device=DEVICE), 0.0)
