"""KV memory beyond the stock engine: the session-aware admission gate, the retention strategies'
exact victims, and the host tier's reload cost and hit classification."""

from __future__ import annotations

import dataclasses

import pytest

from fairway.admission import AdmissionConfig, Candidate, HeldQueue, SessionAdmission, WaitingSessions
from fairway.clock import ManualClock
from fairway.engine.block_pool import QUEUE, SESSION, BlockPool
from fairway.engine.model import EngineConfig, EngineListener, EngineModel
from fairway.policies import make_policy
from fairway.request import RequestSpec
from sim.simulator import Simulation
from tests.factories import LinearCost, ListWorkload, chain, spec


def fill(pool: BlockPool, hashes):
    blocks = pool.allocate(len(hashes))
    for b, h in zip(blocks, hashes, strict=True):
        pool.cache_block(b, h)
    return blocks


def freed_pool(retention: str, **kw) -> BlockPool:
    """6 blocks: 0, 1, 2 hold hashes 10, 11, 12 and are freed tail-first (2, 1, 0), after the
    never-used 3, 4, 5. LRU victim order: 3, 4, 5, 2 (h12), 1 (h11), 0 (h10)."""
    pool = BlockPool(6, retention=retention, **kw)
    a = fill(pool, [10, 11, 12])
    pool.release(a)
    pool.drain_events()
    return pool


# -- retention strategies --------------------------------------------------------------------


def test_lru_victims_are_the_free_order():
    pool = freed_pool("lru")
    pool.add_demand([12], QUEUE, 1)  # tracked only for the gate; LRU ignores it
    assert pool.allocate(4) == [3, 4, 5, 2]


def test_peek_evicts_unneeded_blocks_first_then_lru():
    pool = freed_pool("peek")
    pool.add_demand([12], QUEUE, 1)
    assert pool.allocate(4) == [3, 4, 5, 1]
    assert pool.drain_events() == [(False, 11)]
    assert pool.allocate(2) == [0, 2]  # then LRU among the needed


def test_peek_ignores_session_demand_and_session_does_not():
    peek = freed_pool("peek")
    peek.add_demand([12], SESSION, 1)
    assert peek.allocate(4) == [3, 4, 5, 2]
    sess = freed_pool("session")
    sess.add_demand([12], SESSION, 1)
    assert sess.allocate(4) == [3, 4, 5, 1]


def test_prism_orders_by_queued_demand_then_lru():
    pool = freed_pool("prism")
    pool.add_demand([10, 12], QUEUE, 1)
    pool.add_demand([10, 11, 12], QUEUE, 1)  # demand: h10 2, h11 1, h12 2
    assert pool.allocate(6) == [3, 4, 5, 1, 2, 0]


def test_dropped_demand_restores_the_lru_position():
    pool = freed_pool("peek")
    pool.add_demand([12], QUEUE, 1)
    pool.add_demand([12], QUEUE, -1)
    assert pool.allocate(4) == [3, 4, 5, 2]
    with pytest.raises(RuntimeError):
        pool.add_demand([12], QUEUE, -1)


def test_free_wanted_counts_free_blocks_someone_waits_for():
    pool = freed_pool("lru", track_demand=True)
    pool.add_demand([10, 11], QUEUE, 1)
    pool.add_demand([11, 99], SESSION, 1)  # 99 is not cached: not counted
    assert pool.n_free_wanted == 2
    pool.touch(pool.longest_hit([10]))
    assert pool.n_free_wanted == 1
    pool.release([0])
    pool.add_demand([10, 11], QUEUE, -1)
    assert pool.n_free_wanted == 1  # h11 still wanted by the session
    pool.add_demand([11, 99], SESSION, -1)
    assert pool.n_free_wanted == 0


# -- host tier -------------------------------------------------------------------------------


def test_host_tier_keeps_evicted_hashes_and_their_membership():
    pool = BlockPool(2, host_blocks=2)
    a = fill(pool, [1, 2])
    pool.release(a)
    pool.drain_events()
    pool.allocate(2)  # evicts h2 then h1 to the host tier
    assert pool.drain_events() == []  # still cached (in the host tier): no removal event
    assert 1 in pool and 2 in pool and pool.longest_hit([1, 2]) == []
    assert pool.host_hit([1, 2, 3], 0) == 2 and pool.host_hit([1, 2], 1) == 1


