"""Reference servers for the streaming benchmark (``bench/stream.py``), each streaming one token per
``TOKEN_S`` per request in the cluster's SSE format, so the same client measures all three:

- ``bare``: the Fairway cluster's graph in bare Ray Serve (a FastAPI ingress, a streaming handle,
  2 replicas that yield one token per ``TOKEN_S``): what Ray Serve's per-item stream costs;
- ``python -m bench.stream_apps aiohttp --port P``: one aiohttp process, no Ray: the floor.

Both answer ``POST /v1/completions`` with ``max_tokens`` (streamed when ``stream`` is true, with a
final usage frame when ``stream_options.include_usage``), and ``GET /health``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from collections.abc import AsyncIterator
from typing import Annotated, Any

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from ray import serve

TOKEN_S = 0.008  # one token per 8 ms per stream, about the engine model's decode step


def frame(i: int) -> str:
    return "data: " + json.dumps({"id": "cmpl-0", "object": "text_completion", "choices": [
        {"index": 0, "text": "x", "token_ids": [i], "finish_reason": None}]}) + "\n\n"


def usage_frame(n: int) -> str:
    usage = {"prompt_tokens": 1, "completion_tokens": n, "total_tokens": n + 1}
    return "data: " + json.dumps({"id": "cmpl-0", "object": "text_completion", "choices": [], "usage": usage}) + "\n\n"


async def tokens(n: int) -> AsyncIterator[int]:
    for i in range(n):
        await asyncio.sleep(TOKEN_S)
        yield i


api = FastAPI()


@serve.deployment(num_replicas=2, max_ongoing_requests=4096, ray_actor_options={"num_cpus": 0.5})
class Tokens:
    async def generate(self, n: int) -> AsyncIterator[int]:
        async for i in tokens(n):
            yield i


class Ingress:
    def __init__(self, replicas: Any) -> None:
        self.handle = replicas.options(stream=True)


def current() -> Ingress:
    return serve.get_replica_context().servable_object


@api.get("/health")
async def health() -> JSONResponse:
    return JSONResponse({"status": "ok"})


@api.post("/v1/completions")
async def completions(request: Request, ingress: Annotated[Ingress, Depends(current)]) -> Any:
    body = await request.json()
    n = int(body.get("max_tokens", 16))
    gen = ingress.handle.generate.remote(n)
    if not body.get("stream"):
        count = 0
        async for _ in gen:
            count += 1
        return JSONResponse({"choices": [{"text": "x" * count}], "usage": {"completion_tokens": count}})

    async def sse() -> AsyncIterator[str]:
        async for i in gen:
            yield frame(i)
        yield usage_frame(n)
        yield "data: [DONE]\n\n"

    return StreamingResponse(sse(), media_type="text/event-stream")


def build_bare(args: dict[str, Any] | None = None) -> Any:
    """``serve run``'s builder hook for the bare Ray Serve graph."""
    ingress = serve.deployment(serve.ingress(api)(Ingress), name="Ingress", max_ongoing_requests=4096,
                               ray_actor_options={"num_cpus": 0.25})
    return ingress.bind(Tokens.bind())


def run_aiohttp(port: int) -> None:
    from aiohttp import web

    async def health(_: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        n = int(body.get("max_tokens", 16))
        if not body.get("stream"):
            count = 0
            async for _ in tokens(n):
                count += 1
            return web.json_response({"choices": [{"text": "x" * count}], "usage": {"completion_tokens": count}})
        resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await resp.prepare(request)
        async for i in tokens(n):
            await resp.write(frame(i).encode())
        await resp.write(usage_frame(n).encode())
        await resp.write(b"data: [DONE]\n\n")
        return resp

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_post("/v1/completions", completions)
    web.run_app(app, host="127.0.0.1", port=port, print=None)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.stream_apps", description=__doc__)
    ap.add_argument("server", choices=["aiohttp"])
    ap.add_argument("--port", type=int, required=True)
    a = ap.parse_args(argv)
    run_aiohttp(a.port)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
