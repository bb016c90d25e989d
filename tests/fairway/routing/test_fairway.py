"""The Fairway router (fairway/routing/fairway.py; the model: docs/design.md, Fairway router): exact
picks, scores and waits on hand-made replica states: the wait model, overtaking, the running
prefill, the decode batch, the footprint, affinity ties, hot-prefix replication, the host tier
and the measured speed."""

from __future__ import annotations

import pytest

from fairway.prefix_index import PrefixIndex
from fairway.routing import ROUTERS, ReplicaState, RouteRequest, choice, make_states
from tests.factories import LinearCost, chain
from tests.fairway.routing.helpers import last, ranked, req, router, st, view


# LinearCost: P = 0.01 + 0.001 * uncached tokens. A 1000-token prompt:
#   replica 0: 50 blocks = 800 cached -> P = 0.21 (theta * P = 2.52)
#   replica 1: cold -> P = 1.01;  replica 2: 10 blocks = 160 cached -> P = 0.85
def fairway_states(q0: float) -> list[ReplicaState]:
    return [st(0, matched=50, q=q0), st(1, q=0.5), st(2, matched=10, q=1.0)]


def test_fairway_affinity_while_the_queue_is_short():
    r = router("fairway", rule="affinity")
    assert ranked(r, req(1000), fairway_states(2.0)) == [[0], [1], [2]]  # rest by Q + P: 1.51, 1.85
    assert last(r).reason == "affinity"
    assert last(r).scores == pytest.approx({0: 2.21, 1: 1.51, 2: 1.85})
    edge = 12 * LinearCost().prefill_time(200, 800)
    assert choice(ranked(r, req(1000), fairway_states(edge))) == 0  # Q_j* <= theta * P_rj* (inclusive)


def test_fairway_fair_choice_when_the_best_cached_queue_is_long():
    r = router("fairway", rule="affinity")
    assert ranked(r, req(1000), fairway_states(3.0)) == [[1], [2], [0]]  # argmin Q + P: 1.51
    assert last(r).reason == "fair"
    r8 = router("fairway", rule="affinity", theta=8)  # 2.0 > 8 * 0.21
    assert choice(ranked(r8, req(1000), fairway_states(2.0))) == 1
    assert last(r8).reason == "fair"
    floor = router("fairway", rule="affinity", p_floor_s=0.25)  # 3.0 <= 12 * max(0.21, 0.25)
    assert choice(ranked(floor, req(1000), fairway_states(3.0))) == 0


def test_fairway_extra_work_weight_prices_the_prefill_a_placement_adds():
    # fair case of fairway_states(3.0): expected TTFT 0: 3.21, 1: 1.51, 2: 1.85; P: 0.21, 1.01, 0.85
    r = router("fairway", extra_work_weight=1.0)  # + (P - 0.21): 0: 3.21, 1: 2.31, 2: 2.49
    assert ranked(r, req(1000), fairway_states(3.0)) == [[1], [2], [0]]
    r4 = router("fairway", extra_work_weight=4.0)  # + 4 (P - 0.21): 0: 3.21, 1: 4.71, 2: 4.41
    assert ranked(r4, req(1000), fairway_states(3.0)) == [[0], [2], [1]]
    assert last(r4).scores == pytest.approx({0: 3.21, 1: 4.71, 2: 4.41})


def test_fairway_footprint_term_sends_cold_work_to_the_emptier_cache():
    states = [st(0, q=0.1, tree=100), st(1, q=0.1, tree=10)]
    d = router("fairway", footprint="index")  # cold P = 1.01: 0.1 + 1.01 + 1.01 * 100/100 vs 0.1 + 1.01 + 1.01 * 10/100
    assert ranked(d, req(1000), states) == [[1], [0]] and last(d).reason == "cold"
    assert last(d).scores == pytest.approx({0: 2.12, 1: 1.211})
    off = router("fairway", footprint="index", footprint_weight=0.0)  # equal expected TTFT: the emptier index
    assert ranked(off, req(1000), states) == [[1], [0]]


def test_fairway_expected_first_token_times_leave_out_the_terms_that_only_price():
    # the footprint case above: T = 0.1 + 1.01 + 1.01 * fullness, the expected time 0.1 + 1.01 on both
    states = [st(0, q=0.1, tree=100), st(1, q=0.1, tree=10)]
    d = router("fairway", footprint="index", extra_work_weight=1.0)
    ranked(d, req(1000), states)
    assert last(d).scores == pytest.approx({0: 2.12, 1: 1.211})
    assert last(d).expected_s == pytest.approx({0: 1.11, 1: 1.11})
    # the extra work (fair case of fairway_states(3.0)) prices too: the expected times are T's without it
    ranked(d, req(1000), fairway_states(3.0))
    assert last(d).expected_s == pytest.approx({0: 3.21, 1: 1.51, 2: 1.85})
    # policies that predict no time leave it empty
    ranked(pow2 := router("pow2"), req(1000), states)
    assert last(pow2).expected_s == {}


def test_fairway_ties_cold_and_the_cacheable_cap():
    r = router("fairway", rule="affinity")
    # Equal best match: the smaller queue is j*.
    assert choice(ranked(r, req(1000), [st(0, matched=50, q=1.0), st(1, matched=50, q=0.5), st(2)])) == 1
    assert last(r).reason == "affinity"
    # Nothing cached anywhere: minimum expected TTFT, reason "cold".
    assert ranked(r, req(1000), [st(0, q=0.3), st(1, q=0.1), st(2, q=0.2)]) == [[1], [2], [0]]
    assert last(r).reason == "cold"
    # Equal expected TTFT: the id decides.
    assert ranked(r, req(1000), [st(0, q=0.3), st(1, q=0.3)]) == [[0], [1]]
    # A fully matched 160-token prompt still computes its last block: 144 cached, P = 0.026.
    ranked(r, req(160), [st(0, matched=10, q=0.3), st(1)])
    assert last(r).reason == "affinity"  # 0.3 <= 12 * 0.026
    assert last(r).scores[0] == pytest.approx(0.3 + 0.026)


