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

The rate is a ratio of two exponentially decayed sums, the work admitted and the busy time,
decayed by busy time (half-life ``half_life_s``): a busy replica follows a change of workload
within a few half-lives. The busy sum is the exact integral of the decay over each busy span, so
the rate is a function of the admissions and of when requests waited, not of how often the gate
happens to look. A prior of ``prior`` (1.0: the cost model is right) counts as
``prior_weight_s`` of busy time, so a replica that has measured nothing trusts the cost model,
and one that has been busy for a few seconds trusts itself. While nothing waits, both sums decay
by wall time too (half-life ``idle_half_life_s``), so the rate returns to the prior: what a
replica measured is the pace of the mix it was working off then (decode-heavy steps admit less
prefill a second), and kept through an idle spell it would make an equal replica look slow to
the next burst; a replica that is really slow shows it again within a second or two of backlog.

Complexity: O(1) per call; two floats of state.
"""

from __future__ import annotations

import math

LN2 = math.log(2.0)


class DrainRate:
    """Cost-model prefill seconds admitted per busy wall second (see the module docstring).

    Invariants: ``rate() > 0``; the decayed sums are >= 0.
    """

    __slots__ = ("half_life_s", "idle_half_life_s", "prior", "prior_weight_s", "floor", "_work", "_busy", "_last",
                 "_was_busy")

    def __init__(self, half_life_s: float = 5.0, prior: float = 1.0, prior_weight_s: float = 1.0,
                 floor: float = 0.01, idle_half_life_s: float = 5.0) -> None:
        if not (half_life_s > 0 and prior > 0 and prior_weight_s > 0 and floor > 0 and idle_half_life_s > 0):
            raise ValueError("half_life_s, prior, prior_weight_s, floor and idle_half_life_s must be > 0")
        self.half_life_s = half_life_s
        self.idle_half_life_s = idle_half_life_s
        self.prior = prior
        self.prior_weight_s = prior_weight_s
        self.floor = floor
        self._work = 0.0  # decayed cost-model seconds admitted out of a backlog
        self._busy = 0.0  # decayed busy wall seconds
        self._last: float | None = None
        self._was_busy = False

    def observe(self, now: float, busy: bool) -> None:
        """Account the time since the last call (busy if requests were waiting then, else idle:
        both sums decay toward the prior) and record whether requests wait from ``now`` on."""
        if self._last is not None and now > self._last:
            dt = now - self._last
            if self._was_busy:
                x = -dt * LN2 / self.half_life_s
                keep = math.exp(x)
                self._work *= keep
                # the span's busy seconds, each decayed from its instant to now: integral of
                # 2^(-(now - t) / h) over the span = (1 - keep) * h / ln 2 (expm1 keeps it exact
                # for spans far shorter than the half-life)
                self._busy = self._busy * keep - math.expm1(x) * self.half_life_s / LN2
            else:
                keep = math.exp2(-dt / self.idle_half_life_s)
                self._work *= keep
                self._busy *= keep
        self._last = now
        self._was_busy = busy

    def took(self, now: float, work_s: float) -> None:
        """The gate admitted a request of ``work_s`` cost-model seconds of prefill at ``now``. Counted
        only out of a backlog: a request admitted at once is paced by the arrivals, not the engine."""
        self.observe(now, self._was_busy)
        if self._was_busy:
            self._work += max(0.0, work_s)

    def rate(self) -> float:
        """Cost-model seconds of queued prefill the engine works off per wall second."""
        w0 = self.prior_weight_s
        return max(self.floor, (self._work + self.prior * w0) / (self._busy + w0))

    def wait_s(self, queued_work_s: float) -> float:
        """Estimated wall seconds to work off ``queued_work_s`` cost-model seconds of queue."""
        return queued_work_s / self.rate()
