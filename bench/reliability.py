"""Reliability benchmarks on the real cluster (sim engine), every request accounted for.

``python -m bench.reliability soak --minutes 10`` starts a cluster (2 engine replicas, 2 ingress
replicas, the fault file on) and runs, at once: the load generator (``mixed``, 5% of clients
hanging up on purpose), a hostile client (``HOSTILE``: malformed, oversized and forbidden
requests, one every 0.2 s, each of which must get a 4xx with a message), and, at 25%, 45% and 65%
of the run, a replica kill, an ingress-replica kill and a replica stall (lifted after 3 stall
timeouts). It prints the accounting (``loadgen/accounting.py``), the hostile client's tally, the
peak memory of the cluster's Ray workers, and whether the engines ended empty; it exits non-zero
when any check of ``soak_failures`` fails. ``--minutes 1`` is the short version (about 2 min in
all); CI tests each fault on its own (``tests/e2e/test_faults.py``, ``test_ingress_kill.py``,
``test_ingress_replicas.py``, the hostile requests in ``test_cluster_http.py``).

``python -m bench.reliability overload`` starts a cluster whose engine runs at ``--speed`` of an
H200 (default 0.25, so the 2-core machine can offer three times its capacity), takes the capacity
from the simulator (the highest rate of a doubling sweep whose simulated p99 TTFT stays under
2 s, times the speed: the same engine model), and offers half the capacity for 20 s, three times
it for 60 s, half again for 30 s; the gates' wait bound is ``--max-wait`` (default 5 s, the
shipped ``replica.max_queue_wait_s``) and the router's hold bound ``--hold`` (default 10 s, the
shipped ``router.hold.max_wait_s``; 0: a request both tried gates refuse gets 429 at once); comma
lists run one cluster per combination, one after the other. It reports, per
phase, accepted TTFT p50/p99, the refusals (429 and 503) with the time they took, the peak memory,
and the time after the drop until TTFT is back within twice its first-phase median.

``python -m bench.reliability tenants`` starts a cluster with two API keys (tenants "quiet" and
"flood") at the same speed and capacity, and measures the quiet tenant's TTFT (it sends a quarter
of the capacity) alone, then while the other tenant sends five times its fair share (2.5 times the
capacity), once with the gate's tenant queues (the default) and once with one shared queue
(``replica.tenant_fair: false``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np

from bench.tables import md_table
from cluster.launch import HAPROXY_BUFSIZE, running_cluster
from fairway.summary import pct
from loadgen.accounting import format_report
from loadgen.http_run import HttpLoadRun, HttpRunConfig
from observability.probe import replica_names, wait_idle
from replicas.faults import write_faults

MODEL = "fairway-tiny"
PY = sys.executable

#: Hostile requests: (name, path, body, headers). Each must be answered with a 4xx and a message.
HOSTILE: list[tuple[str, str, Any, dict[str, str]]] = [
    ("invalid json", "/v1/completions", b'{"model": "fairway-tiny", "prompt": [1, 2', {}),
    ("not json", "/v1/completions", b"\x00\xff\xfe garbage", {}),
    ("unknown model", "/v1/completions", {"model": "gpt-9", "prompt": "hi"}, {}),
    ("empty prompt", "/v1/completions", {"model": MODEL, "prompt": ""}, {}),
    ("negative token", "/v1/completions", {"model": MODEL, "prompt": [1, -5]}, {}),
    ("token out of vocab", "/v1/completions", {"model": MODEL, "prompt": [10**9]}, {}),
    ("n=500", "/v1/completions", {"model": MODEL, "prompt": "hi", "n": 500}, {}),
    ("100 prompts x n=2", "/v1/completions", {"model": MODEL, "prompt": ["hi"] * 100, "n": 2}, {}),
    ("max_tokens 0", "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 0}, {}),
    ("too long", "/v1/completions", {"model": MODEL, "prompt": [20] * 40000, "max_tokens": 1}, {}),
    ("body 9 MB", "/v1/completions", b'{"model": "fairway-tiny", "prompt": "' + b"a" * 9_000_000 + b'"}', {}),
    ("headers 64 kB", "/v1/completions", {"model": MODEL, "prompt": "hi"}, {"x-junk": "j" * 65536}),
    ("2000 messages", "/v1/chat/completions",
     {"model": MODEL, "messages": [{"role": "user", "content": "x"}] * 2000}, {}),
    ("bad role", "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "robot", "content": "x"}]}, {}),
    ("temperature 9", "/v1/completions", {"model": MODEL, "prompt": "hi", "temperature": 9}, {}),
    ("responses store", "/v1/responses", {"model": MODEL, "input": "hi", "store": True}, {}),
    ("responses image", "/v1/responses",
     {"model": MODEL, "input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, {}),
    ("stored response", "/v1/responses/resp_1/cancel", {}, {}),
]


async def hostile_client(url: str, stop: asyncio.Event, period_s: float = 0.2,
                         t0: float | None = None) -> dict[str, Any]:
    """Send ``HOSTILE`` requests round-robin until ``stop``; tally the answers: a 4xx with an
    error message is right, anything else (5xx, 2xx, no message, no answer in 10 s) is a miss.
    ``misses`` lists each with its size in bytes and when it was sent and answered (seconds after
    ``t0``, monotonic); ``excuse_ingress_kills`` counts them into the report's ``wrong``."""
    tally: Counter = Counter()
    misses: list[dict[str, Any]] = []
    t0 = time.monotonic() if t0 is None else t0
    timeout = aiohttp.ClientTimeout(total=10)
    async with aiohttp.ClientSession(timeout=timeout) as s:
        i = 0
        while not stop.is_set():
            name, path, body, headers = HOSTILE[i % len(HOSTILE)]
            i += 1
            data = body if isinstance(body, bytes) else json.dumps(body).encode()
            sent = time.monotonic() - t0
            answer = ""
            try:
                async with s.post(url + path, data=data,
                                  headers={"Content-Type": "application/json", **headers}) as r:
                    raw = await r.read()
                    try:
                        msg = json.loads(raw)["error"]["message"]
                    except (ValueError, KeyError, TypeError):
                        msg = ""
                    tally[f"{r.status}"] += 1
                    if not (400 <= r.status < 500 and bool(msg)):
                        answer = f"{r.status} {raw[:120]!r}"
            except (aiohttp.ClientError, TimeoutError, OSError) as e:
                tally[type(e).__name__] += 1
                answer = type(e).__name__
            if answer:
                size = len(data) + sum(len(k) + len(v) for k, v in headers.items())
                misses.append({"what": f"{name}: {answer}", "bytes": size, "sent_s": round(sent, 3),
                               "done_s": round(time.monotonic() - t0, 3)})
            try:
                await asyncio.wait_for(stop.wait(), period_s)
            except TimeoutError:
                pass
    return {"sent": sum(tally.values()), "by_status": dict(sorted(tally.items())), "misses": misses}


