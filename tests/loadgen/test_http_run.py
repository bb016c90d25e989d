"""The HTTP load generator against a fake OpenAI-compatible server (aiohttp, 127.0.0.1, port 0).

The fake implements the ingress contract (SSE chunks, a usage + ``fairway`` chunk, ``[DONE]``,
429 with Retry-After, a request that never answers) with a never-evicting prefix cache over
16-token blocks, and records what it received, so counts, lanes and cached tokens can be
checked exactly; timings are checked against its injected delays with generous bounds.
"""

from __future__ import annotations

import asyncio
import io
import json
import socket
import subprocess
import sys
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
import pytest_asyncio
from aiohttp import web

from loadgen.cli import main
from loadgen.http_run import HTTP_ONLY_KEYS, HttpLoadRun, HttpRunConfig
from loadgen.prompts import FIRST_ID, PromptBuilder, SessionContexts
from sim.runner import RunConfig, run
from tests.factories import ListWorkload, chain, spec
from workloads.concurrency import ConcurrencyWorkload
from workloads.content import LogNormalLen as Len
from workloads.registry import make_workload
from workloads.stats import drain
from workloads.synthetic import AgenticParams, AgenticWorkload

BS = 16


# ------------------------------------------------------------------------------- fake server


@dataclass
class Received:
    """One request as the fake server saw it."""

    index: int
    prompt: list[int]
    max_tokens: int
    status: int = 200
    output: list[int] = field(default_factory=list)
    cached: int = 0
    lane: str = ""
    chunks: int = 0
    authorization: str | None = None
    priority: str | None = None


@dataclass
class FakeOpenAI:
    """A tiny OpenAI-compatible completions server. ``reject(i)``: answer the i-th request (0-based,
    in receive order) with 429; ``hang(i)``: never answer it (until teardown); ``cut(i)``: end its
    stream after the first token chunk with no ``[DONE]``; ``fail(i)``: end it there with an error
    event and ``[DONE]``. ``gone`` counts streams whose client went away before the end."""

    ttft_s: float = 0.02
    itl_s: float = 0.004
    tokens_per_chunk: int = 64
    return_ids: bool = True
    reject: Callable[[int], bool] = lambda i: False
    hang: Callable[[int], bool] = lambda i: False
    cut: Callable[[int], bool] = lambda i: False
    fail: Callable[[int], bool] = lambda i: False
    gone: int = 0
    received: list[Received] = field(default_factory=list)
    in_flight: int = 0
    max_in_flight: int = 0
    url: str = ""

    def __post_init__(self) -> None:
        self._cache: set[int] = set()
        self._stop = asyncio.Event()

    def _blocks(self, ids: list[int]) -> list[int]:
        keys, parent = [], 0
        for i in range(len(ids) // BS):
            parent = hash((parent, tuple(ids[i * BS:(i + 1) * BS])))
            keys.append(parent)
        return keys

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "fake-model", "object": "model"}]})

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        assert body["stream"] is True and body["return_token_ids"] is True and body["ignore_eos"] is True
        assert body["model"] == "fake-model"
        rec = Received(len(self.received), list(body["prompt"]), int(body["max_tokens"]),
                       authorization=request.headers.get("Authorization"), priority=body.get("priority"))
        self.received.append(rec)
        if self.hang(rec.index):
            await self._stop.wait()
            return web.json_response({"error": {"message": "shutting down"}}, status=503)
        if self.reject(rec.index):
            rec.status = 429
            err = {"error": {"message": "queue full", "type": "rate_limit_error", "code": "queue_full"}}
            return web.json_response(err, status=429, headers={"Retry-After": "0"})
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            return await self._stream(request, rec)
        finally:
            self.in_flight -= 1

    async def _stream(self, request: web.Request, rec: Received) -> web.StreamResponse:
        keys = self._blocks(rec.prompt)
        hit = 0
        while hit < len(keys) and keys[hit] in self._cache:
            hit += 1
        rec.cached = hit * BS
        rec.lane = "fast" if rec.cached else "fair"
        rec.output = [FIRST_ID + (rec.index * 131 + j * 7) % 4000 for j in range(rec.max_tokens)]
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)

        async def send(obj: Any) -> None:
            await resp.write(b"data: " + (obj if isinstance(obj, bytes) else json.dumps(obj).encode()) + b"\n\n")

        def chunk(ids: list[int], finish: str | None) -> dict[str, Any]:
            choice: dict[str, Any] = {"index": 0, "text": "".join(f" t{i}" for i in ids), "finish_reason": finish}
            if self.return_ids:
                choice["token_ids"] = ids
            return {"id": "cmpl-x", "object": "text_completion", "choices": [choice]}

        await send(chunk([], None) | {"choices": [{"index": 0, "text": "", "finish_reason": None}]})  # no token
        await asyncio.sleep(self.ttft_s)
        n = len(rec.output)
        try:
            for start in range(0, n, self.tokens_per_chunk):
                if start:
                    await asyncio.sleep(self.itl_s)
                if start and self.cut(rec.index):
                    return resp  # the connection ends with no [DONE]: a cut stream
                if start and self.fail(rec.index):
                    await send({"error": {"message": "engine failed", "type": "server_error", "code": 503}})
                    await send(b"[DONE]")
                    return resp
                end = min(n, start + self.tokens_per_chunk)
                await send(chunk(rec.output[start:end], "length" if end == n else None))
                rec.chunks += 1
        except (ConnectionResetError, asyncio.CancelledError):
            self.gone += 1
            raise
        self._cache.update(self._blocks(rec.prompt + rec.output))
        usage = {"prompt_tokens": len(rec.prompt), "completion_tokens": n, "total_tokens": len(rec.prompt) + n,
                 "prompt_tokens_details": {"cached_tokens": rec.cached}}
        fw = {"lane": rec.lane, "replica": f"r{rec.index % 2}", "queue_wait_s": 0.001 * rec.index,
              "ttft_s": self.ttft_s, "policy": "fake-fairway"}
        await send({"id": "cmpl-x", "object": "text_completion", "choices": [], "usage": usage, "fairway": fw})
        await send(b"[DONE]")
        await resp.write_eof()
        return resp


