"""The discrete-event loop: arrivals and engine step ends on one virtual clock.

Events are ``(time, rank, seq, kind, payload)`` heap entries; ``seq`` comes from a counter the
simulation owns, so equal-time events resolve deterministically (docs/design.md, Deterministic
tie-breaks). At one instant, step ends (rank 0) go before arrivals (rank 1), and idle replicas
start a step only once every event of that instant is applied, so simultaneous arrivals share a
batch.

Handlers return the events they cause (Vidur's layout): an arrival returns nothing (it kicks its
replica), a step end returns the follow-up arrivals of a closed-loop workload.

Plain decode steps in bulk: when a replica's step only decodes its running requests and the
next boundaries are plain (``EngineModel.plain_steps``: one more token each, nothing else), the
loop pushes one event for the end of the last of them instead of one per step, and applies the
plain ones (``EngineModel.skip_plain``) when that event comes or, earlier, before a request is
added to that replica. Nothing else reads an engine between events when the router reads none
(its ``reads_engines`` False: the cluster router without flow control, round robin), so every
result is the same to the bit as one event per step (tests/sim/test_plain_steps.py).
"""

from __future__ import annotations

import heapq
import time
from bisect import bisect_left
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from fairway.clock import ManualClock
from fairway.engine.model import EngineModel, EngineRequest
from fairway.request import RequestSpec, Workload
from sim.flow import HELD

STEP_END = 0  # rank 0: completions free memory before same-instant arrivals are admitted
ARRIVAL = 1
INITIAL_ARRIVAL = 2  # an arrival from the workload's initial stream (pulls the next one lazily)
_RANK = {STEP_END: 0, ARRIVAL: 1, INITIAL_ARRIVAL: 1}

Router = Callable[[RequestSpec, list[EngineModel]], int]  # -1: refused (flow control's wait bound), -2: held
REFUSED = "refused: predicted wait beyond the wait bound"
PAST_BOUND = "refused: its wait bound passed (held at the router, or waiting in its replica's queue)"


class round_robin:  # noqa: N801 - called like the function it was
    """The trivial replica choice of a bare ``Simulation``; ``sim.runner`` routes with
    ``sim.cluster.ClusterRouter`` when there is more than one replica. It reads no engine."""

    reads_engines = False

    def __init__(self) -> None:
        self._i = 0

    def __call__(self, spec: RequestSpec, replicas: list[EngineModel]) -> int:  # noqa: ARG002
        j = self._i % len(replicas)
        self._i += 1
        return j


@dataclass(slots=True)
class _Plain:
    """A replica's plain boundaries not yet applied: boundary i at ``times[i]``,
    starting a step of ``dts[i]`` seconds."""

    times: list[float]
    dts: list[float]


@dataclass
class SimResult:
    """Everything a run produced. Invariant (conservation):
    ``n_arrived == len(finished) + len(rejected) + n_unfinished``."""

    finished: list[EngineRequest] = field(default_factory=list)
    rejected: list[EngineRequest] = field(default_factory=list)
    n_arrived: int = 0
    n_unfinished: int = 0
    end_s: float = 0.0
    wall_s: float = 0.0
    busy_s: list[float] = field(default_factory=list)
    preemptions: int = 0
    evictions: int = 0


