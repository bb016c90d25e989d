"""The hash-ring anchors (fairway/routing/anchors/hashing.py: ``consistent-hash``, ``prefix-hash``,
``session-hash``), each pinned on a hand-made state whose upstream outcome is known, and the
recent-routes window their QPS fallback reads."""

from __future__ import annotations

import pytest

from fairway.clock import ManualClock
from fairway.routing import RouterError, choice
from fairway.routing.anchors.common import RecentRoutes
from fairway.routing.anchors.hashing import session_key
from tests.factories import chain
from tests.fairway.routing.helpers import last, ranked, req, ring_order, router, st


def test_consistent_hash_keys_on_the_first_k_blocks():
    r = router("consistent-hash")
    states = [st(j) for j in range(4)]
    a = req(160, chain("s", 4) + chain("x", 6))
    b = req(96, chain("s", 4) + chain("y", 2))
    assert choice(ranked(r, a, states)) == choice(ranked(r, b, states))
    assert r.key(a) == r.key(b)
    short = req(40, chain("s", 2))  # shorter than k: keyed on the blocks it has
    assert r.key(short) == r.key(req(32, chain("s", 2)))
    assert r.key(short) != r.key(a)
    assert last(r).reason == "hash"
    assert r.key(req(10, [], rid=1)) != r.key(req(10, [], rid=2))  # no block: spread by request id
    ranked(r, req(10, [], rid=1), states)
    assert last(r).reason == "no-blocks"
    assert router("consistent-hash", k=2).key(a) == r.key(short)


def test_consistent_hash_spreads_and_is_consistent_when_a_replica_leaves():
    r = router("consistent-hash")
    four = [st(j) for j in range(4)]
    three = four[:3]
    fams = [req(160, chain(f"fam{i}", 10)) for i in range(200)]
    before = [ranked(r, f, four) for f in fams]
    owners = [choice(x) for x in before]
    assert {j: owners.count(j) > 20 for j in range(4)} == {j: True for j in range(4)}
    after = [choice(ranked(r, f, three)) for f in fams]
    for old, new in zip(before, after, strict=True):
        if old[0][0] != 3:
            assert new == old[0][0]  # keys owned by a remaining replica do not move
        else:
            assert new == old[1][0]  # the departed replica's keys go to the next on the ring
    fresh = router("consistent-hash")  # a replica joins: only keys it takes move
    first = [choice(ranked(fresh, f, three)) for f in fams]
    joined = [choice(ranked(fresh, f, four)) for f in fams]
    assert first == after
    assert joined == owners


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
