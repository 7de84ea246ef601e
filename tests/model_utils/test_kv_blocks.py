"""The block pool's accounting: allocation, references, naming, reuse and eviction."""

from __future__ import annotations

import pytest

from model_utils.runtime import kv_blocks
from model_utils.runtime.kv_blocks import NULL_BLOCK, BlockPool, blocks_for

pytestmark = pytest.mark.unit


def test_blocks_are_handed_out_and_come_back_and_the_null_block_never_is():
    pool = BlockPool(5, 4)
    assert pool.counts().total == 4 and pool.available() == 4
    taken = pool.allocate(4)
    assert sorted(taken) == [1, 2, 3, 4] and NULL_BLOCK not in taken
    assert pool.allocate(1) is None and pool.counts().used == 4
    pool.release(taken)
    assert pool.counts().free == 4 and pool.counts().used == 0
    with pytest.raises(RuntimeError, match="released more often"):
        pool.release([taken[0]])
    assert blocks_for(0, 4) == 0 and blocks_for(1, 4) == 1 and blocks_for(8, 4) == 2


def test_named_blocks_are_found_by_the_tokens_before_and_in_them():
    pool = BlockPool(10, 2)
    seq = [1, 2, 3, 4, 5, 6, 7]
    blocks = pool.allocate(4)
    pool.name_blocks(blocks, seq)  # three full blocks are named; the fourth is partial
    assert pool.match(seq + [8]).blocks == blocks[:3]
    # the last token is never matched: its logits must be computed
    assert pool.match([1, 2, 3, 4, 5, 6]).blocks == blocks[:2]
    assert pool.match([1, 2, 9, 4, 5, 6, 7]).blocks == blocks[:1]  # differs in block 2
    assert pool.match([3, 4, 5, 6]).blocks == []  # same tokens, other position: no match
    pool.release(blocks)
    counts = pool.counts()
    assert counts.cached == 3 and counts.free == 6  # the partial block was freed


def test_a_shared_block_has_one_reference_per_holder_and_is_cached_after_the_last():
    pool = BlockPool(6, 2)
    first = pool.allocate(2)
    pool.name_blocks(first, [1, 2, 3, 4])
    found = pool.match([1, 2, 3, 4, 5]).blocks
    pool.take(found)
    assert found == first and pool.refs(first[0]) == 2
    pool.release(first)
    assert pool.counts().used == 2  # the second holder still has them
    pool.release(found)
    assert pool.counts().cached == 2 and pool.counts().used == 0
    pool.take(pool.match([1, 2, 3, 4, 5]).blocks)  # taken again straight from the cache
    assert pool.counts().cached == 0 and pool.counts().used == 2


def test_cached_blocks_are_evicted_least_recently_used_and_a_sequence_from_its_end():
    pool = BlockPool(7, 2)
    old = pool.allocate(3)
    pool.name_blocks(old, [1, 2, 3, 4, 5, 6])
    pool.release(old)
    new = pool.allocate(3)
    pool.name_blocks(new, [7, 8, 9, 10, 11, 12])
    pool.release(new)
    assert pool.counts().free == 0 and pool.counts().cached == 6
    taken = pool.allocate(2)  # evicts the older conversation's last two blocks
    assert set(taken) == {old[2], old[1]} and pool.evictions == 2
    assert pool.match([1, 2, 3, 4, 5, 6, 0]).blocks == old[:1]
    assert pool.match([7, 8, 9, 10, 11, 12, 0]).blocks == new


def test_the_same_tokens_in_a_second_block_stay_unnamed():
    pool = BlockPool(6, 2)
    a, b = pool.allocate(1), pool.allocate(1)
    pool.name_blocks(a, [1, 2])
    pool.name_blocks(b, [1, 2])  # computed again elsewhere: not a second name
    pool.release(b)
    assert pool.counts().free == 4  # b was freed, not cached
    assert pool.match([1, 2, 0]).blocks == a


def test_a_hash_collision_never_hands_out_a_block_of_other_tokens(monkeypatch):
    monkeypatch.setattr(kv_blocks, "_key", lambda parent, tokens: 42)
    pool = BlockPool(6, 2)
    a, c = pool.allocate(1), pool.allocate(2)
    pool.name_blocks(a, [1, 2])
    pool.name_blocks(c, [5, 6, 7, 8])  # key 42 is a's already: c is not named at all
    assert pool.match([5, 6, 7, 8, 0]).blocks == []
    assert pool.match([1, 2, 0]).blocks == a
    pool.release(c)
    assert pool.counts().free == 4 and pool.counts().cached == 0


def test_clear_cache_frees_every_cached_block():
    pool = BlockPool(5, 2)
    blocks = pool.allocate(2)
    pool.name_blocks(blocks, [1, 2, 3, 4])
    pool.release(blocks)
    assert pool.clear_cache() == 2
    assert pool.counts().free == 4 and pool.match([1, 2, 3, 4, 5]).blocks == []
