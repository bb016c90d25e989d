"""``python -m bench.score``: score policy variants against the best baseline, scenario by scenario.

For each scenario the reference is the best of the baselines (fcfs, lpm, hrrn, k-lpm) on p99 and,
separately, on p50, all run side by side in the same invocation. A variant's score in a scenario is
max(p99 / (1.05 * best p99), p50 / (1.10 * best p50)): 1.0 or less means within 5% of the best
tail and 10% of the best median there. The worst scenario is the variant's score. This is the
sensitivity-sweep tool behind docs/benchmarks.md.

It also prints issue 22's queue-policy target: the variant's p99 and mean TTFT over the better of
``lpm``'s and ``fcfs``'s. A fixed-concurrency scenario (a closed loop) holds the same number of
requests at the engine under every policy, so a policy that serves them more slowly sends fewer
per second, and its TTFT alone reads as if it were better: there the ratios are also given
against the simple policies that serve at least 0.9x the variant's request rate, with each one's
served rate and end-to-end p99 beside them.
"""

from __future__ import annotations

import argparse
import json
import os
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

from bench.report import BASELINES
from fairway.cost_model import DEFAULT_PROFILE
from fairway.spec import parse_spec, split_specs
from sim.runner import RunConfig, run

# ../shared beside the repository, whatever the working directory
TRACE = str(Path(__file__).resolve().parents[2] / "shared" / "traces" / "mooncake_synthetic_trace.jsonl")

#: (label, RunConfig fields): light-to-overload points of every workload family.
SCENARIOS: list[tuple[str, dict[str, Any]]] = [
    ("rag@12", {"workload": "rag", "rate": 12}),
    ("rag@24", {"workload": "rag", "rate": 24}),
    ("rag-spike@8", {"workload": "rag-spike", "rate": 8}),
    ("rag-spike@12", {"workload": "rag-spike", "rate": 12}),
    ("mixed@12", {"workload": "mixed", "rate": 12}),
    ("mixed-spike@6", {"workload": "mixed-spike", "rate": 6}),
    ("mixed-spike@9", {"workload": "mixed-spike", "rate": 9}),
    ("mixed-spike@12", {"workload": "mixed-spike", "rate": 12}),
    ("agentic@0.2", {"workload": "agentic", "rate": 0.2}),
    ("agentic-spike@0.1", {"workload": "agentic-spike", "rate": 0.1}),
    ("agentic-c100", {"workload": "agentic", "rate": 0.5, "concurrency": 100}),
    # the same closed loop at the workload's own rate: memory-bound sustained overload
    ("agentic-c100@4", {"workload": "agentic", "rate": 4, "concurrency": 100}),
    ("mooncake@1.0", {"workload": f"trace:{TRACE}", "time_scale": 1.0, "duration_s": 1e9}),
]


#: Issue 22's queue-policy target: p99 and mean TTFT within this factor of the better of these.
SIMPLE = ("lpm", "fcfs")
TARGET = 1.1
#: In a fixed-concurrency loop a policy's TTFT is compared with the simple ones' that serve at
#: least this fraction of its request rate (module docstring).
SERVED_FRACTION = 0.9


def _one(cfg_json: str) -> dict[str, Any]:
    r = run(RunConfig.model_validate_json(cfg_json))
    return {"p50": r["ttft_s"]["p50"], "p99": r["ttft_s"]["p99"], "mean": r["ttft_s"]["mean"],
            "hit": r["cache_hit_ratio"], "n": r["n_finished"], "served_rps": r["served_rps"],
            "e2e_p99": r["e2e_s"]["p99"], "tpot_p99": r["tpot_s"]["p99"]}


