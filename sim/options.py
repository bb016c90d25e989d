"""The simulator's shared command-line pieces: the common arguments, the ``RunConfig`` they make,
and the one-line result row that ``sim run`` and ``sim sweep`` print."""

from __future__ import annotations

import argparse
from typing import Any

from fairway.cost_model import DEFAULT_PROFILE
from fairway.engine.block_pool import RETENTIONS
from fairway.engine.model import DEFAULT_MAX_NUM_BATCHED_TOKENS, DEFAULT_MAX_NUM_SEQS
from fairway.routing.view_log import DEFAULT_SYNC_PERIOD_S
from fairway.spec import parse_spec
from sim.runner import RunConfig


def add_common_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workload", required=True,
                   help="rag, mixed, agentic, *-spike, trace:PATH, trace:NAME (docs/traces.md)")
    p.add_argument("--duration", type=float, default=None,
                   help="seconds of arrivals (default: 300 for a synthetic workload, the whole trace for trace:PATH)")
    p.add_argument("--time-scale", type=float, default=1.0, help="trace time compression")
    p.add_argument("--concurrency", type=int, default=None, help="fixed-concurrency mode")
    p.add_argument("--replicas", type=int, default=1)
    p.add_argument("--routers", type=int, default=1,
                   help="router instances (one per ingress replica), each routing 1/K of the requests")
    p.add_argument("--router-view", default="shared", choices=["own", "shared"],
                   help="with --routers K: every instance's decisions through one shared view (the cluster's "
                        "default), or each instance's own only")
    p.add_argument("--sync-delay", type=float, default=None,
                   help="shared view: seconds before one instance's decisions and reports reach the others "
                        f"(default: the cluster's sync period, {DEFAULT_SYNC_PERIOD_S} s, with --routers > 1)")
    p.add_argument("--index-mode", default=None, choices=["approx", "lru", "decisions", "events"],
                   help="router prefix index: own decisions + the engines' cached-token feedback with the prompts "
                        "in flight pinned, the same with one LRU over all (the approx index until 2026-12-06), own "
                        "decisions only (what most anchors' originals know), or engine KV events (exact); default: "
                        "the router's own, events for dynamo, else approx")
    p.add_argument("--stale", type=float, default=0.0, help="router load-view staleness (s)")
    p.add_argument("--profile", default=DEFAULT_PROFILE)
    p.add_argument("--kv-blocks", type=int, default=None, help="KV blocks per replica")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-num-seqs", type=int, default=DEFAULT_MAX_NUM_SEQS,
                   help="engine sequence slots per replica (vLLM's default on an H200)")
    p.add_argument("--max-num-batched-tokens", type=int, default=DEFAULT_MAX_NUM_BATCHED_TOKENS)
    p.add_argument("--long-prefill-token-threshold", type=int, default=0,
                   help="the most prompt tokens one request computes in a step, as vLLM's option (0: no cap)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--admission", default="off",
                   help="engine admission gate: off, or session[cold_fraction=..;hold_factor=..;min_hold_s=..;"
                        "max_hold_s=..;session_horizon_s=..;hold_first_turn=..;guard=held|all|policy;"
                        "preempt_for_due=..] (fairway.admission)")
    p.add_argument("--retention", default=None, choices=list(RETENTIONS),
                   help="KV eviction strategy (default: the queue policy's)")
    p.add_argument("--host-kv-blocks", type=int, default=0, help="host (CPU) KV tier per replica, blocks; 0 = off")
    p.add_argument("--classes", default="",
                   help="request classes: name:tier=N:objective=S[:weight=W][:max_wait=S],... (tier: lower first; "
                        "objective: TTFT seconds; max_wait: the wait bound, default the objective); the policies "
                        "classes, priority-fcfs and llmd-flow order by them (sim/flow.py)")
    p.add_argument("--class-mix", default="", help="name=share,...: each request's class, drawn by the seeded RNG")
    p.add_argument("--class-bounds", default="class", choices=["class", "gate"],
                   help="with --classes: refuse on each class's wait bound over the work ahead of it, or on "
                        "today's gate bound (--gate-wait) over all the queued work")
    p.add_argument("--gate-wait", type=float, default=5.0, help="--class-bounds gate: the wait bound (s)")
    p.add_argument("--hold", action="store_true",
                   help="with --classes: the router's held queue, as the product's: a replica has room within "
                        "--gate-wait, a request none has room for waits at the router within its wait bound")
    p.add_argument("--hold-s", type=float, default=10.0,
                   help="--hold with --class-bounds gate: every request's wait bound (router.hold.max_wait_s)")
    p.add_argument("--strict-prefill-first", action="store_true",
                   help="with --classes: a step in which the strictest tier has prefill runs no lower tier's "
                        "prefill (an engine-model option; stock vLLM runs running prefills first)")
    p.add_argument("--no-flow-retry", action="store_true",
                   help="with --classes: a request over the bound on the router's pick is refused, not tried "
                        "on another replica (today's cluster)")


def sync_delay(args: argparse.Namespace) -> float:
    """The shared view's delay: as given, else the cluster's sync period when several router
    instances share a view (one instance has nobody to sync with)."""
    if args.sync_delay is not None:
        return args.sync_delay
    return DEFAULT_SYNC_PERIOD_S if args.routers > 1 and args.router_view == "shared" else 0.0


def config_from(args: argparse.Namespace, policy_spec: str, rate: float, seed: int,
                router_spec: str | None = None) -> RunConfig:
    name, opts = parse_spec(policy_spec)
    rname, ropts = parse_spec(router_spec or args.router)
    admission, admission_options = parse_spec(args.admission)
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
        router_view=args.router_view,
        sync_delay_s=sync_delay(args),
        stale_s=args.stale,
        profile=args.profile,
        kv_blocks=args.kv_blocks,
        block_size=args.block_size,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        long_prefill_token_threshold=args.long_prefill_token_threshold,
        seed=seed,
        admission=admission,
        admission_options=admission_options,
        retention=args.retention,
        host_kv_blocks=args.host_kv_blocks,
        classes=args.classes,
        class_mix=args.class_mix,
        class_bounds=args.class_bounds,
        gate_wait_s=args.gate_wait,
        flow_retry=not args.no_flow_retry,
        hold=args.hold,
        hold_s=args.hold_s,
        strict_prefill_first=args.strict_prefill_first,
    )


def format_row(res: dict[str, Any], rate_key: str = "rate_rps") -> str:
    """One result as a table row; ``rate_key`` picks the rate shown (the configured load in a
    sweep, ``realized_rate_rps`` for ``sim run``)."""
    t = res["ttft_s"]
    ex = res["ttft_by_class_s"]["expensive"]
    lanes = res.get("ttft_by_lane_s") or {}
    lane_s = " ".join(f"{k}:{v['n']}" for k, v in lanes.items())
    return (
        f"{res.get('label', res['policy']):<28} {res[rate_key]:>7.2f} {t['p50']:>9.3f} "
        f"{t['p90']:>9.3f} {t['p99']:>9.3f} {t['mean']:>9.3f} {ex['p99']:>9.3f} "
        f"{res['cache_hit_ratio']:>6.3f} {res['n_finished']:>6d} {lane_s}"
    )


HEADER = (
    f"{'policy':<28} {'rate':>7} {'p50_s':>9} {'p90_s':>9} {'p99_s':>9} {'mean_s':>9} "
    f"{'exp_p99':>9} {'hit':>6} {'n':>6} lanes"
)


