"""The yardstick: the Fairway router against every faithful anchor, point by point.

``python -m bench.yardstick [--seeds 0,1,2] [--views approx,events] [--points all] [--jobs 2]``
runs every router in ``ROUTERS`` over the shared workloads and loads (``POINTS``, plus the real
traces found on disk) in the 8-replica simulator, Fairway replicas under every router, and prints
per point: Fairway's p50 / p99 / hit ratio, the best faithful anchor for each metric (each the
median over seeds), the ratios, and the hit bound of an infinite cache. The last lines are the
medians and maxima of the ratios over the points: the figures the issue's targets are stated in.
The best anchor is taken per metric, so one anchor's median may be set beside another's tail; a
second p50 ratio, and a second best hit ratio, are therefore taken against the anchors whose p99
stays within ``ADMISSIBLE_TAIL`` of the best anchor's, and the verdict names any anchor no worse
than Fairway on p50, p99 and hit at once and better on one (``dominating``). ``--fairway SPEC``
judges a candidate (a ``fairway[...]`` option set) in the shipped router's place.

Equal views: a view is the routers' prefix index, ``approx`` (each router's own decisions,
corrected by the engines' cached-token reports) or ``events`` (the engines' KV events, exact);
every router of one table reads the same view, so "best anchor" compares like with like.

``ABLATIONS`` (today's unbounded ``consistent-hash``, ``round-robin``) run beside the anchors when
asked for (``--ablations``) and are shown, but never count as the best anchor: no production
router works that way.

Each run is one process-independent simulator run cached as JSON under ``--out`` (named by its
configuration), so an interrupted yardstick resumes, and a table can be rebuilt from the cache
(``--table-only``). The table is pure: ``summarise`` and ``render`` take the runs' summaries.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import statistics
import sys
from collections.abc import Iterable, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fairway.cost_model import DEFAULT_PROFILE
from fairway.engine.model import DEFAULT_MAX_NUM_SEQS
from fairway.request import WorkloadError
from fairway.spec import parse_spec, split_specs
from sim.runner import RunConfig, run
from workloads.traces import resolve_trace

FAIRWAY = "fairway"

#: The faithful anchors, each the upstream rule as its own source states it (docs/design.md,
#: Anchors). A name not registered in this build is reported and left out.
ANCHORS: tuple[str, ...] = (
    "pow2",
    "ray-prefix",
    "ray-prefix[imbalanced_threshold=10]",
    "sglang",
    "sglang-classic",
    "dynamo",
    "llmd",
    "llmd-baseline",
    "aibrix",
    "vllm-prefixaware",
    "vllm-loadaware",
    "prefix-hash",
    "session-hash",
)

#: The tail an anchor may have and still set the "admissible" p50 bar: p99 at most this many times the
#: best anchor's p99 at the point. A router that buys its median by starving the expensive requests
#: (hotspot: every cold prompt on one replica, p99 500x the best) is not one an operator runs, so the
#: table also states Fairway's p50 against the anchors that keep their tail within this factor.
ADMISSIBLE_TAIL = 2.0
#: The issue's router targets, Fairway over the best anchor: the median over points of the p50
#: and of the p99 ratio, and the most any one point may reach on either
TARGET_MEDIAN = {"p50": 1.0, "p99": 0.9}
TARGET_MAX = 1.05

#: Shown when asked for, never the best anchor: routers no production system runs as they are here.
ABLATIONS: tuple[str, ...] = ("consistent-hash", "round-robin")

@dataclass(frozen=True, slots=True)
class Point:
    """One workload at one load. ``load`` is a rate (req/s; sessions/s for ``agentic``) or, for a
    trace replay (``scale``), the time compression."""

    name: str
    workload: str
    load: float
    duration_s: float | None
    scale: bool = False

    @property
    def label(self) -> str:
        return f"{self.name} x{self.load:g}" if self.scale else f"{self.name} @{self.load:g}"


def default_points() -> tuple[list[Point], list[str]]:
    """The shared points, and the real traces' points for those found (``workloads.traces``
    looks a named trace up in the shared traces folder, or ``$FAIRWAY_TRACE_DIR``); the second
    list names the traces that were missing (the table prints it)."""
    pts = [
        Point("agentic", "agentic", 2, 300), Point("agentic", "agentic", 3, 300),
        Point("hotspot", "hotspot", 100, 120), Point("hotspot", "hotspot", 160, 120),
        Point("rag-spike", "rag-spike", 60, 300), Point("rag-spike", "rag-spike", 100, 300),
    ]
    missing = []
    for name, scales in REAL_TRACES:
        try:
            resolve_trace(name)
        except WorkloadError:
            missing.append(name)
            continue
        pts += [Point(name, f"trace:{name}", s, None, scale=True) for s in scales]
    return pts, missing


def point_named(label: str) -> Point:
    """The point with this label, or a ValueError naming the known ones and the traces not found."""
    points, missing = default_points()
    for p in points:
        if p.label == label:
            return p
    absent = f" (traces not found: {', '.join(missing)})" if missing else ""
    raise ValueError(f"unknown point {label!r}; known: {', '.join(p.label for p in points)}{absent}")


#: The real traces with prefix information (``workloads.traces.KNOWN_TRACES`` names) and their
#: time scales: the Mooncake ones at the loads the router issues state (x2 busy, x3 and x4
#: overloaded on 8 replicas); the others, not yet measured here, at their own pace and x2.
REAL_TRACES: tuple[tuple[str, tuple[float, ...]], ...] = (
    ("mooncake-synthetic", (2, 3, 4)),
    ("mooncake-conversation", (2, 3, 4)),
    ("mooncake-toolagent", (1, 2)),
    ("bailian-a", (1, 2)),
    ("bailian-b", (1, 2)),
)


@dataclass(frozen=True, slots=True)
class Run:
    """One simulator run of the yardstick: a router at a point, in a view, with a seed."""

    point: Point
    router: str
    view: str
    seed: int
    replicas: int = 8
    policy: str = FAIRWAY  # the replicas' queue policy, under every router
    profile: str = DEFAULT_PROFILE  # the engine model's cost profile
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS  # the engine's sequence slots per replica

    def config(self) -> RunConfig:
        p = self.point
        router, options = parse_spec(self.router)
        policy, policy_options = parse_spec(self.policy)
        return RunConfig(
            workload=p.workload, policy=policy, policy_options=policy_options, rate=1.0 if p.scale else p.load,
            time_scale=p.load if p.scale else 1.0, duration_s=p.duration_s if p.duration_s else 1e9,
            replicas=self.replicas, router=router, router_options=options,
            index_mode=self.view, seed=self.seed, profile=self.profile, max_num_seqs=self.max_num_seqs,
        )

    @property
    def key(self) -> str:
        """A file name for the run's cached summary: readable, and unique per configuration."""
        cfg = self.config().key()
        digest = hashlib.sha1(cfg.encode()).hexdigest()[:10]
        slug = re.sub(r"[^A-Za-z0-9.=-]+", "_", f"{self.point.label}-{self.router}-{self.view}-s{self.seed}")
        return f"{slug}-{digest}"


