"""Many router instances in the simulator: each with its own view, or one shared view.

``python -m bench.scaleout --routers 1,2,4,8 --out out/scaleout`` runs, for each workload point
and each K, the 8-replica cluster with K router instances, view "own" (each instance learns from
its own decisions, as K Ray Serve ingress replicas do without the shared view) and "shared"
(``--sync-delay``, default 0.02 s: the Ray host's exchange period), and prints p50 / p99 / hit
against K = 1. Points: Mooncake x3 by default (``--points``; a point is ``workload@load``, the load
a time scale for ``trace:``, else a rate). Runs are independent processes (``--jobs``).
"""

from __future__ import annotations

import argparse
import json
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

from bench.score import TRACE
from bench.tables import md_table
from fairway.spec import split_specs
from sim.runner import RunConfig, run


def config(point: str, routers: int, view: str, delay: float, seed: int) -> RunConfig:
    workload, _, load = point.rpartition("@")
    workload = workload.replace("mooncake", f"trace:{TRACE}")
    trace = workload.startswith("trace:")
    return RunConfig(workload=workload, policy="fairway", replicas=8, router="fairway", routers=routers,
                     router_view=view, sync_delay_s=delay if view == "shared" else 0.0, seed=seed,
                     time_scale=float(load) if trace else 1.0, rate=4.0 if trace else float(load),
                     duration_s=None if trace else 300.0)


def _one(cfg_json: str) -> dict[str, Any]:
    res = run(RunConfig.model_validate_json(cfg_json))
    keys = ("workload", "routers", "router_view", "sync_delay_s", "rate_rps", "ttft_s", "cache_hit_ratio",
            "hit_bound_capacity", "ceiling_hit_ratio")
    return {k: res[k] for k in keys}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.scaleout", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--points", default="mooncake@3", help="comma-separated workload@load")
    ap.add_argument("--routers", default="1,2,4,8")
    ap.add_argument("--sync-delay", type=float, default=0.02)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--out", default="out/scaleout")
    a = ap.parse_args(argv)
    ks = [int(k) for k in split_specs(a.routers)]
    plan = []
    for point in split_specs(a.points):
        for k in ks:
            for view in (["own"] if k == 1 else ["own", "shared"]):
                plan.append((point, k, view, config(point, k, view, a.sync_delay, a.seed)))
    with ProcessPoolExecutor(max_workers=a.jobs) as pool:
        results = list(pool.map(_one, [c.model_dump_json() for *_, c in plan]))
    rows, base = [], {}
    for (point, k, view, _), r in zip(plan, results, strict=True):
        t = r["ttft_s"]
        if k == 1:
            base[point] = t["p99"]
        rows.append([point, k, view, f"{t['p50']:.3f}", f"{t['p99']:.2f}", f"{r['cache_hit_ratio']:.3f}",
                     f"{r['hit_bound_capacity']:.3f}", f"{t['p99'] / base[point]:.2f}" if point in base else "-"])
    table = md_table(["point", "routers", "view", "p50 s", "p99 s", "hit", "hit bound", "p99 / K=1"], rows,
                     align="lrlrrrrr")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "scaleout.json").write_text(json.dumps({"argv": a.__dict__, "results": results}, indent=1))
    (out / "scaleout.md").write_text(table + "\n")
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
