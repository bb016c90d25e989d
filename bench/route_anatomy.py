"""Where a router leaves the prompt's cache, and the shape of its TTFT around the median: one
yardstick point, each router, each seed.

``python -m bench.route_anatomy --point "mooncake-synthetic x3" --routers fairway,llmd --seeds 0,1,2``

Each decision is classed by the engines' true caches when it is made. The match on an engine is
the longest prefix of the prompt it holds, free-but-cached blocks included. The classes:

- *cold*: no engine holds any of the prompt;
- *holder*: sent where at least ``NEAR`` of the longest match is;
- *away*: sent elsewhere.

For each class it prints the count, the blocks it recomputed, and its TTFT median, and how many
decisions were *over-promised* (the router's index matched more of the prompt on the pick than
that engine held: the view's error that costs most, work the router did not price) with the
blocks promised beyond the engine's. Then come the TTFT quantiles from p30 to p99, the mean, the
share under 100 ms and the hit ratio, each a median over seeds. Last, for traces whose requests
arrive in bursts (several at one instant), how the router placed each burst: the *cheap* requests
(under ``CHEAP_TOKENS`` uncached) that share their replica with a *heavy* one (at least
``HEAVY_TOKENS`` uncached) of the same burst, whose first token then waits for a step that carries
the heavy prompt's chunk, and the TTFT medians of each group.

Why: the yardstick's p50 says who is ahead, not whether a gap is a knife edge between the cached
and the uncached mode or a shift of the whole distribution, nor which decisions make it
(docs/history/2026-12-06-mooncake-median-anatomy.md).

Cost: the simulator run, plus O(replicas x prompt blocks) per decision for the engines' matches.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from bench.yardstick import Run, point_named
from fairway.spec import split_specs
from sim.runner import build

#: A pick holding at least this share of the longest match anywhere counts as the holder
NEAR = 0.9
#: The quantiles printed (percent)
QUANTILES = (30, 40, 45, 50, 55, 60, 70, 90, 99)
#: "Fast" first tokens, for the share printed (seconds)
FAST_S = 0.1
CLASSES = ("cold", "holder", "away")
#: A request with fewer uncached prompt tokens is cheap; one with at least HEAVY_TOKENS is heavy
CHEAP_TOKENS, HEAVY_TOKENS = 1024, 4096


def classify(truth: Sequence[int], pick: int, near: float = NEAR) -> str:
    """The class of one decision from each engine's true match (blocks) and the pick. O(replicas)."""
    best = max(truth)
    if best == 0:
        return "cold"
    return "holder" if truth[pick] >= near * best else "away"


@dataclass(slots=True)
class Anatomy:
    """One run's decisions by class and its requests' TTFTs."""

    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(CLASSES, 0))
    recomputed_blocks: dict[str, int] = field(default_factory=lambda: dict.fromkeys(CLASSES, 0))
    ttft_by_class: dict[str, list[float]] = field(default_factory=lambda: {c: [] for c in CLASSES})
    ttft: list[float] = field(default_factory=list)
    hit: float = 0.0
    over_promised: int = 0  # decisions whose index match on the pick exceeded the engine's
    over_blocks: int = 0  # the blocks matched beyond the engine's, summed over those
    # per request: (arrival, pick, uncached tokens, TTFT), for the bursts' table
    placed: list[tuple[float, int, int, float]] = field(default_factory=list)

    def bursts(self) -> dict[str, float] | None:
        """The bursts' table's figures (module docstring), None when no two requests arrive at
        one instant. O(n log n)."""
        if len({arrival for arrival, *_ in self.placed}) == len(self.placed):
            return None
        groups: dict[tuple[float, int], list[tuple[int, float]]] = {}
        for arrival, pick, uncached, ttft in self.placed:
            groups.setdefault((arrival, pick), []).append((uncached, ttft))
        cheap_with, cheap_alone, heavy = [], [], []
        for g in groups.values():
            has_heavy = any(u >= HEAVY_TOKENS for u, _ in g)
            for u, t in g:
                if u < CHEAP_TOKENS:
                    (cheap_with if has_heavy else cheap_alone).append(t)
                elif u >= HEAVY_TOKENS:
                    heavy.append(t)
        cheap = cheap_with + cheap_alone
        return {"cheap": len(cheap), "with_heavy": len(cheap_with) / len(cheap) if cheap else 0.0,
                "p50_with": _median(cheap_with), "p50_alone": _median(cheap_alone), "p50_cheap": _median(cheap),
                "heavy": len(heavy), "p50_heavy": _median(heavy)}

    def quantiles(self) -> dict[str, float]:
        t = np.asarray(self.ttft)
        out = {f"p{q}": float(np.percentile(t, q)) for q in QUANTILES}
        out["mean"] = float(t.mean())
        out["fast_share"] = float((t < FAST_S).mean())
        out["hit"] = self.hit
        return out


def _median(ts: Sequence[float]) -> float:
    """The median, NaN for none (a table cell with no request)."""
    return float(np.median(ts)) if ts else float("nan")