#: The figures kept from a run's summary (the rest stays in the simulator's own JSON).
KEPT = ("p50", "p99", "mean")


def run_one(r: Run) -> dict[str, Any]:
    """Run ``r`` and keep what the table needs."""
    res = run(r.config())
    return {
        "point": r.point.label, "router": r.router, "view": r.view, "seed": r.seed,
        "ttft_s": {k: res["ttft_s"][k] for k in KEPT},
        "hit": res["cache_hit_ratio"], "hit_bound": res.get("hit_bound_infinite", 0.0),
        "ttft_floor_s": {k: v for k, v in res.get("ttft_floor_s", {}).items() if k in KEPT},
        "n_finished": res["n_finished"], "n_requests": res["n_requests"], "sim_wall_s": res["sim_wall_s"],
        "guard_acts": res.get("guard_acts", 0), "slots": res.get("slots"),
    }


# -- the table (pure) -----------------------------------------------------------------------


@dataclass(slots=True)
class Row:
    """One point in one view: Fairway's medians over seeds and the best anchor for each metric."""

    point: str
    view: str
    fairway: dict[str, float]
    best: dict[str, tuple[str, float]]  # metric -> (anchor, its median over seeds)
    ratio: dict[str, float]  # p50, p99, mean: Fairway / best anchor (lower is better)
    hit_bound: float
    routers: dict[str, dict[str, float]] = field(default_factory=dict)  # every router's medians
    missing: list[str] = field(default_factory=list)  # anchors with no run at this point
    admissible: tuple[str, float] = ("", 0.0)  # the best p50 among anchors with p99 <= ADMISSIBLE_TAIL x best
    admissible_hit: tuple[str, float] = ("", 0.0)  # the best hit ratio among those anchors
    floor: dict[str, float] = field(default_factory=dict)  # the TTFT floor's p50 / p99 (sim/ttft_floor.py)
    # the anchors no worse than Fairway on p50, p99 and hit at once, and better on one (``dominating``)
    dominated_by: list[str] = field(default_factory=list)

    def beyond_reach(self) -> list[str]:
        """The targets no router can meet at this point: those whose bound on Fairway's p50 or
        p99 (the ratio times the best anchor's figure) is under the TTFT floor of Fairway's own
        requests, the least any router could give them."""
        out = []
        for k, median in TARGET_MEDIAN.items():
            if k in self.floor:
                out += [f"{k} <= {t:g}x" for t in (median, TARGET_MAX) if self.floor[k] > t * self.best[k][1]]
        return out


