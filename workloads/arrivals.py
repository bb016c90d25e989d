"""Arrival processes: homogeneous Poisson, and Poisson with periodic bursts.

Every process draws from an injected ``numpy.random.Generator`` and samples exactly:
inter-arrival gaps are exponential and are NEVER clipped (Vidur clips at 3x the mean, which
raises the realised rate and removes the very bursts a tail-latency study needs).

A piecewise-constant rate is sampled piece by piece, each piece a Poisson process of its own
rate started at the piece's left edge. Poisson processes on disjoint intervals are independent
and exponential gaps are memoryless, so this is the exact inhomogeneous process, not an
approximation.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from fairway.request import WorkloadError


def _check_rate(rate: float, duration_s: float) -> None:
    if not (rate > 0 and math.isfinite(rate)):
        raise WorkloadError(f"rate must be a positive finite number, got {rate!r}")
    if not (duration_s > 0 and math.isfinite(duration_s)):
        raise WorkloadError(f"duration_s must be a positive finite number, got {duration_s!r}")


def poisson_arrivals(
    rng: np.random.Generator, rate: float, duration_s: float, start_s: float = 0.0
) -> np.ndarray:
    """Arrival times of a Poisson process of ``rate``/s on ``[start_s, start_s + duration_s)``.

    Gaps are ``Exponential(mean = 1/rate)``, cumulated from ``start_s``; never clipped.
    Returns a sorted float64 array. O(rate * duration_s).
    """
    _check_rate(rate, duration_s)
    end = start_s + duration_s
    mean = rate * duration_s
    chunk = int(mean + 6.0 * math.sqrt(mean) + 16)  # one draw covers the window almost always
    parts: list[np.ndarray] = []
    t = start_s
    while True:
        times = t + np.cumsum(rng.exponential(1.0 / rate, size=chunk))
        parts.append(times)
        if times[-1] >= end:
            break
        t = float(times[-1])
    out = np.concatenate(parts) if len(parts) > 1 else parts[0]
    return out[out < end]


def piecewise_poisson_arrivals(
    rng: np.random.Generator, pieces: Sequence[tuple[float, float, float]]
) -> np.ndarray:
    """Arrivals of a Poisson process whose rate is constant on each ``(start_s, end_s, rate)``.

    Pieces must be disjoint and sorted; each is sampled with exponential gaps from its start
    (exact, by memorylessness). O(total arrivals).
    """
    parts: list[np.ndarray] = []
    prev_end = -math.inf
    for start, end, rate in pieces:
        if start < prev_end:
            raise WorkloadError("rate pieces must be sorted and disjoint")
        prev_end = end
        if end > start and rate > 0:
            parts.append(poisson_arrivals(rng, rate, end - start, start_s=start))
    return np.concatenate(parts) if parts else np.empty(0)


@dataclass(frozen=True, slots=True)
class BurstSchedule:
    """Periodic windows of transient overload on top of a base Poisson rate.

    Window k covers ``[first_s + k * every_s, first_s + k * every_s + len_s)``; inside it the
    rate is ``factor * base``. ``rate`` stays the *base* rate, so the long-run mean rate is
    ``base * (1 + (factor - 1) * len_s / every_s)`` (1.5x base with the defaults).

    Defaults, and why:
    - ``factor = 4``: at a base utilisation of 0.5-0.7 (a normal operating point), a burst offers
      2-2.8x a replica's capacity, i.e. well past it.
    - ``len_s = 10``: the backlog a burst leaves is (4 * rho - 1) * 10 s = 10-18 s of work, so
      queues build for the whole window and take tens of seconds to drain.
    - ``every_s = 60``: the backlog drains (at 1 - rho of capacity) before the next burst for
      rho up to about 0.6, so each burst is a separate, measurable event.
    - ``first_s = 30``: the first burst hits a warm cache and a steady queue, not a cold start.
    """

    every_s: float = 60.0
    len_s: float = 10.0
    factor: float = 4.0
    first_s: float = 30.0

    def __post_init__(self) -> None:
        if not (self.every_s > 0 and 0 < self.len_s <= self.every_s):
            raise WorkloadError("bursts need every_s > 0 and 0 < len_s <= every_s")
        if not self.factor >= 1.0:
            raise WorkloadError(f"burst factor must be >= 1, got {self.factor!r}")
        if not self.first_s >= 0:
            raise WorkloadError(f"first burst time must be >= 0, got {self.first_s!r}")

    def windows(self, duration_s: float) -> list[tuple[float, float]]:
        """Burst windows ``(start_s, end_s)`` that start before ``duration_s`` (clipped to it)."""
        out: list[tuple[float, float]] = []
        start = self.first_s
        while start < duration_s:
            out.append((start, min(start + self.len_s, duration_s)))
            start += self.every_s
        return out

    def rate_at(self, t: float, base_rate: float) -> float:
        """The instantaneous rate at time ``t``."""
        if t >= self.first_s and (t - self.first_s) % self.every_s < self.len_s:
            return base_rate * self.factor
        return base_rate

    def pieces(self, base_rate: float, duration_s: float) -> list[tuple[float, float, float]]:
        """The schedule as sorted, disjoint ``(start_s, end_s, rate)`` pieces covering the run."""
        out: list[tuple[float, float, float]] = []
        t = 0.0
        for start, end in self.windows(duration_s):
            if start > t:
                out.append((t, start, base_rate))
            out.append((start, end, base_rate * self.factor))
            t = end
        if t < duration_s:
            out.append((t, duration_s, base_rate))
        return out


def bursty_arrivals(
    rng: np.random.Generator, rate: float, duration_s: float, bursts: BurstSchedule
) -> np.ndarray:
    """Arrivals on ``[0, duration_s)``: base Poisson ``rate`` plus ``bursts``. Exact, unclipped."""
    _check_rate(rate, duration_s)
    return piecewise_poisson_arrivals(rng, bursts.pieces(rate, duration_s))