def anatomy(run: Run) -> Anatomy:
    """Run ``run`` in the simulator with every routing decision classed (module docstring)."""
    sim, _ = build(run.config())
    instances = getattr(sim.router, "instances", None)
    if not instances:
        raise ValueError("route anatomy needs a routed cluster (replicas > 1)")
    engines = sim.replicas
    picks: dict[int, tuple[str, int, int, int]] = {}  # request id -> (class, blocks recomputed, over-promised, pick)

    def wrap(host: Any) -> None:
        inner = host.decide

        def decide(rid: int, prompt_tokens: int, hashes: Sequence[int], *args: Any, **kwargs: Any) -> Any:
            d = inner(rid, prompt_tokens, hashes, *args, **kwargs)
            truth = [len(e.pool.longest_hit(hashes)) for e in engines]
            picks[rid] = (classify(truth, d.pick), max(truth) - truth[d.pick], max(0, d.matched_blocks - truth[d.pick]),
                          d.pick)
            return d

        host.decide = decide  # this run's instances only

    for host in instances:
        wrap(host)
    res = sim.run()
    a = Anatomy()
    prompt = cached = 0
    for r in res.finished:
        a.ttft.append(r.ttft_s)
        prompt += r.spec.prompt_tokens
        cached += max(0, r.cached_tokens)
        cls, lost, over, pick = picks[r.rid]  # every request is routed once: a missing one is a bug here
        a.over_promised += over > 0
        a.over_blocks += over
        a.counts[cls] += 1
        a.recomputed_blocks[cls] += lost
        a.ttft_by_class[cls].append(r.ttft_s)
        a.placed.append((r.spec.arrival_s, pick, r.spec.prompt_tokens - max(0, r.cached_tokens), r.ttft_s))
    a.hit = cached / prompt if prompt else 0.0
    return a


def render(point: str, results: dict[str, list[Anatomy]]) -> str:
    """The two tables: decisions by class (summed over seeds), and the quantiles (medians over
    seeds) with the first router's ratio to each other's."""
    lines = [f"{point}: decisions by the engines' true caches (summed over seeds)", "",
             "| router | " + " | ".join(f"{c} n (blocks recomputed), TTFT p50 s" for c in CLASSES)
             + " | over-promised n (blocks) |",
             "| --- |" + " --- |" * (len(CLASSES) + 1)]
    for router, runs in results.items():
        cells = []
        for c in CLASSES:
            n = sum(a.counts[c] for a in runs)
            lost = sum(a.recomputed_blocks[c] for a in runs)
            ts = [t for a in runs for t in a.ttft_by_class[c]]
            cells.append(f"{n} ({lost:,}), {statistics.median(ts):.3f}" if ts else f"{n}")
        cells.append(f"{sum(a.over_promised for a in runs)} ({sum(a.over_blocks for a in runs):,})")
        lines.append(f"| {router} | " + " | ".join(cells) + " |")
    keys = [f"p{q}" for q in QUANTILES] + ["mean", "fast_share", "hit"]
    med = {router: {k: statistics.median(a.quantiles()[k] for a in runs) for k in keys}
           for router, runs in results.items()}
    first = next(iter(med))
    lines += ["", f"TTFT quantiles (s), the mean, the share under {FAST_S * 1000:g} ms and the hit ratio: "
              f"medians over seeds; ratios: {first}'s over each other router's", "",
              "| figure | " + " | ".join(med) + " | " + " | ".join(f"{first} / {r}" for r in list(med)[1:]) + " |",
              "| --- |" + " ---: |" * (2 * len(med) - 1)]
    for k in keys:
        vals = [med[r][k] for r in med]
        ratios = [f"{vals[0] / v:.2f}" if v else "-" for v in vals[1:]]
        lines.append(f"| {k} | " + " | ".join(f"{v:.3f}" for v in vals) + " | " + " | ".join(ratios) + " |")
    bursts = {router: [b for a in runs if (b := a.bursts()) is not None] for router, runs in results.items()}
    if all(bursts.values()):
        lines += ["", f"Bursts (requests arriving at one instant; medians over seeds): the cheap requests (under "
                      f"{CHEAP_TOKENS:,} uncached tokens) placed with a heavy one of their burst (at least "
                      f"{HEAVY_TOKENS:,}), and TTFT medians (s)", "",
                  "| router | cheap n | share with a heavy one | p50 with one | p50 without | p50 of the cheap "
                  "| heavy n | p50 of the heavy |", "| --- |" + " ---: |" * 7]
        for router, bs in bursts.items():
            m = {k: statistics.median(b[k] for b in bs) for k in bs[0]}
            lines.append(f"| {router} | {m['cheap']:.0f} | {m['with_heavy']:.2f} | {m['p50_with']:.3f} | "
                         f"{m['p50_alone']:.3f} | {m['p50_cheap']:.3f} | {m['heavy']:.0f} | {m['p50_heavy']:.3f} |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.route_anatomy", description=__doc__.splitlines()[0])
    ap.add_argument("--point", required=True, help="a yardstick point's label, e.g. 'mooncake-synthetic x3'")
    ap.add_argument("--routers", default="fairway,llmd", help="router specs; ratios: the first's over each other's")
    ap.add_argument("--seeds", default="0")
    ap.add_argument("--view", default="approx", choices=("approx", "lru", "events"))
    args = ap.parse_args(argv)
    try:
        point = point_named(args.point)
    except ValueError as e:
        ap.error(str(e))
    results: dict[str, list[Anatomy]] = {}
    for router in split_specs(args.routers):
        for seed in (int(s) for s in split_specs(args.seeds)):
            print(f"{args.point} {router} seed {seed} ...", file=sys.stderr)
            results.setdefault(router, []).append(anatomy(Run(point, router, args.view, seed)))
    print(render(args.point, results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
