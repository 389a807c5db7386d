"""The native CPU kernels (kernels/cpu.py) against their pure-torch twins: quantized matmuls,
paged decode and prefill attention, and the fused RMSNorm and rotary against the torch layers'
own code.

The integer dot products are exact, so kernel and twin differ only by float32 rounding of the
scales (the twin sums in float64); on a grid where every scale is a power of two both are exact
and must agree bit for bit. Shapes cover every tile remainder of the kernels (rows 1..9 and a
multiple of the 64-row block, columns not multiple of the 4- or 2-column tiles, K not a
multiple of 32). On hosts with AVX-512 VNNI the int8 weights of a model are packed for it
(cpu.pack_int8_vnni); that layout must give the rows layout's outputs bit for bit.
"""

from __future__ import annotations

import pytest
import torch
from kvasir_engine.kernels import cpu
from kvasir_engine.kernels import reference as ref
from kvasir_engine.layers.activation import SiluAndMul
from kvasir_engine.layers.norm import RMSNorm
from kvasir_engine.layers.quantization import quantize_int4, quantize_int8
from kvasir_engine.layers.rotary import RotaryEmbedding

pytestmark = pytest.mark.skipif(not cpu.available(),
                                reason="native CPU kernels need x86-64 with AVX2 and a compiler")

SHAPES = [(m, n, k) for m in (1, 2, 3, 4, 5, 9, 130) for n, k in ((1, 32), (7, 100), (70, 576))]
SHAPES += [(16, 33, 1536), (2, 5, 31)]


