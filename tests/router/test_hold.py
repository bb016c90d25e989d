"""The ingress's held queue (``router/hold.py``) with a scripted probe: who is sent when a gate
has room, in which order, and how a request leaves without being sent (its bound, its client,
a full queue, its own failure). Real asyncio, no Ray."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from fairway.clock import ManualClock
from fairway.cost_model import CostModel
from fairway.policies.classes import ClassesConfig
from fairway.protocol import GenerateCall
from fairway.routing.held import HeldQueue
from observability.stats import FairwayStats
from router.hold import Holder, HoldRefused

pytestmark = pytest.mark.asyncio
CLASSES = "int:tier=0:objective=1:max_wait=30,batch:tier=1:objective=30"


def call(name: str, prompt: int = 100, klass: str = "", received: float | None = None) -> GenerateCall:
    now = time.time() if received is None else received
    return GenerateCall(request_id=name, prompt_token_ids=[1] * prompt, block_hashes=(), max_tokens=1,
                        arrival_s=now, received_s=now, priority_class=klass)


class Refused(Exception):
    """A gate's refusal as the ingress maps it (``router.errors.HTTPError`` 429 with ``refused_by``)."""

    refused_by = "r0"
    retry_after_s = 2.0


class Gates:
    """The replicas as the held queue sees them: a probe is refused (``Refused``) until
    ``room`` is set, then accepted; ``sent`` lists the probes in order, ``closed`` the streams
    closed without a reader."""

    def __init__(self) -> None:
        self.room = False
        self.fail: set[str] = set()  # request ids whose probe fails with another error
        self.sent: list[str] = []
        self.probes = 0
        self.closed: list[str] = []
        self.gate: asyncio.Event | None = None  # when set, a probe waits for it (a slow gate)
        self.on_sent: Any = None  # called soon after a probe is accepted

    async def probe(self, c: GenerateCall) -> str:
        assert c.ack and c.avoid == ()
        self.probes += 1
        if self.gate is not None:
            await self.gate.wait()
        await asyncio.sleep(0)
        if c.request_id in self.fail:
            raise RuntimeError(f"replica died under {c.request_id}")
        if not self.room:
            raise Refused("replica r0 queue is full")
        self.sent.append(c.request_id)
        if self.on_sent is not None:
            asyncio.get_running_loop().call_soon(self.on_sent)  # runs before the caller resumes
        return "stream-" + c.request_id

    def close(self, stream: str) -> None:
        self.closed.append(stream)


def holder(gates: Gates, classes: str = "", max_held: int = 100, bound_s: float = 10.0,
           poll_s: float = 0.05) -> Holder[str]:
    cfg = ClassesConfig.parse(classes)
    queue = HeldQueue(ManualClock(), CostModel.from_profile("h200-llama3-8b"), cfg, max_held=max_held)
    stats = FairwayStats(level="router", component="hold-test")

    def bound(c: GenerateCall) -> float:
        return cfg.wait_bound_for(c.priority_class, bound_s)

    return Holder(queue, gates.probe, gates.close, bound, poll_s=poll_s, stats=stats)


