"""Flow control in the simulator: a class mix on any workload, the router's wait-bound check, and
the per-class summary (docs/design.md, Flow control).

- ``ClassMix`` (``workloads/class_mix.py``, shared with the load generator) labels each request of
  a workload with a class drawn from a mix.
- ``FlowControl`` is the router-side admission the issue asks for, as far as the simulator
  models it: a request goes to the router's pick when that replica's predicted wait for its class
  (``QueuePolicy.work_ahead_s``: the queued prefill seconds its queue order puts ahead of it) is
  within the class's wait bound; otherwise, with ``retry``, to the next replica in the router's
  ranking that has room; otherwise it is refused at once (answered, as a 429 would be). Every
  refusal made while some replica had room is counted (``refused_with_room``; target 0). With
  ``bounds="gate"`` every request has the gate's bound instead of its class's, on all the
  replica's queued work, and ``retry=False`` refuses a request its pick refuses.
- With ``hold`` (the product's router, ``router/hold.py``), a replica has room when the work ahead
  of the request there is within the gates' bound (``gate_wait_s``, as each live gate checks
  it); a request no replica has room for is held in the core's ``HeldQueue`` (the class policy's
  order) unless the shortest predicted wait already passes its wait bound (its class's, or
  ``hold_s`` with ``bounds="gate"``) less ``gate_wait_s``, and is placed by ``release``, which the
  simulation calls after every instant's events (where the live ingress probes at first tokens,
  finishes and every ``poll_s``); a held request whose bound less ``gate_wait_s`` passes is
  refused then. While any request is held, new ones join the held queue, but for those whose
  bound leaves no time to hold them (a bound at or under the gates'): they are placed where a
  replica has room, or refused. With classes (``bounds="class"``) a placed request still waiting
  in its replica's queue when its class's bound passes is taken out and refused (``shed``), as
  each live gate answers it 429 (``PastWaitBound``).

Complexity: ``place`` O(N) ``work_ahead_s`` calls at worst (each O(n) in the replica's queue),
one on the common path; ``release`` one ``HeldQueue.head`` and one routing decision per request
placed, plus one for the head that finds no room.
"""

from __future__ import annotations

import heapq
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any, Literal

import numpy as np

from fairway.clock import Clock
from fairway.cost_model import CostModel
from fairway.engine.model import EngineModel, EngineRequest
from fairway.policies.classes import ClassesConfig
from fairway.request import RequestSpec
from fairway.routing.held import HeldQueue
from fairway.summary import pct, short_pct

#: ``FlowControl.place``'s answer for a request it holds
HELD = -2


