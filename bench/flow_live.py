"""Flow control on the live cluster: a class mix through ``serve run``, with and without strict tiers.

``python -m bench.flow_live [--workload rag] [--load 2] [--speed 0.2] [--duration 30] [--arms classes,strict]``

Each arm starts the cluster of ``deploy/cluster.yaml`` (2 sim-engine replicas, the Fairway router
and gates; the engines' KV capacity the cost profile's, as in the simulator) with two request
classes, ``interactive`` (tier 0) and ``batch`` (tier 1), and sends the workload from the load
generator (``loadgen``) with the simulator's seeded 20/80 class mix as each body's ``priority``:

- ``classes``: classes with ``replica.strict_tiers: false`` (each gate orders by class; the
  engine serves what it was given first-come-first-served, as stock vLLM);
- ``strict``: the product's default with two tiers, ``replica.strict_tiers`` (the sim engine
  serves the interactive tier's prefill first and the gates count their room per tier:
  docs/design.md, Flow control).

Time is slowed by ``--speed`` (the engines' step times divided by it) so that the 2-core machine
that also runs the client, the ingress and both replicas is not what limits the run: the rate,
the objectives (1 s and 30 s at full speed), the classes' wait bounds and the gates' and held
queue's bounds (5 s and 10 s) scale with it, so a run
at speed 0.2 is the full-speed run with every engine time five times longer. ``--rate`` is the
load's full-speed requests per second; by default ``--load`` times the simulator's capacity of the
workload on 2 replicas (``bench.flow``'s 8-replica capacity over 4: ``rag`` 40 req/s).

Prints per arm and class: requests, answered, refused, TTFT p50 / p99 (in full-speed seconds,
that is the measured seconds times the speed) and attainment (the share of the class's requests
whose first token met its objective) and goodput (its requests within objective per full-speed
second of arrivals). ``--out DIR`` keeps each arm's load-generator summary.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from cluster.launch import running_cluster
from loadgen.http_run import HttpLoadRun, HttpRunConfig

#: full-speed req/s at which the default router keeps p99 TTFT under 2 s on 2 replicas
#: (``bench.flow``'s 8-replica capacities, docs/benchmarks.md section 8, over 4)
CAPACITY = {"rag": 40.0, "mixed": 31.0}
OBJECTIVES = {"interactive": 1.0, "batch": 30.0}
MIX = "interactive=0.2,batch=0.8"
GATE_WAIT_S, HOLD_WAIT_S = 5.0, 10.0  # deploy/cluster.yaml's gate and held-queue bounds, scaled like the rest
ARMS = {"classes": False, "strict": True}


def classes(speed: float) -> list[dict[str, Any]]:
    """The two classes, with objectives and wait bounds scaled to the slowed engines."""
    return [{"name": n, "tier": t, "objective_s": OBJECTIVES[n] / speed}
            for t, n in enumerate(("interactive", "batch"))]


def run_arm(arm: str, workload: str, rate: float, speed: float, duration: float, seed: int) -> dict[str, Any]:
    """One cluster with ``arm``'s settings and one load-generator run against it."""
    # the engine model's own KV capacity (the simulator's default, not deploy/cluster.yaml's 20,000 blocks)
    with running_cluster(engine_args={"speed": speed, "kv_blocks": None}, classes=classes(speed),
                         replica={"strict_tiers": ARMS[arm], "max_queue_wait_s": GATE_WAIT_S / speed},
                         router={"hold": {"max_wait_s": HOLD_WAIT_S / speed}}) as url:
        cfg = HttpRunConfig(url=url, workload=workload, rate=rate * speed, duration_s=duration / speed, seed=seed,
                            class_mix=MIX, timeout_s=10 * OBJECTIVES["batch"] / speed,
                            class_objectives=",".join(f"{n}={s / speed:g}" for n, s in OBJECTIVES.items()))
        return asyncio.run(HttpLoadRun(cfg).run())


def rows(arm: str, res: dict[str, Any], speed: float, duration: float) -> list[str]:
    out = []
    for name, c in res["by_class"].items():
        t = c["ttft_s"]
        out.append(f"| {arm} | {name} | {c['n']} | {c['n_finished']} | {c['n_rejected']} | "
                   f"{t['p50'] * speed:.3f} / {t['p99'] * speed:.3f} | {c['attainment']:.3f} | "
                   f"{c['n_met'] / duration:.2f} |")
    return out


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.flow_live", description=__doc__.splitlines()[0])
    ap.add_argument("--workload", default="rag", choices=sorted(CAPACITY))
    ap.add_argument("--load", type=float, default=2.0, help="multiple of the workload's 2-replica capacity")
    ap.add_argument("--rate", type=float, default=None, help="full-speed req/s (default: --load x capacity)")
    ap.add_argument("--speed", type=float, default=0.2, help="the sim engines' speed (< 1 slows them down)")
    ap.add_argument("--duration", type=float, default=30.0, help="full-speed seconds of arrivals (/ speed on the wall)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--arms", default=",".join(ARMS), help=f"a subset of {', '.join(ARMS)}")
    ap.add_argument("--out", default=None, help="a folder for each arm's load-generator summary (JSON)")
    a = ap.parse_args(argv)
    arms = [x for x in a.arms.split(",") if x]
    unknown = [x for x in arms if x not in ARMS]
    if unknown or not 0 < a.speed <= 1:
        print(f"bad arguments: arms {unknown or arms}, speed {a.speed} (arms: {', '.join(ARMS)}; 0 < speed <= 1)",
              file=sys.stderr)
        return 2
    rate = a.rate if a.rate is not None else a.load * CAPACITY[a.workload]
    lines = [f"{a.workload} at {rate:g} req/s full speed ({rate * a.speed:g} req/s at speed {a.speed:g}), "
             f"{a.duration:g} s of arrivals, seed {a.seed}; TTFT in full-speed seconds",
             "", "| arm | class | sent | answered | refused | TTFT p50 / p99 s | attainment | goodput req/s |",
             "| --- | --- | ---: | ---: | ---: | --- | --- | ---: |"]
    for arm in arms:
        res = run_arm(arm, a.workload, rate, a.speed, a.duration, a.seed)
        if a.out:
            Path(a.out).mkdir(parents=True, exist_ok=True)
            (Path(a.out) / f"{a.workload}-{arm}-s{a.seed}.json").write_text(json.dumps(res, indent=1))
        lines += rows(arm, res, a.speed, a.duration)
        print(lines[-2], lines[-1], sep="\n", file=sys.stderr)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
