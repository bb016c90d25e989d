"""The routing host (fairway/routing/host.py): the tier split read from an events index, and
unchanged decisions without a host tier."""

from __future__ import annotations

import numpy as np
import pytest

from fairway.clock import ManualClock
from fairway.load_view import LoadView
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
