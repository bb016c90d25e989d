"""PEEK and PRISM (docs/design.md, PEEK and PRISM): exact admission orders on hand-made queues,
the pending tree's incremental invariants, and the hold and demand columns under random events.

LinearCost prices a prefill at 0.01 s + 1 ms per uncached token; blocks are 16 tokens.
"""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fairway.clock import ManualClock
from fairway.policies import POLICIES, PolicyError, make_policy
from fairway.policies.demand import DemandQueue
from fairway.policies.pending_tree import PendingTree
from tests.factories import LinearCost, chain, drain_order, policy_with_cache, queued


def sibling(rid: int, arrival: float, doc: str = "doc", n_doc: int = 10, prompt: int = 200):
    """A request behind the shared ``doc`` prefix with 2 blocks of its own (12 cacheable)."""
    return queued(rid, arrival, prompt, chain(doc, n_doc) + chain(f"u{rid}", 2))


def admit_next(p) -> int | None:
    r = p.select()
    if r is None:
        return None
    p.admit(r.rid)
    return r.rid


def store(p, cache: set[int], hashes) -> None:
    cache.update(hashes)
    p.on_blocks_stored(hashes)


# -- PEEK ---------------------------------------------------------------------------------------


def test_peek_admits_one_pioneer_and_holds_its_siblings_until_the_prefix_is_cached():
    cache: set[int] = set()
    p, clock = policy_with_cache("peek", cache)
    p.add(queued(0, 0.0, 100, chain("cold", 6)))
    for rid in (1, 2, 3):
        p.add(sibling(rid, float(rid)))
    clock.set(3.0)
    assert p.front_demand[[p._slot_of[r] for r in (0, 1, 2, 3)]].tolist() == [1, 3, 3, 3]
    assert admit_next(p) == 1  # the pioneer of the 3-request cluster, oldest of its members
    assert p.held[[p._slot_of[r] for r in (2, 3)]].all()  # siblings wait for doc to be stored
    assert admit_next(p) == 0  # the cold singleton is not held
    assert admit_next(p) is None and p.held_selects == 1  # everyone left is held: the engine runs r1
    store(p, cache, chain("doc", 10) + chain("u1", 2))  # r1's prefill stored its blocks
    assert p.cached_tokens(2) == p.cached_tokens(3) == 160
    assert admit_next(p) == 2 and admit_next(p) == 3  # siblings follow with a 10-block hit
    assert p.lane_admissions == {"pioneer": 1, "reuse": 1, "oldest": 2}
    assert p.hold_expiries == 0


def test_peek_hold_ends_at_its_deadline_and_when_the_pioneer_is_requeued():
    p, clock = policy_with_cache("peek", set())
    for rid in (1, 2):
        p.add(sibling(rid, 0.0))
    assert admit_next(p) == 1
    assert p.select() is None
    # deadline: 4 x r1's prefill (0.21 s) after its admission
    clock.set(0.83)
    assert p.select() is None
    clock.set(0.85)
    assert p.select().rid == 2 and p.hold_expiries == 1
    # a preempted pioneer comes back: its hold on r4 ends at once
    p2, _ = policy_with_cache("peek", set())
    for rid in (3, 4):
        p2.add(sibling(rid, 0.0))
    assert admit_next(p2) == 3 and p2.select() is None
    p2.add(sibling(3, 0.0))  # re-queued for recompute
    assert not p2.held[p2._slot_of[4]]
    assert admit_next(p2) == 3 and p2.select() is None  # the new attempt holds r4 again
    assert p2.hold_expiries == 0


