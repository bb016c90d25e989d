"""The issue-4 cluster benchmarks: router overhead, simulated vs real TTFT, routers on the cluster.

``python -m bench.cluster all --out out/bench-cluster`` (what ``scripts/bench_cluster.sh``
runs) does, each step starting its own ``serve run`` cluster from ``deploy/cluster.yaml``
(``cluster/launch.py:running_cluster``, overrides merged into the app args):

1. ``overhead``: ``python -m bench.overhead`` against the default cluster (HTTP vs
   handle vs direct-actor latency with a cached 8k-token prompt, and the routing decision time,
   in the cluster and offline for 2 and 16 replicas) -> ``overhead.json``;
2. ``sim-vs-real``: ``python -m sim run`` and the load generator on the same workload, rate,
   duration and seed, 2 replicas x 20,000 KV blocks, Fairway router and gate; the real run once
   per sim-engine ``pacing`` and pass -> ``simreal-sim.json``, ``simreal-real-<pacing>-r<k>.json``
   (+ ``-engine.json``: each replica's real-time pacing figures);
3. ``routers``: a workload through clusters whose router policy is overridden
   (``router={"policy": P}``), plus the simulator's figure for each policy it models ->
   ``routers-<P>-r<k>.json``, ``routers-sim-<P>.json``.

With ``--repeats K`` each part makes K passes, alternating direction (A B C, C B A, ...). ``load``
is one load-generator run, ``report`` turns a folder of the JSON files into ``tables.md``, and
``hold`` keeps a cluster up for interactive diagnosis.

This module holds the steps and the command line. The port and process checks around each cluster
are in ``bench/machine.py``; running commands and what each run's JSON records (code fingerprint,
load average, ``load``) in ``bench/recording.py``; the tables and the report in ``bench/tables.py``.
"""

from __future__ import annotations

import argparse
import json
import signal
import time
from pathlib import Path
from typing import Any

from bench.machine import cluster
from bench.recording import (
    PY,
    SIM_ROUTERS,
    Runner,
    Snapshot,
    _sim_router,
    check_clean,
    engine_info,
    load_run,
    loadgen_argv,
    sim_argv,
)
from bench.tables import report


def cmd_overhead(args: argparse.Namespace) -> None:
    r = Runner(Path(args.out))
    code = Snapshot()
    with cluster() as (url, addr):
        r.run([PY, "-m", "bench.overhead", "--url", url, "--ray-address", addr, "--n", str(args.n),
               "--json", str(r.out / "overhead.json")], note="inside `running_cluster()` (deploy/cluster.yaml)")
    r.stamp("overhead.json", code)


def sim_run(r: Runner, argv: list[str], name: str) -> None:
    code = Snapshot()
    r.run(argv)
    r.stamp(name, code)


def run_order(items: list[str], repeats: int) -> list[tuple[str, str]]:
    """``(item, tag)`` in execution order: pass k runs ``items`` forward when k is odd and
    backward when even (A B C, C B A, ...), so slow drift of the machine's load does not favour
    whichever runs first. ``tag`` is ``item`` (one pass) or ``item-rK``."""
    out = []
    for k in range(1, repeats + 1):
        for it in items if k % 2 else items[::-1]:
            out.append((it, it if repeats == 1 else f"{it}-r{k}"))
    return out


def cmd_sim_vs_real(args: argparse.Namespace) -> None:
    r = Runner(Path(args.out))
    w, rate, dur, seed = args.workload, args.rate, args.duration, args.seed
    sim_run(r, sim_argv(w, rate, dur, seed, "fairway", r.out / "simreal-sim.json"), "simreal-sim.json")
    runs = run_order(args.pacing.split(","), args.repeats)
    for pacing, tag in runs:
        code = Snapshot()
        with cluster(engine_args={"pacing": pacing}) as (url, addr):
            r.run(loadgen_argv(url, w, rate, dur, seed, r.out / f"simreal-real-{tag}.json"),
                  note=f"inside `running_cluster(engine_args={{'pacing': '{pacing}'}})`")
            engine_info(r, addr, r.out / f"simreal-real-{tag}-engine.json")
        check_clean(r, f"simreal-real-{tag}.json", f"simreal-real-{tag}-engine.json", code)
    r.write("simreal-meta.json", {"workload": w, "rate": rate, "duration_s": dur, "seed": seed,
                                  "runs": [t for _, t in runs]})


def router_specs(arg: str) -> dict[str, str]:
    """``--policies``: comma-separated router specs, each optionally named ``tag=spec``
    (``fairway,prev=fairway[rule=affinity;wait_model=fcfs]``); the tag names files and rows.
    Returns tag -> spec, in order."""
    from fairway.spec import split_specs

    out: dict[str, str] = {}
    for item in split_specs(arg):
        head = item.split("[", 1)[0]
        tag, spec = item.split("=", 1) if "=" in head else (item, item)
        out[tag.strip()] = spec.strip()
    return out


