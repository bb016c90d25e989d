"""Block pool: cache hits, exact LRU eviction order, events, ref counts."""

from __future__ import annotations

import pytest

from fairway.engine.block_pool import BlockPool, OutOfBlocks


def fill(pool: BlockPool, hashes):
    blocks = pool.allocate(len(hashes))
    for b, h in zip(blocks, hashes, strict=True):
        pool.cache_block(b, h)
    return blocks


def test_hits_survive_release_until_reuse():
    pool = BlockPool(4)
    a = fill(pool, [10, 11])
    pool.release(a)
    assert pool.num_free == 4
    assert pool.longest_hit([10, 11, 12]) == a
    assert pool.longest_hit([11]) == a[1:]  # lookup is per hash; chains make it a prefix


def test_exact_lru_eviction_order():
    pool = BlockPool(6)
    a = fill(pool, [1, 2, 3])  # blocks 0,1,2
    b = fill(pool, [4, 5, 6])  # blocks 3,4,5
    pool.release(a)  # freed tail-first: 2,1,0
    pool.release(b)  # then 5,4,3
    pool.drain_events()
    got = pool.allocate(4)
    assert got == [2, 1, 0, 5]
    assert pool.drain_events() == [(False, 3), (False, 2), (False, 1), (False, 6)]
    assert pool.longest_hit([4, 5]) == [3, 4]
    assert pool.longest_hit([1]) == []


def test_touch_pulls_a_cached_block_out_of_the_free_queue():
    pool = BlockPool(3)
    a = fill(pool, [1, 2])
    pool.release(a)
    pool.touch(pool.longest_hit([1]))  # block 0 in use again
    assert pool.free_after_touch([]) == 2
    got = pool.allocate(2)
    assert got == [2, 1] and pool.longest_hit([1, 2]) == [a[0]]
    with pytest.raises(OutOfBlocks):
        pool.allocate(1)


def test_first_copy_wins_and_double_release_is_caught():
    pool = BlockPool(3)
    a = fill(pool, [7])
    b = pool.allocate(1)
    pool.cache_block(b[0], 7)
    assert pool.cached[7] == a[0] and pool.block_hash[b[0]] is None
    pool.release(b)
    with pytest.raises(RuntimeError):
        pool.release(b)


def test_free_after_touch_counts_free_hits():
    pool = BlockPool(4)
    a = fill(pool, [1, 2])
    pool.release(a[1:])  # block of hash 2 is free, hash 1 still held
    assert pool.free_after_touch(pool.longest_hit([1, 2])) == 2
