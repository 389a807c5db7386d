"""KVCacheManager: block tables, prefix hits, allocation failure; a stateful brute-force check."""

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from kvasir_engine.core.request import Request, SamplingParams
from kvasir_engine.kv.kv_cache_manager import KVCacheManager, kv_memory_waste

BLOCK_SIZE = 2
MAX_MODEL_LEN = 40
PARAMS = SamplingParams(max_tokens=MAX_MODEL_LEN)


def _request(request_id: str, token_ids: list[int], cache_salt: str | None = None) -> Request:
    return Request(request_id, list(token_ids), PARAMS, cache_salt=cache_salt)


def _prefill(manager: KVCacheManager, request: Request) -> list[int]:
    """Admit and fully compute a request's prompt; return its block ids."""
    hits, num_hit_tokens = manager.get_computed_blocks(request)
    assert manager.allocate_slots(request, request.num_tokens - num_hit_tokens, hits) is not None
    request.num_computed_tokens = request.num_tokens
    return manager.get_block_ids(request.request_id)


def test_prefix_hit_reuses_blocks_but_never_the_last_token() -> None:
    manager = KVCacheManager(16, 4, enable_caching=True, max_model_len=64)
    first = _prefill(manager, _request("a", list(range(8))))
    manager.make_prefix_cache_stats()
    same = _request("b", list(range(8)))
    hits, num_hit_tokens = manager.get_computed_blocks(same)
    assert (hits.get_block_ids(), num_hit_tokens) == (first[:1], 4)  # not both: 8th token recomputed
    longer = _request("c", list(range(9)))
    hits, num_hit_tokens = manager.get_computed_blocks(longer)
    assert (hits.get_block_ids(), num_hit_tokens) == (first, 8)
    _prefill(manager, longer)
    stats = manager.make_prefix_cache_stats()
    assert (stats.num_queries, stats.num_hits) == (9, 8)
    assert manager.make_prefix_cache_stats().num_queries == 0


def test_salt_and_disabled_caching_give_no_hits() -> None:
    manager = KVCacheManager(16, 4, enable_caching=True, max_model_len=64)
    _prefill(manager, _request("a", list(range(9)), cache_salt="x"))
    assert manager.get_computed_blocks(_request("b", list(range(9)), cache_salt="y"))[1] == 0
    assert manager.get_computed_blocks(_request("c", list(range(9))))[1] == 0
    assert manager.get_computed_blocks(_request("d", list(range(9)), cache_salt="x"))[1] == 8
    plain = KVCacheManager(16, 4, enable_caching=False, max_model_len=64)
    _prefill(plain, _request("a", list(range(9))))
    assert plain.get_computed_blocks(_request("b", list(range(9))))[1] == 0


def test_allocation_failure_changes_nothing() -> None:
    manager = KVCacheManager(4, 4, enable_caching=True, max_model_len=64)  # 3 usable blocks
    _prefill(manager, _request("a", list(range(8))))
    big = _request("b", list(range(100, 108)))
    assert manager.allocate_slots(big, 8) is None
    assert manager.num_free_blocks == 1 and manager.get_block_ids("b") == []
    assert manager.max_num_tokens == 12
    with pytest.raises(ValueError, match="max_model_len"):
        manager.allocate_slots(_request("c", [1]), 65)


def test_free_evicts_tail_blocks_first() -> None:
    manager = KVCacheManager(4, 2, enable_caching=True, max_model_len=64)  # 3 usable blocks
    a = _request("a", list(range(6)))
    table = _prefill(manager, a)
    manager.free(a)
    # Needing one block evicts the tail (block 3 of "a"), so a 2-block prefix still hits.
    _prefill(manager, _request("b", [50, 51]))
    hits, _ = manager.get_computed_blocks(_request("c", list(range(6))))
    assert hits.get_block_ids() == table[:2]


def test_decode_growth_and_memory_waste() -> None:
    manager = KVCacheManager(8, 4, enable_caching=True, max_model_len=64)
    request = _request("a", list(range(5)))
    _prefill(manager, request)
    assert manager.num_unfilled_slots(request) == 3
    for token in range(4):
        request.append_output_token_ids([token])
        assert manager.allocate_slots(request, 1) is not None
        request.num_computed_tokens += 1
    assert len(manager.get_block_ids("a")) == 3 and manager.num_unfilled_slots(request) == 3
    assert kv_memory_waste(3, 9, 4) == pytest.approx(0.25)
    assert kv_memory_waste(0, 0, 4) == 0.0


