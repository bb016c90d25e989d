"""The ``dynamo`` anchor (NVIDIA Dynamo's KV router): its cost and pick on hand-made states, the
load view's active sequences it reads, the first-token report, and its default index."""

from __future__ import annotations

import numpy as np
import pytest

from fairway.clock import ManualClock
from fairway.engine.model import EngineConfig, EngineModel
from fairway.load_view import LoadView
from fairway.policies import make_policy
from fairway.prefix_index import PrefixIndex
from fairway.routing import ReplicaState, RouteRequest, make_router
from fairway.routing.anchors import Dynamo
from fairway.routing.host import RoutingHost
from sim.cluster import ClusterRouter
from sim.options import config_from
from sim.runner import RunConfig
from sim.simulator import Simulation
from tests.factories import LinearCost, ListWorkload, chain, spec
from tests.fairway.routing.helpers import last, ranked

BS = 16


def dynamo(seed: int = 0, **kw) -> Dynamo:
    r = make_router("dynamo", clock=ManualClock(), cost=LinearCost(), block_size=BS,  # type: ignore[arg-type]
                    rng=np.random.default_rng(seed), **kw)
    assert isinstance(r, Dynamo)
    return r


def ds(replica: int, *, matched: int = 0, host: int = 0, prefill_tok: int = 0, unique: int = 0,
       new: int | None = 10, summed: int = 0) -> ReplicaState:
    """An idle replica state with Dynamo's inputs: ``matched`` blocks cached (``host`` of them in
    the host tier), ``prefill_tok`` held prefill tokens, ``unique`` distinct active blocks,
    ``new`` of the request's blocks not active there, ``summed`` the undeduplicated blocks."""
    return ReplicaState(replica=replica, outstanding=0, running=0, queued_prefill_s=0.0, kv_usage=0.0,
                        matched_blocks=matched, index_blocks=0, active_blocks=summed, host_blocks=host,
                        active_prefill_tokens=prefill_tok, unique_active_blocks=unique, new_blocks=new)


