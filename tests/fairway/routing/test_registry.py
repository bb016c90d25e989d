"""The router registry (fairway/routing/__init__.py): every registered router ranks each replica
once and refuses bad candidates, unknown names and bad options, dotted paths load, and the
defaults are those docs/design.md and the upstream sources state."""

from __future__ import annotations

import math

import numpy as np
import pytest

from fairway.routing import ROUTERS, RouterError, router_class
from fairway.routing.anchors import Pow2
from tests.fairway.routing.helpers import last, ranked, req, router, st

EXPECTED = {"round-robin", "pow2", "consistent-hash", "prefix-hash", "session-hash", "ray-prefix", "sglang",
            "sglang-classic", "dynamo", "llmd", "llmd-baseline", "aibrix", "vllm-prefixaware", "vllm-loadaware",
            "fairway"}


def test_registry_names():
    assert set(ROUTERS) == EXPECTED
    assert all(cls.name == name for name, cls in ROUTERS.items())


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_every_router_ranks_each_replica_once(name):
    rng = np.random.default_rng(42)
    r = router(name, seed=1)
    for _ in range(50):
        n = int(rng.integers(1, 7))
        ids = sorted(rng.choice(20, size=n, replace=False).tolist())
        states = []
        for j in ids:
            run = int(rng.integers(0, 10))
            states.append(st(j, outstanding=run + int(rng.integers(0, 100)), running=run, q=float(rng.random() * 5),
                             kv=float(rng.random()), matched=int(rng.integers(0, 12)), tree=int(rng.integers(0, 50)),
                             qtok=int(rng.integers(0, 4000)), active=int(rng.integers(0, 500))))
        prompt = int(rng.integers(1, 400))
        ranks = ranked(r, req(prompt), states)
        assert ranks[0][0] in ids
        assert isinstance(last(r).reason, str) and last(r).reason


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_every_router_rejects_empty_and_duplicate_candidates(name):
    r = router(name)
    with pytest.raises(ValueError, match="no replicas"):
        ranked(r, req(), [])
    with pytest.raises(ValueError, match="twice"):
        ranked(r, req(), [st(1), st(1)])


def test_unknown_router_and_bad_options():
    with pytest.raises(RouterError, match=r"unknown router 'nope'; known: aibrix, consistent-hash, dynamo"):
        router("nope")
    with pytest.raises(RouterError, match="bad options for router 'fairway'"):
        router("fairway", thetta=3)
    with pytest.raises(RouterError, match="bad options for router 'fairway'"):
        router("fairway", theta=0)
    with pytest.raises(RouterError, match="bad options for router 'pow2'"):
        router("pow2", k=3)
    with pytest.raises(RouterError, match="not a RouterPolicy"):
        router("fairway.clock:ManualClock")
    with pytest.raises(RouterError, match="cannot import"):
        router("no.such.module:X")


def test_dotted_paths():
    assert router_class("fairway.routing.anchors:Pow2") is Pow2
    assert router_class("fairway.routing.anchors.Pow2") is Pow2
    assert isinstance(router("fairway.routing.anchors.Pow2"), Pow2)


def test_options_match_design_defaults():
    assert router("consistent-hash").k == 4
    assert math.isinf(router("ray-prefix").imbalanced_threshold)
    assert router("ray-prefix").match_rate_threshold == 0.1
    sg = router("sglang")
    assert (sg.balance_abs_threshold, sg.balance_rel_threshold, sg.cache_threshold) == (64, 1.5, 0.3)
    dy = router("dynamo")
    assert (dy.overlap_score_credit, dy.prefill_load_scale, dy.host_cache_hit_weight) == (1.0, 1.0, 0.75)
    ll = router("llmd-baseline")
    assert (ll.w_prefix, ll.w_queue, ll.w_kv) == (3, 2, 2)
    ld = router("llmd")
    assert (ld.affinity_threshold, ld.exploration, ld.max_ttft_penalty_s, ld.queue_threshold_tokens) == (
        0.8, 0.0, 18.0, 4194304)
    ai = router("aibrix")
    assert (ai.imbalance_abs_count, ai.std_factor) == (8, 1.0)
    assert router("fairway").config.theta == 12.0


def test_defaults_are_the_upstream_defaults():
    ph = router("prefix-hash")
    assert (ph.prefix_tokens, ph.load_factor, ph._ring.vnodes, ph.spill) == (256, 1.25, 150, "least-loaded")
    sh = router("session-hash")
    assert (math.isinf(sh.max_load_skew), sh.fallback, sh._recent.window_s) == (True, "random", 60.0)
    assert router("vllm-loadaware").beta == 1.0
    pa = router("vllm-prefixaware")
    assert (pa.min_match, pa.chars_per_token) == (0, 4.0)