def test_host_tier_overflow_drops_its_lru_hash():
    pool = BlockPool(2, host_blocks=1)
    a = fill(pool, [1, 2])
    pool.release(a)
    pool.drain_events()
    pool.allocate(2)
    assert pool.drain_events() == [(False, 2)]  # h2 went first, then h1 pushed it out
    assert 1 in pool and 2 not in pool and pool.host_evictions == 1


def test_host_reload_cost_and_hit_classification():
    """Request 1 (6 blocks of 7) evicts 3 of request 0's 4 blocks to the host tier (the LRU
    order: the 3 never-used blocks, then 0's tail first), so request 2, which continues 0's
    prompt, hits 1 block on the GPU and 3 (48 tokens) in the host tier. 48 tokens reload at
    1,000 tokens/s (kv_bytes_per_token 1, link 1,000 B/s) = 0.048 s, during which the request is
    not schedulable; then its 16 new tokens prefill (0.01 + 0.016 s)."""
    clock = ManualClock()
    cost = LinearCost()
    pol = make_policy("fcfs", clock=clock, cost=cost)
    cfg = EngineConfig(kv_blocks=7, host_kv_blocks=8, host_link_bytes_per_s=1000.0)
    eng = EngineModel(cfg, cost, pol, clock)
    specs = [
        spec(0, 0.0, 64, 1, chain("a", 4)),
        spec(1, 1.0, 96, 1, chain("b", 6)),
        spec(2, 2.0, 80, 1, chain("a", 4) + chain("c", 1)),
    ]
    res = Simulation(ListWorkload(specs), [eng], clock).run()
    r2 = next(r for r in res.finished if r.rid == 2)
    assert r2.admitted_s == 2.0
    assert r2.host_tokens == 48 and r2.cached_tokens == 64
    assert eng.reload_s == pytest.approx(0.048)
    assert r2.first_token_s == pytest.approx(2.0 + 0.048 + 0.01 + 0.016)
    assert (eng.gpu_hit_tokens, eng.host_hit_tokens, eng.miss_tokens) == (16, 48, 64 + 96 + 16)


def test_gpu_hit_is_not_reloaded():
    clock = ManualClock()
    cost = LinearCost()
    pol = make_policy("fcfs", clock=clock, cost=cost)
    eng = EngineModel(EngineConfig(kv_blocks=20, host_kv_blocks=8), cost, pol, clock)
    specs = [spec(0, 0.0, 64, 1, chain("a", 4)), spec(1, 1.0, 80, 1, chain("a", 4) + chain("c", 1))]
    Simulation(ListWorkload(specs), [eng], clock).run()
    assert (eng.gpu_hit_tokens, eng.host_hit_tokens, eng.reload_s) == (64, 0, 0.0)


# -- host tier: tier events (which hashes are host-only) ------------------------------------


def test_tier_events_on_eviction_reload_and_host_overflow():
    """Exact tier stream on a hand-made sequence: 2 GPU blocks, a host tier of 2."""
    pool = BlockPool(2, host_blocks=2)
    a = fill(pool, [1, 2])
    assert pool.drain_events() == [(True, 1), (True, 2)] and pool.drain_tier_events() == []
    pool.release(a)  # free queue: 1, 0 (tail first) -> blocks of h2 then h1 evicted first
    b = pool.allocate(2)
    assert pool.drain_events() == []  # both still cached (host tier): the KV stream says nothing
    assert pool.drain_tier_events() == [(True, 2), (True, 1)]  # both host-only now
    pool.cache_block(b[0], 1)  # h1 reloaded into the GPU: a GPU hit again
    assert pool.drain_events() == [] and pool.drain_tier_events() == [(False, 1)]
    pool.cache_block(b[1], 3)  # a new hash: the KV stream only
    assert pool.drain_events() == [(True, 3)] and pool.drain_tier_events() == []
    pool.release(b)  # free queue: h3's block, then h1's
    pool.allocate(1)  # h3 -> host: host is h2, h1, h3 over capacity 2 -> h2 dropped (host-only)
    assert pool.drain_tier_events() == [(True, 3), (False, 2)]
    assert pool.drain_events() == [(False, 2)]
    pool.allocate(1)  # h1 leaves the GPU; its host copy (write-through) makes it host-only
    assert pool.drain_tier_events() == [(True, 1)]  # h3 was the host's LRU: h1 moved to its end
    assert pool.drain_events() == []
    assert set(pool.host) == {1, 3} and not pool.cached


