"""The hit-ratio bounds: exact values on small sequences, and the order LRU <= MIN <= infinite."""

from __future__ import annotations

import numpy as np
import pytest

from sim.cluster import ceiling_hit_ratio
from sim.hit_bounds import _stable_order, infinite_cache_hit_ratio, optimal_eviction_hit_ratio
from tests.factories import chain, spec


def req(rid: int, *blocks: str):
    # 4 blocks of 16 tokens + 1 token: all 4 blocks are reusable
    return spec(rid, float(rid), 65, 1, [h for b in blocks for h in chain(b, 1)] + chain(f"tail{rid}", 1))


def test_infinite_cache_counts_every_block_seen_before():
    specs = [req(0, "a", "b", "c", "d"), req(1, "a", "b", "c", "d"), req(2, "a", "b", "c", "d")]
    # chain(x, 1) names one block; request 0 misses 4, then 1 and 2 hit their 4
    assert infinite_cache_hit_ratio(specs, 16) == pytest.approx(8 * 16 / (3 * 65))


def test_belady_beats_lru_where_lru_thrashes():
    # a cyclic pattern a b c a b c a b c over one-block prompts with room for 2: LRU evicts exactly
    # the block needed next and never hits; MIN evicts the one needed last and hits at 3, 5 and 7
    specs = [spec(i, float(i), 17, 1, chain("abc"[i % 3], 1)) for i in range(9)]
    assert ceiling_hit_ratio(specs, 2, 16) == 0.0
    assert optimal_eviction_hit_ratio(specs, 2, 16) == pytest.approx(3 * 16 / (9 * 17))
    assert infinite_cache_hit_ratio(specs, 16) == pytest.approx(6 * 16 / (9 * 17))


def test_bounds_are_ordered_on_random_sequences():
    rng = np.random.default_rng(0)
    for _ in range(20):
        specs = [spec(i, float(i), 16 * int(rng.integers(2, 9)) + 1, 1,
                      chain(f"f{rng.integers(0, 6)}", 8)) for i in range(60)]
        for cap in (4, 16, 64):
            lru = ceiling_hit_ratio(specs, cap, 16)
            opt = optimal_eviction_hit_ratio(specs, cap, 16)
            assert lru <= opt + 1e-12 <= infinite_cache_hit_ratio(specs, 16) + 2e-12


def _lru_replay(specs, cap: int, bs: int) -> float:
    """The LRU replay one block at a time (the definition ``ceiling_hit_ratio`` vectorises)."""
    from collections import OrderedDict

    lru: OrderedDict[int, None] = OrderedDict()
    cached = prompt = 0
    for s in sorted(specs, key=lambda x: (x.arrival_s, x.rid)):
        for h in s.block_hashes[: max(0, (s.prompt_tokens - 1) // bs)]:
            if h not in lru:
                break
            cached += bs
        prompt += s.prompt_tokens
        for h in s.block_hashes:
            lru[h] = None
            lru.move_to_end(h)
        while len(lru) > cap:
            lru.popitem(last=False)
    return cached / prompt


def _belady(refs: list[int], cap: int) -> int:
    """MIN by its definition: on a miss with a full cache, evict the block used again farthest
    in the future (never again counts as farthest). O(B^2), for small cases."""
    cache: set[int] = set()
    hits = 0
    for i, h in enumerate(refs):
        if h in cache:
            hits += 1
            continue
        if len(cache) >= cap:
            later = refs[i + 1 :]
            cache.remove(max(sorted(cache), key=lambda x, later=later: later.index(x) if x in later else len(later)))
        cache.add(h)
    return hits


def test_vectorised_replays_equal_their_definitions():
    # 64-bit hashes (the numpy path) and hand-made ones (the dict path), repeats inside one
    # request, capacities where the MIN fast path holds and where the heap replay runs
    from sim.hit_bounds import _min_hits

    rng = np.random.default_rng(3)
    for trial in range(60):
        scale = 2**60 if trial % 2 else 1
        specs = []
        for i in range(int(rng.integers(2, 30))):
            fam = int(rng.integers(0, 5))
            blocks = [(fam * 100 + k) * scale for k in range(int(rng.integers(0, 6)))] + [10**7 + i]
            if rng.random() < 0.1:
                blocks.append(blocks[0])
            specs.append(spec(i, float(rng.integers(0, 10)), int(rng.integers(1, 16 * len(blocks) + 1)), 1,
                              blocks))
        for cap in (1, 2, 4, 8, 30):
            assert ceiling_hit_ratio(specs, cap, 16) == _lru_replay(specs, cap, 16)
        refs = [int(x) for x in rng.integers(0, 8, size=int(rng.integers(1, 40)))]
        for cap in (1, 2, 3, 5, 8):
            assert _min_hits(np.array(refs), cap) == _belady(refs, cap)


def test_dense_ids_are_numpy_unique_without_the_values():
    # the references' ids come from an unstable argsort: they must be np.unique's arrays exactly
    # (first index, rank, count), including runs of equal values and one or no element
    from sim.hit_bounds import _dense_ids

    rng = np.random.default_rng(5)
    for n in (1, 2, 7, 500, 20_000):
        for distinct in (1, 3, 64, 2**63):
            x = rng.integers(0, distinct, size=n, dtype=np.uint64)
            first, ids, count = _dense_ids(x)
            _, u_first, u_ids, u_count = np.unique(x, return_index=True, return_inverse=True, return_counts=True)
            assert first.tolist() == u_first.tolist()
            assert ids.tolist() == u_ids.tolist()
            assert count.tolist() == u_count.tolist()
    assert [a.tolist() for a in _dense_ids(np.zeros(0, dtype=np.uint64))] == [[], [], []]


@pytest.mark.parametrize("hi", [1, 3, 1000, 1 << 40])
def test_stable_order_is_the_stable_argsort(hi):
    """Ids with many repeats, a few, and ids too wide to pack (the fallback)."""
    rng = np.random.default_rng(hi % 97)
    for n in (0, 1, 7, 5000):
        r = rng.integers(0, hi, n).astype(np.int64)
        assert np.array_equal(_stable_order(r), np.argsort(r, kind="stable"))
