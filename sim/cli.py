"""``python -m sim run|sweep|offline``: the simulator's command line. Deterministic under ``--seed``."""

from __future__ import annotations

import argparse
import sys

from pydantic import ValidationError

from fairway.policies import PolicyError
from fairway.routing import RouterError
from fairway.spec import SpecError
from sim.offline import add_offline_args, cmd_offline
from sim.options import HEADER, add_common_args, config_from, format_row
from sim.runner import dump, run
from sim.sweep import cmd_sweep
from workloads.registry import WorkloadError


def make_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m sim", description=__doc__)
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="simulate one policy at one rate")
    add_common_args(r)
    r.add_argument("--policy", required=True, help="name or name[key=value;...]")
    r.add_argument("--router", default="round-robin", help="router policy with --replicas > 1")
    r.add_argument("--rate", type=float, default=4.0,
                   help="req/s (agentic: sessions/s); a trace replay ignores it (see --time-scale)")
    r.add_argument("--json", default=None, help="write the summary JSON here")
    s = sub.add_parser("sweep", help="policies x rates: table, JSON and plots")
    add_common_args(s)
    s.add_argument("--policies", required=True, help="comma-separated policy specs")
    s.add_argument("--router", default="round-robin",
                   help="comma-separated router specs (with --replicas > 1): one table row each")
    s.add_argument("--rates", default="4", help="comma-separated rates")
    s.add_argument("--time-scales", default=None,
                   help="comma-separated trace time scales (x axis instead of --rates)")
    s.add_argument("--seeds", default=None, help="comma-separated seeds (default: --seed)")
    s.add_argument("--out", required=True, help="output folder for JSON and PNG plots")
    s.add_argument("--jobs", type=int, default=2, help="parallel processes")
    o = sub.add_parser("offline", help="plan a backlog at t=0 under a KV budget (Sorted-F, FCFS, ...) vs a lower bound")
    add_offline_args(o)
    return ap


def cmd_run(args: argparse.Namespace) -> int:
    cfg = config_from(args, args.policy, args.rate, args.seed)
    res = run(cfg)
    print(HEADER.replace("   rate", "  req/s", 1))  # the realised arrival rate, whatever set it
    print(format_row(res, "realized_rate_rps"))
    print(f"sim wall time {res['sim_wall_s']:.2f} s, simulated {res['sim_end_s']:.1f} s")
    if res.get("per_replica"):
        busy = [round(p["prefill_busy_fraction"], 3) for p in res["per_replica"]]
        print(f"router {res['router']} x{res['routers']} ({cfg.index_mode} index): hit {res['cache_hit_ratio']:.3f} "
              f"(bound {res['hit_bound_capacity']:.3f} at this capacity, {res['hit_bound_infinite']:.3f} with no "
              f"eviction; LRU replay {res['ceiling_hit_ratio']:.3f}), reasons {res['routing_reasons']}, "
              f"prefill-busy {busy}")
        f = res["ttft_floor_s"]
        print(f"TTFT floor (no router or queue order does better): p50 {f['p50']:.3f} s, p99 {f['p99']:.3f} s")
    for name, c in (res.get("flow") or {}).get("classes", {}).items():
        print(f"class {name}: TTFT p50 {c['ttft_s']['p50']:.3f} s, p99 {c['ttft_s']['p99']:.3f} s, attainment "
              f"{c['attainment']:.3f} (objective {c['objective_s']:g} s), goodput {c['goodput_rps']:.2f} req/s, "
              f"refused {c['refused']}/{c['arrived']}, over the wait bound {c['over_bound']}")
    if res.get("flow"):
        f = res["flow"]
        print(f"flow control: refused while a replica had room {f['refused_with_room']}, tried elsewhere "
              f"{f['retried']}")
    if args.json:
        dump(res, args.json)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = make_parser().parse_args(argv)
    try:
        if args.cmd == "run":
            return cmd_run(args)
        if args.cmd == "offline":
            return cmd_offline(args)
        return cmd_sweep(args)
    except ValidationError as e:
        err = e.errors()[0]
        loc = ".".join(str(x) for x in err["loc"])
        print(f"sim: error: invalid {loc}: {err['msg']}", file=sys.stderr)
    except (PolicyError, RouterError, WorkloadError, SpecError, ValueError, OSError) as e:
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        print(f"sim: error: {msg}", file=sys.stderr)
    return 2