def test_peek_stride_serves_the_oldest_lane_between_reuse_admissions():
    """An old cold request behind a stream of cached-prefix requests: LPM serves it last, PEEK's
    oldest lane takes every other admission (equal tickets, two non-empty lanes)."""
    cached = set(chain("sys", 4))
    reqs = [queued(0, 0.0, 1000, chain("cold", 62))] + [
        queued(rid, float(rid), 100, chain("sys", 4) + chain(f"h{rid}", 2)) for rid in range(1, 7)]
    orders = {}
    for name, kw in (("lpm", {}), ("peek", {"charge": "admissions"})):
        p, clock = policy_with_cache(name, cached, **kw)
        for r in reqs:
            p.add(r)
        clock.set(6.0)
        orders[name] = drain_order(p)
    assert orders["lpm"] == [1, 2, 3, 4, 5, 6, 0]
    assert orders["peek"] == [1, 0, 2, 3, 4, 5, 6]  # reuse, oldest, reuse, oldest, ...


def test_peek_work_charge_lets_cheap_reuse_through_while_a_big_cold_request_pays():
    """charge="work": the oldest lane paid 1.01 s for r0, so the cheap reuse requests (0.046 s
    each) take the next admissions until the reuse lane's pass catches up."""
    cached = set(chain("sys", 4))
    p, clock = policy_with_cache("peek", cached)
    p.add(queued(0, 0.0, 1000, chain("cold0", 62)))
    p.add(queued(1, 0.5, 1000, chain("cold1", 62)))
    for rid in range(2, 8):
        p.add(queued(rid, float(rid), 100, chain("sys", 4) + chain(f"h{rid}", 2)))
    clock.set(8.0)
    # tie at 0: reuse r2 (0.046), oldest r0 (1.01), then reuse until its pass passes 1.01
    assert drain_order(p) == [2, 0, 3, 4, 5, 6, 7, 1]


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(1, 40)), min_size=3, max_size=40))
def test_peek_oldest_lane_bound(stream):
    """charge="admissions", equal tickets: while any request is not held, at most 2 admissions
    from other lanes come between two from the oldest lane (a fresh request after each)."""
    cache: set[int] = set(chain("fam0", 8))
    p, _ = policy_with_cache("peek", cache, charge="admissions")
    rid = 0
    for fam, blocks in stream:
        p.add(queued(rid, float(rid), blocks * 16 + 5, chain(f"fam{fam}", blocks)))
        rid += 1
    since_oldest = 0
    for _ in range(len(stream)):
        before = dict(p.lane_admissions)
        if admit_next(p) is None:
            break
        lane = next(k for k, v in p.lane_admissions.items() if v != before[k])
        since_oldest = 0 if lane == "oldest" else since_oldest + 1
        assert since_oldest <= 2
        p.add(queued(rid, float(rid), 5 * 16 + 5, chain("fam0", 5)))  # a cached-prefix newcomer
        rid += 1


# -- PRISM --------------------------------------------------------------------------------------


def test_prism_amortises_a_shared_cold_prefix_over_its_queued_demand():
    """All arrive at 0, decided at 1 s. P = 1.01 s each; cluster a (3 requests) costs
    1.01 / 3, cluster b (2) 1.01 / 2, the singleton s 1.01: ratios 3.97, 2.98, 1.99. Each
    pioneer's siblings are held softly: they go after s, then in demand order."""
    p, clock = policy_with_cache("prism", set())
    fam = {0: "a", 1: "a", 2: "a", 3: "b", 4: "b", 5: "s"}
    for rid, f in fam.items():
        p.add(queued(rid, 0.0, 1000, chain(f, 60) + chain(f"own{rid}", 2)))
    clock.set(1.0)
    assert drain_order(p) == [0, 3, 5, 1, 2, 4]
    assert p.held_picks == 3  # a1, a2 and b1 went while their blocks were still in flight


def test_prism_siblings_follow_once_the_prefix_is_stored():
    cache: set[int] = set()
    p, clock = policy_with_cache("prism", cache)
    for rid in (0, 1, 2):
        p.add(queued(rid, 0.0, 1000, chain("a", 60) + chain(f"own{rid}", 2)))
    p.add(queued(3, 0.0, 400, chain("s", 24)))
    clock.set(1.0)
    assert admit_next(p) == 0
    assert admit_next(p) == 3  # a1, a2 held while a0 computes the shared blocks
    store(p, cache, chain("a", 60))
    assert p.cached_tokens(1) == 960 and not p.held[p._slot_of[1]]
    assert drain_order(p) == [1, 2] and p.held_picks == 0