def test_fairway_affinity_ties_ttft_spreads_an_equal_best_match():
    # A preamble every replica holds, empty queues: with affinity_ties="id" (the reference design's first
    # rule) the lowest id is j*; with "ttft" (the default) the replica with the lower expected
    # TTFT including the footprint term (the emptier cache), then the fewer outstanding requests.
    states = [st(0, matched=50, tree=100), st(1, matched=50, tree=10), st(2, matched=50, tree=100)]
    d = router("fairway", rule="affinity", affinity_ties="id", footprint="index")
    assert choice(ranked(d, req(1000), states)) == 0 and last(d).reason == "affinity"
    # ttft ties with the KV-usage footprint: the lowest KV usage wins the tie
    dflt = router("fairway", rule="affinity")
    kv_states = [st(0, matched=50, kv=0.6, tree=10), st(1, matched=50, kv=0.3, tree=100), st(2, matched=50, kv=0.6)]
    # after the pick, 0 and 2 tie on expected TTFT: the emptier index (2 holds none) ranks first
    assert ranked(dflt, req(1000), kv_states) == [[1], [2], [0]] and last(dflt).reason == "affinity"
    r = router("fairway", rule="affinity", affinity_ties="ttft", footprint="index")
    states = [st(0, matched=50, tree=100), st(1, matched=50, tree=10), st(2, matched=50, tree=100)]
    assert ranked(r, req(1000), states) == [[1], [0], [2]] and last(r).reason == "affinity"
    states = [st(0, matched=50, tree=10, outstanding=3), st(1, matched=50, tree=10, outstanding=1)]
    assert ranked(r, req(1000), states) == [[1], [0]] and last(r).reason == "affinity"
    # the smaller queue still comes first among equal matches
    states = [st(0, matched=50, tree=10, q=0.2), st(1, matched=50, tree=100, q=0.1)]
    assert choice(ranked(r, req(1000), states)) == 1


def test_fairway_affinity_ties_hash_keys_on_the_first_block_after_the_match():
    # 1000-token prompts of 62 blocks; every replica holds the first 50 (a shared preamble), so
    # j* is the rendezvous-hash winner for block 50, the first one after the match.
    def session(k: int, tail: int = 2000) -> RouteRequest:
        return req(1000, list(range(1000, 1050)) + [5000 + k] + list(range(tail, tail + 11)))

    four = [st(j, matched=50) for j in range(4)]
    r = router("fairway", rule="affinity", affinity_ties="hash")
    # exact choices (xxh3_64 of block 50's hash, seeded by the replica id; the highest wins)
    assert [choice(ranked(r, session(k), four)) for k in range(6)] == [1, 0, 1, 2, 2, 0]
    assert last(r).reason == "affinity"
    assert ranked(r, session(0), four) == [[1], [0], [2], [3]]  # the rest by expected TTFT, then id
    # the same block 50 (a deeper shared prefix), different later blocks: the same replica
    assert choice(ranked(r, session(3, tail=9000), four)) == 2
    # rendezvous: dropping a replica that did not win leaves the choice unchanged
    assert choice(ranked(r, session(3), [s for s in four if s.replica != 0])) == 2
    # distinct sessions behind the shared preamble spread over every tied replica
    spread = [choice(ranked(r, session(k), four)) for k in range(40)]
    assert set(spread) == {0, 1, 2, 3} and max(spread.count(j) for j in range(4)) <= 16
    # affinity_ties="id" breaks the same tie by the lowest id
    assert choice(ranked(router("fairway", rule="affinity", affinity_ties="id"), session(0), four)) == 0
    # only equal best matches with the smallest Q_j tie: a deeper match or a shorter queue wins
    assert choice(ranked(r, session(0), [st(0, matched=50), st(1, matched=49), st(2, matched=50)])) == 0
    assert choice(ranked(r, session(0), [st(0, matched=50), st(1, matched=50, q=0.1), st(2, matched=50)])) == 0
    assert choice(ranked(r, session(0), [st(0, matched=40), st(1, matched=50, q=0.1)])) == 1
    # a match capped at the cacheable prefix (61 blocks of a 1000-token prompt) keys on the last
    # block, so prompts that differ only before it land together
    full = [st(j, matched=62) for j in range(4)]
    assert [choice(ranked(r, session(k), full)) for k in range(4)] == [3, 3, 3, 3]


def test_fairway_affinity_ties_kv_sends_an_equal_best_match_to_the_freest_memory():
    # A preamble every replica holds: with affinity_ties="kv", j* is the replica with the lowest
    # KV usage among the equal best matches with the smallest Q_j, then the better expected TTFT
    # (footprint by index blocks here, as measured), then the id.
    r = router("fairway", rule="affinity", affinity_ties="kv", footprint="index")
    states = [st(0, matched=50, kv=0.5), st(1, matched=50, kv=0.2, tree=100), st(2, matched=50, kv=0.2, tree=10)]
    assert ranked(r, req(1000), states) == [[2], [0], [1]] and last(r).reason == "affinity"
    # equal KV usage and equal expected TTFT: the lower id
    assert choice(ranked(r, req(1000), [st(0, matched=50, kv=0.3), st(1, matched=50, kv=0.3)])) == 0
    # a shorter queue still beats freer memory; a deeper match beats both
    assert choice(ranked(r, req(1000), [st(0, matched=50, kv=0.9), st(1, matched=50, kv=0.1, q=0.1)])) == 0
    assert choice(ranked(r, req(1000), [st(0, matched=50, kv=0.9, q=0.1), st(1, matched=49, kv=0.1)])) == 0
    # scores and the cold choice are those of the same footprint with other ties
    cold = [st(0, q=0.1, kv=0.1, tree=100), st(1, q=0.1, kv=0.9, tree=10)]
    same = router("fairway", rule="affinity", footprint="index")
    assert ranked(r, req(1000), cold) == ranked(same, req(1000), cold) == [[1], [0]]


