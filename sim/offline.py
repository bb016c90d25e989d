"""``python -m sim offline``: plan a backlog (every request present at t = 0) under a KV budget
with each planner of ``fairway.offline``, execute the plans, and compare them with the lower
bound. Deterministic under ``--seed``.

The backlog is the first ``--n`` requests a workload issues (first turns, for closed-loop
workloads), their arrival times dropped; a request whose whole footprint exceeds the budget is
left out and counted, as the engine rejects it.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from fairway.cost_model import DEFAULT_PROFILE, CostModel
from fairway.engine.model import DEFAULT_MAX_NUM_BATCHED_TOKENS, DEFAULT_MAX_NUM_SEQS
from fairway.offline import MODES, PLANNERS, Budget, Job, execute, lower_bound
from fairway.summary import pct
from workloads.registry import make_workload

BACKLOG_RATE = 10.0  # arrivals/s used only to draw the backlog from a synthetic workload


def add_offline_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workload", required=True,
                   help="rag, mixed, agentic, *-spike, trace:PATH, trace:NAME (docs/traces.md)")
    p.add_argument("--n", type=int, default=200, help="backlog size")
    p.add_argument("--kv-tokens", type=int, default=65_536,
                   help="KV budget in tokens (rounded down to blocks); small enough that batching decides")
    p.add_argument("--mode", default="both", choices=[*MODES, "both"],
                   help="static: batch after batch; continuous: the plan's order, admitted as memory frees")
    p.add_argument("--planners", default=",".join(PLANNERS), help="comma-separated planner names")
    p.add_argument("--profile", default=DEFAULT_PROFILE)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-num-seqs", type=int, default=DEFAULT_MAX_NUM_SEQS)
    p.add_argument("--max-num-batched-tokens", type=int, default=DEFAULT_MAX_NUM_BATCHED_TOKENS)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write the results JSON here")


def backlog(workload: str, n: int, seed: int, block_size: int) -> list[Job]:
    """The first ``n`` requests of ``workload`` as jobs (rid = position)."""
    if n < 1:
        raise ValueError("--n must be >= 1")
    replay = workload.startswith("trace:")
    wl = make_workload(workload, rate=BACKLOG_RATE, seed=seed, block_size=block_size,
                       duration_s=None if replay else 2.0 * n / BACKLOG_RATE + 10.0)
    jobs: list[Job] = []
    for spec in wl.initial():
        jobs.append(Job(rid=len(jobs), prompt=spec.prompt_tokens, output=spec.output_tokens))
        if len(jobs) == n:
            break
    if len(jobs) < n:
        raise ValueError(f"workload {workload!r} issued only {len(jobs)} requests up front, asked for {n}")
    return jobs


def run_offline(args: argparse.Namespace) -> dict[str, Any]:
    cost = CostModel.from_profile(args.profile)
    if args.kv_tokens < args.block_size:
        raise ValueError("--kv-tokens must hold at least one block")
    budget = Budget(kv_blocks=args.kv_tokens // args.block_size, block_size=args.block_size,
                    max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens)
    names = [x.strip() for x in args.planners.split(",") if x.strip()]
    unknown = [x for x in names if x not in PLANNERS]
    if unknown:
        raise ValueError(f"unknown planner {unknown[0]!r}; known: {', '.join(PLANNERS)}")
    drawn = backlog(args.workload, args.n, args.seed, args.block_size)
    jobs = [Job(rid=i, prompt=j.prompt, output=j.output) for i, j in enumerate(x for x in drawn if budget.fits(x))]
    if not jobs:
        raise ValueError("no request of the backlog fits the KV budget")
    lb = lower_bound(jobs, budget, cost)
    modes = list(MODES) if args.mode == "both" else [args.mode]
    rows = []
    for name in names:
        plan = PLANNERS[name](jobs, budget)
        for mode in modes:
            out = execute(jobs, plan, budget, cost, mode)
            rows.append({
                "planner": name, "mode": mode, "batches": out.batches, "steps": out.steps,
                "completion_s": pct(out.finish_s), "ttft_s": pct(out.first_token_s),
                "makespan_s": out.makespan_s, "ratio_to_bound": float(out.finish_s.sum()) / lb.sum_s,
            })
    return {
        "workload": args.workload, "n": len(jobs), "dropped": len(drawn) - len(jobs), "seed": args.seed,
        "profile": args.profile, "kv_blocks": budget.kv_blocks, "block_size": budget.block_size,
        "bound": {"mean_completion_s": lb.mean_s, "makespan_s": lb.makespan_s},
        "rows": rows,
    }


def cmd_offline(args: argparse.Namespace) -> int:
    res = run_offline(args)
    print(f"backlog {res['workload']}: {res['n']} requests at t=0 ({res['dropped']} too large, left out), "
          f"KV {res['kv_blocks']} blocks x {res['block_size']}, profile {res['profile']}")
    b = res["bound"]
    print(f"lower bound (any schedule, fairway.offline.lower_bound): mean completion {b['mean_completion_s']:.3f} s, "
          f"makespan {b['makespan_s']:.3f} s")
    print(f"{'planner':<15} {'mode':<10} {'batches':>7} {'mean_s':>8} {'p50_s':>8} {'p99_s':>8} "
          f"{'ttft_mean':>9} {'ttft_p99':>9} {'makespan':>9} {'mean/LB':>7}")
    for r in res["rows"]:
        c, t = r["completion_s"], r["ttft_s"]
        print(f"{r['planner']:<15} {r['mode']:<10} {r['batches']:>7d} {c['mean']:>8.3f} {c['p50']:>8.3f} "
              f"{c['p99']:>8.3f} {t['mean']:>9.3f} {t['p99']:>9.3f} {r['makespan_s']:>9.3f} "
              f"{r['ratio_to_bound']:>7.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0
