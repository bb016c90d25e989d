"""Router overhead on a running cluster: the latency the ingress and the router add to a request.

``python -m bench.overhead --url http://127.0.0.1:8000 --ray-address 127.0.0.1:PORT``
connects a Ray driver to the cluster (``auto``: the newest local one) and sends, one at a time
and interleaved in a shuffled order within each round, the same 8k-token prompt by three paths:

- ``http``: ``POST /v1/completions`` (``max_tokens=1``, not streamed, prompt as token ids)
  through the Serve HTTP proxy, the ingress (validation, hashing) and the ingress's Fairway
  request router; timed at the client from send to the whole response;
- ``handle``: the same ``GenerateCall`` through a ``DeploymentHandle`` from this driver
  (``serve.get_deployment_handle("FairwayReplica", app_name="fairway")``, streaming): Ray
  Serve's handle path with its own Fairway request router (this process's), no HTTP, no
  ingress; timed from ``.remote()`` to the first chunk;
- ``actor`` (best effort, Ray-internal API): the call straight to the replica actor that holds
  the prompt (``handle_request_streaming``), bypassing every router; timed the same way;
- ``health``: ``GET /health``, the fixed cost of the HTTP proxy -> ingress hop with no prompt.

Why a cached prompt: after a warm-up every prompt family is fully cached on the replica it is
routed to, so each request costs the engine one constant ~6 ms step (16 recomputed tokens on an
8k context) instead of a ~290 ms cold prefill whose real-time sleep jitter would swamp the
milliseconds measured here. Every path pays that same step, so the differences are the
overheads: ``http - handle`` = HTTP proxy + ingress; ``handle - actor`` = Ray Serve's handle
routing path including the Fairway decision; ``decision_us`` = the decision alone, read from this
driver's ``FairwayRequestRouter.decision_s`` (same code as the ingress's router).
``offline_routing`` times the decision path with ``bench.routing`` for 2 and 16 replicas;
``ingress_cpu`` times, in this process, the prompt-dependent work the ingress does per request
(JSON decoding, request validation, block hashing, pickling the ``GenerateCall``).

All requests are sequential (one in flight), so nothing queues; the box's own noise shows in p99.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import pickle
import random
import time
import uuid
from typing import Any

import numpy as np

from fairway.hashing import block_hashes
from fairway.protocol import GenerateCall
from fairway.summary import pct

APP = "fairway"
DEPLOYMENT = "FairwayReplica"
PATHS = ("http", "handle", "actor", "health")


def family_prompt(family: int, n_tokens: int, vocab: int = 4096) -> list[int]:
    """A deterministic prompt of ``n_tokens`` ids in ``[16, vocab)`` for prompt family ``family``."""
    rng = np.random.default_rng([7, family])
    return rng.integers(16, vocab, size=n_tokens).tolist()


def ms(values: list[float]) -> dict[str, float]:
    """``pct`` of seconds, in milliseconds (``n`` unchanged)."""
    p = pct(values)
    return {k: (v if k == "n" else v * 1e3) for k, v in p.items()}


def paired_diffs(rounds: list[dict[str, float]], a: str, b: str) -> list[float]:
    """``a - b`` within each round where both paths were measured (seconds)."""
    return [r[a] - r[b] for r in rounds if a in r and b in r]


def summarize(rounds: list[dict[str, float]], extra: dict[str, list[float]]) -> dict[str, Any]:
    """Per-path latency (ms), per-pair median/p99 of the paired differences and of the
    distributions (ms), and the ``extra`` series (server-side timings, decision times)."""
    paths = {p: ms([r[p] for r in rounds if p in r]) for p in PATHS}
    diffs: dict[str, Any] = {}
    for a, b in (("http", "handle"), ("handle", "actor"), ("http", "actor")):
        d = paired_diffs(rounds, a, b)
        if not d:
            continue
        diffs[f"{a}-{b}"] = {
            "paired": ms(d),
            "p50_of_diff_ms": float(np.median(d)) * 1e3,
            "diff_of_p50_ms": paths[a]["p50"] - paths[b]["p50"],
            "diff_of_p99_ms": paths[a]["p99"] - paths[b]["p99"],
        }
    return {"paths_ms": paths, "diffs": diffs, "extra_ms": {k: ms(v) for k, v in extra.items() if v}}


def find_request_router(handle: Any) -> Any:
    """This driver's request router object behind ``handle`` (Ray-internal; None if not found)."""
    router = getattr(handle, "_router", None)
    inner = getattr(router, "_asyncio_router", None)
    return getattr(inner, "request_router", None) if inner is not None else None


