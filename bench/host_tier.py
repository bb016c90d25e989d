"""Tier-aware against tier-blind routing, side by side, on engines with a host KV tier.

``python -m bench.host_tier [--workload agentic] [--concurrency 100] [--replicas 4]
[--kv-blocks 2000] [--host-kv-blocks 2000] [--seeds 0,1] [--duration 300]``

runs the Fairway router on the exact prefix view (``--index-mode events``) twice per seed:
``fairway`` (tier-aware: a host-tier hit is priced as a reload, ``PrefixIndex.match_tiers``) and
``fairway[host_tier=false]`` (tier-blind: a host hit counts as a GPU hit, the router before the
tier split), and prints TTFT p50 / p99 / mean and the engines' prompt tokens by class (GPU hit,
host hit, miss) per run, then the medians over seeds. With ``--host-kv-blocks 0`` both rows must
be identical (no tier events, no reload term). One simulation at a time.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

from bench.tables import md_table
from sim.runner import RunConfig, run

ROUTERS = {"tier-aware": {}, "tier-blind": {"host_tier": False}}


def config(args: argparse.Namespace, options: dict[str, Any], seed: int) -> RunConfig:
    return RunConfig(
        workload=args.workload, policy="fairway", rate=args.rate, duration_s=args.duration,
        concurrency=args.concurrency or None, replicas=args.replicas, router="fairway", router_options=options,
        index_mode="events", kv_blocks=args.kv_blocks, host_kv_blocks=args.host_kv_blocks, seed=seed,
    )


def _tokens(r: dict[str, Any]) -> dict[str, float]:
    """Prompt tokens by class (GPU hit, host hit, miss); without a host tier the run JSON has
    only the hit ratio, which is then all GPU."""
    tok = r.get("kv_memory", {}).get("tokens")
    if tok:
        return tok
    hit = r.get("cache_hit_ratio", 0.0)
    return {"gpu_hit": hit, "host_hit": 0.0, "miss": 1.0 - hit}


def row(label: str, seed: str, r: dict[str, Any]) -> list[Any]:
    t = r["ttft_s"]
    tok = _tokens(r)
    total = sum(tok.values()) or 1
    return [label, seed, f"{t['p50']:.3f}", f"{t['p99']:.2f}", f"{t['mean']:.3f}",
            f"{tok['gpu_hit'] / total:.3f}", f"{tok['host_hit'] / total:.3f}", f"{tok['miss'] / total:.3f}",
            r["n_finished"]]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--workload", default="agentic")
    ap.add_argument("--concurrency", type=int, default=100, help="fixed-concurrency mode; 0: open loop at --rate")
    ap.add_argument("--rate", type=float, default=0.5, help="arrival rate (requests/s) with --concurrency 0")
    ap.add_argument("--duration", type=float, default=300.0)
    ap.add_argument("--replicas", type=int, default=4)
    ap.add_argument("--kv-blocks", type=int, default=2000, help="GPU KV blocks per replica")
    ap.add_argument("--host-kv-blocks", type=int, default=2000, help="host KV tier per replica, blocks")
    ap.add_argument("--seeds", default="0,1")
    ap.add_argument("--json", default=None, help="write every run's summary here")
    args = ap.parse_args(argv)
    seeds = [int(s) for s in args.seeds.split(",")]
    results: dict[str, list[dict[str, Any]]] = {k: [] for k in ROUTERS}
    rows = []
    for seed in seeds:
        for label, opts in ROUTERS.items():
            r = run(config(args, opts, seed))
            results[label].append(r)
            rows.append(row(label, str(seed), r))
    for label, rs in results.items():
        med = {"ttft_s": {k: statistics.median(r["ttft_s"][k] for r in rs) for k in ("p50", "p99", "mean")},
               "kv_memory": {"tokens": {k: statistics.median(_tokens(r)[k] for r in rs)
                                        for k in ("gpu_hit", "host_hit", "miss")}},
               "n_finished": int(statistics.median(r["n_finished"] for r in rs))}
        rows.append(row(label, "median", med))
    load = f"concurrency {args.concurrency}" if args.concurrency else f"rate {args.rate:g}/s"
    print(f"{args.workload}, {load}, {args.replicas} replicas, "
          f"{args.kv_blocks} GPU + {args.host_kv_blocks} host KV blocks each, {args.duration:g} s, events index")
    print(md_table(["router", "seed", "p50 s", "p99 s", "mean s", "GPU hit", "host hit", "miss", "n"], rows))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