def medians(runs: Iterable[dict[str, Any]]) -> dict[str, float]:
    """Median over seeds of p50, p99, mean and the hit ratio."""
    rs = list(runs)
    out = {k: statistics.median(r["ttft_s"][k] for r in rs) for k in KEPT}
    out["hit"] = statistics.median(r["hit"] for r in rs)
    out["seeds"] = len(rs)
    return out


def dominating(fw: dict[str, float], meds: dict[str, dict[str, float]], names: Sequence[str]) -> list[str]:
    """Of ``names``, those whose medians are no worse than ``fw``'s on p50, p99 and hit at once and
    better on one: a router that beats Fairway on every count. An empty list puts Fairway on the
    point's front of the three, whatever each figure's best. O(len(names))."""
    def beats(m: dict[str, float]) -> bool:
        no_worse = m["p50"] <= fw["p50"] and m["p99"] <= fw["p99"] and m["hit"] >= fw["hit"]
        return no_worse and (m["p50"], m["p99"], m["hit"]) != (fw["p50"], fw["p99"], fw["hit"])

    return [n for n in names if beats(meds[n])]


def summarise(results: Sequence[dict[str, Any]], anchors: Sequence[str], fairway: str = FAIRWAY) -> list[Row]:
    """Rows in the order the points first appear; a point without a run of ``fairway`` (the router
    spec judged, the shipped ``fairway`` unless a candidate is named) or without any anchor run is
    left out, and one without a run of every anchor says which are missing (its "best anchor" is
    then only the best of those run). Ties between anchors go to the first in ``anchors``."""
    groups: dict[tuple[str, str], dict[str, list[dict[str, Any]]]] = {}
    bound: dict[tuple[str, str], float] = {}
    for r in results:
        g = groups.setdefault((r["point"], r["view"]), {})
        g.setdefault(r["router"], []).append(r)
        bound[(r["point"], r["view"])] = max(bound.get((r["point"], r["view"]), 0.0), r["hit_bound"])
    rows = []
    for (point, view), by_router in groups.items():
        meds = {name: medians(rs) for name, rs in by_router.items()}
        present = [a for a in anchors if a in meds]
        if fairway not in meds or not present:
            continue
        best: dict[str, tuple[str, float]] = {}
        for k in KEPT:
            a = min(present, key=lambda n: meds[n][k])
            best[k] = (a, meds[a][k])
        a = max(present, key=lambda n: meds[n]["hit"])
        best["hit"] = (a, meds[a]["hit"])
        fw = meds[fairway]
        ratio = {k: fw[k] / best[k][1] if best[k][1] > 0 else float("inf") for k in KEPT}
        tail_ok = [n for n in present if meds[n]["p99"] <= ADMISSIBLE_TAIL * best["p99"][1]]
        a = min(tail_ok, key=lambda n: meds[n]["p50"])
        admissible = (a, meds[a]["p50"])
        a = max(tail_ok, key=lambda n: meds[n]["hit"])
        admissible_hit = (a, meds[a]["hit"])
        ratio["p50_admissible"] = fw["p50"] / admissible[1] if admissible[1] > 0 else float("inf")
        missing = [a for a in anchors if a not in meds]
        floors = [r["ttft_floor_s"] for r in by_router[fairway] if r.get("ttft_floor_s")]
        floor = {k: statistics.median(f[k] for f in floors) for k in ("p50", "p99")} if floors else {}
        rows.append(Row(point, view, fw, best, ratio, bound[(point, view)], meds, missing, admissible,
                        admissible_hit, floor, dominating(fw, meds, present)))
    return rows


