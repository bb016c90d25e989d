"""Micro-benchmark: time of one routing decision (index lookup + load snapshot + rank + record).

``python -m bench.routing [--replicas 16] [--prompt-tokens 8192] [--routers fairway,pow2,...]``
builds a prefix index holding, per replica, the prefixes of earlier prompts (shared 2k-token
system prompts, per-session histories), then times the whole routing path for fresh 8k-token
prompts that share part of their prefix with what the replicas hold. ``--classes`` gives the
router two request classes (20% ``interactive``, tier 0; 80% ``batch``, tier 1), so the class
view (the queue per class, the work ahead of each) is priced on every decision. Besides the
whole path it prints its two parts' medians: "choose" (decide + book: what the Ray host's
``choose_replicas`` runs while the request waits) and "record" (the index learns the prompt: the
Ray host's ``on_request_routed``, after the request is sent).
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from fairway.clock import ManualClock
from fairway.cost_model import DEFAULT_PROFILE, CostModel
from fairway.load_view import LoadView
from fairway.policies.classes import ClassesConfig
from fairway.prefix_index import APPROX, EVENTS, PrefixIndex
from fairway.routing import ROUTERS, make_router
from fairway.routing.host import RoutingHost

CLASSES = "interactive:tier=0:objective=1,batch:tier=1:objective=30"


def measure(name: str, replicas: int, prompt_tokens: int, cycles: int, bs: int = 16, index_mode: str = "approx",
            host_share: float = 0.0, classes: bool = False) -> dict[str, float]:
    """Median and p99 of one decision through ``RoutingHost`` (match, states, rank, book,
    record). ``index_mode``: ``"approx"`` the live router's approximate index (prompts in flight
    pinned), ``"lru"`` one LRU over all, ``"events"`` the exact index, fed the warm-up prompts as stored KV
    events; ``host_share`` > 0 (events only): that share of the tail of each warm prompt's
    shared half (what later prompts match) is host-only (tier events), so the tier-aware
    lookup splits real host hits; ``classes``: every request in one of two classes (module
    docstring)."""
    rng = np.random.default_rng(0)
    clock = ManualClock()
    cost = CostModel.from_profile(DEFAULT_PROFILE)
    policy = make_router(name, clock=clock, cost=cost, block_size=bs, rng=np.random.default_rng(1))
    events = index_mode == EVENTS
    # approx: the live router's approximate index (prompts in flight pinned); lru: one LRU over all
    index = PrefixIndex(replicas, mode=EVENTS if events else APPROX,
                        capacity_blocks=None if events else cost.default_kv_blocks(bs),
                        pin_in_flight=index_mode == "approx")
    load = LoadView(replicas, clock, cost, block_size=bs)
    host = RoutingHost(policy, index, load, block_size=bs,
                       classes=ClassesConfig.parse(CLASSES if classes else ""))
    n_blocks = prompt_tokens // bs

    def prompt(k: int) -> list[int]:
        fam = int(rng.integers(0, 64))  # 64 prompt families share their first half
        shared = [fam * 1_000_000 + b for b in range(n_blocks // 2)]
        return shared + [10**12 + k * 1_000_000 + b for b in range(n_blocks - len(shared))]

    for k in range(replicas * 16):  # warm: each replica holds 16 earlier prompts
        p = prompt(k)
        if events:
            index.on_kv_events(k % replicas, [(True, h) for h in p])
            half = n_blocks // 2  # the shared part, which later prompts match
            cut = half - int(half * host_share)
            if cut < half:
                index.on_tier_events(k % replicas, [(True, h) for h in p[cut:half]])
        else:  # routed and reported: the free pool of a pinned approx index
            index.record_routed(k % replicas, p)
            index.on_feedback(k % replicas, p, 0, bs)
    times: list[int] = []
    choose: list[int] = []  # decide + book: what the Ray host's choose_replicas runs before the request is sent
    record: list[int] = []  # the index learns the prompt: the Ray host's on_request_routed, after the send
    sent: list[tuple[int, list[int]]] = []
    for k in range(cycles):
        hashes = prompt(10_000 + k)
        clock.advance(0.01)
        klass = ("interactive" if rng.random() < 0.2 else "batch") if classes else ""
        t0 = time.perf_counter_ns()
        d = host.decide(k, prompt_tokens, hashes, klass=klass)
        host.book(k, d.pick, prompt_tokens, d.matched_blocks, hashes, klass)
        t1 = time.perf_counter_ns()
        host.record_routed(d.pick, hashes, d.reason)
        t2 = time.perf_counter_ns()
        times.append(t2 - t0)
        choose.append(t1 - t0)
        record.append(t2 - t1)
        sent.append((d.pick, hashes))
        if k >= 64:
            host.finished(k - 64, *sent[k - 64], cached_tokens=0, estimated_blocks=None)  # keep ~64 in flight
    us = np.array(times) / 1e3
    return {"p50_us": float(np.median(us)), "p99_us": float(np.percentile(us, 99)),
            "choose_p50_us": float(np.median(choose)) / 1e3, "record_p50_us": float(np.median(record)) / 1e3}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--replicas", type=int, default=16)
    ap.add_argument("--prompt-tokens", type=int, default=8192)
    ap.add_argument("--cycles", type=int, default=2000)
    ap.add_argument("--routers", default=",".join(sorted(ROUTERS)))
    ap.add_argument("--index", default="approx", choices=["approx", "lru", "events"],
                    help="prefix index: approx (prompts in flight pinned), lru (one LRU over all), events")
    ap.add_argument("--host-share", type=float, default=0.0,
                    help="events index: share of the tail of each held prompt's shared half that is host-only")
    ap.add_argument("--classes", action="store_true", help="two request classes (20%% interactive, 80%% batch)")
    args = ap.parse_args()
    print(f"{'router':<18} {'p50 us':>8} {'p99 us':>8} {'choose':>8} {'record':>8}  ({args.replicas} replicas, "
          f"{args.prompt_tokens}-token prompts, {args.index} index, host share {args.host_share}"
          f"{', classes' if args.classes else ''}; choose = decide + book, record = the index learns the prompt, "
          "both p50 us)")
    for name in args.routers.split(","):
        m = measure(name, args.replicas, args.prompt_tokens, args.cycles, index_mode=args.index,
                    host_share=args.host_share, classes=args.classes)
        print(f"{name:<18} {m['p50_us']:>8.1f} {m['p99_us']:>8.1f} {m['choose_p50_us']:>8.1f} "
              f"{m['record_p50_us']:>8.1f}")


if __name__ == "__main__":
    main()
