"""The one clock protocol every policy takes, injected so the same policy code runs on the
simulator's virtual time and on the wall clock (docs/design.md, Injected clock and RNG)."""

from __future__ import annotations

import time
from typing import Protocol


class Clock(Protocol):
    """Anything with ``now() -> seconds`` (monotonic, never decreasing)."""

    def now(self) -> float: ...


class MonotonicClock:
    """Wall clock for live hosts (the replica gate and the Ray Serve router)."""

    __slots__ = ()

    def now(self) -> float:
        return time.monotonic()


class ManualClock:
    """A clock that only moves when told to: the simulator's virtual time and tests' clock."""

    __slots__ = ("_t",)

    def __init__(self, t: float = 0.0) -> None:
        self._t = float(t)

    def now(self) -> float:
        return self._t

    def set(self, t: float) -> None:
        if t < self._t:
            raise ValueError(f"clock cannot go back: {t} < {self._t}")
        self._t = float(t)

    def advance(self, dt: float) -> None:
        self.set(self._t + dt)