@dataclass(slots=True)
class Verdict:
    """The issue's router targets over the rows of one view."""

    median_p50: float
    median_p99: float
    max_p50: float
    max_p99: float
    hit_shortfalls: list[str]
    median_p50_admissible: float = 0.0
    max_p50_admissible: float = 0.0
    hit_shortfalls_admissible: list[str] = field(default_factory=list)
    dominated: list[str] = field(default_factory=list)  # points where an anchor beats Fairway on all three

    @property
    def met(self) -> bool:
        return (self.median_p99 <= TARGET_MEDIAN["p99"] and self.median_p50 <= TARGET_MEDIAN["p50"]
                and max(self.max_p50, self.max_p99) <= TARGET_MAX and not self.hit_shortfalls)


def verdict(rows: Sequence[Row]) -> Verdict:
    """The targets over ``rows`` (the caller passes the complete ones: every anchor run)."""
    p50 = [r.ratio["p50"] for r in rows]
    p99 = [r.ratio["p99"] for r in rows]
    adm = [r.ratio["p50_admissible"] for r in rows]
    short = [r.point for r in rows if r.fairway["hit"] < r.best["hit"][1]]
    short_adm = [r.point for r in rows if r.fairway["hit"] < r.admissible_hit[1]]
    dom = [f"{r.point} ({', '.join(r.dominated_by)})" for r in rows if r.dominated_by]
    return Verdict(statistics.median(p50), statistics.median(p99), max(p50), max(p99), short,
                   statistics.median(adm), max(adm), short_adm, dom)


def _floor(f: dict[str, float]) -> str:
    """The TTFT floor's p50 / p99, or a dash for runs cached before it was kept."""
    return f"{f['p50']:.3f} / {f['p99']:.2f}" if f else "-"


def _ratio(x: float) -> str:
    """A ratio, in bold where Fairway is behind."""
    return f"**{x:.2f}**" if x > 1.0 else f"{x:.2f}"


