"""The hit-ratio bounds: exact values on small sequences, and the order LRU <= MIN <= infinite."""

from __future__ import annotations

import numpy as np
import pytest

from sim.cluster import ceiling_hit_ratio
from sim.hit_bounds import infinite_cache_hit_ratio, optimal_eviction_hit_ratio
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
