"""Block hashes: chained, salted, deterministic across processes, full blocks only."""

import subprocess
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st
from kvasir_engine.kv.hashing import hash_block_tokens, hash_full_blocks

TOKENS = st.lists(st.integers(min_value=0, max_value=200_000), max_size=40)


def test_only_full_blocks_are_hashed() -> None:
    assert len(hash_full_blocks(list(range(7)), 4, None)) == 1
    assert len(hash_full_blocks(list(range(8)), 4, None)) == 2
    assert hash_full_blocks(list(range(3)), 4, None) == []


@given(TOKENS, st.integers(min_value=1, max_value=8))
def test_chain_matches_block_by_block(token_ids: list[int], block_size: int) -> None:
    hashes = hash_full_blocks(token_ids, block_size, None)
    parent = None
    for i, block_hash in enumerate(hashes):
        parent = hash_block_tokens(parent, token_ids[i * block_size:(i + 1) * block_size])
        assert block_hash == parent
    # Hashing the tail from a mid-chain parent continues the same chain.
    if len(hashes) >= 2:
        assert hash_full_blocks(token_ids[block_size:], block_size, hashes[0]) == hashes[1:]


def test_hash_depends_on_whole_prefix() -> None:
    a = hash_full_blocks([1, 2, 3, 4, 5, 6], 3, None)
    b = hash_full_blocks([9, 2, 3, 4, 5, 6], 3, None)
    assert a[0] != b[0]
    assert a[1] != b[1]  # same second block, different parent


def test_cache_salt_separates_tenants() -> None:
    plain = hash_full_blocks([1, 2, 3, 4], 2, None)
    salted = hash_full_blocks([1, 2, 3, 4], 2, None, cache_salt="tenant-a")
    other = hash_full_blocks([1, 2, 3, 4], 2, None, cache_salt="tenant-b")
    assert plain[0] != salted[0] != other[0]
    assert plain[1] != salted[1] != other[1]
    assert hash_full_blocks([1, 2, 3, 4], 2, None, cache_salt="") != plain


def test_deterministic_across_processes() -> None:
    code = ("from kvasir_engine.kv.hashing import hash_full_blocks;"
            "print(hash_full_blocks(list(range(32)), 16, None, 's')[1].hex())")
    runs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           check=True).stdout.strip() for _ in range(2)}
    assert runs == {hash_full_blocks(list(range(32)), 16, None, "s")[1].hex()}


def test_bad_input_is_named() -> None:
    with pytest.raises(ValueError, match="block_size"):
        hash_full_blocks([1], 0, None)
    with pytest.raises(ValueError, match="token_ids"):
        hash_block_tokens(None, [2**70])
