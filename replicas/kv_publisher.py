"""A replica's KV events to the shared view: what its engine stored and removed, in batches.

Why: the request routers' exact prefix view (``router.prefix_view: events``) is every engine's
prefix cache. The engine adapters already report stored / removed block hashes in our hash space
(the sim engine's block pool; vLLM's KV events through ``replicas/engines/kv_events.py``, or its
estimate); this class forwards them to the application's hub actor (``router/view_hub.py``),
where every router reads them.

Batching: events are merged per hash until the next flush (the last event of a hash wins, so a
block stored and evicted within one period costs nothing), and one actor call every
``period_s`` carries the batch. With nothing to say, a heartbeat (an empty publish) every
``heartbeat_s`` keeps the replica known to the hub; a replica silent past the hub's ttl is
announced gone and the routers forget its blocks. When the hub answers that it did not know the
replica (the first call, a restarted hub, a replica announced gone), the next call carries the
whole block set instead of a delta.

Host KV tier (engines that keep evicted blocks in host memory: the sim engine with
``host_kv_blocks``, vLLM with CPU offloading and ``kv_events``): the engine also reports *tier
events*, ``(host_only, hash)`` transitions of the hashes it holds only in its host tier
(``fairway/engine/block_pool.py``, Tier events). They are merged per hash the same way, in a second
dict, and travel as a second event after the KV one: a ``TierDelta`` (hashes that became
host-only, hashes that stopped being so). The whole set (``KvFull``) then carries the host-only
hashes too. The events are the core's (``fairway/routing/view_log.py``). Why a second event, not a
flag per hash: the KV batch stays what it was, so with no host tier nothing changes on the wire or
in any cost (no ``TierDelta``, and an empty ``KvFull.host_only``). Last wins per hash in each
stream, and each stream alone replays its set exactly, so the receiver (KV batch first, then the
tier batch) ends with the engine's block set and host-only set.

Costs: O(1) per event (a dict write), O(hashes) per flush; memory O(distinct hashes per period).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterable

from fairway.routing.view_log import KvDelta, KvFull, TierDelta

log = logging.getLogger("ray.serve")

ReplicaEvent = KvDelta | TierDelta | KvFull
Send = Callable[[list[ReplicaEvent]], Awaitable[bool]]  # events -> "send your whole state"
TierEvents = Iterable[tuple[bool, int]]  # (host_only, hash) transitions


class HubNotReady(Exception):
    """``send`` found no hub yet (no router has created it): retried quietly, with backoff."""


class KvPublisher:
    """Merges a replica's stored / removed hashes and publishes them (see the module docstring).

    ``send`` publishes a list of events and returns the hub's "resend everything" answer;
    ``snapshot`` returns every hash the engine holds now (either tier); ``host_only`` (engines
    with a host KV tier; None: none) the hashes it holds only in its host tier. Tests call
    ``flush`` directly.
    """

    def __init__(self, uid: str, send: Send, snapshot: Callable[[], Iterable[int]], period_s: float = 0.02,
                 heartbeat_s: float = 1.0, host_only: Callable[[], Iterable[int]] | None = None) -> None:
        if period_s <= 0 or heartbeat_s <= 0:
            raise ValueError("period_s and heartbeat_s must be > 0")
        self.uid = uid
        self.send = send
        self.snapshot = snapshot
        self.host_only = host_only
        self.period_s = period_s
        self.heartbeat_s = heartbeat_s
        self._pending: dict[int, bool] = {}  # hash -> stored (True) or removed (False), last wins
        self._tier: dict[int, bool] = {}  # hash -> became (True) or stopped being (False) host-only, last wins
        self._full = True  # the hub needs the whole set (nothing sent yet)
        self._task: asyncio.Task | None = None
        self.sent_batches = 0
        self.sent_hashes = 0
        self.failures = 0

    # -- the engine's listener ---------------------------------------------------------------

    def on_stored(self, hashes: Iterable[int]) -> None:
        pending = self._pending
        for h in hashes:
            pending.pop(h, None)
            pending[h] = True

    def on_removed(self, hashes: Iterable[int]) -> None:
        pending = self._pending
        for h in hashes:
            pending.pop(h, None)
            pending[h] = False

    def on_tier(self, events: TierEvents) -> None:
        """The engine's tier events (host tier only), after the KV events of the same step."""
        tier = self._tier
        for host_only, h in events:
            tier.pop(h, None)
            tier[h] = host_only

    # -- publishing --------------------------------------------------------------------------

    def batch(self) -> list[ReplicaEvent]:
        """The events the next call carries (and forget them): the whole set, a delta or none."""
        if self._full:
            self._pending.clear()
            self._tier.clear()
            host = list(self.host_only()) if self.host_only is not None else []
            return [KvFull(self.uid, list(self.snapshot()), host or ())]
        out: list[ReplicaEvent] = []
        if self._pending:
            pending, self._pending = self._pending, {}
            stored = [h for h, s in pending.items() if s]
            removed = [h for h, s in pending.items() if not s]
            out.append(KvDelta(self.uid, stored, removed))
        if self._tier:
            tier, self._tier = self._tier, {}
            out.append(TierDelta(self.uid, [h for h, t in tier.items() if t], [h for h, t in tier.items() if not t]))
        return out

    async def flush(self) -> bool:
        """Send one batch (a heartbeat if empty). On failure the next call sends the whole set
        (the lost delta cannot be replayed). Returns whether the call succeeded."""
        events = self.batch()
        try:
            want_full = await self.send(events)
        except HubNotReady:
            self._full = True
            return False
        except Exception as e:  # noqa: BLE001 - serving goes on; the routers fall back to their approx view
            if not self.failures:
                log.warning("replica %s: KV events not published (%s: %s); retrying", self.uid, type(e).__name__, e)
            self.failures += 1
            self._full = True
            return False
        self._full = bool(want_full)
        if events:
            self.sent_batches += 1
            self.sent_hashes += sum(e.hash_count for e in events)
        return True

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        last = loop.time()
        backoff = self.period_s
        while True:
            await asyncio.sleep(backoff)
            if not (self._pending or self._tier or self._full) and loop.time() - last < self.heartbeat_s:
                continue
            ok = await self.flush()
            last = loop.time()
            backoff = self.period_s if ok else min(1.0, backoff * 2)
