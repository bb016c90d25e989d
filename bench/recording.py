"""Running things and recording them: the commands a benchmark step runs, and what its JSON records.

``Runner`` runs each command, appending it to ``commands.txt``, and stamps every run's JSON with the
code fingerprint (a hash of the product code a run executes, not of ``bench/``) and the load
average at its start and end (``Snapshot``, ``Runner.stamp``). The load generator is ``load``
(``load_run``): ``python -m loadgen run`` (the same ``HttpLoadRun`` and configuration) plus the
ingress-measured TTFT, the client-side share and the per-request list for pairing with the
simulator by rid. After each load run the replica names in the responses are checked against our
replicas (``foreign_replicas``, ``check_clean``).
"""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

PY = sys.executable
SIM_ROUTERS = {"fairway", "pow2", "ray-prefix"}  # ray-default is Ray Serve's own: no simulator twin

# The product packages a run executes; bench/ (this reporting code) is left out.
FINGERPRINT_DIRS = ("fairway", "workloads", "observability", "router", "replicas", "sim", "loadgen", "cluster")


def code_files(root: Path | None = None) -> dict[str, str]:
    """``{path: short sha256}`` of the code a run executes: the product packages' ``.py``
    files and the cluster YAML, not the benchmark code in ``bench/``."""
    import hashlib

    root = root or Path(__file__).resolve().parents[1]
    files = sorted(p for d in FINGERPRINT_DIRS for p in (root / d).rglob("*.py"))
    files.append(root / "deploy" / "cluster.yaml")
    out = {}
    for p in files:
        rel = p.relative_to(root).as_posix()
        if p.exists():
            out[rel] = hashlib.sha256(p.read_bytes()).hexdigest()[:12]
    return out


def code_fingerprint(root: Path | None = None, files: dict[str, str] | None = None) -> str:
    """A short hash over ``code_files``: runs with different fingerprints ran different code,
    which happens when the tree changes while a benchmark runs."""
    import hashlib

    files = code_files(root) if files is None else files
    return hashlib.sha256(json.dumps(files, sort_keys=True).encode()).hexdigest()[:10]


def loadavg() -> float:
    """The machine's 1-minute load average (other users' work shows here), or -1."""
    try:
        return float(Path("/proc/loadavg").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return -1.0


class Snapshot:
    """The code and the machine's load when a run starts (``Runner.stamp`` adds the end)."""

    def __init__(self) -> None:
        self.files = code_files()
        self.code = code_fingerprint(files=self.files)
        self.load = loadavg()


class Runner:
    """Runs commands, logging each to ``out/commands.txt``."""

    def __init__(self, out: Path) -> None:
        self.out = out
        out.mkdir(parents=True, exist_ok=True)

    def log(self, line: str) -> None:
        with open(self.out / "commands.txt", "a") as f:
            f.write(line + "\n")

    def run(self, argv: list[str], note: str = "") -> None:
        shown = " ".join(shlex.quote(a) for a in argv).replace(PY, "python")
        self.log(f"{note + ': ' if note else ''}{shown}")
        print(f"[bench] {shown}", flush=True)
        subprocess.run(argv, check=True)

    def json(self, name: str) -> dict[str, Any]:
        return json.loads((self.out / name).read_text())

    def write(self, name: str, data: Any) -> None:
        (self.out / name).write_text(json.dumps(data, indent=1))

    def stamp(self, name: str, snap: Snapshot) -> None:
        """Record in ``name`` the code the run started with, the code at its end, and the load
        average at both ends."""
        res = self.json(name)
        res["code"] = snap.code
        res["code_at_end"] = code_fingerprint()
        res["code_files"] = snap.files
        res["loadavg"] = [snap.load, loadavg()]
        self.write(name, res)


def sim_argv(workload: str, rate: float, duration: float, seed: int, router: str, path: Path,
             replicas: int = 2, kv_blocks: int = 20000) -> list[str]:
    return [PY, "-m", "sim", "run", "--workload", workload, "--rate", f"{rate:g}", "--duration", f"{duration:g}",
            "--seed", str(seed), "--replicas", str(replicas), "--router", router, "--policy", "fairway",
            "--kv-blocks", str(kv_blocks), "--json", str(path)]


def loadgen_argv(url: str, workload: str, rate: float, duration: float, seed: int, path: Path) -> list[str]:
    """``python -m bench.cluster load``: ``python -m loadgen run`` plus the TTFT split."""
    return [PY, "-m", "bench.cluster", "load", "--url", url, "--workload", workload, "--rate", f"{rate:g}",
            "--duration", f"{duration:g}", "--seed", str(seed), "--timeout-s", "300", "--json", str(path)]


def load_run(url: str, workload: str, rate: float, duration: float, seed: int, timeout_s: float = 300.0
             ) -> dict[str, Any]:
    """``python -m loadgen run``'s summary (the same ``HttpLoadRun``, the same configuration) plus
    ``server_ttft_s`` (TTFT as the ingress measures it: from its routing call to the first chunk
    back) and ``client_side_s`` (client TTFT - ingress TTFT: HTTP, proxy, request parsing and
    hashing, the client's own event loop), per request, as ``pct`` dicts."""
    import asyncio

    import numpy as np

    from fairway.summary import pct
    from loadgen.http_run import HttpLoadRun, HttpRunConfig

    cfg = HttpRunConfig(url=url, workload=workload, rate=rate, duration_s=duration, seed=seed, timeout_s=timeout_s)
    runner = HttpLoadRun(cfg)
    res = asyncio.run(runner.run())
    pairs = [(r.result.ttft_s, r.result.server_ttft_s) for r in runner.records
             if r.result.ok and r.result.ttft_s is not None and r.result.server_ttft_s is not None]
    res["server_ttft_s"] = pct([s for _, s in pairs])
    res["client_side_s"] = pct(np.array([c - s for c, s in pairs]))
    res["requests"] = [  # per request, for pairing with the simulator's by rid
        {"rid": r.rid, "kind": r.kind, "sent_s": round(r.sent_s, 4), "prompt_tokens": r.result.prompt_tokens,
         "cached_tokens": r.result.cached_tokens, "ttft_s": r.result.ttft_s, "server_ttft_s": r.result.server_ttft_s,
         "queue_wait_s": r.result.queue_wait_s, "replica": r.result.replica, "status": r.result.status}
        for r in sorted(runner.records, key=lambda x: x.rid)]
    return res


def engine_info(r: Runner, ray_address: str, path: Path) -> None:
    r.run([PY, "-m", "bench.overhead", "--replica-info", "--ray-address", ray_address, "--json", str(path)],
          note="replica pacing figures")


def foreign_replicas(res: dict[str, Any], info: list[dict[str, Any]]) -> list[str]:
    """Replica names in a load run's results that are not among our cluster's replicas."""
    ours = {str(i.get("replica")) for i in info}
    return sorted({str(p["replica"]) for p in res.get("per_replica") or []} - ours)


def check_clean(r: Runner, run_json: str, engine_json: str, code: Snapshot) -> None:
    """Record in the run's JSON which replicas answered that are not ours (should be none) and
    the code fingerprints."""
    r.stamp(run_json, code)
    res, info = r.json(run_json), r.json(engine_json)
    res["foreign_replicas"] = foreign_replicas(res, info)
    if res["foreign_replicas"]:
        print(f"[bench] WARNING: {run_json} was answered by foreign replicas {res['foreign_replicas']}", flush=True)
    r.write(run_json, res)


def _sim_router(spec: str) -> tuple[str, dict[str, Any]]:
    from fairway.spec import parse_spec

    return parse_spec(spec)