def req(prompt: int = 160, family: str = "p", rid: int = 0) -> RouteRequest:
    return RouteRequest(rid=rid, prompt_tokens=prompt, block_hashes=chain(family, prompt // BS))


# -- the rule on hand-made states -------------------------------------------------------------


def test_cost_arithmetic_and_defaults():
    r = dynamo()
    assert (r.overlap_score_credit, r.prefill_load_scale, r.host_cache_hit_weight, r.router_temperature) == (
        1.0, 1.0, 0.75, 0.0)
    assert r.host_tier and r.first_tokens and r.active_blocks and Dynamo.default_index_mode == "events"
    states = [
        ds(0, matched=8, prefill_tok=320, unique=10, new=2),  # (320 + 160)/16 - 8 + 10 + 2 = 34
        ds(1, unique=25, new=10),  # 160/16 + 25 + 10 = 45
        ds(2, matched=4, prefill_tok=64, unique=20, new=6),  # (64 + 160)/16 - 4 + 20 + 6 = 36
    ]
    assert ranked(r, req(), states) == [[0], [2], [1]]
    assert last(r).scores == {0: 34.0, 1: 45.0, 2: 36.0}
    assert last(r).reason == "cost"
    # the prefill term never goes negative: a full match on an idle replica costs its decode term only
    assert dynamo().cost_of(req(), ds(0, matched=10, new=0)) == 0.0
    # prefill_load_scale 0 (Dynamo's old overlap_score_weight 0): decode load only
    assert ranked(dynamo(prefill_load_scale=0.0), req(), states) == [[0], [2], [1]]
    assert ranked(dynamo(overlap_score_credit=0.0), req(), [ds(0, matched=10, unique=5), ds(1, unique=4)])[0] == [1]


def test_deduplicated_active_blocks_change_the_pick():
    # Replica 0 serves three requests sharing a 20-block prefix: 60 blocks summed, 24 distinct.
    # Replica 1 serves one 30-block request. Summed blocks would prefer 1; Dynamo counts 0's
    # shared prefix once and picks 0.
    states = [ds(0, unique=24, summed=60, new=10), ds(1, unique=30, summed=30, new=10)]
    assert ranked(dynamo(), req(), states) == [[0], [1]]
    untracked = [ds(0, summed=60, new=None), ds(1, summed=30, new=None)]  # a host without tracking
    assert ranked(dynamo(), req(), untracked) == [[1], [0]]
    # The request's own prefix active on a replica is not charged again: 6 of its 10 blocks are
    # active on 1, so only 4 are new there.
    states = [ds(0, unique=20, new=10), ds(1, unique=24, new=4)]  # 10 + 20 + 10 = 40 > 10 + 24 + 4 = 38
    assert ranked(dynamo(), req(), states) == [[1], [0]]


def test_host_tier_hit_earns_three_quarters_of_a_gpu_hit():
    r = dynamo()
    states = [
        ds(0, matched=12),  # 20 - 12 = 8
        ds(1, matched=16, host=8),  # 20 - (8 + 0.75 * 8) = 6
        ds(2, matched=16),  # 20 - 16 = 4
    ]
    assert ranked(r, req(320), [ds(s.replica, matched=s.matched_blocks, host=s.host_blocks, new=0) for s in states]) \
        == [[2], [1], [0]]
    assert last(r).scores == {0: 8.0, 1: 6.0, 2: 4.0}
    full = dynamo(host_cache_hit_weight=1.0)  # a host hit worth a GPU hit: 1 and 2 tie
    ranked(full, req(320), [ds(1, matched=16, host=8, new=0), ds(2, matched=16, new=0)])
    assert last(full).scores == {1: 4.0, 2: 4.0}


def test_equal_minima_are_drawn_from_the_rng():
    states = [ds(0, unique=5), ds(1, unique=5), ds(2, unique=9), ds(3, unique=5)]
    r = dynamo(seed=7)
    picks = [ranked(r, req(), states)[0][0] for _ in range(40)]
    draws = np.random.default_rng(7)
    assert picks == [(0, 1, 3)[int(draws.integers(3))] for _ in range(40)]  # uniform among the tied
    assert set(picks) == {0, 1, 3}  # never by id alone, and never the costlier replica
    assert ranked(r, req(), states)[1:] != []  # the others keep ranks of their own
    one = dynamo(seed=7)
    ranked(one, req(), [ds(0, unique=5), ds(1, unique=6)])  # a single minimum draws nothing
    assert one.rng.integers(3) == np.random.default_rng(7).integers(3)


def test_temperature_samples_a_softmax_over_the_costs():
    states = [ds(0, unique=0), ds(1, unique=10), ds(2, unique=20)]
    r = dynamo(seed=3, router_temperature=1.0)
    picks = [ranked(r, req(), states)[0][0] for _ in range(3000)]
    # weights exp(-(c - min) / (range * T)) = 1, e^-0.5, e^-1
    w = np.exp([0.0, -0.5, -1.0])
    share = [picks.count(j) / len(picks) for j in range(3)]
    assert share == pytest.approx(list(w / w.sum()), abs=0.03)
    assert [ranked(r, req(), [ds(0), ds(1)])[0][0] for _ in range(20)].count(0) not in (0, 20)  # all equal: uniform


# -- the load view's active sequences ---------------------------------------------------------


def view(n: int = 2) -> LoadView:
    return LoadView(n, ManualClock(), LinearCost(), block_size=BS)  # type: ignore[arg-type]


def test_load_view_counts_distinct_active_blocks_and_new_blocks():
    lv = view(3)
    a = chain("a", 10)
    lv.on_routed(1, 0, 160)
    lv.track_blocks(1, a)
    lv.on_routed(2, 0, 160)
    lv.track_blocks(2, a[:6] + chain("b", 4))  # shares 6 blocks with request 1
    lv.on_routed(3, 1, 64)
    lv.track_blocks(3, a[:4])
    s = lv.snapshot()
    assert s.unique_active_blocks == (14, 4, 0)
    assert s.active_blocks == (20, 4, 0)  # summed, as before
    assert lv.new_blocks(a) == [0, 6, 10]
    assert lv.new_blocks(a[:6] + chain("c", 4)) == [4, 6, 10]
    # prefix, not set, membership: after the first block not active, the rest count as new
    assert lv.new_blocks([a[0], 99, a[2], a[3]]) == [3, 3, 4]
    assert lv.new_blocks([]) == [0, 0, 0]
    lv.on_finished(1)  # its 4 blocks of its own leave; the 6 shared with request 2 stay
    assert lv.snapshot().unique_active_blocks == (10, 4, 0)
    assert lv.new_blocks(a) == [4, 6, 10]
    lv.on_started(2)
    lv.on_finished(2)
    lv.on_finished(3)
    assert lv.snapshot().unique_active_blocks == (0, 0, 0)
    assert lv.new_blocks(a) == [10, 10, 10]
    assert lv._abw == {} and lv._ab == [{}, {}, {}] and lv._ab_req == {}  # nothing leaks
    lv.on_routed(4, 2, 32)
    lv.track_blocks(4, chain("d", 2))
    with pytest.raises(KeyError):
        lv.track_blocks(4, chain("d", 2))


def test_prefill_tokens_are_held_until_the_first_token():
    lv = view()
    lv.on_routed(1, 0, 1000, cached_tokens=680)  # 320 uncached
    lv.on_routed(2, 1, 200)
    assert lv.snapshot().active_prefill_tokens == (320, 200)
    lv.on_started(1)  # admitted: it leaves the queue, not Dynamo's prefill load
    s = lv.snapshot()
    assert (s.queued_prefill_tokens, s.active_prefill_tokens) == ((0, 200), (320, 200))
    lv.on_first_token(1)
    lv.on_first_token(1)  # idempotent
    lv.on_first_token(99)  # unknown: ignored
    assert lv.snapshot().active_prefill_tokens == (0, 200)
    assert lv.snapshot().prefill_ends != ((), ())  # the estimated prefill end is left alone
    lv.on_finished(2)  # finished (or rejected) before its first token: released too
    assert lv.snapshot().active_prefill_tokens == (0, 0)
    lv.on_routed(3, 1, 48)
    lv.on_started(3)
    lv.on_prefill_done(3)  # a host that reports prefill ends releases them as well
    assert lv.snapshot().active_prefill_tokens == (0, 0)


def test_held_prefill_flips_the_pick_until_the_first_token():
    clock = ManualClock()
    cost = LinearCost()
    policy = make_router("dynamo", clock=clock, cost=cost, block_size=BS, rng=np.random.default_rng(0))  # type: ignore[arg-type]
    host = RoutingHost(policy, PrefixIndex(2), LoadView(2, clock, cost, block_size=BS), block_size=BS)  # type: ignore[arg-type]
    host.book(1, 0, 320, 0, chain("a", 20))  # 20 blocks on 0, admitted, no first token yet
    host.on_started(1)
    host.book(3, 1, 480, 0, chain("c", 30))  # 30 blocks on 1, already decoding
    host.on_started(3)
    host.on_first_token(3)
    b = chain("b", 10)
    # 0: (320 + 160)/16 + 20 + 10 = 60; 1: 160/16 + 30 + 10 = 50
    d = host.decide(5, 160, b)
    assert d.pick == 1 and d.ranking.scores == {0: 60.0, 1: 50.0}
    host.on_first_token(1)  # 0: 10 + 20 + 10 = 40
    d = host.decide(6, 160, b)
    assert d.pick == 0 and d.ranking.scores == {0: 40.0, 1: 50.0}


def test_only_policies_that_read_them_track_blocks_and_hear_first_tokens():
    clock = ManualClock()
    cost = LinearCost()
    policy = make_router("ray-prefix", clock=clock, cost=cost, block_size=BS)  # type: ignore[arg-type]
    host = RoutingHost(policy, PrefixIndex(2), LoadView(2, clock, cost, block_size=BS), block_size=BS)  # type: ignore[arg-type]
    host.book(1, 0, 320, 0, chain("a", 20))
    host.on_started(1)
    host.on_first_token(1)  # not heard: the view stays as it was without the report
    s = host.load.snapshot()
    assert (s.unique_active_blocks, s.active_prefill_tokens) == ((0, 0), (320, 0))


# -- the simulator: the first-token report and the default index ------------------------------


class Recorder:
    """A lifecycle listener that logs what the engine reports."""

    def __init__(self) -> None:
        self.log: list[tuple[str, int]] = []

    def on_admitted(self, replica, r):
        self.log.append(("admitted", r.rid))

    def on_first_token(self, replica, r):
        assert r.first_token_s >= 0
        self.log.append(("first", r.rid))

    def on_preempted(self, replica, r):
        self.log.append(("preempted", r.rid))

    def on_finished(self, replica, r):
        self.log.append(("finished", r.rid))

    def on_kv_events(self, replica, events):
        pass


def test_engine_reports_each_first_token_once_between_admission_and_finish():
    clock = ManualClock()
    cost = LinearCost()
    e = EngineModel(EngineConfig(kv_blocks=80, max_num_batched_tokens=64), cost,
                    make_policy("fcfs", clock=clock, cost=cost), clock, replica=0)
    rec = Recorder()
    e.listener = rec
    specs = [spec(0, 0.0, 100, 3, chain("x", 6)), spec(1, 0.0, 40, 1, chain("y", 2))]
    Simulation(ListWorkload(specs), [e], clock).run()
    assert [x for x in rec.log if x[1] == 0] == [("admitted", 0), ("first", 0), ("finished", 0)]
    assert [x for x in rec.log if x[1] == 1] == [("admitted", 1), ("first", 1), ("finished", 1)]


@pytest.mark.parametrize("view", [{}, {"routers": 2, "view": "shared"},
                                  {"routers": 2, "view": "shared", "sync_delay_s": 0.1}])
def test_a_dynamo_cluster_run_releases_every_active_sequence(view):
    clock = ManualClock()
    cost = LinearCost()
    engines = [EngineModel(EngineConfig(kv_blocks=80, max_num_batched_tokens=256), cost,
                           make_policy("fcfs", clock=clock, cost=cost), clock, replica=j) for j in range(3)]
    host = ClusterRouter("dynamo", 3, clock, cost, index_mode="events", capacity_blocks=80, **view)
    specs = [spec(i, 0.05 * i, 200, 4, chain(f"fam{i % 5}", 10) + chain(f"u{i}", 2)) for i in range(40)]
    res = Simulation(ListWorkload(specs), engines, clock, router=host).run()
    assert len(res.finished) == 40
    host.deliver_all()
    for inst in host.instances:
        s = inst.load.live()
        assert s.active_prefill_tokens == (0, 0, 0) and s.unique_active_blocks == (0, 0, 0)
        assert inst.load._abw == {} and inst.load._held == {}


def test_dynamo_reads_the_events_index_unless_told_otherwise():
    assert RunConfig(workload="mixed", policy="fcfs", router="dynamo").index_mode == "events"
    assert RunConfig(workload="mixed", policy="fcfs", router="dynamo", index_mode="approx").index_mode == "approx"
    assert RunConfig(workload="mixed", policy="fcfs", router="llmd").index_mode == "approx"
    from sim.cli import make_parser

    args = make_parser().parse_args(["run", "--workload", "mixed", "--policy", "fcfs", "--router", "dynamo"])
    assert config_from(args, "fcfs", 1.0, 0).index_mode == "events"
    args = make_parser().parse_args(["run", "--workload", "mixed", "--policy", "fcfs", "--router", "dynamo",
                                     "--index-mode", "approx"])
    assert config_from(args, "fcfs", 1.0, 0).index_mode == "approx"


def test_the_ray_host_tracks_active_blocks_and_releases_prefill_at_the_first_token():
    from tests.router.test_serve_router import T0, book, replica, router, rstats

    r, _ = router("dynamo")
    j = r._index_of(replica("replica-0").replica_id)
    for rid in ("a", "b"):  # a 1,600-token prompt each, families of their own: 100 blocks each
        book(r, j, rid, 1600, routed_at=T0 - 5.0)
    s = r.load.snapshot()
    assert (s.unique_active_blocks, s.active_prefill_tokens) == ((200,), (3200,))
    # "a" is still prefilling, "b" has its first token: only "a"'s prompt stays in the prefill load
    r.bookings.apply_stats(j, rstats(T0 - 0.1, waiting_ids=[], prefilling={"a": T0 - 0.5}))
    assert r.load.snapshot().active_prefill_tokens == (1600,)
