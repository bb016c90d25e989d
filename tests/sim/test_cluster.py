"""Multi-replica simulation: conservation across replicas, KV-event index exactness, reasons."""

from __future__ import annotations

import pytest

from fairway.clock import ManualClock
from fairway.engine.model import EngineConfig, EngineModel, EngineRequest
from fairway.policies import make_policy
from fairway.routing import ROUTERS
from sim.cluster import ClusterRouter, ceiling_hit_ratio
from sim.runner import RunConfig, run
from sim.simulator import Simulation
from tests.factories import LinearCost, ListWorkload, chain, spec


def cluster(router: str, specs, n=3, kv_blocks=80, routers=1, index_mode="approx", options=None, **view):
    clock = ManualClock()
    cost = LinearCost()
    engines = [EngineModel(EngineConfig(kv_blocks=kv_blocks, max_num_batched_tokens=256), cost,
                           make_policy("fairway", clock=clock, cost=cost), clock, replica=j)
               for j in range(n)]
    host = ClusterRouter(router, n, clock, cost, routers=routers, index_mode=index_mode,
                         capacity_blocks=kv_blocks, options=options or {}, **view)
    return Simulation(ListWorkload(specs), engines, clock, router=host), engines, host


def family_specs(n=60):
    return [spec(i, 0.05 * i, 200, 4, chain(f"fam{i % 5}", 10) + chain(f"u{i}", 2)) for i in range(n)]


@pytest.mark.parametrize("router", sorted(ROUTERS))
@pytest.mark.parametrize(("routers", "view"), [(1, {}), (2, {}), (2, {"view": "shared"}),
                                               (2, {"view": "shared", "sync_delay_s": 0.1})])
def test_every_request_finishes_on_some_replica(router, routers, view):
    specs = family_specs()
    sim, engines, host = cluster(router, specs, routers=routers, **view)
    res = sim.run()
    assert len(res.finished) == len(specs) and res.n_unfinished == 0
    assert sorted(r.rid for r in res.finished) == list(range(len(specs)))
    assert sum(sum(i.reasons.values()) for i in host.instances) == len(specs)
    host.deliver_all()  # with a sync delay, the last finishes are still on their way
    for i in host.instances:  # every routed request left the load view
        snap = i.load.live()
        assert sum(snap.outstanding) == 0 and sum(snap.queued_prefill_s) == 0.0
        assert snap.queued_prefills == ((),) * len(engines) and snap.prefill_ends == ((),) * len(engines)
        assert snap.max_running == tuple(e.config.max_num_seqs for e in engines)  # reported at bind
    for e in engines:
        assert e.pool.num_free == e.pool.num_blocks


def test_a_rejected_request_leaves_the_routers_load_view():
    specs = family_specs(10) + [spec(10, 0.2, 2000, 4, chain("huge", 125))]  # 126 blocks > 80
    sim, engines, host = cluster("fairway", specs)
    res = sim.run()
    assert [r.rid for r in res.rejected] == [10] and len(res.finished) == 10
    snap = host.instances[0].load.live()
    assert sum(snap.outstanding) == 0 and sum(snap.queued_prefill_s) == 0.0


def test_kv_event_index_equals_the_engines_caches():
    sim, engines, host = cluster("fairway", family_specs(), index_mode="events", kv_blocks=40)
    sim.run()
    for j, e in enumerate(engines):
        assert set(host.instances[0].index.blocks(j)) == set(e.pool.cached)


def test_prefix_affinity_sends_a_family_to_one_replica():
    # The family is all the traffic (share 1 > 1/3), but the cluster is idle: a copy elsewhere
    # would serve it no sooner, so replication makes none.
    specs = [spec(i, 1.0 * i, 200, 2, chain("fam", 10) + chain(f"u{i}", 2)) for i in range(10)]
    sim, _, host = cluster("fairway", specs)
    res = sim.run()
    assert len({r.replica for r in res.finished}) == 1
    assert all(r.cached_tokens == 160 for r in res.finished if r.rid > 0)
    assert "replicate" not in host.reasons()


def test_ceiling_hit_ratio_of_a_shared_cache():
    specs = [spec(0, 0.0, 161, 1, chain("a", 10)), spec(1, 1.0, 161, 1, chain("a", 10))]
    assert ceiling_hit_ratio(specs, 100, 16) == pytest.approx(160 / 322)
    assert ceiling_hit_ratio(specs, 5, 16) == 0.0  # too small to keep the prefix


def test_run_json_has_cluster_fields():
    res = run(RunConfig(workload="rag", policy="fairway", rate=8, duration_s=15, replicas=2,
                        router="fairway"))
    assert res["router"] == "fairway" and len(res["per_replica"]) == 2
    assert sum(p["requests"] for p in res["per_replica"]) == res["n_finished"]
    assert 0 < res["cache_hit_ratio"] <= res["ceiling_hit_ratio"] + 0.05
    # true bounds: no routing beats them (the LRU replay is only a reference)
    assert res["cache_hit_ratio"] <= res["hit_bound_capacity"] <= res["hit_bound_infinite"]
    assert res["ceiling_hit_ratio"] <= res["hit_bound_capacity"]
    assert sum(res["routing_reasons"].values()) == res["n_requests"]
    assert all(0 <= p["prefill_busy_fraction"] <= p["busy_fraction"] <= 1.0 for p in res["per_replica"])


