"""Plain decode steps in bulk (sim/simulator.py): every result is the same to the bit as one
event per step, on random workloads, at an arrival on a boundary's very instant, at a
``max_time_s`` cut, and through the cluster router's views."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fairway.clock import ManualClock
from fairway.engine.model import EngineConfig, EngineListener, EngineModel
from fairway.policies import POLICIES, make_policy
from sim.cluster import ClusterRouter
from sim.runner import RunConfig, run
from sim.simulator import Simulation
from tests.factories import LinearCost, ListWorkload, chain, spec


class KVLog(EngineListener):
    """Keeps each engine's KV event flushes, one entry per flush. ``hears``: it reads them at
    once, so it keeps their time too (then no plain boundary may take a new block); else a
    plain boundary may, and only the flushes' order is kept."""

    def __init__(self, clock: ManualClock, hears: bool) -> None:
        self.clock = clock
        self.hears = hears
        self.flushes: list[tuple[int, float, tuple[tuple[bool, int], ...]]] = []

    @property
    def hears_kv_events(self) -> bool:
        return self.hears

    def on_kv_events(self, replica, events):
        self.flushes.append((replica, self.clock.now() if self.hears else 0.0, tuple(events)))


def build(specs, *, bulk: bool, replicas: int = 1, kv_blocks: int = 60, policy: str = "fairway",
          max_time_s: float | None = None, block_size: int = 16, hears: bool = False):
    clock = ManualClock()
    cost = LinearCost()
    log = KVLog(clock, hears)
    engines = [
        EngineModel(EngineConfig(kv_blocks=kv_blocks, block_size=block_size, max_num_batched_tokens=256),
                    cost, make_policy(policy, clock=clock, cost=cost), clock, replica=j)
        for j in range(replicas)
    ]
    for e in engines:
        e.listener = log
    sim = Simulation(ListWorkload(specs), engines, clock, max_time_s=max_time_s)
    sim.kv_log = log
    assert sim.bulk  # round robin reads no engine
    sim.bulk = bulk
    return sim, engines


class StepLog(Simulation):
    """Logs each step end it handles: (time, replica)."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.ends: list[tuple[float, int]] = []

    def on_step_end(self, j):
        self.ends.append((self.clock.now(), j))
        return super().on_step_end(j)


def outcome(sim: Simulation, engines: list[EngineModel]) -> dict:
    """Everything a run leaves: each request's lifecycle, each engine's counters, blocks and
    running requests' token counts (a cut leaves some mid-decode)."""
    res = sim.run()
    reqs = sorted((r.rid, r.replica, r.admitted_s, r.first_token_s, r.finished_s, r.cached_tokens,
                   r.generated, r.rejected) for r in res.finished + res.rejected)
    eng = [(e.steps, e.busy_s, e.prefill_busy_s, e.prefill_tokens, e.peak_running, e.preemptions,
            e.policy.steps, e.policy.processed_tokens, list(e.pool.free), e.pool.evictions,
            [(r.rid, r.num_computed, r.generated, list(r.blocks), r.n_hashed) for r in e.running],
            sorted(e.reqs), [(r.rid, n) for r, n in e._batch])
           for e in engines]
    flushes = sorted(sim.kv_log.flushes, key=lambda f: f[0]) if hasattr(sim, "kv_log") else []  # per replica, in order
    return {"reqs": reqs, "engines": eng, "end": res.end_s, "busy": res.busy_s, "n": res.n_unfinished,
            "kv": flushes}


request_st = st.tuples(
    st.floats(0, 3, allow_nan=False),  # arrival
    st.integers(1, 300),  # prompt tokens
    st.integers(1, 60),  # output tokens
    st.sampled_from(["sys", "doc", "x"]),  # shared prefix family
    st.integers(0, 8),  # shared blocks
    st.booleans(),  # output hashed too (a later turn's prefix)
)


def specs_of(reqs):
    out = []
    for i, (t, prompt, n_out, fam, shared, with_out) in enumerate(reqs):
        n = (prompt + (n_out if with_out else 0)) // 16
        hs = (chain(fam, min(shared, n)) + chain(f"u{i}", n))[:n]
        out.append(spec(i, round(t, 1), prompt, n_out, hs))  # rounded: arrivals share instants
    return out


@settings(max_examples=60, deadline=None)
@given(st.lists(request_st, min_size=1, max_size=25), st.sampled_from(sorted(POLICIES)),
       st.integers(1, 3), st.sampled_from([40, 60, 200]), st.sampled_from([None, 1.5, 4.0]), st.booleans())
def test_bulk_steps_give_the_same_run_as_one_event_per_step(reqs, policy, replicas, kv_blocks, cut, hears):
    specs = specs_of(reqs)
    kw = {"replicas": replicas, "kv_blocks": kv_blocks, "policy": policy, "max_time_s": cut, "hears": hears}
    one = outcome(*build(specs, bulk=False, **kw))
    bulk = outcome(*build(specs, bulk=True, **kw))
    assert bulk == one