def test_prism_response_ratio_ages_an_expensive_request():
    p, clock = policy_with_cache("prism", set())
    p.add(queued(0, 0.0, 2000, chain("big", 124)))  # P = 2.01 s
    p.add(queued(1, 0.9, 100, chain("small", 6)))  # P = 0.11 s
    clock.set(1.0)  # ratios 3.01 / 2.01 = 1.50 and 0.21 / 0.11 = 1.91
    assert p.select().rid == 1
    p2, clock2 = policy_with_cache("prism", set())
    p2.add(queued(0, 0.0, 2000, chain("big", 124)))
    p2.add(queued(1, 9.9, 100, chain("small", 6)))
    clock2.set(10.0)  # 12.01 / 2.01 = 5.98 against 1.91
    assert p2.select().rid == 0


# -- shared: registry, retention, demand --------------------------------------------------------


def test_registered_with_their_retention():
    assert POLICIES["peek"].retention == "peek" and POLICIES["prism"].retention == "prism"
    with pytest.raises(PolicyError, match="bad options"):
        make_policy("peek", clock=ManualClock(), cost=LinearCost(), lanes=2)
    with pytest.raises(ValueError, match="charge"):
        make_policy("peek", clock=ManualClock(), cost=LinearCost(), charge="tokens")


@pytest.mark.parametrize("name", ["peek", "prism"])
def test_queued_demand_counts_waiting_requests_per_block(name):
    p, _ = policy_with_cache(name, set(chain("doc", 4)))
    for rid in (1, 2, 3):
        p.add(sibling(rid, 0.0))
    doc = chain("doc", 10)
    assert [p.queued_demand(h) for h in (doc[0], doc[9], chain("u1", 1)[0])] == [3, 3, 1]
    p.remove(2)
    assert p.queued_demand(doc[0]) == 2 and p.queued_demand(chain("u2", 1)[0]) == 0
    assert p.front_demand[p._slot_of[1]] == 2  # r1's frontier is doc[4]


def test_pending_tree_add_remove_and_dual_walk():
    t = PendingTree()
    t.add(1, chain("doc", 4) + chain("x", 2))
    t.add(2, chain("doc", 4) + chain("y", 1))
    t.add(3, chain("doc", 2))
    t.check()
    assert t.demand(chain("doc", 1)[0]) == 3 and t.demand(chain("doc", 4)[3]) == 2
    assert t.num_nodes == 4 + 2 + 1
    cached = set(chain("doc", 3))
    assert t.dual_walk(cached.__contains__) == {1: 3, 2: 3, 3: 2}
    assert list(t.remove(1)) == chain("doc", 4) + chain("x", 2)
    t.check()
    assert t.num_nodes == 5 and chain("x", 1)[0] not in t
    with pytest.raises(KeyError):
        t.add(2, [])
    t.remove(2)
    t.remove(3)
    assert t.num_nodes == 0 and len(t) == 0


ops = st.lists(
    st.one_of(
        st.tuples(st.just("add"), st.integers(0, 2), st.integers(1, 8), st.integers(0, 2)),
        st.tuples(st.just("pop"), st.integers(0, 30)),
        st.tuples(st.just("admit")),
        st.tuples(st.just("store"), st.integers(0, 2), st.integers(1, 8)),
        st.tuples(st.just("evict"), st.integers(0, 2), st.integers(0, 7)),
        st.tuples(st.just("tick"), st.floats(0.0, 2.0)),
    ),
    max_size=60,
)


