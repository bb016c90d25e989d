"""``sglang`` and ``sglang-classic`` (fairway/routing/anchors/sglang.py): each decision pinned on a
hand-made state where the upstream rule's outcome is known."""

from __future__ import annotations

import pytest

from fairway.routing import choice
from tests.factories import chain
from tests.fairway.routing.helpers import last, ranked, req, router, st


def test_sglang_classic_imbalance_switch_needs_both_thresholds():
    r = router("sglang-classic")
    full = dict(matched=10)
    # 100 - 30 > 64 and 100 > 1.5 * 30: imbalanced -> least load, despite replica 0's full match.
    assert ranked(r, req(), [st(0, outstanding=100, **full), st(1, outstanding=30), st(2, outstanding=50)]) == [
        [1], [2], [0]]
    assert last(r).reason == "imbalanced"
    # 100 - 40 = 60: not over the absolute threshold -> cache-aware.
    assert choice(ranked(r, req(), [st(0, outstanding=100, **full), st(1, outstanding=40)])) == 0
    assert last(r).reason == "affinity"
    # 200 - 135 = 65 > 64 but 200 < 1.5 * 135: not over the relative threshold.
    assert choice(ranked(r, req(), [st(0, outstanding=200, **full), st(1, outstanding=135)])) == 0
    assert last(r).reason == "affinity"


def test_sglang_classic_match_rate_must_exceed_threshold():
    r = router("sglang-classic")
    # 160-token prompt: 3 blocks = 0.3, not > 0.3 -> smallest tree; 4 blocks = 0.4 -> matched.
    states = [st(0, matched=3, tree=30), st(1, tree=5, outstanding=2), st(2, tree=5, outstanding=1)]
    assert ranked(r, req(160), states) == [[2], [0], [1]]
    assert last(r).reason == "smallest-tree"
    states[0] = st(0, matched=4, tree=30)
    assert choice(ranked(r, req(160), states)) == 0
    assert last(r).reason == "affinity"
    # Two best-matched workers: the lower load wins.
    tie = [st(0, matched=4, outstanding=3), st(1, matched=4, outstanding=1), st(2)]
    assert choice(ranked(r, req(160), tie)) == 1


def test_sglang_below_threshold_takes_the_least_loaded_not_the_smallest_tree():
    states = [st(0, tree=1, outstanding=5), st(1, tree=50, outstanding=2), st(2, tree=30, outstanding=3)]
    r = router("sglang")
    assert ranked(r, req(160), states) == [[1], [2], [0]]
    assert last(r).reason == "least-loaded"
    assert choice(ranked(router("sglang-classic"), req(160), states)) == 0  # the old rule: smallest tree


def test_sglang_least_loaded_ties_go_to_fewer_processed_then_id():
    r = router("sglang")
    idle = [st(0), st(1), st(2)]
    # every pick counts as processed: equal loads rotate 0, 1, 2, 0 (SMG PR 1714), no randomness
    assert [choice(ranked(r, req(160, hashes=chain(f"x{i}", 10)), idle)) for i in range(4)] == [0, 1, 2, 0]


@pytest.mark.parametrize("seed", range(6))
def test_sglang_affinity_goes_to_the_first_holder_whatever_its_load(seed):
    r = router("sglang", seed=seed)
    shared = chain("sys", 10)
    # first request: nothing matched, replica 2 is the least loaded and becomes the prefix's owner
    assert choice(ranked(r, req(160, hashes=shared), [st(0, outstanding=3), st(1, outstanding=3), st(2)])) == 2
    # all three now hold the whole prompt: the tree names its first tenant, not the idlest holder
    full = [st(0, matched=10), st(1, matched=10), st(2, matched=10, outstanding=60)]
    assert ranked(r, req(160, hashes=shared), full) == [[2], [0], [1]]
    assert last(r).reason == "affinity"
    # no per-request spill gate: 60 > 1.5 x mean (20) and > mean + 40, still the owner; only the
    # fleet-wide switch (max - min > 64 and max > 1.5 min) moves it
    full[2] = st(2, matched=10, outstanding=65)
    assert ranked(r, req(160, hashes=shared), full) == [[0], [1], [2]]
    assert last(r).reason == "imbalanced"


def test_sglang_affinity_without_a_known_owner_is_random_among_the_best_matched():
    states = [st(0, matched=10), st(1, matched=10), st(2, matched=2)]
    got = {choice(ranked(router("sglang", seed=s), req(160), states)) for s in range(12)}
    assert got == {0, 1}


def test_sglang_match_rate_must_exceed_the_threshold():
    r = router("sglang")
    # 160-token prompt: 3 blocks = 0.3 is not > 0.3: least loaded; 4 blocks = 0.4: the match
    assert choice(ranked(r, req(160), [st(0, matched=3, outstanding=1), st(1)])) == 1
    assert last(r).reason == "least-loaded"
    assert choice(ranked(router("sglang"), req(160), [st(0, matched=4, outstanding=1), st(1)])) == 0
