"""`KVCacheBlock` (one block of the paged KV cache) and `KVCacheBlocks` (an ordered run of them).

A block is bookkeeping only: its id indexes the runner's KV tensors
(`[num_blocks, block_size, num_kv_heads, head_dim]`); no tensor lives here. A block with
`ref_cnt == 0` sits in the pool's free queue; if it also has a `block_hash` its K/V is still valid
and a later request with the same prefix may take it back (a prefix-cache hit) until it is
evicted.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvasir_engine.kv.hashing import BlockHash


@dataclass(eq=False)
class KVCacheBlock:
    block_id: int
    # Requests that hold this block in their block table.
    ref_cnt: int = 0
    # Set once the block is full and cached; cleared when it is evicted.
    block_hash: BlockHash | None = None
    # Links of the free queue (owned by FreeBlockQueue); None while not queued.
    prev_free: KVCacheBlock | None = field(default=None, repr=False)
    next_free: KVCacheBlock | None = field(default=None, repr=False)


@dataclass(frozen=True)
class KVCacheBlocks:
    """Blocks handed to or found for one request, in block-table order."""

    blocks: tuple[KVCacheBlock, ...] = ()

    def __add__(self, other: KVCacheBlocks) -> KVCacheBlocks:
        return KVCacheBlocks(self.blocks + other.blocks)

    def __len__(self) -> int:
        return len(self.blocks)

    def get_block_ids(self) -> list[int]:
        return [block.block_id for block in self.blocks]