def test_host_tier_overflow_of_a_hash_also_on_the_gpu_is_silent():
    pool = BlockPool(3, host_blocks=1)
    a = fill(pool, [1, 2])
    pool.release(a)
    pool.drain_events()
    b = pool.allocate(1)  # the never-used block 2: nothing evicted
    assert pool.drain_tier_events() == []
    pool.allocate(1)  # h2 -> host-only
    assert pool.drain_tier_events() == [(True, 2)]
    pool.cache_block(b[0], 2)  # h2 back on the GPU (its host copy stays)
    pool.allocate(1)  # h1 -> host: pushes out h2, which is on the GPU: no event for h2
    assert pool.drain_tier_events() == [(False, 2), (True, 1)]
    assert pool.drain_events() == []
    assert 2 in pool.cached and set(pool.host) == {1}


def test_no_host_tier_emits_no_tier_events():
    pool = BlockPool(2)
    a = fill(pool, [1, 2])
    pool.release(a)
    pool.allocate(2)
    assert pool.drain_events() == [(True, 1), (True, 2), (False, 2), (False, 1)]
    assert pool.tier_events == [] and pool.drain_tier_events() == []


class _TierListener:
    def __init__(self) -> None:
        self.calls: list[tuple[str, list[tuple[bool, int]]]] = []

    def on_kv_events(self, replica, events):
        self.calls.append(("kv", list(events)))

    def on_kv_tier_events(self, replica, events):
        self.calls.append(("tier", list(events)))

    def __getattr__(self, name):  # on_admitted, on_finished, ...: ignored
        return lambda *a, **k: None


def test_engine_sends_tier_events_after_the_kv_events_of_the_same_flush():
    """The reload scenario of ``test_host_reload_cost_and_hit_classification``: the listener's
    replay of both streams ends with the pool's GPU set and host-only set."""
    clock = ManualClock()
    cost = LinearCost()
    pol = make_policy("fcfs", clock=clock, cost=cost)
    eng = EngineModel(EngineConfig(kv_blocks=7, host_kv_blocks=8), cost, pol, clock)
    eng.listener = lsn = _TierListener()
    specs = [spec(0, 0.0, 64, 1, chain("a", 4)), spec(1, 1.0, 96, 1, chain("b", 6)),
             spec(2, 2.0, 80, 1, chain("a", 4) + chain("c", 1))]
    Simulation(ListWorkload(specs), [eng], clock).run()
    held: set[int] = set()
    host_only: set[int] = set()
    for kind, events in lsn.calls:
        for on, h in events:
            s = held if kind == "kv" else host_only
            (s.add if on else s.discard)(h)
    pool = eng.pool
    assert held == set(pool.cached) | set(pool.host)
    assert host_only == set(pool.host) - set(pool.cached)
    assert any(kind == "tier" for kind, _ in lsn.calls)
    a = chain("a", 4)
    # request 2's admission: its new blocks push b's blocks to the host, then a's reload
    assert [ev[-3:] for kind, ev in lsn.calls if kind == "tier"][-1] == [(False, a[1]), (False, a[2]), (False, a[3])]


# -- the admission gate: the rule ------------------------------------------------------------


def cand(new_blocks=7, cached=0, prompt=100, p=0.11, first=False, arrival=0.0):
    return Candidate(rid=1, arrival_s=arrival, prompt_tokens=prompt, cached_tokens=cached,
                     new_blocks=new_blocks, est_prefill_s=p, first_turn=first)


