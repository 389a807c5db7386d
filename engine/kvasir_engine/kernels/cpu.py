"""Launchers for the native CPU kernels (csrc/), built on first use: quantized matmuls
(cpu_quant.cpp: int8, cpu_quant_int4.cpp: int4, both with int8 activations; cpu_quant_wo.cpp:
int4 / int8 weights times float activations, for weight-only checkpoints), bfloat16 matmuls with AVX512-BF16 (cpu_bf16.cpp), paged decode attention
(cpu_attention.cpp), causal prefill attention with AVX512-BF16 (cpu_prefill.cpp), fused
RMSNorm, rotary and SwiGLU gate (cpu_layers.cpp), and the decoder layers of a decode step
chained in one call (cpu_decode.cpp, see models/fused_decode.py).

PyTorch's own int8 CPU products (`_weight_int8pack_mm`, `_int_mm`) are fast only where oneDNN
has AVX-512 VNNI or AMX kernels; on an AVX2-only CPU they run at ~2 GFLOP/s, slower than float32
by 50x. The C++ kernels here multiply int8 codes with AVX2 integer dot products (VNNI where the
CPU has it), so `--quantization int8/int4` is fast on any x86-64 CPU of the last decade. The
decode attention kernel reads K and V straight through the block tables, one call a layer in
place of the torch path's gathers, matmuls and softmax (each a few microseconds of dispatch);
the fused layers do the same for the 5-10 small ops of a residual + RMSNorm or a rotary.

The extension is compiled once per machine with `-march=native` (it runs where it was built)
into `$KVASIR_KERNEL_CACHE` (default `~/.cache/kvasir/kernels`), in about a minute; later
processes load it in milliseconds. Where it cannot be built (no compiler, no AVX2, a read-only
cache) `available()` is False and the reason is logged once; kernels/choice.py then keeps
the torch ops for the whole process.
`reference.int8_linear` / `reference.int4_linear` / `reference.int4_linear_wo` /
`reference.int8_linear_wo` are the numerical twins the tests compare to.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import logging
import os
import platform
from pathlib import Path

import torch

from kvasir_engine.kernels.checks import FLOAT_DTYPES, check_tensor
from kvasir_engine.kernels.host import cpu_has

logger = logging.getLogger(__name__)

GROUP_SIZE = 32  # K is padded to a multiple of this, and int4 groups are this long
NATIVE_DTYPES = (torch.float32, torch.bfloat16)  # activations and caches the kernels take
_CSRC = Path(__file__).with_name("csrc")
_SOURCES = ("cpu_quant.cpp", "cpu_quant_int4.cpp", "cpu_quant_wo.cpp", "cpu_bf16.cpp",
            "cpu_attention.cpp", "cpu_prefill.cpp", "cpu_layers.cpp", "cpu_decode.cpp")


def padded_k(k: int) -> int:
    return -(-k // GROUP_SIZE) * GROUP_SIZE


@functools.cache
def available() -> bool:
    """True once the extension is built and loaded (building it on the first call). Whether
    the engine uses it is decided once, in kernels/choice.py (KVASIR_NATIVE_CPU_KERNELS)."""
    if platform.machine() not in ("x86_64", "AMD64") or not cpu_has("avx2"):
        logger.info("native CPU kernels need an x86-64 CPU with AVX2; using torch ops")
        return False
    try:
        _build()
    except Exception as exc:  # a missing compiler or cache directory: keep the torch ops
        logger.warning("native CPU kernels unavailable (%s: %s); quantized layers use torch "
                       "ops, which are much slower on CPUs without AVX-512 VNNI",
                       type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "")
        return False
    return True


def build_dir() -> Path:
    """Where this process builds and loads the extension: one directory per torch version
    (the extension links against its ABI) and per source tree (two checkouts sharing the
    cache would otherwise rebuild each other's), under $KVASIR_KERNEL_CACHE."""
    cache = Path(os.environ.get("KVASIR_KERNEL_CACHE",
                                Path.home() / ".cache" / "kvasir" / "kernels"))
    tree = hashlib.sha256(str(_CSRC.resolve()).encode()).hexdigest()[:8]
    return cache / f"kvasir_cpu-torch{torch.__version__}-{tree}"


def _build() -> None:
    from torch.utils import cpp_extension

    target = build_dir()
    target.mkdir(parents=True, exist_ok=True)
    # torch's own build lock is a plain file (its "baton"): a builder killed mid-build leaves
    # it behind and every later start waits on it forever. An flock is released when its
    # holder dies, so whoever holds it is the only builder, and a baton it finds is stale.
    with open(target / "build.flock", "w") as guard:
        fcntl.flock(guard, fcntl.LOCK_EX)
        (target / "lock").unlink(missing_ok=True)
        cpp_extension.load(
            name="kvasir_cpu", sources=[str(_CSRC / name) for name in _SOURCES],
            build_directory=str(target), extra_include_paths=[str(_CSRC)],
            extra_cflags=["-O3", "-march=native", "-fopenmp"], extra_ldflags=["-fopenmp"],
            is_python_module=False, verbose=False)


# Columns of one block of the VNNI-packed int8 layout (pack_int8_vnni).
VNNI_BLOCK = 16


@functools.cache
def int8_vnni_supported() -> bool:
    """Whether the built kernels multiply int8 weights in the VNNI-packed layout (a host with
    AVX-512 VNNI): `quantize_int8(native=True)` then packs every weight that way."""
    return available() and bool(torch.ops.kvasir_cpu.int8_vnni_supported())


def pack_int8_vnni(rows: torch.Tensor) -> torch.Tensor:
    """[N, Kp] int8 -> [ceil(N / 16), Kp / 4, 64] uint8, the layout of cpu_quant.cpp's
    int8_vnni: block b, step k4 holds columns 16b..16b+15 at k = 4k4..4k4+3 (a column's four
    bytes together), each weight plus 128; columns past N are zero weights."""
    n, kp = rows.shape
    num_blocks = -(-n // VNNI_BLOCK)
    shifted = torch.full((num_blocks * VNNI_BLOCK, kp), 128, dtype=torch.int16)
    shifted[:n] = rows.to(torch.int16) + 128
    return (shifted.to(torch.uint8).view(num_blocks, VNNI_BLOCK, kp // 4, 4)
            .permute(0, 2, 1, 3).contiguous().view(num_blocks, kp // 4, 4 * VNNI_BLOCK))


def unpack_int8_vnni(packed: torch.Tensor, n: int) -> torch.Tensor:
    """pack_int8_vnni's inverse: [N, Kp] int8 rows (what the reference twin takes)."""
    num_blocks, kp4, _ = packed.shape
    rows = (packed.view(num_blocks, kp4, VNNI_BLOCK, 4).permute(0, 2, 1, 3)
            .reshape(num_blocks * VNNI_BLOCK, kp4 * 4)[:n])
    return (rows.to(torch.int16) - 128).to(torch.int8)


def int8_rows(weight: torch.Tensor, n: int) -> torch.Tensor:
    """A native int8 weight in either layout as [N, Kp] int8 rows."""
    return unpack_int8_vnni(weight, n) if weight.dim() == 3 else weight


def check_int8_weight(weight: torch.Tensor, scale: torch.Tensor, k: int) -> None:
    if isinstance(weight, torch.Tensor) and weight.dim() == 3:  # pack_int8_vnni's layout
        check_tensor("scale", scale, (None,), (torch.float32,))
        check_tensor("weight", weight, (-(-scale.shape[0] // VNNI_BLOCK), padded_k(k) // 4,
                                        4 * VNNI_BLOCK), (torch.uint8,))
        return
    check_tensor("weight", weight, (None, padded_k(k)), (torch.int8,))
    check_tensor("scale", scale, (weight.shape[0],), (torch.float32,))


def int8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, k: int,
                checked: bool = False) -> torch.Tensor:
    """x [M, K] -> [M, N] in x's dtype; weight [N, Kp] int8 (zero past K) or pack_int8_vnni's
    layout of it, scale [N] float32; the same outputs either way, bit for bit.
    `checked`: the caller ran `check_int8_weight` once (a layer's own weights), so this call
    skips it: a C=1 decode step makes 120 of these calls, and the checks cost ~3 us each."""
    if not checked:
        check_int8_weight(weight, scale, k)
    result: torch.Tensor = torch.ops.kvasir_cpu.int8_linear(x, weight, scale, k)
    return result


# Columns of one block of the bfloat16 pair layout (pack_bf16_pairs).
BF16_BLOCK = 16


@functools.cache
def bf16_dot_supported() -> bool:
    """Whether the built kernels multiply bfloat16 with AVX512-BF16 dot products (bf16_linear)."""
    return available() and bool(torch.ops.kvasir_cpu.bf16_dot_supported())


def pack_bf16_pairs(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] bfloat16, K even -> [ceil(N / 16), K / 2, 32] bfloat16, the layout of
    cpu_bf16.cpp: block b, step k2 holds columns 16b..16b+15 at k = 2k2, 2k2+1 (a column's
    pair together); columns past N are zero."""
    n, k = weight.shape
    if weight.dtype != torch.bfloat16 or k % 2:
        raise ValueError(f"pack_bf16_pairs takes [N, K] bfloat16 with K even, got "
                         f"{weight.dtype} {tuple(weight.shape)}")
    num_blocks = -(-n // BF16_BLOCK)
    padded = torch.zeros(num_blocks * BF16_BLOCK, k, dtype=torch.bfloat16)
    padded[:n] = weight.detach()
    return (padded.view(num_blocks, BF16_BLOCK, k // 2, 2).permute(0, 2, 1, 3)
            .contiguous().view(num_blocks, k // 2, 2 * BF16_BLOCK))


def bf16_linear(x: torch.Tensor, packed: torch.Tensor, n: int) -> torch.Tensor:
    """x [M, K] bfloat16 -> [M, N] bfloat16 over pack_bf16_pairs' layout of an [N, K] weight:
    float32 sums of exact products, in k order, rounded once; a row's output does not depend
    on the other rows."""
    result: torch.Tensor = torch.ops.kvasir_cpu.bf16_linear(x, packed, n)
    return result


def check_int4_weight(packed: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor,
                      k: int) -> None:
    groups = padded_k(k) // GROUP_SIZE
    check_tensor("packed", packed, (None, padded_k(k) // 2), (torch.uint8,))
    check_tensor("scale", scale, (packed.shape[0], groups), (torch.float16,))
    check_tensor("minimum", minimum, (packed.shape[0], groups), (torch.float16,))


def int4_linear(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor,
                k: int, checked: bool = False) -> torch.Tensor:
    """x [M, K] -> [M, N]; packed [N, Kp / 2] uint8 nibbles, scale/minimum [N, Kp / 32] float16.
    `checked`: as for int8_linear, the caller ran `check_int4_weight` once."""
    if not checked:
        check_int4_weight(packed, scale, minimum, k)
    result: torch.Tensor = torch.ops.kvasir_cpu.int4_linear(x, packed, scale, minimum, k)
    return result


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """[N, Kp] uint8 codes 0..15 -> [N, Kp / 2] uint8, two a byte (reference.unpack_int4's
    layout: element j of a group of 32 in byte j's low nibble, element j + 16 in its high)."""
    groups = codes.view(codes.shape[0], -1, GROUP_SIZE)  # [N, G, 32]
    return (groups[..., :16] | (groups[..., 16:] << 4)).view(codes.shape[0], -1)


def check_int4_wo_weight(packed: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor,
                         k: int) -> None:
    groups = padded_k(k) // GROUP_SIZE
    check_tensor("packed", packed, (None, padded_k(k) // 2), (torch.uint8,))
    check_tensor("scale", scale, (packed.shape[0], groups), FLOAT_DTYPES)
    check_tensor("minimum", minimum, (packed.shape[0], groups), (torch.float32,))


def int4_linear_wo(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor,
                   minimum: torch.Tensor, k: int, checked: bool = False) -> torch.Tensor:
    """x [M, K] float32 | bfloat16 -> [M, N] in x's dtype, activations unquantized; packed
    as int4_linear's, scale [N, Kp / 32] in the checkpoint's dtype, minimum [N, Kp / 32]
    float32: weights `scale * code + minimum` rounded to the scale's dtype (and to bfloat16
    for bfloat16 x), float32 sums. `checked`: as for int8_linear."""
    if not checked:
        check_int4_wo_weight(packed, scale, minimum, k)
    result: torch.Tensor = torch.ops.kvasir_cpu.int4_linear_wo(x, packed, scale, minimum, k)
    return result


def check_int8_wo_weight(rows: torch.Tensor, scale: torch.Tensor, k: int) -> None:
    check_tensor("rows", rows, (None, padded_k(k)), (torch.int8,))
    check_tensor("scale", scale, (rows.shape[0],), FLOAT_DTYPES)


def int8_linear_wo(x: torch.Tensor, rows: torch.Tensor, scale: torch.Tensor, k: int,
                   checked: bool = False) -> torch.Tensor:
    """x [M, K] float32 | bfloat16 -> [M, N] in x's dtype, activations unquantized; rows
    [N, Kp] int8 (zero past K), scale [N] in the checkpoint's dtype: weights `scale * code`
    rounded as int4_linear_wo's. `checked`: as for int8_linear."""
    if not checked:
        check_int8_wo_weight(rows, scale, k)
    result: torch.Tensor = torch.ops.kvasir_cpu.int8_linear_wo(x, rows, scale, k)
    return result


def decode_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     block_tables: torch.Tensor, seq_lens: torch.Tensor, max_len: int,
                     scale: float, chunk_blocks: int = 0, wide: bool = True) -> torch.Tensor:
    """One query token per request over its paged context -> [N, H, D]; the twin is
    `reference.paged_decode_attention`. query [N, H, D]; caches [blocks, block_size, Hkv, D];
    block_tables [N, B] int32; seq_lens [N] int32, each <= max_len. Contexts are split into
    work items of `chunk_blocks` blocks (0: ~64 positions, whatever the batch, so a request's
    result does not depend on the others in it). `wide`: 16-lane vectors where the build has
    AVX-512 and head_dim is 32, 64 or 128 (False: the AVX2 item everywhere, for tests)."""
    n = query.shape[0]
    check_tensor("block_tables", block_tables, (n, None), (torch.int32,))
    check_tensor("seq_lens", seq_lens, (n,), (torch.int32,))
    result: torch.Tensor = torch.ops.kvasir_cpu.decode_attention(
        query, k_cache, v_cache, block_tables.contiguous(), seq_lens.contiguous(), max_len,
        scale, chunk_blocks, wide)
    return result


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """layers/norm.py's RMSNorm in one call: x, residual [T, H] -> (normed, x + residual)."""
    out, new_residual = torch.ops.kvasir_cpu.rms_norm(
        x.contiguous(), weight, eps, None if residual is None else residual.contiguous())
    return out, new_residual


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """layers/activation.py's SwiGLU gate in one call: x [T, 2 * I] -> silu(x[:, :I]) * x[:, I:]."""
    result: torch.Tensor = torch.ops.kvasir_cpu.silu_and_mul(x.contiguous())
    return result


def decode_layers(hidden: torch.Tensor, positions: torch.Tensor, weights: list[torch.Tensor],
                  method: str, k_caches: list[torch.Tensor], v_caches: list[torch.Tensor],
                  block_tables: torch.Tensor, seq_lens: torch.Tensor,
                  slot_mapping: torch.Tensor, max_len: int, cos: torch.Tensor,
                  sin: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int,
                  eps: float, scale: float) -> torch.Tensor:
    """Every decoder layer of a decode-only batch (one token per request) and the final norm,
    hidden [M, H] -> [M, H]; `weights` in the order models/fused_decode.py lays them out."""
    check_tensor("block_tables", block_tables, (hidden.shape[0], None), (torch.int32,))
    check_tensor("seq_lens", seq_lens, (hidden.shape[0],), (torch.int32,))
    check_tensor("slot_mapping", slot_mapping, (hidden.shape[0],), (torch.int64,))
    result: torch.Tensor = torch.ops.kvasir_cpu.decode_layers(
        hidden.contiguous(), positions.contiguous(), weights, method, k_caches, v_caches,
        block_tables.contiguous(), seq_lens.contiguous(), slot_mapping.contiguous(), max_len,
        cos, sin, num_heads, num_kv_heads, head_dim, eps, scale)
    return result


@functools.cache
def prefill_attention_supported() -> bool:
    """Whether the built kernels have the AVX512-BF16 prefill attention (prefill_attention)."""
    return available() and bool(torch.ops.kvasir_cpu.prefill_attention_supported())


def prefill_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      block_table: torch.Tensor, seq_len: int, scale: float) -> torch.Tensor:
    """Causal attention of one request's queries [Q, H, D] (bfloat16, heads contiguous), the
    last Q positions of its seq_len, over K and V read through block_table [B] int32 from the
    bfloat16 caches [blocks, block_size, Hkv, D] -> [Q, H, D]; float32 scores and softmax."""
    result: torch.Tensor = torch.ops.kvasir_cpu.prefill_attention(
        query, k_cache, v_cache, block_table.to(torch.int32).contiguous(), seq_len, scale)
    return result


def rotary_(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor, cos: torch.Tensor,
            sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """layers/rotary.py's rotation of query [T, H, D] and key [T, Hkv, D], in place, from its
    tables cos and signed sin [max_position, D] (positions [T] int64); returns them."""
    torch.ops.kvasir_cpu.rotary_(positions.contiguous(), query, key, cos, sin)
    return query, key
