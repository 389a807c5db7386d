"""Pure-PyTorch twins of every Triton kernel: the numerical ground truth (docs/architecture.md, rule 8).

Each function computes in float32 and returns the input dtype, the way the kernels do, so a test
compares like with like. They are written for clarity, not speed: loops over requests, gathers
through the block table, no fusion. The KV cache layout is the one of `attention/metadata.py`:
[num_blocks, block_size, num_kv_heads, head_dim], slot = block_id * block_size + offset.
"""

from __future__ import annotations

import torch


def gather_context(
    cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_table: torch.Tensor,  # [B] int
    seq_len: int,
) -> torch.Tensor:  # [seq_len, num_kv_heads, head_dim]
    """The first `seq_len` cached tokens of one request, in order."""
    block_size = cache.shape[1]
    num_blocks = (seq_len + block_size - 1) // block_size
    blocks = cache[block_table[:num_blocks].long()]
    return blocks.reshape(-1, cache.shape[2], cache.shape[3])[:seq_len]


def _attend(
    query: torch.Tensor,  # [Q, H, D]
    key: torch.Tensor,  # [S, KH, D]
    value: torch.Tensor,  # [S, KH, D]
    scale: float,
) -> torch.Tensor:  # [Q, H, D] float32
    """Queries are the last Q positions of an S-token context: query i sees keys 0..S-Q+i."""
    num_q, num_heads = query.shape[0], query.shape[1]
    seq_len, num_kv_heads = key.shape[0], key.shape[1]
    group = num_heads // num_kv_heads
    k = key.float().repeat_interleave(group, dim=1)  # [S, H, D]
    v = value.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,shd->hqs", query.float(), k) * scale  # [H, Q, S]
    q_pos = torch.arange(seq_len - num_q, seq_len).unsqueeze(1)
    k_pos = torch.arange(seq_len).unsqueeze(0)
    scores = scores.masked_fill(k_pos > q_pos, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.einsum("hqs,shd->qhd", probs, v)


def paged_decode_attention(
    query: torch.Tensor,  # [R, H, D]: one token per request
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [R, B] int32
    seq_lens: torch.Tensor,  # [R] int32, the query token included
    scale: float,
) -> torch.Tensor:  # [R, H, D]
    out = torch.zeros(query.shape, dtype=torch.float32)
    for r, seq_len in enumerate(seq_lens.tolist()):
        if seq_len == 0:  # a padding slot (CUDA-graph batches): defined as zeros
            continue
        k = gather_context(k_cache, block_tables[r], seq_len)
        v = gather_context(v_cache, block_tables[r], seq_len)
        out[r] = _attend(query[r : r + 1], k, v, scale)[0]
    return out.to(query.dtype)


def paged_prefill_attention(
    query: torch.Tensor,  # [T, H, D]: ragged chunks, request r owns [qsl[r], qsl[r+1])
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [R, B] int32
    query_start_loc: torch.Tensor,  # [R + 1] int32
    seq_lens: torch.Tensor,  # [R] int32: cached prefix + this chunk
    scale: float,
) -> torch.Tensor:  # [T, H, D]
    """Causal within each chunk, full over the cached prefix; the chunk's K/V is already cached."""
    out = torch.zeros(query.shape, dtype=torch.float32)
    starts = query_start_loc.tolist()
    for r, seq_len in enumerate(seq_lens.tolist()):
        lo, hi = starts[r], starts[r + 1]
        if hi == lo:
            continue
        k = gather_context(k_cache, block_tables[r], seq_len)
        v = gather_context(v_cache, block_tables[r], seq_len)
        out[lo:hi] = _attend(query[lo:hi], k, v, scale)
    return out.to(query.dtype)


def kv_store(
    key: torch.Tensor,  # [T, KH, D]
    value: torch.Tensor,  # [T, KH, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, KH, D], written in place
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [T] int64; a negative slot means "do not store" (padding)
) -> None:
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    k_cache.view(-1, *k_cache.shape[2:])[slots] = key[keep].to(k_cache.dtype)
    v_cache.view(-1, *v_cache.shape[2:])[slots] = value[keep].to(v_cache.dtype)


def rms_norm(
    x: torch.Tensor,  # [T, hidden]
    weight: torch.Tensor,  # [hidden]
    eps: float,
    residual: torch.Tensor | None = None,  # [T, hidden]
) -> tuple[torch.Tensor, torch.Tensor]:  # (normed [T, hidden], new residual [T, hidden])
    """With a residual: h = x + residual, returns (norm(h), h); without: (norm(x), x)."""
    h = x.float() if residual is None else x.float() + residual.float()
    normed = h * torch.rsqrt(h.pow(2).mean(dim=-1, keepdim=True) + eps) * weight.float()
    return normed.to(x.dtype), h.to(x.dtype)


def rotary_embedding(
    positions: torch.Tensor,  # [T] int
    query: torch.Tensor,  # [T, H, D]
    key: torch.Tensor,  # [T, KH, D]
    cos_sin_cache: torch.Tensor,  # [max_pos, D]: cos in [:, :D/2], sin in [:, D/2:]
    is_neox: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE. Neox style rotates the halves (x[:D/2], x[D/2:]), GPT-J style the pairs (x[0::2], x[1::2])."""
    half = query.shape[-1] // 2
    cos_sin = cos_sin_cache[positions.long()].float()
    cos, sin = cos_sin[:, None, :half], cos_sin[:, None, half:]  # [T, 1, D/2]

    def rotate(x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        x1, x2 = (xf[..., :half], xf[..., half:]) if is_neox else (xf[..., 0::2], xf[..., 1::2])
        o1, o2 = x1 * cos - x2 * sin, x2 * cos + x1 * sin
        out = torch.cat([o1, o2], dim=-1) if is_neox else torch.stack([o1, o2], dim=-1).flatten(-2)
        return out.to(x.dtype)

    return rotate(query), rotate(key)


def rope_cos_sin_cache(max_pos: int, head_dim: int, theta: float = 10000.0) -> torch.Tensor:
    """[max_pos, head_dim] float32: cos | sin of the plain (unscaled) Llama frequencies."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    freqs = torch.outer(torch.arange(max_pos, dtype=torch.float32), inv_freq)
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1)


def _quantize_activations(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, Kp] float32 (zero-padded) -> codes [M, Kp] int, scales [M, Kp / group]: per group
    of `group` columns, round(x * 127 / max|x|) half to even, as the kernel does."""
    m, kp = x.shape
    blocks = x.view(m, kp // group, group)
    amax = blocks.abs().amax(dim=-1).clamp(min=1e-12)  # [M, G]
    # A tensor divided by a tensor, as the kernel's 127.0f / amax: `127.0 / amax` runs as
    # reciprocal-then-multiply, one ulp off at times, which flips rare ties (x * inv == k.5).
    inverse = torch.full_like(amax, 127.0) / amax
    codes = torch.round(blocks * inverse.unsqueeze(-1))
    return codes.view(m, kp), amax / 127.0


def int8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                k: int) -> torch.Tensor:
    """Twin of kernels.cpu.int8_linear: per-row int8 activations times per-channel int8
    weights [N, Kp], summed exactly (float64), scaled; returns x's dtype."""
    kp = weight.shape[1]
    xf = torch.nn.functional.pad(x.float(), (0, kp - k))
    codes, x_scale = _quantize_activations(xf, kp)  # one group: the whole row
    dots = codes.double() @ weight.double().t()  # [M, N], exact
    return (dots * x_scale.double() * scale.double()).to(x.dtype)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """[N, Kp / 2] uint8 -> [N, Kp] codes 0..15: byte j of each 16-byte group holds element j
    of the group's 32 in its low nibble and element j + 16 in its high nibble."""
    n, half = packed.shape
    groups = packed.view(n, half // 16, 16).long()
    return torch.cat((groups & 0x0F, groups >> 4), dim=-1).view(n, 2 * half)


def int4_linear(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor,
                minimum: torch.Tensor, k: int) -> torch.Tensor:
    """Twin of kernels.cpu.int4_linear: weights d * q + min per group of 32 (Q4_1), int8
    activations with one scale per group of 32 (Q8_1); returns x's dtype."""
    group = 32
    n, kp = packed.shape[0], 2 * packed.shape[1]
    xf = torch.nn.functional.pad(x.float(), (0, kp - k))
    codes, x_scale = _quantize_activations(xf, group)  # [M, Kp], [M, G]
    q = unpack_int4(packed).double().view(n, kp // group, group)  # [N, G, 32]
    c = codes.double().view(-1, kp // group, group)  # [M, G, 32]
    dots = torch.einsum("mgk,ngk->mng", c, q)  # [M, N, G], exact
    x_sum = x_scale.double() * c.sum(-1)  # [M, G]
    y = (dots * x_scale.double().unsqueeze(1) * scale.double().unsqueeze(0)).sum(-1)
    y = y + x_sum @ minimum.double().t()
    return y.to(x.dtype)


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Twin of kernels.fp8.fp8_linear: activations to e4m3 per row (amax / 448), the product
    of the dequantized operands in float64; returns x's dtype."""
    x_scale = x.abs().amax(dim=1, keepdim=True).float().clamp(min=1e-12) / 448.0
    codes = (x.float() / x_scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    xd = codes.double() * x_scale.double()
    wd = weight.double() * scale.double().unsqueeze(1)
    return (xd @ wd.t()).to(x.dtype)


def dequantize_int4_wo(packed: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor,
                       k: int, dtype: torch.dtype) -> torch.Tensor:
    """A weight-only int4 weight [N, K] in `dtype`: `scale * code + minimum` computed exactly
    (float64) and rounded once to float32, as the kernel's fma does, then to the scale's dtype
    (the checkpoint library's dequantization) and to `dtype`."""
    n, kp = packed.shape[0], 2 * packed.shape[1]
    codes = unpack_int4(packed).double().view(n, kp // 32, 32)
    exact = codes * scale.double().unsqueeze(-1) + minimum.double().unsqueeze(-1)
    return exact.float().to(scale.dtype).to(dtype).view(n, kp)[:, :k]


def dequantize_int8_wo(rows: torch.Tensor, scale: torch.Tensor, k: int,
                       dtype: torch.dtype) -> torch.Tensor:
    """A weight-only int8 weight [N, K] in `dtype`: `scale * code` rounded as
    dequantize_int4_wo's."""
    exact = rows[:, :k].double() * scale.double().unsqueeze(1)
    return exact.float().to(scale.dtype).to(dtype)


def int4_linear_wo(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor,
                   minimum: torch.Tensor, k: int) -> torch.Tensor:
    """Twin of kernels.cpu.int4_linear_wo: float activations as they are times the dequantized
    weights in x's dtype, summed in float32; returns x's dtype."""
    w = dequantize_int4_wo(packed, scale, minimum, k, x.dtype)
    return (x.float() @ w.float().t()).to(x.dtype)


def int8_linear_wo(x: torch.Tensor, rows: torch.Tensor, scale: torch.Tensor,
                   k: int) -> torch.Tensor:
    """Twin of kernels.cpu.int8_linear_wo, as int4_linear_wo's."""
    w = dequantize_int8_wo(rows, scale, k, x.dtype)
    return (x.float() @ w.float().t()).to(x.dtype)