async def until(cond: Any, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError("condition not met in time")
        await asyncio.sleep(0.005)


async def test_held_requests_are_sent_in_the_flow_control_order_once_a_gate_has_room():
    """Strict tiers first, then within a class Fairway's Fast lane (the least prompt work, no
    cache view at the router); nothing is sent while every gate refuses."""
    gates = Gates()
    h = holder(gates, CLASSES)
    waits = {}
    for name, prompt, klass in (("b-long", 8000, "batch"), ("b-short", 100, "batch"), ("i", 20000, "int")):
        waits[name] = asyncio.ensure_future(h.wait(call(name, prompt, klass), refused_wait_s=1.0))
        await asyncio.sleep(0)
    await until(lambda: gates.probes >= 2)  # rounds ran, every probe refused
    assert gates.sent == [] and len(h) == 3
    gates.room = True
    h.room()
    got = await asyncio.wait_for(asyncio.gather(*waits.values()), 5)
    assert [stream for stream, _ in got] == ["stream-b-long", "stream-b-short", "stream-i"]
    assert gates.sent == ["i", "b-short", "b-long"]
    assert len(h) == 0 and not h.queue.depth
    hist = {x["labels"]["class"]: x["count"] for x in h.stats.snapshot()["histograms"]["hold"]}
    assert hist == {"int": 1, "batch": 2}
    assert h.stats.gauge("held", **{"class": "batch"}) == 0


async def test_a_refused_probe_ends_the_round_and_keeps_its_place():
    """One refused probe per round at most: the head is refused, the others are not tried."""
    gates = Gates()
    h = holder(gates, poll_s=10.0)  # no polling: only the signs of room start rounds
    tasks = [asyncio.ensure_future(h.wait(call(f"r{i}", 100 + i), refused_wait_s=1.0)) for i in range(3)]
    await until(lambda: gates.probes >= 1)
    await asyncio.sleep(0.05)
    assert gates.probes == 1  # the round stopped at the head's refusal
    h.room()
    await until(lambda: gates.probes >= 2)
    await asyncio.sleep(0.05)
    assert gates.probes == 2
    gates.room = True
    h.room()
    await asyncio.wait_for(asyncio.gather(*tasks), 5)
    assert gates.sent == ["r0", "r1", "r2"]  # the head kept its place through its refusals


async def test_a_request_whose_predicted_wait_passes_its_bound_is_refused_at_once():
    gates = Gates()
    h = holder(gates, bound_s=5.0)
    with pytest.raises(HoldRefused) as e:
        await h.wait(call("x"), refused_wait_s=6.0)
    assert e.value.reason == "hold_bound" and e.value.retry_after_s == 6.0 and "5 s" in e.value.message
    assert gates.probes == 0 and len(h) == 0
    # the bound counts from the request's headers: 3 s ago, a 2.5 s queue passes a 5 s bound
    with pytest.raises(HoldRefused):
        await h.wait(call("y", received=time.time() - 3.0), refused_wait_s=2.5)


async def test_a_request_held_past_its_bound_gets_429_with_the_last_estimate():
    gates = Gates()
    h = holder(gates, bound_s=0.3)
    t0 = time.monotonic()
    with pytest.raises(HoldRefused) as e:
        await asyncio.wait_for(h.wait(call("x"), refused_wait_s=0.1), 5)
    assert 0.25 <= time.monotonic() - t0 < 2.0
    assert e.value.reason == "hold_timeout" and e.value.retry_after_s == 2.0  # the probes' estimate
    assert gates.probes >= 1 and gates.sent == [] and len(h) == 0
    (timeout,) = h.stats.snapshot()["histograms"]["hold"]
    assert timeout["labels"] == {"class": "", "status": "timeout"} and timeout["count"] == 1


async def test_a_client_that_leaves_is_dropped_or_its_stream_closed():
    gates = Gates()
    h = holder(gates, poll_s=10.0)
    gone = asyncio.ensure_future(h.wait(call("gone"), refused_wait_s=1.0))
    await until(lambda: gates.probes >= 1)
    gone.cancel()
    await asyncio.sleep(0.01)
    assert len(h) == 0 and not h.queue.depth  # dropped while held: never sent
    # gone while a gate takes it: the round closes the stream nobody reads
    gates.gate = asyncio.Event()
    gates.room = True
    late = asyncio.ensure_future(h.wait(call("late"), refused_wait_s=1.0))
    await until(lambda: gates.probes >= 2)
    late.cancel()
    gates.gate.set()
    await until(lambda: gates.closed == ["stream-late"])
    assert gates.sent == ["late"] and len(h) == 0


async def test_the_held_queue_has_a_size_bound_and_a_probe_failure_is_the_requests_answer():
    gates = Gates()
    h = holder(gates, max_held=1, poll_s=10.0)
    first = asyncio.ensure_future(h.wait(call("a"), refused_wait_s=1.0))
    await until(lambda: len(h) == 1)
    with pytest.raises(HoldRefused) as e:
        await h.wait(call("b"), refused_wait_s=1.0)
    assert e.value.reason == "held_full" and "holds 1 requests" in e.value.message
    gates.fail.add("a")
    h.room()
    with pytest.raises(RuntimeError, match="replica died"):
        await asyncio.wait_for(first, 5)
    assert len(h) == 0


async def test_the_gates_bound_is_left_of_every_requests_bound():
    """With the gates' wait bound as ``margin_s`` a request is held only until its bound less that
    margin (it may wait that long in a gate's queue once sent), and one whose bound leaves no
    time after the margin is refused at once."""
    gates = Gates()
    h = holder(gates, bound_s=1.5)
    h.margin_s = 1.2
    t0 = time.monotonic()
    with pytest.raises(HoldRefused) as e:
        await asyncio.wait_for(h.wait(call("x"), refused_wait_s=1.3), 5)
    assert e.value.reason == "hold_timeout" and time.monotonic() - t0 < 1.2  # held 0.3 s, not 1.5
    with pytest.raises(HoldRefused) as e:
        await h.wait(call("y"), refused_wait_s=2.8)  # 1.6 s more than the margin: past 1.5
    assert e.value.reason == "hold_bound"


async def test_only_a_request_whose_bound_outlasts_the_gates_can_be_held():
    """A bound at or under the gates' leaves no time to hold: such a request is sent at once even
    while others are held (the ingress checks ``can_hold``), not queued behind them."""
    h = holder(Gates(), "int:tier=0:objective=1,batch:tier=1:objective=30")
    h.margin_s = 5.0
    assert not h.can_hold(call("i", klass="int"))
    assert h.can_hold(call("b", klass="batch"))
    assert not h.can_hold(call("late", klass="batch", received=time.time() - 26.0))  # 30 - 5 s passed


async def test_a_probe_nobody_answers_counts_as_a_refusal_and_the_bounds_go_on():
    """A gate that neither acknowledges nor refuses (its replica's loop stuck): the probe times
    out like a refusal, and the held request still gets its answer at its bound."""
    gates = Gates()
    gates.gate = asyncio.Event()  # never set: every probe hangs
    h = holder(gates, bound_s=0.4)
    h.probe_timeout_s = 0.1
    t0 = time.monotonic()
    with pytest.raises(HoldRefused) as e:
        await asyncio.wait_for(h.wait(call("x"), refused_wait_s=0.1), 5)
    assert e.value.reason == "hold_timeout" and time.monotonic() - t0 < 2.0
    assert gates.probes >= 1 and len(h) == 0


async def test_a_caller_leaving_as_its_stream_arrives_closes_it_and_rounds_pause_after_a_refusal():
    """The round hands the stream over and the caller is cancelled before it reads it: the
    stream is closed, not left running. And however many signs of room arrive, rounds that end
    in a refusal are at least ``REFUSED_PAUSE_S`` apart (one refused probe each)."""
    from router.hold import REFUSED_PAUSE_S

    gates = Gates()
    h = holder(gates, poll_s=10.0)
    busy = asyncio.ensure_future(h.wait(call("busy"), refused_wait_s=1.0))
    t0 = time.monotonic()
    while time.monotonic() - t0 < 0.2:  # a storm of signs of room
        h.room()
        await asyncio.sleep(0.001)
    assert 1 <= gates.probes <= 0.2 / REFUSED_PAUSE_S + 2
    gates.room = True
    gates.on_sent = busy.cancel  # the result is set; its caller is cancelled before it runs
    h.room()
    with pytest.raises(asyncio.CancelledError):
        await busy
    assert gates.closed == ["stream-busy"]