def excuse_ingress_kills(hostile: dict[str, Any], events: list[dict[str, Any]]) -> dict[str, Any]:
    """``hostile`` with its misses counted: ``wrong``, but for those an ingress-replica kill
    explains, counted apart in ``at_ingress_kill``: a request in flight at the kill (sent before
    the kill returned, answered after it began) too big for HAProxy to replay on another replica
    (over its buffer, ``HAPROXY_BUFSIZE``; docs/reliability.md, "Router faults"). The events'
    times are rounded to 0.1 s, so the kill's window is widened by that much on each side.
    O(misses x events)."""
    kills = [(e["at_s"] - 0.1, e["done_s"] + 0.1) for e in events if e["event"] == "kill ingress"]
    limit = int(HAPROXY_BUFSIZE)
    excused: list[dict[str, Any]] = []
    left: list[dict[str, Any]] = []
    for m in hostile["misses"]:
        at_kill = m["bytes"] > limit and any(m["sent_s"] <= done and m["done_s"] >= at for at, done in kills)
        (excused if at_kill else left).append(m)
    return {**hostile, "wrong": len(left), "wrong_examples": [m["what"] for m in left[:5]],
            "at_ingress_kill": len(excused), "at_ingress_kill_examples": [m["what"] for m in excused[:5]]}