@pytest_asyncio.fixture
async def serve():
    """``await serve(FakeOpenAI(...))`` starts it; teardown stops it and checks no task leaked."""
    runners: list[tuple[FakeOpenAI, web.AppRunner]] = []

    async def start(fake: FakeOpenAI) -> FakeOpenAI:
        app = web.Application(client_max_size=64 * 1024**2)
        app.router.add_get("/v1/models", fake.models)
        app.router.add_post("/v1/completions", fake.completions)
        runner = web.AppRunner(app, shutdown_timeout=1.0)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        fake.url = f"http://127.0.0.1:{port}"
        runners.append((fake, runner))
        return fake

    yield start
    for fake, runner in runners:
        fake._stop.set()
        await runner.cleanup()
    await asyncio.sleep(0)
    leaked = [t for t in asyncio.all_tasks() if t is not asyncio.current_task() and not t.done()]
    assert not leaked, leaked


def cfg(url: str, workload: str = "mixed", **kw: Any) -> HttpRunConfig:
    return HttpRunConfig(url=url, workload=workload, **kw)


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def small_agentic(seed: int = 3, sessions_rate: float = 4.0, duration_s: float = 1.0) -> AgenticWorkload:
    """Short sessions with small contexts and ~10 ms think times (a real-time closed loop)."""
    params = AgenticParams(preamble_tokens=200, task_len=Len(40, 0.5, 16, 200), tool_output_len=Len(60, 0.5, 16, 300),
                           output_len=Len(20, 0.5, 8, 60), mean_turns=3, max_turns=4, think_mean_s=0.01)
    return AgenticWorkload(np.random.default_rng(seed), rate=sessions_rate, duration_s=duration_s, params=params)


# ------------------------------------------------------------------------------------ prompts


def test_equal_block_hashes_give_equal_token_prefixes_and_different_ones_differ():
    pb = PromptBuilder(vocab_size=4096)
    a = spec(0, 0.0, 4 * BS + 5, 8, chain("a", 5))
    b = spec(1, 0.0, 4 * BS + 5, 8, chain("a", 2) + chain("b", 3, start=2))
    ia, ib = pb.token_ids(a), pb.token_ids(b)
    assert ia.size == ib.size == 4 * BS + 5
    assert np.array_equal(ia[: 2 * BS], ib[: 2 * BS])
    for blk in range(2, 4):
        assert not np.array_equal(ia[blk * BS:(blk + 1) * BS], ib[blk * BS:(blk + 1) * BS])
    assert not np.array_equal(ia[4 * BS:], ib[4 * BS:])  # partial tails come from the rid
    assert np.array_equal(ia, pb.token_ids(a))  # deterministic
    assert ia.min() >= FIRST_ID and ia.max() < 4096
    assert PromptBuilder(vocab_size=64).token_ids(a).max() < 64
    prefix = np.arange(100, 100 + 40)
    with_prefix = pb.token_ids(a, prefix)
    assert np.array_equal(with_prefix[:40], prefix) and np.array_equal(with_prefix[40:], ia[40:])


