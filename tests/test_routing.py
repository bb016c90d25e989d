"""Router policies: exact choices on hand-made replica states, the registry, and the load view."""

from __future__ import annotations

import math
import weakref

import numpy as np
import pytest

from fairway.clock import ManualClock
from fairway.load_view import ROUTED_WINDOW, LoadView
from fairway.prefix_index import PrefixIndex
from fairway.routing import (
    ROUTERS,
    Ranking,
    ReplicaState,
    RouteRequest,
    RouterError,
    RouterPolicy,
    choice,
    make_router,
    make_states,
    router_class,
)
from fairway.routing.anchors import Pow2
from fairway.routing.host import RoutingHost
from fairway.routing.popularity import PrefixShares
from tests.factories import LinearCost, chain

BS = 16


def st(replica: int, outstanding: int = 0, running: int = 0, q: float = 0.0, kv: float = 0.0, matched: int = 0,
       tree: int = 0, qtok: int = 0, active: int = 0, qp: tuple[float, ...] = (), cap: int = 0,
       ends: tuple[float, ...] = (), routed_since: float = 0.0, routed: tuple[float, ...] = ()) -> ReplicaState:
    """A replica state with readable defaults (idle, empty, nothing matched). ``qp``: the waiting
    requests' prefill estimates (their sum becomes Q unless ``q`` is given); ``cap``: max_num_seqs;
    ``ends``: the estimated prefill ends of its started requests; ``routed``: the prefill
    estimates routed to it after ``routed_since``."""
    qp = tuple(sorted(qp))
    return ReplicaState(replica=replica, outstanding=outstanding, running=running, queued_prefill_s=q or sum(qp),
                        kv_usage=kv, matched_blocks=matched, index_blocks=tree, queued_prefill_tokens=qtok,
                        active_blocks=active, queued_prefills=qp, max_running=cap, prefill_ends=ends,
                        routed_since=routed_since, routed_prefills=tuple(sorted(routed)))