class KVCacheManagerMachine(RuleBasedStateMachine):
    """Requests over a 3-token alphabet share prefixes often; a brute-force model of which
    full-block prefixes each block holds predicts every prefix hit exactly."""

    def __init__(self) -> None:
        super().__init__()
        self.manager = KVCacheManager(10, BLOCK_SIZE, enable_caching=True,
                                      max_model_len=MAX_MODEL_LEN)
        self.requests: dict[str, Request] = {}
        self.next_id = 0
        # block id -> (salt, prefix tokens) it holds the K/V of, for keyed blocks.
        self.block_to_prefix: dict[int, tuple[str | None, tuple[int, ...]]] = {}
        self.prefix_to_block: dict[tuple[str | None, tuple[int, ...]], int] = {}

    def _prefix(self, request: Request, num_blocks: int) -> tuple[str | None, tuple[int, ...]]:
        return request.cache_salt, tuple(request.all_token_ids[:num_blocks * BLOCK_SIZE])

    def _after_allocation(self, request: Request, new_block_ids: list[int], start: int,
                          end: int) -> None:
        """Model one allocation that covers tokens [start, end) of the request."""
        for block_id in new_block_ids:  # a block handed out again loses what it cached
            prefix = self.block_to_prefix.pop(block_id, None)
            if prefix is not None and self.prefix_to_block.get(prefix) == block_id:
                del self.prefix_to_block[prefix]
        table = self.manager.get_block_ids(request.request_id)
        # Only blocks that became full in this allocation are keyed (none are re-keyed later).
        for i in range(start // BLOCK_SIZE, min(end, request.num_tokens) // BLOCK_SIZE):
            prefix = self._prefix(request, i + 1)
            if table[i] not in self.block_to_prefix and prefix not in self.prefix_to_block:
                self.block_to_prefix[table[i]] = prefix
                self.prefix_to_block[prefix] = table[i]

    @rule(tokens=st.lists(st.integers(0, 2), min_size=1, max_size=14),
          salt=st.sampled_from([None, None, "t"]), chunk=st.integers(1, 14))
    def admit(self, tokens: list[int], salt: str | None, chunk: int) -> None:
        request = _request(f"r{self.next_id}", tokens, salt)
        self.next_id += 1
        hits, num_hit_tokens = self.manager.get_computed_blocks(request)
        expected: list[int] = []
        while (len(expected) < (len(tokens) - 1) // BLOCK_SIZE
               and self._prefix(request, len(expected) + 1) in self.prefix_to_block):
            expected.append(self.prefix_to_block[self._prefix(request, len(expected) + 1)])
        assert hits.get_block_ids() == expected
        assert num_hit_tokens == len(expected) * BLOCK_SIZE
        num_new = min(chunk, len(tokens) - num_hit_tokens)
        num_free_before = self.manager.num_free_blocks
        new_blocks = self.manager.allocate_slots(request, num_new, hits)
        if new_blocks is None:
            assert self.manager.num_free_blocks == num_free_before
            assert self.manager.get_block_ids(request.request_id) == []
            self.manager.free(request)
            return
        request.num_computed_tokens = num_hit_tokens + num_new
        self._after_allocation(request, new_blocks.get_block_ids(), 0,
                               request.num_computed_tokens)
        self.requests[request.request_id] = request

    @precondition(lambda self: self.requests)
    @rule(data=st.data(), chunk=st.integers(1, 6), token=st.integers(0, 2))
    def advance(self, data: st.DataObject, chunk: int, token: int) -> None:
        request = self.requests[data.draw(st.sampled_from(sorted(self.requests)))]
        if request.num_computed_tokens == request.num_tokens:
            if request.num_tokens >= MAX_MODEL_LEN:
                return
            request.append_output_token_ids([token])  # a decode step
        num_new = min(chunk, request.num_tokens - request.num_computed_tokens)
        new_blocks = self.manager.allocate_slots(request, num_new)
        if new_blocks is None:
            return
        start = request.num_computed_tokens
        request.num_computed_tokens += num_new
        self._after_allocation(request, new_blocks.get_block_ids(), start,
                               request.num_computed_tokens)

    @precondition(lambda self: self.requests)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        self.manager.free(self.requests.pop(data.draw(st.sampled_from(sorted(self.requests)))))

    @invariant()
    def blocks_are_accounted_for(self) -> None:
        pool = self.manager.block_pool
        holders: dict[int, int] = {}
        for request in self.requests.values():
            table = self.manager.get_block_ids(request.request_id)
            assert len(table) == -(-request.num_computed_tokens // BLOCK_SIZE)
            assert len(set(table)) == len(table)
            for i, block_id in enumerate(table):
                holders[block_id] = holders.get(block_id, 0) + 1
                if pool.blocks[block_id].ref_cnt > 1:  # shared: must hold this exact prefix
                    assert self.block_to_prefix[block_id] == self._prefix(request, i + 1)
        for block in pool.blocks[1:]:
            assert block.ref_cnt == holders.get(block.block_id, 0)
        free_ids = [b.block_id for b in pool.free_block_queue]
        assert set(free_ids).isdisjoint(holders)
        assert len(free_ids) + len(holders) == pool.num_usable_blocks
        assert {b: p for b, p in self.block_to_prefix.items()} == {
            b.block_id: self.block_to_prefix[b.block_id] for b in pool.hash_to_block.values()}

    def teardown(self) -> None:
        for request in list(self.requests.values()):
            self.manager.free(request)
        assert all(b.ref_cnt == 0 for b in self.manager.block_pool.blocks[1:])
        assert self.manager.num_free_blocks == self.manager.block_pool.num_usable_blocks
        assert self.manager.usage == 0.0


TestKVCacheManagerMachine = KVCacheManagerMachine.TestCase
TestKVCacheManagerMachine.settings = settings(max_examples=200, stateful_step_count=40,
                                              deadline=None)