def test_long_decodes_are_taken_in_bulk():
    """Two long decodes: most of their steps are plain, and the run is the same."""
    specs = [spec(0, 0.0, 40, 300, chain("a", 2)), spec(1, 0.05, 40, 200, chain("b", 2))]
    sims = {}
    for bulk in (False, True):
        clock = ManualClock()
        cost = LinearCost()
        eng = EngineModel(EngineConfig(kv_blocks=200, max_num_batched_tokens=256), cost,
                          make_policy("fcfs", clock=clock, cost=cost), clock)
        sim = StepLog(ListWorkload(specs), [eng], clock)
        sim.bulk = bulk
        sims[bulk] = (outcome(sim, [eng]), sim.ends, eng.steps)
    (one, one_ends, steps), (bulk, bulk_ends, bulk_steps) = sims[False], sims[True]
    assert bulk == one and bulk_steps == steps
    assert len(one_ends) == steps >= 300
    assert len(bulk_ends) < steps / 5  # a new block every 16 tokens, two finishes, an arrival
    assert set(bulk_ends) <= set(one_ends)  # each handled step end is one of the real ones


@pytest.mark.parametrize("nth", [3, 8, 20, 24, 40])
def test_an_arrival_on_a_boundarys_instant_joins_that_step(nth):
    """A request arriving exactly when a plain boundary falls is admitted at that instant, into
    the step that starts there, as with one event per step (at the 8th and 24th step end an
    output block fills and is cached)."""
    clock = ManualClock()
    cost = LinearCost()
    solo = [spec(0, 0.0, 40, 100, chain("a", 8))]  # its output hashed too, as a later turn's prefix
    eng = EngineModel(EngineConfig(kv_blocks=200, max_num_batched_tokens=256), cost,
                      make_policy("fcfs", clock=clock, cost=cost), clock)
    probe = StepLog(ListWorkload(solo), [eng], clock)
    probe.bulk = False
    probe.run()
    t = probe.ends[nth][0]  # a step end of the lone decode
    specs = [*solo, spec(1, t, 64, 5, chain("b", 4))]
    one = build(specs, bulk=False, kv_blocks=200)
    bulk = build(specs, bulk=True, kv_blocks=200)
    a, b = outcome(*one), outcome(*bulk)
    assert b == a
    late = [r for r in a["reqs"] if r[0] == 1][0]
    assert late[2] == t  # admitted at its arrival instant


@pytest.mark.parametrize("kv_blocks", [12, 13, 14, 20])
def test_decodes_that_run_out_of_blocks_preempt_as_with_one_event_per_step(kv_blocks):
    """Two decodes outgrow the KV cache: the last plain boundary is the one whose new blocks
    the free ones still cover, and the next step preempts as before."""
    specs = [spec(0, 0.0, 40, 100, chain("a", 2)), spec(1, 0.0, 40, 100, chain("b", 2))]
    one = outcome(*build(specs, bulk=False, kv_blocks=kv_blocks, policy="fcfs"))
    bulk = outcome(*build(specs, bulk=True, kv_blocks=kv_blocks, policy="fcfs"))
    assert bulk == one
    assert one["engines"][0][5] > 0 or kv_blocks == 20  # preemptions (20 blocks hold both)


def cluster_cfg(**kw) -> RunConfig:
    base = {"workload": "rag", "policy": "fairway", "rate": 6, "duration_s": 12, "replicas": 3,
            "router": "fairway", "seed": 1}
    return RunConfig(**{**base, **kw})


@pytest.mark.parametrize("kw", [
    {},
    {"index_mode": "events", "routers": 2, "router_view": "shared", "sync_delay_s": 0.05},
    {"router": "llmd", "index_mode": "lru"},
    {"workload": "agentic", "concurrency": 12, "replicas": 1},
])
def test_runner_summaries_are_the_same_without_bulk_steps(kw, monkeypatch):
    cfg = cluster_cfg(**kw)
    bulk = run(cfg)
    monkeypatch.setattr(ClusterRouter, "reads_engines", property(lambda self: True))
    monkeypatch.setattr("sim.simulator.round_robin.reads_engines", True)
    one = run(cfg)
    for res in (bulk, one):
        res.pop("sim_wall_s")
    assert json.dumps(bulk, sort_keys=True) == json.dumps(one, sort_keys=True)


def test_a_router_that_reads_engines_turns_bulk_off():
    clock = ManualClock()
    cost = LinearCost()
    eng = EngineModel(EngineConfig(kv_blocks=60), cost, make_policy("fcfs", clock=clock, cost=cost), clock)

    def least_running(spec, replicas):  # reads the engines' live state
        return min(range(len(replicas)), key=lambda j: len(replicas[j].running))

    assert not Simulation(ListWorkload([]), [eng], clock, router=least_running).bulk
    assert Simulation(ListWorkload([]), [eng], clock).bulk
