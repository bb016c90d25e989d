"""An interactive prompt behind a running long batch prompt, on the live cluster, with and without strict tiers.

``python -m bench.tier_wait [--config deploy/cluster-vllm-cpu.yaml] [--rounds 5] [--long-words 6000]``
(run it with ``.venv-vllm/bin/python`` for the vLLM config; ``deploy/cluster.yaml`` runs the sim engine)

Each arm starts the config's cluster with two request classes (``interactive`` tier 0, ``batch``
tier 1) and, per round, streams a long ``batch`` prompt (``--long-words`` random words, about 14k
tokens of the tiny tokenizer at 6,000), then ``--gap-s`` later a short ``interactive`` one (200
words), both to 4 tokens. Arms: ``fcfs`` (the engine's default order: vLLM runs a running request's
prefill first, so the interactive prompt waits for the rest of the batch prefill) and ``strict``
(``replica.strict_tiers``: the batch prefill pauses while the interactive prompt's runs; on vLLM
through ``replicas/engines/vllm_tiers.py``'s scheduler). Prints per arm the rounds' interactive
TTFT (from its own send), the batch TTFT, and how often the interactive first token came first,
over the rounds whose interactive prompt left before the batch prompt's first token (all are in
the JSON line after); the medians are what to compare. The prompts are fresh random words each round (no prefix hit).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any

import aiohttp

from cluster.launch import running_cluster

CLASSES = [{"name": "interactive", "tier": 0, "objective_s": 1.0}, {"name": "batch", "tier": 1, "objective_s": 30.0}]
ARMS = {"fcfs": False, "strict": True}
WORDS = ("alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma tau "
         "upsilon phi chi psi omega").split()


async def _first_token_s(client: aiohttp.ClientSession, url: str, model: str, klass: str, prompt: str) -> float:
    """Seconds from the send to the stream's first data event."""
    body = {"model": model, "prompt": prompt, "max_tokens": 4, "stream": True, "priority": klass,
            "ignore_eos": True}
    t0 = time.perf_counter()
    first = None
    async with client.post(f"{url}/v1/completions", json=body) as r:
        if r.status != 200:
            raise RuntimeError(f"{klass}: HTTP {r.status}: {(await r.read())[:300]!r}")
        async for line in r.content:
            if first is None and line.startswith(b"data:"):
                first = time.perf_counter() - t0
    if first is None:
        raise RuntimeError(f"{klass}: no event")
    return first


async def rounds(url: str, model: str, n: int, long_words: int, gap_s: float, seed: int) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    out = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as client:
        for _ in range(n):
            long = " ".join(rng.choice(WORDS) for _ in range(long_words))
            short = " ".join(rng.choice(WORDS) for _ in range(200))
            t0 = time.perf_counter()
            batch = asyncio.create_task(_first_token_s(client, url, model, "batch", long))
            await asyncio.sleep(gap_s)
            t_short = time.perf_counter()
            inter = await _first_token_s(client, url, model, "interactive", short)
            batch_s = await batch
            out.append({"interactive_sent_s": t_short - t0, "interactive_ttft_s": inter, "batch_ttft_s": batch_s,
                        "interactive_first": t_short - t0 + inter < batch_s})
    return out


def summary(arm: str, all_rounds: list[dict[str, Any]]) -> str:
    """One arm's line. A round counts when the interactive prompt left while the batch one had no
    first token yet (a client starved of CPU by the engine can send it late)."""
    rs = [r for r in all_rounds if r["interactive_sent_s"] < r["batch_ttft_s"]]
    if not rs:
        return f"{arm:7s} no round sent the interactive prompt before the batch prompt's first token"
    inter = [r["interactive_ttft_s"] for r in rs]
    batch = [r["batch_ttft_s"] for r in rs]
    return (f"{arm:7s} {len(rs)}/{len(all_rounds)} rounds: interactive TTFT p50 {statistics.median(inter):.3f} s "
            f"({min(inter):.3f}-{max(inter):.3f}), batch TTFT p50 {statistics.median(batch):.3f} s "
            f"({min(batch):.3f}-{max(batch):.3f}), interactive first {sum(r['interactive_first'] for r in rs)}")


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="deploy/cluster-vllm-cpu.yaml")
    ap.add_argument("--model", default="fairway-tiny")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--long-words", type=int, default=6000)
    ap.add_argument("--gap-s", type=float, default=0.15, help="the interactive prompt's delay after the batch one")
    ap.add_argument("--arms", default="fcfs,strict")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    arms = [x for x in a.arms.split(",") if x]
    for arm in arms:
        if arm not in ARMS:
            ap.error(f"unknown arm {arm!r}; known: {', '.join(ARMS)}")
    results: dict[str, list[dict[str, Any]]] = {}
    for arm in arms:
        with running_cluster(a.config, classes=CLASSES, replica={"strict_tiers": ARMS[arm]}) as url:
            results[arm] = asyncio.run(rounds(url, a.model, a.rounds, a.long_words, a.gap_s, a.seed))
    for arm, all_rounds in results.items():
        print(summary(arm, all_rounds))
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