def test_hotspot_workload_shares_one_prefix():
    from workloads.registry import make_workload

    specs = list(make_workload("hotspot", rate=20, duration_s=10, seed=1).initial())
    firsts = [s.block_hashes[0] for s in specs if s.kind == "cheap"]
    assert len(firsts) > 0.8 * len(specs) and len(set(firsts)) == 1


def test_runner_gives_the_fairway_router_the_replicas_wait_model():
    from sim.runner import router_options

    base = dict(workload="rag", replicas=2, router="fairway")
    assert router_options(RunConfig(policy="fairway", **base)) == {"wait_model": "queue", "prefill_chunk": 8192,
                                                                   "fast_share": pytest.approx(0.4)}
    assert router_options(RunConfig(policy="fcfs", **base)) == {"wait_model": "fcfs", "prefill_chunk": 8192}
    mine = RunConfig(policy="fcfs", router_options={"wait_model": "queue", "fast_share": 1.0, "prefill_chunk": 0},
                     **base)
    assert router_options(mine) == {"wait_model": "queue", "fast_share": 1.0, "prefill_chunk": 0}
    assert router_options(RunConfig(policy="fairway", workload="rag", replicas=2, router="pow2")) == {}


def test_runner_gives_the_fairway_router_the_engines_prefill_chunk():
    """The router prices a long prompt in the steps the engines run it in: their token budget,
    or their per-request cap where lower."""
    from sim.runner import router_options

    base = dict(workload="rag", replicas=2, router="fairway", policy="fcfs")
    assert router_options(RunConfig(max_num_batched_tokens=4096, **base))["prefill_chunk"] == 4096
    assert router_options(RunConfig(max_num_batched_tokens=4096, long_prefill_token_threshold=1024,
                                    **base))["prefill_chunk"] == 1024
    assert router_options(RunConfig(max_num_batched_tokens=4096, long_prefill_token_threshold=5000,
                                    **base))["prefill_chunk"] == 4096


def two_routers(**view) -> tuple[ClusterRouter, ManualClock]:
    clock = ManualClock()
    return ClusterRouter("ray-prefix", 4, clock, LinearCost(), routers=2, capacity_blocks=80, **view), clock


def route(host: ClusterRouter, rid: int, t: float, clock: ManualClock) -> int:
    clock.set(t)
    return host(spec(rid, t, 160, 4, chain("doc", 10)), [])


def test_own_view_instances_do_not_see_each_others_prefixes():
    host, clock = two_routers()
    a = route(host, 0, 0.0, clock)  # instance 0
    assert host.instances[1].index.match(chain("doc", 10)) == [0, 0, 0, 0]
    assert host.instances[0].index.match(chain("doc", 10))[a] == 10


def test_shared_view_every_instance_follows_the_prefix_at_once():
    host, clock = two_routers(view="shared")
    a = route(host, 0, 0.0, clock)
    assert route(host, 1, 0.01, clock) == a  # instance 1 sends the sibling to the holder
    assert host.instances[1].index.match(chain("doc", 10))[a] == 10
    assert host.instances[1].load.live().outstanding[a] == 2  # and sees both in flight


def test_shared_view_with_a_delay_learns_after_the_delay_in_order():
    host, clock = two_routers(view="shared", sync_delay_s=0.5)
    a = route(host, 0, 0.0, clock)  # instance 0
    clock.set(0.4)
    host._deliver(1)  # not yet due: instance 1 knows nothing of rid 0
    assert host.instances[1].index.match(chain("doc", 10)) == [0, 0, 0, 0]
    assert list(host.ledgers[1]) == [] and host.instances[1].load.live().outstanding[a] == 0
    assert route(host, 3, 0.6, clock) == a  # due now: delivered before instance 1 decides
    assert host.instances[1].index.match(chain("doc", 10))[a] == 10
    assert list(host.ledgers[1]) == ["remote:router0:0", "3"]  # adopted through the ledger, then its own
    assert list(host.ledgers[0]) == ["0"]  # and rid 3 reaches instance 0 only after the delay
    clock.set(1.1)
    host._deliver(0)
    assert list(host.ledgers[0]) == ["0", "remote:router1:1"]
    assert host.instances[0].load.live().outstanding[a] == 2