def test_hold_rule():
    g = SessionAdmission()
    # cold (nothing cached), needs 7 blocks, 10 free of which 5 hold waiting contexts: held
    assert g.should_hold(cand(), 0.0, free_blocks=10, free_wanted_blocks=5, running=1)
    # enough free blocks nobody waits for: admitted
    assert not g.should_hold(cand(), 0.0, free_blocks=12, free_wanted_blocks=5, running=1)
    # warm (half cached): admitted; a first turn is cold however much is cached
    assert not g.should_hold(cand(cached=50), 0.0, 10, 5, 1)
    assert g.should_hold(cand(cached=90, first=True), 0.0, 10, 5, 1)
    # an idle engine holds no one
    assert not g.should_hold(cand(), 0.0, 10, 5, running=0)
    # past its bound: admitted
    assert not g.should_hold(cand(), 2.0, 10, 5, 1)


@pytest.mark.parametrize(("p", "bound"), [(0.11, 2.0), (0.5, 4.0), (2.0, 10.0)])
def test_starvation_bound_is_clamped_multiple_of_own_prefill(p, bound):
    # clamp(8 * P, 2 s, 10 s) after arrival
    assert SessionAdmission().deadline(cand(p=p, arrival=5.0)) == pytest.approx(5.0 + bound)


def test_config_checks():
    with pytest.raises(ValueError):
        AdmissionConfig(cold_fraction=1.5)
    with pytest.raises(ValueError):
        AdmissionConfig(min_hold_s=5.0, max_hold_s=1.0)
    with pytest.raises(ValueError):
        EngineConfig(retention="mru")


def test_held_queue_and_waiting_sessions():
    h: HeldQueue[str] = HeldQueue()
    h.add(1, 5.0, "a")
    h.add(2, 3.0, "b")
    h.add(3, 5.0, "c")
    assert [rid for rid, _, _ in h.in_order()] == [2, 1, 3]
    assert h.remove(2) == "b" and 2 not in h and len(h) == 2
    w = WaitingSessions(10.0)
    assert w.finish(7, 0.0, (1, 2)) is None
    assert w.finish(8, 1.0, (3,)) is None
    assert w.arrive(7) == (1, 2) and w.arrive(7) is None
    assert w.expire(10.5) == [] and w.expire(11.0) == [(3,)] and len(w) == 0


# -- the admission gate in the engine --------------------------------------------------------


def sess(rid, arrival, prompt, output, hashes, session, turn=0) -> RequestSpec:
    return dataclasses.replace(spec(rid, arrival, prompt, output, hashes), session=session, turn=turn)


def gated_engine(**kw):
    clock = ManualClock()
    cost = LinearCost()
    pol = make_policy("fcfs", clock=clock, cost=cost)
    cfg = EngineConfig(kv_blocks=20, admission=AdmissionConfig(**kw))
    return EngineModel(cfg, cost, pol, clock), clock


def setup_hold(eng, clock, deadline=2.24):
    """t=0: a long request L (10 blocks, session 9) and session 1's first turn (5 blocks, one
    output token) run; at 0.24 session 1 finishes and waits (5 free blocks it will need), 5 blocks
    were never used. Then a cold first turn of session 2 (100 tokens, 7 blocks) arrives: 7 > the
    5 free blocks nobody waits for, so it is held; bound = arrival + clamp(8 * 0.11, 2, 10)."""
    eng.add(sess(0, 0.0, 150, 50, chain("L", 12), session=9))
    eng.add(sess(1, 0.0, 80, 1, chain("s1", 5), session=1))
    dt = eng.start_step()
    assert dt == pytest.approx(0.01 + 0.230)
    clock.set(0.24)
    assert [r.rid for r in eng.finish_step()] == [1]
    assert eng.pool.n_free_wanted == 5
    eng.add(sess(2, 0.24, 100, 1, chain("s2", 6), session=2))
    eng.start_step()
    assert 2 in eng.held and eng.holds == 1
    assert eng.held.deadline(2) == pytest.approx(deadline)
    eng.finish_step()


