"""``python -m bench.report DIR...``: markdown tables from sweep folders (for docs/benchmarks.md).

For each ``DIR/sweep.json``: one row per (load, policy) with p50 / p99 / mean TTFT, the expensive
class's p99 and the hit ratio, then Fairway's ratios to FCFS, LPM and to the best of the
baselines at each load.

``python -m bench.report --side-by-side DIR[=LABEL]...``: every policy of the sweeps side by side,
one row per policy and one column per point (a sweep folder's loads): p50 / p99 TTFT, then mean
TTFT / hit ratio, and the best p50 and p99 of each column in bold.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from typing import Any

from bench.tables import md_table

BASELINES = ("fcfs", "lpm", "hrrn", "k-lpm")


def table(path: str) -> str:
    with open(os.path.join(path, "sweep.json")) as f:
        data = json.load(f)
    rows: list[dict[str, Any]] = data["results"]
    out = [f"**{data['workload']}** (seeds {data['seeds']})", "",
           "| load | policy | p50 s | p99 s | mean s | expensive p99 s | hit | n |",
           "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        t = r["ttft_s"]
        out.append(f"| {r['rate_rps']:g} | {r['label']} | {t['p50']:.3f} | {t['p99']:.2f} | "
                   f"{t['mean']:.2f} | {r['ttft_by_class_s']['expensive']['p99']:.2f} | "
                   f"{r['cache_hit_ratio']:.3f} | {r['n_finished']} |")
    out += ["", "| load | fairway p50 / best | fairway p99 / best | p99 vs fcfs | p99 vs lpm | "
            "p50 vs fcfs | p50 vs lpm |", "| ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for load in sorted({r["rate_rps"] for r in rows}):
        at = {r["label"]: r["ttft_s"] for r in rows if r["rate_rps"] == load}
        if "fairway" not in at or not all(b in at for b in BASELINES):
            continue
        fw = at["fairway"]
        b50 = min(at[b]["p50"] for b in BASELINES)
        b99 = min(at[b]["p99"] for b in BASELINES)
        out.append(f"| {load:g} | {fw['p50'] / b50:.2f} | {fw['p99'] / b99:.2f} | "
                   f"{fw['p99'] / at['fcfs']['p99']:.2f} | {fw['p99'] / at['lpm']['p99']:.2f} | "
                   f"{fw['p50'] / at['fcfs']['p50']:.2f} | {fw['p50'] / at['lpm']['p50']:.2f} |")
    return "\n".join(out) + "\n"


ORDER = ("fairway", "fcfs", "lpm", "hrrn", "k-lpm", "lpm-aging", "vllm-sjf", "dfs-weight", "svf", "svf-1bit",
         "peek", "prism", "srpt-oracle")


def side_by_side(folders: list[tuple[str, str]]) -> str:
    """The two policy x point matrices (module docstring) for ``(folder, label)`` pairs. A point
    with several seeds takes each figure's median over them. The best marks skip the oracle."""
    points: list[tuple[str, dict[str, tuple[float, ...]]]] = []
    for folder, label in folders:
        with open(os.path.join(folder, "sweep.json")) as f:
            rows = json.load(f)["results"]
        by: dict[float, dict[str, list[dict[str, Any]]]] = {}
        for r in rows:
            by.setdefault(r["rate_rps"], {}).setdefault(r["label"], []).append(r)
        for load in sorted(by):
            cells = {pol: tuple(statistics.median(x) for x in zip(
                *[(r["ttft_s"]["p50"], r["ttft_s"]["p99"], r["ttft_s"]["mean"], r["cache_hit_ratio"]) for r in rs],
                strict=True)) for pol, rs in by[load].items()}
            points.append((f"{label} {load:g}" if len(by) > 1 else label, cells))
    pols = [p for p in ORDER if any(p in c for _, c in points)]
    pols += sorted({p for _, c in points for p in c} - set(pols))
    best = [[min((v[i] for p, v in c.items() if p != "srpt-oracle"), default=None) for i in range(2)]
            for _, c in points]

    def cell(k: int, pol: str, i: int, j: int, fmt: tuple[str, str], mark: bool) -> str:
        c = points[k][1]
        if pol not in c:
            return "-"
        a, b = format(c[pol][i], fmt[0]), format(c[pol][j], fmt[1])
        if mark and pol != "srpt-oracle":
            a = f"**{a}**" if c[pol][i] == best[k][i] else a
            b = f"**{b}**" if c[pol][j] == best[k][j] else b
        return f"{a} / {b}"

    header = ["policy"] + [label for label, _ in points]
    ks = range(len(points))
    out = ["p50 / p99 TTFT, seconds (best of each column in bold, the oracle aside):", "",
           md_table(header, [[p] + [cell(k, p, 0, 1, (".3f", ".2f"), True) for k in ks] for p in pols]),
           "", "mean TTFT, seconds / hit ratio:", "",
           md_table(header, [[p] + [cell(k, p, 2, 3, (".3f", ".3f"), False) for k in ks] for p in pols])]
    return "\n".join(out) + "\n"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (module docstring); every folder must hold a ``sweep.json``, else a
    usage error that names it."""
    p = argparse.ArgumentParser(prog="python -m bench.report", description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--side-by-side", action="store_true",
                   help="every policy of the sweeps in one matrix; a folder may be DIR=LABEL")
    p.add_argument("folders", nargs="+", metavar="DIR", help="a sweep folder (python -m sim sweep --out DIR)")
    args = p.parse_args(argv)
    # (folder, label) pairs: with --side-by-side a folder may carry its label after "="
    args.pairs = [(d, label or os.path.basename(d.rstrip("/")))
                  for d, _, label in (a.partition("=") if args.side_by_side else (a, "", "") for a in args.folders)]
    for d, _ in args.pairs:
        if not os.path.isfile(os.path.join(d, "sweep.json")):
            p.error(f"{d}: no sweep.json there (a folder written by python -m sim sweep --out)")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.side_by_side:
        print(side_by_side(args.pairs))
        return
    for d, _ in args.pairs:
        print(table(d))


if __name__ == "__main__":
    main()
