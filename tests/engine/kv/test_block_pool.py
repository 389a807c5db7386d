"""BlockPool: ref counts, LRU free queue, prefix-cache map; a stateful model-based check."""

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from kvasir_engine.kv.block import KVCacheBlock
from kvasir_engine.kv.block_pool import NULL_BLOCK_ID, BlockPool
from kvasir_engine.kv.hashing import BlockHash


def _hash(n: int) -> BlockHash:
    return BlockHash(n.to_bytes(8, "little"))


def test_null_block_is_never_handed_out() -> None:
    pool = BlockPool(4, enable_caching=True)
    assert pool.num_free_blocks == 3
    blocks = pool.get_new_blocks(3)
    assert NULL_BLOCK_ID not in [b.block_id for b in blocks]
    assert pool.usage == 1.0
    with pytest.raises(ValueError, match="only 0 free"):
        pool.get_new_blocks(1)
    with pytest.raises(ValueError, match="num_blocks"):
        BlockPool(1, enable_caching=True)


def test_cached_blocks_are_evicted_least_recently_freed_first() -> None:
    pool = BlockPool(5, enable_caching=True)
    a, b, c, d = pool.get_new_blocks(4)
    pool.cache_full_blocks([a, b, c], [_hash(1), _hash(2), _hash(3)], 0, 3)
    pool.free_blocks([c, b])  # c freed first: c is the older entry
    pool.free_blocks([a, d])  # d is uncached: evicted before any cached block
    assert pool.usage == 0.0
    assert [blk.block_id for blk in pool.get_new_blocks(2)] == [d.block_id, c.block_id]
    assert pool.get_cached_block(_hash(3)) is None  # evicted
    assert pool.get_cached_block(_hash(2)) is b
    pool.touch([b])  # a hit takes it out of the free queue
    assert pool.get_new_blocks(1) == [a]
    assert pool.num_free_blocks == 0


def test_duplicate_hash_keeps_first_copy() -> None:
    pool = BlockPool(3, enable_caching=True)
    a, b = pool.get_new_blocks(2)
    pool.cache_full_blocks([a], [_hash(7)], 0, 1)
    pool.cache_full_blocks([b], [_hash(7)], 0, 1)
    assert pool.get_cached_block(_hash(7)) is a and b.block_hash is None


def test_caching_disabled_never_hits() -> None:
    pool = BlockPool(3, enable_caching=False)
    (a,) = pool.get_new_blocks(1)
    pool.cache_full_blocks([a], [_hash(1)], 0, 1)
    assert pool.get_cached_block(_hash(1)) is None


def test_double_free_is_refused() -> None:
    pool = BlockPool(3, enable_caching=True)
    (a,) = pool.get_new_blocks(1)
    pool.free_blocks([a])
    with pytest.raises(ValueError, match="freed more often"):
        pool.free_blocks([a])