def cmd_routers(args: argparse.Namespace) -> None:
    r = Runner(Path(args.out))
    w, rate, dur, seed = args.workload, args.rate, args.duration, args.seed
    specs = router_specs(args.policies)
    policies = list(specs)
    for p in policies:
        if _sim_router(specs[p])[0] in SIM_ROUTERS:
            sim_run(r, sim_argv(w, rate, dur, seed, specs[p], r.out / f"routers-sim-{p}.json"),
                    f"routers-sim-{p}.json")
    runs = run_order(policies, args.repeats)
    for p, tag in runs:
        code = Snapshot()
        name, opts = _sim_router(specs[p])
        with cluster(router={"policy": name, "policy_options": opts}) as (url, addr):
            r.run(loadgen_argv(url, w, rate, dur, seed, r.out / f"routers-{tag}.json"),
                  note=f"inside `running_cluster(router={{'policy': '{name}', 'policy_options': {opts}}})`")
            engine_info(r, addr, r.out / f"routers-{tag}-engine.json")
        check_clean(r, f"routers-{tag}.json", f"routers-{tag}-engine.json", code)
    r.write("routers-meta.json", {"workload": w, "rate": rate, "duration_s": dur, "seed": seed,
                                  "policies": policies, "specs": specs, "runs": [t for _, t in runs]})


# -- command line ---------------------------------------------------------------------------------


def make_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m bench.cluster", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)

    def common(p: argparse.ArgumentParser, workload: str, rate: float, duration: float) -> None:
        p.add_argument("--out", default="out/bench-cluster")
        p.add_argument("--workload", default=workload)
        p.add_argument("--rate", type=float, default=rate)
        p.add_argument("--duration", type=float, default=duration)
        p.add_argument("--seed", type=int, default=1)

    o = sub.add_parser("overhead", help="router overhead (one cluster)")
    o.add_argument("--out", default="out/bench-cluster")
    o.add_argument("--n", type=int, default=500)
    s = sub.add_parser("sim-vs-real", help="sim run vs loadgen run on the cluster")
    common(s, "mixed", 2.0, 120.0)
    s.add_argument("--pacing", default="deadline,sleep", help="sim-engine pacing modes to run (comma-separated)")
    s.add_argument("--repeats", type=int, default=1, help="passes over the modes, alternating order")
    r = sub.add_parser("routers", help="router policies on the cluster")
    common(r, "rag-spike", 2.0, 120.0)
    r.add_argument("--policies", default="fairway,pow2,ray-prefix,ray-default",
                   help="router specs, comma-separated, each optionally tag=spec: prev=fairway[rule=affinity]")
    r.add_argument("--repeats", type=int, default=1, help="passes over the policies, alternating order")
    ld = sub.add_parser("load", help="python -m loadgen run + the client/server TTFT split")
    ld.add_argument("--url", required=True)
    ld.add_argument("--workload", required=True)
    ld.add_argument("--rate", type=float, required=True)
    ld.add_argument("--duration", type=float, required=True)
    ld.add_argument("--seed", type=int, default=1)
    ld.add_argument("--timeout-s", type=float, default=300.0)
    ld.add_argument("--json", required=True)
    h = sub.add_parser("hold", help="start a cluster, print its URL and Ray address, keep it up (diagnosis)")
    h.add_argument("--seconds", type=float, default=600.0)
    h.add_argument("--overrides", default="{}", help="JSON merged into the app args")
    rep = sub.add_parser("report", help="tables.md from the JSON files")
    rep.add_argument("--out", default="out/bench-cluster")
    a = sub.add_parser("all", help="overhead, sim-vs-real, routers, report")
    a.add_argument("--out", default="out/bench-cluster")
    a.add_argument("--n", type=int, default=500)
    a.add_argument("--seed", type=int, default=1)
    a.add_argument("--simreal", default="mixed:2:120", help="workload:rate:duration")
    a.add_argument("--pacing", default="deadline,sleep")
    a.add_argument("--routers", default="rag-spike:2:120", help="workload:rate:duration")
    a.add_argument("--policies", default="fairway,pow2,ray-prefix,ray-default")
    a.add_argument("--repeats", type=int, default=2, help="passes (alternating order) for sim-vs-real and routers")
    return ap


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: list[str] | None = None) -> int:
    args = make_parser().parse_args(argv)
    # A background job starts with SIGINT ignored, and children inherit that: restore the
    # handlers so ``kill`` (TERM) or Ctrl-C stops our clusters cleanly (running_cluster's finally).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, _interrupt)
    if args.cmd == "load":
        from loadgen.cli import format_summary

        res = load_run(args.url, args.workload, args.rate, args.duration, args.seed, args.timeout_s)
        Path(args.json).write_text(json.dumps(res, indent=1))
        print(format_summary(res))
        sv, cl = res["server_ttft_s"], res["client_side_s"]
        print(f"ingress-measured TTFT p50 {sv['p50']:.3f} p99 {sv['p99']:.3f} s; "
              f"client side p50 {cl['p50'] * 1e3:.1f} ms p99 {cl['p99'] * 1e3:.1f} ms")
        return 0
    if args.cmd == "hold":
        with cluster(**json.loads(args.overrides)) as (url, addr):
            print(f"[bench] holding {url} ray {addr} for {args.seconds:.0f} s", flush=True)
            time.sleep(args.seconds)
        return 0
    if args.cmd == "overhead":
        cmd_overhead(args)
    elif args.cmd == "sim-vs-real":
        cmd_sim_vs_real(args)
    elif args.cmd == "routers":
        cmd_routers(args)
    elif args.cmd == "all":
        cmd_overhead(args)
        for key, fn in (("simreal", cmd_sim_vs_real), ("routers", cmd_routers)):
            w, rate, dur = getattr(args, key).split(":")
            fn(argparse.Namespace(**vars(args), workload=w, rate=float(rate), duration=float(dur)))
    print(report(Path(args.out)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
