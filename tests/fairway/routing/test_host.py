"""The routing host (fairway/routing/host.py): the tier split read from an events index,
unchanged decisions without a host tier, and the class view of a classed request."""

from __future__ import annotations

import numpy as np
import pytest

from fairway.clock import ManualClock
from fairway.load_view import LoadView
from fairway.policies.classes import ClassesConfig
from fairway.prefix_index import PrefixIndex
from fairway.routing import make_router
from fairway.routing.host import RoutingHost
from tests.factories import LinearCost, chain
from tests.fairway.routing.helpers import BS, last, ranked, req, router, st


def _tier_host(host_tier: bool) -> tuple[RoutingHost, PrefixIndex]:
    clock = ManualClock()
    cost = LinearCost()
    idx = PrefixIndex(3, mode="events")
    pol = make_router("fairway", clock=clock, cost=cost, block_size=BS,  # type: ignore[arg-type]
                      rng=np.random.default_rng(0), replicate=False, host_tier=host_tier)
    return RoutingHost(pol, idx, LoadView(3, clock, cost, block_size=BS), block_size=BS), idx  # type: ignore[arg-type]


def test_routing_host_reads_the_tier_split_from_an_events_index():
    hs = chain("p", 10)
    # tier-aware: replica 1 (fewer host blocks); tier-blind: a tie of full matches, the lower id
    for host_tier, expected in ((True, 1), (False, 0)):
        host, idx = _tier_host(host_tier)
        for j in (0, 1, 2):
            idx.on_kv_events(j, [(True, h) for h in hs[: 9 if j < 2 else 4]])
        idx.on_tier_events(0, [(True, h) for h in hs[5:9]])  # replica 0: 5 GPU + 4 host blocks
        idx.on_tier_events(1, [(True, h) for h in hs[7:9]])  # replica 1: 7 GPU + 2 host blocks
        d = host.decide(1, 160, hs)
        assert (d.pick, d.matched_blocks) == (expected, 9)
        assert d.ranking.scores[0] - d.ranking.scores[1] == pytest.approx(
            (4 - 2) * BS / 50e9 if host_tier else 0.0, abs=1e-15)


def test_no_host_tier_decisions_are_unchanged():
    """No tier events: the tier-aware router decides exactly as the tier-blind one (random
    states and prompts, every decision and score equal)."""
    rng = np.random.default_rng(3)
    aware, blind = router("fairway"), router("fairway", host_tier=False)
    for k in range(200):
        states = [st(j, outstanding=int(rng.integers(0, 5)), q=float(rng.random()), kv=float(rng.random()),
                     matched=int(rng.integers(0, 12)), tree=int(rng.integers(0, 100))) for j in range(4)]
        rq = req(int(rng.integers(17, 400)), rid=k)
        assert ranked(aware, rq, states) == ranked(blind, rq, states)
        assert last(aware).scores == last(blind).scores


def _class_host(classes: str = "interactive:tier=0,batch:tier=1", **options: object) -> RoutingHost:
    """Two replicas, the Fairway router (no replication) and ``classes``."""
    clock = ManualClock()
    cost = LinearCost()
    pol = make_router("fairway", clock=clock, cost=cost, block_size=BS,  # type: ignore[arg-type]
                      rng=np.random.default_rng(0), replicate=False, **options)
    return RoutingHost(pol, PrefixIndex(2), LoadView(2, clock, cost, block_size=BS),  # type: ignore[arg-type]
                       block_size=BS, classes=ClassesConfig.parse(classes))


def test_a_classed_request_no_replica_serves_in_time_is_placed_by_its_class_view():
    """Replica 0 holds 10 s of batch work, replica 1 1 s of batch and 2 s of interactive work.
    By the whole queues (10 s against 3 s) no replica meets a 1 s objective, so the class view
    decides: an interactive request waits 0 s on replica 0 and 2 s on replica 1 (the gates serve
    tier 0 first), a batch request 10 s against 3 s (replica 1, as is one of the default class,
    batch). Without the class view, or with a 5 s interactive objective that replica 1 meets
    by the whole queue, the whole queue decides: replica 1 (it spares replica 0's backlog)."""
    cases = (("interactive:tier=0,batch:tier=1", True, [0, 1, 1]),
             ("interactive:tier=0,batch:tier=1", False, [1, 1, 1]),
             ("interactive:tier=0:objective=5,batch:tier=1", True, [1, 1, 1]))
    for classes, view, expected in cases:
        host = _class_host(classes, class_view=view)
        for rid, j, p, k in ((1, 0, 10.0, "batch"), (2, 1, 1.0, "batch"), (3, 1, 2.0, "interactive")):
            host.load.on_routed(rid, j, 100, prefill_s=p, klass=k)
        picks = [host.decide(10 + n, 160, chain(f"q{n}", 10), klass=k).pick
                 for n, k in enumerate(("interactive", "batch", ""))]  # "": the default class, batch
        assert picks == expected, (classes, view)
    d = _class_host().decide(20, 160, chain("w", 10), klass="interactive")
    assert d.ranking.waits == {0: 0.0, 1: 0.0}  # empty queues: the whole view, met at once


def test_bookings_queue_a_request_under_its_class_and_resolve_the_default():
    host = _class_host()
    host.book(1, 0, 160, 0, klass="")
    host.book(2, 1, 160, 0, klass="interactive")
    host.book(3, 1, 160, 0, klass="unknown")  # a class this router does not know: the whole queue only
    queues = host.load.snapshot().class_queues
    assert set(queues[0]) == {"batch"} and set(queues[1]) == {"interactive"}
    assert host.load.snapshot().outstanding == (1, 2)


def _chunk_host(chunk: int) -> tuple[RoutingHost, ManualClock]:
    clock = ManualClock()
    cost = LinearCost()
    pol = make_router("fairway", clock=clock, cost=cost, block_size=BS,  # type: ignore[arg-type]
                      rng=np.random.default_rng(0), replicate=False, prefill_chunk=chunk)
    return RoutingHost(pol, PrefixIndex(2), LoadView(2, clock, cost, block_size=BS), block_size=BS), clock  # type: ignore[arg-type]


def test_a_long_prompt_is_booked_and_priced_in_the_engines_chunks():
    """A 250-token prompt on an engine that computes 100 tokens a step runs in 3 steps: the
    router books it at 3 x 0.01 + 0.25 = 0.28 s and sees its replica busy until then. Priced as
    one pass (``prefill_chunk=0``) it is booked at 0.26 s, and at t = 0.27, while its last chunk
    still runs, its replica looks free."""
    for chunk, booked, wait_at_027 in ((100, 0.28, 0.01), (0, 0.26, 0.0)):
        host, clock = _chunk_host(chunk)
        d = host.decide(1, 250, chain("long", 15))
        assert d.ranking.scores[d.pick] == pytest.approx(booked)  # idle: T = P
        host.book(1, d.pick, 250, 0)
        assert host.load.snapshot().queued_prefill_s[d.pick] == pytest.approx(booked)
        host.on_started(1)  # at t = 0
        clock.set(0.27)
        assert host.decide(2, 100, chain("short", 6)).ranking.waits == pytest.approx(
            {d.pick: wait_at_027, 1 - d.pick: 0.0})
    # the first step's own chunk: a prompt that fits one chunk is priced as one pass either way
    host, _ = _chunk_host(100)
    assert host.decide(3, 90, chain("fits", 5)).ranking.scores[0] == pytest.approx(0.01 + 0.09)