class FlowControl:
    """The router's wait-bound check, its held queue, and their counters (module docstring)."""

    def __init__(self, classes: ClassesConfig, bounds: Literal["class", "gate"] = "class",
                 gate_wait_s: float = 5.0, retry: bool = True, hold: bool = False, hold_s: float = 10.0,
                 clock: Clock | None = None, cost: CostModel | None = None, inner: str = "fairway") -> None:
        self.classes = classes
        self.bounds = bounds
        self.gate_wait_s = gate_wait_s
        self.retry = retry
        self.hold = hold
        self.hold_s = hold_s
        self.refused: Counter[str] = Counter()
        self.refused_with_room = 0
        self.retried = 0
        self.held: HeldQueue | None = None
        if hold:
            if clock is None or cost is None:
                raise ValueError("a held queue needs the simulation's clock and cost model")
            self.clock = clock
            self.held = HeldQueue(clock, cost, classes if bounds == "class" else ClassesConfig(), inner=inner)
        self._specs: dict[int, RequestSpec] = {}  # held rid -> its request
        self._deadlines: list[tuple[float, int]] = []  # (hold end, rid), lazily cleaned
        self.hold_times: list[float] = []  # seconds each placed held request was held
        self.hold_timeouts = 0
        self._placed: list[tuple[float, int, int]] = []  # (bound, rid, replica) of placed requests; heap
        self.shed = 0  # placed requests refused at their bound, still waiting in a replica's queue

    def bound_s(self, spec: RequestSpec) -> float:
        """The request's wait bound: the gate's (``bounds="gate"``: with a held queue, ``hold_s``)
        or its class's."""
        if self.bounds == "gate":
            return self.hold_s if self.hold else self.gate_wait_s
        return self.classes.spec(spec.priority_class).wait_bound_s

    def room_s(self, spec: RequestSpec) -> float:
        """The predicted wait under which a replica takes ``spec``: the gates' bound with a held
        queue, else the request's own bound."""
        return self.gate_wait_s if self.hold else self.bound_s(spec)

    def wait_s(self, engine: EngineModel, spec: RequestSpec) -> float:
        """The predicted wait of ``spec`` on ``engine``: its queue's work ahead of the request's
        class, or all of it (``bounds="gate"``, as today's gate counts)."""
        if self.bounds == "gate":
            return engine.policy.queued_prefill_s()
        return engine.policy.work_ahead_s(spec.priority_class)

    def first_with_room(self, spec: RequestSpec, engines: Sequence[EngineModel], order: Sequence[int]) -> int:
        """The first replica of ``order`` with room for ``spec`` (only the pick without
        ``retry``), or -1."""
        room = self.room_s(spec)
        for k, j in enumerate(order if self.retry else order[:1]):
            if self.wait_s(engines[j], spec) <= room:
                self.retried += k > 0
                return j
        return -1

    def place(self, spec: RequestSpec, engines: Sequence[EngineModel], order: Sequence[int]) -> int:
        """The replica for ``spec``: the first of ``order`` (the router's preference, its pick
        first) with room, only the pick without ``retry``; ``HELD``: held; -1: refused."""
        if self.held is not None and len(self.held) and self.can_hold(spec):  # others are held: it queues
            return self._hold(spec, None)
        j = self.first_with_room(spec, engines, order)
        if j >= 0:
            return j
        if self.held is not None:
            return self._hold(spec, min(self.wait_s(e, spec) for e in engines))
        return self._refuse(spec, engines)

    def _count_refusal(self, spec: RequestSpec) -> None:
        self.refused[self.classes.resolve(spec.priority_class)] += 1

    def _refuse(self, spec: RequestSpec, engines: Sequence[EngineModel]) -> int:
        self._count_refusal(spec)
        room = self.room_s(spec)
        if any(self.wait_s(e, spec) <= room for e in engines):
            self.refused_with_room += 1
        return -1

    def hold_end_s(self, spec: RequestSpec) -> float:
        """When ``spec``'s hold would end: its bound less the gates' (then at most that at a gate)."""
        return spec.arrival_s + self.bound_s(spec) - self.gate_wait_s

    def can_hold(self, spec: RequestSpec) -> bool:
        """Whether ``spec``'s bound leaves time to hold it; one that does not is never held (it goes
        where a replica has room, else it is refused), so it does not queue behind held ones."""
        return self.clock.now() < self.hold_end_s(spec)

    def _hold(self, spec: RequestSpec, predicted_s: float | None) -> int:
        """Hold ``spec`` (module docstring), or refuse it. O(1) plus the held queue's add."""
        assert self.held is not None
        now = self.clock.now()
        end = self.hold_end_s(spec)
        late = predicted_s is not None and now + max(predicted_s - self.gate_wait_s, 0.0) > end
        if late or now >= end or not self.held.hold(spec.rid, spec.prompt_tokens, spec.priority_class):
            self._count_refusal(spec)
            return -1
        self._specs[spec.rid] = spec
        heapq.heappush(self._deadlines, (end, spec.rid))
        return HELD

    @property
    def n_held(self) -> int:
        return 0 if self.held is None else len(self.held)

    @property
    def pending(self) -> bool:
        """Requests held, or placed with a class bound still to watch."""
        return bool(self._placed) or self.n_held > 0

    def placed(self, spec: RequestSpec, replica: int) -> None:
        """``spec`` went to ``replica``: with classes and a held queue, it is shed there if still
        waiting at its class's bound (``release``). O(log n)."""
        if self.held is not None and self.bounds == "class":
            heapq.heappush(self._placed, (spec.arrival_s + self.bound_s(spec), spec.rid, replica))

    def release(self, route: Callable[[RequestSpec], int],
                engines: Sequence[EngineModel] = ()) -> tuple[list[tuple[RequestSpec, int]], list[RequestSpec]]:
        """The held requests to place now, in the held queue's order, with their replicas
        (``route(spec)``: the router's pick with room, booked, or -1 when none has room, which
        ends the round), and those refused: their hold ended, or (``engines``) they waited in a
        replica's queue past their class's bound, where they are aborted."""
        assert self.held is not None
        now = self.clock.now()
        expired = []
        while self._placed and self._placed[0][0] <= now:
            _, rid, j = heapq.heappop(self._placed)
            if j < len(engines) and rid in engines[j].policy:  # still waiting there, unadmitted
                spec = engines[j].reqs[rid].spec
                engines[j].abort(rid)
                self._count_refusal(spec)
                self.shed += 1
                expired.append(spec)
        while self._deadlines and self._deadlines[0][0] <= now:
            _, rid = heapq.heappop(self._deadlines)
            if rid in self.held:
                self.held.drop(rid)
                spec = self._specs.pop(rid)
                self._count_refusal(spec)
                self.hold_timeouts += 1
                expired.append(spec)
        placed = []
        while (rid := self.held.head()) is not None:
            spec = self._specs[rid]
            j = route(spec)
            if j < 0:
                break
            self.hold_times.append(self.held.take(rid))
            del self._specs[rid]
            placed.append((spec, j))
        return placed, expired


