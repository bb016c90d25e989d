"""A router policy's answer is data: ``rank`` returns a frozen ``Ranking`` (``fairway/routing/base.py``)
with its reason, scores and waits, and the Fairway router's options are one validated, frozen
``FairwayRouterConfig`` (``fairway/routing/fairway.py``)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from fairway.clock import ManualClock
from fairway.load_view import LoadView
from fairway.prefix_index import PrefixIndex
from fairway.routing import ROUTERS, Ranking, RouterError
from fairway.routing.fairway import FairwayRouter, FairwayRouterConfig
from fairway.routing.host import RoutingHost
from tests.factories import LinearCost, chain
from tests.fairway.routing.helpers import BS, check, req, router, st


@pytest.mark.parametrize("name", sorted(ROUTERS))
def test_every_router_returns_a_frozen_ranking_and_keeps_no_last_answer(name):
    r = router(name, seed=2)
    states = [st(0, outstanding=2, matched=3), st(1, q=0.4, kv=0.5), st(2, outstanding=1, matched=10, tree=20)]
    out = r.rank(req(160), states)
    assert isinstance(out, Ranking) and out.reason
    check(out.ranks, states)
    assert set(out.scores) <= {0, 1, 2} and set(out.waits) <= {0, 1, 2}
    with pytest.raises(dataclasses.FrozenInstanceError):
        out.reason = "other"  # type: ignore[misc]
    assert not [a for a in vars(r) if a.startswith("last_")]


def test_the_fairway_router_returns_every_candidates_score_and_wait():
    states = [st(0, matched=50, q=2.0), st(1, q=0.5), st(2, matched=10, q=1.0)]
    out = router("fairway", rule="affinity").rank(req(1000), states)
    assert out.ranks == [[0], [1], [2]] and out.reason == "affinity"
    assert out.scores == pytest.approx({0: 2.21, 1: 1.51, 2: 1.85})
    assert set(out.waits) == {0, 1, 2}
    assert router("round-robin").rank(req(), states) == Ranking([[0], [1], [2]], "round-robin")


def test_a_routing_decision_carries_the_policys_ranking():
    clock, cost = ManualClock(), LinearCost()
    policy = router("fairway")
    host = RoutingHost(policy, PrefixIndex(2), LoadView(2, clock, cost, block_size=BS), block_size=BS)  # type: ignore[arg-type]
    d = host.decide(1, 160, chain("p", 10))
    assert d.ranking is not None and d.ranking.ranks == d.ranks and d.ranking.reason == d.reason == "cold"
    assert set(d.ranking.scores) == set(d.ranking.waits) == {0, 1}


def test_fairway_router_config_defaults_and_validation():
    cfg = FairwayRouterConfig()
    assert (cfg.theta, cfg.fast_share, cfg.wait_model, cfg.rule, cfg.host_tier) == (12.0, pytest.approx(0.4),
                                                                                    "queue", "score", True)
    assert router("fairway").config == cfg
    assert router("fairway", theta=8).config == FairwayRouterConfig(theta=8.0)
    assert isinstance(FairwayRouterConfig(theta=8).theta, float)  # numbers normalised once
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.theta = 3.0  # type: ignore[misc]
    for bad, needle in (({"theta": 0}, "theta must be > 0"), ({"fast_share": 0}, "fast_share must be in"),
                        ({"footprint": "x"}, "footprint must be"), ({"wait_model": "x"}, "wait_model must be"),
                        ({"rule": "x"}, "rule must be"), ({"affinity_ties": "x"}, "affinity_ties must be"),
                        ({"p_floor_s": -1}, "p_floor_s must be"), ({"speed_aware": 1}, "speed_aware must be true")):
        with pytest.raises(ValueError, match=needle):
            FairwayRouterConfig(**bad)
        with pytest.raises(RouterError, match=f"bad options for router 'fairway'.*{needle}"):
            router("fairway", **bad)
    with pytest.raises(RouterError, match="wait_modle"):
        router("fairway", wait_modle="fcfs")


def test_a_config_object_or_options_not_both():
    cfg = FairwayRouterConfig(theta=4)
    r = FairwayRouter(ManualClock(), LinearCost(), BS, np.random.default_rng(0), config=cfg)  # type: ignore[arg-type]
    assert r.config is cfg
    with pytest.raises(TypeError, match="not both"):
        FairwayRouter(ManualClock(), LinearCost(), BS, config=cfg, theta=5)  # type: ignore[arg-type]
