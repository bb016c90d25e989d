"""How fast a replica's engine works off its queued prefill: the gate's wait estimate.

Why: the queue's bound must be a wait an operator can state (wall seconds a request may wait
before it enters the engine), but the queue's work is known in the cost model's seconds, the
time an H200 takes to prefill each request alone. A real engine also decodes, shares every step
with the running requests, and may be slower or faster than the profile, so a queue's cost-model
seconds can take several times as long to work off. So the ratio is measured: ``DrainRate`` is
the cost-model prefill seconds the gate admitted out of a backlog per wall second while requests
were waiting (busy), and the estimated wait of the queue is its work divided by that rate.

Admissions, not first tokens, are the measure: the gate admits only as the engine makes room
(slots, one step of unprefilled tokens, KV memory), so admissions out of a backlog are the pace
at which the queue is worked off, the very wait being estimated; and a long prefill counts when
it enters, not after seconds in which nothing seemed to finish (which would read as a slow
engine and refuse requests for nothing).

Admissions come in lumps, so the rate is kept per interval: the busy seconds between two
admission instants out of a backlog and the work admitted at the second are one sample, added to
two sums when the interval closes, the older samples first decayed by the interval's busy time
(half-life ``half_life_s``). The rate is the ratio of the sums, so at a steady pace it reads that
pace at every instant, whatever the spacing of the admissions and whenever the gate looks. The
interval still open counts only once it outlasts the mean closed interval: up to then an
admission is not yet due, beyond it every busy second without one is evidence of a slower
engine (a stalled one reads the floor). A prior of ``prior`` (1.0: the cost model is right)
counts as ``prior_weight_s`` of busy time, so a replica that has measured nothing trusts the
cost model, and one that has been busy for a few seconds trusts itself. While nothing waits, the
sums decay by wall time too (half-life ``idle_half_life_s``), so the rate returns to the prior:
what a replica measured is the pace of the mix it was working off then (decode-heavy steps
admit less prefill a second), and kept through an idle spell it would make an equal replica look
slow to the next burst; a replica that is really slow shows it again within a second or two of
backlog.

Complexity: O(1) per call; five floats of state.
"""

from __future__ import annotations

import math


class DrainRate:
    """Cost-model prefill seconds admitted per busy wall second (see the module docstring).

    Invariants: ``rate() > 0``; the sums and the open interval are >= 0.
    """

    __slots__ = ("half_life_s", "idle_half_life_s", "prior", "prior_weight_s", "floor", "_work", "_busy", "_count",
                 "_open", "_last", "_was_busy")

    def __init__(self, half_life_s: float = 5.0, prior: float = 1.0, prior_weight_s: float = 1.0,
                 floor: float = 0.01, idle_half_life_s: float = 5.0) -> None:
        if not (half_life_s > 0 and prior > 0 and prior_weight_s > 0 and floor > 0 and idle_half_life_s > 0):
            raise ValueError("half_life_s, prior, prior_weight_s, floor and idle_half_life_s must be > 0")
        self.half_life_s = half_life_s
        self.idle_half_life_s = idle_half_life_s
        self.prior = prior
        self.prior_weight_s = prior_weight_s
        self.floor = floor
        self._work = 0.0  # decayed cost-model seconds admitted out of a backlog, closed intervals
        self._busy = 0.0  # decayed busy wall seconds of the closed intervals
        self._count = 0.0  # decayed number of closed intervals (their mean is _busy / _count)
        self._open = 0.0  # busy seconds since the last admission out of a backlog
        self._last: float | None = None
        self._was_busy = False

    def observe(self, now: float, busy: bool) -> None:
        """Account the time since the last call (busy if requests were waiting then: the open
        interval grows; else idle: everything decays toward the prior) and record whether
        requests wait from ``now`` on."""
        if self._last is not None and now > self._last:
            dt = now - self._last
            if self._was_busy:
                self._open += dt
            else:
                keep = math.exp2(-dt / self.idle_half_life_s)
                self._work *= keep
                self._busy *= keep
                self._count *= keep
                self._open *= keep
        self._last = now
        self._was_busy = busy

    def took(self, now: float, work_s: float) -> None:
        """The gate admitted a request of ``work_s`` cost-model seconds of prefill at ``now``. Counted
        only out of a backlog: a request admitted at once is paced by the arrivals, not the engine.
        The first admission at an instant closes the open interval; the others at the same instant
        add their work to it."""
        self.observe(now, self._was_busy)
        if not self._was_busy:
            return
        if self._open > 0.0:
            keep = math.exp2(-self._open / self.half_life_s)
            self._work *= keep
            self._busy = self._busy * keep + self._open
            self._count = self._count * keep + 1.0
            self._open = 0.0
        self._work += max(0.0, work_s)

    def rate(self) -> float:
        """Cost-model seconds of queued prefill the engine works off per wall second."""
        w0 = self.prior_weight_s
        overdue = self._open - (self._busy / self._count if self._count > 0.0 else 0.0)
        return max(self.floor, (self._work + self.prior * w0) / (self._busy + w0 + max(0.0, overdue)))

    def wait_s(self, queued_work_s: float) -> float:
        """Estimated wall seconds to work off ``queued_work_s`` cost-model seconds of queue."""
        return queued_work_s / self.rate()