def flow_summary(finished: Sequence[EngineRequest], rejected: Sequence[EngineRequest],
                 classes: ClassesConfig, flow: FlowControl | None) -> dict[str, Any]:
    """Per class: arrivals, finishes, refusals, TTFT p50/p99, objective attainment (met / arrived,
    a refusal counting as a miss), goodput (met per second of arrivals) and how many finished
    requests waited past the class's wait bound for their first token; plus the refusals made
    while a replica had room. O(n log n)."""
    arrivals = [r.spec.arrival_s for r in finished] + [r.spec.arrival_s for r in rejected]
    span = max(arrivals) - min(arrivals) if len(arrivals) > 1 else 0.0
    ttft: dict[str, list[float]] = {c: [] for c in classes.names}
    n_rej: Counter[str] = Counter(classes.resolve(r.spec.priority_class) for r in rejected)
    for r in finished:
        ttft[classes.resolve(r.spec.priority_class)].append(r.ttft_s)
    per: dict[str, Any] = {}
    for c in classes.classes:
        t = np.asarray(ttft[c.name], dtype=float)
        arrived = len(t) + n_rej[c.name]
        met = int(np.count_nonzero(t <= c.objective_s))
        per[c.name] = {
            "arrived": arrived, "finished": len(t), "refused": n_rej[c.name],
            "ttft_s": short_pct(pct(t)), "objective_s": c.objective_s, "wait_bound_s": c.wait_bound_s,
            "attainment": met / arrived if arrived else 1.0,
            "goodput_rps": met / span if span else 0.0,
            "over_bound": int(np.count_nonzero(t > c.wait_bound_s)),
        }
    out: dict[str, Any] = {"classes": per}
    if flow is not None:
        out.update(bounds=flow.bounds, retry=flow.retry, refused_with_room=flow.refused_with_room,
                   retried=flow.retried)
        if flow.held is not None:
            out.update(held=len(flow.hold_times), hold_s=short_pct(pct(np.asarray(flow.hold_times, dtype=float))),
                       hold_timeouts=flow.hold_timeouts, shed=flow.shed)
    return out


__all__ = ["HELD", "FlowControl", "flow_summary"]
