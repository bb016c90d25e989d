"""``ray-prefix`` (fairway/routing/anchors/ray.py): affinity at the match-rate threshold, the
smallest trees below it, the imbalance switch, and the pre-2.60 threshold."""

from __future__ import annotations

import math

from fairway.routing import choice, validated_router
from tests.fairway.routing.helpers import last, picks, ranked, req, router, st


def test_ray_prefix_affinity_at_the_match_rate_threshold():
    r = router("ray-prefix")
    # 160-token prompt, 1 matched block = 16 tokens: rate 0.1 >= 0.1.
    states = [st(0, outstanding=3, matched=1, tree=40), st(1, outstanding=2, matched=1, tree=90), st(2, tree=0)]
    assert ranked(r, req(160), states) == [[1, 0], [2]]  # the best-matched set, shortest queue first
    assert last(r).reason == "affinity"


def test_ray_prefix_smallest_tree_below_the_threshold():
    r = router("ray-prefix")
    # 320-token prompt, 1 block matched: rate 0.05 < 0.1 -> the smallest trees, shortest queue first.
    states = [st(0, outstanding=0, matched=1, tree=50), st(1, outstanding=4, tree=10), st(2, outstanding=1, tree=10)]
    assert ranked(r, req(320), states) == [[2, 1], [0]]
    assert last(r).reason == "smallest-tree"


def test_ray_prefix_imbalance_switch():
    states = [st(0, outstanding=5, matched=10), st(1), st(2)]
    r = router("ray-prefix")  # imbalanced_threshold = inf: never imbalanced
    assert ranked(r, req(), states) == [[0], [1], [2]]
    assert last(r).reason == "affinity"
    r10 = router("ray-prefix", imbalanced_threshold=10)  # the pre-2.60 default: spread 5 is balanced
    assert choice(ranked(r10, req(), states)) == 0
    r2 = router("ray-prefix", imbalanced_threshold=2, seed=5)
    got = picks(r2, req(), states, 30)
    assert last(r2).reason == "imbalanced"
    assert set(got) == {1, 2}  # power of two choices never takes the longest queue


def test_ray_prefix_imbalanced_threshold_10_spec_builds_and_switches_above_10():
    assert validated_router("ray-prefix[imbalanced_threshold=10]") == ("ray-prefix", {"imbalanced_threshold": 10})
    r = router("ray-prefix", imbalanced_threshold=10, seed=1)
    assert r.imbalanced_threshold == 10 and math.isinf(router("ray-prefix").imbalanced_threshold)
    ten = [st(0, outstanding=10, matched=10), st(1), st(2)]
    assert choice(ranked(r, req(), ten)) == 0 and last(r).reason == "affinity"  # 10 - 0 is not > 10
    eleven = [st(0, outstanding=11, matched=10), st(1), st(2)]
    got = {choice(ranked(r, req(), eleven)) for _ in range(30)}
    assert got == {1, 2} and last(r).reason == "imbalanced"