def req(prompt: int = 160, hashes=None, rid: int = 0) -> RouteRequest:
    hs = chain("p", prompt // BS) if hashes is None else list(hashes)
    return RouteRequest(rid=rid, prompt_tokens=prompt, block_hashes=hs)


def router(name: str, seed: int = 0, **kw) -> RouterPolicy:
    return make_router(name, clock=ManualClock(), cost=LinearCost(), block_size=BS,  # type: ignore[arg-type]
                       rng=np.random.default_rng(seed), **kw)


def check(ranks: list[list[int]], states) -> None:
    """Every replica exactly once across the ranks; no empty rank."""
    assert all(ranks), ranks
    flat = [j for r in ranks for j in r]
    assert sorted(flat) == sorted(s.replica for s in states)


_RANKINGS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def ranking(r: RouterPolicy, rq: RouteRequest, states) -> Ranking:
    """``r.rank``, its ranks checked; kept as ``r``'s last answer here (``last``)."""
    out = r.rank(rq, states)
    check(out.ranks, states)
    _RANKINGS[r] = out
    return out


def ranked(r: RouterPolicy, rq: RouteRequest, states) -> list[list[int]]:
    return ranking(r, rq, states).ranks


def last(r: RouterPolicy) -> Ranking:
    """The ``Ranking`` ``r`` returned to the last ``ranked`` / ``ranking`` / ``picks`` call here."""
    return _RANKINGS[r]


def picks(r: RouterPolicy, rq: RouteRequest, states, n: int) -> list[int]:
    return [choice(ranked(r, rq, states)) for _ in range(n)]


# -- round-robin, pow2 -------------------------------------------------------------------------


def test_round_robin_cycles_in_id_order():
    r = router("round-robin")
    states = [st(2), st(0), st(1)]  # order of the states does not matter
    assert ranked(r, req(), states) == [[0], [1], [2]]
    assert ranked(r, req(), states) == [[1], [2], [0]]
    assert ranked(r, req(), states) == [[2], [0], [1]]
    assert picks(r, req(), states, 3) == [0, 1, 2]
    assert last(r).reason == "round-robin"


def test_pow2_two_replicas_shorter_queue_first():
    r = router("pow2")
    assert picks(r, req(), [st(0, outstanding=3), st(1, outstanding=1)], 10) == [1] * 10
    assert ranked(r, req(), [st(0, outstanding=3), st(1, outstanding=1)]) == [[1, 0]]
    assert sorted(ranked(r, req(), [st(0, outstanding=2), st(1, outstanding=2)])[0]) == [0, 1]  # tie: the draw's order
    assert ranked(r, req(), [st(4)]) == [[4]]
    assert last(r).reason == "pow2"


def test_pow2_never_picks_the_longest_queue_and_is_seeded():
    states = [st(0, outstanding=5), st(1, outstanding=1), st(2, outstanding=9)]
    a = picks(router("pow2", seed=7), req(), states, 60)
    assert a == picks(router("pow2", seed=7), req(), states, 60)
    assert a != picks(router("pow2", seed=8), req(), states, 60)
    assert set(a) == {0, 1}  # 0 wins only when drawn with 2; 2 never wins
    r = router("pow2", seed=3)
    for _ in range(30):
        ranks = ranked(r, req(), states)
        first = ranks[0]
        assert len(first) == 2 and first[0] == min(first, key=lambda j: states[j].outstanding)
        assert len(ranks) == 2  # the pair, then the one left


# -- consistent-hash ---------------------------------------------------------------------------


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


# -- ray-prefix --------------------------------------------------------------------------------


def test_ray_prefix_affinity_at_the_match_rate_threshold():
    r = router("ray-prefix")
    # 160-token prompt, 1 matched block = 16 tokens: rate 0.1 >= 0.1.
    states = [st(0, outstanding=3, matched=1, tree=40), st(1, outstanding=2, matched=1, tree=90), st(2, tree=0)]
    assert ranked(r, req(160), states) == [[1, 0], [2]]  # the best-matched set, shortest queue first
    assert last(r).reason == "affinity"


def test_ray_prefix_smallest_tree_below_the_threshold():
    r = router("ray-prefix")
    # 320-token prompt, 1 block matched: rate 0.05 < 0.1 -> the smallest trees, shortest queue first.
    states = [st(0, outstanding=0, matched=1, tree=50), st(1, outstanding=4, tree=10), st(2, outstanding=1, tree=10)]
    assert ranked(r, req(320), states) == [[2, 1], [0]]
    assert last(r).reason == "smallest-tree"


def test_ray_prefix_imbalance_switch():
    states = [st(0, outstanding=5, matched=10), st(1), st(2)]
    r = router("ray-prefix")  # imbalanced_threshold = inf: never imbalanced
    assert ranked(r, req(), states) == [[0], [1], [2]]
    assert last(r).reason == "affinity"
    r10 = router("ray-prefix", imbalanced_threshold=10)  # the pre-2.60 default: spread 5 is balanced
    assert choice(ranked(r10, req(), states)) == 0
    r2 = router("ray-prefix", imbalanced_threshold=2, seed=5)
    got = picks(r2, req(), states, 30)
    assert last(r2).reason == "imbalanced"
    assert set(got) == {1, 2}  # power of two choices never takes the longest queue


# -- sglang-classic (sglang, llmd, aibrix as their sources state them: tests/test_anchors_score.py) --


def test_sglang_classic_imbalance_switch_needs_both_thresholds():
    r = router("sglang-classic")
    full = dict(matched=10)
    # 100 - 30 > 64 and 100 > 1.5 * 30: imbalanced -> least load, despite replica 0's full match.
    assert ranked(r, req(), [st(0, outstanding=100, **full), st(1, outstanding=30), st(2, outstanding=50)]) == [
        [1], [2], [0]]
    assert last(r).reason == "imbalanced"
    # 100 - 40 = 60: not over the absolute threshold -> cache-aware.
    assert choice(ranked(r, req(), [st(0, outstanding=100, **full), st(1, outstanding=40)])) == 0
    assert last(r).reason == "affinity"
    # 200 - 135 = 65 > 64 but 200 < 1.5 * 135: not over the relative threshold.
    assert choice(ranked(r, req(), [st(0, outstanding=200, **full), st(1, outstanding=135)])) == 0
    assert last(r).reason == "affinity"


def test_sglang_classic_match_rate_must_exceed_threshold():
    r = router("sglang-classic")
    # 160-token prompt: 3 blocks = 0.3, not > 0.3 -> smallest tree; 4 blocks = 0.4 -> matched.
    states = [st(0, matched=3, tree=30), st(1, tree=5, outstanding=2), st(2, tree=5, outstanding=1)]
    assert ranked(r, req(160), states) == [[2], [0], [1]]
    assert last(r).reason == "smallest-tree"
    states[0] = st(0, matched=4, tree=30)
    assert choice(ranked(r, req(160), states)) == 0
    assert last(r).reason == "affinity"
    # Two best-matched workers: the lower load wins.
    tie = [st(0, matched=4, outstanding=3), st(1, matched=4, outstanding=1), st(2)]
    assert choice(ranked(r, req(160), tie)) == 1


# -- llm-d (dynamo: tests/test_anchors_dynamo.py) ---------------------------------------------


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


# -- aibrix ------------------------------------------------------------------------------------


def test_aibrix_imbalance_switch():
    r = router("aibrix")
    # 10 - 1 = 9 > 8: only the least-loaded pod is considered, whatever the matches.
    imb = [st(0, outstanding=10, matched=10), st(1, outstanding=1), st(2, outstanding=3, matched=5)]
    assert ranked(r, req(), imb) == [[1], [2], [0]]
    assert last(r).reason == "imbalanced"
    # Ties among the least loaded: the matched one among them.
    assert choice(ranked(r, req(), [st(0, outstanding=10), st(1, outstanding=1),
                                    st(2, outstanding=1, matched=4)])) == 2
    # 8 - 0 = 8 is not over 8: best match with load <= mean + sample sigma = 4 + 4.
    bal = [st(0, outstanding=8, matched=10), st(1), st(2, outstanding=4, matched=5)]
    assert ranked(r, req(), bal) == [[0], [1], [2]]
    assert last(r).reason == "affinity"
    bal[0] = st(0, outstanding=9, matched=10)  # 9 - 0 > 8: imbalanced, only replica 1
    assert choice(ranked(r, req(), bal)) == 1


def test_aibrix_no_match_goes_to_least_loaded():
    r = router("aibrix")
    assert ranked(r, req(), [st(0, outstanding=3), st(1, outstanding=1), st(2, outstanding=2)]) == [[1], [2], [0]]
    assert last(r).reason == "least-loaded"


# -- vllm-prefixaware --------------------------------------------------------------------------


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


# -- fairway -----------------------------------------------------------------------------------

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
    assert last(r).scores == pytest.approx({0: 0.96, 1: 1.51, 2: 1.85})
    # W = Q for FCFS replicas: replica 0 waits 3.0 s, so the minimum T is replica 1's.
    f = router("fairway", wait_model="fcfs")
    assert ranked(f, req(1000), states) == [[1], [2], [0]] and last(f).reason == "fair"
    assert last(f).scores == pytest.approx({0: 3.21, 1: 1.51, 2: 1.85})
    # The Fast lane's share: with the whole capacity (fast_share = 1), W_0 = 0.3.
    assert ranked(router("fairway", fast_share=1.0), req(1000), states) == [[0], [1], [2]]
    # A replica with every sequence slot taken admits on a finish, not by prefill order: W = Q.
    full = [st(0, matched=50, qp=(0.1, 0.2, 1.2, 1.5), outstanding=8, running=4, cap=8)] + states[1:]
    assert ranked(r, req(1000), full) == [[1], [2], [0]] and last(r).reason == "fair"
    assert last(r).waits[0] == pytest.approx(3.0)
    # one free slot: the queue order applies again
    free = [st(0, matched=50, qp=(0.1, 0.2, 1.2, 1.5), outstanding=7, running=3, cap=8)] + states[1:]
    assert choice(ranked(r, req(1000), free)) == 0
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


# -- every router ------------------------------------------------------------------------------


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


# -- load view ---------------------------------------------------------------------------------


def view(n: int = 2, stale_s: float = 0.0) -> tuple[LoadView, ManualClock]:
    clock = ManualClock()
    return LoadView(n, clock, LinearCost(), block_size=BS, stale_s=stale_s), clock  # type: ignore[arg-type]


def test_load_view_lifecycle():
    lv, _ = view()
    assert lv.on_routed(1, 0, prompt_tokens=1000, cached_tokens=800) == pytest.approx(0.21)
    assert lv.on_routed(2, 0, prompt_tokens=100) == pytest.approx(0.11)
    lv.on_routed(3, 1, prompt_tokens=160, cached_tokens=160)  # capped at 159 cached: 1 token to compute
    s = lv.snapshot()
    assert s.queued_prefill_s == pytest.approx((0.32, 0.011))
    assert s.queued_prefill_tokens == (300, 1)
    assert s.outstanding == (2, 1)
    assert s.running == (0, 0)
    assert s.active_blocks == (63 + 7, 10)
    lv.on_started(1)
    lv.on_started(1)  # idempotent
    s = lv.snapshot()
    assert s.queued_prefill_s == pytest.approx((0.11, 0.011))
    assert (s.outstanding, s.running, s.waiting) == ((2, 1), (1, 0), (1, 1))
    lv.on_finished(2)  # rejected before it started: leaves Q too
    lv.on_finished(1)
    s = lv.snapshot()
    assert s.queued_prefill_s[0] == 0.0
    assert (s.outstanding[0], s.running[0], s.active_blocks[0], s.queued_prefill_tokens[0]) == (0, 0, 0, 0)
    assert 3 in lv and 1 not in lv
    with pytest.raises(KeyError):
        lv.on_finished(1)
    with pytest.raises(KeyError):
        lv.on_routed(3, 0, 10)


def test_load_view_carries_each_replicas_reported_speed():
    lv, _ = view(2)
    assert lv.snapshot().speed == (1.0, 1.0)
    lv.report_speed(1, 0.25)
    assert lv.snapshot().speed == (1.0, 0.25)
    for bad in (0.0, -1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError):
            lv.report_speed(0, bad)


def test_load_view_queue_resets_to_exact_zero():
    lv, _ = view(1)
    for rid, p in enumerate((0.1, 0.2, 0.3, 0.7)):
        lv.on_routed(rid, 0, 100, prefill_s=p)
    for rid in (2, 0, 3):
        lv.on_started(rid)
    assert lv.snapshot().queued_prefill_s[0] == pytest.approx(0.2)
    lv.on_started(1)
    assert lv.snapshot().queued_prefill_s[0] == 0.0


def test_load_view_preemption_requeues_the_work():
    lv, _ = view(1)
    lv.on_routed(1, 0, prompt_tokens=1000)
    lv.on_started(1)
    lv.on_preempted(1, cached_tokens=480, prompt_tokens=1040)
    s = lv.snapshot()
    assert s.queued_prefill_s[0] == pytest.approx(0.01 + 0.56)
    assert (s.running[0], s.queued_prefill_tokens[0], s.outstanding[0]) == (0, 560, 1)


def test_load_view_lists_the_waiting_work_sorted_and_the_capacity():
    lv, _ = view(2)
    for rid, p in ((1, 0.5), (2, 0.1), (3, 0.3), (4, 0.1)):
        lv.on_routed(rid, 0, 100, prefill_s=p)
    lv.on_routed(5, 1, 100, prefill_s=0.2)
    assert lv.snapshot().queued_prefills == ((0.1, 0.1, 0.3, 0.5), (0.2,))
    lv.on_started(4)  # one of two equal estimates leaves: the other stays
    lv.on_finished(3)  # cancelled before it started
    assert lv.snapshot().queued_prefills == ((0.1, 0.5), (0.2,))
    lv.on_preempted(4, cached_tokens=0, prompt_tokens=100)  # back in the queue, re-priced: 0.11
    qp = lv.snapshot().queued_prefills
    assert qp[0] == pytest.approx((0.1, 0.11, 0.5)) and qp[1] == (0.2,)
    assert lv.snapshot().max_running == (0, 0)
    lv.report_max_running(1, 256)
    snap = lv.snapshot()
    assert snap.max_running == (0, 256)
    assert make_states(snap, [0, 0], [0, 0])[1].max_running == 256
    with pytest.raises(ValueError):
        lv.report_max_running(0, -1)


def test_load_view_lists_the_started_prefills_until_their_estimated_end():
    lv, clock = view(2)
    for rid, p in ((1, 0.5), (2, 0.2), (3, 0.4)):
        lv.on_routed(rid, 0, 100, prefill_s=p)
    lv.on_routed(4, 1, 100, prefill_s=1.0)
    clock.set(1.0)
    lv.on_started(1)  # ends at 1.5
    lv.on_started(2, started_at=0.9)  # the host learned of it late: ends at 1.1
    lv.on_started(4, started_at=5.0)  # never later than now: ends at 2.0
    assert lv.snapshot().prefill_ends == ((1.5, pytest.approx(1.1)), (2.0,))
    clock.set(1.2)
    lv.on_started(3)  # ends at 1.6
    snap = lv.snapshot()
    assert snap.prefill_ends == ((1.5, 1.6), (2.0,))  # 1.1 has passed: decoding
    assert make_states(snap, [0, 0], [0, 0])[0].prefill_ends == (1.5, 1.6)
    lv.on_finished(1)  # finished (or cancelled) early
    lv.on_preempted(4, cached_tokens=0, prompt_tokens=100)  # back in the queue
    assert lv.snapshot().prefill_ends == ((1.6,), ())
    lv.on_started(4)  # restarted at 1.2, re-priced at 0.11 s: ends at 1.31
    lv.on_prefill_done(4)  # a host that saw its first token says so: gone before its estimate
    lv.on_prefill_done(99)  # unknown (already finished): ignored
    assert lv.snapshot().prefill_ends == ((1.6,), ())
    clock.set(1.6)
    lv.on_routed(5, 1, 100, prefill_s=0.1)
    assert lv.snapshot().prefill_ends == ((), ())


def test_load_view_keeps_a_window_of_the_work_routed_lately():
    lv, clock = view(2)
    lv.on_routed(1, 0, 100, prefill_s=0.5)
    assert lv.snapshot().routed_windows == ((0.0, ()), (0.0, ()))  # one arrival: no rate yet
    clock.set(1.0)
    lv.on_routed(2, 0, 100, prefill_s=0.9)
    clock.set(2.0)
    lv.on_routed(3, 0, 100, prefill_s=0.3)
    lv.on_finished(2)  # finishing does not leave the window: it is the arrival rate
    snap = lv.snapshot()
    assert snap.routed_windows[0] == (0.0, (0.3, 0.9))
    s0 = make_states(snap, [0, 0], [0, 0])[0]
    assert (s0.routed_since, s0.routed_prefills) == (0.0, (0.3, 0.9))
    # bounded: the last ROUTED_WINDOW arrivals, the oldest of them marking the window's start
    for i in range(ROUTED_WINDOW + 2):
        clock.set(10.0 + i)
        lv.on_routed(100 + i, 1, 100, prefill_s=i / 100)
    t0, ps = lv.snapshot().routed_windows[1]
    assert t0 == 12.0 and ps == pytest.approx(tuple(i / 100 for i in range(3, ROUTED_WINDOW + 2)))


def test_load_view_staleness():
    lv, clock = view(2, stale_s=10.0)
    first = lv.snapshot()
    lv.on_routed(1, 0, 100)
    lv.report_kv_usage(1, 0.5)
    clock.set(9.99)
    assert lv.snapshot() is first
    assert lv.live().outstanding == (1, 0)
    clock.set(10.0)
    s = lv.snapshot()
    assert s.taken_s == 10.0 and s.outstanding == (1, 0) and s.kv_usage == (0.0, 0.5)
    lv.on_finished(1)
    clock.set(19.0)
    assert lv.snapshot() is s
    live, clock = view(1, stale_s=0.0)
    a = live.snapshot()
    assert live.snapshot() is a  # nothing changed: the same snapshot
    live.on_routed(1, 0, 100)
    assert live.snapshot().outstanding == (1,)
    with pytest.raises(ValueError):
        live.report_kv_usage(0, 1.5)
    with pytest.raises(ValueError):
        view(1, stale_s=-1.0)


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
    # replica 2 wins with T = 0.02.
    dflt = router("fairway")
    assert ranked(dflt, rq, states) == [[2], [0]] and last(dflt).reason == "affinity"
    assert last(dflt).waits == pytest.approx({0: 0.0, 2: 0.0})
    assert last(dflt).scores == pytest.approx({0: 1.32, 2: 0.02})


# -- prefix shares (the Fairway router's replication signal) -----------------------------------


def test_prefix_shares_are_rates_since_first_sighting_relative_to_all_decisions():
    sh = PrefixShares(max_prefixes=2)
    for t in (0.0, 1.0):
        sh.observe(t)
    assert sh.share(7, 1.0) is None  # first sighting
    sh.observe(2.0)
    assert sh.share(7, 2.0) is None  # two sightings: one interval is not yet a rate
    sh.observe(3.0)
    # prefix 7: 2 intervals over 2 s = 1/s; all decisions: 3 intervals over 3 s = 1/s
    assert sh.share(7, 3.0) == pytest.approx(1.0)
    for t in (4.0, 5.0, 6.0):
        sh.observe(t)
    # no sighting of 7 at 4 and 5: 3 intervals over 5 s against 6 over 6 s
    assert sh.share(7, 6.0) == pytest.approx(0.6)
    sh.share(8, 6.0)
    sh.share(9, 6.0)  # a third prefix: the least recently seen (7) is forgotten
    assert len(sh) == 2
    assert sh.share(7, 6.5) is None  # counted again from scratch
    with pytest.raises(ValueError):
        PrefixShares(max_prefixes=0)


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


# -- fairway: GPU hit, host-tier hit, miss -------------------------------------------------------
# LinearCost, idle replicas, a 160-token prompt (9 cacheable blocks = 144 tokens): T = the first
# token's step, 0.01 + 0.001 * uncached tokens, plus the reload of the host tokens at
# kv_bytes_per_token (1) / host_link_bytes_per_s seconds each.


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
    first. Replica 1 reporting a fifth of that pace (its gate drains 0.2 cost-model s per s) makes
    its T five times as long, 0.17 / 0.2 = 0.85 s against 0.2 + 0.17 = 0.37 s: 0 goes first."""
    r = router("fairway", replicate=False, speed_aware=True)
    states = [st(0, outstanding=1, qp=(0.2,)), st(1)]
    assert ranked(r, req(160), states) == [[1], [0]]
    assert last(r).scores == pytest.approx({0: 0.37, 1: 0.17})
    states[1].speed = 0.2
    assert ranked(r, req(160), states) == [[0], [1]]
    assert last(r).scores == pytest.approx({0: 0.37, 1: 0.85})
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
