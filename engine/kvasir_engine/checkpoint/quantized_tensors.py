"""A pre-quantized checkpoint's tensors, turned into the integer form our layers stage.

compressed-tensors stores a quantized Linear as several tensors (`weight_packed`,
`weight_scale`, `weight_zero_point`, `weight_shape`; or an int8 / FP8 `weight` with its
`weight_scale`). `convert_quantized` gathers each module's parts from the stream (they may sit
in different shards) and yields, under the module's own name, what layers/prequantized.py
stages and packs once for the native kernels (int4, int8), with no float copy of the weight,
or multiplies in FP8 on a GPU that can (dequantized at load elsewhere):

- int4 (`kernel == "int4"`): `.weight` codes [N, K] uint8 in 0..15 (the stored value + 8),
  `.weight_scale` [N, ceil(K / 32)] in the checkpoint's dtype and `.weight_minimum` the same
  in float32, one per group of 32 (`weight = scale * code + minimum`). compressed-tensors'
  `(q - zp) * scale` with q = code - 8 is `scale * code - scale * (8 + zp)`: the scale carries
  over as it is and `minimum = -scale * (8 + zp)`, exact in float32 (a scale's 8 or 11
  significant bits times a 5-bit integer). A checkpoint group of 32k weights repeats its scale
  over k of our groups;
- int8: `.weight` [N, K] int8 as stored, `.weight_scale` [N] in the checkpoint's dtype;
- FP8: `.weight` [N, K] float8_e4m3fn as stored, `.weight_scale` [N] float32.

Tensors of unquantized modules (norms, embeddings, an ignored LM head) pass through untouched.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from kvasir_engine.checkpoint.quant_config import (
    KERNEL_FP8,
    KERNEL_INT4,
    KERNEL_INT8,
    CheckpointQuantization,
)

TILE_GROUP = 32  # the int4 tile's group along K (kernels/cpu.py GROUP_SIZE)
# What each kernel's module needs from the file before it can be converted.
_PARTS = {
    KERNEL_INT4: ("weight_packed", "weight_scale", "weight_shape"),
    KERNEL_INT8: ("weight", "weight_scale"),
    KERNEL_FP8: ("weight", "weight_scale"),
}
# AutoGPTQ's and AutoAWQ's 4-bit modules; GPTQ's g_idx is optional (read when it came first).
LEGACY_STORAGES = ("gptq", "awq")
_LEGACY_PARTS = ("qweight", "qzeros", "scales")
# AutoAWQ's GEMM words hold columns 0, 2, 4, 6, 1, 3, 5, 7 of each eight, from the low bits up.
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
# Activation scales of static schemes and KV scales: nothing of ours reads them.
_QUANTIZED_DTYPES = (torch.int8, torch.float8_e4m3fn)
_DROPPED = ("input_scale", "input_zero_point", "output_scale", "k_scale", "v_scale")


def convert_quantized(weights: Iterator[tuple[str, torch.Tensor]],
                      quant: CheckpointQuantization) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint stream with each quantized module's parts replaced by the staged form."""
    legacy = quant.storage in LEGACY_STORAGES
    needed = _LEGACY_PARTS if legacy else _PARTS[quant.kernel] + (
        ("weight_zero_point",) if quant.kernel == KERNEL_INT4 and not quant.symmetric else ())
    optional = "g_idx" if legacy else "weight_zero_point"
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in weights:
        module, _, part = name.rpartition(".")
        if part in _DROPPED:
            continue
        # Which tensors are parts is read off the file: an int8 / FP8 `weight` by its dtype
        # (it may come before its scale), the others by name; the layers check the rest.
        is_part = (part in needed or part == optional) and (
            part != "weight" or tensor.dtype in _QUANTIZED_DTYPES)
        if not is_part:
            yield name, tensor
            continue
        parts = pending.setdefault(module, {})
        parts[part] = tensor
        if all(p in parts for p in needed):
            yield from _convert(module, pending.pop(module), quant)
    if pending:
        module, parts = next(iter(pending.items()))
        missing = sorted(set(needed) - set(parts))
        raise ValueError(f"checkpoint lacks {missing} of quantized module {module!r} "
                         f"({quant.describe()})")


def _convert(module: str, parts: dict[str, torch.Tensor], quant: CheckpointQuantization,
             ) -> Iterator[tuple[str, torch.Tensor]]:
    where = f"quantized module {module!r}"
    if quant.storage in LEGACY_STORAGES:
        codes, scale, minimum = legacy_tile_form(parts, quant, where)
        yield f"{module}.weight", codes
        yield f"{module}.weight_scale", scale
        yield f"{module}.weight_minimum", minimum
        return
    if quant.kernel == KERNEL_INT4:
        codes, scale, minimum = int4_tile_form(parts, quant, where)
        yield f"{module}.weight", codes
        yield f"{module}.weight_scale", scale
        yield f"{module}.weight_minimum", minimum
        return
    weight, scale = parts["weight"], parts["weight_scale"]
    n = weight.shape[0]
    if weight.dim() != 2 or scale.numel() not in (1, n):
        raise ValueError(f"{where}: weight {tuple(weight.shape)} with weight_scale "
                         f"{tuple(scale.shape)} is not per channel or per tensor")
    scale = scale.reshape(-1).expand(n).contiguous()  # [N]
    if quant.kernel == KERNEL_INT8:
        if weight.dtype != torch.int8:
            raise ValueError(f"{where}: weight is {weight.dtype}, int8 expected")
        yield f"{module}.weight", weight
        yield f"{module}.weight_scale", scale
        return
    if weight.dtype != torch.float8_e4m3fn:
        raise ValueError(f"{where}: weight is {weight.dtype}, float8_e4m3fn expected")
    yield f"{module}.weight", weight
    yield f"{module}.weight_scale", scale.float()