@settings(max_examples=60, deadline=None)
@given(ops, st.sampled_from(["peek", "prism"]))
def test_demand_columns_match_a_rebuild_under_random_events(script, name):
    """After any sequence of arrivals, removals, admissions, stores, evictions and time steps:
    the tree satisfies its invariants, the dual walk equals the tracked hits, and each waiting
    request's frontier demand and hold flag equal a fresh computation."""
    cache: set[int] = set()
    p, clock = policy_with_cache(name, cache)
    assert isinstance(p, DemandQueue)
    rid = 0
    for op in script:
        if op[0] == "add":
            _, fam, n, tail = op
            p.add(queued(rid, clock.now(), n * 16 + 1 + tail * 16,
                         chain(f"f{fam}", n) + chain(f"t{rid}", tail)))
            rid += 1
        elif op[0] == "pop" and len(p):
            p.remove(sorted(p._items)[op[1] % len(p)])
        elif op[0] == "admit":
            admit_next(p)
        elif op[0] == "store":
            store(p, cache, chain(f"f{op[1]}", op[2]))
        elif op[0] == "evict":
            h = chain(f"f{op[1]}", 8)[op[2]]
            if h in cache:
                cache.discard(h)
                p.on_blocks_removed([h])
        elif op[0] == "tick":
            clock.advance(op[1])
            p.select()  # expires due holds
        p.tree.check()
        walk = p.tree.dual_walk(cache.__contains__)
        for r in p._items:
            slot = p._slot_of[r]
            hit = p.cached_tokens(r) // 16
            assert walk[r] == hit
            path = p.tree.path(r)
            front = path[hit] if hit < len(path) else None
            assert p.front_demand[slot] == (0 if front is None else p.tree.demand(front))
            assert p.held[slot] == (front is not None and p.in_flight(front))


# -- the replica gate ---------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_gate_runs_peek_and_releases_siblings_on_the_store_event():
    from replicas.gate import AdmissionGate, GateConfig
    from tests.replicas.test_gate import ScriptedEngine, call, consume, settle

    clock = ManualClock()
    engine = ScriptedEngine()
    pol = make_policy("peek", clock=clock, cost=LinearCost(), block_size=16)
    gate = AdmissionGate(engine, pol, clock, GateConfig(prefill_budget_tokens=10_000), replica="r0")
    doc = chain("doc", 10)
    out: list = []
    tasks = [asyncio.create_task(consume(gate, call(r, 200, doc + chain(r, 2)), out)) for r in "abc"]
    await asyncio.sleep(0)
    await settle()
    assert engine.started == ["a"]  # b and c wait for a's prefix
    engine.cached.update(doc)
    engine.on_stored(doc)
    gate.pump()
    await settle()
    assert engine.started == ["a", "b", "c"]
    for r in "abc":
        engine.release(r)
    await asyncio.gather(*tasks)
    firsts = {rid: ch.cached_tokens for rid, ch in out if ch.prompt_tokens}
    assert firsts["b"] == firsts["c"] == 160  # (the scripted engine reads a's hit at release too)


# -- the engine model ---------------------------------------------------------------------------


@pytest.mark.parametrize(("name", "hits"), [("lpm", [0, 0, 0]), ("peek", [0, 160, 160]),
                                            ("prism", [0, 0, 0])])
def test_engine_computes_a_burst_of_siblings_shared_prefix_once(name, hits):
    """Three siblings arrive together on an idle engine: lpm admits all three in one step (each
    computes the 10-block prefix); PEEK admits the pioneer and the siblings follow once its
    prefix is stored, with a 160-token hit. PRISM's holds are soft: with nothing else waiting
    it admits the held siblings in the same step, as lpm does."""
    from fairway.engine.model import EngineConfig, EngineModel
    from sim.simulator import Simulation
    from tests.factories import ListWorkload, spec

    clock = ManualClock()
    cost = LinearCost()
    pol = make_policy(name, clock=clock, cost=cost)
    eng = EngineModel(EngineConfig(kv_blocks=200), cost, pol, clock)
    specs = [spec(r, 0.0, 200, 2, chain("doc", 10) + chain(f"u{r}", 2)) for r in range(3)]
    res = Simulation(ListWorkload(specs), [eng], clock).run()
    assert sorted(r.rid for r in res.finished) == [0, 1, 2]
    assert [r.cached_tokens for r in sorted(res.finished, key=lambda r: r.rid)] == hits