class OverheadBench:
    """Holds the prompts, the HTTP session and the Ray handles; ``run()`` does the rounds."""

    def __init__(self, url: str, n: int, prompt_tokens: int, families: int, seed: int, model: str,
                 block_size: int = 16) -> None:
        self.url = url.rstrip("/")
        self.n = n
        self.prompt_tokens = prompt_tokens
        self.block_size = block_size
        self.model = model
        self.rng = random.Random(seed)
        self.prompts = [family_prompt(f, prompt_tokens) for f in range(families)]
        self.hashes = [tuple(block_hashes(p, block_size)) for p in self.prompts]
        self.bodies = [json.dumps({"model": model, "prompt": p, "max_tokens": 1, "temperature": 0}).encode()
                       for p in self.prompts]
        self.home: dict[int, str] = {}  # family -> replica unique id (where it is cached)
        self.actors: dict[str, Any] = {}  # replica unique id -> actor handle
        self.rounds: list[dict[str, float]] = []
        self.extra: dict[str, list[float]] = {"ingress_ttft": [], "replica_ttft_http": [], "replica_ttft_handle": []}
        self.cached: dict[str, list[float]] = {p: [] for p in PATHS}
        self.errors: dict[str, str] = {}

    def call(self, family: int) -> GenerateCall:
        return GenerateCall(request_id=f"bench-{uuid.uuid4().hex[:12]}", prompt_token_ids=self.prompts[family],
                            block_hashes=self.hashes[family], max_tokens=1, arrival_s=time.time(), model=self.model)

    async def http(self, session: Any, family: int) -> float:
        t0 = time.perf_counter()
        async with session.post(f"{self.url}/v1/completions", data=self.bodies[family],
                                headers={"content-type": "application/json"}) as r:
            body = await r.read()
        dt = time.perf_counter() - t0
        if r.status != 200:
            raise RuntimeError(f"HTTP {r.status}: {body[:200]!r}")
        d = json.loads(body)
        fw = d.get("fairway", {})
        self.extra["ingress_ttft"].append(float(fw.get("ttft_s", 0.0)))
        self.extra["replica_ttft_http"].append(float(fw.get("replica_ttft_s", 0.0)))
        self.cached["http"].append(d["usage"]["prompt_tokens_details"]["cached_tokens"] / self.prompt_tokens)
        self.home.setdefault(family, fw.get("replica", ""))
        return dt

    async def health(self, session: Any) -> float:
        t0 = time.perf_counter()
        async with session.get(f"{self.url}/health") as r:
            await r.read()
        return time.perf_counter() - t0

    async def handle(self, h: Any, family: int) -> float:
        t0 = time.perf_counter()
        gen = h.generate.remote(self.call(family))
        first = None
        async for c in gen:
            if first is None:
                first = c
                dt = time.perf_counter() - t0
        assert first is not None
        self.extra["replica_ttft_handle"].append(first.ttft_s)
        self.cached["handle"].append(first.cached_tokens / self.prompt_tokens)
        self.home[family] = first.replica
        return dt

    async def actor(self, family: int) -> float:
        from ray.serve._private.common import RequestMetadata

        actor = self.actors[self.home[family]]
        call = self.call(family)
        meta = pickle.dumps(RequestMetadata(request_id=call.request_id, internal_request_id=uuid.uuid4().hex,
                                            call_method="generate", app_name=APP, is_streaming=True))
        t0 = time.perf_counter()
        gen = actor.handle_request_streaming.options(num_returns="streaming").remote(meta, call)
        first = None
        async for ref in gen:
            c = await ref
            if first is None:
                first = c
                dt = time.perf_counter() - t0
        assert first is not None
        self.cached["actor"].append(first.cached_tokens / self.prompt_tokens)
        return dt

    def find_actors(self) -> None:
        import ray

        for a in ray.util.list_named_actors(all_namespaces=True):
            name = a["name"] if isinstance(a, dict) else a
            if name.startswith("SERVE_REPLICA::") and f"#{DEPLOYMENT}#" in name:
                ns = a.get("namespace", "serve") if isinstance(a, dict) else "serve"
                self.actors[name.rsplit("#", 1)[1]] = ray.get_actor(name, namespace=ns)

    async def run(self, warmup: int = 3) -> dict[str, Any]:
        import aiohttp
        from ray import serve

        h = serve.get_deployment_handle(DEPLOYMENT, app_name=APP).options(stream=True)
        families = range(len(self.prompts))
        async with aiohttp.ClientSession() as session:
            for _ in range(warmup):  # fill the caches on both routers' choices, start the connections
                for f in families:
                    await self.http(session, f)
                    await self.handle(h, f)
            self.find_actors()
            use_actor = all(self.home.get(f) in self.actors for f in families)
            if use_actor:
                try:
                    for f in families:
                        await self.actor(f)
                except Exception as e:  # noqa: BLE001 - Ray-internal path: report, measure the rest
                    use_actor = False
                    self.errors["actor"] = f"{type(e).__name__}: {e}"
            else:
                self.errors["actor"] = f"replica actors not found ({sorted(self.actors)} vs {self.home})"
            for k in self.extra.values():
                k.clear()
            for k in self.cached.values():
                k.clear()
            router = find_request_router(h)
            decision = getattr(router, "decision_s", None)
            if decision is not None:
                decision.clear()
            paths = [p for p in PATHS if p != "actor" or use_actor]
            for i in range(self.n):
                f = i % len(self.prompts)
                order = list(paths)
                self.rng.shuffle(order)
                row: dict[str, float] = {}
                for p in order:
                    if p == "http":
                        row[p] = await self.http(session, f)
                    elif p == "handle":
                        row[p] = await self.handle(h, f)
                    elif p == "health":
                        row[p] = await self.health(session)
                    else:
                        row[p] = await self.actor(f)
                self.rounds.append(row)
        out = summarize(self.rounds, self.extra)
        out["decision_us"] = ({k: (v if k == "n" else v * 1e6) for k, v in pct(decision).items()}
                              if decision else None)
        out["fully_cached_fraction"] = {p: float(np.mean(np.array(v) >= 1 - 16 / self.prompt_tokens))
                                        for p, v in self.cached.items() if v}
        out["errors"] = self.errors
        out["router_class"] = type(router).__name__ if router is not None else None
        return out


