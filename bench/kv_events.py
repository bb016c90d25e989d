"""What the exact prefix view costs per KV event, on this machine's CPU.

``python -m bench.kv_events`` times, per block hash, the three steps a replica's KV event takes
to reach a request router (``router.prefix_view: events``), with the real classes and no Ray:

- the replica's ``KvPublisher``: merging stored / removed hashes, then building one batch;
- the hub (``ViewHub.publish``): updating that replica's block set and appending the batch to the
  log; and one router's ``exchange`` reading it back;
- the router: applying the batch to its exact index (its ledger's ``apply_remote``:
  ``fairway/routing/bookings.py``).

A batch is ``--batch`` stored and as many removed hashes (a steady cache: every store evicts
one), over ``--replicas`` replicas. The figures are medians of ``--repeats`` runs. The actor
call's own cost (one Ray round trip per period per replica and router) is not included: it is
per call, not per event, and measured with the shared view (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from bench.tables import md_table
from fairway.clock import ManualClock
from fairway.cost_model import CostModel
from fairway.load_view import LoadView
from fairway.routing import make_router
from fairway.routing.bookings import Bookings
from fairway.routing.fallback_index import FallbackIndex
from fairway.routing.host import RoutingHost
from fairway.routing.view_log import KvFull
from replicas.kv_publisher import KvPublisher, ReplicaEvent
from router.view_hub import ViewHub


def _timed(f, n_hashes: int) -> float:
    t0 = time.perf_counter()
    f()
    return (time.perf_counter() - t0) / n_hashes


def measure(batch: int = 500, replicas: int = 8, repeats: int = 20) -> tuple[dict[str, float], bool]:
    """Microseconds per hash for each step (see the module docstring), and whether the router's
    exact index ends equal to the hub's block sets (the pipeline lost nothing)."""
    hub = ViewHub()
    clock, cost = ManualClock(0.0), CostModel.from_profile("h200-llama3-8b")
    index = FallbackIndex(0)
    host = RoutingHost(make_router("fairway", clock=clock, cost=cost, rng=np.random.default_rng(0)), index,
                       LoadView(0, clock, cost))
    router = Bookings(host, clock, wall=lambda: 0.0, exact=True)  # a router's ledger on the exact view
    uids = [f"replica-{j}" for j in range(replicas)]
    next_hash = [1]

    def hashes(n: int) -> list[int]:
        start = next_hash[0]
        next_hash[0] += n
        return list(range(start, start + n))

    async def never(events: list[ReplicaEvent]) -> bool:
        return False

    pubs = [KvPublisher(uid, never, list) for uid in uids]
    for p in pubs:
        p._full = False
    held = {uid: hashes(batch) for uid in uids}
    for uid in uids:
        hub.publish("replica:" + uid, [KvFull(uid, held[uid])], now=0.0)
        router.apply_remote(KvFull(uid, held[uid]))
    n = 2 * batch * replicas  # hashes per round: stored + removed on every replica
    batches: list[list[ReplicaEvent]] = []

    def publisher() -> None:
        batches.clear()
        for p, uid in zip(pubs, uids, strict=True):
            new = hashes(batch)
            p.on_stored(new)
            p.on_removed(held[uid][:batch])
            held[uid] = held[uid][batch:] + new
            batches.append(p.batch())

    seq = [0]

    def hub_round() -> None:
        for uid, events in zip(uids, batches, strict=True):
            hub.publish("replica:" + uid, events, now=0.0)
        seq[0] = hub.exchange("router", [], seq[0], now=0.0).head

    def router_round() -> None:
        for events in batches:
            for e in events:
                router.apply_remote(e)

    out: dict[str, list[float]] = {"publisher": [], "hub": [], "router": []}
    for _ in range(repeats):
        out["publisher"].append(_timed(publisher, n))
        out["hub"].append(_timed(hub_round, n))
        out["router"].append(_timed(router_round, n))
    exact = index.exact
    same = all(set(exact.blocks(router.replica(uid))) == hub.kv[uid] == set(held[uid]) for uid in uids)
    return {k: statistics.median(v) * 1e6 for k, v in out.items()}, same


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.kv_events", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=500, help="stored (and removed) hashes per replica batch")
    ap.add_argument("--replicas", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=20)
    a = ap.parse_args(argv)
    costs, same = measure(a.batch, a.replicas, a.repeats)
    print(md_table(["step", "us per hash"], [[k, f"{v:.3f}"] for k, v in costs.items()]))
    print("the router's exact index equals the replicas' caches:", same)
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
