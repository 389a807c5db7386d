"""The twins themselves against plain dense attention over contiguous K/V (SDPA, causal)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from kernel_cases import assert_close, random_paged_kv
from kvasir_engine.kernels import reference as ref


def dense_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """[S, H, D] causal self-attention over the whole sequence, KV heads repeated for GQA."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                         is_causal=True, scale=scale)
    return out.transpose(0, 1)


@pytest.mark.parametrize(("group", "block_size"), [(1, 16), (4, 32), (8, 16)])
def test_paged_twins_match_dense_attention(group: int, block_size: int) -> None:
    gen = torch.Generator().manual_seed(group * 100 + block_size)
    num_kv_heads, head_dim, scale = 2, 64, 0.125
    # (cached prefix, chunk): empty prefix, prefix ending mid-block, a one-token decode.
    plan = [(0, 7), (37, 20), (16, 1), (45, 1)]
    seq_lens = [p + c for p, c in plan]
    k_cache, v_cache, block_tables = random_paged_kv(seq_lens, num_kv_heads, head_dim, block_size,
                                                     torch.float32, gen)
    queries, expected, dense_k, dense_v = [], [], [], []
    for r, (prefix, chunk) in enumerate(plan):
        n = prefix + chunk
        q_full = torch.randn(n, num_kv_heads * group, head_dim, generator=gen)
        k = torch.randn(n, num_kv_heads, head_dim, generator=gen)
        v = torch.randn(n, num_kv_heads, head_dim, generator=gen)
        slots = torch.tensor([int(block_tables[r, i // block_size]) * block_size + i % block_size
                              for i in range(n)])
        ref.kv_store(k, v, k_cache, v_cache, slots)
        queries.append(q_full[prefix:])
        expected.append(dense_causal(q_full, k, v, scale)[prefix:])
        dense_k.append(k)
        dense_v.append(v)
    query = torch.cat(queries)
    starts = torch.tensor([0] + torch.tensor([c for _, c in plan]).cumsum(0).tolist(),
                          dtype=torch.int32)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    out = ref.paged_prefill_attention(query, k_cache, v_cache, block_tables, starts, lens, scale)
    assert_close(out, torch.cat(expected))

    decode = [r for r, (_, chunk) in enumerate(plan) if chunk == 1]
    out = ref.paged_decode_attention(query[starts[decode].long()], k_cache, v_cache,
                                     block_tables[decode], lens[decode], scale)
    assert_close(out, torch.stack([expected[r][0] for r in decode]))
    for r, n in enumerate(seq_lens):
        assert torch.equal(ref.gather_context(k_cache, block_tables[r], n), dense_k[r])
        assert torch.equal(ref.gather_context(v_cache, block_tables[r], n), dense_v[r])


def test_decode_twin_gives_zeros_for_padding_slots() -> None:
    gen = torch.Generator().manual_seed(0)
    k_cache, v_cache, block_tables = random_paged_kv([5, 0], 1, 64, 16, torch.float32, gen)
    query = torch.randn(2, 2, 64, generator=gen)
    lens = torch.tensor([5, 0], dtype=torch.int32)
    out = ref.paged_decode_attention(query, k_cache, v_cache, block_tables, lens, 0.1)
    assert torch.equal(out[1], torch.zeros(2, 64))
    assert out[0].abs().sum() > 0


def test_rms_norm_twin_matches_torch_rms_norm() -> None:
    gen = torch.Generator().manual_seed(1)
    x, residual = torch.randn(4, 96, generator=gen), torch.randn(4, 96, generator=gen)
    weight = torch.randn(96, generator=gen)
    normed, h = ref.rms_norm(x, weight, 1e-6, residual)
    assert torch.equal(h, x + residual)
    torch.testing.assert_close(normed, F.rms_norm(x + residual, (96,), weight, eps=1e-6))


def test_rotary_twin_matches_complex_rotation() -> None:
    gen = torch.Generator().manual_seed(2)
    head_dim, positions = 64, torch.tensor([0, 3, 17])
    cache = ref.rope_cos_sin_cache(32, head_dim, theta=500000.0)
    q, k = torch.randn(3, 4, head_dim, generator=gen), torch.randn(3, 2, head_dim, generator=gen)
    rq, rk = ref.rotary_embedding(positions, q, k, cache, is_neox=False)
    inv_freq = 1.0 / 500000.0 ** (torch.arange(0, head_dim, 2).float() / head_dim)
    angle = torch.polar(torch.ones(3, head_dim // 2), positions[:, None].float() * inv_freq)
    for x, rx in ((q, rq), (k, rk)):
        pairs = torch.view_as_complex(x.reshape(*x.shape[:2], -1, 2).contiguous())
        rotated = torch.view_as_real(pairs * angle[:, None]).flatten(-2)
        torch.testing.assert_close(rx, rotated, atol=1e-5, rtol=1e-5)
    # Neox style is the same rotation after de-interleaving the pairs into halves.
    perm = torch.cat([torch.arange(0, head_dim, 2), torch.arange(1, head_dim, 2)])
    nq, _ = ref.rotary_embedding(positions, q[..., perm], k[..., perm], cache, is_neox=True)
    torch.testing.assert_close(nq, rq[..., perm])