def test_shared_prefix_length_in_ids_equals_shared_hashes_on_a_real_workload():
    specs = list(make_workload("mixed", rate=10, duration_s=3, seed=2).initial())[:20]
    pb = PromptBuilder()
    ids = [pb.token_ids(s) for s in specs]

    def common(x, y) -> int:
        n = 0
        while n < min(len(x), len(y)) and x[n] == y[n]:
            n += 1
        return n

    shared_pairs = 0
    for i in range(len(specs)):
        for j in range(i):
            a, b = specs[i], specs[j]
            full = min(a.prompt_tokens, b.prompt_tokens) // BS
            hashes = common(a.block_hashes[:full], b.block_hashes[:full])
            blocks = common(ids[i][: full * BS], ids[j][: full * BS]) // BS
            assert blocks == hashes
            shared_pairs += hashes > 0
    assert shared_pairs > 0  # the check is not vacuous: mixed's cheap requests share prefixes


def test_session_contexts_need_an_extension_and_stay_bounded():
    ctx = SessionContexts(max_tokens=100)
    prev = spec(0, 0.0, 32, 16, chain("s", 3))
    prev.session = 7
    ctx.remember(prev, np.arange(32), np.arange(16))
    other = spec(1, 0.0, 80, 8, chain("t", 5))
    other.session = 7
    assert ctx.prefix_for(other) is None and len(ctx) == 1  # not an extension: kept
    nxt = spec(2, 0.0, 80, 8, chain("s", 5))
    nxt.session = 7
    assert np.array_equal(ctx.prefix_for(nxt), np.concatenate([np.arange(32), np.arange(16)]))
    assert len(ctx) == 0 and ctx.tokens == 0  # used once, then forgotten
    for sid in range(3):  # 3 x 48 tokens > 100: the oldest is dropped
        s = spec(sid, 0.0, 32, 16, chain("s", 3))
        s.session = sid
        ctx.remember(s, np.arange(32), np.arange(16))
    assert len(ctx) == 2 and ctx.tokens == 96


# ------------------------------------------------------------------------------- open loop