def _int8_case(m: int, n: int, k: int, seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    kp = cpu.padded_k(k)
    weight = torch.randint(-127, 128, (n, kp), generator=g, dtype=torch.int8)
    weight[:, k:] = 0
    return torch.randn(m, k, generator=g), weight, torch.rand(n, generator=g) + 0.1


def _int4_case(m: int, n: int, k: int, seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    groups = cpu.padded_k(k) // 32
    packed = torch.randint(0, 256, (n, groups * 16), generator=g, dtype=torch.uint8)
    return (torch.randn(m, k, generator=g), packed,
            (torch.rand(n, groups, generator=g) * 0.1).half(),
            (torch.randn(n, groups, generator=g) * 0.1).half())


@pytest.mark.parametrize(("m", "n", "k"), SHAPES)
def test_int8_linear_matches_twin(m: int, n: int, k: int) -> None:
    x, weight, scale = _int8_case(m, n, k, seed=m * 1000 + n)
    out = cpu.int8_linear(x, weight, scale, k)
    expected = ref.int8_linear(x, weight, scale, k)
    assert out.shape == (m, n) and out.dtype == torch.float32
    torch.testing.assert_close(out, expected, atol=1e-3, rtol=1e-5)


needs_vnni = pytest.mark.skipif(not cpu.int8_vnni_supported(),
                                reason="the packed int8 layout needs AVX-512 VNNI")


@needs_vnni
@pytest.mark.parametrize(("m", "n", "k"),
                         SHAPES + [(8, 16, 64), (17, 49, 96), (3, 200, 600), (70, 33, 1536)]
                         + [(m, 37, 100) for m in (6, 7, 10, 11, 12, 13, 14, 15)])
def test_packed_int8_equals_the_rows_layout(m: int, n: int, k: int) -> None:
    """Column tiles of every row count (1..16: decode), 8 x 2 tiles past them (1..8 rows, and
    past a 64-row block), a last block of 1..16 columns, Kp both a multiple of 64 and not."""
    x, weight, scale = _int8_case(m, n, k, seed=m * 31 + n)
    packed = cpu.pack_int8_vnni(weight)
    assert packed.shape == (-(-n // 16), cpu.padded_k(k) // 4, 64)
    out = cpu.int8_linear(x, packed, scale, k)
    assert torch.equal(out, cpu.int8_linear(x, weight, scale, k))
    torch.testing.assert_close(out, ref.int8_linear(x, weight, scale, k), atol=1e-3, rtol=1e-5)


@pytest.mark.parametrize(("m", "n", "k"),
                         [(1, 37, 100), (9, 70, 576), (16, 33, 1536), (70, 49, 96), (0, 16, 64)])
@pytest.mark.parametrize("layout", ["rows", "packed"])
def test_bfloat16_activations_equal_their_float32_copies(m: int, n: int, k: int,
                                                         layout: str) -> None:
    """bfloat16 x is quantized and (packed) written out without float32 copies: the same codes
    and the same rounding as x.float() in, y.to(bfloat16) out, bit for bit; a strided x too."""
    if layout == "packed" and not cpu.int8_vnni_supported():
        pytest.skip("the packed int8 layout needs AVX-512 VNNI")
    x, weight, scale = _int8_case(m, n, k, seed=m * 7 + n)
    w = cpu.pack_int8_vnni(weight) if layout == "packed" else weight
    x16 = x.to(torch.bfloat16)
    out = cpu.int8_linear(x16, w, scale, k)
    assert out.dtype == torch.bfloat16 and out.shape == (m, n)
    assert torch.equal(out, cpu.int8_linear(x16.float(), w, scale, k).to(torch.bfloat16))
    strided = torch.stack([x16, x16], dim=2)[:, :, 0]  # x16's values, not contiguous
    assert torch.equal(cpu.int8_linear(strided, w, scale, k), out)


def test_packing_round_trips() -> None:
    _, weight, _ = _int8_case(1, 37, 100, seed=9)
    weight[0, :4] = torch.tensor([-127, 127, 0, -1], dtype=torch.int8)
    packed = cpu.pack_int8_vnni(weight)
    assert packed.dtype == torch.uint8
    assert torch.equal(cpu.unpack_int8_vnni(packed, 37), weight)
    # Block 0, step 0 holds column 0's first four weights, shifted by 128.
    assert packed[0, 0, :4].tolist() == [1, 255, 128, 127]


@needs_vnni
def test_packed_launcher_rejects_bad_arguments() -> None:
    x, weight, scale = _int8_case(2, 40, 100, seed=5)
    packed = cpu.pack_int8_vnni(weight)
    with pytest.raises(ValueError, match="weight"):
        cpu.int8_linear(x, packed[:2].contiguous(), scale, 100)  # 2 blocks for 40 columns
    with pytest.raises(ValueError, match="weight"):
        cpu.int8_linear(x, packed.view(torch.int8), scale, 100)
    with pytest.raises(ValueError, match="scale"):
        cpu.int8_linear(x, packed, scale.view(4, 10), 100)
    with pytest.raises(RuntimeError, match="packed w must be"):
        cpu.int8_linear(x, packed.transpose(0, 1), scale, 100, checked=True)


@pytest.mark.parametrize(("m", "n", "k"), SHAPES)
def test_int4_linear_matches_twin(m: int, n: int, k: int) -> None:
    x, packed, scale, minimum = _int4_case(m, n, k, seed=m * 1000 + n)
    out = cpu.int4_linear(x, packed, scale, minimum, k)
    expected = ref.int4_linear(x, packed, scale, minimum, k)
    assert out.shape == (m, n) and out.dtype == torch.float32
    torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_kernels_return_the_activation_dtype(dtype: torch.dtype) -> None:
    x, weight, scale = _int8_case(5, 70, 576, seed=1)
    out = cpu.int8_linear(x.to(dtype), weight, scale, 576)
    assert out.dtype == dtype
    expected = ref.int8_linear(x.to(dtype), weight, scale, 576)
    torch.testing.assert_close(out.float(), expected.float(), atol=1.0, rtol=1e-2)
    x, packed, s, mn = _int4_case(5, 70, 576, seed=2)
    assert cpu.int4_linear(x.to(dtype), packed, s, mn, 576).dtype == dtype


def test_exact_on_a_power_of_two_grid() -> None:
    """Rows reaching +-127 and power-of-two scales: no rounding anywhere, equality expected."""
    g = torch.Generator().manual_seed(7)
    codes = torch.randint(-127, 128, (9, 96), generator=g).float()
    codes[:, 0] = 127.0
    x = codes * 0.25  # per-row scale 0.25 / 127 * 127: x quantizes back to codes exactly
    weight = torch.randint(-127, 128, (11, 96), generator=g, dtype=torch.int8)
    scale = torch.full((11,), 0.5)
    out = cpu.int8_linear(x, weight, scale, 96)
    exact = (codes.double() @ weight.double().t()) * 0.25 * 0.5
    assert torch.equal(out.double(), exact)


def test_twin_rounds_an_activation_tie_as_the_kernel_does() -> None:
    """x * (127 / max|x|) lands exactly on -64.5 in float32 here, but only when 127 / max|x| is
    a true division; the twin once multiplied by a reciprocal and rounded the tie the other way
    (a 1-code, ~0.1 difference in bench/cpu_kernels.py's validation at 512 rows)."""
    x = torch.zeros(1, 32)
    x[0, 0], x[0, 1] = 3.4607765674591064, -1.7576385736465454
    weight = torch.zeros(3, 32, dtype=torch.int8)
    weight[:, 1] = 127
    scale = torch.ones(3)
    out = cpu.int8_linear(x, weight, scale, 32)
    torch.testing.assert_close(out, ref.int8_linear(x, weight, scale, 32), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(out, torch.full((1, 3), -64 * 127 * 3.4607765674591064 / 127))


def test_zero_rows_and_zero_activations() -> None:
    x, weight, scale = _int8_case(3, 7, 100, seed=3)
    assert cpu.int8_linear(x[:0], weight, scale, 100).shape == (0, 7)
    zeros = torch.zeros(2, 100)
    assert torch.equal(cpu.int8_linear(zeros, weight, scale, 100), torch.zeros(2, 7))
    _, packed, s, mn = _int4_case(1, 7, 100, seed=4)
    # Zero activations leave only the minimum term, which is zero too: exactly zero out.
    assert torch.equal(cpu.int4_linear(zeros, packed, s, mn, 100), torch.zeros(2, 7))


def test_launchers_reject_bad_arguments() -> None:
    x, weight, scale = _int8_case(2, 7, 100, seed=5)
    with pytest.raises(ValueError, match="weight"):
        cpu.int8_linear(x, weight[:, :100].contiguous(), scale, 100)
    with pytest.raises(ValueError, match="scale"):
        cpu.int8_linear(x, weight, scale[:3], 100)
    with pytest.raises(ValueError, match="weight"):
        cpu.int8_linear(x, weight.float(), scale, 100)
    with pytest.raises(RuntimeError, match="x must be"):
        cpu.int8_linear(x[:, :50], weight, scale, 100)
    _, packed, s, mn = _int4_case(2, 7, 100, seed=6)
    with pytest.raises(ValueError, match="packed"):
        cpu.int4_linear(x, packed[:, :8].contiguous(), s, mn, 100)
    with pytest.raises(ValueError, match="minimum"):
        cpu.int4_linear(x, packed, s, mn.t().contiguous(), 100)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"), [(9, 3, 64), (4, 4, 32),
                                                                    (8, 1, 128), (2, 1, 40)])
# Work items of whole contexts (7), one block (split-K merged by log-sum-exp), three blocks
# (a partial last chunk), or the kernel's own choice (0).
@pytest.mark.parametrize("chunk_blocks", [0, 1, 3, 7])
# The AVX-512 item where the build has it (head_dim 32, 64, 128; 40 stays on AVX2's), and AVX2's.
@pytest.mark.parametrize("wide", [True, False])
def test_decode_attention_matches_twin(dtype: torch.dtype, num_heads: int, num_kv_heads: int,
                                       head_dim: int, chunk_blocks: int, wide: bool) -> None:
    g = torch.Generator().manual_seed(num_heads * head_dim)
    block_size, seq_lens = 16, [1, 15, 16, 17, 100, 0, 3]
    num_blocks = 64
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g).to(dtype)
    max_blocks = -(-max(seq_lens) // block_size)
    # Scattered, distinct blocks per request, 0-padded past each one's context.
    perm = torch.randperm(num_blocks - 1, generator=g) + 1
    tables = torch.zeros(len(seq_lens), max_blocks, dtype=torch.int32)
    used = 0
    for r, n in enumerate(seq_lens):
        count = -(-n // block_size)
        tables[r, :count] = perm[used:used + count].to(torch.int32)
        used += count
    q = torch.randn(len(seq_lens), num_heads, head_dim, generator=g).to(dtype)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    out = cpu.decode_attention(q, k_cache, v_cache, tables, lens, max(seq_lens),
                               head_dim ** -0.5, chunk_blocks, wide)
    expected = ref.paged_decode_attention(q, k_cache, v_cache, tables, lens, head_dim ** -0.5)
    assert out.dtype == dtype and out.shape == q.shape
    atol, rtol = (2e-5, 1e-5) if dtype == torch.float32 else (2e-2, 2e-2)
    torch.testing.assert_close(out.float(), expected.float(), atol=atol, rtol=rtol)


@pytest.mark.parametrize(("q_dtype", "cache_dtype"), [(torch.float32, torch.bfloat16),
                                                      (torch.bfloat16, torch.float32)])
@pytest.mark.parametrize("wide", [True, False])
def test_decode_attention_mixes_query_and_cache_dtypes(q_dtype: torch.dtype,
                                                       cache_dtype: torch.dtype,
                                                       wide: bool) -> None:
    """--kv-cache-dtype bfloat16 under float32 compute: the kernel reads the bfloat16 cache and
    computes in float32, so it matches the float32 twin on the cache's (exact) float32 values."""
    g = torch.Generator().manual_seed(5)
    k_cache = torch.randn(8, 16, 3, 64, generator=g).to(cache_dtype)
    v_cache = torch.randn(8, 16, 3, 64, generator=g).to(cache_dtype)
    tables = torch.tensor([[3, 1, 6, 0], [2, 5, 0, 0]], dtype=torch.int32)
    lens = torch.tensor([50, 20], dtype=torch.int32)
    q = torch.randn(2, 9, 64, generator=g).to(q_dtype)
    out = cpu.decode_attention(q, k_cache, v_cache, tables, lens, 50, 0.125, 0, wide)
    expected = ref.paged_decode_attention(q.float(), k_cache.float(), v_cache.float(), tables,
                                          lens, 0.125)
    assert out.dtype == q_dtype
    atol = 2e-5 if q_dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), expected, atol=atol, rtol=atol)


@pytest.mark.parametrize("block_size", [1, 8, 32])
def test_decode_attention_tiles_across_block_sizes(block_size: int) -> None:
    """The AVX-512 item scores 16 positions a tile: a tile may span several blocks (or end
    inside one), and a context need not fill its last tile."""
    g = torch.Generator().manual_seed(block_size)
    seq_lens = [1, 16, 17, 70, 129]
    num_blocks = sum(-(-n // block_size) for n in seq_lens) + 1
    k_cache = torch.randn(num_blocks, block_size, 3, 64, generator=g).bfloat16()
    v_cache = torch.randn(num_blocks, block_size, 3, 64, generator=g).bfloat16()
    max_blocks = -(-max(seq_lens) // block_size)
    perm = (torch.randperm(num_blocks - 1, generator=g) + 1).to(torch.int32)
    tables = torch.zeros(len(seq_lens), max_blocks, dtype=torch.int32)
    used = 0
    for r, n in enumerate(seq_lens):
        count = -(-n // block_size)
        tables[r, :count] = perm[used:used + count]
        used += count
    q = torch.randn(len(seq_lens), 9, 64, generator=g).bfloat16()
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    expected = ref.paged_decode_attention(q.float(), k_cache.float(), v_cache.float(), tables,
                                          lens, 0.125)
    for chunk_blocks in (0, 1, 5):
        out = cpu.decode_attention(q, k_cache, v_cache, tables, lens, max(seq_lens), 0.125,
                                   chunk_blocks)
        torch.testing.assert_close(out.float(), expected, atol=2e-2, rtol=2e-2)


needs_bf16_prefill = pytest.mark.skipif(not cpu.prefill_attention_supported(),
                                        reason="the native prefill attention needs AVX512-BF16")


def _prefill_case(num_queries: int, seq_len: int, num_heads: int, num_kv_heads: int,
                  head_dim: int, block_size: int, seed: int) -> tuple[torch.Tensor, ...]:
    """Queries as a view into a fused qkv output (rows further apart than the heads), caches
    with scattered blocks, and the float32 twin's output over the same bfloat16 values."""
    g = torch.Generator().manual_seed(seed)
    count = -(-seq_len // block_size)
    num_blocks = count + 4
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g).bfloat16()
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g).bfloat16()
    table = (torch.randperm(num_blocks, generator=g)[:count]).to(torch.int32)
    width = (num_heads + 2 * num_kv_heads) * head_dim
    qkv = torch.randn(num_queries, width, generator=g).bfloat16()
    q = qkv[:, :num_heads * head_dim].view(num_queries, num_heads, head_dim)
    expected = ref.paged_prefill_attention(
        q.float(), k_cache.float(), v_cache.float(), table.unsqueeze(0),
        torch.tensor([0, num_queries], dtype=torch.int32),
        torch.tensor([seq_len], dtype=torch.int32), head_dim ** -0.5)
    return q, k_cache, v_cache, table, expected


@needs_bf16_prefill
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"),
                         [(9, 3, 64), (4, 4, 32), (8, 2, 128), (16, 1, 64)])
# A whole prompt, a chunk after a cached prefix, one query, query tiles past the first work
# item (96 rows), contexts ending inside a key tile, and a late chunk of a long prompt (many
# tiles, running maxima that move late).
@pytest.mark.parametrize(("num_queries", "seq_len"),
                         [(37, 37), (40, 113), (1, 30), (130, 130), (5, 200), (70, 2100)])
@pytest.mark.parametrize("block_size", [1, 16, 32])
def test_prefill_attention_matches_twin(num_heads: int, num_kv_heads: int, head_dim: int,
                                        num_queries: int, seq_len: int,
                                        block_size: int) -> None:
    q, k_cache, v_cache, table, expected = _prefill_case(
        num_queries, seq_len, num_heads, num_kv_heads, head_dim, block_size,
        seed=num_heads * seq_len + block_size)
    out = cpu.prefill_attention(q, k_cache, v_cache, table, seq_len, head_dim ** -0.5)
    assert out.dtype == torch.bfloat16 and out.shape == q.shape
    # float32 scores and softmax; the V sum takes the probabilities rounded to bfloat16 (as
    # flash attention does), then the output's rounding (and q, K, V's own)
    torch.testing.assert_close(out.float(), expected.float(), atol=1e-2, rtol=1e-2)


@needs_bf16_prefill
def test_prefill_attention_refuses_what_it_cannot_take() -> None:
    q, k_cache, v_cache, table, _ = _prefill_case(4, 20, 9, 3, 64, 16, seed=1)
    with pytest.raises(RuntimeError, match="q and both caches must be bfloat16"):
        cpu.prefill_attention(q.float(), k_cache, v_cache, table, 20, 0.125)
    with pytest.raises(RuntimeError, match="head_dim must be 32, 64 or 128"):
        cpu.prefill_attention(q[..., :48], k_cache[..., :48].contiguous(),
                              v_cache[..., :48].contiguous(), table, 20, 0.125)
    with pytest.raises(RuntimeError, match="seq_len 3 must be >= Q = 4"):
        cpu.prefill_attention(q, k_cache, v_cache, table, 3, 0.125)
    with pytest.raises(RuntimeError, match="fit the block table"):
        cpu.prefill_attention(q, k_cache, v_cache, table, 33, 0.125)
    with pytest.raises(RuntimeError, match="outside the caches"):
        cpu.prefill_attention(q, k_cache, v_cache, table + 100, 20, 0.125)


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_products_do_not_depend_on_the_batch(method: str) -> None:
    """A row's output is bit-identical whether it is multiplied alone, in a decode pair or in
    a prefill tile: greedy decoding must not change with what else is in the batch."""
    g = torch.Generator().manual_seed(21)
    weight = torch.randn(70, 600, generator=g) * 0.05
    x = torch.randn(7, 600, generator=g)
    if method == "int8":
        q8 = quantize_int8(weight, native=True)
        product = lambda rows: cpu.int8_linear(rows, q8.rows, q8.scale, 600)  # noqa: E731
    else:
        q4 = quantize_int4(weight, native=True)
        product = lambda rows: cpu.int4_linear(rows, q4.packed, q4.scale, q4.minimum, 600)  # noqa: E731
    batch = product(x)
    for r in range(7):
        assert torch.equal(product(x[r:r + 1]), batch[r:r + 1])
        assert torch.equal(product(x[r:r + 2]), batch[r:r + 2])


def test_decode_attention_does_not_depend_on_the_batch() -> None:
    g = torch.Generator().manual_seed(22)
    k_cache = torch.randn(40, 16, 3, 64, generator=g)
    v_cache = torch.randn(40, 16, 3, 64, generator=g)
    tables = torch.arange(40, dtype=torch.int32).view(4, 10)
    lens = torch.tensor([150, 7, 64, 100], dtype=torch.int32)
    q = torch.randn(4, 9, 64, generator=g)
    together = cpu.decode_attention(q, k_cache, v_cache, tables, lens, 160, 0.125)
    for r in range(4):
        alone = cpu.decode_attention(q[r:r + 1], k_cache, v_cache, tables[r:r + 1],
                                     lens[r:r + 1], 160, 0.125)
        assert torch.equal(alone, together[r:r + 1])


def test_decode_attention_rejects_bad_arguments() -> None:
    cache = torch.zeros(4, 16, 2, 64)
    q, tables = torch.zeros(2, 4, 64), torch.zeros(2, 2, dtype=torch.int32)
    with pytest.raises(RuntimeError, match="exceeds max_len"):
        cpu.decode_attention(q, cache, cache, tables, torch.tensor([3, 40], dtype=torch.int32),
                             32, 0.125)
    with pytest.raises(ValueError, match="seq_lens"):
        cpu.decode_attention(q, cache, cache, tables, torch.tensor([3, 4]), 32, 0.125)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        cpu.decode_attention(q.half(), cache.half(), cache.half(), tables,
                             torch.tensor([3, 4], dtype=torch.int32), 32, 0.125)
    with pytest.raises(RuntimeError, match="chunk_blocks"):
        cpu.decode_attention(q, cache, cache, tables, torch.tensor([3, 4], dtype=torch.int32),
                             32, 0.125, -1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_matches_the_torch_layer(dtype: torch.dtype, with_residual: bool) -> None:
    g = torch.Generator().manual_seed(11)
    norm = RMSNorm(576, 1e-5)
    norm.weight.data = (1 + 0.1 * torch.randn(576, generator=g))
    norm = norm.to(dtype)
    x = torch.randn(37, 576, generator=g).to(dtype)
    residual = torch.randn(37, 576, generator=g).to(dtype) if with_residual else None
    out, new_residual = cpu.rms_norm(x, norm.weight, 1e-5, residual)
    expected, expected_residual = norm(x, residual)
    atol, rtol = (1e-5, 1e-5) if dtype == torch.float32 else (2e-2, 1e-2)
    torch.testing.assert_close(out, expected, atol=atol, rtol=rtol)
    torch.testing.assert_close(new_residual, expected_residual, atol=0, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("inter", [1536, 13])  # SmolLM2's width, and a tail past the vectors
def test_silu_and_mul_matches_the_torch_layer(dtype: torch.dtype, inter: int) -> None:
    g = torch.Generator().manual_seed(13)
    # Gates from -90 to 90: the exponential's clamped ends and everything between.
    x = (torch.randn(7, 2 * inter, generator=g) * 4).to(dtype)
    x[0, :inter] = torch.linspace(-90, 90, inter).to(dtype)
    out = SiluAndMul("native")(x)
    expected = SiluAndMul()(x)
    assert out.dtype == dtype and out.shape == (7, inter)
    atol, rtol = (1e-5, 1e-5) if dtype == torch.float32 else (1e-2, 1e-2)
    torch.testing.assert_close(out, expected, atol=atol, rtol=rtol)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        cpu.silu_and_mul(x.half())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_matches_the_torch_layer(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(12)
    rotary = RotaryEmbedding(64, 2048, 10000.0).to(dtype)
    positions = torch.tensor([0, 5, 1999, 17, 300])
    qkv = torch.randn(5, (9 + 2 * 3) * 64, generator=g).to(dtype)
    q = qkv[:, :576].view(5, 9, 64)  # views of one fused output, as in the model
    k = qkv[:, 576:768].view(5, 3, 64)
    q_ref, k_ref = q.clone(), k.clone()
    out_q, out_k = cpu.rotary_(positions, q, k, rotary.cos_cached, rotary.sin_cached)
    assert out_q.data_ptr() == q.data_ptr()  # in place
    exp_q, exp_k = rotary(positions, q_ref, k_ref)
    atol, rtol = (1e-5, 1e-5) if dtype == torch.float32 else (2e-2, 1e-2)
    torch.testing.assert_close(out_q, exp_q, atol=atol, rtol=rtol)
    torch.testing.assert_close(out_k, exp_k, atol=atol, rtol=rtol)
    untouched = qkv[:, 768:].clone()
    cpu.rotary_(positions, q, k, rotary.cos_cached, rotary.sin_cached)
    assert torch.equal(qkv[:, 768:], untouched)  # V is not touched


def test_layer_kernels_reject_bad_arguments() -> None:
    rotary = RotaryEmbedding(64, 16, 10000.0)
    q, k = torch.zeros(2, 9, 64), torch.zeros(2, 3, 64)
    with pytest.raises(RuntimeError, match="outside the table"):
        cpu.rotary_(torch.tensor([0, 16]), q, k, rotary.cos_cached, rotary.sin_cached)
    with pytest.raises(RuntimeError, match="query's dtype"):
        cpu.rotary_(torch.tensor([0, 1]), q, k, rotary.cos_cached.double(), rotary.sin_cached)
    with pytest.raises(RuntimeError, match="weight"):
        cpu.rms_norm(torch.zeros(2, 64), torch.ones(32), 1e-5)
    with pytest.raises(RuntimeError, match="residual"):
        cpu.rms_norm(torch.zeros(2, 64), torch.ones(64), 1e-5, torch.zeros(3, 64))