def offline_routing(replicas: tuple[int, ...] = (2, 16), routers: tuple[str, ...] = ("fairway", "pow2", "ray-prefix"),
                    prompt_tokens: int = 8192, cycles: int = 2000) -> list[dict[str, Any]]:
    """``bench.routing.measure`` for each router x replica count (microseconds)."""
    from bench.routing import measure

    return [{"router": name, "replicas": n, "prompt_tokens": prompt_tokens, **measure(name, n, prompt_tokens, cycles)}
            for n in replicas for name in routers]


def ingress_cpu(prompt_tokens: int = 8192, reps: int = 200, block_size: int = 16) -> dict[str, dict[str, float]]:
    """Per-request ingress work that grows with the prompt, timed here (ms): decoding the JSON
    body, validating it (``CompletionRequest``), hashing the blocks, pickling the call."""
    from router.openai_api import CompletionRequest

    ids = family_prompt(0, prompt_tokens)
    body = json.dumps({"model": "fairway-tiny", "prompt": ids, "max_tokens": 1}).encode()
    steps: dict[str, list[float]] = {"json_decode": [], "validate": [], "hash_blocks": [], "pickle_call": []}
    for _ in range(reps):
        t0 = time.perf_counter()
        d = json.loads(body)
        t1 = time.perf_counter()
        req = CompletionRequest.model_validate(d)
        t2 = time.perf_counter()
        hashes = tuple(block_hashes(list(req.prompt), block_size))
        t3 = time.perf_counter()
        pickle.dumps(GenerateCall("x", list(req.prompt), hashes, 1, time.time()))
        t4 = time.perf_counter()
        for k, dt in zip(steps, (t1 - t0, t2 - t1, t3 - t2, t4 - t3), strict=True):
            steps[k].append(dt)
    return {k: ms(v) for k, v in steps.items()}