def render(rows: Sequence[Row], missing: Sequence[str] = (), not_run: Sequence[str] = (),
           fairway: str = FAIRWAY, max_num_seqs: int = DEFAULT_MAX_NUM_SEQS) -> str:
    """The markdown table per view, with its verdict line over the complete points; ``missing``:
    traces not found; ``not_run``: points without a Fairway run and an anchor run yet;
    ``fairway``: the router spec judged, named above the tables when it is not the shipped one;
    ``max_num_seqs``: the engines' sequence slots, named above the tables when not the default."""
    out = [] if fairway == FAIRWAY else [f"Judged as Fairway: `{fairway}`.\n"]
    if max_num_seqs != DEFAULT_MAX_NUM_SEQS:
        out.append(f"Engines with {max_num_seqs} sequence slots per replica (default {DEFAULT_MAX_NUM_SEQS}).\n")
    for view in dict.fromkeys(r.view for r in rows):
        vr = [r for r in rows if r.view == view and not r.missing]
        partial = [r for r in rows if r.view == view and r.missing]
        seeds = sorted({int(r.fairway["seeds"]) for r in rows if r.view == view})
        out.append(f"View `{view}`, medians over {'/'.join(map(str, seeds))} seed(s):\n")
        out.append("| point | Fairway p50 / p99 s | best anchor p50 s | best anchor p99 s | p50 / p99 ratio "
                   f"| p50 ratio, anchors with p99 <= {ADMISSIBLE_TAIL:g}x best | Fairway hit | best anchor hit "
                   f"| best hit, anchors with p99 <= {ADMISSIBLE_TAIL:g}x best | hit bound | TTFT floor p50 / p99 s |")
        out.append("| --- | ---: | --- | --- | ---: | --- | ---: | --- | --- | ---: | ---: |")
        for r in vr:
            (a50, v50), (a99, v99), (ah, vh) = r.best["p50"], r.best["p99"], r.best["hit"]
            out.append(
                f"| {r.point} | {r.fairway['p50']:.3f} / {r.fairway['p99']:.2f} | {v50:.3f} ({a50}) "
                f"| {v99:.2f} ({a99}) | {_ratio(r.ratio['p50'])} / {_ratio(r.ratio['p99'])} "
                f"| {_ratio(r.ratio['p50_admissible'])} ({r.admissible[0]}) "
                f"| {r.fairway['hit']:.3f} | {vh:.3f} ({ah}) | {r.admissible_hit[1]:.3f} ({r.admissible_hit[0]}) "
                f"| {r.hit_bound:.3f} "
                f"| {_floor(r.floor)} |")
        for r in partial:
            out.append(f"| {r.point} | {r.fairway['p50']:.3f} / {r.fairway['p99']:.2f} | incomplete: "
                       f"{len(r.missing)} anchor(s) not run ({', '.join(r.missing)}) | | | | | | | | |")
        out.append("")
        if not vr:
            out.append("No point with every anchor run yet.\n")
            continue
        v = verdict(vr)
        out.append(f"Ratios over the {len(vr)} complete points: p50 median {v.median_p50:.2f}, max {v.max_p50:.2f}; "
                   f"p99 median {v.median_p99:.2f}, max {v.max_p99:.2f}; hit below the best anchor at "
                   f"{len(v.hit_shortfalls)} point(s){': ' + ', '.join(v.hit_shortfalls) if v.hit_shortfalls else ''}. "
                   f"Targets (p99 median <= {TARGET_MEDIAN['p99']:.1f}, p50 median <= {TARGET_MEDIAN['p50']:.1f}, "
                   f"no point above {TARGET_MAX:g}, hit >= best): "
                   f"{'met' if v.met else 'not met'}. p50 against the anchors whose p99 is within "
                   f"{ADMISSIBLE_TAIL:g}x the best: median {v.median_p50_admissible:.2f}, "
                   f"max {v.max_p50_admissible:.2f}; hit below the best of those at "
                   f"{len(v.hit_shortfalls_admissible)} point(s)"
                   f"{': ' + ', '.join(v.hit_shortfalls_admissible) if v.hit_shortfalls_admissible else ''}. "
                   f"An anchor no worse on p50, p99 and hit at once, and better on one, at "
                   f"{len(v.dominated)} point(s){': ' + '; '.join(v.dominated) if v.dominated else ''}.\n")
        reach = [f"{r.point} ({', '.join(r.beyond_reach())})" for r in vr if r.beyond_reach()]
        if reach:
            out.append("Beyond any router, the TTFT floor of Fairway's own requests being above the bound: "
                       + "; ".join(reach) + ".\n")
    if not_run:
        out.append("Points not run yet: " + "; ".join(not_run) + ".\n")
    if missing:
        out.append("Traces not found, left out: " + "; ".join(missing) + ".\n")
    return "\n".join(out)


# -- the command ----------------------------------------------------------------------------