def test_fairway_kv_footprint_prices_placement_by_kv_usage():
    # cold P = 1.01; fullness = kv_usage / the highest kv_usage: 0.8/0.8 and 0.2/0.8
    states = [st(0, q=0.1, kv=0.8, tree=10), st(1, q=0.1, kv=0.2, tree=100)]
    r = router("fairway", footprint="kv")
    assert ranked(r, req(1000), states) == [[1], [0]] and last(r).reason == "cold"
    assert last(r).scores == pytest.approx({0: 0.1 + 2 * 1.01, 1: 0.1 + 1.01 * 1.25})
    assert ranked(router("fairway", footprint="index"), req(1000), states) == [[0], [1]]  # 10 < 100 blocks
    assert ranked(router("fairway"), req(1000), states) == [[1], [0]]  # the default is footprint="kv"
    # "kv-abs": the usage itself, so low usages barely count: 0.1 + 1.01 * 1.8 against 0.1 + 1.01 * 1.2
    a = router("fairway", footprint="kv-abs")
    assert ranked(a, req(1000), states) == [[1], [0]]
    assert last(a).scores == pytest.approx({0: 0.1 + 1.01 * 1.8, 1: 0.1 + 1.01 * 1.2})
    # Nearly idle memory (2% and 1% in use), replica 0 holding 80 of the 1000 tokens (P 0.93 vs
    # 1.01): the relative fullness (1 against 0.5) moves the request off its cache, 0.93 * 2 >
    # 1.01 * 1.5; the absolute one keeps it, 0.93 * 1.02 < 1.01 * 1.01.
    idle = [st(0, kv=0.02, matched=5), st(1, kv=0.01)]
    assert ranked(router("fairway"), req(1000), idle) == [[1], [0]]
    assert ranked(a, req(1000), idle) == [[0], [1]] and last(a).reason == "affinity"
    assert last(a).scores == pytest.approx({0: 0.93 * 1.02, 1: 1.01 * 1.01})
    with pytest.raises(ValueError):
        router("fairway", footprint="nope")
    with pytest.raises(ValueError):
        router("fairway", affinity_ties="nope")


def test_fairway_footprint_floor_keeps_a_sliver_of_memory_from_reading_full():
    # Two cold replicas, one running a 4,000-token prompt (0.4% of its KV memory), the other
    # empty but with 0.1 s more queued. Relative to the fullest, 0.004 reads as full: 0.5 + 1.01 * 2
    # against 0.6 + 1.01, so the request goes behind the longer queue. Normalised by at least
    # footprint_floor (0.05), the sliver is 0.08 of full: 0.5 + 1.01 * 1.08 < 0.6 + 1.01.
    states = [st(0, q=0.5, kv=0.004), st(1, q=0.6, kv=0.0)]
    assert ranked(router("fairway", footprint_floor=0.0), req(1000), states) == [[1], [0]]
    f = router("fairway", footprint_floor=0.05)
    assert ranked(f, req(1000), states) == [[0], [1]]
    assert last(f).scores == pytest.approx({0: 0.5 + 1.01 * 1.08, 1: 0.6 + 1.01})
    # At or above the floor the fullest replica is the measure, as without it.
    busy = [st(0, q=0.5, kv=0.4), st(1, q=0.6, kv=0.1)]
    assert ranked(f, req(1000), busy) == [[1], [0]]
    assert last(f).scores == pytest.approx({0: 0.5 + 1.01 * 2, 1: 0.6 + 1.01 * 1.25})
    for bad in (-0.1, 1.5):
        with pytest.raises(ValueError):
            router("fairway", footprint_floor=bad)
    with pytest.raises(ValueError, match="footprint='kv' only"):  # never silently ignored
        router("fairway", footprint="index", footprint_floor=0.05)
    for bad in (-1, 1.5, True):  # tokens, a whole number
        with pytest.raises(ValueError, match="prefill_chunk"):
            router("fairway", prefill_chunk=bad)


