"""Flow control between request classes: the class policy against today's default and two anchors,
from half to three times capacity, in the 8-replica simulator.

``python -m bench.flow [--workloads rag,mixed] [--loads 0.5,1,2,3] [--duration 60] [--jobs 2]``

Each workload's requests are labelled 20% ``interactive`` (tier 0, TTFT objective 1 s, wait bound
1 s) and 80% ``batch`` (tier 1, objective 30 s, wait bound 30 s) by the simulator's seeded class
mix, and every arm routes with the Fairway router over 8 replicas:

- ``default``: the product without classes: Fairway's queue policy, classes ignored; a replica
  has room while its queued prefill work is within the gates' wait bound (5 s); a request its
  pick has no room for goes to the next replica with room, else waits in the router's held queue
  for its pick to have room, within a wait bound of 10 s (``router.hold.max_wait_s``) of which
  the gate's 5 s are the last (``sim/flow.py``).
- ``refuse``: the cluster before the held queue: as ``default``, but a request its pick refuses
  is refused (429), not tried elsewhere nor held.
- ``priority-fcfs``: strict priority, then arrival order (``fairway/policies/flow_anchors.py``).
- ``llmd-flow``: llm-d's flow control: priority band, then round-robin between the band's flows
  (tenants; the shared workloads have one per class), then FCFS within a flow.
- ``classes``: the class policy (``fairway/policies/classes.py``: strict tiers, weighted fair
  sharing of prefill work, Fairway's lanes within a class) in front of engines that serve what
  they admitted in vLLM's own order (the cluster with ``replica.strict_tiers: false``).
- ``classes-strict``: **the product with classes** (``PRODUCT``): ``classes`` with the engine
  model's ``strict_prefill_first``, a step in which the interactive tier has prefill to run runs
  no batch prefill (decodes go on); the cluster's ``replica.strict_tiers``, on by default when the
  classes span two tiers (the sim engine has the rule, vLLM gets it through a scheduler class).
  ``priority-fcfs-strict`` and ``llmd-flow-strict``: the anchors on the same engine, so the rule
  is compared like with like (docs/history/2026-12-03-strict-prefill.md).
- ``classes-nohold``: the class policy with the router's class check alone: a request goes to the
  first replica of the router's ranking where the work its queue order puts ahead of it is within
  its class's wait bound, else it is refused at once (the simulator before the held queue).

``priority-fcfs``, ``llmd-flow`` and ``classes`` (and their strict arms) share the product's admission (each gate's room
counted on the work ahead of the request's class, the retry, the held queue ordered as their own
queues with each class's wait bound, a request still queued at a replica when its class's bound
passes refused there), so they differ only in the order. Capacity is the highest
rate at which ``default`` keeps p99 TTFT under 2 s with no classes (a doubling search, then
bisection); loads are multiples of it. The interactive TTFT of an idle cluster is the product
arm's at 0.1x.

Targets (the issue's), for the product arm: at 2x, interactive p99 within 1.5x of idle and
attainment >= 99%, batch goodput at least the best anchor's (on either engine), no batch request
past its wait bound unanswered; below capacity, p50 and p99 within 1.02x of ``default``'s; no
refusal while any replica had room. The held queue's decision time is ``python -m bench.decision --held 10000``.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

from bench.tables import md_table
from sim.runner import RunConfig, run

CLASSES = "interactive:tier=0:objective=1,batch:tier=1:objective=30"
MIX = "interactive=0.2,batch=0.8"
ARMS: dict[str, dict[str, Any]] = {
    "default": {"policy": "fairway", "class_bounds": "gate", "hold": True},
    "refuse": {"policy": "fairway", "class_bounds": "gate", "flow_retry": False},
    "priority-fcfs": {"policy": "priority-fcfs", "hold": True},
    "llmd-flow": {"policy": "llmd-flow", "hold": True},
    "classes": {"policy": "classes", "hold": True},
    "classes-nohold": {"policy": "classes"},
}
ANCHORS = ("priority-fcfs", "llmd-flow")
# the class arm and the anchors on the engine model's strict-tier prefill
ARMS.update({f"{a}-strict": {**ARMS[a], "strict_prefill_first": True} for a in ("classes", *ANCHORS)})
DEFAULT_ARMS = tuple(ARMS)
PRODUCT = "classes-strict"  # the shipped configuration with two tiers (replica.strict_tiers on by default)
IDLE_LOAD = 0.1


def config(workload: str, rate: float, arm: str, *, replicas: int, duration: float, seed: int) -> RunConfig:
    return RunConfig(workload=workload, rate=rate, duration_s=duration, replicas=replicas, router="fairway",
                     seed=seed, classes=CLASSES, class_mix=MIX, **ARMS[arm])


def _p99(cfg: RunConfig) -> float:
    return float(run(cfg)["ttft_s"]["p99"])


def capacity(workload: str, *, replicas: int, duration: float, seed: int, steps: int = 4) -> float:
    """The highest rate (req/s) whose p99 TTFT stays under 2 s with today's default and no
    classes: doubling from 8, then ``steps`` bisections."""
    def ok(rate: float) -> bool:
        return _p99(RunConfig(workload=workload, rate=rate, duration_s=duration, replicas=replicas,
                              router="fairway", policy="fairway", seed=seed)) < 2.0

    lo, hi = 0.0, 8.0
    while ok(hi):
        lo, hi = hi, hi * 2
        if hi > 8192:
            return lo
    for _ in range(steps):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid)
    return lo


def _run(cfg: RunConfig) -> dict[str, Any]:
    return run(cfg)


def row_of(res: dict[str, Any]) -> dict[str, Any]:
    """The figures the table shows, from one run's summary."""
    per = res["flow"]["classes"]
    i, b = per["interactive"], per["batch"]
    return {
        "int_p50": i["ttft_s"]["p50"], "int_p99": i["ttft_s"]["p99"], "int_att": i["attainment"],
        "batch_p50": b["ttft_s"]["p50"], "batch_p99": b["ttft_s"]["p99"], "batch_goodput": b["goodput_rps"],
        "batch_att": b["attainment"], "batch_over": b["over_bound"],
        "refused": i["refused"] + b["refused"], "refused_room": res["flow"]["refused_with_room"],
        "held": res["flow"].get("held", 0), "hold_p99": res["flow"].get("hold_s", {}).get("p99", 0.0),
        "p50": res["ttft_s"]["p50"], "p99": res["ttft_s"]["p99"],
    }


