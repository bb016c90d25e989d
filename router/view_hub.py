"""The shared routing view across ingress replicas: one Ray actor holding a ``ViewLog``.

Every ``FairwayRequestRouter`` of an application finds the same named actor (created by the
first one, ``get_if_exists``; detached, so it outlives the ingress replica that created it and a
restarted router finds the log intact) and calls ``exchange`` every ``sync_period_s``: one actor
call carries its batch of events out and the other routers' events in. A router silent for
``ttl_s`` (3 s; a live one exchanges every 10 ms) is announced gone, and the others drop the
requests it had in flight. Why an actor: it is what Ray gives for shared state (Ray's own
prefix-aware router keeps its tree in one), it needs no broker or port of ours, and one round
trip per period per router costs far less than a decision.

With the exact prefix view (``router.prefix_view: events``) the replicas ``publish`` their engines'
KV events here too (``replicas/kv_publisher.py``): ``KvDelta`` batches, or a ``KvFull`` when the hub
did not know the replica (its first call, the hub restarted, or the replica was silent past
``ttl_s`` and announced gone); the event types are the core's (``fairway/routing/view_log.py``).
The hub keeps every replica's block set from them, so a router that starts, restarts or fell
behind the log asks for a snapshot (``exchange(..., snapshot=True)``) and routes exactly from its
first request. Replicas whose engines have a host KV tier also publish ``TierDelta``s (hashes that
became / stopped being host-only) and a ``KvFull`` with its ``host_only`` set; the hub keeps each
replica's host-only set beside its block set and a snapshot carries both (``Exchange.host``: only
the replicas holding some), so a router that starts tells a GPU hit, a host hit and a miss apart
from its first request (docs/cost-model.md, The router's view of the host tier). Without a host
tier no ``TierDelta`` comes and ``host`` stays empty.
Costs: an exchange O(events in + events out + replicas), a snapshot O(blocks cached in the
cluster); a publish O(hashes in it).
"""

from __future__ import annotations

import time
from typing import Any

from fairway.routing.view_log import (
    HUB_NAMESPACE,
    REPLICA_SOURCE,
    Event,
    Exchange,
    KvDelta,
    KvFull,
    TierDelta,
    ViewLog,
    hub_name,
)


class ViewHub:
    """The actor's class: a ``ViewLog`` behind ``exchange``, and the replicas' cached blocks."""

    def __init__(self, capacity: int = 200_000, ttl_s: float = 3.0) -> None:
        self.log = ViewLog(capacity, ttl_s)
        self.kv: dict[str, set[int]] = {}  # replica unique id -> block hashes its engine holds
        self.host: dict[str, set[int]] = {}  # replica unique id -> of those, the host-only ones

    def exchange(self, source: str, events: list[Event], after: int, snapshot: bool = False,
                 now: float | None = None) -> Exchange:
        now = time.monotonic() if now is None else now
        self._forget(self.log.expire(now, keep=source))  # before the log's own expiry: the kv sets go too
        ex = self.log.exchange(source, events, after, now)
        if snapshot:
            ex.kv = {uid: list(blocks) for uid, blocks in self.kv.items()}
            ex.host = {uid: list(hs) for uid, hs in self.host.items() if hs}
        return ex

    def publish(self, source: str, events: list[Event], now: float | None = None) -> bool:
        """A replica's KV events. Returns True when the hub wants the replica's whole block set
        (it did not know the replica): the replica then sends a ``KvFull``."""
        now = time.monotonic() if now is None else now
        self._forget(self.log.expire(now, keep=source))
        for e in events:
            if isinstance(e, KvDelta):
                blocks = self.kv.setdefault(e.replica, set())
                blocks.difference_update(e.removed)
                blocks.update(e.stored)
            elif isinstance(e, TierDelta):
                hs = self.host.setdefault(e.replica, set())
                hs.difference_update(e.back)
                hs.update(e.host_only)
            elif isinstance(e, KvFull):
                self.kv[e.replica] = set(e.hashes)
                if e.host_only:
                    self.host[e.replica] = set(e.host_only)
                else:
                    self.host.pop(e.replica, None)
        unknown = self.log.publish(source, events, now)
        return unknown and not any(isinstance(e, KvFull) for e in events)

    def _forget(self, gone: list[str]) -> None:
        for src in gone:
            if src.startswith(REPLICA_SOURCE):
                self.kv.pop(src[len(REPLICA_SOURCE):], None)
                self.host.pop(src[len(REPLICA_SOURCE):], None)


def get_hub(app_name: str, capacity: int = 200_000) -> Any:
    """The application's hub actor, created if it does not exist yet. Only from a process of the
    application's Ray cluster (a Serve replica): elsewhere Ray would initialize itself on the
    actor call and start, or join, whatever cluster it finds, so this raises instead and the
    caller routes on its own view."""
    import ray

    if not ray.is_initialized():
        raise RuntimeError("the shared view's hub lives in the application's Ray cluster, and this process "
                           "is not connected to one")
    return ray.remote(ViewHub).options(
        name=hub_name(app_name), namespace=HUB_NAMESPACE, lifetime="detached", get_if_exists=True,
        num_cpus=0, max_restarts=-1).remote(capacity)