def test_gate_holds_the_cold_turn_and_admits_the_warm_follow_up():
    eng, clock = gated_engine()
    setup_hold(eng, clock)
    clock.set(0.5)
    # session 1's next turn: 80 of 96 tokens cached (warm), needs 1 new block: admitted past the held one
    eng.add(sess(3, 0.5, 96, 1, chain("s1", 6), session=1, turn=1))
    eng.start_step()
    assert [r.rid for r in eng.scheduled] == [0, 3]
    assert 2 in eng.held and eng.reqs[3].cached_tokens == 80


def test_gate_releases_at_the_bound():
    eng, clock = gated_engine()
    setup_hold(eng, clock)
    clock.set(2.0)
    eng.start_step()
    assert 2 in eng.held  # before its bound
    eng.finish_step()
    clock.set(2.24)
    eng.start_step()
    assert 2 not in eng.held and eng.reqs[2].admitted_s == pytest.approx(2.24)
    assert eng.hold_releases_due == 1


def test_gate_releases_when_the_waiting_session_expires():
    eng, clock = gated_engine(min_hold_s=20.0, max_hold_s=20.0)
    setup_hold(eng, clock, deadline=20.24)
    clock.set(10.0)
    eng.start_step()
    assert 2 in eng.held  # session 1 still waits (finished at 0.24, horizon 10 s)
    eng.finish_step()
    clock.set(10.24)
    eng.start_step()  # horizon over: its 5 blocks are evictable, 10 free >= 7
    assert eng.reqs[2].admitted_s == pytest.approx(10.24) and eng.hold_releases_due == 0


def test_gate_never_holds_on_an_idle_engine():
    eng, clock = gated_engine()
    eng.add(sess(0, 0.0, 100, 1, chain("x", 6), session=4))
    eng.start_step()
    assert not len(eng.held) and eng.holds == 0


def test_abort_of_a_held_request():
    eng, clock = gated_engine()
    setup_hold(eng, clock)
    assert eng.abort(2) and 2 not in eng.held and eng.num_waiting == 0
    assert eng.pool.n_free_wanted == 5


class AdmissionLog(EngineListener):
    """Engine listener: every admission's (rid, time), re-admissions after a preemption included."""

    def __init__(self, clock: ManualClock) -> None:
        self.clock = clock
        self.admitted: list[tuple[int, float]] = []

    def on_admitted(self, replica: int, r) -> None:
        self.admitted.append((r.rid, round(self.clock.now(), 3)))

    def on_finished(self, replica: int, r) -> None: ...
    def on_preempted(self, replica: int, r) -> None: ...
    def on_kv_events(self, *a) -> None: ...


def run_guarded(a_output: int, **gate) -> tuple[EngineModel, list[tuple[int, float]]]:
    """20 blocks, ``lpm``. t=0: L (224 tokens, 14 blocks, 40 output tokens) and P (32 tokens, one
    output token) start; A (100 tokens cold, 7 blocks) does not fit beside L (6 blocks free once
    P is done) and waits. At 0.4 W arrives: 48 tokens of which P's 32 are cached, 1 new block,
    so it fits, and ``lpm`` picks it before the cold A. L finishes at 0.851 without the gate."""
    clock = ManualClock()
    cost = LinearCost()
    pol = make_policy("lpm", clock=clock, cost=cost)
    eng = EngineModel(EngineConfig(kv_blocks=20, admission=AdmissionConfig(**gate) if gate else None),
                      cost, pol, clock)
    log = AdmissionLog(clock)
    eng.listener = log
    specs = [spec(0, 0.0, 224, 40, chain("L", 14)), spec(1, 0.0, 32, 1, chain("p", 2)),
             spec(2, 0.0, 100, a_output, chain("A", 6)), spec(3, 0.4, 48, 1, chain("p", 3))]
    Simulation(ListWorkload(specs), [eng], clock).run()
    return eng, log.admitted


