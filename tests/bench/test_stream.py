"""The streaming benchmark's client against its aiohttp reference server (no Ray): it counts every
token of every stream in its window and times TTFT, so its figures can be trusted side by side."""

from __future__ import annotations

import asyncio

from bench.stream import Point, aiohttp_server, drive, engine_rate, medians, point, targets
from observability.exporter import free_port


def test_client_counts_tokens_and_ttft_against_the_reference_server():
    with aiohttp_server(free_port()) as url:
        r = asyncio.run(drive(url, concurrency=2, warmup_s=0.3, duration_s=1.5, max_tokens=16))
    # 2 streams at one token per 8 ms at the most (the server sleeps 8 ms before each): at most
    # 2 / 0.008 = 250 tokens/s, and no TTFT under 8 ms; a 16-token request lasts >= 128 ms
    p = point("aiohttp", 2, r)
    assert r["errors"] == 0 and 1 <= p.requests <= 2 * 1.5 / 0.128 + 2
    assert 0 < p.tokens_per_s <= 2 / 0.008 * 1.02
    assert p.ttft_p50_ms >= 8


def test_rounds_give_one_point_per_target_and_c_with_the_medians():
    def p(target: str, c: int, tps: float, cpu: float) -> Point:
        return Point(target, c, tps, 10.0, 20.0, cpu, requests=5, errors=0, window_s=15.0)

    rounds = [p("fairway", 64, 9000, 0.15), p("aiohttp", 64, 7000, 0.07),
              p("fairway", 64, 10000, 0.12), p("aiohttp", 64, 7100, 0.08),
              p("fairway", 64, 9500, 0.13), p("aiohttp", 64, 7200, 0.06)]
    m = medians(rounds)
    assert [(x.target, x.concurrency) for x in m] == [("fairway", 64), ("aiohttp", 64)]
    assert (m[0].tokens_per_s, m[0].cpu_ms_per_token, m[0].requests) == (9500, 0.13, 15)
    assert m[0].extra["cpu_ms_per_token"] == [0.15, 0.12, 0.13] and m[1].cpu_ms_per_token == 0.07


def test_each_prefix_view_is_its_own_fairway_row_and_no_view_keeps_the_configs_own():
    # nothing starts: each server is a context manager, entered only by the caller
    rows = list(targets(["fairway"], [0.05], 1, [True], (True,), ("approx", "events")))
    assert [label for label, _, _ in rows] == [
        "fairway (interval 50 ms, Serve throughput-optimized, HAProxy ingress, approx prefix view)",
        "fairway (interval 50 ms, Serve throughput-optimized, HAProxy ingress, events prefix view)"]
    assert [extra["prefix_view"] for _, extra, _ in rows] == ["approx", "events"]
    cluster = [ctx.args[1] for _, _, ctx in rows]  # ray_mode(fast, running_cluster(...), haproxy)
    assert [c.kwds["router"] for c in cluster] == [{"prefix_view": "approx"}, {"prefix_view": "events"}]
    (label, extra, ctx), = targets(["fairway"], [0.05], 1, [True], (True,))
    assert "prefix view" not in label and "prefix_view" not in extra and "router" not in ctx.args[1].kwds


def test_the_engine_rate_grows_with_the_streams_until_the_steps_lengthen():
    """The engine model's own rate for the benchmark's closed loop: C=4 runs one 32-token prompt
    per stream and then decodes (a step per token), so about C / step time; 64 times the streams
    cannot give 64 times the rate, because a step with more sequences is longer."""
    r4, r256 = engine_rate(4, 128), engine_rate(256, 128)
    assert 0 < r4 < r256 < 64 * r4
