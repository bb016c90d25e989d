"""The anchors checked against their sources in issue 22 (``sglang``, ``aibrix``, ``llmd``,
``llmd-baseline``): each decision pinned on a hand-made state where the upstream rule's outcome is
known, and the load view's in-flight prompt tokens that ``llmd`` reads."""

from __future__ import annotations

import pytest

from fairway.prefix_index import PrefixIndex
from fairway.routing import choice
from fairway.routing.host import RoutingHost
from tests.factories import LinearCost, chain
from tests.test_routing import BS, last, picks, ranked, req, router, st, view


def tok(replica: int, tokens: int, matched: int = 0, **kw):
    """A replica state with ``tokens`` uncached prompt tokens in flight (no first token yet)."""
    s = st(replica, matched=matched, **kw)
    s.active_prefill_tokens = tokens
    return s


# -- sglang: SMG cache_aware ---------------------------------------------------------------------


def test_sglang_below_threshold_takes_the_least_loaded_not_the_smallest_tree():
    states = [st(0, tree=1, outstanding=5), st(1, tree=50, outstanding=2), st(2, tree=30, outstanding=3)]
    r = router("sglang")
    assert ranked(r, req(160), states) == [[1], [2], [0]]
    assert last(r).reason == "least-loaded"
    assert choice(ranked(router("sglang-classic"), req(160), states)) == 0  # the old rule: smallest tree


def test_sglang_least_loaded_ties_go_to_fewer_processed_then_id():
    r = router("sglang")
    idle = [st(0), st(1), st(2)]
    # every pick counts as processed: equal loads rotate 0, 1, 2, 0 (SMG PR 1714), no randomness
    assert [choice(ranked(r, req(160, hashes=chain(f"x{i}", 10)), idle)) for i in range(4)] == [0, 1, 2, 0]


@pytest.mark.parametrize("seed", range(6))
def test_sglang_affinity_goes_to_the_first_holder_whatever_its_load(seed):
    r = router("sglang", seed=seed)
    shared = chain("sys", 10)
    # first request: nothing matched, replica 2 is the least loaded and becomes the prefix's owner
    assert choice(ranked(r, req(160, hashes=shared), [st(0, outstanding=3), st(1, outstanding=3), st(2)])) == 2
    # all three now hold the whole prompt: the tree names its first tenant, not the idlest holder
    full = [st(0, matched=10), st(1, matched=10), st(2, matched=10, outstanding=60)]
    assert ranked(r, req(160, hashes=shared), full) == [[2], [0], [1]]
    assert last(r).reason == "affinity"
    # no per-request spill gate: 60 > 1.5 x mean (20) and > mean + 40, still the owner; only the
    # fleet-wide switch (max - min > 64 and max > 1.5 min) moves it
    full[2] = st(2, matched=10, outstanding=65)
    assert ranked(r, req(160, hashes=shared), full) == [[0], [1], [2]]
    assert last(r).reason == "imbalanced"


def test_sglang_affinity_without_a_known_owner_is_random_among_the_best_matched():
    states = [st(0, matched=10), st(1, matched=10), st(2, matched=2)]
    got = {choice(ranked(router("sglang", seed=s), req(160), states)) for s in range(12)}
    assert got == {0, 1}


def test_sglang_match_rate_must_exceed_the_threshold():
    r = router("sglang")
    # 160-token prompt: 3 blocks = 0.3 is not > 0.3: least loaded; 4 blocks = 0.4: the match
    assert choice(ranked(r, req(160), [st(0, matched=3, outstanding=1), st(1)])) == 1
    assert last(r).reason == "least-loaded"
    assert choice(ranked(router("sglang"), req(160), [st(0, matched=4, outstanding=1), st(1)])) == 0


# -- aibrix --------------------------------------------------------------------------------------


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


# -- llm-d ---------------------------------------------------------------------------------------


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


# -- the in-flight prompt tokens llmd reads --------------------------------------------------------


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
    from fairway.load_view import LoadView
    from tests.test_cluster import cluster, family_specs

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
