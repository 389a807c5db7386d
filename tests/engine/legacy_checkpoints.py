"""AutoAWQ and AutoGPTQ checkpoints (qweight / qzeros / scales / g_idx) of a tiny random Llama.

AWQ: packed by the real library, AutoAWQ 0.2.9's `WQLinear_GEMM.from_linear` (pure PyTorch,
installs without another torch), from scales and zero points computed as its
`AwqQuantizer.pseudo_quantize_tensor` computes them (round-to-nearest, no activation-aware
search: that needs calibration and changes only the scales); its own `dequantize_gemm` gives
the reference weights.

GPTQ: no library that writes the layout installs here without building CUDA extensions
(auto-gptq 0.7.1 builds from source; GPTQModel pulls numpy 2.2 and torchao), so the test writes
it itself, following AutoGPTQ's `QuantLinear.pack` (qlinear_cuda_old.py, checkpoint_format
"gptq"): qweight [K / 8, N] int32 with input 8r + i in bits 4i of row r, qzeros [K / g, N / 8]
with column 8c + i in bits 4i of column c and each zero stored minus one, float16 scales
[K / g, N], g_idx [K] = k // g. Symmetric, as GPTQ checkpoints almost always are (zero 8:
stored 7, clear of the v1 format's overflow of a zero of 0).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from helpers import write_checkpoint

_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _group_params(weight, group_size: int, symmetric: bool):  # type: ignore[no-untyped-def]
    """[N, K] -> (scales, zeros) [N, K / g]: AutoAWQ's min / max rule, or GPTQ's symmetric one."""
    import torch

    w = weight.float().view(weight.shape[0], -1, group_size)
    if symmetric:
        scales = (w.abs().amax(-1) / 7.5).clamp(min=1e-5)
        return scales.half().float(), torch.full_like(scales, 8.0)
    lo, hi = w.amin(-1), w.amax(-1)
    scales = ((hi - lo).clamp(min=1e-5) / 15).half().float()
    zeros = (-torch.round(lo / scales)).clamp(0, 15)
    return scales, zeros


def _codes(weight, scales, zeros, group_size: int):  # type: ignore[no-untyped-def]
    """[N, K] codes 0..15 of `weight` on the groups' grids."""
    import torch

    s = scales.repeat_interleave(group_size, dim=1)
    z = zeros.repeat_interleave(group_size, dim=1)
    return (torch.round(weight.float() / s) + z).clamp(0, 15)


def write_legacy_checkpoint(directory: Path, method: str, group_size: int = 32,
                            **overrides: Any) -> dict[str, Any]:
    """A tiny random Llama in `directory` as `method` ("awq" | "gptq") int4; returns
    {linear name: its reference float32 weight [N, K]}, as the format dequantizes it."""
    from safetensors.torch import load_file, save_file

    write_checkpoint(directory, "llama", shard=False, **overrides)
    tensors = load_file(str(directory / "model.safetensors"))
    reference: dict[str, Any] = {}
    for name in [n for n in tensors if n.rsplit(".", 2)[-2] in _LINEARS]:
        module = name.removesuffix(".weight")
        weight = tensors.pop(name).float()
        if method == "awq":
            parts, reference[module] = _awq(weight, group_size)
        else:
            parts, reference[module] = _gptq(weight, group_size)
        tensors.update({f"{module}.{part}": t.contiguous() for part, t in parts.items()})
    save_file(tensors, str(directory / "model.safetensors"))
    config_file = directory / "config.json"
    config = json.loads(config_file.read_text())
    config["quantization_config"] = (
        {"quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": True,
         "version": "gemm", "modules_to_not_convert": None} if method == "awq" else
        {"quant_method": "gptq", "bits": 4, "group_size": group_size, "desc_act": False,
         "sym": True, "checkpoint_format": "gptq", "static_groups": False})
    config_file.write_text(json.dumps(config))
    return reference


def _awq(weight, group_size: int):  # type: ignore[no-untyped-def]
    import torch
    from awq.modules.linear.gemm import WQLinear_GEMM
    from awq.utils.packing_utils import dequantize_gemm

    scales, zeros = _group_params(weight, group_size, symmetric=False)  # [N, G]
    on_grid = ((_codes(weight, scales, zeros, group_size)
                - zeros.repeat_interleave(group_size, dim=1))
               * scales.repeat_interleave(group_size, dim=1))
    linear = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False)
    linear.weight.data = on_grid.half()
    packed = WQLinear_GEMM.from_linear(linear, 4, group_size, scales=scales.t().half(),
                                       zeros=zeros.t().contiguous())
    parts = {"qweight": packed.qweight, "qzeros": packed.qzeros, "scales": packed.scales}
    return parts, dequantize_gemm(packed.qweight, packed.qzeros, packed.scales, 4,
                                  group_size).t().float()


def _pack_rows(values):  # type: ignore[no-untyped-def]
    """[R, C] values 0..15 -> [R / 8, C] int32: row 8r + i in bits 4i of row r."""
    import torch

    v = values.to(torch.int64).view(-1, 8, values.shape[1])
    shifts = (torch.arange(8) * 4).view(1, 8, 1)
    words = (v << shifts).sum(1)  # 0 .. 2^32 - 1
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def _gptq(weight, group_size: int):  # type: ignore[no-untyped-def]
    import torch

    scales, zeros = _group_params(weight, group_size, symmetric=True)  # [N, G]
    codes = _codes(weight, scales, zeros, group_size)  # [N, K]
    parts = {"qweight": _pack_rows(codes.t()),  # [K / 8, N]
             "qzeros": _pack_rows(zeros - 1).t(),  # [G, N / 8]
             "scales": scales.t().half(),  # [G, N]
             "g_idx": torch.arange(weight.shape[1], dtype=torch.int32) // group_size}
    dequantized = (codes - zeros.repeat_interleave(group_size, dim=1)) \
        * scales.repeat_interleave(group_size, dim=1)
    return parts, dequantized