class BlockPoolMachine(RuleBasedStateMachine):
    """Owners hold blocks; the model predicts ref counts, the free-queue order and the cache."""

    def __init__(self) -> None:
        super().__init__()
        self.pool = BlockPool(9, enable_caching=True)
        self.owners: dict[int, list[KVCacheBlock]] = {}
        self.next_owner = 0
        self.next_hash = 0
        # Model of the free queue, head (evicted next) first, and of the cache map.
        self.model_queue: list[int] = list(range(1, 9))
        self.model_cache: dict[BlockHash, int] = {}

    @rule(n=st.integers(min_value=0, max_value=4))
    def allocate(self, n: int) -> None:
        if n > len(self.model_queue):
            with pytest.raises(ValueError):
                self.pool.get_new_blocks(n)
            return
        blocks = self.pool.get_new_blocks(n)
        expected, self.model_queue = self.model_queue[:n], self.model_queue[n:]
        assert [b.block_id for b in blocks] == expected
        self.model_cache = {h: i for h, i in self.model_cache.items() if i not in expected}
        self.owners[self.next_owner] = blocks
        self.next_owner += 1

    @precondition(lambda self: self.model_cache)
    @rule(data=st.data())
    def hit(self, data: st.DataObject) -> None:
        block_hash = data.draw(st.sampled_from(sorted(self.model_cache)))
        block = self.pool.get_cached_block(block_hash)
        assert block is not None and block.block_id == self.model_cache[block_hash]
        self.pool.touch([block])
        if block.block_id in self.model_queue:
            self.model_queue.remove(block.block_id)
        self.owners[self.next_owner] = [block]
        self.next_owner += 1

    @precondition(lambda self: self.owners)
    @rule(data=st.data())
    def cache(self, data: st.DataObject) -> None:
        owner = data.draw(st.sampled_from(sorted(self.owners)))
        blocks = self.owners[owner]
        hashes = [_hash(self.next_hash + i) for i in range(len(blocks))]
        self.next_hash += len(blocks)
        self.pool.cache_full_blocks(blocks, hashes, 0, len(blocks))
        for block, block_hash in zip(blocks, hashes, strict=True):
            if block.block_id not in self.model_cache.values():
                self.model_cache[block_hash] = block.block_id

    @precondition(lambda self: self.owners)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        owner = data.draw(st.sampled_from(sorted(self.owners)))
        blocks = self.owners.pop(owner)
        self.pool.free_blocks(reversed(blocks))
        held = {b.block_id for bs in self.owners.values() for b in bs}
        cached = set(self.model_cache.values())
        for block in reversed(blocks):
            if block.block_id in held:
                continue
            if block.block_id in cached:
                self.model_queue.append(block.block_id)
            else:
                self.model_queue.insert(0, block.block_id)

    @invariant()
    def matches_model(self) -> None:
        pool = self.pool
        holders: dict[int, int] = {}
        for blocks in self.owners.values():
            ids = [b.block_id for b in blocks]
            assert len(ids) == len(set(ids)), "an owner holds a block twice"
            for block_id in ids:
                holders[block_id] = holders.get(block_id, 0) + 1
        for block in pool.blocks[1:]:
            assert block.ref_cnt == holders.get(block.block_id, 0)
        assert [b.block_id for b in pool.free_block_queue] == self.model_queue
        assert len(pool.free_block_queue) == pool.num_free_blocks
        # Every usable block is held or free, never both, never neither: nothing leaks.
        assert set(holders).isdisjoint(self.model_queue)
        assert set(holders) | set(self.model_queue) == set(range(1, 9))
        assert {h: b.block_id for h, b in pool.hash_to_block.items()} == self.model_cache
        assert all(b.block_hash == h for h, b in pool.hash_to_block.items())
        assert pool.usage == pytest.approx(len(holders) / 8)

    def teardown(self) -> None:
        for owner in sorted(self.owners):
            self.pool.free_blocks(self.owners[owner])
        assert all(b.ref_cnt == 0 for b in self.pool.blocks[1:])
        assert self.pool.num_free_blocks == 8


TestBlockPoolMachine = BlockPoolMachine.TestCase
TestBlockPoolMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


def test_cache_changes_are_recorded_as_events_until_taken() -> None:
    pool = BlockPool(4, enable_caching=True)
    a, b, c = pool.get_new_blocks(3)
    pool.cache_full_blocks([a, b], [_hash(1), _hash(2)], 0, 2)
    pool.cache_full_blocks([c], [_hash(1)], 0, 1)  # the same prefix twice: one copy, one event
    assert pool.take_events() == [("stored", _hash(1)), ("stored", _hash(2))]
    assert pool.take_events() == []
    pool.free_blocks([b, a, c])
    pool.get_new_blocks(2)  # c (uncached) first, then b: evicted
    assert pool.take_events() == [("removed", _hash(2))]
    pool.free_blocks([blk for blk in pool.blocks[1:] if blk.ref_cnt])
    assert pool.reset_prefix_cache()
    assert pool.take_events() == [("cleared", None)]
