"""``python -m loadgen run``: replay a workload against an OpenAI-compatible server over HTTP.

Bad input (an unknown workload, a bad value, an unreachable server) exits 2 with one line on
stderr, as ``python -m sim`` does.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from typing import Any

from pydantic import ValidationError

from fairway.request import WorkloadError
from loadgen.accounting import format_report
from loadgen.http_client import ServerError
from loadgen.http_run import HttpLoadRun, HttpRunConfig, build_workload


def make_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m loadgen", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="send a workload to a server and summarise latencies")
    r.add_argument("--url", required=True, help="server base URL, e.g. http://127.0.0.1:8000")
    r.add_argument("--workload", required=True, help="rag, mixed, agentic, *-spike, hotspot, trace:PATH")
    r.add_argument("--rate", type=float, default=4.0, help="req/s (agentic: sessions/s)")
    r.add_argument("--duration", type=float, default=None,
                   help="seconds of arrivals (default: 300 for a synthetic workload, the whole trace for trace:PATH)")
    r.add_argument("--concurrency", type=int, default=None, help="fixed-concurrency mode")
    r.add_argument("--time-scale", type=float, default=1.0, help="trace time compression")
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--block-size", type=int, default=16, help="tokens per hashed block")
    r.add_argument("--model", default=None, help="model name (default: the first of GET /v1/models)")
    r.add_argument("--vocab-size", type=int, default=4096, help="token ids are drawn below this")
    r.add_argument("--max-requests", type=int, default=None, help="send at most this many requests")
    r.add_argument("--stop-after", type=float, default=None, help="send nothing after this many seconds")
    r.add_argument("--timeout-s", type=float, default=600.0, help="total time limit per request")
    r.add_argument("--retries", type=int, default=0, help="retries of a 429/503, after its Retry-After")
    r.add_argument("--api-key-env", default=None, help="environment variable holding the API key to send")
    r.add_argument("--disconnect-fraction", type=float, default=0.0,
                   help="share of clients that hang up on purpose (half at a random time, half mid-stream)")
    r.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                   help="progress line on stderr (default: when stderr is a terminal)")
    r.add_argument("--class-mix", default="", help="name=share,...: each request's class, sent as the body's "
                   "priority (drawn as the simulator's --class-mix)")
    r.add_argument("--class-objectives", default="", help="name=seconds,...: TTFT objectives, for attainment by class")
    r.add_argument("--json", default=None, help="write the summary JSON here")
    return ap


def config_from(args: argparse.Namespace) -> HttpRunConfig:
    return HttpRunConfig(
        url=args.url,
        workload=args.workload,
        rate=args.rate,
        duration_s=args.duration,
        time_scale=args.time_scale,
        concurrency=args.concurrency,
        seed=args.seed,
        block_size=args.block_size,
        model=args.model,
        vocab_size=args.vocab_size,
        max_requests=args.max_requests,
        stop_after_s=args.stop_after,
        timeout_s=args.timeout_s,
        retries=args.retries,
        disconnect_fraction=args.disconnect_fraction,
        api_key=os.environ.get(args.api_key_env) if args.api_key_env else None,
        class_mix=args.class_mix,
        class_objectives=args.class_objectives,
    )


def format_summary(res: dict[str, Any]) -> str:
    t, itl, e2e = res["ttft_s"], res["itl_s"], res["e2e_s"]
    lanes = " ".join(f"{k}:{v['n']}" for k, v in (res.get("ttft_by_lane_s") or {}).items()) or "-"
    errors = " ".join(f"{k}:{v}" for k, v in res["errors_by_status"].items()) or "-"
    return (
        f"{res['workload']} -> {res['url']} ({res['model']}), {res['wall_s']:.1f} s\n"
        f"requests {res['n_requests']}: ok {res['n_finished']}, rejected {res['n_rejected']}, "
        f"unfinished {res['n_unfinished']}; errors {errors}\n"
        f"ttft p50 {t['p50']:.3f} p90 {t['p90']:.3f} p99 {t['p99']:.3f} s | itl p50 {itl['p50'] * 1e3:.1f} ms "
        f"| tpot p50 {res['tpot_s']['p50'] * 1e3:.1f} ms | e2e p50 {e2e['p50']:.2f} s "
        f"| served {res['served_rps']:.2f} req/s | hit {res['cache_hit_ratio']:.3f} | lanes {lanes}\n"
        f"accounting: {format_report(res['accounting'])}"
    )


def format_lane_table(res: dict[str, Any]) -> str:
    """TTFT per Fairway lane (as the replicas report each request's lane) and per replica."""
    rows = [("lane", "requests", "ttft p50 s", "ttft p99 s")]
    for lane, v in sorted((res.get("ttft_by_lane_s") or {}).items()):
        rows.append((lane or "-", str(v["n"]), f"{v['p50']:.3f}", f"{v['p99']:.3f}"))
    t = res["ttft_s"]
    rows.append(("all", str(t["n"]), f"{t['p50']:.3f}", f"{t['p99']:.3f}"))
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True)))
             for r in rows]
    for rep in res.get("per_replica") or []:
        lines.append(f"replica {rep['replica']}: {rep['requests']} requests, hit ratio {rep['hit_ratio']:.3f}")
    for name, c in (res.get("by_class") or {}).items():
        att = f", attainment {c['attainment']:.3f} (objective {c['objective_s']:g} s)" if "attainment" in c else ""
        lines.append(f"class {name}: {c['n']} sent, {c['n_finished']} ok, {c['n_rejected']} refused, ttft p50 "
                     f"{c['ttft_s']['p50']:.3f} p99 {c['ttft_s']['p99']:.3f} s{att}")
    return "\n".join(lines)


def cmd_run(args: argparse.Namespace) -> int:
    cfg = config_from(args)
    workload = build_workload(cfg)  # bad workload names fail here, before the server is contacted
    show = sys.stderr.isatty() if args.progress is None else args.progress
    runner = HttpLoadRun(cfg, workload, progress=sys.stderr if show else None)
    res = asyncio.run(runner.run())
    print(format_summary(res))
    print(format_lane_table(res))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = make_parser().parse_args(argv)
    try:
        return cmd_run(args)
    except ValidationError as e:
        err = e.errors()[0]
        loc = ".".join(str(x) for x in err["loc"])
        print(f"loadgen: error: invalid {loc}: {err['msg']}", file=sys.stderr)
    except (ServerError, WorkloadError, ValueError, OSError) as e:
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        print(f"loadgen: error: {msg}", file=sys.stderr)
    return 2
