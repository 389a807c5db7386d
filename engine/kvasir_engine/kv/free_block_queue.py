"""`FreeBlockQueue`: the blocks nobody holds, least recently freed first.

An intrusive doubly linked list (the links live on `KVCacheBlock`) so that taking a block back
out of the middle on a prefix-cache hit is O(1), like popping the head for eviction. An
`OrderedDict` would do the same work with a hash lookup and an extra object per block.
"""

from __future__ import annotations

from collections.abc import Iterator

from kvasir_engine.kv.block import KVCacheBlock


class FreeBlockQueue:
    def __init__(self, blocks: list[KVCacheBlock]) -> None:
        # Sentinels keep every insert and unlink free of head/tail special cases.
        self._head = KVCacheBlock(block_id=-1)
        self._tail = KVCacheBlock(block_id=-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free_blocks = 0
        for block in blocks:
            self.append(block)

    def __len__(self) -> int:
        return self.num_free_blocks

    def __iter__(self) -> Iterator[KVCacheBlock]:
        node = self._head.next_free
        while node is not None and node is not self._tail:
            yield node
            node = node.next_free

    def popleft(self) -> KVCacheBlock:
        block = self._head.next_free
        if block is None or block is self._tail:
            raise ValueError("no free blocks left")
        self.remove(block)
        return block

    def append(self, block: KVCacheBlock) -> None:
        """Queue `block` last: evicted after every block already queued."""
        self._insert_between(block, self._tail.prev_free, self._tail)

    def appendleft(self, block: KVCacheBlock) -> None:
        """Queue `block` first: evicted before anything else (it caches nothing)."""
        self._insert_between(block, self._head, self._head.next_free)

    def remove(self, block: KVCacheBlock) -> None:
        prev_block, next_block = block.prev_free, block.next_free
        if prev_block is None or next_block is None:
            raise ValueError(f"block {block.block_id} is not in the free queue")
        prev_block.next_free = next_block
        next_block.prev_free = prev_block
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def _insert_between(self, block: KVCacheBlock, prev_block: KVCacheBlock | None,
                        next_block: KVCacheBlock | None) -> None:
        if block.prev_free is not None or block.next_free is not None:
            raise ValueError(f"block {block.block_id} is already in the free queue")
        if prev_block is None or next_block is None:
            raise RuntimeError("free queue links are broken")
        block.prev_free, block.next_free = prev_block, next_block
        prev_block.next_free = block
        next_block.prev_free = block
        self.num_free_blocks += 1
