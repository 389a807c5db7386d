"""One KV block as bytes, out of and into the paged cache: the only torch in kv_transfer/.

A block's payload is K then V of each layer in turn, each `[block_size, num_kv_heads, head_dim]`
in the cache's dtype (float32, bfloat16, ...: the bytes as stored, so any dtype goes through).
Both sides agreed on the layout in the handshake (wire.py), so the byte counts match.
"""

from __future__ import annotations

import torch

from kvasir_engine.config import EngineConfig

# One (K, V) pair per layer, each [num_blocks, block_size, num_kv_heads, head_dim].
KVCaches = list[tuple[torch.Tensor, torch.Tensor]]


def block_nbytes(kv_caches: KVCaches) -> int:
    k = kv_caches[0][0]
    return 2 * len(kv_caches) * k[0].numel() * k.element_size()


def shard_nbytes(config: EngineConfig) -> int:
    """`block_nbytes` of one tensor-parallel rank's cache, from the config alone (its KV heads:
    a share of the model's, or one replicated when the ranks outnumber them)."""
    arch, tp = config.model.arch, config.parallel.tensor_parallel_size
    itemsize = getattr(torch, config.cache.resolved_kv_cache_dtype(config.model.dtype)).itemsize
    num_kv_heads = max(1, arch.num_key_value_heads // tp)
    return (2 * arch.num_hidden_layers * config.cache.block_size * num_kv_heads * arch.head_dim
            * int(itemsize))


def read_block(kv_caches: KVCaches, block_id: int) -> bytes:
    """[2 x num_layers, block_size, heads, head_dim] of one block, as bytes."""
    parts = torch.stack([t[block_id] for k, v in kv_caches for t in (k, v)])
    return bytes(parts.to("cpu").contiguous().view(torch.uint8).numpy().tobytes())


def write_block(kv_caches: KVCaches, block_id: int, payload: bytearray) -> None:
    """The inverse of `read_block`, into block `block_id` of this cache."""
    k0 = kv_caches[0][0]
    flat = torch.frombuffer(payload, dtype=torch.uint8).view(k0.dtype).view(
        2 * len(kv_caches), *k0.shape[1:])
    for i, (k, v) in enumerate(kv_caches):
        k[block_id].copy_(flat[2 * i])
        v[block_id].copy_(flat[2 * i + 1])
