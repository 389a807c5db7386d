"""Rotary position embedding (rotate-half form, as Hugging Face checkpoints expect).

Frequencies follow transformers exactly, including Llama 3's piecewise scaling ("llama3":
low frequencies divided by `factor`, high ones kept, a smooth blend between) and linear scaling.
cos/sin are precomputed for every position up to max_position_embeddings and gathered once per
forward pass (not once per layer), so a ragged batch needs no per-request work. `impl` comes
from the process's `KernelChoice` (kernels/choice.py), given at construction: with "triton"
(the Triton attention backend on CUDA) query and key are rotated in place by one Triton launch
from a [max_position, head_dim] table of cos then sin of the head_dim / 2 frequencies; with
"native" (x86 CPUs, float32/bfloat16) the torch rotation below runs as one call of
kernels/cpu.py over query and key, in place, from the same tables.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn

from kvasir_engine.checkpoint.arch import RopeScaling
from kvasir_engine.kernels import cpu


def inv_frequencies(head_dim: int, theta: float, scaling: RopeScaling) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor
    if scaling.rope_type != "llama3":
        return inv_freq
    old_len = scaling.original_max_position_embeddings
    low_wavelen = old_len / scaling.low_freq_factor
    high_wavelen = old_len / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old_len / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor)
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    is_medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    # Buffers (register_buffer below): `cos_sin_cache` for the Triton kernel, else the other two.
    cos_sin_cache: torch.Tensor
    cos_cached: torch.Tensor
    sin_cached: torch.Tensor

    def __init__(self, head_dim: int, max_position: int, theta: float,
                 scaling: RopeScaling | None = None, impl: str = "torch"):
        super().__init__()
        if impl not in ("torch", "native", "triton"):
            raise ValueError(f"RotaryEmbedding impl must be torch, native or triton, got {impl!r}")
        self.impl = impl
        inv_freq = inv_frequencies(head_dim, theta, scaling or RopeScaling())
        t = torch.arange(max_position, dtype=torch.int64).float()
        freqs = torch.outer(t, inv_freq)  # [max_position, head_dim / 2]
        self.kernel: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = None
        if impl == "triton":
            # Imported here: triton is only needed (and only present) where kernels run.
            from kvasir_engine.kernels.rotary import rotary_embedding

            self.kernel = rotary_embedding
            cos_sin = torch.cat((freqs.cos(), freqs.sin()), dim=-1)
            self.register_buffer("cos_sin_cache", cos_sin, persistent=False)
            return
        # cos over the whole head; sin with the first half negated, so that
        # x * cos + rotate_half(x) * sin == x * cos + swap_halves(x) * signed_sin.
        self.register_buffer("cos_cached", torch.cat((freqs, freqs), dim=-1).cos(),
                             persistent=False)
        self.register_buffer("sin_cached", torch.cat((-freqs.sin(), freqs.sin()), dim=-1),
                             persistent=False)
        # The last step's cos/sin rows in the activation dtype: every layer of a forward pass
        # gets the same positions tensor, so only the first layer gathers and casts them.
        self._step: tuple[torch.Tensor, torch.dtype, torch.Tensor, torch.Tensor] | None = None

    def forward(self, positions: torch.Tensor, query: torch.Tensor,
                key: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T]; query [T, H, D]; key [T, Hkv, D] -> rotated (same shapes and dtype)."""
        if self.kernel is not None:
            return self.kernel(positions, query, key, self.cos_sin_cache)
        if self.impl == "native":
            return cpu.rotary_(positions, query, key, self.cos_cached, self.sin_cached)
        cos, sin = self._cos_sin(positions, query.dtype)
        return _rotate(query, cos, sin), _rotate(key, cos, sin)

    def _cos_sin(self, positions: torch.Tensor,
                 dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        if self._step is None or self._step[0] is not positions or self._step[1] != dtype:
            cos = self.cos_cached.index_select(0, positions).to(dtype).unsqueeze(1)  # [T, 1, D]
            sin = self.sin_cached.index_select(0, positions).to(dtype).unsqueeze(1)
            self._step = (positions, dtype, cos, sin)
        return self._step[2], self._step[3]


def _rotate(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    swapped = torch.cat((x[..., half:], x[..., :half]), dim=-1)
    return torch.addcmul(x * cos, swapped, signed_sin)
