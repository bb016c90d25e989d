"""Many router instances in the simulator: each with its own view, or one shared view.

``python -m bench.scaleout --routers 1,2,4,8 --out out/scaleout`` runs, for each workload point
and each K, the 8-replica cluster with K router instances, view "own" (each instance learns from
its own decisions, as K Ray Serve ingress replicas do without the shared view) and "shared"
(``--sync-delay``, default 0.01 s: the Ray host's exchange period), and prints p50 / p99 / hit
against K = 1. Points: Mooncake x3 by default (``--points``; a point is ``workload@load``, the load
a time scale for ``trace:``, else a rate). Runs are independent processes (``--jobs``).

One run's p99 is chaotic: it is set by the ~1% slowest requests, and a perturbation as small as a
0.3% change of the trace's time scale moves one router's Mooncake x3 p99 by 17%. So each
point is an ensemble of ``--ensemble`` members (default 5): for a trace, the time scale
multiplied by 1 + 0.01 * (i - (n - 1) / 2) / ((n - 1) / 2) (the load within +-1%); for a synthetic
workload, seeds ``--seed`` .. ``--seed + n - 1``. A row reports the members' medians, and
"p99 / K=1" is the ratio of the median p99 to the one-router median at the same point, with the
range of the members' own ratios (member i against member i of K = 1) beside it.
"""

from __future__ import annotations

import argparse
import json
import statistics
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

from bench.score import TRACE
from bench.tables import md_table
from fairway.spec import split_specs
from sim.runner import RunConfig, run


def config(point: str, routers: int, view: str, delay: float, seed: int, index: str = "approx") -> RunConfig:
    workload, _, load = point.rpartition("@")
    workload = workload.replace("mooncake", f"trace:{TRACE}")
    trace = workload.startswith("trace:")
    return RunConfig(workload=workload, policy="fairway", replicas=8, router="fairway", routers=routers,
                     router_view=view, sync_delay_s=delay if view == "shared" else 0.0, seed=seed, index_mode=index,
                     time_scale=float(load) if trace else 1.0, rate=4.0 if trace else float(load),
                     duration_s=None if trace else 300.0)


def members(point: str, n: int, seed: int) -> list[tuple[str, int]]:
    """The ensemble of ``point``: (point, seed) pairs, the load spread within +-1% for a trace,
    seeds ``seed`` .. ``seed + n - 1`` for a synthetic workload (see the module docstring)."""
    if n < 1:
        raise ValueError("an ensemble needs at least one member")
    workload, _, load = point.rpartition("@")
    if not (workload.startswith("trace:") or workload.startswith("mooncake")):
        return [(point, seed + i) for i in range(n)]
    if n == 1:
        return [(point, seed)]
    half = (n - 1) / 2
    return [(f"{workload}@{float(load) * (1 + 0.01 * (i - half) / half):.6g}", seed) for i in range(n)]


def _one(cfg_json: str) -> dict[str, Any]:
    cfg = RunConfig.model_validate_json(cfg_json)
    res = run(cfg) | {"index_mode": cfg.index_mode}
    keys = ("workload", "routers", "router_view", "index_mode", "sync_delay_s", "rate_rps", "ttft_s", "cache_hit_ratio",
            "hit_bound_capacity", "ceiling_hit_ratio")
    return {k: res[k] for k in keys}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.scaleout", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--points", default="mooncake@3", help="comma-separated workload@load")
    ap.add_argument("--routers", default="1,2,4,8")
    ap.add_argument("--sync-delay", type=float, default=0.01)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--ensemble", type=int, default=5, help="members per point (see the module docstring)")
    ap.add_argument("--views", default="own,shared", help="views for K > 1: own, shared or both")
    ap.add_argument("--index", default="approx", help="prefix index modes: approx, events (KV events, which "
                                                      "travel with the shared view's delay) or both")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--out", default="out/scaleout")
    a = ap.parse_args(argv)
    ks = [int(k) for k in split_specs(a.routers)]
    views = split_specs(a.views)
    if not views or set(views) - {"own", "shared"}:
        ap.error("--views takes own, shared or both")
    indexes = split_specs(a.index)
    if not indexes or set(indexes) - {"approx", "events"}:
        ap.error("--index takes approx, events or both")
    plan = []
    for point in split_specs(a.points):
        for index in indexes:
            for k in ks:
                for view in (["own"] if k == 1 else views):
                    for i, (member, seed) in enumerate(members(point, a.ensemble, a.seed)):
                        plan.append((point, index, k, view, i, config(member, k, view, a.sync_delay, seed, index)))
    with ProcessPoolExecutor(max_workers=a.jobs) as pool:
        results = list(pool.map(_one, [c.model_dump_json() for *_, c in plan]))
    groups: dict[tuple[str, str, int, str], list[dict[str, Any]]] = {}
    for (point, index, k, view, _i, _c), r in zip(plan, results, strict=True):
        groups.setdefault((point, index, k, view), []).append(r)
    base_index = indexes[0]  # "p99 / K=1": against one router on the first index mode listed
    rows = []
    for (point, index, k, view), rs in groups.items():
        row = summary_row(point, k, view, rs, groups.get((point, base_index, 1, "own")))
        rows.append([row[0], index, *row[1:]])  # the index mode after the point
    table = md_table(["point", "index", "routers", "view", "p50 s", "p99 s", "hit", "hit bound",
                      f"p99 / K=1 {base_index}", "members' ratios"], rows, align="llrlrrrrrl")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "scaleout.json").write_text(json.dumps({"argv": a.__dict__, "results": results}, indent=1))
    (out / "scaleout.md").write_text(table + "\n")
    print(table)
    return 0


def summary_row(point: str, k: int, view: str, rs: list[dict[str, Any]],
                base: list[dict[str, Any]] | None) -> list[Any]:
    """One table row: the members' median p50, p99, hit ratio and hit bound, and the p99 against
    the one-router members (``base``): the ratio of medians and the range of member ratios."""
    def med(key: str, sub: str | None = None) -> float:
        return statistics.median(r[key][sub] if sub else r[key] for r in rs)

    p99 = med("ttft_s", "p99")
    ratio, spread = "-", "-"
    if base:
        ratio = f"{p99 / statistics.median(b['ttft_s']['p99'] for b in base):.2f}"
        each = [r["ttft_s"]["p99"] / b["ttft_s"]["p99"] for r, b in zip(rs, base, strict=True)]
        spread = f"{min(each):.2f}-{max(each):.2f}"
    return [point, k, view, f"{med('ttft_s', 'p50'):.3f}", f"{p99:.2f}", f"{med('cache_hit_ratio'):.3f}",
            f"{med('hit_bound_capacity'):.3f}", ratio, spread]


if __name__ == "__main__":
    raise SystemExit(main())