def target_ratios(row: dict[str, dict[str, Any]], variant: str, closed_loop: bool) -> dict[str, Any]:
    """The variant's p99 and mean TTFT over the better of ``SIMPLE``'s. In a closed loop, also
    over the better of those serving at least ``SERVED_FRACTION`` of its rate (None if none
    does), and its served rate and end-to-end p99 beside theirs. O(len(SIMPLE))."""
    v = row[variant]
    out: dict[str, Any] = {"p99": v["p99"] / min(row[b]["p99"] for b in SIMPLE),
                           "mean": v["mean"] / min(row[b]["mean"] for b in SIMPLE)}
    if closed_loop and "served_rps" in v:
        peers = [b for b in SIMPLE if row[b]["served_rps"] >= SERVED_FRACTION * v["served_rps"]]
        out["peers"] = peers
        out["p99_at_rate"] = v["p99"] / min(row[b]["p99"] for b in peers) if peers else None
        out["mean_at_rate"] = v["mean"] / min(row[b]["mean"] for b in peers) if peers else None
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--variants", default="fairway", help="comma-separated policy specs")
    ap.add_argument("--scenarios", default=None, help="comma-separated scenario labels (default all)")
    ap.add_argument("--duration", type=float, default=300.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--json", default=None)
    ap.add_argument("--cache", default=None, help="JSON file reusing results of identical runs")
    ap.add_argument("--profile", default=DEFAULT_PROFILE,
                    help="the engine model's cost profile (python -m bench.calibrate show NAME)")
    args = ap.parse_args()
    variants = split_specs(args.variants)
    wanted = set(split_specs(args.scenarios)) if args.scenarios else None
    scen = [(k, v) for k, v in SCENARIOS if wanted is None or k in wanted]
    if not os.path.exists(TRACE):
        scen = [(k, v) for k, v in scen if not v["workload"].startswith("trace:")]
    jobs = []
    for label, fields in scen:
        for spec in (*BASELINES, *variants):
            name, opts = parse_spec(spec)
            base = {"duration_s": args.duration, "seed": args.seed, "profile": args.profile, **fields}
            cfg = RunConfig(policy=name, policy_options=opts, **base)
            jobs.append((label, spec, cfg.key()))
    cache: dict[str, dict[str, Any]] = {}
    if args.cache and os.path.exists(args.cache):
        with open(args.cache) as f:
            cache = json.load(f)
    todo = sorted({j[2] for j in jobs if j[2] not in cache})
    with ProcessPoolExecutor(max_workers=max(1, args.jobs)) as ex:
        cache.update(zip(todo, ex.map(_one, todo), strict=True))
    if args.cache:
        with open(args.cache, "w") as f:
            json.dump(cache, f)
    results = [cache[j[2]] for j in jobs]
    table: dict[str, dict[str, dict[str, Any]]] = {}
    for (label, spec, _), res in zip(jobs, results, strict=True):
        table.setdefault(label, {})[spec] = res
    worst = dict.fromkeys(variants, 0.0)
    print(f"{'scenario':<18} {'best p50':>9} {'best p99':>9}  " + "  ".join(f"{v[:26]:>26}" for v in variants))
    for label, _ in scen:
        row = table[label]
        b50 = min(row[b]["p50"] for b in BASELINES)
        b99 = min(row[b]["p99"] for b in BASELINES)
        cells = []
        for v in variants:
            r = row[v]
            s = max(r["p99"] / (1.05 * b99), r["p50"] / (1.10 * b50))
            worst[v] = max(worst[v], s)
            cells.append(f"{r['p50'] / b50:5.2f}x50 {r['p99'] / b99:5.2f}x99 s{s:5.2f}")
        print(f"{label:<18} {b50:>9.3f} {b99:>9.2f}  " + "  ".join(f"{c:>26}" for c in cells))
    print("worst-case score: " + ", ".join(f"{v} {worst[v]:.2f}" for v in variants))
    print(f"\nissue 22's target: p99 and mean TTFT <= {TARGET}x the better of {' and '.join(SIMPLE)}")
    ratios: dict[str, dict[str, Any]] = {}
    for label, fields in scen:
        row, closed = table[label], fields.get("concurrency") is not None
        for v in variants:
            t = ratios.setdefault(label, {})[v] = target_ratios(row, v, closed)
            line = f"{label:<18} {v[:26]:<26} p99 {t['p99']:5.2f}x  mean {t['mean']:5.2f}x"
            if "peers" in t:
                at = (f"p99 {t['p99_at_rate']:5.2f}x  mean {t['mean_at_rate']:5.2f}x against {', '.join(t['peers'])}"
                      if t["peers"] else "no simple policy serves its rate")
                served = ", ".join(f"{b} {row[b]['served_rps']:.2f} req/s e2e p99 {row[b]['e2e_p99']:.1f} s"
                                   for b in (v, *SIMPLE))
                line += f"  | closed loop, at >= {SERVED_FRACTION}x its served rate: {at}  ({served})"
            print(line)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"scenarios": [k for k, _ in scen], "table": table, "worst": worst, "target": ratios},
                      f, indent=1)


if __name__ == "__main__":
    main()
