"""`BlockPool`: the fixed set of KV blocks, their reference counts and the prefix cache.

Torch-free bookkeeping (docs/architecture.md, rule 3), after vLLM v1's `block_pool.py`. Every block is either held
(`ref_cnt > 0`, in one or more requests' block tables) or free (in the free queue). Free blocks
that carry a hash are the prefix cache: they keep their K/V until memory is needed, and are then
evicted least-recently-freed first. Block 0 is reserved as the null block: it is never handed out,
so the runner may pad block tables and slot mappings with 0 without corrupting any request's K/V.

Every change to the set of cached hashes is also recorded as a `KVCacheEvent` (vLLM's KV cache
events: a block stored, a block removed, all cleared) until `take_events` drains them; the front
end mirrors them for the gateway's precise prefix routing (frontend/prefix_cache_view.py).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from kvasir_engine.kv.block import KVCacheBlock
from kvasir_engine.kv.free_block_queue import FreeBlockQueue
from kvasir_engine.kv.hashing import BlockHash

NULL_BLOCK_ID = 0
# (kind, hash): kind is STORED or REMOVED with the block's hash, or CLEARED with None.
STORED, REMOVED, CLEARED = "stored", "removed", "cleared"
KVCacheEvent = tuple[str, BlockHash | None]


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool) -> None:
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (block 0 is the reserved null block), "
                             f"got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(block_id) for block_id in range(num_blocks)]
        self.null_block = self.blocks[NULL_BLOCK_ID]
        self.null_block.ref_cnt = 1  # held forever, so never queued, evicted or freed
        self.free_block_queue = FreeBlockQueue(self.blocks[1:])
        self.hash_to_block: dict[BlockHash, KVCacheBlock] = {}
        self._events: list[KVCacheEvent] = []

    @property
    def num_usable_blocks(self) -> int:
        """Blocks requests can hold: all but the null block."""
        return self.num_blocks - 1

    @property
    def num_free_blocks(self) -> int:
        """Blocks nobody holds, including cached ones that can be evicted."""
        return len(self.free_block_queue)

    @property
    def usage(self) -> float:
        """Fraction of usable blocks held by requests, 0..1 (cached free blocks count as free)."""
        return 1.0 - self.num_free_blocks / self.num_usable_blocks

    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        if not self.enable_caching:
            return None
        return self.hash_to_block.get(block_hash)

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Take `num_blocks` free blocks (ref_cnt 1 each), evicting the least recently freed."""
        if num_blocks > self.num_free_blocks:
            raise ValueError(f"cannot get {num_blocks} blocks: only {self.num_free_blocks} free")
        new_blocks = []
        for _ in range(num_blocks):
            block = self.free_block_queue.popleft()
            self._evict(block)
            block.ref_cnt = 1
            new_blocks.append(block)
        return new_blocks

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """One more holder for each block (a prefix-cache hit); free ones leave the free queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_block_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """One holder fewer for each block; blocks nobody holds become free.

        `ordered_blocks` is in eviction order: among cached blocks, earlier ones are evicted
        first. Uncached blocks go to the front of the queue: keeping them buys nothing.
        """
        for block in ordered_blocks:
            if block.ref_cnt <= 0 or block is self.null_block:
                raise ValueError(f"block {block.block_id} freed more often than it was taken")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if block.block_hash is None:
                    self.free_block_queue.appendleft(block)
                else:
                    self.free_block_queue.append(block)

    def cache_full_blocks(self, blocks: Sequence[KVCacheBlock], block_hashes: Sequence[BlockHash],
                          num_cached_blocks: int, num_full_blocks: int) -> None:
        """Key blocks `[num_cached_blocks, num_full_blocks)` of a request by their hashes.

        `blocks` is the request's block table and `block_hashes[i]` the hash of its block i.
        When another block already holds the same prefix (two requests computed it at once),
        the first one stays the cached copy and this one is left unkeyed.
        """
        if not self.enable_caching:
            return
        if num_full_blocks > min(len(blocks), len(block_hashes)):
            raise ValueError(f"cannot cache {num_full_blocks} full blocks: the request has "
                             f"{len(blocks)} blocks and {len(block_hashes)} block hashes")
        for block, block_hash in zip(blocks[num_cached_blocks:num_full_blocks],
                                     block_hashes[num_cached_blocks:num_full_blocks],
                                     strict=True):
            if block.block_hash is not None:
                continue  # a prefix-cache hit: already keyed
            if block_hash not in self.hash_to_block:
                block.block_hash = block_hash
                self.hash_to_block[block_hash] = block
                self._events.append((STORED, block_hash))

    def uncache(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Forget these blocks' hashes (their contents are not what the hash says)."""
        for block in blocks:
            self._evict(block)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block; refused (False) while any request holds a block."""
        if self.num_free_blocks != self.num_usable_blocks:
            return False
        for block in self.blocks[1:]:
            block.block_hash = None
        self.hash_to_block.clear()
        self._events.append((CLEARED, None))
        return True

    def take_events(self) -> list[KVCacheEvent]:
        """The cache changes since the previous call, oldest first."""
        events, self._events = self._events, []
        return events

    def _evict(self, block: KVCacheBlock) -> None:
        if block.block_hash is None:
            return
        if self.hash_to_block.get(block.block_hash) is block:
            del self.hash_to_block[block.block_hash]
            self._events.append((REMOVED, block.block_hash))
        block.block_hash = None