def test_fairway_queue_wait_model_counts_only_the_work_ahead_in_the_fast_lane():
    # LinearCost: a 1000-token prompt with 800 cached on replica 0 has P = 0.21; cold P = 1.01;
    # with 160 cached (replica 2) P = 0.85. Replica 0's 3.0 s queue holds two requests lighter
    # than 0.21 s (0.1 + 0.2) and two heavier ones.
    states = [st(0, matched=50, qp=(0.1, 0.2, 1.2, 1.5)), st(1, qp=(0.5,)), st(2, matched=10, qp=(0.5, 0.5))]
    r = router("fairway")
    # W_0 = min(3.0, 0.3 / 0.4) = 0.75; replica 1 is cold there: W = Q = 0.5; replica 2: the
    # queued 0.5 + 0.5 are lighter than 0.85: W = min(1.0, 2.5) = 1.0.
    assert ranked(r, req(1000), states) == [[0], [1], [2]] and last(r).reason == "affinity"
    assert last(r).waits == pytest.approx({0: 0.75, 1: 0.5, 2: 1.0})
    # T_0 = 0.96 plus the 0.21 s this request adds to each of the two heavier ones it passes there
    # (overtake_weight); nothing waiting on 1 or 2 is heavier than this request there
    assert last(r).scores == pytest.approx({0: 0.96 + 2 * 0.21, 1: 1.51, 2: 1.85})
    # W = Q for FCFS replicas: replica 0 waits 3.0 s, so the minimum T is replica 1's.
    f = router("fairway", wait_model="fcfs")
    assert ranked(f, req(1000), states) == [[1], [2], [0]] and last(f).reason == "fair"
    assert last(f).scores == pytest.approx({0: 3.21, 1: 1.51, 2: 1.85})
    # The Fast lane's share: with the whole capacity (fast_share = 1), W_0 = 0.3.
    assert ranked(router("fairway", fast_share=1.0), req(1000), states) == [[0], [1], [2]]
    # A replica with every sequence slot taken still admits in its queue's order at each finish,
    # so the cached request keeps its place ahead of the heavier work: W_0 = 0.75 as above.
    full = [st(0, matched=50, qp=(0.1, 0.2, 1.2, 1.5), outstanding=8, running=4, cap=8)] + states[1:]
    assert ranked(r, req(1000), full) == [[0], [1], [2]] and last(r).reason == "affinity"
    assert last(r).waits[0] == pytest.approx(0.75)
    # fcfs_when_full (the earlier model) prices the full replica as FCFS: W_0 = Q = 3.0, and the
    # request leaves its cache; with one free slot the queue order applies again
    old = router("fairway", fcfs_when_full=True)
    assert ranked(old, req(1000), full) == [[1], [2], [0]] and last(old).reason == "fair"
    assert last(old).waits[0] == pytest.approx(3.0)
    free = [st(0, matched=50, qp=(0.1, 0.2, 1.2, 1.5), outstanding=7, running=3, cap=8)] + states[1:]
    assert choice(ranked(old, req(1000), free)) == 0
    # a host that does not list the waiting requests (empty qp) gets W = Q
    assert router("fairway").expected_wait(st(0, q=2.0), 0.21, 800) == 2.0
    with pytest.raises(ValueError):
        router("fairway", wait_model="nope")
    with pytest.raises(ValueError):
        router("fairway", rule="nope")
    with pytest.raises(ValueError):
        router("fairway", fast_share=0.0)


def test_fairway_score_rule_has_no_separate_affinity_test():
    # A shared preamble on replicas 0 and 1 (P = 0.21 there), replica 2 empty (P = 1.01), all
    # queued work on 0 and 1 lighter than 0.21 s: W_0 = min(0.6, 0.6 / 0.4) = 0.6, W_1 = 0.7.
    # Under rule="affinity", j* = 0 (the equal match with the smaller W) passes the test
    # (0.6 <= 12 * 0.21). Under the default the KV footprint prices 0 and 1, nearly full, above
    # the empty replica 2, so the new session seeds replica 2: T = 1.01 + 0 against
    # 0.6 + 0.21 + 0.21 * 1 = 1.02 and 0.7 + 0.42 = 1.12.
    states = [st(0, matched=50, kv=0.9, qp=(0.2, 0.2, 0.2)), st(1, matched=50, kv=0.9, qp=(0.1, 0.2, 0.2, 0.2)),
              st(2)]
    aff = router("fairway", rule="affinity")
    assert choice(ranked(aff, req(1000), states)) == 0 and last(aff).reason == "affinity"
    r = router("fairway")
    assert ranked(r, req(1000), states) == [[2], [0], [1]] and last(r).reason == "fair"
    assert last(r).scores == pytest.approx({0: 1.02, 1: 1.12, 2: 1.01})
    # nothing cached anywhere: "cold", the minimum T
    assert ranked(r, req(1000), [st(0, qp=(0.2,)), st(1)]) == [[1], [0]] and last(r).reason == "cold"


def test_fairway_running_prefill_counts_the_started_work_still_to_run():
    # At t = 10, replica 0 holds 800 of the 1000 tokens (P = 0.21) but started two cold prompts
    # whose prefills end at 10.5 and 10.9 (one ended at 9.0: done). R_0 = 0.5 + 0.9 = 1.4, so
    # T_0 = 1.4 + 0.21 = 1.61 against the idle replica 1's cold 1.01.
    r = router("fairway")
    r.clock.set(10.0)
    states = [st(0, matched=50, running=3, outstanding=3, ends=(9.0, 10.5, 10.9)), st(1)]
    assert r.running_prefill_s(states[0]) == pytest.approx(1.4)
    assert ranked(r, req(1000), states) == [[1], [0]] and last(r).reason == "fair"
    assert last(r).waits == pytest.approx({0: 1.4, 1: 0.0})
    # R adds to the queue-order wait as well: one lighter request queued (0.1 / 0.4 = 0.25)
    queued = [st(0, matched=50, ends=(10.5,), qp=(0.1, 2.0)), st(1, qp=(0.3,))]
    assert ranked(r, req(1000), queued) == [[0], [1]]
    assert last(r).waits == pytest.approx({0: 0.5 + 0.25, 1: 0.3})
    # Off (no running-prefill term, first step priced as P): replica 0 looks idle and keeps the request.
    off = router("fairway", running_prefill=False, decode_batch=False)
    off.clock.set(10.0)
    assert ranked(off, req(1000), states) == [[0], [1]] and last(off).reason == "affinity"
    assert last(off).waits == pytest.approx({0: 0.0, 1: 0.0})


