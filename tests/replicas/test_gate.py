"""The replica gate: admission order is the policy's, the queue is bounded, cancelled waiters
leave, memory blocks the head, and the routing stats carry what routers need.

A scripted engine (implements ``fairway.protocol.Engine``) lets each test release first
tokens exactly when it wants, so orders are exact.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Iterable, Sequence

import pytest

from fairway.clock import ManualClock
from fairway.policies import make_policy
from fairway.policies.classes import ClassesConfig
from fairway.protocol import Engine, EngineOutput, EngineStats, GenerateCall, Overloaded, RequestTooLarge
from replicas.gate import AdmissionGate, GateConfig
from tests.factories import LinearCost, chain

pytestmark = pytest.mark.asyncio


class ScriptedEngine(Engine):
    """An engine whose requests produce their first token only when the test says so."""

    block_size = 16
    max_num_batched_tokens = 100
    max_num_seqs = 8
    max_model_len = 4096

    def __init__(self, cached: set[int] | None = None) -> None:
        self.cached = cached or set()
        self.started: list[str] = []  # request ids in the order they entered the engine
        self.go: dict[str, asyncio.Event] = {}
        self.fits = True
        self.on_stored: Callable[[Iterable[int]], None] | None = None

    async def start(self) -> None: ...

    async def shutdown(self) -> None: ...

    async def generate(self, call: GenerateCall) -> AsyncIterator[EngineOutput]:
        self.started.append(call.request_id)
        ev = self.go.setdefault(call.request_id, asyncio.Event())
        await ev.wait()
        n = len(call.prompt_token_ids)
        hit = 0
        for h in call.block_hashes[: (n - 1) // 16]:
            if h not in self.cached:
                break
            hit += 1
        yield EngineOutput([7], cached_tokens=hit * 16)
        yield EngineOutput([8], finished=True, finish_reason="length")

    def release(self, request_id: str) -> None:
        self.go.setdefault(request_id, asyncio.Event()).set()

    def stats(self) -> EngineStats:
        return EngineStats(running=len(self.started), prefilling=0, pending_prefill_tokens=0,
                           kv_blocks_total=100, kv_blocks_free=50)

    def can_fit(self, prompt_tokens: int, block_hashes: Sequence[int]) -> bool:
        return self.fits

    def cached_prefix_blocks(self, block_hashes: Sequence[int]) -> int:
        n = 0
        for h in block_hashes:
            if h not in self.cached:
                break
            n += 1
        return n

    def cached_hashes(self) -> list[int]:
        return list(self.cached)

    def set_cache_listener(self, on_stored, on_removed) -> None:
        self.on_stored = on_stored


def call(rid: str, tokens: int, hashes: Sequence[int] = ()) -> GenerateCall:
    return GenerateCall(request_id=rid, prompt_token_ids=[20] * tokens, block_hashes=tuple(hashes),
                        max_tokens=2, arrival_s=0.0)


def make_gate(policy: str = "fcfs", cached: set[int] | None = None, **cfg) -> tuple[AdmissionGate, ScriptedEngine,
                                                                                    ManualClock]:
    clock = ManualClock()
    engine = ScriptedEngine(cached)
    pol = make_policy(policy, clock=clock, cost=LinearCost(), block_size=16)
    gate = AdmissionGate(engine, pol, clock, GateConfig(**cfg), replica="r0")
    return gate, engine, clock


async def consume(gate: AdmissionGate, c: GenerateCall, out: list) -> None:
    async for chunk in gate.submit(c):
        out.append((c.request_id, chunk))


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def test_admission_order_is_the_policys():
    """lpm: once the engine frees room, the waiter with the longest cached prefix goes next; the
    prefill budget (100 tokens) keeps the rest waiting in the gate, not in the engine."""
    fam = chain("doc", 8)
    gate, engine, clock = make_gate("lpm", cached=set(fam[:6]), prefill_budget_tokens=100)
    out: list = []
    tasks = [asyncio.create_task(consume(gate, call("a", 120), out))]  # fills the budget alone
    await settle()
    for rid, hashes in (("b", []), ("c", fam[:3] + chain("x", 5)), ("d", fam)):
        clock.advance(1.0)
        tasks.append(asyncio.create_task(consume(gate, call(rid, 128, hashes), out)))
    await settle()
    assert engine.started == ["a"]
    assert len(gate.policy) == 3
    for rid in ("a", "d", "c"):
        engine.release(rid)
        await settle()
    assert engine.started == ["a", "d", "c", "b"]  # d: 6 cached blocks, c: 3, b: 0
    engine.release("b")
    await asyncio.gather(*tasks)
    firsts = {rid: ch for rid, ch in out if ch.prompt_tokens}
    assert firsts["d"].cached_tokens == 96 and firsts["c"].cached_tokens == 48 and firsts["b"].cached_tokens == 0
    assert {ch.lane for _, ch in out} == {""}  # lpm has no lanes


async def test_fcfs_order_and_queue_waits():
    gate, engine, clock = make_gate("fcfs", prefill_budget_tokens=1)
    out: list = []
    tasks = []
    for i, rid in enumerate("abc"):
        tasks.append(asyncio.create_task(consume(gate, call(rid, 64), out)))
        await settle()
        clock.advance(0.5 * (i + 1))
    for rid in "abc":
        engine.release(rid)
        await settle()
    await asyncio.gather(*tasks)
    assert engine.started == ["a", "b", "c"]
    waits = {rid: ch.queue_wait_s for rid, ch in out if ch.prompt_tokens and ch.token_ids == [7]}
    assert waits == {"a": 0.0, "b": 2.5, "c": 1.5}  # b arrived at 0.5, c at 1.5; both admitted at 3.0


@pytest.mark.parametrize(("bound", "tokens", "why"), [
    ({"max_queue": 2}, 64, "2 waiting"),
    # LinearCost prices a 500-token prompt at 0.51 s: 1.02 s of prefill work waits, however short the queue
    # (a replica that has measured nothing trusts the cost model: 1.02 s of work is a 1.02 s wait)
    ({"max_queue_wait_s": 1.0}, 500, "an estimated 1.0 s of queue, the bound is 1 s"),
])
async def test_full_queue_refuses_at_once_with_retry_after(bound, tokens, why):
    gate, engine, _ = make_gate("fcfs", prefill_budget_tokens=1, **bound)
    out: list = []
    tasks = [asyncio.create_task(consume(gate, call(r, tokens), out)) for r in "abc"]
    await settle()
    assert engine.started == ["a"] and len(gate.policy) == 2
    with pytest.raises(Overloaded) as e:
        async for _ in gate.submit(call("d", tokens)):
            pass
    assert e.value.status == 429 and e.value.retry_after_s >= 1.0 and why in e.value.message
    for r in "abc":
        engine.release(r)
        await settle()
    await asyncio.gather(*tasks)
    assert engine.started == ["a", "b", "c"] and gate.rejected == 1


async def test_wait_bound_uses_the_measured_drain_rate():
    """An engine slower than its cost model: b (0.51 s of prefill) waited 9 s behind a to be
    admitted. The gate learns the rate, (0.51 + 1 prior) / (9 + 1) = 0.151 cost-model s per s (a,
    admitted at once, does not count: arrivals paced it), so one 500-token request queued is a
    3.4 s wait (d is taken) and two are 6.8 s (e is refused), where the cost model alone would
    call them 1.02 s and accept both."""
    gate, engine, clock = make_gate("fcfs", prefill_budget_tokens=1, max_queue_wait_s=5.0)
    out: list = []
    tasks = [asyncio.create_task(consume(gate, call(r, 500), out)) for r in "abc"]
    await settle()
    assert engine.started == ["a"] and gate.queue_wait_s() == pytest.approx(1.02)
    clock.advance(9.0)
    engine.release("a")
    await settle()
    assert engine.started == ["a", "b"]
    assert gate.drain.rate() == pytest.approx(1.51 / 10.0)
    assert gate.queue_wait_s() == pytest.approx(0.51 * 10.0 / 1.51)
    tasks.append(asyncio.create_task(consume(gate, call("d", 500), out)))
    await settle()
    with pytest.raises(Overloaded) as e:
        async for _ in gate.submit(call("e", 500)):
            pass
    assert "an estimated 6.8 s of queue, the bound is 5 s" in e.value.message and e.value.retry_after_s == 6.8
    for r in "bcd":
        engine.release(r)
        await settle()
    await asyncio.gather(*tasks)
    assert engine.started == ["a", "b", "c", "d"] and gate.rejected == 1


async def test_wait_bound_is_per_tenant_a_quiet_tenant_is_not_refused_for_a_flood():
    """Tenant a floods: a0 in the engine, a1..a3 waiting (3 x 0.51 s of work, the bound is 1.5 s),
    so a4 is refused with a's wait (1.53 s). b has nothing queued: under fair queueing its request
    waits for none of a's backlog (own 0 + min(1.53, 0) = 0), so b0 is accepted, and admitted
    next; a second b request then waits for b0's work and the same share of a's (2 x 0.51 s)."""
    clock = ManualClock()

    def pol():
        return make_policy("fcfs", clock=clock, cost=LinearCost(), block_size=16)

    engine = ScriptedEngine()
    gate = AdmissionGate(engine, pol(), clock, GateConfig(prefill_budget_tokens=1, max_queue_wait_s=1.5),
                         replica="r0", policy_factory=pol)
    out: list = []

    def c(rid: str):
        x = call(rid, 500)
        x.tenant = rid[0]
        return x

    tasks = [asyncio.create_task(consume(gate, c(r), out)) for r in ("a0", "a1", "a2", "a3")]
    await settle()
    assert engine.started == ["a0"] and gate.queue_wait_s("a") == pytest.approx(1.53)
    with pytest.raises(Overloaded) as e:
        async for _ in gate.submit(c("a4")):
            pass
    assert "an estimated 1.5 s of queue, the bound is 1.5 s" in e.value.message and e.value.retry_after_s == 1.5
    assert gate.queue_wait_s("b") == 0.0
    tasks.append(asyncio.create_task(consume(gate, c("b0"), out)))
    await settle()
    assert gate.queue_wait_s("b") == pytest.approx(1.02)
    engine.release("a0")
    await settle()
    assert engine.started == ["a0", "b0"]
    for r in ("b0", "a1", "a2", "a3"):
        engine.release(r)
        await settle()
    await asyncio.gather(*tasks)
    assert engine.started == ["a0", "b0", "a1", "a2", "a3"] and gate.rejected == 1


async def test_cancelled_waiter_leaves_the_queue():
    gate, engine, _ = make_gate("fcfs", prefill_budget_tokens=1)
    out: list = []
    a = asyncio.create_task(consume(gate, call("a", 64), out))
    b = asyncio.create_task(consume(gate, call("b", 64), out))
    c = asyncio.create_task(consume(gate, call("c", 64), out))
    await settle()
    b.cancel()
    await settle()
    assert len(gate.policy) == 1 and "b" not in gate.routing_stats().waiting_ids
    engine.release("a")
    await settle()
    engine.release("c")
    await asyncio.gather(a, c)
    assert engine.started == ["a", "c"]


async def test_head_that_does_not_fit_blocks_everyone_until_memory_frees():
    gate, engine, _ = make_gate("fcfs")
    engine.fits = False
    out: list = []
    tasks = [asyncio.create_task(consume(gate, call(r, 64), out)) for r in "ab"]
    await settle()
    assert engine.started == [] and len(gate.policy) == 2
    engine.fits = True
    gate.pump()
    await settle()
    assert engine.started == ["a", "b"]
    for r in "ab":
        engine.release(r)
    await asyncio.gather(*tasks)


async def test_too_long_and_empty_prompts_are_refused():
    gate, _, _ = make_gate("fcfs")
    with pytest.raises(RequestTooLarge, match="context length 4096"):
        async for _ in gate.submit(call("a", 4095)):
            pass
    with pytest.raises(RequestTooLarge, match="empty"):
        async for _ in gate.submit(call("b", 0)):
            pass
    with pytest.raises(RequestTooLarge, match="max_tokens must be >= 1"):
        async for _ in gate.submit(GenerateCall("c", [20] * 16, (), 0, 0.0)):
            pass
    assert gate.rejected == 3


async def test_routing_stats_carry_waiting_ids_and_cached_feedback():
    fam = chain("doc", 4)
    gate, engine, _ = make_gate("fairway", cached=set(fam), prefill_budget_tokens=1)
    out: list = []
    t1 = asyncio.create_task(consume(gate, call("a", 80, fam), out))
    t2 = asyncio.create_task(consume(gate, call("b", 80, fam), out))
    await settle()
    before = time.time()
    st = gate.routing_stats()
    assert st.waiting_ids == ["b"] and st.recent_cached == {} and gate.policy.lane_sizes() == {"fast": 1, "fair": 0}
    assert st.max_num_seqs == 8  # the engine's sequence capacity, for the router's wait model
    # "a" is in the engine without a first token: listed with its admission time (wall clock)
    assert list(st.prefilling) == ["a"] and st.prefilling["a"] <= before
    assert st.admitted_ids == ["a"]  # every request in the engine, prefilling or not
    engine.release("a")
    await settle()
    st = gate.routing_stats()  # "a" has its first token; "b" took its place
    assert st.waiting_ids == [] and list(st.prefilling) == ["b"]
    assert st.admitted_ids == ["b"]  # "a" is done: it left the engine
    engine.release("b")
    await asyncio.gather(t1, t2)
    st = gate.routing_stats()
    assert st.waiting_ids == [] and st.recent_cached == {"a": 64, "b": 64}  # 4 blocks, capped below 80
    assert st.prefilling == {} and st.admitted_ids == []
    assert {ch.lane for _, ch in out if ch.prompt_tokens} == {"fast"}


async def test_a_stream_cancelled_after_admission_frees_its_slot():
    """The consumer of an admitted stream goes away (Serve cancels it when the client
    disconnects): the engine slot is released, the cancel counted, and the next waiter admitted."""
    gate, engine, _ = make_gate("fcfs", max_queue=4)
    engine.max_num_seqs = 1
    out: list = []
    a = asyncio.create_task(consume(gate, call("a", 64), out))
    b = asyncio.create_task(consume(gate, call("b", 64), out))
    await settle()
    assert engine.started == ["a"] and len(gate.policy) == 1
    a.cancel()
    await settle()
    assert (gate.cancelled, gate.finished, engine.started) == (1, 1, ["a", "b"])
    engine.release("b")
    await b
    assert [rid for rid, _ in out] == ["b", "b"]


async def test_a_waiter_cancelled_just_before_a_pump_is_not_admitted():
    """Serve cancels a waiter's task when its client disconnects; ``Task.cancel`` cancels the
    admission future the task awaits at once, but the task sees it only when it next runs. A pump
    in between (an engine step, another request's arrival or end) must not admit the request: it
    would stay counted in the engine forever (its task, finding its future cancelled, has nothing
    to release), hold prefill budget, and after ``stall_timeout_s`` the watchdog would fail the
    replica as stalled with nothing in the engine (a CI run of a thousand disconnects did so)."""
    gate, engine, clock = make_gate("fcfs", stall_timeout_s=15.0)
    engine.fits = False
    out: list = []
    a = asyncio.create_task(consume(gate, call("a", 64), out))
    b = asyncio.create_task(consume(gate, call("b", 64), out))
    await settle()
    assert len(gate.policy) == 2 and engine.started == []
    a.cancel()  # its future is cancelled now; the task has not run yet
    engine.fits = True
    assert gate.pump() == 1  # b only: a is dropped from the queue, not admitted
    assert gate.routing_stats().admitted_ids == ["b"] and gate._pending_prefill == 64
    await settle()
    assert a.cancelled() and gate.cancelled == 1 and engine.started == ["b"]
    engine.release("b")
    await b
    assert [rid for rid, _ in out] == ["b", "b"]
    assert (gate._admitted, gate._pending_prefill, len(gate.policy), gate.routing_stats().waiting_ids) == ({}, 0, 0, [])
    clock.advance(15.0)
    gate._watch()
    assert not gate.stalled  # nothing is in the engine: nothing to stall


async def test_a_flooding_tenant_does_not_starve_a_quiet_one():
    """Tenant a queues six requests, then tenant b two. FCFS within each tenant, fair queueing
    across them: b, newly backlogged, starts at the system's virtual time, so it goes next, and
    the two alternate while both wait (ties to the name). One shared queue would run all of a's
    first."""
    async def order(fair: bool) -> list[str]:
        clock = ManualClock()

        def pol():
            return make_policy("fcfs", clock=clock, cost=LinearCost(), block_size=16)

        engine = ScriptedEngine()
        gate = AdmissionGate(engine, pol(), clock, GateConfig(prefill_budget_tokens=1), replica="r0",
                             policy_factory=pol if fair else None)
        out: list = []
        tasks = []
        for rid in ("a0", "a1", "a2", "a3", "a4", "a5", "b0", "b1"):
            c = call(rid, 64)
            c.tenant = rid[0]
            tasks.append(asyncio.create_task(consume(gate, c, out)))
            await settle()
        assert gate.policy.tenant_sizes() == ({"a": 5, "b": 2} if fair else {"": 7})
        for _ in range(8):
            engine.release(engine.started[-1])
            await settle()
        await asyncio.gather(*tasks)
        return engine.started

    assert await order(True) == ["a0", "b0", "a1", "b1", "a2", "a3", "a4", "a5"]
    assert await order(False) == ["a0", "a1", "a2", "a3", "a4", "a5", "b0", "b1"]


async def test_a_stalled_engine_fails_its_requests_with_504_refuses_new_ones_and_recovers():
    """Two requests in an engine that stops producing: after the stall timeout both end with
    EngineStalled (504) at once, the gate reports itself stalled and refuses a new request with
    a retryable 503; the engine's next output clears the state. The watchdog reads the gate's
    injected clock: nothing fails until the manual clock passes the timeout."""
    from fairway.protocol import EngineFailed, EngineStalled

    gate, engine, clock = make_gate("fcfs", stall_timeout_s=60.0)  # never reached on the wall clock here
    await gate.start()
    try:
        outcomes: list = []

        async def one(rid: str) -> None:
            try:
                async for _ in gate.submit(call(rid, 64)):
                    pass
                outcomes.append((rid, "ok"))
            except EngineStalled as e:
                outcomes.append((rid, e.status))

        tasks = [asyncio.create_task(one(r)) for r in ("a", "b")]
        deadline = time.monotonic() + 5
        while engine.started != ["a", "b"]:
            assert time.monotonic() < deadline, engine.started
            await asyncio.sleep(0.005)
        clock.advance(59.0)
        gate._watch()  # what the ticker does: not yet at the timeout
        assert not gate.stalled and not outcomes
        clock.advance(1.0)
        await asyncio.wait_for(asyncio.gather(*tasks), 5)
        assert sorted(outcomes) == [("a", 504), ("b", 504)]
        assert gate.stalled and gate.stalls == 1 and not gate._admitted
        with pytest.raises(EngineFailed) as e:
            async for _ in gate.submit(call("c", 64)):
                pass
        assert e.value.status == 503 and e.value.retry_after_s == 1.0
        gate._progress()  # the engine produced again
        assert not gate.stalled
        engine.release("d")
        outcomes.clear()
        await asyncio.wait_for(one("d"), 5)
        assert outcomes == [("d", "ok")]
    finally:
        await gate.shutdown()


async def test_the_stall_bound_scales_with_the_engine_time_scale():
    """An engine standing for hardware four times slower (the sim engine at ``speed`` 0.25) takes
    four times as long over every step: the watchdog waits ``stall_timeout_s`` times its
    ``time_scale`` (60 s here), not 15 s, before it fails the engine's requests; a faster one keeps 15 s."""
    from fairway.protocol import EngineStalled

    clock = ManualClock()
    engine = ScriptedEngine()

    def gate_at(time_scale: float) -> AdmissionGate:
        engine.time_scale = time_scale
        return AdmissionGate(engine, make_policy("fcfs", clock=clock, cost=LinearCost(), block_size=16), clock,
                             GateConfig(stall_timeout_s=15.0), replica="r0")

    gate = gate_at(4.0)
    assert gate.stall_bound_s == 60.0
    task = asyncio.create_task(consume(gate, call("a", 64), []))
    await settle()
    assert engine.started == ["a"]
    clock.advance(59.0)
    gate._watch()
    assert not gate.stalled  # 15 s would have failed it here
    clock.advance(1.0)
    gate._watch()
    assert gate.stalled
    with pytest.raises(EngineStalled, match="no progress for 60 s"):
        await asyncio.wait_for(task, 5)
    assert gate_at(0.001).stall_bound_s == 15.0  # a sim engine at 1000x speed: the bound is never tightened
    with pytest.raises(ValueError, match="time_scale must be > 0"):
        gate_at(0.0)


class MemoryEngine(ScriptedEngine):
    """A scripted engine with ``capacity`` prompt tokens of KV: a request holds its prompt's tokens
    from admission until it finishes."""

    def __init__(self, capacity: int) -> None:
        super().__init__()
        self.capacity = capacity
        self.held: dict[str, int] = {}

    async def generate(self, call: GenerateCall) -> AsyncIterator[EngineOutput]:
        self.held[call.request_id] = len(call.prompt_token_ids)
        async for out in super().generate(call):
            if out.finished:  # its memory is free before the gate hears of the finish
                del self.held[call.request_id]
            yield out

    def can_fit(self, prompt_tokens: int, block_hashes: Sequence[int]) -> bool:
        return prompt_tokens <= self.capacity - sum(self.held.values())


@pytest.mark.parametrize("recent_s", [30.0, 0.5])
async def test_a_flooding_tenant_leaves_room_for_a_recent_quiet_one(recent_s):
    """Tenant b was seen (one 64-token request, finished); tenant a then floods an engine with room
    for 200 prompt tokens. a holds more than b, so each of a's admissions must leave b's largest
    prompt (64) free: a0 and a1 enter, a2 waits with 72 tokens free; b1 then enters at once. Once
    b has been quiet for ``recent_s`` it is owed nothing and a2 enters as room allows."""
    clock = ManualClock()

    def pol():
        return make_policy("fcfs", clock=clock, cost=LinearCost(), block_size=16)

    engine = MemoryEngine(200)
    gate = AdmissionGate(engine, pol(), clock, GateConfig(prefill_budget_tokens=10_000, tenant_recent_s=recent_s),
                         replica="r0", policy_factory=pol)
    out: list = []

    def submit(rid: str) -> asyncio.Task:
        c = call(rid, 64)
        c.tenant = rid[0]
        return asyncio.create_task(consume(gate, c, out))

    first = submit("b0")
    await settle()
    engine.release("b0")
    await first
    clock.set(1.0)
    tasks = [submit(rid) for rid in ("a0", "a1", "a2")]
    await settle()
    if recent_s == 30.0:
        assert engine.started == ["b0", "a0", "a1"] and gate.policy.reserve("a", clock.now()) == (64, 1)
        tasks.append(submit("b1"))
        await settle()
        assert engine.started == ["b0", "a0", "a1", "b1"]  # at once, ahead of a2
    else:  # b was seen 1 s ago, longer than recent_s: nothing is kept for it
        assert engine.started == ["b0", "a0", "a1", "a2"] and gate.policy.reserve("a", clock.now()) == (0, 0)
    for _ in range(4):
        for rid in list(engine.held):
            engine.release(rid)
        await settle()
    await asyncio.wait_for(asyncio.gather(*tasks), 5.0)
    assert len(engine.started) == 5 if recent_s == 30.0 else 4
    assert gate.policy.held == {"a": 0, "b": 0}  # every admission released


async def test_a_tenant_whose_policy_holds_its_queue_back_does_not_block_the_others():
    """A policy may offer nothing while requests wait (PEEK holds siblings until their pioneer's
    blocks are stored): fair queueing then serves the next tenant instead of stopping."""
    from fairway.policies.baselines import FCFS
    from replicas.tenants import TenantQueues
    from tests.factories import queued

    class Holding(FCFS):
        def select(self):
            return None

    clock = ManualClock()
    pols = iter([Holding(clock, LinearCost()), FCFS(clock, LinearCost())])
    tq = TenantQueues(FCFS(clock, LinearCost()), lambda: next(pols))
    tq.add(queued(1, 0.0, 64), "a")  # a: least virtual time (first), but held
    tq.add(queued(2, 0.0, 64), "b")
    assert tq.select().rid == 2


async def test_a_flooding_tenant_leaves_half_the_prefill_budget_to_a_recent_quiet_one():
    """Budget 100 unprefilled tokens; b was seen (a 64-token prompt). a0 enters (0 + min(64, 50)
    < 100); a1 would leave less than 50 tokens of budget for b (64 pending), so it waits; b1,
    which owes nobody, enters at once."""
    clock = ManualClock()

    def pol():
        return make_policy("fcfs", clock=clock, cost=LinearCost(), block_size=16)

    engine = ScriptedEngine()
    gate = AdmissionGate(engine, pol(), clock, GateConfig(prefill_budget_tokens=100), replica="r0",
                         policy_factory=pol)
    out: list = []

    def submit(rid: str) -> asyncio.Task:
        c = call(rid, 64)
        c.tenant = rid[0]
        return asyncio.create_task(consume(gate, c, out))

    tasks = [submit("b0")]
    await settle()
    engine.release("b0")
    await tasks.pop()
    tasks += [submit("a0"), submit("a1")]
    await settle()
    assert engine.started == ["b0", "a0"]
    tasks.append(submit("b1"))
    await settle()
    assert engine.started == ["b0", "a0", "b1"]
    for _ in range(4):
        for rid in engine.started:
            engine.release(rid)
        await settle()
    await asyncio.wait_for(asyncio.gather(*tasks), 5.0)
    assert engine.started == ["b0", "a0", "b1", "a1"]


@pytest.mark.parametrize(("bound", "order", "waits"), [
    (None, ["a", "d", "c", "b"], {"a": 0.0, "d": 0.0, "c": 2.0, "b": 4.0}),
    (2.5, ["a", "d", "b", "c"], {"a": 0.0, "d": 0.0, "b": 3.0, "c": 3.0}),
])
async def test_oldest_first_after_its_bound(bound, order, waits):
    """lpm, one admission at a time: b (nothing cached) arrives at 1, c (3 blocks cached) at 2,
    d (6) at 3, behind a. a's first token at 3: b has waited 2 s, d goes. d's at 4: b has waited
    3 s, past a 2.5 s bound, so it goes before c; without the bound lpm keeps it last."""
    fam = chain("doc", 8)
    gate, engine, clock = make_gate("lpm", cached=set(fam[:6]), prefill_budget_tokens=1,
                                    oldest_first_after_s=bound)
    out: list = []
    tasks = [asyncio.create_task(consume(gate, call("a", 120), out))]
    await settle()
    for rid, hashes in (("b", []), ("c", fam[:3] + chain("x", 5)), ("d", fam)):
        clock.advance(1.0)
        tasks.append(asyncio.create_task(consume(gate, call(rid, 128, hashes), out)))
        await settle()
    for rid in order:
        engine.release(rid)
        await settle()
        clock.advance(1.0)
    await asyncio.gather(*tasks)
    assert engine.started == order
    assert {rid: ch.queue_wait_s for rid, ch in out if ch.token_ids == [7]} == pytest.approx(waits)


# -- request classes ---------------------------------------------------------------------------

CLASSES = "interactive:tier=0:objective=1,batch:tier=1:objective=30"


async def test_strict_tiers_hold_across_tenants_and_fair_queueing_within_a_tier():
    """Tenant a floods with batch requests, then tenant b sends two batch and tenant c one
    interactive request. The interactive one goes first whatever its tenant; then the tenants'
    fair queueing alternates a and b within the batch tier."""
    clock = ManualClock()

    def pol():
        return make_policy("classes", clock=clock, cost=LinearCost(), block_size=16, classes=CLASSES, inner="fcfs")

    engine = ScriptedEngine()
    gate = AdmissionGate(engine, pol(), clock, GateConfig(prefill_budget_tokens=1), replica="r0", policy_factory=pol)
    out: list = []
    tasks = []
    for rid in ("a0", "a1", "a2", "a3", "b0", "b1", "c0"):
        c = call(rid, 64)
        c.tenant = rid[0]
        c.priority_class = "interactive" if rid[0] == "c" else "batch"
        tasks.append(asyncio.create_task(consume(gate, c, out)))
        await settle()
    for _ in range(7):
        engine.release(engine.started[-1])
        await settle()
    await asyncio.gather(*tasks)
    assert engine.started == ["a0", "c0", "b0", "a1", "b1", "a2", "a3"]


async def test_an_interactive_request_is_not_refused_for_a_batch_backlog():
    """Batch requests fill the queue to its wait bound (3 x 0.51 s waiting, the bound 1.5 s): a
    fourth batch request is refused, an interactive one waits for none of that work and is taken,
    and admitted next."""
    clock = ManualClock()
    engine = ScriptedEngine()
    gate = AdmissionGate(engine, make_policy("classes", clock=clock, cost=LinearCost(), block_size=16,
                                             classes=CLASSES, inner="fcfs"),
                         clock, GateConfig(prefill_budget_tokens=1, max_queue_wait_s=1.5), replica="r0")
    out: list = []

    def c(rid: str, klass: str) -> GenerateCall:
        x = call(rid, 500)
        x.priority_class = klass
        return x

    tasks = [asyncio.create_task(consume(gate, c(r, "batch"), out)) for r in ("b0", "b1", "b2", "b3")]
    await settle()
    assert engine.started == ["b0"] and gate.queue_wait_s("", "batch") == pytest.approx(1.53)
    with pytest.raises(Overloaded):
        async for _ in gate.submit(c("b4", "batch")):
            pass
    assert gate.queue_wait_s("", "interactive") == 0.0
    tasks.append(asyncio.create_task(consume(gate, c("i0", "interactive"), out)))
    await settle()
    for r in ("b0", "i0", "b1", "b2", "b3"):
        engine.release(r)
        await settle()
    await asyncio.gather(*tasks)
    assert engine.started == ["b0", "i0", "b1", "b2", "b3"] and gate.rejected == 1


async def test_a_call_with_ack_is_acknowledged_when_queued_and_refusals_stay_refusals():
    """``GenerateCall.ack`` (a request the router held): the gate yields an ``accepted`` chunk as
    soon as it queues the call, before its admission; a full gate still refuses it at once."""
    gate, engine, _ = make_gate("fcfs", prefill_budget_tokens=1)
    out: list = []
    a = asyncio.create_task(consume(gate, call("a", 64), out))
    await settle()
    held = call("h", 64)
    held.ack = True
    b = asyncio.create_task(consume(gate, held, out))
    await settle()
    assert [(rid, c.accepted, c.token_ids) for rid, c in out] == [("h", True, [])]  # queued, not admitted
    assert engine.started == ["a"] and len(gate.policy) == 1
    engine.release("a")
    await settle()
    engine.release("h")
    await asyncio.gather(a, b)
    assert [(rid, c.accepted, c.token_ids) for rid, c in out if rid == "h"] == [
        ("h", True, []), ("h", False, [7]), ("h", False, [8])]
    full, engine, _ = make_gate("fcfs", prefill_budget_tokens=1, max_queue=1)
    busy = [asyncio.create_task(consume(full, call(x, 64), [])) for x in ("a", "b")]  # one running, one waiting
    await settle()
    seen: list = []
    with pytest.raises(Overloaded):
        await consume(full, held, seen)
    assert seen == []  # refused before any acknowledgement
    for x in ("a", "b"):
        engine.release(x)
        await settle()
    await asyncio.gather(*busy)


async def test_a_request_still_waiting_at_its_class_bound_is_answered_429_not_retried():
    """With a wait bound per class, a request still unadmitted when its bound passes is answered
    ``PastWaitBound`` (429, which the ingress does not retry elsewhere) and leaves the queue; a
    class without a bound, and an admitted request, are untouched."""
    from fairway.protocol import PastWaitBound

    gate, engine, _ = make_gate("fcfs", prefill_budget_tokens=1)
    gate.wait_bound_s = {"short": 0.0, "long": None}.get
    out: list = []
    running = asyncio.create_task(consume(gate, call("a", 64), out))
    await settle()
    short, long_ = call("s", 64), call("l", 64)
    short.priority_class, long_.priority_class = "short", "long"
    short.received_s = long_.received_s = time.time() - 1.0
    ts = asyncio.create_task(consume(gate, short, out))
    tl = asyncio.create_task(consume(gate, long_, out))
    await settle()
    assert len(gate.policy) == 2
    gate._shed()
    await settle()
    with pytest.raises(PastWaitBound):
        await ts
    assert len(gate.policy) == 1 and gate.past_bound == 1 and gate.rejected == 1 and gate.cancelled == 0
    for x in ("a", "l"):
        engine.release(x)
        await settle()
    await asyncio.gather(running, tl)
    assert engine.started == ["a", "l"]


@pytest.mark.parametrize("tiered, started", [
    (False, ["b0"]),  # rule 2: the batch backlog fills the budget, the interactive request waits behind it
    (True, ["b0", "i0"]),  # the engine pauses batch prefill for it: rule 2 counts only its own tier's backlog
])
async def test_with_an_engine_that_serves_the_strict_tier_first_rule_2_counts_only_that_tiers_backlog(
        tiered, started):
    """A batch request's 500 prompt tokens fill the 100-token prefill budget. An interactive
    request then arrives: with ``tier_of`` (the engine runs the strictest tier's prefill first)
    it enters the engine at once, and a second interactive one waits for the first's prefill, not
    for the batch's; without it, both wait for the batch request's first token."""
    clock = ManualClock()
    engine = ScriptedEngine()
    classes = ClassesConfig.parse(CLASSES)
    gate = AdmissionGate(engine, make_policy("classes", clock=clock, cost=LinearCost(), block_size=16,
                                             classes=CLASSES, inner="fcfs"),
                         clock, GateConfig(), replica="r0",
                         tier_of=(lambda k: classes.spec(k).tier) if tiered else None)
    out: list = []

    def c(rid: str, klass: str, tokens: int) -> GenerateCall:
        x = call(rid, tokens)
        x.priority_class = klass
        return x

    tasks = [asyncio.create_task(consume(gate, c("b0", "batch", 500), out))]
    await settle()
    tasks += [asyncio.create_task(consume(gate, c(r, "interactive", 200), out)) for r in ("i0", "i1")]
    await settle()
    assert engine.started == started
    for r in ("b0", "i0", "i1") if not tiered else ("i0", "i1", "b0"):
        engine.release(r)
        await settle()
    await asyncio.gather(*tasks)
    assert engine.started == ["b0", "i0", "i1"] and gate.admitted == 3


@pytest.mark.parametrize(("free", "aging", "order"), [(50, 0.0, ["w1", "w2", "c0"]), (200, 0.0, ["c0", "w1", "w2"]),
                                                    (50, 50.0, ["c0", "w1", "w2"])])
async def test_the_memory_guard_at_the_gate_reads_the_engines_free_blocks_and_its_own_counts(free, aging, order):
    """Fairway's memory guard on the live path: the gate keeps the memory view (which prompts
    its admitted requests hold, which cached blocks its waiting ones need) over the engine's
    free-block count. A cold promoted head (100 new blocks) and two warm requests (20 cached
    blocks each, held by no running request): with 50 free blocks, 40 of them the warm ones'
    contexts, the cold head would evict them, so the warm ones pass it; with 200 free it evicts
    nobody and the lanes decide as without the guard. With ``guard_aging`` 50 (tokens a second
    late) the cold head, due 19.32 against the warm ones' 26.2, leads them by 6.88 s x 50 = 344
    tokens of aging, more than their 320 cached: it goes first. The finished prompts stay wanted
    for ``guard_horizon_s``, then every count is back to zero."""
    clock = ManualClock()
    warm = set(chain("w1", 20)) | set(chain("w2", 20))
    engine = ScriptedEngine(set(warm))
    engine.stats = lambda: EngineStats(running=0, prefilling=0, pending_prefill_tokens=0,  # type: ignore[method-assign]
                                       kv_blocks_total=400, kv_blocks_free=free)
    # fast_ahead 0: the guard alone reorders (the warm picks would also pass the cold head by fast_ahead)
    pol = make_policy("fairway", clock=clock, cost=LinearCost(), block_size=16, memory_guard=True,
                      guard_loss=0.0, guard_aging=aging, fast_ahead=0.0)
    cfg = GateConfig(max_queue_wait_s=None, prefill_budget_tokens=10_000)
    gate = AdmissionGate(engine, pol, clock, cfg, replica="r0")
    view = gate.memory
    unguarded = make_policy("fairway", clock=clock, cost=LinearCost(), block_size=16, memory_guard=False)
    assert view is not None and AdmissionGate(ScriptedEngine(), unguarded, clock).memory is None
    assert make_gate("fcfs")[0].memory is None
    engine.fits = False  # everyone waits for memory until the test lets them in
    out: list = []
    tasks = [asyncio.create_task(consume(gate, call("c0", 1600, chain("cold", 100)), out))]
    await settle()
    clock.advance(25.0)
    for rid in ("w1", "w2"):
        tasks.append(asyncio.create_task(consume(gate, call(rid, 336, chain(rid, 21)), out)))
    await settle()
    assert (view.n_wanted, view.n_free_wanted, view.spare_blocks()) == (40, 40, free - 40)
    clock.advance(5.0)  # all three promoted; the Fair lane's head (EDF) is the cold c0
    engine.fits = True
    gate.pump()
    await settle()
    assert engine.started == order
    assert gate.policy.yields == (2 if order[0] != "c0" else 0)  # fairway_memory_guard_yields_total's source
    assert view.n_held == 100 + 21 + 21 and view.n_wanted == 0
    for rid in order:
        engine.release(rid)
    await asyncio.gather(*tasks)
    assert (view.n_held, view.n_wanted, view.n_free_wanted) == (0, 142, 142)  # wanted by a next turn
    clock.advance(10.0)  # guard_horizon_s: then nobody's
    assert (view.n_held, view.n_wanted, view.n_free_wanted) == (0, 0, 0)


async def test_the_default_guard_at_the_gate_counts_the_admitted_prompts_once_a_reader_needs_them():
    """The default Fairway keeps its memory view's counts off while no context is lost waiting;
    the running prompts it counts when a reader needs them are the ones the gate admitted and
    the engine has not released (``TenantQueues.held_prompts``)."""
    clock = ManualClock()
    engine = ScriptedEngine(set())
    gate = AdmissionGate(engine, make_policy("fairway", clock=clock, cost=LinearCost(), block_size=16), clock,
                         GateConfig(max_queue_wait_s=None, prefill_budget_tokens=10_000), replica="r0")
    view = gate.memory
    assert view is not None
    out: list = []
    tasks = [asyncio.create_task(consume(gate, call(rid, 336, chain(rid, 21)), out)) for rid in ("a", "b")]
    await settle()
    assert engine.started == ["a", "b"] and not view.counting and view.n_held == 0
    view.need(tasks, True)
    assert view.n_held == 42
    engine.release("a")
    await settle()
    assert view.n_held == 21
    engine.release("b")
    await asyncio.gather(*tasks)
    assert view.n_held == 0


def test_a_tenant_queue_made_after_evictions_reads_the_replica_memory_of_them():
    """The replica's evictions before a tenant's first request count for that request's deadline:
    its new Fairway queue shares the memory the first queue recorded (theta 12, P floor .1)."""
    from replicas.tenants import TenantQueues
    from tests.factories import chain, queued

    clock = ManualClock()

    def pol():
        return make_policy("fairway", clock=clock, cost=LinearCost(), block_size=16, lost_blocks=65536,
                           lost_scope="evicted")

    cache = set(chain("d", 30))
    tq = TenantQueues(pol(), pol)
    tq.attach_cache(cache.__contains__)
    cache.clear()
    tq.on_blocks_removed(chain("d", 30))
    tq.add(queued(1, 0.0, 500, chain("d", 31)), "x")
    x = tq.queues["x"]
    assert x.evicted is tq.queues[""].evicted and x.lost_credits == 1
    assert x.due[x._slot_of[1]] == pytest.approx(12 * 0.1)


async def test_a_follow_up_turn_whose_context_ran_here_is_counted_as_a_lost_context_credit():
    """Fairway's defaults (``lost_blocks``, ``lost_scope=turns``) at the gate: turn 1 runs, its context is no
    longer cached when turn 2 arrives, and turn 2's deadline counts it as cached (theta 12, P
    floor .1); ``fairway_lost_context_credits_total`` counts it. A prompt sharing none of turn 1's
    end counts nothing."""
    from observability.stats import FairwayStats

    clock = ManualClock()
    engine = ScriptedEngine(set())
    pol = make_policy("fairway", clock=clock, cost=LinearCost(), block_size=16)  # the shipped defaults
    gate = AdmissionGate(engine, pol, clock, GateConfig(max_queue_wait_s=None), replica="r0")
    gate.stats = FairwayStats(level="replica", component="r0", policy="fairway")
    out: list = []
    first = asyncio.create_task(consume(gate, call("t1", 481, chain("d", 30)), out))
    await settle()
    engine.release("t1")
    await first
    engine.fits = False  # the next arrivals wait, so their deadlines can be read
    later = [asyncio.create_task(consume(gate, call("t2", 500, chain("d", 31)), out)),
             asyncio.create_task(consume(gate, call("x", 500, chain("x", 31)), out))]
    await settle()
    policy = gate.policy.queues[""]
    due = {rid: policy.due[policy._slot_of[rid]] for rid in policy._slot_of}
    assert sorted(due.values()) == pytest.approx([12 * 0.1, 12 * 0.51])  # t2 credited, x cold
    engine.fits = True
    gate.pump()
    await settle()
    for rid in ("t2", "x"):
        engine.release(rid)
    await asyncio.gather(*later)
    assert gate.stats.counter("lost_credits") == 1  # counted at the admissions


def _first_step_gate(first_step_hold: bool = True, **config) -> tuple[AdmissionGate, ScriptedEngine, ManualClock]:
    """A Fairway gate with a 1,000-token prefill budget over a scripted engine, LinearCost."""
    clock = ManualClock()
    engine = ScriptedEngine()
    engine.max_model_len = 8192
    pol = make_policy("fairway", clock=clock, cost=LinearCost(), block_size=16, first_step_hold=first_step_hold)
    gate = AdmissionGate(engine, pol, clock, GateConfig(prefill_budget_tokens=1000, **config), replica="r0")
    return gate, engine, clock


@pytest.mark.parametrize(("hold", "tokens"), [(False, 3000), (True, 3000), (True, 600), (False, 600)])
async def test_a_long_prompt_waits_at_the_gate_for_the_first_tokens_of_the_step_in_the_engine(hold, tokens):
    """fairway[first_step_hold]: three short prompts are in the engine, within one step's budget
    (1,000 tokens); a 3,000-token prompt's chunk would fill their step (0.31 s -> 1.01 s each,
    LinearCost), and a 600-token prompt would end in it but lengthen it to 0.91 s, so either
    waits until their first tokens are out; off, it goes in at once."""
    from observability.stats import FairwayStats

    gate, engine, _ = _first_step_gate(first_step_hold=hold)
    gate.stats = FairwayStats(level="replica", component="r0", policy="fairway")
    out: list = []
    tasks = [asyncio.create_task(consume(gate, call(rid, 100, chain(rid, 7)), out)) for rid in "abc"]
    await settle()
    tasks.append(asyncio.create_task(consume(gate, call("h", tokens, chain("h", tokens // 16)), out)))
    await settle()
    if not hold:
        assert engine.started == ["a", "b", "c", "h"] and gate.first_step_holds == 0
    else:
        assert engine.started == ["a", "b", "c"] and gate.first_step_holds == 1
        for rid in "ab":
            engine.release(rid)
            await settle()
            assert engine.started == ["a", "b", "c"]  # c's first token is still to come
        engine.release("c")
        await settle()
        assert engine.started == ["a", "b", "c", "h"]
        assert gate.first_step_holds == 1  # one request held, over five pumps
    assert gate.stats.counter("first_step_holds") == gate.first_step_holds  # fairway_first_step_holds_total
    for rid in "abch":
        engine.release(rid)
    await asyncio.gather(*tasks)
    assert {rid for rid, ch in out if ch.finished} == set("abch")


async def test_a_prompt_that_would_end_in_the_step_is_held_for_one_step_at_most():
    """A 600-token prompt is held for the first tokens of a, b and c; a short prompt d arrives
    and goes first (the Fast lane): the 600-token prompt would pay to wait for d's first token
    too, but it has waited once already, so it goes in with d."""
    gate, engine, _ = _first_step_gate()
    out: list = []
    tasks = [asyncio.create_task(consume(gate, call(rid, 100, chain(rid, 7)), out)) for rid in "abc"]
    await settle()
    tasks.append(asyncio.create_task(consume(gate, call("h", 600, chain("h", 37)), out)))
    await settle()
    engine.release("a")
    await settle()
    assert engine.started == ["a", "b", "c"] and gate.first_step_holds == 1  # still b's and c's step
    tasks.append(asyncio.create_task(consume(gate, call("d", 100, chain("d", 7)), out)))
    await settle()
    assert engine.started == ["a", "b", "c", "d", "h"] and gate.first_step_holds == 1
    for rid in "bcdh":
        engine.release(rid)
    await asyncio.gather(*tasks)
    assert {rid for rid, ch in out if ch.finished} == set("abcdh")


@pytest.mark.parametrize(("cap", "held"), [(100, False), (400, True)])
async def test_the_hold_prices_the_chunk_the_engine_s_long_prefill_cap_allows(cap, held):
    """The engine computes at most ``long_prefill_token_threshold`` tokens of a prompt a step
    (vLLM's option): the 3,000-token prompt's chunk beside a, b and c is that cap. 100 tokens
    add 0.1 s to three first tokens, less than the 0.31 s step it would wait: it goes in; 400
    add 0.4 s to each: it waits."""
    gate, engine, _ = _first_step_gate()
    engine.long_prefill_token_threshold = cap
    out: list = []
    tasks = [asyncio.create_task(consume(gate, call(rid, 100, chain(rid, 7)), out)) for rid in "abc"]
    await settle()
    tasks.append(asyncio.create_task(consume(gate, call("h", 3000, chain("h", 188)), out)))
    await settle()
    assert engine.started == (["a", "b", "c"] if held else ["a", "b", "c", "h"])
    assert gate.first_step_holds == int(held)
    for rid in "abch":
        engine.release(rid)
    await asyncio.gather(*tasks)
    assert {rid for rid, ch in out if ch.finished} == set("abch")


async def test_a_prefill_longer_than_the_engine_s_cap_brings_no_first_token_to_the_step():
    """Cap 220: a (500 tokens) runs a 220-token chunk of its prompt in the step, so the step
    (0.01 + 0.22 + 0.2 s) ends b's and c's prefills only. The 3,000-token prompt's 220-token
    chunk would delay those two first tokens by 0.44 s, more than the 0.43 s step it waits: it
    is held. Were a counted as ending in the step with its whole prompt, the step would be
    0.71 s and three first tokens' 0.66 s would not pay for it."""
    gate, engine, _ = _first_step_gate()
    engine.long_prefill_token_threshold = 220
    out: list = []
    tasks = [asyncio.create_task(consume(gate, call("a", 500, chain("a", 31)), out))]
    await settle()
    tasks += [asyncio.create_task(consume(gate, call(rid, 100, chain(rid, 7)), out)) for rid in "bc"]
    await settle()
    assert engine.started == ["a", "b", "c"] and gate.first_step_holds == 0
    tasks.append(asyncio.create_task(consume(gate, call("h", 3000, chain("h", 188)), out)))
    await settle()
    assert engine.started == ["a", "b", "c"] and gate.first_step_holds == 1
    for rid in "abch":
        engine.release(rid)
    await asyncio.gather(*tasks)
    assert {rid for rid, ch in out if ch.finished} == set("abch")


async def test_a_prompt_as_cheap_as_the_step_in_the_engine_is_not_held():
    """As above with a fourth 100-token prompt: its chunk adds 0.1 s to three first tokens,
    less than the 0.31 s step it would wait, so it goes in at once."""
    gate, engine, _ = _first_step_gate()
    out: list = []
    tasks = [asyncio.create_task(consume(gate, call(rid, 100, chain(rid, 7)), out)) for rid in "abcd"]
    await settle()
    assert engine.started == ["a", "b", "c", "d"] and gate.first_step_holds == 0
    for rid in "abcd":
        engine.release(rid)
    await asyncio.gather(*tasks)
    assert {rid for rid, ch in out if ch.finished} == set("abcd")


async def test_a_long_prompt_past_the_age_bound_is_not_held_for_first_tokens():
    """As above, with ``oldest_first_after_s`` 0.5 s: held at its arrival; once it has waited
    past the bound it goes in at the next pump (a's first token), though b's and c's are to come."""
    gate, engine, clock = _first_step_gate(oldest_first_after_s=0.5)
    out: list = []
    tasks = [asyncio.create_task(consume(gate, call(rid, 100, chain(rid, 7)), out)) for rid in "abc"]
    await settle()
    tasks.append(asyncio.create_task(consume(gate, call("h", 3000, chain("h", 188)), out)))
    await settle()
    assert engine.started == ["a", "b", "c"] and gate.first_step_holds == 1
    clock.advance(0.6)
    engine.release("a")
    await settle()
    assert engine.started == ["a", "b", "c", "h"]
    for rid in "bch":
        engine.release(rid)
    await asyncio.gather(*tasks)
    assert {rid for rid, ch in out if ch.finished} == set("abch")
