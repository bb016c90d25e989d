"""The front door's stall: what one maximum-size prompt does to every other client of an ingress.

``python -m bench.frontdoor --streams 16 --prompt-mb 7.5 [--code DIR]`` serves the ingress's
FastAPI app (``router/ingress.py``, the code under ``--code``: default this checkout, so an older
checkout can be measured side by side) with uvicorn in a subprocess, behind a scripted replica
handle (no Ray, no engine: each call streams one token every ``--token-interval-ms``). The client
(this process, aiohttp) keeps ``--streams`` streams running, then sends one text prompt of
``--prompt-mb`` MB (under the 8 MiB body limit; ``--shape`` other than ``text``: a short prompt and
that many MB of JSON structure, ``large_body``), and meanwhile 1-token requests one after another
(50 ms apart) until it is answered. It reports:

- the large request's status and time to its answer;
- the slowest of the 1-token requests (and how many were sent);
- the longest gap between two events of any other stream, in the window from the large request
  to its answer plus 1 s, beside the same figure in an equal window just before (the baseline).

Results: one JSON object on stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from observability.exporter import free_port

MODEL = "fairway-tiny"
ROOT = Path(__file__).resolve().parents[1]


def serve(port: int, interval_s: float) -> None:
    """The server side (a subprocess): the ingress app over a scripted replica handle."""
    import uvicorn

    import router.ingress as ingress_mod
    from fairway.protocol import TokenChunk
    from router.ingress import FairwayIngress, IngressArgs, app

    class Gen:
        def __init__(self, call: Any) -> None:
            self.n, self.i, self.prompt = call.max_tokens, 0, len(call.prompt_token_ids)

        def __aiter__(self) -> Gen:
            return self

        async def __anext__(self) -> TokenChunk:
            if self.i >= self.n:
                raise StopAsyncIteration
            self.i += 1
            await asyncio.sleep(interval_s)
            done = self.i == self.n
            return TokenChunk(token_ids=[100 + self.i % 1000], finished=done, finish_reason="length" if done else None,
                              prompt_tokens=self.prompt, completion_tokens=self.i, replica="r0")

        def cancel(self) -> None:
            pass

    class Replicas:
        def options(self, **_: Any) -> Replicas:
            return self

        @property
        def generate(self) -> Replicas:
            return self

        def remote(self, call: Any) -> Gen:
            return Gen(call)

    ingress = FairwayIngress(Replicas(), IngressArgs(model=MODEL, metrics=False))
    ingress_mod.current_ingress = lambda: ingress
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="error", lifespan="off")


async def wait_up(url: str, timeout_s: float = 60) -> None:
    import aiohttp

    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession() as s:
        while True:
            try:
                async with s.get(url + "/health") as r:
                    if r.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError("the ingress did not start")
            await asyncio.sleep(0.1)


#: The large body's shapes (``--shape``): what its megabytes are made of
SHAPES = ("text", "members", "arrays", "batch", "kept", "kept-word")


def large_body(shape: str, mb: float) -> bytes:
    """A body of about ``mb`` MB: a text prompt (``text``), or a short prompt with the rest in one
    structure: an object's members (``members``: a ``logit_bias`` of that many token ids), empty
    arrays (``arrays``: inside a ``response_format`` schema), or a batch of one-token prompts
    (``batch``); or a text prompt served with ``truncate_prompt_tokens: -1`` (its last tokens
    kept: ``kept``; ``kept-word``: one word of that many letters, whose kept side has no
    whitespace to cut at). ``members``, ``arrays`` and ``batch`` are what JSON parsing costs most
    per byte; the two ``kept`` shapes are answered 200, their tokenization bounded by what is
    kept."""
    n = int(mb * 1e6)
    body: dict[str, Any] = {"model": MODEL, "prompt": "hi", "max_tokens": 1}
    if shape == "text":
        body["prompt"] = "word " * (n // 5)
    elif shape == "members":
        body["logit_bias"] = {str(i): 1 for i in range(n // 12)}
    elif shape == "arrays":
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "a", "schema": {
            "type": "object", "x": [[]] * (n // 4)}}}
    elif shape == "batch":
        body["prompt"] = [[1]] * (n // 5)
    elif shape in ("kept", "kept-word"):
        body["prompt"] = "word " * (n // 5) if shape == "kept" else "a" * n
        body["truncate_prompt_tokens"], body["truncation_side"] = -1, "left"
    else:
        raise ValueError(f"unknown shape {shape!r}; known: {', '.join(SHAPES)}")
    return json.dumps(body).encode()


async def drive(url: str, streams: int, prompt_mb: float, warmup_s: float, shape: str = "text") -> dict[str, Any]:
    import aiohttp

    events: list[list[float]] = [[] for _ in range(streams)]
    stop = asyncio.Event()

    async def stream(i: int, s: aiohttp.ClientSession) -> None:
        body = {"model": MODEL, "prompt": [5, 6, 7, 8], "max_tokens": 30_000, "stream": True}
        while not stop.is_set():
            async with s.post(url + "/v1/completions", json=body) as r:
                async for line in r.content:
                    if line.startswith(b"data: "):
                        events[i].append(time.monotonic())
                    if stop.is_set():
                        return

    async def timed(s: aiohttp.ClientSession, data: bytes) -> tuple[int, float]:
        t0 = time.monotonic()
        async with s.post(url + "/v1/completions", data=data, headers={"Content-Type": "application/json"}) as r:
            await r.read()
            return r.status, time.monotonic() - t0

    big = large_body(shape, prompt_mb)
    small = json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 1}).encode()
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=600)) as s:
        tasks = [asyncio.create_task(stream(i, s)) for i in range(streams)]
        await asyncio.sleep(warmup_s)
        t_big = time.monotonic()
        big_task = asyncio.create_task(timed(s, big))
        smalls: list[tuple[int, float]] = []
        while not big_task.done():
            smalls.append(await timed(s, small))
            await asyncio.sleep(0.05)
        big_status, big_s = await big_task
        await asyncio.sleep(1.0)
        stop.set()
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    window = big_s + 1.0

    def max_gap(t0: float, t1: float) -> float:
        gaps = [b - a for ev in events for a, b in zip(ev, ev[1:], strict=False) if t0 <= b and a <= t1]
        return max(gaps, default=float("nan"))

    return {"shape": shape, "prompt_bytes": len(big), "big_status": big_status, "big_answer_s": round(big_s, 4),
            "small_sent": len(smalls), "small_statuses": sorted({st for st, _ in smalls}),
            "small_max_answer_s": round(max(t for _, t in smalls), 4),
            "max_gap_during_s": round(max_gap(t_big, t_big + window), 4),
            "max_gap_before_s": round(max_gap(t_big - window, t_big), 4), "streams": streams}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.frontdoor", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--prompt-mb", type=float, default=7.5)
    ap.add_argument("--shape", choices=SHAPES, default="text", help="what the large body is made of (large_body)")
    ap.add_argument("--token-interval-ms", type=float, default=20.0)
    ap.add_argument("--warmup-s", type=float, default=2.0)
    ap.add_argument("--code", default=str(ROOT), help="the checkout whose router/ingress.py is served")
    ap.add_argument("--serve", type=int, help=argparse.SUPPRESS)  # internal: be the server on this port
    a = ap.parse_args(argv)
    if a.serve:
        serve(a.serve, a.token_interval_ms / 1000)
        return 0
    port = free_port()
    code = str(Path(a.code).resolve())
    env = {**os.environ, "PYTHONPATH": code}
    proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--serve", str(port),
                             "--token-interval-ms", str(a.token_interval_ms)], cwd=code, env=env)
    try:
        url = f"http://127.0.0.1:{port}"
        asyncio.run(wait_up(url))
        out = asyncio.run(drive(url, a.streams, a.prompt_mb, a.warmup_s, a.shape))
    finally:
        proc.terminate()
        proc.wait(30)
    print(json.dumps({"code": code, **out}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
