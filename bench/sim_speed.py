"""Simulator speed, side by side: the same ``sim run`` commands on two code trees, timed, with a
digest of each run's result, so "bit-identical and faster" is one command.

``python -m bench.sim_speed --base e07d341 [--runs A,B,C,D] [--repeat 3]``

exports ``--base`` (any git revision) with ``git archive`` into a temporary folder and runs every
command on it and on this checkout, alternating the two trees within each repeat (so a noisy
neighbour slows both alike). Each run is a fresh ``python -P -m sim run ... --json FILE`` process
with ``PYTHONPATH`` set to its tree and the same working directory (this checkout's root, so a
relative trace path means the same file for both). Measured per process: CPU time (user + sys of
the child, from ``os.wait4``: the figure to compare on a shared machine) and wall time; medians
over the repeats are printed. The digest is the SHA-256 of the run's ``--json`` summary with its
one volatile field, ``sim_wall_s``, removed and the rest re-serialised as ``sim.runner.dump`` writes
it. The exit status is 1 if any digest differs between the trees or between repeats.

Runs (the reference set of issue 22, item 6): A/B/C replay the Mooncake synthetic trace at x3 on 8
replicas under the ``fairway``, ``llmd`` and ``dynamo`` (events index) routers; D is one replica
on the ``agentic`` workload at concurrency 100. E, asked for by name only (``--runs E``), is the
issue's one-hour trace: the Mooncake conversation trace at its own pace on 8 replicas under
``fairway``; it runs where ``trace_dir()`` (``$FAIRWAY_TRACE_DIR``) holds that trace, and is
skipped with a message elsewhere.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from fairway.request import WorkloadError
from workloads.traces import TRACE_DIR_ENV, resolve_trace

ROOT = Path(__file__).resolve().parent.parent
TRACE = ["--replicas", "8", "--policy", "fairway", "--workload",
         "trace:../shared/traces/mooncake_synthetic_trace.jsonl", "--duration", "1e9", "--time-scale", "3",
         "--seed", "0"]
RUNS: dict[str, list[str]] = {
    "A": [*TRACE, "--router", "fairway"],
    "B": [*TRACE, "--router", "llmd"],
    "C": [*TRACE, "--router", "dynamo", "--index-mode", "events"],
    "D": ["--workload", "agentic", "--concurrency", "100", "--duration", "300", "--seed", "0", "--policy", "fairway"],
    "E": ["--replicas", "8", "--policy", "fairway", "--router", "fairway", "--workload", "trace:mooncake-conversation",
          "--seed", "0"],
}
DEFAULT_RUNS = "A,B,C,D"
NAMED_TRACE = {"E": "mooncake-conversation"}  # runs that need a named trace, which may be absent
VOLATILE = ("sim_wall_s",)


@dataclass
class Sample:
    """One run of one command on one tree: CPU and wall seconds, and the result's digest."""

    cpu_s: list[float] = field(default_factory=list)
    wall_s: list[float] = field(default_factory=list)
    digests: set[str] = field(default_factory=set)


def digest(path: str) -> str:
    """SHA-256 of a ``sim run --json`` summary without its volatile fields. O(file size)."""
    with open(path) as f:
        res = json.load(f)
    for k in VOLATILE:
        res.pop(k, None)
    return hashlib.sha256(json.dumps(res, indent=1, sort_keys=False).encode()).hexdigest()


def run_once(tree: Path, argv: list[str], python: str) -> tuple[float, float, str]:
    """(CPU s, wall s, digest) of one ``sim run`` on ``tree``."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "res.json")
        env = {**os.environ, "PYTHONPATH": str(tree)}
        cmd = [python, "-P", "-m", "sim", "run", *argv, "--json", out]
        t0 = time.perf_counter()
        p = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        _, status, usage = os.wait4(p.pid, 0)
        wall = time.perf_counter() - t0
        p.returncode = os.waitstatus_to_exitcode(status)
        err = p.stderr.read().decode() if p.stderr else ""
        if p.returncode:
            raise SystemExit(f"{' '.join(cmd)} failed ({p.returncode}):\n{err}")
        return usage.ru_utime + usage.ru_stime, wall, digest(out)


def export(rev: str, into: str) -> Path:
    """The tree of git revision ``rev`` under ``into`` (``git archive``)."""
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", into], input=archive, check=True)
    return Path(into)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.sim_speed", description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", default=None, help="git revision to compare against (omit: this checkout only)")
    ap.add_argument("--runs", default=DEFAULT_RUNS, help=f"comma-separated, from {', '.join(RUNS)} "
                                                           f"(default {DEFAULT_RUNS})")
    ap.add_argument("--repeat", type=int, default=3, help="runs per command and tree (medians printed)")
    ap.add_argument("--python", default=sys.executable)
    ap.add_argument("--json", default=None, help="write every sample here")
    args = ap.parse_args(argv)
    names = [n for n in args.runs.split(",") if n]
    unknown = [n for n in names if n not in RUNS]
    if unknown:
        ap.error(f"unknown runs {unknown}; known: {', '.join(RUNS)}")
    for n in [n for n in names if n in NAMED_TRACE]:
        try:
            resolve_trace(NAMED_TRACE[n])
        except WorkloadError as e:
            print(f"run {n} skipped: {e} (set {TRACE_DIR_ENV} to a folder that holds it)", file=sys.stderr)
            names.remove(n)
    if not names:
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        trees = {"head": ROOT} if args.base is None else {args.base: export(args.base, tmp), "head": ROOT}
        samples = {(n, t): Sample() for n in names for t in trees}
        for rep in range(args.repeat):
            for n in names:
                for t, tree in trees.items():
                    cpu, wall, d = run_once(tree, RUNS[n], args.python)
                    s = samples[(n, t)]
                    s.cpu_s.append(cpu)
                    s.wall_s.append(wall)
                    s.digests.add(d)
                    print(f"  [{rep + 1}/{args.repeat}] {n} {t}: cpu {cpu:.2f} s, wall {wall:.2f} s, {d[:12]}",
                          file=sys.stderr, flush=True)
    ok = True
    print(f"{'run':<4} {'tree':<10} {'cpu_s':>8} {'wall_s':>8} {'digest':<14} {'cpu x':>6} same")
    for n in names:
        ref = samples[(n, next(iter(trees)))]
        for t in trees:
            s = samples[(n, t)]
            same = s.digests == ref.digests and len(s.digests) == 1
            ok &= same
            cpu, wall = statistics.median(s.cpu_s), statistics.median(s.wall_s)
            gain = statistics.median(ref.cpu_s) / cpu
            print(f"{n:<4} {t:<10} {cpu:>8.2f} {wall:>8.2f} {min(s.digests)[:12]:<14} {gain:>6.2f} "
                  f"{'yes' if same else 'NO'}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({f"{n}/{t}": vars(s) | {"digests": sorted(s.digests)} for (n, t), s in samples.items()}, f,
                      indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