def ray_worker_rss_bytes() -> int:
    """Resident memory of the Ray worker processes (``ray::`` in their command line): the
    cluster's replicas, ingress replicas, controller and proxy. Linux /proc; 0 elsewhere."""
    total = 0
    for pid in os.listdir("/proc") if os.path.isdir("/proc") else ():
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"ray::" not in f.read(200):
                    continue
            with open(f"/proc/{pid}/status") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        total += int(line.split()[1]) * 1024
                        break
        except OSError:
            continue
    return total


class RssSampler:
    """``ray_worker_rss_bytes`` once a second in a thread; ``peak`` and ``samples``."""

    def __init__(self) -> None:
        self.samples: list[tuple[float, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join(5)

    def _run(self) -> None:
        t0 = time.monotonic()
        while not self._stop.is_set():
            self.samples.append((time.monotonic() - t0, ray_worker_rss_bytes()))
            self._stop.wait(1.0)

    @property
    def peak(self) -> int:
        return max((b for _, b in self.samples), default=0)


def kill_actor(match: str) -> str:
    """Kill the first live Serve actor whose name contains ``match`` (in a subprocess, so this
    process never joins the Ray cluster); its name, or "" if none matched."""
    script = (
        "import ray,sys\n"
        "ray.init(address='auto', namespace='serve', logging_level='ERROR')\n"
        f"names = sorted(a['name'] for a in ray.util.list_named_actors(all_namespaces=True) "
        f"if a['namespace'] == 'serve' and {match!r} in a['name'])\n"
        "if names: ray.kill(ray.get_actor(names[0], namespace='serve'), no_restart=True)\n"
        "print(names[0] if names else '')\n"
    )
    out = subprocess.run([PY, "-c", script], capture_output=True, text=True, timeout=120)
    return out.stdout.strip().splitlines()[-1] if out.stdout.strip() else ""


async def soak(url: str, faults: Path, duration_s: float, rate: float, seed: int = 0,
               stall_timeout_s: float = 5.0) -> dict[str, Any]:
    """The soak of the module docstring against a running cluster; returns its report."""
    cfg = HttpRunConfig(url=url, workload="mixed", rate=rate, duration_s=duration_s, seed=seed, model=MODEL,
                        timeout_s=120, disconnect_fraction=0.05)
    load = HttpLoadRun(cfg)
    stop = asyncio.Event()
    events: list[dict[str, Any]] = []
    t0 = time.monotonic()

    async def chaos() -> None:
        plan = [(0.25, "kill replica"), (0.45, "kill ingress"), (0.65, "stall replica")]
        for frac, what in plan:
            await asyncio.sleep(max(0.0, t0 + frac * duration_s - time.monotonic()))
            at = round(time.monotonic() - t0, 1)
            if what.startswith("kill"):
                match = "FairwayReplica" if what == "kill replica" else "FairwayIngress"
                actor = await asyncio.to_thread(kill_actor, match)
                events.append({"at_s": at, "done_s": round(time.monotonic() - t0, 1), "event": what,
                               "actor": actor})
            else:
                victim = (await asyncio.to_thread(replica_names, url) or [""])[0]
                write_faults(faults, {victim: {"stall": True}})
                events.append({"at_s": at, "event": what, "replica": victim})
                await asyncio.sleep(3 * stall_timeout_s)
                write_faults(faults, {})
                events.append({"at_s": round(time.monotonic() - t0, 1), "event": "stall lifted"})

    with RssSampler() as rss:
        hostile = asyncio.create_task(hostile_client(url, stop, t0=t0))
        chaos_task = asyncio.create_task(chaos())
        res = await load.run()
        await chaos_task
        stop.set()
        hostile_report = excuse_ingress_kills(await hostile, events)
    return {"duration_s": duration_s, "rate": rate, "accounting": res["accounting"], "hostile": hostile_report,
            "events": events, "peak_rss_mb": round(rss.peak / 2**20, 1), "ttft_s": res["ttft_s"],
            "wall_s": round(time.monotonic() - t0, 1)}


#: The soak's fault events, in the order ``soak`` provokes them
SOAK_EVENTS = ["kill replica", "kill ingress", "stall replica", "stall lifted"]


def soak_failures(rep: dict[str, Any]) -> list[str]:
    """The checks a soak report (``soak``'s, with ``engines_idle_after_s``) fails, each named; none
    when it passed. No request lost; cut streams at most those in flight through the killed
    ingress replica (about rate x 2 s) with twice that as slack; at least 60% completed despite the
    hang-ups, the kills and the stall; every fault event in order, naming its actor or replica; the
    hostile client sent at least a third of its nominal rate (one every 0.2 s) and got a 4xx with a
    message every time, but at most one request too big for HAProxy to replay in flight at the
    ingress kill (docs/reliability.md); and the engines ended empty. O(events)."""
    acc, h, events = rep["accounting"], rep["hostile"], rep["events"]
    checks = [
        (acc["lost"] == 0, f"lost {acc['lost']} requests"),
        (acc["cut"] <= 4 * rep["rate"], f"cut {acc['cut']} streams, more than 4 x the rate ({rep['rate']:g} req/s)"),
        (acc["completed"] >= 0.6 * acc["sent"], f"completed {acc['completed']} of {acc['sent']}, under 60%"),
        ([e["event"] for e in events] == SOAK_EVENTS, f"events {[e['event'] for e in events]}, not {SOAK_EVENTS}"),
        (all(e.get("actor", e.get("replica")) for e in events[:3]), "a fault event names no actor or replica"),
        (h["sent"] >= rep["duration_s"] * 5 / 3, f"the hostile client sent only {h['sent']} requests"),
        (h["wrong"] == 0, f"{h['wrong']} hostile requests answered wrongly: {h.get('wrong_examples')}"),
        (h["at_ingress_kill"] <= 1, f"{h['at_ingress_kill']} hostile requests lost at the ingress kill"),
        (rep.get("engines_idle_after_s") is not None, "the engines did not end empty"),
    ]
    return [why for ok, why in checks if not ok]


def sim_capacity(workload: str, replicas: int, kv_blocks: int, seed: int = 0) -> float:
    """The highest rate (req/s) of a doubling sweep from 1 whose simulated p99 TTFT stays under
    2 s, on H200 speed (module docstring)."""
    from sim.runner import RunConfig, run

    best, rate = 0.0, 1.0
    while rate <= 1024:
        r = run(RunConfig(workload=workload, rate=rate, duration_s=60.0, replicas=replicas, router="fairway",
                          policy="fairway", kv_blocks=kv_blocks, seed=seed))
        if r["ttft_s"]["p99"] >= 2.0:
            break
        best, rate = rate, rate * 2
    return best


def _phase_stats(records: list[tuple[float, float, Any]], lo: float, hi: float) -> dict[str, Any]:
    """Records (absolute send time, finish time, result) sent in [lo, hi): accepted TTFT and refusals."""
    sel = [(s, f, r) for s, f, r in records if lo <= s < hi]
    ok = [r.ttft_s for _, _, r in sel if r.ok and r.ttft_s is not None]
    refused = [f - s for s, f, r in sel if r.status in ("429", "503")]
    other = Counter(r.status for _, _, r in sel if not r.ok and r.status not in ("429", "503"))
    waits = [r.queue_wait_s for _, _, r in sel if r.ok and r.queue_wait_s is not None]
    lanes = {lane: pct([r.ttft_s for _, _, r in sel if r.ok and r.ttft_s is not None and r.lane == lane])
             for lane in sorted({r.lane for _, _, r in sel if r.ok})}
    return {"sent": len(sel), "accepted": len(ok), "ttft_s": pct(ok), "queue_wait_s": pct(waits),
            "ttft_s_by_lane": lanes, "refused": len(refused), "refusal_time_s": pct(refused), "other": dict(other)}


def overload(url: str, capacity: float, seed: int = 0, pre_s: float = 20.0, over_s: float = 60.0,
             post_s: float = 30.0, factor: float = 3.0, normal: float = 0.5) -> dict[str, Any]:
    """The overload run of the module docstring against a running cluster."""
    total = pre_s + over_s + post_s
    runs: list[HttpLoadRun] = []
    starts: list[float] = []

    def go(rate: float, duration: float, delay: float, s: int) -> None:
        time.sleep(delay)
        cfg = HttpRunConfig(url=url, workload="mixed", rate=rate, duration_s=duration, seed=s, model=MODEL,
                            timeout_s=300)
        run = HttpLoadRun(cfg)
        runs.append(run)
        starts.append(time.monotonic())
        asyncio.run(run.run())

    t0 = time.monotonic()
    threads = [threading.Thread(target=go, args=(normal * capacity, total, 0.0, seed)),
               threading.Thread(target=go, args=((factor - normal) * capacity, over_s, pre_s, seed + 1))]
    with RssSampler() as rss:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    records = []
    for run in runs:
        base = run._start  # the run's own clock origin (monotonic)
        for rec in run.records:
            records.append((base + rec.sent_s - t0, base + rec.finish_s - t0, rec.result))
    phases = {"normal before": _phase_stats(records, 0, pre_s),
              f"{factor:g}x": _phase_stats(records, pre_s, pre_s + over_s),
              "normal after": _phase_stats(records, pre_s + over_s, total + 1)}
    base_p50 = phases["normal before"]["ttft_s"]["p50"]
    recovery = None
    for w in np.arange(pre_s + over_s, total, 1.0):
        win = _phase_stats(records, w, w + 5.0)
        if win["accepted"] and win["refused"] == 0 and win["ttft_s"]["p50"] <= 2 * base_p50:
            recovery = float(w - (pre_s + over_s))
            break
    ledger = [run.ledger.report() for run in runs]
    return {"capacity_rps": capacity, "phases": phases, "recovery_s": recovery,
            "peak_rss_mb": round(rss.peak / 2**20, 1), "rss_mb_first": round(rss.samples[0][1] / 2**20, 1),
            "lost": sum(x["lost"] for x in ledger), "accounting": ledger}


def tenants(speed: float, seconds: float, seed: int = 0, kv: int = 4000) -> dict[str, Any]:
    """Per-tenant fairness (module docstring, ``tenants``): the quiet tenant's TTFT alone, then
    beside a tenant sending five times its fair share, with the gate's tenant queues on and off."""
    cap = sim_capacity("mixed", 2, kv, seed) * speed
    quiet_rate, flood_rate = 0.25 * cap, 5 * 0.5 * cap
    env = {"FAIRWAY_BENCH_KEYS": "k-quiet=quiet,k-flood=flood"}
    auth = {"keys_env": "FAIRWAY_BENCH_KEYS"}

    def run(url: str, rate: float, key: str, s: int) -> dict[str, Any]:
        cfg = HttpRunConfig(url=url, workload="mixed", rate=rate, duration_s=seconds, seed=s, model=MODEL,
                            timeout_s=600, api_key=key)
        return asyncio.run(HttpLoadRun(cfg).run())

    out: dict[str, Any] = {"capacity_rps": cap, "quiet_rps": quiet_rate, "flood_rps": flood_rate}
    for fair in (True, False):
        with running_cluster(num_replicas=2, engine_args={"kv_blocks": kv, "speed": speed}, api_key="k-quiet",
                             env=env, auth=auth, replica={"tenant_fair": fair}) as url:
            if fair:
                out["quiet alone"] = run(url, quiet_rate, "k-quiet", seed)["ttft_s"]
            box: dict[str, Any] = {}

            def flooding(b: dict[str, Any] = box, u: str = url) -> None:
                b["res"] = run(u, flood_rate, "k-flood", seed + 1)

            flood = threading.Thread(target=flooding)
            flood.start()
            quiet = run(url, quiet_rate, "k-quiet", seed)
            flood.join()
            key = "fair queues" if fair else "one shared queue"
            out[key] = {"quiet": quiet["ttft_s"], "flood": box["res"]["ttft_s"],
                        "flood refused": box["res"]["n_rejected"], "lost": quiet["accounting"]["lost"]
                        + box["res"]["accounting"]["lost"]}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.reliability", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    commands = {"soak": {"--minutes": 10.0, "--rate": 4.0},
                "overload": {"--speed": 0.25, "--factor": 3.0, "--over-s": 60.0},
                "tenants": {"--speed": 0.25, "--seconds": 40.0}}
    for name, options in commands.items():
        p = sub.add_parser(name)
        for flag, default in options.items():
            p.add_argument(flag, type=float, default=default)
        p.add_argument("--seed", type=int, default=0)
        p.add_argument("--out", default="out/reliability")
        if name == "overload":
            p.add_argument("--max-wait", default="5", help="the gates' max_queue_wait_s; a comma list runs "
                                                           "one cluster per value, one after the other")
            p.add_argument("--hold", default="10", help="the router's router.hold.max_wait_s; a comma list as "
                                                        "--max-wait's")
    a = ap.parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    if a.cmd == "soak":
        faults = Path(tempfile.mkdtemp()) / "faults.json"
        stall = 5.0
        with running_cluster(num_replicas=2, ingress_replicas=2, engine_args={"kv_blocks": 4000},
                             replica={"stall_timeout_s": stall, "fault_file": str(faults)}) as url:
            rep = asyncio.run(soak(url, faults, a.minutes * 60, a.rate, a.seed, stall))
            rep["engines_idle_after_s"] = wait_idle(url, 2, 60.0)
        (out / "soak.json").write_text(json.dumps(rep, indent=1))
        print(f"soak {a.minutes:g} min at {a.rate:g} req/s: {format_report(rep['accounting'])}")
        h = rep["hostile"]
        print(f"hostile: {h['sent']} sent, {h['wrong']} wrong, {h['at_ingress_kill']} too big to replay "
              f"at the ingress kill {h['by_status']}")
        print(f"events: {rep['events']}\npeak RSS of the Ray workers: {rep['peak_rss_mb']} MB")
        print(f"engines idle after the load: {rep['engines_idle_after_s']} s")
        failures = soak_failures(rep)
        print("soak: " + ("passed" if not failures else "FAILED: " + "; ".join(failures)))
        return 1 if failures else 0
    if a.cmd == "tenants":
        rep = tenants(a.speed, a.seconds, a.seed)
        (out / "tenants.json").write_text(json.dumps(rep, indent=1))
        print(json.dumps(rep, indent=1))
        return 0
    kv = 4000
    cap = sim_capacity("mixed", 2, kv, a.seed) * a.speed
    reps = []
    for wait in [float(w) for w in str(a.max_wait).split(",")]:
        for hold in [float(h) for h in str(a.hold).split(",")]:
            with running_cluster(num_replicas=2, engine_args={"kv_blocks": kv, "speed": a.speed},
                                 replica={"max_queue_wait_s": wait}, router={"hold": {"max_wait_s": hold}}) as url:
                rep = overload(url, cap, a.seed, over_s=a.over_s, factor=a.factor)
            rep["max_queue_wait_s"] = wait
            rep["hold_s"] = hold
            reps.append(rep)
        print(json.dumps({k: v for k, v in rep.items() if k != "accounting"}, indent=1, default=str))
    (out / "overload.json").write_text(json.dumps(reps, indent=1, default=str))
    print(overload_table(reps))
    return 0 if all(r["lost"] == 0 for r in reps) else 1


def overload_table(reps: list[dict[str, Any]]) -> str:
    """One row per wait bound: the overload phase's refusals and TTFT, the recovery, memory."""
    rows = []
    for r in reps:
        over = next(v for k, v in r["phases"].items() if k.endswith("x"))
        after = r["phases"]["normal after"]
        rows.append([f"{r['max_queue_wait_s']:g} s", f"{r.get('hold_s', 0):g} s",
                     f"{over['accepted']} / {over['refused']}",
                     f"{over['refusal_time_s']['max'] * 1000:.0f} ms", f"{over['ttft_s']['p50']:.2f} s",
                     f"{over['ttft_s']['p99']:.1f} s", f"{over['ttft_s']['max']:.1f} s",
                     f"{after['ttft_s']['p50']:.2f} s / {after['ttft_s']['p99']:.1f} s",
                     "-" if r["recovery_s"] is None else f"{r['recovery_s']:g} s",
                     f"+{r['peak_rss_mb'] - r['rss_mb_first']:.0f} MB", str(r["lost"])])
    return md_table(["max_queue_wait_s", "router.hold.max_wait_s", "overload accepted / refused", "refusal max",
                     "TTFT p50", "p99", "max", "after: p50 / p99", "recovery", "peak memory", "lost"], rows)


if __name__ == "__main__":
    raise SystemExit(main())
