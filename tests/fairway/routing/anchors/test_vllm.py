"""vLLM production-stack's routers (fairway/routing/anchors/vllm.py: ``vllm-prefixaware``,
``vllm-loadaware``): exact and random picks on hand-made states, the minimum match, the
session ring and lowest-QPS fallbacks."""

from __future__ import annotations

import pytest

from fairway.clock import ManualClock
from fairway.routing import choice, validated_router
from fairway.routing.anchors.hashing import session_key
from tests.fairway.routing.helpers import last, picks, ranked, req, ring_order, router, st


def test_vllm_prefixaware_random_among_best_matches_without_load():
    states = [st(0, matched=5, outstanding=100), st(1, matched=5), st(2, matched=2), st(3)]
    r = router("vllm-prefixaware", seed=11)
    got = picks(r, req(), states, 40)
    assert set(got) == {0, 1}
    assert last(r).reason == "affinity"
    assert got == picks(router("vllm-prefixaware", seed=11), req(), states, 40)
    ranks = ranked(r, req(), states)
    assert ranks[1:] == [[1 - ranks[0][0]], [2], [3]]


def test_vllm_prefixaware_random_overall_without_a_match():
    r = router("vllm-prefixaware", seed=2)
    assert set(picks(r, req(), [st(j) for j in range(3)], 60)) == {0, 1, 2}
    assert last(r).reason == "random"


def test_vllm_prefixaware_min_match_falls_back_to_lowest_qps():
    # min_match in characters: 10 matched blocks = 160 tokens = 640 characters at 4 a token
    states = [st(0, matched=10), st(1, matched=10), st(2)]
    r = router("vllm-prefixaware", min_match=640, seed=3)
    assert set(choice(ranked(r, req(320), states)) for _ in range(20)) == {0, 1}
    assert last(r).reason == "affinity"
    clock = ManualClock()
    q = router("vllm-prefixaware", min_match=641, clock=clock, seed=3)
    assert [choice(ranked(q, req(320), states)) for _ in range(4)] == [0, 1, 2, 0]  # unseen, then fewest
    assert last(q).reason == "qps"
    assert router("vllm-prefixaware", min_match=4096).min_match == 4096
    assert validated_router("vllm-prefixaware[min_match=4096]") == ("vllm-prefixaware", {"min_match": 4096})


def test_vllm_prefixaware_default_min_match_is_off():
    r = router("vllm-prefixaware")
    assert r.min_match == 0  # upstream --prefix-min-match-length defaults to 0
    ranked(r, req(), [st(0), st(1)])
    assert last(r).reason == "random"


def test_vllm_loadaware_cold_idle_beats_warm_busy_at_beta_1():
    # 160-token prompt. Replica 0 holds it all but has 6 in flight; 1 and 2 hold nothing.
    # mean 3: score0 = 1 - (6-3)/3 = 0; score1 = -(2-3)/3 = 1/3; score2 = -(1-3)/3 = 2/3.
    states = [st(0, outstanding=6, matched=10), st(1, outstanding=2), st(2, outstanding=1)]
    r = router("vllm-loadaware")
    assert ranked(r, req(160), states) == [[2], [1], [0]]
    assert last(r).reason == "score"
    assert last(r).scores == pytest.approx({0: 0.0, 1: 1 / 3, 2: 2 / 3})
    # beta 0.2: score0 = 1 - 0.2 = 0.8 beats 0.067 and 0.133
    assert choice(ranked(router("vllm-loadaware", beta=0.2), req(160), states)) == 0


def test_vllm_loadaware_idle_fleet_clamps_the_mean_and_ties_go_to_the_lowest_id():
    # mean 1/3 -> denominator 1: replica 1 (1 in flight) scores 0.5 - 2/3; replica 2 scores 0.5 + 1/3
    states = [st(0), st(1, outstanding=1, matched=5), st(2, matched=5)]
    r = router("vllm-loadaware")
    assert choice(ranked(r, req(160), states)) == 2
    assert last(r).scores[1] == pytest.approx(0.5 - 2 / 3)
    tie = [st(3, matched=5), st(1, matched=5), st(2, matched=1)]
    assert ranked(r, req(160), tie) == [[1], [3], [2]]
    over = [st(0, matched=40), st(1, matched=5)]  # matched beyond the prompt counts as a full hit
    assert router("vllm-loadaware").scores(req(160), over)[0] == pytest.approx(0.5 + 1 - 0.5)


def test_vllm_loadaware_no_holder_falls_back_to_session_ring_or_qps():
    clock = ManualClock()
    r = router("vllm-loadaware", clock=clock)
    states = [st(j, outstanding=10 * j) for j in range(3)]
    order = ring_order(r, session_key("bob"), [0, 1, 2])
    assert ranked(r, req(session="bob"), states) == [[j] for j in order]
    assert last(r).reason == "session"
    got = [choice(ranked(r, req(), states)) for _ in range(3)]
    assert last(r).reason == "qps"
    assert got == [j for j in range(3) if j != order[0]] + [0]  # never routed first, then fewest (id)
