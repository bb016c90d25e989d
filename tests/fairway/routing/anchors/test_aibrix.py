"""``aibrix`` (fairway/routing/anchors/aibrix.py): the imbalance switch, the gateway's in-flight
load, the standard-deviation filter, integer match percents and random ties."""

from __future__ import annotations

from fairway.routing import choice
from tests.fairway.routing.helpers import last, picks, ranked, req, router, st


def test_aibrix_imbalance_switch():
    r = router("aibrix")
    # 10 - 1 = 9 > 8: only the least-loaded pod is considered, whatever the matches.
    imb = [st(0, outstanding=10, matched=10), st(1, outstanding=1), st(2, outstanding=3, matched=5)]
    assert ranked(r, req(), imb) == [[1], [2], [0]]
    assert last(r).reason == "imbalanced"
    # Ties among the least loaded: the matched one among them.
    assert choice(ranked(r, req(), [st(0, outstanding=10), st(1, outstanding=1),
                                    st(2, outstanding=1, matched=4)])) == 2
    # 8 - 0 = 8 is not over 8: best match with load <= mean + sample sigma = 4 + 4.
    bal = [st(0, outstanding=8, matched=10), st(1), st(2, outstanding=4, matched=5)]
    assert ranked(r, req(), bal) == [[0], [1], [2]]
    assert last(r).reason == "affinity"
    bal[0] = st(0, outstanding=9, matched=10)  # 9 - 0 > 8: imbalanced, only replica 1
    assert choice(ranked(r, req(), bal)) == 1


def test_aibrix_no_match_goes_to_least_loaded():
    r = router("aibrix")
    assert ranked(r, req(), [st(0, outstanding=3), st(1, outstanding=1), st(2, outstanding=2)]) == [[1], [2], [0]]
    assert last(r).reason == "least-loaded"


def test_aibrix_load_is_the_gateways_in_flight_count_not_engine_running():
    # in flight 12 vs 1: imbalanced (> 8), only replica 1; by running counts (1, 1, 2) replica 0's
    # full match would have won
    states = [st(0, outstanding=12, running=1, matched=10), st(1, outstanding=1, running=1),
              st(2, outstanding=2, running=2)]
    r = router("aibrix")
    assert ranked(r, req(160), states) == [[1], [2], [0]]
    assert last(r).reason == "imbalanced"


def test_aibrix_std_filter_uses_the_sample_deviation():
    r = router("aibrix")
    # loads 4, 0, 2: mean 2, sample sigma 2 -> 4 <= 4, the best match wins (the population
    # sigma, 1.63, would skip it for replica 2)
    assert choice(ranked(r, req(160), [st(0, outstanding=4, matched=10), st(1), st(2, outstanding=2, matched=5)])) == 0
    assert last(r).reason == "affinity"
    # loads 5, 0, 2: mean 2.33, sample sigma 2.52 -> 5 > 4.85, skipped for the next match
    assert choice(ranked(r, req(160), [st(0, outstanding=5, matched=10), st(1), st(2, outstanding=2, matched=5)])) == 2


def test_aibrix_match_percent_is_an_integer_and_ties_go_by_load():
    # 3200-token prompt = 200 blocks: 3 and 2 matched blocks are both 1 percent, so the lower load
    # wins over the longer match
    r = router("aibrix")
    states = [st(0, outstanding=2, matched=3), st(1, outstanding=1, matched=2), st(2)]
    assert choice(ranked(r, req(3200), states)) == 1


def test_aibrix_equal_match_and_load_and_the_fallback_are_random():
    pair = [st(0, outstanding=1, matched=10), st(1, outstanding=1, matched=10), st(2, outstanding=1)]
    assert set(picks(router("aibrix", seed=3), req(160), pair, 30)) == {0, 1}
    idle = [st(0, outstanding=2), st(1), st(2)]
    r = router("aibrix", seed=5)
    assert set(picks(r, req(160), idle, 30)) == {1, 2}
    assert last(r).reason == "least-loaded"
