"""The streaming benchmark's client against its aiohttp reference server (no Ray): it counts every
token of every stream in its window and times TTFT, so its figures can be trusted side by side."""

from __future__ import annotations

import asyncio

from bench.stream import aiohttp_server, drive, point
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