def unpack_int32_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """[R, C] int32, eight 4-bit values a word from the low bits up -> [R, 8 * C] uint8 0..15
    (compressed-tensors' pack_to_int32 with 4 bits, AutoGPTQ's and AutoAWQ's words alike)."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    return ((packed.unsqueeze(-1) >> shifts) & 0xF).to(torch.uint8).view(packed.shape[0], -1)


def int4_tile_form(parts: dict[str, torch.Tensor], quant: CheckpointQuantization, where: str,
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """compressed-tensors pack-quantized int4 -> (codes [N, K] uint8, scale [N, ceil(K / 32)]
    in the checkpoint's dtype, minimum the same in float32): the module docstring's mapping."""
    n, k = (int(d) for d in parts["weight_shape"].tolist())
    codes = unpack_int32_nibbles(parts["weight_packed"])
    if codes.shape[0] != n or codes.shape[1] < k:
        raise ValueError(f"{where}: weight_packed {tuple(parts['weight_packed'].shape)} does not "
                         f"hold weight_shape {(n, k)}")
    codes = codes[:, :k].contiguous()
    scale = parts["weight_scale"].reshape(n, -1)  # [N, G]
    if "weight_zero_point" in parts:
        zp = parts["weight_zero_point"]  # [ceil(N / 8), G] int32: packed along the rows
        offsets = unpack_int32_nibbles(zp.t().contiguous()).t()[:n].float() - 8  # [N, G]
    else:
        offsets = torch.zeros(scale.shape)
    return tile_groups(codes, scale, offsets, quant.group_size or k, where)


def tile_groups(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group_size: int,
                where: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Weights `scale * (code - 8 - zero)` in groups of `group_size` along K (scale [N, G] in
    the checkpoint's dtype, zero [N, G] float) as our groups of 32: (codes, scale in its dtype,
    minimum = -scale * (8 + zero) in float32, exact)."""
    n, k = codes.shape
    num_groups = scale.shape[1]
    if group_size % TILE_GROUP and group_size < k:
        raise ValueError(f"{where}: group size {group_size} is not a multiple of {TILE_GROUP}")
    if num_groups != -(-k // group_size) or zero.shape != scale.shape:
        raise ValueError(f"{where}: {num_groups} scale groups for {k} inputs in groups of "
                         f"{group_size}")
    tile = torch.arange(-(-k // TILE_GROUP)) * TILE_GROUP // group_size  # our group -> theirs
    tile_scale = scale[:, tile].contiguous()
    minimum = -tile_scale.float() * (8.0 + zero[:, tile].float())
    return codes, tile_scale, minimum


def legacy_tile_form(parts: dict[str, torch.Tensor], quant: CheckpointQuantization, where: str,
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """AutoGPTQ / AutoAWQ int4 -> the tile's (codes, scale, minimum); both dequantize
    `scale * (q - zero)` with q and zero in 0..15 and float16 scales [K / g, N].

    - GPTQ ("gptq" checkpoint_format, v1): qweight [K / 8, N] packed along K, qzeros
      [K / g, N / 8] packed along N and stored minus one, g_idx [K] (group of each input);
    - AWQ (GEMM): qweight [K, N / 8] and qzeros [K / g, N / 8], both packed along N in
      `AWQ_ORDER`, zeros stored as they are."""
    qweight, qzeros, scales = parts["qweight"], parts["qzeros"], parts["scales"]
    if quant.storage == "gptq":
        codes = unpack_int32_nibbles(qweight.t().contiguous())  # [N, K]
        zero = unpack_int32_nibbles(qzeros).float() + 1  # [G, N]
    else:
        codes = _awq_columns(unpack_int32_nibbles(qweight)).t().contiguous()  # [N, K]
        zero = _awq_columns(unpack_int32_nibbles(qzeros)).float()  # [G, N]
    n, k = codes.shape
    group_size = quant.group_size or k
    g_idx = parts.get("g_idx")
    if g_idx is not None and not torch.equal(g_idx.long(), torch.arange(k) // group_size):
        raise ValueError(f"{where}: g_idx assigns inputs to groups out of order (act order); "
                         "not supported")
    if scales.shape[1] != n or zero.shape != scales.shape:
        raise ValueError(f"{where}: scales {tuple(scales.shape)} and qzeros "
                         f"{tuple(qzeros.shape)} do not fit qweight {tuple(qweight.shape)}")
    return tile_groups(codes, scales.t(), zero.t() - 8, group_size, where)


def _awq_columns(unpacked: torch.Tensor) -> torch.Tensor:
    """[R, 8 * C] nibbles in AWQ's word order -> columns in their natural order."""
    rows = unpacked.shape[0]
    inverse = torch.tensor(AWQ_ORDER).argsort()
    return unpacked.view(rows, -1, 8)[:, :, inverse].reshape(rows, -1)