def test_shared_view_with_a_delay_ends_a_request_everywhere_with_its_feedback():
    host, clock = two_routers(view="shared", sync_delay_s=0.5)
    a = route(host, 0, 0.0, clock)
    clock.set(0.6)
    host._deliver(1)
    request = EngineRequest(spec(0, 0.0, 160, 4, chain("doc", 10)), 0)
    request.cached_tokens = 0
    host.on_admitted(a, request)
    host.on_finished(a, request)  # nothing was cached: both indexes learn it, instance 1 after the delay
    assert list(host.ledgers[0]) == [] and host.instances[0].load.live().outstanding[a] == 0
    assert not host.ledgers[0].awaiting_feedback("0")
    assert list(host.ledgers[1]) == ["remote:router0:0"]
    clock.set(1.2)
    host._deliver(1)
    assert list(host.ledgers[1]) == [] and host.instances[1].load.live().outstanding[a] == 0
    assert not host.ledgers[1].awaiting_feedback("0")


def test_a_shared_view_with_a_delay_delivers_kv_events_after_the_delay():
    host, clock = two_routers(view="shared", sync_delay_s=0.5, index_mode="events")
    host.on_kv_events(2, [(True, 7), (True, 8), (False, 7)])
    clock.set(0.4)
    host._deliver(0)
    assert list(host.instances[0].index.blocks(2)) == []
    clock.set(0.5)
    host._deliver(0)
    host._deliver(1)
    assert [list(i.index.blocks(2)) for i in host.instances] == [[8], [8]]


def test_decisions_index_ignores_the_engines_reports_and_approx_corrects_itself():
    # 30 families of 10 blocks on 3 replicas of 80 blocks: the engines evict. One LRU over the
    # prompts in flight and finished (``lru``) keeps finished prompts the engines dropped, so the
    # engines' cached-token reports shrink its capacity estimate; the pinned approx index ages
    # only finished prompts, in what the prompts in flight leave, and never over-promised here
    # (its capacity holds); the decisions-only index (what most anchors' originals know) keeps
    # its configured capacity and every routed block
    specs = [spec(i, 0.05 * i, 200, 4, chain(f"fam{i % 30}", 10) + chain(f"u{i}", 2)) for i in range(90)]
    caps = {}
    for mode in ("approx", "lru", "decisions"):
        sim, engines, host = cluster("round-robin", specs, index_mode=mode)
        res = sim.run()
        assert len(res.finished) == len(specs)
        assert [h.feedback_on for h in host.instances] == [mode != "decisions"]
        caps[mode] = [host.instances[0].index.capacity(j) for j in range(3)]
    assert caps["decisions"] == [80, 80, 80] and caps["approx"] == [80, 80, 80]
    assert all(c < 80 for c in caps["lru"])
    with pytest.raises(ValueError, match="unknown index mode"):
        cluster("pow2", specs, index_mode="exact")


def test_routers_sharing_one_view_without_delay_route_as_one():
    # one hot prefix (90% of requests, several holders needed) among cold ones: replication and
    # "fair" picks happen; each instance names another's decision by its best match, as its own,
    # so K instances over one shared view decide exactly as one router does
    specs = [spec(i, 0.002 * i, 300, 4, chain("hot" if i % 10 else f"cold{i}", 16) + chain(f"u{i}", 2))
             for i in range(400)]
    picks, reasons = {}, {}
    for k in (1, 3):
        sim, engines, host = cluster("fairway", specs, n=4, kv_blocks=400, routers=k, view="shared")
        res = sim.run()
        picks[k] = [r.replica for r in sorted(res.finished, key=lambda r: r.rid)]
        reasons[k] = host.reasons()
    assert reasons[1].get("replicate", 0) > 0 and reasons[1].get("fair", 0) + reasons[1].get("cold", 0) > 0
    assert picks[3] == picks[1]
    assert reasons[3] == reasons[1]


def test_the_routers_expected_first_token_time_is_exact_for_a_request_alone():
    """Requests far apart, each alone on an idle cluster: the Fairway router's expected time to
    the first token is the engine's own first step, so each TTFT over it is 1. Eight arriving at
    once on two replicas with a 256-token step budget: the router counts the queue its own
    bookings make, and the ratio stays within the model's approximations. A router that predicts
    no time reports nothing."""
    alone = [spec(i, 10.0 * i, 200, 4, chain(f"u{i}", 12)) for i in range(4)]
    sim, _, host = cluster("fairway", alone, n=2)
    res = sim.run()
    ratios = host.model_ratios({r.rid: r.ttft_s for r in res.finished})
    assert list(ratios) == ["cold"] and ratios["cold"]["n"] == 4
    assert ratios["cold"]["p50"] == pytest.approx(1.0) and ratios["cold"]["p99"] == pytest.approx(1.0)
    together = [spec(i, 0.0, 200, 4, chain(f"v{i}", 12)) for i in range(8)]
    sim, _, host = cluster("fairway", together, n=2)
    res = sim.run()
    burst = host.model_ratios({r.rid: r.ttft_s for r in res.finished})["cold"]
    assert burst["n"] == 8 and 0.8 <= burst["p50"] <= burst["p99"] <= 1.5
    sim, _, host = cluster("pow2", alone, n=2)
    res = sim.run()
    assert host.model_ratios({r.rid: r.ttft_s for r in res.finished}) == {}
