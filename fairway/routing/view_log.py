"""The shared routing view's log: what every request router has routed and finished, in one order.

Why: Ray Serve runs one request router per ingress replica, and each one alone sees only the
requests that entered through its replica, so K routers each route with 1/K of the picture (a
prompt family's siblings scatter, and each router underestimates every queue). Each router
appends its own events here and reads everyone else's, so all of them hold the same prefix index
and in-flight load. A router that starts (or restarts) reads the whole retained log first, which
rebuilds the recent routing of the cluster before its first decision.

The log is a bounded ring of ``(seq, source, event)``. The events are the frozen dataclasses
below, defined here once for every host: a router's ``RequestRouted`` / ``RequestFinished``, a
replica's ``KvDelta`` / ``TierDelta`` / ``KvFull`` (``replicas/kv_publisher.py``), and the log's own
``SourceGone``. ``exchange`` appends a batch and returns the others' events after the caller's
last seen seq. A source that has not exchanged for ``ttl_s`` (its router died) is announced once
with ``SourceGone(source)``, so the others drop the requests it had in flight instead of counting
them on their replicas forever. Complexity: O(batch + returned events + sources) per exchange;
memory O(capacity).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import islice

HUB_NAMESPACE = "fairway"  # the Ray namespace of the hub actor that holds an application's log
REPLICA_SOURCE = "replica:"  # the prefix of a replica's source name (its KV events)
#: How often each request router exchanges with the shared view by default (seconds): the
#: cluster's ``router.sync_period_s``, and the simulator's sync delay with several routers.
DEFAULT_SYNC_PERIOD_S = 0.01
#: How often each replica sends its engine's KV events to the shared view by default (seconds):
#: the cluster's ``router.kv_period_s``. Each send is an actor call (about a millisecond of CPU
#: across the processes here), so 50 ms makes a fifth of 10 ms's calls; in the simulator events
#: 50-100 ms late keep the exact view's gain at Mooncake x4 and half of it at x2 (docs/benchmarks.md, 5).
DEFAULT_KV_PERIOD_S = 0.05


@dataclass(frozen=True, slots=True)
class RequestRouted:
    """A router sent a request to ``replica`` (a replica's unique id). ``key`` names it across
    the view (``"<router id>:<its number there>"``); ``estimated_blocks``: the router's index match
    on ``replica``; ``best_blocks``: the decision's longest match among the candidates;
    ``routed_at``: the router's wall clock; ``klass``: its request class ("" without classes)."""

    replica: str
    key: str
    hashes: tuple[int, ...]
    prompt_tokens: int
    estimated_blocks: int
    request_id: str
    routed_at: float
    best_blocks: int
    klass: str = ""


@dataclass(frozen=True, slots=True)
class RequestFinished:
    """The request ``key`` (a ``RequestRouted``'s) ended on its replica."""

    key: str


@dataclass(frozen=True, slots=True)
class KvDelta:
    """Replica ``replica``'s engine stored and removed these block hashes since its last batch."""

    replica: str
    stored: Sequence[int]
    removed: Sequence[int]

    @property
    def hash_count(self) -> int:
        return len(self.stored) + len(self.removed)


@dataclass(frozen=True, slots=True)
class TierDelta:
    """Host KV tier: hashes that became host-only (``host_only``) and that stopped being so
    (``back``); sent after the ``KvDelta`` of the same batch."""

    replica: str
    host_only: Sequence[int]
    back: Sequence[int]

    @property
    def hash_count(self) -> int:
        return len(self.host_only) + len(self.back)


@dataclass(frozen=True, slots=True)
class KvFull:
    """Replica ``replica``'s whole block set, and the host-only part of it (empty without a host
    KV tier): sent when the hub did not know the replica."""

    replica: str
    hashes: Sequence[int]
    host_only: Sequence[int] = ()

    @property
    def hash_count(self) -> int:
        return len(self.hashes) + len(self.host_only)


@dataclass(frozen=True, slots=True)
class SourceGone:
    """The log announces ``source`` silent past its ttl: a router (its requests in flight leave
    the others' load views) or a replica (``REPLICA_SOURCE`` + its id: its blocks are forgotten)."""

    source: str


Event = RequestRouted | RequestFinished | KvDelta | TierDelta | KvFull | SourceGone


def hub_name(app_name: str) -> str:
    """The name of the actor holding application ``app_name``'s log (routers and replicas find it
    by this name)."""
    return f"fairway-view-{app_name or 'default'}"


@dataclass(slots=True)
class Exchange:
    """The answer to one ``exchange``: the other sources' events after the caller's ``after``
    (oldest first), the seq to pass next time, and ``gap``: events the caller had not seen were
    dropped from the ring before it asked (its view misses them)."""

    events: list[Event]
    head: int
    gap: bool
    kv: dict[str, list[int]] | None = None  # every replica's cached blocks, when asked (a snapshot)
    # with ``kv``: the replicas' host-only blocks (host KV tier), only for those holding some
    host: dict[str, list[int]] | None = None


class ViewLog:
    """A bounded, ordered log of routing events from several sources (see the module docstring)."""

    __slots__ = ("capacity", "ttl_s", "_ring", "_next", "_seen")

    def __init__(self, capacity: int = 200_000, ttl_s: float = 3.0) -> None:
        if capacity < 1:
            raise ValueError("capacity must be >= 1")
        if ttl_s <= 0:
            raise ValueError("ttl_s must be > 0")
        self.capacity = capacity
        self.ttl_s = ttl_s
        self._seen: dict[str, float] = {}  # source -> when it last exchanged
        self._ring: deque[tuple[int, str, Event]] = deque(maxlen=capacity)
        self._next = 1  # the seq the next event gets; seqs start at 1, so after=0 means "all"

    @property
    def head(self) -> int:
        """The seq of the newest event (0: none yet)."""
        return self._next - 1

    def exchange(self, source: str, events: Sequence[Event], after: int, now: float = 0.0) -> Exchange:
        """Append ``source``'s ``events``; return the other sources' events with seq > ``after``
        that are still retained. ``now`` (seconds, any monotonic base) dates the call."""
        self.expire(now, keep=source)
        self._seen[source] = now
        first_kept = self._ring[0][0] if self._ring else self._next
        gap = after + 1 < first_kept
        start = max(after + 1, first_kept) - first_kept  # position in the ring
        out = [e for _, src, e in islice(self._ring, start, None) if src != source]
        self._append(source, events)
        return Exchange(out, self.head, gap)

    def publish(self, source: str, events: Sequence[Event], now: float = 0.0) -> bool:
        """Append ``source``'s ``events`` without reading (a source that only writes, such as a
        replica's KV events). Returns whether ``source`` was unknown (new, or announced gone
        since its last call): its readers have nothing of it, so it should send its whole state.
        O(len(events) + sources)."""
        self.expire(now, keep=source)
        new = source not in self._seen
        self._seen[source] = now
        self._append(source, events)
        return new

    def expire(self, now: float, keep: str = "") -> list[str]:
        """Announce every source but ``keep`` silent for more than ``ttl_s`` with ``SourceGone(source)``
        and forget it; return those sources. O(sources)."""
        gone = [src for src, seen in self._seen.items() if src != keep and now - seen > self.ttl_s]
        for src in gone:
            del self._seen[src]
            self._append("", (SourceGone(src),))
        return gone

    def _append(self, source: str, events: Sequence[Event]) -> None:
        for e in events:
            self._ring.append((self._next, source, e))
            self._next += 1