def test_guard_all_admits_the_overdue_request_first_and_lets_nobody_pass():
    _, plain = run_guarded(1)
    assert plain == [(0, 0.0), (1, 0.0), (3, 0.401), (2, 0.867)]  # lpm: the warm W passes A
    _, guarded = run_guarded(1, guard="all", min_hold_s=0.1, max_hold_s=0.1)
    # A is overdue from 0.1: nobody is admitted before it, W waits for it though W would fit
    assert guarded == [(0, 0.0), (1, 0.0), (2, 0.851), (3, 0.851)]


def test_preempt_for_due_makes_room_once_and_the_resumed_decode_waits_its_own_bound():
    """A is overdue at 0.1 and does not fit: L (decoding) is preempted for it at 0.266. L is
    re-queued with its bound counted from then (0.366), not from its arrival, and an overdue
    resumed decode preempts nobody (only a first token is worth it): L waits for A's 20 tokens and
    resumes at 0.661, with no ping-pong between the two."""
    eng, log = run_guarded(20, guard="all", min_hold_s=0.1, max_hold_s=0.1, preempt_for_due=True)
    assert log == [(0, 0.0), (1, 0.0), (2, 0.266), (0, 0.661), (3, 0.661)]
    assert eng.preemptions == 1


# -- the simulator's options ------------------------------------------------------------------


def test_runner_options_reach_the_engine():
    from sim.runner import RunConfig, build, run

    cfg = RunConfig(workload="agentic", policy="fairway", rate=0.5, duration_s=5.0, kv_blocks=4000,
                    admission="session", admission_options={"max_hold_s": 5.0}, retention="peek",
                    host_kv_blocks=1000)
    sim, _ = build(cfg)
    eng = sim.replicas[0]
    assert eng.retention == "peek" and eng.pool.host_capacity == 1000
    assert eng.gate is not None and eng.gate.config.max_hold_s == 5.0
    res = run(cfg)
    kv = res["kv_memory"]
    assert kv["retention"] == "peek" and set(kv["tokens"]) == {"gpu_hit", "host_hit", "miss"}
    assert "kv_memory" not in run(cfg.model_copy(update={"admission": "off", "admission_options": {},
                                                         "retention": None, "host_kv_blocks": 0}))
    with pytest.raises(ValueError, match="bad admission option"):
        build(cfg.model_copy(update={"admission_options": {"bogus": 1}}))


# -- the router's view of the host tier in the simulator ------------------------------------------


def _cluster_cfg(host_kv_blocks: int, routers: int = 1, sync_delay_s: float = 0.0, **router_options):
    from sim.runner import RunConfig

    return RunConfig(workload="agentic", policy="fairway", concurrency=20, duration_s=15, replicas=2,
                     router="fairway", router_options=router_options, index_mode="events", kv_blocks=300,
                     host_kv_blocks=host_kv_blocks, seed=0, routers=routers,
                     router_view="shared" if sync_delay_s else "own", sync_delay_s=sync_delay_s)


@pytest.mark.parametrize("routers,delay", [(1, 0.0), (2, 0.05)])
def test_sim_router_index_tracks_the_engines_host_only_blocks(routers, delay):
    """Every router instance's index ends with each engine's host-only set, the tier events
    travelling with the KV events (through the delayed shared view with 2 instances)."""
    from sim.runner import build

    sim, _ = build(_cluster_cfg(300, routers, delay))
    sim.run()
    sim.router.deliver_all()
    assert sum(e.host_hit_tokens for e in sim.replicas) > 0  # the host tier was used
    for inst in sim.router.instances:
        for j, e in enumerate(sim.replicas):
            assert inst.index.host_only(j) == set(e.pool.host) - set(e.pool.cached)
            assert set(inst.index.blocks(j)) == set(e.pool.cached) | set(e.pool.host)


def test_sim_without_a_host_tier_tier_aware_routing_changes_nothing():
    from sim.runner import run

    aware = run(_cluster_cfg(0), keep_samples=True)
    blind = run(_cluster_cfg(0, host_tier=False), keep_samples=True)
    assert aware["ttft_samples_s"] == blind["ttft_samples_s"]
    assert aware["routing_reasons"] == blind["routing_reasons"]
