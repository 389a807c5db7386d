"""The model's RMSNorm and RotaryEmbedding layers with their fused Triton kernels (the CUDA path)
against the same layers' torch path (the CPU path), under the interpreter on CPU."""

from __future__ import annotations

import pytest
import torch
from kernel_cases import DEVICE, DTYPES, assert_close
from kvasir_engine.checkpoint.arch import RopeScaling
from kvasir_engine.layers.norm import RMSNorm
from kvasir_engine.layers.rotary import RotaryEmbedding

LLAMA3 = RopeScaling(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                     original_max_position_embeddings=64)


def _norm_pair(hidden: int, dtype: torch.dtype, gen: torch.Generator) -> tuple[RMSNorm, RMSNorm]:
    weight = torch.randn(hidden, generator=gen)
    layers = (RMSNorm(hidden, 1e-5), RMSNorm(hidden, 1e-5, impl="triton"))
    for layer in layers:
        layer.weight.data.copy_(weight)
    torch_path, fused = (layer.to(device=DEVICE, dtype=dtype) for layer in layers)
    return torch_path, fused


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [64, 96])  # 96: a row shorter than its power-of-two block
@pytest.mark.parametrize("with_residual", [False, True])
def test_rmsnorm_kernel_matches_torch_layer(dtype: torch.dtype, hidden: int,
                                            with_residual: bool) -> None:
    gen = torch.Generator().manual_seed(hidden)
    torch_path, fused = _norm_pair(hidden, dtype, gen)
    x = torch.randn(5, hidden, generator=gen).to(DEVICE, dtype)
    residual = torch.randn(5, hidden, generator=gen).to(DEVICE, dtype) if with_residual else None
    with torch.inference_mode():
        expected, expected_residual = torch_path(x, residual)
        got, got_residual = fused(x, residual)
    assert got.dtype == dtype and got.shape == x.shape
    assert_close(got, expected)
    assert_close(got_residual, expected_residual)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("scaling", [None, LLAMA3], ids=["default", "llama3"])
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"), [(4, 1, 64), (3, 3, 32)])
def test_rotary_kernel_matches_torch_layer(dtype: torch.dtype, scaling: RopeScaling | None,
                                           num_heads: int, num_kv_heads: int,
                                           head_dim: int) -> None:
    gen = torch.Generator().manual_seed(head_dim + num_heads)
    layers = (RotaryEmbedding(head_dim, 256, 500000.0, scaling),
              RotaryEmbedding(head_dim, 256, 500000.0, scaling, impl="triton"))
    torch_path, fused = (layer.to(DEVICE) for layer in layers)
    positions = torch.tensor([0, 1, 63, 64, 255, 7], device=DEVICE)
    # q and k as views of one fused QKV output, as the attention layer hands them over.
    qkv = torch.randn(6, num_heads + 2 * num_kv_heads, head_dim, generator=gen).to(DEVICE, dtype)
    q, k = qkv[:, :num_heads], qkv[:, num_heads:num_heads + num_kv_heads]
    with torch.inference_mode():
        expected_q, expected_k = torch_path(positions, q.clone(), k.clone())
        got_q, got_k = fused(positions, q, k)
    assert got_q.data_ptr() == q.data_ptr()  # rotated in place, no copy
    assert_close(got_q, expected_q)
    assert_close(got_k, expected_k)


def test_torch_path_is_the_default() -> None:
    assert RMSNorm(8).kernel is None
    assert RotaryEmbedding(16, 8, 10000.0).kernel is None


def test_model_on_the_triton_backend_uses_the_fused_layers(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A tiny Llama built on the Triton backend runs every norm and the rotary fused, and its
    prefill hidden states match the torch-backend model's."""
    from helpers import write_checkpoint
    from kvasir_engine.attention.metadata import AttentionMetadata
    from kvasir_engine.checkpoint.loader import load_weights
    from kvasir_engine.checkpoint.metadata import read_model_arch
    from kvasir_engine.kernels.choice import KernelChoice
    from kvasir_engine.models.llama import LlamaForCausalLM

    path = write_checkpoint(tmp_path / "m", "llama3")
    arch = read_model_arch(path)
    num_tokens, block_size = 6, 16
    meta = AttentionMetadata(
        slot_mapping=torch.arange(block_size, block_size + num_tokens),
        query_start_loc=torch.tensor([0, num_tokens], dtype=torch.int32),
        seq_lens=torch.tensor([num_tokens], dtype=torch.int32),
        block_tables=torch.tensor([[1]], dtype=torch.int32), max_query_len=num_tokens,
        max_seq_len=num_tokens, query_start_loc_cpu=(0, num_tokens), seq_lens_cpu=(num_tokens,),
        is_decode_only=False)
    ids, positions = torch.tensor([5, 9, 2, 7, 7, 1]), torch.arange(num_tokens)
    hidden = []
    triton = KernelChoice(attention_backend="triton", decode_attention="triton", norm="triton",
                          rotary="triton")
    for kernels in (KernelChoice(), triton):
        model = LlamaForCausalLM(arch, kernels)
        load_weights(model, str(path), arch)
        shape = (2, block_size, arch.num_key_value_heads, arch.head_dim)
        caches = [(torch.zeros(shape), torch.zeros(shape)) for _ in range(arch.num_hidden_layers)]
        with torch.inference_mode():
            hidden.append(model.eval()(ids, positions, caches, meta))
    fused_norms = [m.kernel is not None for m in model.modules() if isinstance(m, RMSNorm)]
    assert fused_norms and all(fused_norms)
    assert model.model.layers[0].self_attn.rotary.kernel is not None
    torch.testing.assert_close(hidden[1], hidden[0], atol=1e-4, rtol=1e-4)
