"""The hit tracker stays equal to a fresh longest-prefix walk under any event sequence."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from fairway.hashing import longest_cached_prefix
from fairway.policies.hits import HitTracker

# Three prompt families sharing a 3-block root: block ids are positions in a small universe.
ROOT = [1, 2, 3]
PROMPTS = {
    0: ROOT + [10, 11, 12],
    1: ROOT + [10, 20],
    2: ROOT + [30, 31, 32, 33],
    3: [40, 41],
}
UNIVERSE = sorted({h for p in PROMPTS.values() for h in p})


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.sampled_from(UNIVERSE)), max_size=40),
       st.lists(st.sampled_from(sorted(PROMPTS)), unique=True, min_size=1))
def test_tracker_matches_fresh_walk(ops, keys):
    cache: set[int] = set()
    changes = []
    t = HitTracker(cache.__contains__, lambda k, o, n: changes.append((k, o, n)))
    for k in keys:
        t.add(k, PROMPTS[k])
    for i, (store, h) in enumerate(ops):
        if store and h not in cache:
            cache.add(h)
            t.on_stored([h])
        elif not store and h in cache:
            cache.discard(h)
            t.on_removed([h])
        if i == len(ops) // 2 and len(keys) > 1:
            t.remove(keys[0])
            keys = keys[1:]
        for k in keys:
            assert t.hit(k) == longest_cached_prefix(PROMPTS[k], cache)


def test_batched_events_against_final_state():
    cache = {1, 2, 3, 10}
    t = HitTracker(cache.__contains__)
    t.add(0, PROMPTS[0])
    assert t.hit(0) == 4
    # in one batch: 11 stored then evicted, 12 stored; 2 evicted
    cache.update({12})
    cache.discard(2)
    t.on_stored([11, 12])
    t.on_removed([11, 2])
    assert t.hit(0) == 1


@settings(max_examples=200, deadline=None)
@given(st.lists(st.lists(st.sampled_from(UNIVERSE), max_size=8), max_size=12),
       st.lists(st.sampled_from(sorted(PROMPTS)), unique=True, min_size=1))
def test_a_batch_of_removals_reports_the_steps_of_one_by_one(batches, keys):
    """on_removed folds a batch into one cut per request; its path is the hits that removing
    the batch's hashes one event at a time goes through."""
    full = set(UNIVERSE)
    one: list[tuple[int, int, int]] = []
    folded: list[tuple[int, int, int]] = []
    cache_a, cache_b = set(full), set(full)
    a = HitTracker(cache_a.__contains__, lambda k, o, n: one.append((k, o, n)))

    def on_cut(k, o, path):
        for n in path:
            folded.append((k, o, n))
            o = n

    b = HitTracker(cache_b.__contains__, None, on_cut)
    for k in keys:
        a.add(k, PROMPTS[k])
        b.add(k, PROMPTS[k])
    for batch in batches:
        gone = [h for h in dict.fromkeys(batch) if h in cache_a]
        for h in gone:
            cache_a.discard(h)
            a.on_removed([h])
        cache_b.difference_update(gone)
        b.on_removed(gone)
        assert sorted(one) == sorted(folded)
        for k in keys:
            assert a.hit(k) == b.hit(k) == longest_cached_prefix(PROMPTS[k], cache_b)