def test_fairway_delay_weight_charges_a_placement_the_delay_it_adds_to_the_burst_behind_it():
    # At t = 10, replica 0 holds 800 of the 1000 tokens (P = 0.21) behind 1.4 s of started
    # prefill: T_0 = 1.61. Replica 1 is idle (cold P = 1.01, T_1 = 1.01) but was routed eight
    # 0.1 s requests in the last second: lambda = 8/s, rho = 0.8, backlog 0, so the 1.01 s placed
    # there delays the burst's next arrivals by D_1 = 8 * 1.01 * (0 + 1.01) / 0.2 = 40.804 s.
    burst = [st(0, matched=50, outstanding=2, ends=(10.5, 10.9)),
             st(1, routed_since=9.0, routed=(0.1,) * 8)]
    plain = router("fairway")
    plain.clock.set(10.0)
    assert ranked(plain, req(1000), burst) == [[1], [0]] and last(plain).reason == "fair"
    r = router("fairway", delay_weight=0.1)
    r.clock.set(10.0)
    assert r.arrivals_delay(burst[1], 1.01) == pytest.approx(40.804)
    assert r.arrivals_delay(burst[0], 0.21) == 0.0  # no routed window: nothing known to delay
    assert ranked(r, req(1000), burst) == [[0], [1]] and last(r).reason == "affinity"
    assert last(r).scores == pytest.approx({0: 1.61, 1: 1.01 + 4.0804})
    # the backlog lengthens the busy period: 0.5 s queued there gives 8 * 1.01 * 1.51 / 0.2
    assert r.arrivals_delay(st(1, qp=(0.5,), routed_since=9.0, routed=(0.1,) * 8), 1.01) == pytest.approx(61.004)
    # the same eight requests over 100 s (rho = 0.008): the term fades and the request moves
    quiet = [burst[0], st(1, routed_since=-90.0, routed=(0.1,) * 8)]
    assert ranked(r, req(1000), quiet) == [[1], [0]] and last(r).reason == "fair"
    # past saturation the load is capped at 0.95 (1 / (1 - rho) = 20)
    assert r.arrivals_delay(st(1, routed_since=9.9, routed=(0.1,) * 8), 1.01) == pytest.approx(80 * 1.01 * 1.01 * 20)
    with pytest.raises(ValueError):
        router("fairway", delay_weight=-1.0)


def test_fairway_decode_batch_prices_the_first_token_step_with_the_running_decodes():
    # LinearCost's step adds 0.005 s when the batch decodes. Replicas 0 and 1 both hold the whole
    # cacheable prompt (62 blocks: 8 new tokens of 1000, P = 0.018). Replica 0 is decoding two
    # sequences, replica 1 has five requests waiting and none running: S_0 = 0.023, S_1 = 0.018.
    states = [st(0, matched=62, running=2, outstanding=2, active=20), st(1, matched=62, outstanding=5)]
    r = router("fairway")
    assert ranked(r, req(1000), states) == [[1], [0]]
    assert last(r).scores == pytest.approx({0: 0.023, 1: 0.018})
    # without it the two tie on T = P, and the tie goes to fewer outstanding requests
    plain = router("fairway", decode_batch=False)
    assert ranked(plain, req(1000), states) == [[0], [1]]
    assert last(plain).scores == pytest.approx({0: 0.018, 1: 0.018})


def test_fairway_overtaking_stretches_a_cold_wait_by_the_lighter_work_routed_lately():
    # At t = 10, a cold 1000-token prompt (P = 1.01) everywhere. Replica 0 has 0.5 s queued and
    # was routed 0.2 + 0.3 + 0.5 s of lighter work (and 2.0 s of heavier) since t = 0: rho = 0.1,
    # W_0 = 0.5 / 0.9 = 0.556. Replica 1 has 0.54 s queued and no window: W_1 = 0.54.
    r = router("fairway")
    r.clock.set(10.0)
    states = [st(0, qp=(0.5,), routed_since=0.0, routed=(0.2, 0.3, 0.5, 2.0)), st(1, qp=(0.54,))]
    assert r.lighter_rate(states[0], 1.01) == pytest.approx(0.1)
    assert ranked(r, req(1000), states) == [[1], [0]] and last(r).reason == "cold"
    assert last(r).waits == pytest.approx({0: 0.5 / 0.9, 1: 0.54})
    assert last(r).scores == pytest.approx({0: 0.5 / 0.9 + 1.01, 1: 1.55})
    # off (no overtaking): W = R + Q, and replica 0's shorter queue wins
    off = router("fairway", overtaking=False)
    off.clock.set(10.0)
    assert ranked(off, req(1000), states) == [[0], [1]]
    assert last(off).waits == pytest.approx({0: 0.5, 1: 0.54})
    # only lighter work overtakes: a window of heavier requests leaves W = Q
    assert r.expected_wait(st(0, qp=(0.5,), routed_since=0.0, routed=(2.0, 3.0)), 1.01, 0) == pytest.approx(0.5)
    # promotion after theta * P bounds the wait. A 10 s prompt behind rho = 0.99 waits
    # 0.5 / 0.01 = 50 s, under the cap 0.5 + 12 * 10; with theta = 4 the cap, 40.5 s, applies.
    # Lighter work alone filling the replica (rho = 1.1 / 0.5 = 2.2) gives the cap, 0.5 + 12 * 1.01.
    assert r.expected_wait(st(0, qp=(0.5,), routed_since=0.0, routed=(9.9,)), 10.0, 0) == pytest.approx(50.0)
    assert r.expected_wait(st(0, qp=(0.5,), routed_since=9.5, routed=(0.5, 0.6)), 1.01, 0) == pytest.approx(12.62)
    capped = router("fairway", theta=4.0)
    capped.clock.set(10.0)
    assert capped.expected_wait(st(0, qp=(0.5,), routed_since=0.0, routed=(9.9,)), 10.0, 0) == pytest.approx(40.5)
    # an idle replica stays idle whatever its recent traffic
    assert r.expected_wait(st(0, routed_since=0.0, routed=(0.2, 0.3)), 1.01, 0) == 0.0
    # a request that reuses a cache keeps the queue-order wait; FCFS replicas keep W = Q
    cached = st(0, matched=50, qp=(0.1, 0.2, 1.2, 1.5), routed_since=0.0, routed=(0.1, 0.1))
    assert r.expected_wait(cached, 0.21, 800) == pytest.approx(0.75)
    f = router("fairway", wait_model="fcfs")
    f.clock.set(10.0)
    assert f.expected_wait(states[0], 1.01, 0) == pytest.approx(0.5)


