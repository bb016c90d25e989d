"""``python -m sim sweep``: policies x rates (x seeds), a table, JSON and PNG plots.

With several seeds each figure is the median over seeds, so one seed's noise does not decide a
short run (under 2,000 requests). Runs are independent processes, so ``--jobs 2`` uses both cores.
"""

from __future__ import annotations

import argparse
import json
import os
from concurrent.futures import ProcessPoolExecutor
from typing import Any

import numpy as np

from fairway.spec import split_specs
from sim.options import HEADER, config_from, format_row
from sim.runner import RunConfig, run


def _one(cfg_json: str) -> dict[str, Any]:
    return run(RunConfig.model_validate_json(cfg_json), keep_samples=True)


#: The KV memory's counts in a run's JSON (``sim/runner.py``) beside its prompt-token counts.
KV_COUNTS = ("prefill_tokens_computed", "holds", "hold_releases_due", "host_reload_s")


def median_over_seeds(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Combine seed runs: medians of every TTFT statistic, sums of counts (the KV memory's token
    counts, holds and reload seconds among them), pooled samples."""
    if len(results) == 1:
        return results[0]
    out = dict(results[0])

    def med(path: list[str]) -> float:
        vals = []
        for r in results:
            v: Any = r
            for p in path:
                v = v.get(p, {}) if isinstance(v, dict) else {}
            if isinstance(v, (int, float)):
                vals.append(float(v))
        return float(np.median(vals)) if vals else 0.0

    for key in ("ttft_s", "queue_wait_s"):
        out[key] = {k: med([key, k]) for k in results[0][key]}
    for key in ("ttft_by_lane_s", "ttft_by_class_s"):
        out[key] = {
            g: {k: med([key, g, k]) for k in ("p50", "p99", "n")} for g in results[0][key]
        }
    out["cache_hit_ratio"] = med(["cache_hit_ratio"])
    out["n_finished"] = int(sum(r["n_finished"] for r in results))
    out["n_requests"] = int(sum(r["n_requests"] for r in results))
    out["seeds"] = [r["seed"] for r in results]
    out["ttft_samples_s"] = [x for r in results for x in r.get("ttft_samples_s", [])]
    out["sim_wall_s"] = float(sum(r["sim_wall_s"] for r in results))
    if "kv_memory" in out:  # the settings (admission, retention, host_kv_blocks) are the same in every run
        kv = out["kv_memory"] = dict(out["kv_memory"])
        kv["tokens"] = {k: sum(r["kv_memory"]["tokens"][k] for r in results) for k in kv["tokens"]}
        for k in KV_COUNTS:
            kv[k] = sum(r["kv_memory"][k] for r in results)
    return out


def cmd_sweep(args: argparse.Namespace) -> int:
    routers = split_specs(args.router) if args.replicas > 1 else [args.router]
    policies = [f"{r}/{p}" if len(routers) > 1 else p for r in routers for p in split_specs(args.policies)]
    by_scale = bool(args.time_scales)
    rates = [float(x) for x in split_specs(args.time_scales if by_scale else args.rates)]
    seeds = [int(x) for x in split_specs(args.seeds)] if args.seeds else [args.seed]
    def cfg_for(label: str, x: float, seed: int) -> RunConfig:
        router, _, spec = label.rpartition("/") if "/" in label else (None, "", label)
        if by_scale:  # trace replays: the x axis is the time compression, not a rate
            return config_from(args, spec, 1.0, seed, router).model_copy(update={"time_scale": x})
        return config_from(args, spec, x, seed, router)

    cfgs = [
        (spec, rate, cfg_for(spec, rate, seed))
        for rate in rates
        for spec in policies
        for seed in seeds
    ]
    os.makedirs(args.out, exist_ok=True)
    jobs = max(1, args.jobs)
    payload = [c.model_dump_json() for _, _, c in cfgs]
    if jobs == 1:
        raw = [_one(p) for p in payload]
    else:
        with ProcessPoolExecutor(max_workers=jobs) as ex:
            raw = list(ex.map(_one, payload))
    grouped: dict[tuple[str, float], list[dict[str, Any]]] = {}
    for (spec, rate, _), res in zip(cfgs, raw, strict=True):
        res["label"] = spec
        grouped.setdefault((spec, rate), []).append(res)
    rows = []
    print(f"workload {args.workload}, seeds {seeds}")
    print(HEADER)
    for rate in rates:
        for spec in policies:
            res = median_over_seeds(grouped[(spec, rate)])
            res["label"] = spec
            if by_scale:
                res["rate_rps"] = rate  # the x value shown: the time scale
            rows.append(res)
            print(format_row(res))
    slim = [{k: v for k, v in r.items() if k != "ttft_samples_s"} for r in rows]
    with open(os.path.join(args.out, "sweep.json"), "w") as f:
        json.dump({"workload": args.workload, "seeds": seeds, "results": slim}, f, indent=1)
    plot(rows, policies, rates, args.workload, args.out,
         "time scale (x faster)" if by_scale else "rate (req/s; agentic: sessions/s)")
    print(f"wrote {os.path.join(args.out, 'sweep.json')} and plots in {args.out}")
    return 0


def plot(rows: list[dict[str, Any]], policies: list[str], rates: list[float], workload: str,
         out: str, xlabel: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for spec in policies:
        pts = [r for r in rows if r["label"] == spec]
        xs = [r["rate_rps"] for r in pts]
        axes[0].plot(xs, [r["ttft_s"]["p50"] for r in pts], marker="o", label=spec)
        axes[1].plot(xs, [r["ttft_s"]["p99"] for r in pts], marker="o", label=spec)
    for ax, what in zip(axes, ("p50", "p99"), strict=True):
        ax.set_xlabel(xlabel)
        ax.set_ylabel(f"TTFT {what} (s)")
        ax.set_yscale("log")
        ax.grid(True, alpha=0.3)
        ax.set_title(f"{workload}: TTFT {what} vs rate")
    axes[1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(os.path.join(out, "ttft_vs_rate.png"), dpi=110)
    plt.close(fig)

    top = max(rates)
    fig, ax = plt.subplots(figsize=(6, 4.2))
    for spec in policies:
        for r in rows:
            if r["label"] == spec and r["rate_rps"] == top:
                xs = np.sort(np.asarray(r.get("ttft_samples_s", []), dtype=float))
                if xs.size:
                    ax.plot(xs, np.arange(1, xs.size + 1) / xs.size, label=spec)
    ax.set_xscale("log")
    ax.set_xlabel("TTFT (s)")
    ax.set_ylabel("fraction of requests")
    ax.set_title(f"{workload}: TTFT CDF at x = {top:g}")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(os.path.join(out, "ttft_cdf.png"), dpi=110)
    plt.close(fig)