class Simulation:
    """Run ``workload`` through ``replicas`` (engine models sharing ``clock``)."""

    def __init__(
        self,
        workload: Workload,
        replicas: list[EngineModel],
        clock: ManualClock,
        router: Router | None = None,
        max_time_s: float | None = None,
    ) -> None:
        if not replicas:
            raise ValueError("need at least one replica")
        self.workload = workload
        self.replicas = replicas
        self.clock = clock
        self.router = router or round_robin()
        if hasattr(self.router, "bind"):
            self.router.bind(replicas)  # type: ignore[union-attr]
        self.max_time_s = max_time_s
        self._heap: list[tuple[float, int, int, int, object]] = []
        self._seq = 0
        self._busy = [False] * len(replicas)
        self._initial: Iterator[RequestSpec] = iter(())
        self.result = SimResult()
        self.flow: object | None = None  # request classes: the router's wait-bound check (sim/flow.py)
        # a router that holds requests (sim/flow.py): its held ones are released after each instant
        self._release = getattr(self.router, "release", None) if getattr(self.router, "holds", False) else None
        # plain decode steps in bulk (the module docstring): only where nothing reads an engine
        # between events; per replica, the boundaries not yet applied and its live step end
        self.bulk = not getattr(self.router, "reads_engines", True)
        self._plain: dict[int, _Plain] = {}
        self._live = [-1] * len(replicas)  # seq of each replica's step end event still due

    def _push(self, t: float, kind: int, payload: object) -> int:
        seq = self._seq
        heapq.heappush(self._heap, (t, _RANK[kind], seq, kind, payload))
        self._seq = seq + 1
        return seq

    def _push_next_initial(self) -> None:
        spec = next(self._initial, None)
        if spec is not None:
            self._push(spec.arrival_s, INITIAL_ARRIVAL, spec)

    def on_arrival(self, spec: RequestSpec) -> int:
        """Route and enqueue; return the replica index touched."""
        self.result.n_arrived += 1
        j = self.router(spec, self.replicas)
        if j == HELD:  # the router holds it until a replica has room (``_released``)
            return j
        if j < 0:  # refused by the router's wait bound (sim/flow.py): answered at once
            r = EngineRequest(spec=spec, seq=-1, replica=-1, rejected=REFUSED)
        else:
            if j in self._plain:
                self._settle(j)
            r = self.replicas[j].add(spec)
        if r.rejected:
            self._rejected(r)
        return j

    def _rejected(self, r: EngineRequest) -> None:
        self.result.rejected.append(r)
        for follow in self.workload.on_complete(r.spec, self.clock.now()):
            self._push(follow.arrival_s, ARRIVAL, follow)

    def _released(self, touched: set[int]) -> None:
        """The router's held requests placed now (their replicas join ``touched``), and the
        requests refused because their wait bound passed (held, or waiting at a replica).
        After every instant's events, before idle replicas start a step."""
        placed, expired = self._release(self.replicas)  # type: ignore[misc]
        for spec, j in placed:
            if j in self._plain:
                self._settle(j)
            r = self.replicas[j].add(spec)
            if r.rejected:
                self._rejected(r)
            touched.add(j)
        for spec in expired:
            self._rejected(EngineRequest(spec=spec, seq=-1, replica=-1, rejected=PAST_BOUND))

    def on_step_end(self, j: int) -> list[RequestSpec]:
        self._busy[j] = False
        done = self.replicas[j].finish_step()
        follow: list[RequestSpec] = []
        now = self.clock.now()
        for r in done:
            self.result.finished.append(r)
            follow.extend(self.workload.on_complete(r.spec, now))
        return follow

    def _kick(self, j: int) -> None:
        if self._busy[j]:
            return
        eng = self.replicas[j]
        if not eng.has_work():
            return
        dt = eng.start_step()
        if dt is None:
            return
        self._busy[j] = True
        t = self.clock.now() + dt
        k = eng.plain_steps() if self.bulk else 0
        if not k:
            self._live[j] = self._push(t, STEP_END, j)
            return
        # the plain boundaries' instants, as one event per step would sum them; none past
        # max_time_s (the run stops before it, with that step in flight)
        times: list[float] = []
        dts = eng.plain_step_times(k)
        limit = self.max_time_s
        for d in dts:
            if limit is not None and t > limit:
                break
            times.append(t)
            t = t + d
        del dts[len(times):]
        self._live[j] = self._push(t, STEP_END, j)
        if times:
            self._plain[j] = _Plain(times, dts)

    def _settle(self, j: int) -> None:
        """Before a request is added to replica ``j``: apply its plain boundaries before now,
        and end its bulk: the step in flight now ends at its own boundary's instant, as a step
        end event of its own. A boundary at this very instant ends the step in flight without
        starting the next: the instant's kick starts it, with the new request. O(boundaries
        applied + log)."""
        p = self._plain.pop(j)
        now = self.clock.now()
        m = bisect_left(p.times, now)
        eng = self.replicas[j]
        at_now = m < len(p.times) and p.times[m] == now
        eng.skip_plain(p.dts[:m], finish=at_now)
        if at_now:
            self._busy[j] = False
            self._live[j] = -1
        elif m < len(p.times):
            self._live[j] = self._push(p.times[m], STEP_END, j)

    def _settle_all(self) -> None:
        """Apply every plain boundary left (the run stopped at ``max_time_s``: each is at or
        before it), the clock at the last instant handled, as one event per step leaves it."""
        last = self.clock.now()
        for j, p in self._plain.items():
            self.replicas[j].skip_plain(p.dts)
            last = max(last, p.times[-1])
        self._plain.clear()
        self.clock.set(last)

    def run(self) -> SimResult:
        t0 = time.perf_counter()
        self._initial = iter(self.workload.initial())
        self._push_next_initial()
        heap = self._heap
        live = self._live
        while heap:
            t, _, seq, kind, payload = heap[0]
            if kind == STEP_END and live[payload] != seq:  # type: ignore[index]
                heapq.heappop(heap)  # a bulk's end, settled earlier: no instant of its own
                continue
            if self.max_time_s is not None and t > self.max_time_s:
                break
            self.clock.set(t)
            touched: set[int] = set()
            while heap and heap[0][0] == t:
                _, _, seq, kind, payload = heapq.heappop(heap)
                if kind != STEP_END:
                    if kind == INITIAL_ARRIVAL:
                        self._push_next_initial()
                    touched.add(self.on_arrival(payload))  # type: ignore[arg-type]
                else:
                    j = int(payload)  # type: ignore[arg-type]
                    if live[j] != seq:  # a bulk's end, settled earlier
                        continue
                    p = self._plain.pop(j, None)
                    if p is not None:
                        self.replicas[j].skip_plain(p.dts)
                    for f in self.on_step_end(j):
                        self._push(max(f.arrival_s, t), ARRIVAL, f)
                    touched.add(j)
            if self._release is not None and self.router.pending:  # type: ignore[attr-defined]
                self._released(touched)
            touched.discard(HELD)
            for j in sorted(touched):
                self._kick(j)
        self._settle_all()
        res = self.result
        res.end_s = self.clock.now()
        res.n_unfinished = sum(len(e.reqs) for e in self.replicas) + getattr(self.router, "n_held", 0)
        res.wall_s = time.perf_counter() - t0
        res.busy_s = [e.busy_s for e in self.replicas]
        res.preemptions = sum(e.preemptions for e in self.replicas)
        res.evictions = sum(e.pool.evictions for e in self.replicas)
        return res