def test_queue_model_options_follow_the_replica_policy():
    from fairway.routing.fairway import queue_model_options

    assert queue_model_options("fairway") == {"wait_model": "queue", "fast_share": pytest.approx(0.4)}
    assert queue_model_options("fairway", {"fair_share": 0.75}) == {"wait_model": "queue",
                                                                     "fast_share": pytest.approx(0.25)}
    assert queue_model_options("fairway", {"theta": 6}) == {"wait_model": "queue", "fast_share": pytest.approx(0.4),
                                                            "theta": 6.0}
    assert queue_model_options("fcfs") == {"wait_model": "fcfs"}
    assert queue_model_options("lpm", {"x": 1}) == {"wait_model": "fcfs"}


def test_states_from_load_view_and_index_feed_a_router():
    lv, _ = view(3)
    idx = PrefixIndex(3)
    prompt = chain("doc", 40)
    idx.record_routed(2, prompt)
    lv.on_routed(1, 2, prompt_tokens=640, cached_tokens=0)
    lv.report_kv_usage(0, 0.25)
    rq = RouteRequest(rid=2, prompt_tokens=650, block_hashes=prompt)
    states = make_states(lv.snapshot(), idx.match(prompt), idx.sizes(), replicas=[0, 2])
    assert [(s.replica, s.matched_blocks, s.index_blocks, s.outstanding, s.kv_usage) for s in states] == [
        (0, 0, 0, 0, 0.25), (2, 40, 40, 1, 0.0)]
    assert states[1].queued_prefill_s == pytest.approx(0.65)
    assert states[1].queued_prefills == pytest.approx((0.65,))
    # With W = Q (wait_model="fcfs", the reference design's affinity rule, docs/design.md): replica 2 holds the prefix
    # (P = 0.02) but its queue, 0.65 s, is over 12 * 0.02: the fair choice, 0 + P(650) = 0.66
    # against 0.65 + 0.02.
    r = router("fairway", rule="affinity", wait_model="fcfs", footprint_weight=0.0)
    assert ranked(r, rq, states) == [[0], [2]]
    assert last(r).reason == "fair"
    assert last(r).scores == pytest.approx({0: 0.66, 2: 0.67})
    # The index footprint term adds P * (index blocks / the fullest's): replica 2 is the fullest,
    # + 0.02 * 40 / 40; replica 0 holds nothing, + 0.
    d = router("fairway", rule="affinity", wait_model="fcfs", footprint="index")
    assert ranked(d, rq, states) == [[0], [2]]
    assert last(d).scores == pytest.approx({0: 0.66, 2: 0.69})
    # The KV footprint adds P * (KV usage / the highest): replica 0 reports 0.25, the highest,
    # + 0.66 * 1; replica 2 reports 0, + 0. Replica 2 wins by expected TTFT.
    k = router("fairway", rule="affinity", wait_model="fcfs")
    assert ranked(k, rq, states) == [[2], [0]] and last(k).reason == "affinity"
    assert last(k).scores == pytest.approx({0: 1.32, 2: 0.67})
    # The default (queue wait model, minimum T): the one request queued on replica 2 is heavier
    # (0.65 s) than this one there (0.02 s), so the Fast lane puts this one first: W = 0, and
    # replica 2 wins with T = 0.02, plus the 0.02 s it adds to the request it passes.
    dflt = router("fairway")
    assert ranked(dflt, rq, states) == [[2], [0]] and last(dflt).reason == "affinity"
    assert last(dflt).waits == pytest.approx({0: 0.0, 2: 0.0})
    assert last(dflt).scores == pytest.approx({0: 1.32, 2: 0.04})


def test_fairway_replicates_a_prefix_drawing_more_than_its_holders_share():
    # Replica 0 alone holds the prompt's 50-block prefix (P = 0.21 against 1.01 cold) and is
    # busy: a prefill started there runs 0.5 s more (T_0 = 0.71). The same prefix comes once a
    # second; at its third sighting it draws every decision: share 1 > 1/3. Once it held the
    # prefix, replica 2 would serve the request in 0.21 and replica 1 (0.1 s lighter work
    # queued) in 0.31, both under 0.71: the request seeds replica 2.
    r = router("fairway")

    def busy(t: float, two_holders: bool = False) -> list[ReplicaState]:
        return [st(0, matched=50, ends=(t + 0.5,)), st(1, qp=(0.1,)), st(2, matched=50 if two_holders else 0)]

    got = []
    for t in (0.0, 1.0, 2.0):
        r.clock.set(t)
        got.append((choice(ranked(r, req(1000), busy(t))), last(r).reason))
    assert got == [(0, "affinity"), (0, "affinity"), (2, "replicate")]
    assert ranked(r, req(1000), busy(2.0)) == [[2], [0], [1]]  # ranks: the seed, then by T
    # two holders of three (share 1 > 2/3): replica 2 holds it now and is the best holder
    # (T 0.21), so no non-holder would do better: no seed
    r.clock.set(3.0)
    assert choice(ranked(r, req(1000), busy(3.0, two_holders=True))) == 2 and last(r).reason == "affinity"
    # an idle cluster: a copy would serve the prefix no sooner (0.21 against 0.21): no seed
    idle = router("fairway")
    for t in (0.0, 1.0, 2.0, 3.0):
        idle.clock.set(t)
        assert choice(ranked(idle, req(1000), [st(0, matched=50), st(1), st(2)])) == 0
        assert last(idle).reason == "affinity"
    # priced in the engine's chunks (100 tokens a step: the 200 uncached tokens take 2 steps,
    # 0.22), a copy is priced as the holder is: on an idle cluster still no seed (the first step
    # priced as P, so the copy's price is P's own)
    chunked = router("fairway", prefill_chunk=100, decode_batch=False)
    for t in (0.0, 1.0, 2.0, 3.0):
        chunked.clock.set(t)
        assert choice(ranked(chunked, req(1000), [st(0, matched=50), st(1), st(2)])) == 0
        assert last(chunked).reason == "affinity" and last(chunked).scores[0] == pytest.approx(0.22)
    # other traffic dilutes the share: the prefix in 1 of 4 decisions (0.25 < 1/3) stays put
    d = router("fairway")
    for t in range(13):
        d.clock.set(float(t))
        rq = req(1000) if t % 4 == 0 else req(1000, hashes=chain(f"other{t}", 62))
        ranked(d, rq, busy(float(t)))
        assert last(d).reason != "replicate"
    # off: the holder keeps it
    off = router("fairway", replicate=False)
    for t in (0.0, 1.0, 2.0):
        off.clock.set(t)
        assert choice(ranked(off, req(1000), busy(t))) == 0


