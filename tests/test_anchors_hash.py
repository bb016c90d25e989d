"""The hash-ring and vLLM production-stack anchors: each pinned on a hand-made state whose
upstream outcome is known (``prefix-hash``, ``session-hash``, ``vllm-prefixaware[min_match]``,
``vllm-loadaware``), plus ``ray-prefix[imbalanced_threshold=10]`` and pow2's random ties."""

from __future__ import annotations

import math

import numpy as np
import pytest

from fairway.clock import ManualClock
from fairway.routing import RouteRequest, RouterError, RouterPolicy, choice, make_router, validated_router
from fairway.routing.anchors.common import RecentRoutes
from fairway.routing.anchors.hashing import HashRing, session_key
from tests.factories import LinearCost, chain
from tests.test_routing import last, ranked, st

BS = 16


def router(name: str, seed: int = 0, clock: ManualClock | None = None, **kw) -> RouterPolicy:
    return make_router(name, clock=clock or ManualClock(), cost=LinearCost(), block_size=BS,  # type: ignore[arg-type]
                       rng=np.random.default_rng(seed), **kw)


def req(prompt: int = 160, hashes=None, rid: int = 0, session: str | None = None) -> RouteRequest:
    hs = chain("p", prompt // BS) if hashes is None else list(hashes)
    return RouteRequest(rid=rid, prompt_tokens=prompt, block_hashes=hs, session=session)


def ring_order(r: RouterPolicy, key: int, ids: list[int]) -> list[int]:
    """The anchor's own ring, read through a fresh ring of the same size (the ring is a pure
    function of the ids and the key)."""
    return HashRing(r._ring.vnodes).order(key, ids)  # type: ignore[attr-defined]


# -- prefix-hash -------------------------------------------------------------------------------


def test_prefix_hash_keys_on_the_blocks_covering_the_first_256_tokens():
    r = router("prefix-hash")
    a = req(640, chain("s", 16) + chain("a", 24))
    b = req(320, chain("s", 16) + chain("b", 4))
    assert r.key(a) == r.key(b)  # 256 tokens = 16 blocks shared: one key
    c = req(640, chain("s", 15) + chain("c", 25))
    assert r.key(c) != r.key(a)  # differs inside the first 256 tokens
    assert r.key(req(48, chain("s", 3))) == r.key(req(64, chain("s", 3)))  # short: its full blocks
    assert r.key(req(10, [], rid=1)) != r.key(req(10, [], rid=2))  # no full block: by request id
    assert router("prefix-hash", prefix_tokens=250).key(a) == r.key(a)  # 250 tokens -> 16 blocks


def test_prefix_hash_bound_is_smg_load_ok():
    r = router("prefix-hash")
    # SMG's own example (prefix_hash.rs test_load_ok_calculation): total 100, 4 workers ->
    # (100 + 1) / 4 * 1.25 = 31.5625.
    assert r.load_ok(30, 100, 4) and r.load_ok(31, 100, 4)
    assert not r.load_ok(35, 100, 4) and not r.load_ok(32, 100, 4)
    assert r.load_ok(1000, 0, 4)  # nothing in flight: anything goes


def test_prefix_hash_owner_within_the_bound_then_least_loaded_spill():
    r = router("prefix-hash")
    rq = req(320)
    order = ring_order(r, r.key(rq), [0, 1, 2, 3])
    owner = order[0]
    idle = [st(j) for j in range(4)]
    assert ranked(r, rq, idle) == [[j] for j in order]  # the owner, then ring order
    assert last(r).reason == "ring"
    # owner at 2 of total 5: bound 1.25 * 6 / 4 = 1.875 -> over; the others 1, 1, 1: the
    # least loaded within the bound is a tie at 1, SMG takes the first in worker order (id)
    loads = {j: 1 for j in range(4)} | {owner: 2}
    states = [st(j, outstanding=loads[j]) for j in range(4)]
    want = min(j for j in range(4) if j != owner)
    ranks = ranked(r, rq, states)
    assert choice(ranks) == want and last(r).reason == "spill"
    assert [x[0] for x in ranks[1:]] == [j for j in order if j != want]
    # not a walk: with the next on the ring busier than another, SMG still takes the least loaded
    nxt, far = order[1], order[-1]
    loads = {owner: 9, nxt: 2, far: 0} | {j: 1 for j in order[2:-1]}
    states = [st(j, outstanding=loads[j]) for j in range(4)]  # total 12: bound 4.06
    assert choice(ranked(r, rq, states)) == far
    walk = router("prefix-hash", spill="walk")  # KubeAI CHWBL: the next within the bound clockwise
    assert choice(ranked(walk, rq, states)) == nxt and last(walk).reason == "spill"


def test_prefix_hash_keeps_the_owner_at_the_bound():
    r = router("prefix-hash")
    rq = req(320)
    owner = ring_order(r, r.key(rq), [0, 1])[0]
    # owner 2, other 1: bound 1.25 * 4 / 2 = 2.5 -> the owner stays
    assert choice(ranked(r, rq, [st(owner, outstanding=2), st(1 - owner, outstanding=1)])) == owner
    assert last(r).reason == "ring"
    # owner 3, other 0: bound 1.25 * 4 / 2 = 2.5 -> spill to the other
    assert choice(ranked(r, rq, [st(owner, outstanding=3), st(1 - owner)])) == 1 - owner


def test_prefix_hash_rejects_bad_options():
    with pytest.raises(RouterError):
        router("prefix-hash", spill="random")
    with pytest.raises(RouterError):
        router("prefix-hash", load_factor=0.9)


# -- session-hash ------------------------------------------------------------------------------


def test_session_hash_same_session_same_replica_and_unbounded_by_default():
    r = router("session-hash")
    ids = list(range(4))
    for s in ("alice", "bob", "carol"):
        order = ring_order(r, session_key(s), ids)
        busy = [st(j, outstanding=50 if j == order[0] else 0) for j in ids]  # SMG: no load bound
        assert ranked(r, req(session=s), busy) == [[j] for j in order]
        assert last(r).reason == "session"
    owners = {choice(ranked(r, req(session=f"u{i}"), [st(j) for j in ids])) for i in range(60)}
    assert owners == set(ids)  # sessions spread over the ring


def test_session_hash_bounded_walks_the_ring():
    r = router("session-hash", max_load_skew=1.5)  # SMG bounded_consistent_hashing
    ids = list(range(4))
    order = ring_order(r, session_key("alice"), ids)
    # total 8, mean 2: bound 1.5 * 2 = 3. Owner 5 > 3; the next on the ring 3 <= 3 -> it.
    loads = {order[0]: 5, order[1]: 3, order[2]: 0, order[3]: 0}
    assert choice(ranked(r, req(session="alice"), [st(j, outstanding=loads[j]) for j in ids])) == order[1]
    assert last(r).reason == "spill"
    # low load: the baseline is max(mean, 1) -> owner at 1 of total 1 stays (bound 1.5)
    loads = {j: 0 for j in ids} | {order[0]: 1}
    assert choice(ranked(r, req(session="alice"), [st(j, outstanding=loads[j]) for j in ids])) == order[0]


def test_session_hash_without_a_session_random_or_lowest_qps():
    states = [st(j) for j in range(3)]
    r = router("session-hash", seed=4)
    got = [choice(ranked(r, req(), states)) for _ in range(60)]
    assert set(got) == {0, 1, 2} and last(r).reason == "no-session"  # SMG: uniformly random
    same = router("session-hash", seed=4)
    assert got == [choice(ranked(same, req(), states)) for _ in range(60)]
    clock = ManualClock()
    q = router("session-hash", clock=clock, fallback="qps")  # production-stack SessionRouter
    assert [choice(ranked(q, req(), states)) for _ in range(3)] == [0, 1, 2]  # never routed first
    owner = ring_order(q, session_key("s"), [0, 1, 2])[0]
    ranked(q, req(session="s"), states)  # a session request counts too
    clock.advance(1.0)
    want = min(j for j in range(3) if j != owner)
    assert choice(ranked(q, req(), states)) == want


def test_recent_routes_counts_the_window():
    rr = RecentRoutes(60.0)
    assert rr.least(0.0, [2, 5]) == 2
    rr.note(0.0, 2)
    rr.note(1.0, 5)
    rr.note(2.0, 5)
    assert rr.least(3.0, [2, 5]) == 2 and rr.count(3.0, 5) == 2
    assert rr.count(60.5, 2) == 0  # t=0 left the window [0.5, 60.5]
    assert rr.least(61.5, [2, 5]) == 2  # 5's two requests left at 61 and 62: 0 vs 1 -> still 2
    assert rr.least(62.5, [2, 5]) == 2  # both 0: the first


# -- vllm-prefixaware[min_match] ---------------------------------------------------------------


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


# -- vllm-loadaware ----------------------------------------------------------------------------


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


# -- ray-prefix[imbalanced_threshold=10], pow2 ties ----------------------------------------------


def test_ray_prefix_imbalanced_threshold_10_spec_builds_and_switches_above_10():
    assert validated_router("ray-prefix[imbalanced_threshold=10]") == ("ray-prefix", {"imbalanced_threshold": 10})
    r = router("ray-prefix", imbalanced_threshold=10, seed=1)
    assert r.imbalanced_threshold == 10 and math.isinf(router("ray-prefix").imbalanced_threshold)
    ten = [st(0, outstanding=10, matched=10), st(1), st(2)]
    assert choice(ranked(r, req(), ten)) == 0 and last(r).reason == "affinity"  # 10 - 0 is not > 10
    eleven = [st(0, outstanding=11, matched=10), st(1), st(2)]
    got = {choice(ranked(r, req(), eleven)) for _ in range(30)}
    assert got == {1, 2} and last(r).reason == "imbalanced"


def test_pow2_equal_queues_keep_the_draw_order():
    # Ray keeps the first of its random pair unless the second is strictly shorter
    r = router("pow2", seed=0)
    tie = [st(0, outstanding=2), st(1, outstanding=2)]
    firsts = [ranked(r, req(), tie)[0] for _ in range(40)]
    assert {tuple(f) for f in firsts} == {(0, 1), (1, 0)}
    again = router("pow2", seed=0)
    assert firsts == [ranked(again, req(), tie)[0] for _ in range(40)]
    assert all(ranked(r, req(), [st(0, outstanding=3), st(1, outstanding=1)]) == [[1, 0]] for _ in range(10))


def test_defaults_are_the_upstream_defaults():
    ph = router("prefix-hash")
    assert (ph.prefix_tokens, ph.load_factor, ph._ring.vnodes, ph.spill) == (256, 1.25, 150, "least-loaded")
    sh = router("session-hash")
    assert (math.isinf(sh.max_load_skew), sh.fallback, sh._recent.window_s) == (True, "random", 60.0)
    assert router("vllm-loadaware").beta == 1.0
    pa = router("vllm-prefixaware")
    assert (pa.min_match, pa.chars_per_token) == (0, 4.0)
