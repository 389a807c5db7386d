"""PrefixCacheView: the mirror of the held block hashes a router polls, deltas or a reset."""

from kvasir_engine.frontend.prefix_cache_view import (
    HASH_BYTES,
    PrefixCacheView,
    prefix_block_hashes,
    short_hash,
)
from kvasir_engine.kv.hashing import BlockHash, hash_full_blocks


def _hash(n: int) -> BlockHash:
    return BlockHash(n.to_bytes(32, "little"))


def test_a_new_reader_gets_everything_then_only_the_net_changes() -> None:
    view = PrefixCacheView(block_size=16)
    view.apply([("stored", _hash(1)), ("stored", _hash(2))])
    first = view.since(None, None)
    assert first["reset"] and first["block_size"] == 16 and first["seq"] == 2
    assert sorted(first["stored"]) == sorted([short_hash(_hash(1)), short_hash(_hash(2))])
    view.apply([("removed", _hash(1)), ("stored", _hash(3)), ("removed", _hash(3)),
                ("stored", _hash(1))])
    delta = view.since(first["instance"], first["seq"])
    assert not delta["reset"] and delta["seq"] == 6
    # 1 removed then stored again: held; 3 stored then removed: not held
    assert delta["stored"] == [short_hash(_hash(1))]
    assert delta["removed"] == [short_hash(_hash(3))]
    assert view.since(first["instance"], 6)["stored"] == []
    assert view.num_held == 2


def test_another_instance_a_future_seq_or_a_lag_past_the_log_is_a_reset() -> None:
    view = PrefixCacheView(block_size=4, max_log_events=2)
    view.apply([("stored", _hash(i)) for i in range(1, 5)])
    instance = view.instance_id
    assert view.since("restarted-engine", 4)["reset"]
    assert view.since(instance, 99)["reset"]
    assert view.since(instance, 1)["reset"]  # events 2 and 3 fell out of the log
    assert not view.since(instance, 3)["reset"]
    view.apply([("cleared", None)])
    after = view.since(instance, 4)  # a clear is told as a reset to an empty set
    assert after["reset"] and after["stored"] == [] and view.num_held == 0
    assert not view.since(instance, 5)["reset"]


def test_prompt_hashes_are_the_caches_chain_cut_short() -> None:
    tokens = list(range(40))
    full = hash_full_blocks(tokens, 16, None, "salt")
    assert prefix_block_hashes(tokens, 16, "salt", 64) == [h[:HASH_BYTES].hex() for h in full]
    assert prefix_block_hashes(tokens, 16, "salt", 1) == [full[0][:HASH_BYTES].hex()]
    assert prefix_block_hashes(tokens, 16, "other", 64)[0] != short_hash(full[0])