def connect(ray_address: str) -> None:
    """Join the cluster as a driver. A local ``serve run`` starts Ray with token authentication
    (the token in ``~/.ray/auth_token``) while a connecting driver defaults to none: ask for it
    (before Ray is first imported: it reads the mode then)."""
    os.environ.setdefault("RAY_AUTH_MODE", "token")
    import ray

    ray.init(address=ray_address, namespace="fairway-bench", logging_level="ERROR", log_to_driver=False)


def replica_info(ray_address: str, calls: int = 40) -> list[dict[str, Any]]:
    """Each replica's ``info()`` (engine limits and the sim engine's pacing figures), through the
    public handle: non-generation calls go to any replica, so ``calls`` of them reach both."""
    connect(ray_address)
    import ray
    from ray import serve

    try:
        h = serve.get_deployment_handle(DEPLOYMENT, app_name=APP)
        seen: dict[str, dict[str, Any]] = {}
        for _ in range(calls):
            d = h.info.remote().result(timeout_s=30)
            seen[d["replica"]] = d
    finally:
        ray.shutdown()
    return [seen[k] for k in sorted(seen)]


def run_bench(url: str, ray_address: str, n: int = 300, prompt_tokens: int = 8192, families: int = 4,
              seed: int = 0, model: str = "fairway-tiny", offline: bool = True) -> dict[str, Any]:
    """Connect to the cluster, measure, disconnect; the JSON-ready result."""
    connect(ray_address)
    import ray

    try:
        bench = OverheadBench(url, n, prompt_tokens, families, seed, model)
        res = asyncio.run(bench.run())
    finally:
        ray.shutdown()
    res.update({"url": url, "n_rounds": n, "prompt_tokens": prompt_tokens, "families": families, "seed": seed,
                "method": "sequential, shuffled order within each round, fully cached prompt, max_tokens=1"})
    if offline:
        res["offline_routing"] = offline_routing(prompt_tokens=prompt_tokens)
        res["ingress_cpu_ms"] = ingress_cpu(prompt_tokens)
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.overhead", description=__doc__.splitlines()[0])
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--ray-address", default="auto")
    ap.add_argument("--n", type=int, default=300, help="rounds (one request per path each)")
    ap.add_argument("--prompt-tokens", type=int, default=8192)
    ap.add_argument("--families", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-offline", action="store_true", help="skip the offline routing micro-benchmark")
    ap.add_argument("--replica-info", action="store_true", help="only print each replica's info() (pacing figures)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.replica_info:
        info = replica_info(args.ray_address)
        print(json.dumps(info, indent=1))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(info, f, indent=1)
        return 0
    res = run_bench(args.url, args.ray_address, args.n, args.prompt_tokens, args.families, args.seed,
                    offline=not args.no_offline)
    from bench.tables import overhead_table

    print(overhead_table(res))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
