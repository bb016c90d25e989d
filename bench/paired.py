"""Is a candidate router's difference from a baseline larger than the noise of the requests?
One yardstick point, two router specs, the same requests, a paired bootstrap.

``python -m bench.paired --point "mooncake-synthetic x2" --base fairway --candidate "fairway[extra_work_weight=1]"``
(a point on a trace outside the shared folder needs ``FAIRWAY_TRACE_DIR``, as for the yardstick)

Both runs replay the same request stream (the point, view and seed fix it), so each request has
a TTFT under each router. The ratio of a figure (p50, p99, mean) is the candidate's over the
base's. Its interval comes from a paired bootstrap: draw the requests with replacement, take
the figure of the same draw under both routers, and read the ratio's quantiles over the draws.
The table also gives the share of draws whose ratio is above a threshold (``--above``, 1.05 by
default, the yardstick's per-point bound).

Why: on a trace of 1,000 requests the p99 is about the 10th-slowest request, so one request
placed differently moves it by 10% while the mean does not move
(docs/history/2026-12-08-seeds-and-small-traces.md). On a trace point the replay is
deterministic: its seed changes neither arrivals nor sizes, so more seeds give no new sample of a
deterministic router. The requests themselves are the sample, and this is their spread. The
draws treat the requests as independent, which they are not (they queue behind one another):
the interval is the figure's spread over these requests, not over other traffic.

Cost: the two simulator runs, then O(boot x requests) for the draws, in blocks of ``BLOCK``
draws so memory stays O(BLOCK x requests).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from bench.yardstick import Run, point_named, registered
from sim.runner import build

#: Draws per block of the bootstrap (bounds its memory)
BLOCK = 256
#: The figures compared, each a function of one row of TTFTs (seconds)
FIGURES: dict[str, Callable[[np.ndarray], np.ndarray]] = {
    "p50": lambda a: np.percentile(a, 50, axis=-1),
    "p99": lambda a: np.percentile(a, 99, axis=-1),
    "mean": lambda a: a.mean(axis=-1),
}


@dataclass(frozen=True, slots=True)
class PairedRatio:
    """One figure's candidate / base ratio on the full sample, its bootstrap interval at
    ``level``, and the share of draws above ``threshold``."""

    figure: str
    base: float
    candidate: float
    ratio: float
    low: float
    high: float
    above: float
    threshold: float
    level: float


def ttfts(run: Run) -> dict[int, float]:
    """Each finished request's TTFT by request id, from one simulator run."""
    sim, _ = build(run.config())
    res = sim.run()
    return {r.spec.rid: r.ttft_s for r in res.finished}


def pair(base: dict[int, float], candidate: dict[int, float]) -> tuple[np.ndarray, np.ndarray]:
    """The two runs' TTFTs aligned by request id. Both runs finish the same requests (the
    simulator loses none); a difference is refused, naming a few ids, rather than compared
    over a subset."""
    if base.keys() != candidate.keys():
        only = sorted(base.keys() ^ candidate.keys())
        raise ValueError(f"the runs finished different requests ({len(only)} differ, e.g. {only[:5]})")
    ids = sorted(base)
    return np.array([base[i] for i in ids]), np.array([candidate[i] for i in ids])


def check_draws(boot: int, level: float) -> None:
    """The bootstrap's settings, checked before any run (a ValueError names them)."""
    if boot < 1 or not 0 < level < 1:
        raise ValueError("boot must be >= 1 and level in (0, 1)")


def paired_ratios(base: np.ndarray, candidate: np.ndarray, rng: np.random.Generator, boot: int = 2000,
                  level: float = 0.9, threshold: float = 1.05) -> list[PairedRatio]:
    """Every figure of ``FIGURES``: the ratio and its paired-bootstrap interval (module docstring).
    O(boot x n)."""
    if base.shape != candidate.shape or base.ndim != 1 or base.size == 0:
        raise ValueError("base and candidate must be equal-length, non-empty 1-D arrays of TTFTs")
    check_draws(boot, level)
    n = base.size
    draws: dict[str, list[np.ndarray]] = {f: [] for f in FIGURES}
    for start in range(0, boot, BLOCK):
        idx = rng.integers(0, n, size=(min(BLOCK, boot - start), n))
        b, c = base[idx], candidate[idx]
        for f, fn in FIGURES.items():
            draws[f].append(fn(c) / fn(b))
    out = []
    tail = (1 - level) / 2
    for f, fn in FIGURES.items():
        r = np.concatenate(draws[f])
        fb, fc = float(fn(base)), float(fn(candidate))
        lo, hi = np.quantile(r, [tail, 1 - tail])
        out.append(PairedRatio(f, fb, fc, fc / fb, float(lo), float(hi), float((r > threshold).mean()),
                               threshold, level))
    return out


def render(label: str, base: str, candidate: str, n: int, rows: Sequence[PairedRatio]) -> str:
    """The table: one line per figure."""
    lvl = f"{rows[0].level:.0%}"
    th = f"{rows[0].threshold:g}"
    lines = [f"{label}, {n:,} requests paired: {candidate} / {base}", "",
             f"| figure | {base} s | {candidate} s | ratio | {lvl} interval | share of draws above {th} |",
             "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        lines.append(f"| {r.figure} | {r.base:.3f} | {r.candidate:.3f} | {r.ratio:.3f} | "
                     f"{r.low:.3f} - {r.high:.3f} | {r.above:.2f} |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.paired", description=__doc__.splitlines()[0])
    ap.add_argument("--point", required=True, help="a yardstick point's label, e.g. 'mooncake-toolagent x2'")
    ap.add_argument("--base", default="fairway", help="the baseline router spec")
    ap.add_argument("--candidate", required=True, help="the candidate router spec")
    ap.add_argument("--view", default="approx", choices=("approx", "lru", "events"))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--boot", type=int, default=2000, help="bootstrap draws")
    ap.add_argument("--level", type=float, default=0.9, help="the interval's coverage")
    ap.add_argument("--above", type=float, default=1.05, help="report the share of draws above this ratio")
    ap.add_argument("--boot-seed", type=int, default=0, help="the bootstrap's RNG seed")
    args = ap.parse_args(argv)
    try:
        check_draws(args.boot, args.level)
    except ValueError as e:
        ap.error(str(e))
    unknown = registered([args.base, args.candidate])[1]
    if unknown:
        ap.error(f"not a router spec this build can make: {', '.join(unknown)}")
    try:
        point = point_named(args.point)
    except ValueError as e:
        ap.error(str(e))
    b, c = (ttfts(Run(point, spec, args.view, args.seed)) for spec in (args.base, args.candidate))
    xb, xc = pair(b, c)
    rows = paired_ratios(xb, xc, np.random.default_rng(args.boot_seed), args.boot, args.level, args.above)
    print(render(f"{point.label} ({args.view}, seed {args.seed})", args.base, args.candidate, xb.size, rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
