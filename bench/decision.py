"""Micro-benchmark: time of one policy decision with N requests waiting.

``python -m bench.decision [--waiting 1000] [--policies fairway,fcfs,...]`` prints the median
and p99 of ``select()`` and of a full decision cycle (``select`` + ``admit`` + one ``add`` to keep
the queue at N), over requests with random prompt lengths and cached prefixes, cache events
included (each cycle stores 4 blocks, which moves some waiting requests' hits).

``python -m bench.decision --held 10000`` times the router's held queue
(``fairway/routing/held.py``) instead: N requests held in two classes (20% ``interactive``, tier
0; 80% ``batch``, tier 1; Fairway within each), and per cycle the decision which one goes next
(``head``), its send (``take``) and one new request held (``hold``), so the queue stays at N.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import TypeVar

import numpy as np

from fairway.clock import ManualClock
from fairway.cost_model import DEFAULT_PROFILE, CostModel
from fairway.policies import QueuedRequest, QueuePolicy, make_policy

T = TypeVar("T")


def _requests(rng: np.random.Generator, n: int, start: int) -> list[QueuedRequest]:
    out = []
    for i in range(start, start + n):
        fam = int(rng.integers(0, 50))
        blocks = int(rng.integers(8, 512))
        hashes = [fam * 10_000_000 + b for b in range(blocks)]
        out.append(QueuedRequest(i, float(i) * 0.01, blocks * 16 + 5, hashes, seq=i))
    return out


def measure(policy: str, waiting: int, cycles: int, seed: int = 0) -> dict[str, float]:
    rng = np.random.default_rng(seed)
    clock = ManualClock()
    cached: set[int] = set()
    for fam in range(50):  # each family has a random cached prefix
        cached.update(fam * 10_000_000 + b for b in range(int(rng.integers(0, 256))))
    p: QueuePolicy = make_policy(policy, clock=clock, cost=CostModel.from_profile(DEFAULT_PROFILE))
    p.attach_cache(cached.__contains__)
    for r in _requests(rng, waiting, 0):
        p.add(r)
    fresh = iter(_requests(rng, cycles, waiting))

    def rest(k: int, r: QueuedRequest) -> None:  # admit, keep the queue at N, 4 cache events
        p.admit(r.rid)
        p.add(next(fresh))
        fam = int(rng.integers(0, 50))
        new = [fam * 10_000_000 + 256 + k % 64 * 4 + j for j in range(4)]
        cached.update(new)
        p.on_blocks_stored(new)
        p.on_step(8192)

    return timed_cycles(cycles, lambda: clock.advance(0.02), p.select, rest)


def timed_cycles(cycles: int, tick: Callable[[], None], decide: Callable[[], T | None],
                 rest: Callable[[int, T], None]) -> dict[str, float]:
    """``cycles`` of ``tick()``, the timed decision ``decide()`` and the rest of the cycle
    ``rest(k, decision)``: the median and p99, in microseconds, of the decision alone and of the
    whole cycle."""
    sel, full = [], []
    for k in range(cycles):
        tick()
        t0 = time.perf_counter_ns()
        x = decide()
        t1 = time.perf_counter_ns()
        assert x is not None
        rest(k, x)
        t2 = time.perf_counter_ns()
        sel.append(t1 - t0)
        full.append(t2 - t0)
    s, f = np.array(sel) / 1e3, np.array(full) / 1e3
    return {
        "select_p50_us": float(np.median(s)),
        "select_p99_us": float(np.percentile(s, 99)),
        "cycle_p50_us": float(np.median(f)),
        "cycle_p99_us": float(np.percentile(f, 99)),
    }


CLASSES = "interactive:tier=0:objective=1,batch:tier=1:objective=30"


def measure_held(held: int, cycles: int, seed: int = 0, inner: str = "fairway") -> dict[str, float]:
    """The held queue's decision at ``held`` requests (module docstring)."""
    from fairway.policies.classes import ClassesConfig
    from fairway.routing.held import HeldQueue

    rng = np.random.default_rng(seed)
    clock = ManualClock()
    q = HeldQueue(clock, CostModel.from_profile(DEFAULT_PROFILE), ClassesConfig.parse(CLASSES), inner=inner,
                  max_held=held + 1)

    def hold(rid: int) -> None:
        q.hold(rid, int(rng.integers(128, 8192)), "interactive" if rng.random() < 0.2 else "batch")

    for rid in range(held):
        clock.advance(0.001)
        hold(rid)

    def rest(k: int, rid: int) -> None:  # sent: it leaves, one more is held
        q.take(rid)
        hold(held + k)

    return timed_cycles(cycles, lambda: clock.advance(0.002), q.head, rest)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--waiting", type=int, default=1000)
    ap.add_argument("--cycles", type=int, default=2000)
    ap.add_argument("--policies", default="fairway,fcfs,lpm,hrrn,k-lpm,lpm-aging,vllm-sjf,srpt-oracle,dfs-weight")
    ap.add_argument("--held", type=int, default=0, help="time the router's held queue at this many held requests "
                                                         "(two classes), with --policies as the order within a class")
    args = ap.parse_args()
    if args.held:
        print(f"{'within a class':<14} {'head p50':>11} {'head p99':>11} {'cycle p50':>10} {'cycle p99':>10}"
              f"  (us, {args.held} held, classes {CLASSES})")
        for name in args.policies.split(","):
            m = measure_held(args.held, args.cycles, inner=name)
            print(f"{name:<14} {m['select_p50_us']:>11.1f} {m['select_p99_us']:>11.1f} "
                  f"{m['cycle_p50_us']:>10.1f} {m['cycle_p99_us']:>10.1f}")
        return
    head = f"{'policy':<14} {'select p50':>11} {'select p99':>11} {'cycle p50':>10} {'cycle p99':>10}"
    print(f"{head}  (us, {args.waiting} waiting)")
    for name in args.policies.split(","):
        m = measure(name, args.waiting, args.cycles)
        print(f"{name:<14} {m['select_p50_us']:>11.1f} {m['select_p99_us']:>11.1f} "
              f"{m['cycle_p50_us']:>10.1f} {m['cycle_p99_us']:>10.1f}")


if __name__ == "__main__":
    main()
