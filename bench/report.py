"""``python -m bench.report DIR...``: markdown tables from sweep folders (for docs/benchmarks.md).

For each ``DIR/sweep.json``: one row per (load, policy) with p50 / p99 / mean TTFT, the expensive
class's p99 and the hit ratio, then Fairway's ratios to FCFS, LPM and to the best of the
baselines at each load.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

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


def main() -> None:
    for d in sys.argv[1:]:
        print(table(d))


if __name__ == "__main__":
    main()
