"""``python -m sim run|sweep``: the simulator's command line. Deterministic under ``--seed``."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from pydantic import ValidationError

from loadgen.registry import WorkloadError
from router.policies import PolicyError
from router.routing import RouterError
from sim.runner import RunConfig, dump, run


class CLIError(ValueError):
    pass


def parse_policy_spec(spec: str) -> tuple[str, dict[str, Any]]:
    """``fairway`` or ``fairway[theta=4;fair_share=0.5]`` -> (name, options)."""
    spec = spec.strip()
    if "[" not in spec:
        return spec, {}
    if not spec.endswith("]"):
        raise CLIError(f"malformed policy spec {spec!r}: expected name[key=value;...]")
    name, _, body = spec[:-1].partition("[")
    opts: dict[str, Any] = {}
    for part in filter(None, body.split(";")):
        if "=" not in part:
            raise CLIError(f"malformed policy option {part!r} in {spec!r}: expected key=value")
        k, _, v = part.partition("=")
        opts[k.strip()] = _value(v.strip())
    return name, opts


def _value(v: str) -> Any:
    try:
        return json.loads(v)
    except json.JSONDecodeError:
        return v


def split_list(s: str) -> list[str]:
    """Split on commas outside brackets."""
    out, depth, cur = [], 0, []
    for ch in s:
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
        if ch == "," and depth == 0:
            out.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    out.append("".join(cur))
    return [x.strip() for x in out if x.strip()]


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workload", required=True, help="rag, mixed, agentic, *-spike, trace:PATH")
    p.add_argument("--duration", type=float, default=300.0, help="seconds of arrivals")
    p.add_argument("--time-scale", type=float, default=1.0, help="trace time compression")
    p.add_argument("--concurrency", type=int, default=None, help="fixed-concurrency mode")
    p.add_argument("--replicas", type=int, default=1)
    p.add_argument("--routers", type=int, default=1, help="independent router instances (each sees 1/K)")
    p.add_argument("--index-mode", default="approx", choices=["approx", "events"],
                   help="router prefix index: own decisions + feedback, or engine KV events")
    p.add_argument("--stale", type=float, default=0.0, help="router load-view staleness (s)")
    p.add_argument("--profile", default="h200-llama3-8b")
    p.add_argument("--kv-blocks", type=int, default=None, help="KV blocks per replica")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--seed", type=int, default=0)


def make_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m sim", description=__doc__)
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="simulate one policy at one rate")
    _common(r)
    r.add_argument("--policy", required=True, help="name or name[key=value;...]")
    r.add_argument("--router", default="round-robin", help="router policy with --replicas > 1")
    r.add_argument("--rate", type=float, default=4.0, help="req/s (agentic: sessions/s)")
    r.add_argument("--json", default=None, help="write the summary JSON here")
    s = sub.add_parser("sweep", help="policies x rates: table, JSON and plots")
    _common(s)
    s.add_argument("--policies", required=True, help="comma-separated policy specs")
    s.add_argument("--router", default="round-robin",
                   help="comma-separated router specs (with --replicas > 1): one table row each")
    s.add_argument("--rates", default="4", help="comma-separated rates")
    s.add_argument("--time-scales", default=None,
                   help="comma-separated trace time scales (x axis instead of --rates)")
    s.add_argument("--seeds", default=None, help="comma-separated seeds (default: --seed)")
    s.add_argument("--out", required=True, help="output folder for JSON and PNG plots")
    s.add_argument("--jobs", type=int, default=2, help="parallel processes")
    return ap


def config_from(args: argparse.Namespace, policy_spec: str, rate: float, seed: int,
                router_spec: str | None = None) -> RunConfig:
    name, opts = parse_policy_spec(policy_spec)
    rname, ropts = parse_policy_spec(router_spec or args.router)
    return RunConfig(
        workload=args.workload,
        policy=name,
        policy_options=opts,
        rate=rate,
        duration_s=args.duration,
        time_scale=args.time_scale,
        concurrency=args.concurrency,
        replicas=args.replicas,
        router=rname,
        router_options=ropts,
        routers=args.routers,
        index_mode=args.index_mode,
        stale_s=args.stale,
        profile=args.profile,
        kv_blocks=args.kv_blocks,
        block_size=args.block_size,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        seed=seed,
    )


def format_row(res: dict[str, Any]) -> str:
    t = res["ttft_s"]
    ex = res["ttft_by_class_s"]["expensive"]
    lanes = res.get("ttft_by_lane_s") or {}
    lane_s = " ".join(f"{k}:{v['n']}" for k, v in lanes.items())
    return (
        f"{res.get('label', res['policy']):<28} {res['rate_rps']:>7.2f} {t['p50']:>9.3f} "
        f"{t['p90']:>9.3f} {t['p99']:>9.3f} {t['mean']:>9.3f} {ex['p99']:>9.3f} "
        f"{res['cache_hit_ratio']:>6.3f} {res['n_finished']:>6d} {lane_s}"
    )


HEADER = (
    f"{'policy':<28} {'rate':>7} {'p50_s':>9} {'p90_s':>9} {'p99_s':>9} {'mean_s':>9} "
    f"{'exp_p99':>9} {'hit':>6} {'n':>6} lanes"
)


def cmd_run(args: argparse.Namespace) -> int:
    cfg = config_from(args, args.policy, args.rate, args.seed)
    res = run(cfg)
    print(HEADER)
    print(format_row(res))
    print(f"sim wall time {res['sim_wall_s']:.2f} s, simulated {res['sim_end_s']:.1f} s")
    if res.get("per_replica"):
        busy = [round(p["prefill_busy_fraction"], 3) for p in res["per_replica"]]
        print(f"router {res['router']} x{res['routers']}: hit {res['cache_hit_ratio']:.3f} "
              f"(ceiling {res['ceiling_hit_ratio']:.3f}), reasons {res['routing_reasons']}, prefill-busy {busy}")
    if args.json:
        dump(res, args.json)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = make_parser().parse_args(argv)
    try:
        if args.cmd == "run":
            return cmd_run(args)
        from sim.sweep import cmd_sweep

        return cmd_sweep(args)
    except ValidationError as e:
        err = e.errors()[0]
        loc = ".".join(str(x) for x in err["loc"])
        print(f"sim: error: invalid {loc}: {err['msg']}", file=sys.stderr)
    except (PolicyError, RouterError, WorkloadError, CLIError, ValueError, OSError) as e:
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        print(f"sim: error: {msg}", file=sys.stderr)
    return 2