@pytest.mark.asyncio
async def test_open_loop_counts_timings_lanes_and_cache_are_exact(serve):
    fake = await serve(FakeOpenAI(ttft_s=0.03, itl_s=0.004, tokens_per_chunk=64))
    c = cfg(fake.url, "mixed", rate=20, duration_s=1.0, seed=0)
    expected = list(make_workload("mixed", rate=20, duration_s=1.0, seed=0).initial())
    progress = io.StringIO()
    runner = HttpLoadRun(c, progress=progress)
    res = await runner.run()

    n = len(expected)
    assert n > 5
    assert res["n_requests"] == res["n_finished"] == len(fake.received) == n
    assert res["n_rejected"] == res["n_unfinished"] == 0 and res["errors_by_status"] == {}
    assert sorted(len(r.prompt) for r in fake.received) == sorted(s.prompt_tokens for s in expected)
    assert sorted(r.max_tokens for r in fake.received) == sorted(s.output_tokens for s in expected)
    by_rid = sorted(runner.records, key=lambda r: r.rid)
    assert [r.rid for r in by_rid] == [s.rid for s in expected]
    assert all(r.sent_s >= r.arrival_s for r in by_rid)  # sent no earlier than the workload says
    assert [r.arrival_s for r in by_rid] == [s.arrival_s for s in expected]

    assert res["ttft_s"]["n"] == n and res["ttft_s"]["p50"] >= 0.03  # the empty first chunk is no token
    gaps = sum(r.chunks - 1 for r in fake.received)
    assert res["itl_s"]["n"] == gaps > 0 and res["itl_s"]["mean"] >= 0.25 * 0.004
    for r in runner.records:
        chunks = -(-r.result.completion_tokens // 64)
        assert r.result.e2e_s >= 0.03 + (chunks - 1) * 0.004 and r.result.e2e_s >= r.result.ttft_s

    lanes = Counter(r.lane for r in fake.received)
    assert {k: v["n"] for k, v in res["ttft_by_lane_s"].items()} == dict(lanes)
    assert lanes["fast"] > 0  # mixed shares prefixes, so the fake cache hit
    prompt = sum(len(r.prompt) for r in fake.received)
    cached = sum(r.cached for r in fake.received)
    assert res["cache_hit_ratio"] == cached / prompt
    assert res["queue_wait_s"]["n"] == n
    assert res["queue_wait_s"]["max"] == pytest.approx(0.001 * (n - 1))
    assert res["ttft_by_class_s"]["cheap"]["n"] + res["ttft_by_class_s"]["expensive"]["n"] == n
    assert res["policy"] == "fake-fairway" and res["model"] == "fake-model" and res["replicas"] == 2
    assert sum(p["requests"] for p in res["per_replica"]) == n
    assert res["wall_s"] >= expected[-1].arrival_s
    text = progress.getvalue()
    assert text.startswith("\rloadgen: sent") and text.endswith("\n") and f"ok {n}" in text


@pytest.mark.asyncio
async def test_a_class_mix_sends_each_class_as_priority_and_sums_up_attainment_by_class(serve):
    """``class_mix``: every request carries its drawn class as the body's ``priority``, drawn as
    the simulator draws it for the same seed; the summary counts each class, and its attainment
    is the share of its sent requests whose first token met its objective (refusals miss)."""
    fake = await serve(FakeOpenAI(ttft_s=0.03, reject=lambda i: i == 0))
    c = cfg(fake.url, "mixed", rate=20, duration_s=1.0, seed=0, class_mix="interactive=1,batch=3",
            class_objectives="interactive=10,batch=0.001")
    runner = HttpLoadRun(c)
    res = await runner.run()
    from workloads.class_mix import ClassMix, parse_mix
    expected = {s.rid: s.priority_class for s in ClassMix(make_workload("mixed", rate=20, duration_s=1.0, seed=0),
                                                           parse_mix("interactive=1,batch=3"), 0).initial()}
    assert {r.rid: r.klass for r in runner.records} == expected
    assert Counter(r.priority for r in fake.received) == Counter(expected.values())
    by = res["by_class"]
    assert set(by) == {"interactive", "batch"} and by["interactive"]["n"] + by["batch"]["n"] == len(expected)
    first = fake.received[0].priority  # the refused one
    assert by[first]["n_rejected"] == 1 and by[first]["n_finished"] == by[first]["n"] - 1
    assert by["interactive"]["attainment"] == pytest.approx(by["interactive"]["n_finished"] / by["interactive"]["n"])
    assert by["batch"]["attainment"] == 0.0  # 1 ms: no first token comes that fast
    with pytest.raises(ValueError, match="bad class objective"):
        cfg(fake.url, class_mix="a=1", class_objectives="a=0")


@pytest.mark.asyncio
async def test_rejections_and_timeouts_are_counted_not_hung(serve):
    fake = await serve(FakeOpenAI(reject=lambda i: i in (1, 3), hang=lambda i: i == 4))
    specs = [spec(i, 0.01 * i, 40, 8, chain(f"p{i}", 2)) for i in range(7)]
    runner = HttpLoadRun(cfg(fake.url, timeout_s=0.5), ListWorkload(specs))
    res = await asyncio.wait_for(runner.run(), 10)
    assert res["n_requests"] == 7 and res["n_finished"] == 4
    assert res["n_rejected"] == 2 and res["n_unfinished"] == 1
    assert res["errors_by_status"] == {"429": 2, "timeout": 1}
    assert res["ttft_s"]["n"] == 4 and res["n_retries"] == 0
    assert 0.5 <= res["wall_s"] < 5


@pytest.mark.asyncio
async def test_every_request_gets_exactly_one_outcome_and_the_silent_failures_are_lost(serve):
    """Seven requests, one of each fate: completed (2), refused with 429 (retryable), a hang
    (timeout: lost), a stream cut without [DONE] (lost), a stream ended by an error event
    (failed), and a client that hangs up after its first token (disconnected)."""
    fake = await serve(FakeOpenAI(tokens_per_chunk=2, itl_s=0.05, reject=lambda i: i == 1,
                                  hang=lambda i: i == 2, cut=lambda i: i == 3, fail=lambda i: i == 4))
    specs = [spec(i, 0.02 * i, 40, 8, chain(f"p{i}", 2)) for i in range(7)]
    runner = HttpLoadRun(cfg(fake.url, timeout_s=1.0), ListWorkload(specs))
    # request 5's client leaves after one token event (keyed by the request, not the issue
    # order, which a loaded machine can shuffle among requests 20 ms apart)
    runner._hang_up = lambda s: (None, 1) if s.rid == 5 else (None, None)
    res = await asyncio.wait_for(runner.run(), 10)
    acc = res["accounting"]
    assert {k: acc[k] for k in ("sent", "completed", "refused", "failed", "disconnected", "lost")} == {
        "sent": 7, "completed": 2, "refused": 1, "failed": 1, "disconnected": 1, "lost": 2}
    assert acc["refused_by_status"] == {"429": 1} and acc["retryable"] == 2  # the 429 and the failure
    assert sorted(e["status"] for e in acc["lost_examples"]) == ["stream", "timeout"]
    assert fake.gone == 1  # the server saw the hang-up as a client that went away


@pytest.mark.asyncio
async def test_a_disconnect_fraction_hangs_up_that_share_of_clients(serve):
    fake = await serve(FakeOpenAI(ttft_s=0.05, tokens_per_chunk=1, itl_s=0.01))
    specs = [spec(i, 0.005 * i, 40, 30, chain(f"q{i}", 2)) for i in range(60)]
    runner = HttpLoadRun(cfg(fake.url, disconnect_fraction=0.5, disconnect_within_s=0.04), ListWorkload(specs))
    res = await asyncio.wait_for(runner.run(), 20)
    acc = res["accounting"]
    assert acc["lost"] == 0 and acc["sent"] == 60 and acc["completed"] + acc["disconnected"] == 60
    assert 15 <= acc["disconnected"] <= 45


@pytest.mark.asyncio
async def test_an_api_key_goes_with_every_request(serve):
    fake = await serve(FakeOpenAI())
    specs = [spec(i, 0.01 * i, 40, 4, chain(f"k{i}", 2)) for i in range(3)]
    res = await HttpLoadRun(cfg(fake.url, api_key="k-123"), ListWorkload(specs)).run()
    assert res["n_finished"] == 3 and [r.authorization for r in fake.received] == ["Bearer k-123"] * 3
    assert "k-123" not in repr(cfg(fake.url, api_key="k-123"))  # never printed with the config


@pytest.mark.asyncio
async def test_retries_honour_retry_after(serve):
    fake = await serve(FakeOpenAI(reject=lambda i: i == 0))
    runner = HttpLoadRun(cfg(fake.url, retries=1), ListWorkload([spec(0, 0.0, 40, 8, chain("a", 2))]))
    res = await runner.run()
    assert res["n_finished"] == 1 and res["n_retries"] == 1 and res["errors_by_status"] == {}
    assert [r.status for r in fake.received] == [429, 200]


@pytest.mark.asyncio
async def test_max_requests_caps_what_is_sent(serve):
    fake = await serve(FakeOpenAI())
    res = await HttpLoadRun(cfg(fake.url, "rag", rate=50, duration_s=1.0, max_requests=5)).run()
    assert res["n_requests"] == len(fake.received) == 5


@pytest.mark.asyncio
async def test_a_failing_request_task_stops_the_run_with_its_error(serve):
    fake = await serve(FakeOpenAI())
    bad = spec(1, 0.05, 64, 8, chain("b", 1))  # 1 hash cannot cover 4 prompt blocks
    runner = HttpLoadRun(cfg(fake.url), ListWorkload([spec(0, 0.0, 40, 8, chain("a", 2)), bad]))
    with pytest.raises(ValueError, match="block hashes"):
        await asyncio.wait_for(runner.run(), 10)


# ----------------------------------------------------------------------------- closed loop


def follow_ups_extending_a_completion(received: list[Received]) -> int:
    """How many requests' prompts start with an earlier completed request's prompt + output."""
    seqs = [r.prompt + r.output for r in received if r.status == 200]
    return sum(1 for r in received if any(len(s) <= len(r.prompt) and r.prompt[: len(s)] == s for s in seqs))


@pytest.mark.asyncio
async def test_closed_loop_follow_ups_reuse_returned_token_ids(serve):
    fake = await serve(FakeOpenAI(ttft_s=0.005, itl_s=0.001))
    expected = drain(small_agentic(), 0.01)
    runner = HttpLoadRun(cfg(fake.url, "agentic"), small_agentic())
    res = await asyncio.wait_for(runner.run(), 30)
    turns = [r for r in runner.records if r.turn > 0]
    assert res["n_requests"] == res["n_finished"] == len(expected) == len(fake.received)
    assert len(turns) == sum(1 for s in expected if s.turn > 0) > 0
    assert all(r.reused_context for r in turns) and not any(r.reused_context for r in runner.records if r.turn == 0)
    assert follow_ups_extending_a_completion(fake.received) == len(turns)
    # the previous turn's output blocks were cached by the server, so a follow-up hits them
    by_prompt = {tuple(r.prompt): r for r in fake.received}
    for r in fake.received:
        prev = [q for q in fake.received if q is not r and r.prompt[: len(q.prompt) + len(q.output)]
                == q.prompt + q.output]
        if prev:
            q = max(prev, key=lambda q: len(q.prompt))
            assert by_prompt[tuple(r.prompt)].cached >= (len(q.prompt) + len(q.output)) // BS * BS


@pytest.mark.asyncio
async def test_closed_loop_without_returned_ids_falls_back_to_hash_derived_ids(serve):
    fake = await serve(FakeOpenAI(ttft_s=0.005, itl_s=0.001, return_ids=False))
    runner = HttpLoadRun(cfg(fake.url, "agentic"), small_agentic())
    res = await asyncio.wait_for(runner.run(), 30)
    assert res["n_finished"] == res["n_requests"] == len(drain(small_agentic(), 0.01))
    assert not any(r.reused_context for r in runner.records)
    assert follow_ups_extending_a_completion(fake.received) == 0


@pytest.mark.asyncio
async def test_concurrency_mode_keeps_at_most_c_in_flight(serve):
    fake = await serve(FakeOpenAI(ttft_s=0.03, itl_s=0.002))
    c = cfg(fake.url, "agentic", rate=1.0, duration_s=10.0, concurrency=3, max_requests=12)
    runner = HttpLoadRun(c)
    assert isinstance(runner.workload, ConcurrencyWorkload)
    res = await asyncio.wait_for(runner.run(), 30)
    assert res["n_requests"] == res["n_finished"] == 12 == len(fake.received)
    assert fake.max_in_flight == 3 and res["concurrency"] == 3
    turns = [r for r in runner.records if r.turn > 0]
    assert all(r.reused_context for r in turns)


# ------------------------------------------------------------------------------ JSON and CLI


def sim_keys(**kw: Any) -> set[str]:
    return set(run(RunConfig(workload="rag", policy="fcfs", rate=2, duration_s=3, **kw)))


@pytest.mark.asyncio
async def test_cli_json_has_the_simulator_keys_plus_http_ones(serve, tmp_path, capsys):
    fake = await serve(FakeOpenAI())
    out = tmp_path / "r.json"
    rc = await asyncio.to_thread(main, ["run", "--url", fake.url, "--workload", "rag", "--rate", "8",
                                        "--duration", "1", "--seed", "4", "--json", str(out), "--no-progress"])
    assert rc == 0
    res = json.loads(out.read_text())
    keys = set(res)
    single, multi = sim_keys(), sim_keys(replicas=2)
    assert single <= multi <= keys
    assert keys - multi == HTTP_ONLY_KEYS
    assert set(res["itl_s"]) == set(res["e2e_s"]) == set(res["ttft_s"]) == set(res["queue_wait_s"])
    assert set(res["ttft_by_class_s"]) == {"cheap", "expensive"}
    n = len(list(make_workload("rag", rate=8, duration_s=1, seed=4).initial()))
    assert res["n_requests"] == res["n_finished"] == n and res["workload"] == "rag" and res["seed"] == 4
    assert res["url"] == fake.url and res["rate_rps"] == 8
    out = capsys.readouterr().out
    assert "ttft p50" in out and "tpot p50" in out and "served" in out
    assert res["tpot_s"]["n"] > 0 and res["served_rps"] > 0  # the fake server reports usage


@pytest.mark.parametrize(
    "args,needle",
    [
        (["--workload", "nope"], "unknown workload 'nope'"),
        (["--workload", "rag", "--rate", "-1"], "rate"),
        (["--workload", "trace:missing.jsonl"], "missing.jsonl"),
        (["--workload", "rag"], "cannot reach"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(args, needle, capsys):
    rc = main(["run", "--url", f"http://127.0.0.1:{closed_port()}", "--duration", "2", *args])
    err = capsys.readouterr().err.strip()
    assert rc == 2
    assert len(err.splitlines()) == 1 and needle in err and err.startswith("loadgen: error:")


def test_entry_point_exits_2_on_a_bad_workload():
    p = subprocess.run([sys.executable, "-m", "loadgen", "run", "--url", "http://127.0.0.1:1", "--workload", "nope"],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and p.stderr.strip().startswith("loadgen: error: unknown workload")