def test_a_holders_kv_usage_alone_makes_a_copy_unless_the_seed_rule_leaves_the_footprint_out():
    """The idle cluster of the two-ingress end-to-end test, as one of its routers saw it when it
    sent a follow-up away (2026-12-05): nothing queued or running anywhere, the holder's KV usage
    from a stats report taken while the previous request ran (0.063), the others' 0. The footprint
    normalizes KV usage by the fullest replica's, so the holder's T doubled (P 0.21 + 0.21 against
    a copy's 0.21) and the prefix, all of the traffic, was copied. With seed_footprint=False the
    seed rule compares the T's without that term (the default): no copy; the decision is then the
    affinity one."""
    idle = [st(0, matched=50, kv=0.063), st(1), st(2)]
    for seed_footprint, want in ((True, (1, "replicate")), (False, (0, "affinity"))):
        r = router("fairway", seed_footprint=seed_footprint)
        got = None
        for t in (0.0, 1.0, 2.0):
            r.clock.set(t)
            got = (choice(ranked(r, req(1000), idle)), last(r).reason)
        assert got == want, seed_footprint
        assert last(r).scores[0] == pytest.approx(0.42)  # the holder's own T keeps its footprint term


def test_another_routers_decisions_count_in_the_fairway_prefix_shares():
    """With a shared view, K routers replicate on the whole traffic: three decisions adopted
    from other routers (a 65-token prompt, 4 cacheable blocks, all matched) count as sightings
    and decisions, so the fourth, this router's own, already has a share: prefix rate 3 / 3 s
    over the decision rate (3 - 1) / 3 s = 1.5."""
    r = router("fairway")
    hashes = chain("x", 5)
    for t in (0.0, 1.0, 2.0):
        r.clock.set(t)
        r.on_adopted(hashes, 5, 65)
    assert r.shares.share(int(hashes[3]), 3.0) == pytest.approx(1.5)
    unused = router("fairway")
    unused.on_adopted(hashes, 0, 65)  # nothing matched: a decision, but no prefix sighting
    assert len(unused.shares) == 0


def tier_states(host0: int, host1: int, matched1: int = 9) -> list[ReplicaState]:
    s0, s1 = st(0, matched=9), st(1, matched=matched1)
    s0.host_blocks, s1.host_blocks = host0, host1
    return [s0, s1]


def test_fairway_prefers_a_gpu_hit_to_an_equal_host_hit():
    r = router("fairway", replicate=False)
    assert ranked(r, req(160), tier_states(host0=9, host1=0)) == [[1], [0]]
    assert last(r).scores == pytest.approx({0: 0.026 + 144 / 50e9, 1: 0.026})
    assert ranked(r, req(160), tier_states(host0=3, host1=2)) == [[1], [0]]  # fewer host blocks
    blind = router("fairway", replicate=False, host_tier=False)  # a host hit counts as a GPU hit
    assert ranked(blind, req(160), tier_states(host0=9, host1=0)) == [[0], [1]]
    assert last(blind).scores == pytest.approx({0: 0.026, 1: 0.026})


def test_fairway_prefers_a_host_hit_to_a_miss_unless_the_link_is_slower_than_recompute():
    r = router("fairway", replicate=False)
    states = tier_states(host0=0, host1=9, matched1=9)
    states[0].matched_blocks = 0  # replica 0: a miss; replica 1: the whole prefix in the host tier
    assert ranked(r, req(160), states) == [[1], [0]]  # host hit (0.026 + 3e-9) beats the miss (0.17)
    assert r.host_tokens(req(160), states[1]) == 144
    slow = router("fairway", replicate=False, host_link_bytes_per_s=500.0)  # 144 tokens reload in 0.288 s
    assert ranked(slow, req(160), states) == [[0], [1]]
    assert last(slow).scores == pytest.approx({0: 0.17, 1: 0.026 + 0.288})


def test_fairway_divides_a_replicas_expected_ttft_by_its_measured_speed():
    """Replica 0 has 0.2 s of queued prefill, replica 1 none: at the cost model's pace 1 goes
    first (on 0 the 0.17 s request would also pass the 0.2 s one: T = 0.2 + 0.17 + 0.17).
    Replica 1 reporting a fifth of that pace (its gate drains 0.2 cost-model s per s) makes its T
    five times as long, 0.17 / 0.2 = 0.85 s against 0.54 s: 0 goes first."""
    r = router("fairway", replicate=False, speed_aware=True)
    states = [st(0, outstanding=1, qp=(0.2,)), st(1)]
    assert ranked(r, req(160), states) == [[1], [0]]
    assert last(r).scores == pytest.approx({0: 0.54, 1: 0.17})
    states[1].speed = 0.2
    assert ranked(r, req(160), states) == [[0], [1]]
    assert last(r).scores == pytest.approx({0: 0.54, 1: 0.85})
    states[0].speed = 0.5  # the wait it adds to the request it passes is at the replica's pace too
    assert ranked(r, req(160), states) == [[1], [0]]
    assert last(r).scores == pytest.approx({0: 0.54 / 0.5, 1: 0.85})
    blind = router("fairway", replicate=False, speed_aware=False)
    assert ranked(blind, req(160), states) == [[1], [0]]
    with pytest.raises(ValueError):
        router("fairway", speed_aware="yes")


