"""``llmd`` and ``llmd-baseline`` (fairway/routing/anchors/llmd.py): the filters, scores and random
ties of the upstream rules on hand-made states, and the in-flight prompt tokens ``llmd`` reads
(held from routing to the first token, in the load view and the simulator)."""

from __future__ import annotations

import pytest

from fairway.load_view import LoadView
from fairway.prefix_index import PrefixIndex
from fairway.routing import choice
from fairway.routing.host import RoutingHost
from tests.factories import LinearCost
from tests.fairway.routing.helpers import BS, last, picks, ranked, req, router, st, view


def test_llmd_baseline_score_arithmetic():
    r = router("llmd-baseline")
    states = [
        st(0, matched=10, outstanding=6, running=2, kv=0.5),  # 3*1 + 2*0 + 2*0.5 = 4.0
        st(1, matched=0, outstanding=1, running=1, kv=0.2),  # 0 + 2*1 + 2*0.8 = 3.6
        st(2, matched=5, outstanding=3, running=1, kv=0.9),  # 1.5 + 2*0.5 + 0.2 = 2.7
    ]
    assert ranked(r, req(160), states) == [[0], [1], [2]]
    assert last(r).scores == pytest.approx({0: 4.0, 1: 3.6, 2: 2.7})
    states[0] = st(0, matched=10, outstanding=6, running=2, kv=1.0)  # 3.0 < 3.6
    assert choice(ranked(r, req(160), states)) == 1
    # All queues equal: the queue term is 1 for everyone.
    same = [st(0, matched=2, kv=0.5), st(1, matched=2, kv=0.5)]
    ranked(r, req(160), same)
    assert last(r).scores == pytest.approx({0: 0.6 + 2 + 1, 1: 0.6 + 2 + 1})
    assert set(picks(r, req(160), same, 30)) == {0, 1}  # the max-score picker's random ties


def tok(replica: int, tokens: int, matched: int = 0, **kw):
    """A replica state with ``tokens`` uncached prompt tokens in flight (no first token yet)."""
    s = st(replica, matched=matched, **kw)
    s.active_prefill_tokens = tokens
    return s


def test_llmd_baseline_ties_are_random_from_the_rng():
    same = [st(0, matched=2, kv=0.5), st(1, matched=2, kv=0.5), st(2, matched=0, kv=0.5)]
    got = picks(router("llmd-baseline", seed=4), req(160), same, 40)
    assert set(got) == {0, 1}
    assert got == picks(router("llmd-baseline", seed=4), req(160), same, 40)


def test_llmd_filters_to_sticky_replicas_then_the_least_token_load():
    r = router("llmd", peak_prefill_tps=1000.0)
    # 10-block prompt: 8 and 10 blocks are sticky (>= 0.8), 7 is not, however idle it is
    states = [tok(0, 5000, matched=8), tok(1, 3000, matched=10), tok(2, 0, matched=7)]
    assert ranked(r, req(160), states) == [[1], [0], [2]]
    assert last(r).reason == "affinity"
    assert last(r).scores[1] == pytest.approx(1 - 3000 / 4194304)


def test_llmd_ttft_gate_breaks_stickiness_past_18_seconds_of_prefill():
    r = router("llmd", peak_prefill_tps=1000.0)
    # best sticky 18,000 tokens = 18 s over the best other (0): not more than 18 s, still sticky
    states = [tok(0, 18_000, matched=10), tok(1, 0, matched=2), tok(2, 500)]
    assert choice(ranked(r, req(160), states)) == 0
    states[0] = tok(0, 18_001, matched=10)
    assert ranked(r, req(160), states) == [[1], [2], [0]]
    assert last(r).reason == "affinity-broken"


def test_llmd_without_a_sticky_replica_scores_all_and_ties_are_random():
    r = router("llmd", seed=1)
    states = [tok(0, 100, matched=7), tok(1, 100), tok(2, 200)]
    assert set(picks(r, req(160), states, 30)) == {0, 1}
    assert last(r).reason == "no-affinity"
    # past queue_threshold_tokens the score is 0 for every replica: all tie
    full = [tok(0, 5_000_000), tok(1, 4_194_304), tok(2, 9_000_000)]
    assert set(picks(r, req(160), full, 40)) == {0, 1, 2}


def test_llmd_exploration_skips_the_filter():
    r = router("llmd", exploration=1.0)
    assert choice(ranked(r, req(160), [tok(0, 900, matched=10), tok(1, 0)])) == 1
    assert last(r).reason == "explore"


def test_llmd_peak_prefill_throughput_is_calibrated_on_one_8192_token_chunk():
    assert router("llmd").peak_prefill_tps == pytest.approx(8192 / LinearCost().prefill_time(8192, 0))
    with pytest.raises(ValueError):
        router("llmd", exploration=2.0)


def test_active_prefill_tokens_are_held_from_routing_to_the_first_token():
    lv, _ = view()
    lv.on_routed(1, 0, prompt_tokens=1000, cached_tokens=800)
    lv.on_routed(2, 0, prompt_tokens=100)
    lv.on_routed(3, 1, prompt_tokens=160, cached_tokens=160)  # capped at 159: 1 uncached token
    assert lv.snapshot().active_prefill_tokens == (300, 1)
    lv.on_started(1)  # admission does not release them: the first token does
    assert lv.snapshot().active_prefill_tokens == (300, 1)
    lv.on_first_token(1)
    lv.on_first_token(1)  # idempotent
    assert lv.snapshot().active_prefill_tokens == (100, 1)
    lv.on_finished(2)  # finished (or rejected) before a first token: released then
    lv.on_prefill_done(3)  # the Ray host's first-token report releases them too
    assert lv.snapshot().active_prefill_tokens == (0, 0)
    lv.on_finished(1)
    lv.on_finished(3)
    assert lv.snapshot().active_prefill_tokens == (0, 0)


def test_only_a_policy_that_reads_them_hears_first_tokens():
    for name, held in (("llmd", 0), ("llmd-baseline", 160)):
        lv, _ = view()
        host = RoutingHost(router(name), PrefixIndex(2), lv, block_size=BS)
        host.book(7, 0, 160, 0)
        host.on_first_token(7)
        assert lv.snapshot().active_prefill_tokens[0] == held


def test_the_simulator_releases_llmds_tokens_at_each_first_token(monkeypatch):
    from tests.sim.test_cluster import cluster, family_specs

    early: list[int] = []
    real = LoadView.on_first_token

    def spy(self, rid):
        if rid in self and self.snapshot().active_prefill_tokens:  # released while still in flight
            early.append(rid)
        real(self, rid)

    monkeypatch.setattr(LoadView, "on_first_token", spy)
    specs = family_specs(20)
    sim, engines, host = cluster("llmd", specs)
    assert len(sim.run().finished) == 20
    assert sorted(early) == list(range(20))
    assert host.instances[0].load.live().active_prefill_tokens == (0,) * len(engines)