def registered(names: Sequence[str]) -> tuple[list[str], list[str]]:
    """``names`` split into the ones this build can make, and the others."""
    from fairway.routing import RouterError, validated_router

    ok, bad = [], []
    for n in names:
        try:
            validated_router(n)
            ok.append(n)
        except RouterError:
            bad.append(n)
    return ok, bad


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.yardstick", description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--views", default="approx", help="approx, events, or both (approx,events)")
    ap.add_argument("--points", default="all", help="'all', or labels' prefixes, e.g. 'agentic,Mooncake'")
    ap.add_argument("--anchors", default=",".join(ANCHORS), help="anchor specs (default: every faithful anchor)")
    ap.add_argument("--fairway", default=FAIRWAY,
                    help="the router spec judged as Fairway (a candidate, e.g. 'fairway[sticky_match=0.95]')")
    ap.add_argument("--policy", default=FAIRWAY, help="the replicas' queue policy under every router, e.g. "
                                                      "'fairway[memory_guard=false]' (default: fairway)")
    ap.add_argument("--profile", default=DEFAULT_PROFILE,
                    help="the engine model's cost profile (e.g. h200-llama3-8b-graphs, measured steps)")
    ap.add_argument("--max-num-seqs", type=int, default=DEFAULT_MAX_NUM_SEQS,
                    help="the engine's sequence slots per replica (vLLM's max_num_seqs; its own default on "
                         "a GPU of 70 GiB or more is 1024)")
    ap.add_argument("--ablations", action="store_true", help="also run ABLATIONS (shown, never the best anchor)")
    ap.add_argument("--jobs", type=int, default=max(1, min(2, os.cpu_count() or 1)))
    ap.add_argument("--out", default="out/yardstick", help="cache of the runs' summaries")
    ap.add_argument("--table-only", action="store_true", help="print the table from the cache, run nothing")
    ap.add_argument("--md", default=None, help="also write the table to this file")
    args = ap.parse_args(argv)

    if registered([args.fairway])[1]:
        ap.error(f"--fairway {args.fairway!r} is not a router spec this build can make")
    anchors, unknown = registered(split_specs(args.anchors))
    if unknown:
        print(f"not registered in this build, left out: {', '.join(unknown)}", file=sys.stderr)
    routers = [args.fairway, *anchors, *(ABLATIONS if args.ablations else ())]
    points, missing = default_points()
    if args.points != "all":
        want = split_specs(args.points)
        points = [p for p in points if any(p.label.startswith(w) for w in want)]
    if args.max_num_seqs < 1:
        ap.error("--max-num-seqs must be at least 1")
    runs = [Run(p, r, v, s, policy=args.policy, profile=args.profile, max_num_seqs=args.max_num_seqs)
            for v in split_specs(args.views) for p in points for r in routers
            for s in (int(x) for x in split_specs(args.seeds))]
    cache = Path(args.out)
    cache.mkdir(parents=True, exist_ok=True)
    results: list[dict[str, Any]] = []
    todo = []
    for r in runs:
        f = cache / f"{r.key}.json"
        if f.exists():
            results.append(json.loads(f.read_text()))
        elif not args.table_only:
            todo.append(r)
    if todo:
        print(f"{len(todo)} runs to do ({len(runs) - len(todo)} cached), {args.jobs} at a time", file=sys.stderr)
        with ProcessPoolExecutor(max_workers=args.jobs) as ex:
            futs = {ex.submit(run_one, r): r for r in todo}
            for i, fut in enumerate(as_completed(futs), 1):
                r = futs[fut]
                res = fut.result()
                (cache / f"{r.key}.json").write_text(json.dumps(res))
                results.append(res)
                print(f"[{i}/{len(todo)}] {r.point.label} {r.router} {r.view} s{r.seed}: "
                      f"p50 {res['ttft_s']['p50']:.3f} p99 {res['ttft_s']['p99']:.2f} hit {res['hit']:.3f} "
                      f"({res['sim_wall_s']:.0f} s)", file=sys.stderr)
    order = {p.label: i for i, p in enumerate(points)}
    results = [r for r in results if r["point"] in order and r["router"] in routers]
    results.sort(key=lambda r: (order[r["point"]], r["view"], r["router"], r["seed"]))
    rows = summarise(results, anchors, args.fairway)
    shown = {r.point for r in rows}
    text = render(rows, missing, [p.label for p in points if p.label not in shown], args.fairway, args.max_num_seqs)
    print(text)
    if args.md:
        Path(args.md).write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