def verdicts(rows: dict[tuple[str, float, str], dict[str, Any]], idle: dict[str, float],
             loads: Sequence[float]) -> list[str]:
    """The issue's targets for the product arm, one line each per workload (module docstring);
    the best anchor is the best of those run, on either engine. Pure."""
    out = []
    arms = {k[2] for k in rows}
    if not {PRODUCT, "default", *ANCHORS} <= arms:
        return [f"verdicts need the arms {PRODUCT}, default, {', '.join(ANCHORS)}: not all run"]
    anchors = [a for a in (*ANCHORS, *(f"{x}-strict" for x in ANCHORS)) if a in arms]
    for w in sorted({k[0] for k in rows}):
        if 2.0 in loads:
            c = rows[w, 2.0, PRODUCT]
            best = max(rows[w, 2.0, a]["batch_goodput"] for a in anchors)
            lim = 1.5 * idle[w]
            out.append(f"{w} 2x: interactive p99 {c['int_p99']:.3f} s vs 1.5 x idle {lim:.3f} s: "
                       f"{'met' if c['int_p99'] <= lim else 'MISSED'}; attainment {c['int_att']:.4f}: "
                       f"{'met' if c['int_att'] >= 0.99 else 'MISSED'}; batch goodput {c['batch_goodput']:.2f} vs "
                       f"best anchor {best:.2f} req/s: {'met' if c['batch_goodput'] >= best else 'MISSED'}; batch "
                       f"past its bound {c['batch_over']}: {'met' if c['batch_over'] == 0 else 'MISSED'}")
        for load in (x for x in loads if x < 1.0):
            c, d = rows[w, load, PRODUCT], rows[w, load, "default"]
            r50, r99 = c["p50"] / d["p50"], c["p99"] / d["p99"]
            out.append(f"{w} {load:g}x: p50 {r50:.3f}x, p99 {r99:.3f}x of default: "
                       f"{'met' if max(r50, r99) <= 1.02 else 'MISSED'}")
        room = sum(r["refused_room"] for k, r in rows.items() if k[0] == w and k[2] == PRODUCT)
        out.append(f"{w}: refusals while a replica had room ({PRODUCT}, all loads) {room}: "
                   f"{'met' if room == 0 else 'MISSED'}")
    return out


