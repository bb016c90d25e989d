"""Micro-benchmark: time of one routing decision (index lookup + load snapshot + rank + record).

``python -m bench.routing [--replicas 16] [--prompt-tokens 8192] [--routers fairway,pow2,...]``
builds a prefix index holding, per replica, the prefixes of earlier prompts (shared 2k-token
system prompts, per-session histories), then times the whole routing path for fresh 8k-token
prompts that share part of their prefix with what the replicas hold.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from fairway.clock import ManualClock
from fairway.cost_model import CostModel
from fairway.load_view import LoadView
from fairway.prefix_index import PrefixIndex
from fairway.routing import ROUTERS, RouteRequest, make_router, make_states


def measure(name: str, replicas: int, prompt_tokens: int, cycles: int, bs: int = 16) -> dict[str, float]:
    rng = np.random.default_rng(0)
    clock = ManualClock()
    cost = CostModel.from_profile("h200-llama3-8b")
    policy = make_router(name, clock=clock, cost=cost, block_size=bs, rng=np.random.default_rng(1))
    index = PrefixIndex(replicas, capacity_blocks=cost.default_kv_blocks(bs))
    load = LoadView(replicas, clock, cost, block_size=bs)
    n_blocks = prompt_tokens // bs

    def prompt(k: int) -> list[int]:
        fam = int(rng.integers(0, 64))  # 64 prompt families share their first half
        shared = [fam * 1_000_000 + b for b in range(n_blocks // 2)]
        return shared + [10**12 + k * 1_000_000 + b for b in range(n_blocks - len(shared))]

    for k in range(replicas * 16):  # warm: each replica holds 16 earlier prompts
        index.record_routed(k % replicas, prompt(k))
    times = []
    for k in range(cycles):
        hashes = prompt(10_000 + k)
        clock.advance(0.01)
        t0 = time.perf_counter_ns()
        matched = index.match(hashes)
        states = make_states(load.snapshot(), matched, index.sizes())
        ranks = policy.rank(RouteRequest(k, prompt_tokens, hashes), states)
        j = ranks[0][0]
        index.record_routed(j, hashes)
        load.on_routed(k, j, prompt_tokens, matched[j] * bs)
        t1 = time.perf_counter_ns()
        times.append(t1 - t0)
        if k >= 64:
            load.on_finished(k - 64)  # keep ~64 requests in flight
    us = np.array(times) / 1e3
    return {"p50_us": float(np.median(us)), "p99_us": float(np.percentile(us, 99))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--replicas", type=int, default=16)
    ap.add_argument("--prompt-tokens", type=int, default=8192)
    ap.add_argument("--cycles", type=int, default=2000)
    ap.add_argument("--routers", default=",".join(sorted(ROUTERS)))
    args = ap.parse_args()
    print(f"{'router':<18} {'p50 us':>8} {'p99 us':>8}  ({args.replicas} replicas, {args.prompt_tokens}-token prompts)")
    for name in args.routers.split(","):
        m = measure(name, args.replicas, args.prompt_tokens, args.cycles)
        print(f"{name:<18} {m['p50_us']:>8.1f} {m['p99_us']:>8.1f}")


if __name__ == "__main__":
    main()