def test_fairway_host_tokens_follow_the_cacheable_cap():
    r = router("fairway")
    s = st(0, matched=10)
    s.host_blocks = 2  # GPU blocks 0..7, host blocks 8..9; only 9 blocks are cacheable
    assert r.cached_tokens(req(160), s) == 144 and r.host_tokens(req(160), s) == 16
    s.host_blocks = 1  # the one host block is past the cacheable prefix: no reload
    assert r.host_tokens(req(160), s) == 0 and r.reload_s(req(160), s) == 0.0


def test_fairway_host_tier_options_are_checked():
    for bad in ({"host_link_bytes_per_s": 0}, {"host_link_bytes_per_s": -1.0},
                {"host_link_bytes_per_s": float("inf")}, {"host_link_bytes_per_s": "fast"},
                {"host_link_bytes_per_s": True}, {"host_tier": "yes"}, {"host_tier": 1}):
        with pytest.raises(ValueError):
            router("fairway", **bad)
    assert router("fairway", host_link_bytes_per_s=25e9).reload_s_per_token == pytest.approx(1 / 25e9)
    assert router("fairway").host_tier and not router("fairway", host_tier=False).host_tier
    # anchors count both tiers as hits, but Dynamo, which credits a host hit 0.75 of a GPU hit
    assert not any(router(n).host_tier for n in ROUTERS if n not in ("fairway", "dynamo"))


def test_fairway_sticky_match_keeps_a_continuation_within_the_slack():
    # fairway_states(3.0) by T: 1: 1.51, 2: 1.85, 0: 3.21; replica 0 caches 800 of 1000 tokens (0.8);
    # the request's cold prefill is 1.01 s, so T_0 - T_1 = 1.70 is 1.68 cold prefills.
    assert choice(ranked(router("fairway"), req(1000), fairway_states(3.0))) == 1  # off by default
    sticky = router("fairway", sticky_match=0.8, sticky_slack=2)
    assert ranked(sticky, req(1000), fairway_states(3.0)) == [[0], [1], [2]]
    assert choice(ranked(router("fairway", sticky_match=0.8, sticky_slack=1.5), req(1000), fairway_states(3.0))) == 1
    # no replica holds 0.9 of the prompt: the minimum T
    assert choice(ranked(router("fairway", sticky_match=0.9, sticky_slack=100), req(1000), fairway_states(3.0))) == 1
    # the minimum-T pick holds enough already: unchanged
    assert choice(ranked(router("fairway", sticky_match=0.8), req(1000), fairway_states(0.5))) == 0
    with pytest.raises(ValueError, match="sticky_match"):
        router("fairway", sticky_match=1.5)
    with pytest.raises(ValueError, match="sticky_slack"):
        router("fairway", sticky_slack=-1)


def test_fairway_overtake_weight_charges_a_placement_the_wait_it_adds_to_heavier_requests_waiting():
    # Replica 0 holds 800 of the 1000 tokens (P = 0.21); waiting there: one 0.1 s request and three
    # cold 3 s prompts. The request waits for the lighter one only (0.1 / fast_share 0.4 = 0.25 s):
    # T_0 = 0.46. Idle replica 1: cold, T_1 = 1.01. But on 0 it goes ahead of the three heavier
    # requests and delays each by its own 0.21 s: with weight 1 the sum of first-token times
    # grows by 0.46 + 3 * 0.21 = 1.09 there against 1.01 on replica 1, which then gets it.
    states = [st(0, matched=50, qp=(0.1, 3.0, 3.0, 3.0)), st(1)]
    plain = router("fairway", overtake_weight=0.0)  # the rule before 2026-12-06
    assert ranked(plain, req(1000), states) == [[0], [1]] and last(plain).reason == "affinity"
    assert last(plain).scores == pytest.approx({0: 0.46, 1: 1.01})
    r = router("fairway")  # overtake_weight 1, the default
    assert ranked(r, req(1000), states) == [[1], [0]] and last(r).reason == "fair"
    assert last(r).scores == pytest.approx({0: 0.46 + 3 * 0.21, 1: 1.01})
    assert last(r).expected_s == pytest.approx({0: 0.46, 1: 1.01})  # a price, not a wait
    # half the weight keeps it on the holder (0.46 + 0.315 < 1.01); a request no waiting one is
    # heavier than adds nothing: the cold 1.01 s prompt on 1 overtakes nobody
    half = router("fairway", overtake_weight=0.5)
    assert ranked(half, req(1000), states) == [[0], [1]]
    assert ranked(r, req(1000), [st(0, qp=(0.5, 0.9)), st(1, qp=(1.0,))]) == [[1], [0]]
    assert last(r).scores == pytest.approx({0: 1.01 + 1.4, 1: 1.01 + 1.0})
    # FCFS replicas: the request passes nobody, so nothing is added to its wait for all 9.1 s
    fcfs = router("fairway", wait_model="fcfs")
    assert ranked(fcfs, req(1000), states) == [[1], [0]]
    assert last(fcfs).scores == pytest.approx({0: 9.1 + 0.21, 1: 1.01})
    with pytest.raises(ValueError):
        router("fairway", overtake_weight=-1.0)
