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

With ``--repeats K`` each part makes K passes, alternating direction (A B C, C B A, ...). The load
generator is ``load``: ``python -m loadgen run`` (the same ``HttpLoadRun`` and configuration) plus
the ingress-measured TTFT, the client-side share and the per-request list for pairing with the
simulator by rid. Every run's JSON records the code fingerprint and the load average at its start
and end. ``report`` turns a folder of those JSON files into ``tables.md``; every command run is
appended to ``commands.txt``. ``hold`` keeps a cluster up for interactive diagnosis.

Other users of the machine start clusters too, and Serve's HTTP proxies bind with SO_REUSEPORT:
a second cluster on the same port silently takes part of the connections. So the benchmark
clusters listen on their own port (``FAIRWAY_BENCH_PORT``, default 8471, not the tests' 8000);
before starting one this waits until nothing listens there, and once it answers checks that every
listener is a descendant of our own ``serve run`` (else it stops ours and waits again). After
each load run the replica names in the responses are checked against our replicas
(``foreign_replicas``). The Ray address a driver needs comes from our ``serve run``'s session
folder (``/tmp/ray/session_*_<pid>/gcs_server_port_*``).
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

PORT = int(os.environ.get("FAIRWAY_BENCH_PORT", "8471"))
PY = sys.executable
SIM_ROUTERS = {"fairway", "pow2", "ray-prefix"}  # ray-default is Ray Serve's own: no simulator twin


# -- the machine's processes (Linux /proc) -------------------------------------------------------


def port_listening(port: int = PORT) -> bool:
    """Whether something accepts TCP connections on 127.0.0.1:``port``."""
    with contextlib.closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as s:
        s.settimeout(1.0)
        return s.connect_ex(("127.0.0.1", port)) == 0


def _ppid(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return 0


def _cmdline(pid: int) -> list[str]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return [x.decode(errors="replace") for x in f.read().split(b"\0") if x]
    except OSError:
        return []


def _pids() -> list[int]:
    return [int(p) for p in os.listdir("/proc") if p.isdigit()]


def is_descendant(pid: int, ancestor: int) -> bool:
    for _ in range(64):
        if pid == ancestor:
            return True
        if pid <= 1:
            return False
        pid = _ppid(pid)
    return False


def listener_pids(port: int = PORT) -> set[int]:
    """Processes holding a listening TCP socket on ``port`` (IPv4 or IPv6)."""
    inodes: set[str] = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for ln in lines:
            f = ln.split()
            if len(f) > 9 and f[3] == "0A" and int(f[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(f"socket:[{f[9]}]")
    out: set[int] = set()
    if not inodes:
        return out
    for pid in _pids():
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                if os.readlink(f"/proc/{pid}/fd/{fd}") in inodes:
                    out.add(pid)
                    break
            except OSError:
                continue
    return out


def my_serve_pid() -> int | None:
    """Our child ``serve run`` process (started by ``running_cluster``)."""
    me = os.getpid()
    for pid in _pids():
        if _ppid(pid) == me:
            cmd = _cmdline(pid)
            if len(cmd) >= 3 and Path(cmd[-3]).name == "serve" and cmd[-2] == "run":
                return pid
    return None


def ray_address_of(serve_pid: int, timeout_s: float = 30.0) -> str:
    """``IP:port`` of the GCS of the Ray instance ``serve run`` (pid ``serve_pid``) started."""
    import ray

    deadline = time.monotonic() + timeout_s
    while True:
        files = glob.glob(f"/tmp/ray/session_*_{serve_pid}/gcs_server_port_*")
        if files:
            port = Path(files[0]).read_text().strip()
            if port:
                return f"{ray.util.get_node_ip_address()}:{port}"
        if time.monotonic() > deadline:
            raise RuntimeError(f"no Ray session for serve run pid {serve_pid}")
        time.sleep(0.5)


def wait_port_free(port: int = PORT, timeout_s: float = 1800.0, poll_s: float = 10.0) -> None:
    """Wait until nothing listens on ``port`` (another user's cluster); ``TimeoutError`` after
    ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    said = False
    while port_listening(port):
        if time.monotonic() > deadline:
            raise TimeoutError(f"port {port} still busy after {timeout_s:.0f} s")
        if not said:
            print(f"[bench] port {port} is busy (another cluster); waiting", flush=True)
            said = True
        time.sleep(poll_s)


@contextlib.contextmanager
def cluster(tries: int = 5, **overrides: Any) -> Iterator[tuple[str, str]]:
    """``(url, ray_address)`` of our own running cluster (see the module docstring)."""
    from cluster.launch import running_cluster

    for attempt in range(tries):
        wait_port_free()
        print(f"[bench] starting cluster {json.dumps(overrides)}", flush=True)
        t0 = time.monotonic()
        with running_cluster(timeout_s=300.0, port=PORT, **overrides) as url:
            serve_pid = my_serve_pid()
            owners = listener_pids()
            if serve_pid is not None and owners and all(is_descendant(p, serve_pid) for p in owners):
                print(f"[bench] cluster up in {time.monotonic() - t0:.0f} s", flush=True)
                yield url, ray_address_of(serve_pid)
                return
            print(f"[bench] port {PORT} is held by another cluster (pids {sorted(owners)}); retrying",
                  flush=True)
        time.sleep(5.0 * (attempt + 1))
    raise RuntimeError(f"could not get port {PORT} for our cluster after {tries} tries")


# -- running things -------------------------------------------------------------------------------

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


def _sim_router(spec: str) -> tuple[str, dict[str, Any]]:
    from fairway.spec import parse_spec

    return parse_spec(spec)


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


# -- tables ---------------------------------------------------------------------------------------


def _f(x: Any, nd: int = 3) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:.{nd}f}"
    return str(x)


def md_table(header: list[str], rows: list[list[Any]], align: str | None = None) -> str:
    """A GitHub markdown table; ``align`` is one char per column (``l`` or ``r``; default: first
    column left, the rest right)."""
    align = align or "l" + "r" * (len(header) - 1)
    seps = ["---" if a == "l" else "---:" for a in align]
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join(seps) + " |"]
    lines += ["| " + " | ".join(_f(c) if not isinstance(c, str) else c for c in row) + " |" for row in rows]
    return "\n".join(lines)


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def overhead_table(res: dict[str, Any]) -> str:
    """Markdown: per-path latency, the differences, and the decision times."""
    paths = res["paths_ms"]
    rows = [[p, d["p50"], d["p90"], d["p99"], d["mean"], d["n"]] for p, d in paths.items() if d["n"]]
    extra = res.get("extra_ms", {})
    names = {"ingress_ttft": "ingress-measured TTFT (http path)",
             "replica_ttft_http": "replica-measured TTFT (http path)",
             "replica_ttft_handle": "replica-measured TTFT (handle path)"}
    rows += [[names.get(k, k), d["p50"], d["p90"], d["p99"], d["mean"], d["n"]] for k, d in extra.items()]
    out = [md_table(["path (client-timed unless noted)", "p50 ms", "p90 ms", "p99 ms", "mean ms", "n"], rows)]
    drows = [[k, d["p50_of_diff_ms"], d["diff_of_p50_ms"], d["diff_of_p99_ms"], d["paired"]["p99"]]
             for k, d in res.get("diffs", {}).items()]
    if drows:
        out.append(md_table(["difference", "median paired ms", "p50 diff ms", "p99 diff ms", "paired p99 ms"],
                            drows))
    dec = res.get("decision_us")
    rrows = []
    if dec:
        rrows.append(["in cluster (driver's FairwayRequestRouter)", "2", res.get("prompt_tokens", 8192),
                      dec["p50"], dec["p99"], dec["n"]])
    for o in res.get("offline_routing", []):
        rrows.append([f"offline `bench.routing` {o['router']}", str(o["replicas"]), o["prompt_tokens"],
                      o["p50_us"], o["p99_us"], "2000"])
    if rrows:
        out.append(md_table(["routing decision", "replicas", "prompt tokens", "p50 us", "p99 us", "n"], rrows))
    cpu = res.get("ingress_cpu_ms")
    if cpu:
        crows = [[k, d["p50"], d["p99"]] for k, d in cpu.items()]
        crows.append(["sum of p50s", sum(d["p50"] for d in cpu.values()), ""])
        out.append(md_table([f"ingress CPU per request, {res.get('prompt_tokens', 8192)} tokens (offline)",
                             "p50 ms", "p99 ms"], crows))
    if res.get("errors"):
        out.append("errors: " + "; ".join(f"{k}: {v}" for k, v in res["errors"].items()))
    return "\n\n".join(out)


def _lanes(res: dict[str, Any]) -> str:
    lanes = res.get("ttft_by_lane_s") or {}
    return " ".join(f"{k} {v['p50']:.3f}/{v['p99']:.3f} (n={v['n']})" for k, v in lanes.items()) or "-"


def _split(res: dict[str, Any]) -> str:
    per = res.get("per_replica") or []
    return "/".join(str(p["requests"]) for p in per) or "-"


def _loadavg(res: dict[str, Any]) -> str:
    la = res.get("loadavg")
    return f"{la[0]:.1f}/{la[1]:.1f}" if la else "-"


def _prefill_busy(res: dict[str, Any]) -> str:
    per = res.get("per_replica") or []
    vals = [p.get("prefill_busy_fraction") for p in per if p.get("prefill_busy_fraction") is not None]
    return "/".join(f"{v:.2f}" for v in vals) or "-"


def sim_vs_real_table(sim: dict[str, Any], reals: dict[str, dict[str, Any]],
                      engines: dict[str, list[dict[str, Any]]] | None = None) -> str:
    """Markdown: sim row, one row per real run, and real/sim ratio rows."""
    t = sim["ttft_s"]
    rows: list[list[Any]] = [["sim", t["p50"], t["p90"], t["p99"], t["mean"], sim["cache_hit_ratio"], sim["n_finished"],
                              _lanes(sim), _split(sim)]]
    for name, res in reals.items():
        r = res["ttft_s"]
        rows.append([f"real ({name})", r["p50"], r["p90"], r["p99"], r["mean"], res["cache_hit_ratio"],
                     res["n_finished"], _lanes(res), _split(res)])
    for name, res in reals.items():
        r = res["ttft_s"]
        rows.append([f"real/sim ({name})", ratio(r["p50"], t["p50"]), ratio(r["p90"], t["p90"]),
                     ratio(r["p99"], t["p99"]), ratio(r["mean"], t["mean"]),
                     ratio(res["cache_hit_ratio"], sim["cache_hit_ratio"]), "", "", ""])
    out = [md_table(["run", "p50 s", "p90 s", "p99 s", "mean s", "hit", "n", "lanes p50/p99 s", "split"], rows)]
    erows: list[list[Any]] = []
    for name in reals:
        for e in (engines or {}).get(name, []):
            tm = e.get("timing") or {}
            erows.append([name, str(e.get("replica", "?"))[-8:], tm.get("modelled_busy_s"), tm.get("wall_busy_s"),
                          tm.get("slowdown"), tm.get("late_ms_p50"), tm.get("late_ms_p99"), tm.get("written_off_s")])
    if erows:
        out.append(md_table(["real run", "replica", "modelled busy s", "wall busy s", "wall/modelled",
                             "late p50 ms", "late p99 ms", "written off s"], erows))
    split_rows: list[list[Any]] = []
    for name, res in reals.items():
        sv, cl = res.get("server_ttft_s"), res.get("client_side_s")
        if sv:
            split_rows.append([f"ingress-measured TTFT ({name})", sv["p50"], sv["p90"], sv["p99"], sv["mean"]])
            split_rows.append([f"ingress-measured / sim ({name})",
                               *(ratio(sv[k], t[k]) for k in ("p50", "p90", "p99", "mean"))])
        if cl:
            split_rows.append([f"client side = client - ingress TTFT ({name})",
                               *(cl[k] for k in ("p50", "p90", "p99", "mean"))])
    if split_rows:
        out.append(md_table(["TTFT split", "p50 s", "p90 s", "p99 s", "mean s"], split_rows))
    crows = [[name, (res.get("send_lag_s") or {}).get("p99", 0.0) * 1e3, (res.get("itl_s") or {}).get("p50", 0.0) * 1e3,
              (res.get("e2e_s") or {}).get("p50"), res.get("n_rejected"), res.get("n_unfinished"),
              " ".join(res.get("foreign_replicas") or []) or "none", _loadavg(res)]
             for name, res in reals.items()]
    out.append(md_table(["real run", "send lag p99 ms", "ITL p50 ms", "E2E p50 s", "rejected", "unfinished",
                         "foreign replicas", "load avg start/end"], crows))
    return "\n\n".join(out)


def routers_table(reals: dict[str, dict[str, Any]], sims: dict[str, dict[str, Any]]) -> str:
    """Markdown: one row per router on the cluster, then the simulator's rows."""
    rows: list[list[Any]] = []
    for label, group in (("cluster", reals), ("sim", sims)):
        for name, res in group.items():
            t = res["ttft_s"]
            ex = (res.get("ttft_by_class_s") or {}).get("expensive", {})
            errs = res.get("errors_by_status") or {}
            rows.append([f"{name} ({label})", t["p50"], t["p90"], t["p99"], ex.get("p99"), _lanes(res),
                         res["cache_hit_ratio"], _split(res), f"{res['n_finished']}/{res['n_requests']}",
                         " ".join(f"{k}:{v}" for k, v in errs.items()) or "-", _loadavg(res)])
    return md_table(["router", "p50 s", "p90 s", "p99 s", "expensive p99 s", "lanes p50/p99 s", "hit",
                     "per-replica requests", "ok/sent", "errors", "load avg start/end"], rows)


def sim_requests(workload: str, rate: float, duration: float, seed: int, router: str = "fairway",
                 replicas: int = 2, kv_blocks: int = 20000,
                 router_options: dict[str, Any] | None = None) -> dict[int, dict[str, Any]]:
    """The simulator's finished requests of that run, by rid: TTFT, kind, prompt and cached tokens."""
    from sim.runner import RunConfig, build

    sim, _ = build(RunConfig(workload=workload, policy="fairway", rate=rate, duration_s=duration, seed=seed,
                             replicas=replicas, router=router, router_options=router_options or {},
                             kv_blocks=kv_blocks))
    res = sim.run()
    return {r.spec.rid: {"ttft_s": r.ttft_s, "kind": r.spec.kind, "prompt_tokens": r.spec.prompt_tokens,
                         "cached_tokens": max(0, r.cached_tokens), "replica": r.replica} for r in res.finished}


def pairs_table(reals: dict[str, dict[str, Any]], sim: dict[int, dict[str, Any]], top: int = 3) -> str:
    """Markdown: per real run, the per-request differences real - sim (client and ingress TTFT)
    by request kind, and the slowest requests of the real run next to their simulated TTFT."""
    import numpy as np

    rows: list[list[Any]] = []
    slow: list[list[Any]] = []
    for name, res in reals.items():
        reqs = [q for q in res.get("requests") or [] if q["rid"] in sim and q["ttft_s"] is not None]
        if not reqs:
            continue
        for kind in sorted({q["kind"] for q in reqs}):
            g = [q for q in reqs if q["kind"] == kind]
            d = np.array([q["ttft_s"] - sim[q["rid"]]["ttft_s"] for q in g])
            ds = np.array([q["server_ttft_s"] - sim[q["rid"]]["ttft_s"] for q in g if q["server_ttft_s"] is not None])
            same_hit = np.mean([(q["cached_tokens"] or 0) == sim[q["rid"]]["cached_tokens"] for q in g])
            rows.append([name, kind, len(g), float(np.median(d)) * 1e3, float(np.percentile(d, 90)) * 1e3,
                         float(np.median(ds)) * 1e3 if ds.size else None,
                         float(np.percentile(ds, 90)) * 1e3 if ds.size else None, float(same_hit)])
        for q in sorted(reqs, key=lambda q: -q["ttft_s"])[:top]:
            sq = sim[q["rid"]]
            slow.append([name, q["rid"], q["kind"], q["prompt_tokens"], f"{q['cached_tokens']}/{sq['cached_tokens']}",
                         q["ttft_s"], q["server_ttft_s"], sq["ttft_s"]])
    if not rows:
        return ""
    return "\n\n".join([
        md_table(["real run", "kind", "n", "real - sim p50 ms", "p90 ms", "ingress - sim p50 ms", "p90 ms",
                  "same cached tokens"], rows),
        md_table(["real run", "slowest rids", "kind", "prompt", "cached real/sim", "real TTFT s", "ingress TTFT s",
                  "sim TTFT s"], slow)])


def routers_median_table(runs: dict[str, dict[str, Any]], policies: list[str]) -> str:
    """Markdown: per policy, the median over its repeated runs (tags ``policy-rK``)."""
    import numpy as np

    rows: list[list[Any]] = []
    for p in policies:
        group = [v for k, v in runs.items() if k == p or k.rsplit("-r", 1)[0] == p]
        if not group:
            continue

        def med(f: Any, g: list[dict[str, Any]] = group) -> float:
            return float(np.median([f(x) for x in g]))

        rows.append([p, len(group), med(lambda x: x["ttft_s"]["p50"]), med(lambda x: x["ttft_s"]["p90"]),
                     med(lambda x: x["ttft_s"]["p99"]), med(lambda x: x["ttft_s"]["mean"]),
                     med(lambda x: x["cache_hit_ratio"]),
                     med(lambda x: (x.get("server_ttft_s") or x["ttft_s"])["p50"]),
                     med(lambda x: (x.get("server_ttft_s") or x["ttft_s"])["p99"])])
    return md_table(["router (median over runs)", "runs", "p50 s", "p90 s", "p99 s", "mean s", "hit",
                     "ingress p50 s", "ingress p99 s"], rows)


def code_versions(out: Path) -> str:
    """One line: which code fingerprints the runs in ``out`` used (a warning if more than one, or
    if the tree changed during a run)."""
    seen: dict[str, list[str]] = {}
    changed = []
    for p in sorted(out.glob("*.json")):
        d = _load(p)
        if isinstance(d, dict) and d.get("code"):
            seen.setdefault(d["code"], []).append(p.stem)
            if d.get("code_at_end") and d["code_at_end"] != d["code"]:
                changed.append(p.stem)
    if not seen:
        return "code fingerprint: not recorded"
    if len(seen) == 1 and not changed:
        return f"code fingerprint (`bench.cluster.code_fingerprint`): {next(iter(seen))} for every run"
    lines = [f"WARNING: runs used different code ({len(seen)} fingerprints):"]
    lines += [f"- {k}: {', '.join(v)}" for k, v in seen.items()]
    files = {d["code"]: d.get("code_files") for d in (_load(p) for p in sorted(out.glob("*.json")))
             if isinstance(d, dict) and d.get("code") and d.get("code_files")}
    if len(files) > 1:
        first, *rest = files.values()
        diff = sorted({k for f in rest for k in set(first) | set(f) if first.get(k) != f.get(k)})
        lines.append(f"- files that differ: {', '.join(diff)}")
    if changed:
        lines.append(f"- the tree changed during: {', '.join(changed)}")
    return "\n".join(lines)


def _load(path: Path) -> Any:
    return json.loads(path.read_text()) if path.exists() else None


def report(out: Path) -> str:
    """``tables.md`` for the JSON files in ``out`` (missing parts are skipped)."""
    parts: list[str] = []
    ov = _load(out / "overhead.json")
    if ov:
        parts += ["### Router overhead", overhead_table(ov)]
    sim = _load(out / "simreal-sim.json")
    meta = _load(out / "simreal-meta.json") or {}
    tags = meta.get("runs") or []
    reals = {t: _load(out / f"simreal-real-{t}.json") for t in tags}
    reals = {k: v for k, v in reals.items() if v}
    if sim and reals:
        engines = {k: _load(out / f"simreal-real-{k}-engine.json") or [] for k in reals}
        head = {k: meta[k] for k in ("workload", "rate", "duration_s", "seed") if k in meta}
        parts += [f"### Simulated vs real TTFT ({json.dumps(head)})", sim_vs_real_table(sim, reals, engines)]
        if any(v.get("requests") for v in reals.values()) and "workload" in meta:
            by_rid = sim_requests(meta["workload"], meta["rate"], meta["duration_s"], meta["seed"])
            parts.append(pairs_table(reals, by_rid))
    rmeta = _load(out / "routers-meta.json")
    if rmeta:
        rr = {t: _load(out / f"routers-{t}.json") for t in rmeta.get("runs") or rmeta["policies"]}
        rs = {p: _load(out / f"routers-sim-{p}.json") for p in rmeta["policies"]}
        head = {k: rmeta[k] for k in ("workload", "rate", "duration_s", "seed") if k in rmeta}
        rr = {k: v for k, v in rr.items() if v}
        parts += [f"### Routers on the cluster ({json.dumps(head)})",
                  routers_table(rr, {k: v for k, v in rs.items() if v})]
        if len(rmeta.get("runs") or []) > len(rmeta["policies"]):  # repeated runs: their medians
            parts.append(routers_median_table(rr, rmeta["policies"]))
        if "workload" in rmeta:
            specs = rmeta.get("specs") or {}
            for p in rmeta["policies"]:
                mine = {k: v for k, v in rr.items() if (k == p or k.rsplit("-r", 1)[0] == p) and v.get("requests")}
                name, opts = _sim_router(specs.get(p, p))
                if name in SIM_ROUTERS and mine:
                    by_rid = sim_requests(rmeta["workload"], rmeta["rate"], rmeta["duration_s"], rmeta["seed"],
                                          router=name, router_options=opts)
                    parts.append(pairs_table(mine, by_rid))
    parts.append(code_versions(out))
    text = "\n\n".join(parts) + "\n"
    (out / "tables.md").write_text(text)
    return text


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