def render(rows: dict[tuple[str, float, str], dict[str, Any]], caps: dict[str, float]) -> str:
    header = ["workload", "load", "arm", "int p50", "int p99", "int att", "batch p50", "batch p99",
              "batch goodput", "batch att", "refused", "refused w/ room", "held", "hold p99", "p50", "p99"]
    body = []
    for (w, load, arm), r in sorted(rows.items(), key=lambda kv: (kv[0][0], kv[0][1], list(ARMS).index(kv[0][2]))):
        body.append([w, f"{load:g}x ({load * caps[w]:.0f}/s)", arm, r["int_p50"], r["int_p99"], r["int_att"],
                     r["batch_p50"], r["batch_p99"], f"{r['batch_goodput']:.2f}", r["batch_att"], r["refused"],
                     r["refused_room"], r["held"], r["hold_p99"], r["p50"], r["p99"]])
    return md_table(header, body, "lll" + "r" * (len(header) - 3))


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.flow", description=__doc__.splitlines()[0])
    ap.add_argument("--workloads", default="rag,mixed")
    ap.add_argument("--loads", default="0.5,1,2,3", help="multiples of capacity")
    ap.add_argument("--replicas", type=int, default=8)
    ap.add_argument("--duration", type=float, default=60.0, help="seconds of arrivals per run")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--capacity", default=None, help="workload=req/s,... instead of measuring it")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--arms", default=",".join(DEFAULT_ARMS),
                    help=f"a subset of {', '.join(ARMS)} (default: all; the verdicts need default, "
                         f"{PRODUCT} and the anchors)")
    ap.add_argument("--out", default=None, help="write every run's summary here (JSON)")
    a = ap.parse_args(argv)
    workloads = [w for w in a.workloads.split(",") if w]
    loads = [float(x) for x in a.loads.split(",")]
    kw = {"replicas": a.replicas, "duration": a.duration, "seed": a.seed}
    given = dict((k, float(v)) for k, v in (p.split("=") for p in a.capacity.split(","))) if a.capacity else {}
    caps = {w: given.get(w) or capacity(w, **kw) for w in workloads}
    print("capacity: " + ", ".join(f"{w} {c:g} req/s" for w, c in caps.items()), file=sys.stderr)
    arms = [x for x in a.arms.split(",") if x]
    jobs = {(w, load, arm): config(w, load * caps[w], arm, **kw) for w in workloads for load in loads for arm in arms}
    jobs.update({(w, IDLE_LOAD, "idle"): config(w, IDLE_LOAD * caps[w], PRODUCT, **kw) for w in workloads})
    with ProcessPoolExecutor(max_workers=a.jobs) as ex:
        results = dict(zip(jobs, ex.map(_run, jobs.values()), strict=True))
    rows = {k: row_of(r) for k, r in results.items() if k[2] != "idle"}
    idle = {w: row_of(results[w, IDLE_LOAD, "idle"])["int_p99"] for w in workloads}
    print(render(rows, caps))
    print()
    print("idle interactive p99: " + ", ".join(f"{w} {v:.3f} s" for w, v in idle.items()))
    for line in verdicts(rows, idle, loads):
        print(line)
    if a.out:
        Path(a.out).write_text(json.dumps({"capacity": caps, "runs": [
            {"workload": k[0], "load": k[1], "arm": k[2], **r} for k, r in results.items()]}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
