"""The router's view of each replica's load, with optional staleness.

Why: the cluster-level rules need, per replica j, the queued prefill work Q_j in seconds (routed
to j and not yet started; docs/design.md, Notation), the number of outstanding requests (the queue
length Ray Serve's power-of-two and SGLang's router compare), the running count (AIBrix), and
for Dynamo's cost the queued uncached tokens and the KV blocks of its active requests. The router
tracks them from its own decisions (``on_routed``) and the replicas' lifecycle reports
(``on_started``, ``on_finished``); the replicas' KV usage comes from their periodic stats
(``report_kv_usage``).

For the Fairway router's queue-order wait model, the snapshot also lists, per replica, the
prefill estimates of the requests waiting to start, sorted (``queued_prefills``), the
replica's sequence capacity when known (``max_running``, its engine's ``max_num_seqs``), and the
estimated prefill ends of its started requests still prefilling (``prefill_ends``: start + P),
and the rate at which prefill work has been routed to it lately (``routed_windows``: the routing
time of the oldest of its last ``ROUTED_WINDOW`` routed requests and the prefill estimates of the
ones after it, sorted), from which the router reads the rate of work lighter than a request's own.

With request classes (the host passes each booking's class), the snapshot also lists each
replica's waiting work per class (``class_queues``), from which the Fairway router prices a
request on the queue its class sees (``fairway/routing/base.py``: ``ClassView``).

llm-d's token load (read by the ``llmd`` anchor, ``fairway/routing/anchors/llmd.py``): per replica,
the uncached prompt tokens of its requests whose first token has not come yet
(``active_prefill_tokens``: added at routing, released by ``on_first_token`` or
``on_prefill_done``, or at the finish), the router's own bookkeeping as in llm-d's in-flight load
producer (and Dynamo's active prefill tokens).

Dynamo's active blocks (read by the ``dynamo`` anchor, ``fairway/routing/anchors/dynamo.py``), when
the host asks for them (``track_blocks``): per replica, the multiset of its outstanding requests'
prompt block hashes, hence its distinct active blocks (``unique_active_blocks``) and, for a new
request, how many of its blocks are not already active there (``new_blocks``): the router's own
bookkeeping, as Dynamo's ``ActiveSequences``.

Staleness: in Ray Serve the replicas' stats reach the router only every so often
(``record_routing_stats``, polled every 10 s by default), and several ingress replicas each see
part of the load. ``stale_s`` mimics that: readers get a ``LoadSnapshot`` refreshed at most every
``stale_s`` seconds of the injected clock (0 = live). The refresh is lazy: the first read at or
after ``taken_s + stale_s`` takes a new snapshot of the current counters.

Complexity: every lifecycle hook is O(1) plus O(log n + n) for the sorted list of the n requests
waiting on that replica (a bisect insort / delete, a memmove in C); a snapshot costs O(replicas +
waiting requests on the replicas whose queue changed since the last one) when it is refreshed and
O(1) otherwise. ``track_blocks`` and the finish of a tracked request cost O(its prompt blocks);
``new_blocks`` costs O(blocks matched + replicas), like the prefix index's lookup.
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from fairway.clock import Clock
from fairway.cost_model import CostModel
from fairway.prefix_index import prefix_walk

#: Routed requests per replica behind its routed-work rate: 32 arrivals put the relative standard
#: error of a Poisson rate estimate near 1/sqrt(32) = 18%, and span a few seconds to a minute of a
#: replica's traffic in the workloads measured (docs/history/2026-11-30-router-fifth-pass.md has the 16 and 64 sweep).
ROUTED_WINDOW = 32


@dataclass(frozen=True, slots=True)
class LoadSnapshot:
    """Per-replica load at ``taken_s`` (index = replica id).

    Invariants: every tuple has one entry per replica; ``0 <= running[j] <= outstanding[j]``;
    ``queued_prefill_s[j] >= 0``, and exactly 0.0 when no routed request on j is waiting to
    start; ``queued_prefill_tokens[j] >= 0``; ``0 <= kv_usage[j] <= 1``;
    ``queued_prefills[j]`` holds the prefill estimates of j's waiting requests in ascending order
    (their sum is ``queued_prefill_s[j]`` up to float drift); ``max_running[j]`` is j's sequence
    capacity, 0 when unknown; ``prefill_ends[j]`` the estimated prefill end times (start + its
    prefill estimate) of j's started requests whose end was still ahead at ``taken_s``;
    ``class_queues[j]`` maps each request class with requests waiting on j to (their queued
    prefill seconds, their estimates ascending); empty for requests routed without a class.
    ``routed_windows[j]`` is ``(t0, ps)``: t0 the routing time of the oldest of j's last
    ``ROUTED_WINDOW`` routed requests and ps the prefill estimates of the later ones, ascending,
    so sum(ps) / (now - t0) is the prefill work routed to j per second lately ((now, ()) before
    the second request); ``speed[j]`` j's measured pace against the cost model (its gate's drain
    rate, 1.0 until reported). The last five are empty tuples for snapshots built by hand.
    """

    taken_s: float
    queued_prefill_s: tuple[float, ...]
    queued_prefill_tokens: tuple[int, ...]
    outstanding: tuple[int, ...]
    running: tuple[int, ...]
    active_blocks: tuple[int, ...]
    kv_usage: tuple[float, ...]
    queued_prefills: tuple[tuple[float, ...], ...] = field(default=())
    max_running: tuple[int, ...] = field(default=())
    prefill_ends: tuple[tuple[float, ...], ...] = field(default=())
    routed_windows: tuple[tuple[float, tuple[float, ...]], ...] = field(default=())
    speed: tuple[float, ...] = field(default=())
    active_prefill_tokens: tuple[int, ...] = field(default=())
    unique_active_blocks: tuple[int, ...] = field(default=())
    class_queues: tuple[dict[str, tuple[float, tuple[float, ...]]], ...] = field(default=())

    @property
    def waiting(self) -> tuple[int, ...]:
        """Routed requests not yet started, per replica (outstanding - running)."""
        return tuple(o - r for o, r in zip(self.outstanding, self.running, strict=True))


@dataclass(slots=True)
class _Tracked:
    rid: int
    replica: int
    prompt_tokens: int
    prefill_s: float
    uncached_tokens: int
    blocks: int
    started: bool = False
    klass: str = ""


class _SortedWork:
    """The (P, rid) entries of requests waiting on one replica (or of one class there), sorted,
    with their P's alone in a parallel list, so a snapshot copies the estimates with one C-level
    ``tuple`` instead of a generator over the pairs.

    Why: a replica's queue is re-frozen after every request that joins or leaves it; with a deep
    queue the per-entry Python loop was most of a snapshot. Complexity: O(log n + n) per add or
    remove (a bisect and two memmoves in C), O(n) in C per ``frozen``."""

    __slots__ = ("keys", "ps")

    def __init__(self) -> None:
        self.keys: list[tuple[float, int]] = []
        self.ps: list[float] = []

    def add(self, p: float, rid: int) -> None:
        i = bisect.bisect_right(self.keys, (p, rid))
        self.keys.insert(i, (p, rid))
        self.ps.insert(i, p)

    def remove(self, p: float, rid: int) -> None:
        """Remove ``rid``'s entry (priced ``p``), if there."""
        i = bisect.bisect_left(self.keys, (p, rid))
        if i < len(self.keys) and self.keys[i][1] == rid:
            del self.keys[i]
            del self.ps[i]

    def __len__(self) -> int:
        return len(self.ps)

    def frozen(self) -> tuple[float, ...]:
        """The estimates, ascending."""
        return tuple(self.ps)


class LoadView:
    """Router-side load bookkeeping per replica, read through a possibly stale snapshot.

    Lifecycle of one request: ``on_routed`` (adds its prefill estimate to Q_j) ->
    ``on_started`` (admitted into the engine: leaves Q_j, counts as running) ->
    ``on_finished`` (leaves every count). ``on_finished`` without ``on_started`` (rejected,
    cancelled) removes it from Q_j too. ``on_preempted`` puts a running request back in Q_j.
    """

    __slots__ = ("clock", "cost", "block_size", "stale_s", "_q", "_qtok", "_nq", "_out", "_run", "_blocks", "_kv",
                 "_qp", "_qp_frozen", "_cap", "_speed", "_pf", "_rw", "_rws", "_rw_frozen", "_req", "_snap", "_version",
                 "_snap_version", "_ptok", "_held", "_ab", "_abw", "_ab_req", "_cq", "_cq_frozen")

    def __init__(
        self, num_replicas: int, clock: Clock, cost: CostModel, block_size: int = 16, stale_s: float = 0.0
    ) -> None:
        if num_replicas < 0:
            raise ValueError("num_replicas must be >= 0")
        if block_size < 1:
            raise ValueError("block_size must be >= 1")
        if not stale_s >= 0:
            raise ValueError("stale_s must be >= 0")
        self.clock = clock
        self.cost = cost
        self.block_size = block_size
        self.stale_s = float(stale_s)
        self._q: list[float] = []
        self._qtok: list[int] = []
        self._nq: list[int] = []  # requests waiting to start, per replica (for the exact-zero reset)
        self._out: list[int] = []
        self._run: list[int] = []
        self._blocks: list[int] = []
        self._kv: list[float] = []
        self._qp: list[_SortedWork] = []  # per replica: (P, rid) of waiting requests, sorted
        self._qp_frozen: list[tuple[float, ...] | None] = []  # its P's as a tuple; None when stale
        self._cap: list[int] = []  # per replica: max_num_seqs, 0 = unknown
        self._speed: list[float] = []  # per replica: measured pace against the cost model, 1.0 = unknown
        self._pf: list[dict[int, float]] = []  # per replica: rid -> estimated prefill end, started requests
        self._rw: list[deque[tuple[float, float]]] = []  # per replica: (routed at, P) of its last routed
        self._rws: list[list[float]] = []  # per replica: the P's of its window after the oldest, sorted
        self._rw_frozen: list[tuple[float, tuple[float, ...]] | None] = []  # its window; None when stale
        self._req: dict[int, _Tracked] = {}
        self._ptok: list[int] = []  # per replica: held prefill tokens (no first token yet)
        self._held: dict[int, int] = {}  # rid -> its held prefill tokens
        # Dynamo's active blocks (see the module docstring)
        self._ab: list[dict[int, int]] = []  # per replica: hash -> active requests holding it
        self._abw: dict[int, int] = {}  # hash -> bitmask of the replicas where it is active
        self._ab_req: dict[int, Sequence[int]] = {}  # rid -> its tracked prompt hashes
        # per replica, per request class: [queued prefill s, sorted (P, rid)] of its waiting requests
        self._cq: list[dict[str, tuple[list[float], _SortedWork]]] = []
        self._cq_frozen: list[dict[str, tuple[float, tuple[float, ...]]] | None] = []
        self._snap: LoadSnapshot | None = None
        self._version = 0
        self._snap_version = -1
        for _ in range(num_replicas):
            self.add_replica()

    @property
    def num_replicas(self) -> int:
        return len(self._q)

    def add_replica(self) -> int:
        """Append an idle replica; return its id. O(1)."""
        for fcol in (self._q, self._kv):
            fcol.append(0.0)
        self._qp.append(_SortedWork())
        self._qp_frozen.append(())
        self._cap.append(0)
        self._speed.append(1.0)
        self._pf.append({})
        self._rw.append(deque(maxlen=ROUTED_WINDOW))
        self._rws.append([])
        self._rw_frozen.append(None)
        for icol in (self._qtok, self._nq, self._out, self._run, self._blocks, self._ptok):
            icol.append(0)
        self._ab.append({})
        self._cq.append({})
        self._cq_frozen.append({})
        self._version += 1
        return len(self._q) - 1

    def __contains__(self, rid: int) -> bool:
        return rid in self._req

    # -- lifecycle hooks ---------------------------------------------------------------------

    def on_routed(
        self, rid: int, replica: int, prompt_tokens: int, cached_tokens: int = 0, prefill_s: float | None = None,
        klass: str = "",
    ) -> float:
        """Request ``rid`` was routed to ``replica`` with an estimated ``cached_tokens`` hit.

        Adds its prefill estimate P = cost.prefill_time(prompt - cached, cached) to Q_j (or
        ``prefill_s`` when the caller already priced it) and returns it. The hit is capped at
        prompt - 1 tokens (the engine always computes the last prompt token). ``klass``: its
        request class, when the host has classes (it is then also queued in ``class_queues``).
        O(log n + n) for the sorted lists.
        """
        if rid in self._req:
            raise KeyError(f"request {rid} is already tracked")
        if not 0 <= replica < len(self._q):
            raise IndexError(f"no replica {replica}")
        c = max(0, min(cached_tokens, prompt_tokens - 1))
        p = self.cost.prefill_time(prompt_tokens - c, c) if prefill_s is None else float(prefill_s)
        blocks = -(-prompt_tokens // self.block_size)
        t = _Tracked(rid, replica, prompt_tokens, p, prompt_tokens - c, blocks, klass=klass)
        self._req[rid] = t
        self._class_queue(t)
        self._route_window(replica, p)
        self._q[replica] += p
        self._qp[replica].add(p, rid)
        self._qp_frozen[replica] = None
        self._qtok[replica] += t.uncached_tokens
        self._nq[replica] += 1
        self._out[replica] += 1
        self._blocks[replica] += blocks
        self._ptok[replica] += t.uncached_tokens
        self._held[rid] = t.uncached_tokens
        self._version += 1
        return p

    def on_started(self, rid: int, started_at: float | None = None) -> None:
        """``rid`` was admitted into its engine (prefill starts): its work leaves Q_j, it counts
        as running, and its prefill is expected to end at ``started_at`` (default now) + its
        estimate. A host that learns of starts late (from periodic stats) passes the latest
        time the start can have happened. Idempotent for a request already started. O(1)."""
        t = self._req[rid]
        if t.started:
            return
        self._unqueue(t)
        t.started = True
        self._run[t.replica] += 1
        start = self.clock.now() if started_at is None else min(float(started_at), self.clock.now())
        self._pf[t.replica][rid] = start + t.prefill_s
        self._version += 1

    def on_prefill_done(self, rid: int) -> None:
        """``rid`` produced its first token (its prefill is over): it leaves ``prefill_ends`` and
        ``active_prefill_tokens`` (``on_first_token``). A host that hears of first tokens calls
        it; otherwise the estimated end stands. O(1)."""
        t = self._req.get(rid)
        if t is not None and self._pf[t.replica].pop(rid, None) is not None:
            self._version += 1
        self.on_first_token(rid)

    def on_first_token(self, rid: int) -> None:
        """``rid`` produced its first token: its prompt tokens leave ``active_prefill_tokens``
        (llm-d releases a request's prompt tokens at its first chunk). Unlike
        ``on_prefill_done`` it leaves the estimated prefill end alone, so a host that reports
        first tokens for llm-d's sake changes nothing the other policies read. Idempotent;
        unknown ids are ignored. O(1)."""
        if rid in self._held:
            self._release_held(rid, self._req[rid].replica)
            self._version += 1

    def _release_held(self, rid: int, j: int) -> None:
        """``rid``'s held prefill tokens leave replica ``j``'s count (none held: nothing). O(1)."""
        tok = self._held.pop(rid, None)
        if tok is not None:
            self._ptok[j] -= tok

    def track_blocks(self, rid: int, hashes: Sequence[int]) -> None:
        """Record the prompt block hashes of the routed request ``rid`` (after ``on_routed``) as
        active on its replica until it finishes: Dynamo's per-worker active sequences.

        Why: Dynamo's decode cost counts a worker's *distinct* active blocks, so requests sharing
        a prefix count it once, and charges a new request only its blocks not already active
        there. Hosts call it only for policies that read them (``RouterPolicy.active_blocks``).
        ``hashes`` is kept, not copied: pass an immutable sequence. O(len(hashes))."""
        t = self._req[rid]
        if rid in self._ab_req:
            raise KeyError(f"request {rid} already has tracked blocks")
        self._ab_req[rid] = hashes
        counts, where, bit = self._ab[t.replica], self._abw, 1 << t.replica
        for h in hashes:
            c = counts.get(h, 0)
            if not c:
                where[h] = where.get(h, 0) | bit
            counts[h] = c + 1
        self._version += 1

    def new_blocks(self, hashes: Sequence[int]) -> list[int]:
        """Per replica (index = id), how many of ``hashes`` would become active there: the blocks
        after the longest prefix of ``hashes`` that is active on it (Dynamo's "additional active
        blocks"; chained hashes make prefix and set membership agree). Live, not snapshotted.

        Complexity: O(blocks matched on some replica + 1) dict probes plus O(replicas): a
        replica leaves the walk at its first miss, the walk ends when none is left."""
        n, held = len(hashes), prefix_walk(self._abw, (1 << len(self._ab)) - 1, hashes, len(self._ab))
        return [n - k for k in held]

    def on_preempted(self, rid: int, cached_tokens: int = 0, prompt_tokens: int | None = None,
                     prefill_s: float | None = None) -> None:
        """A running ``rid`` went back to its engine's waiting queue (preempted, to be
        recomputed): its prefill work is queued again, re-priced with the new hit.

        ``prompt_tokens``: the tokens to recompute (prompt plus generated so far); default the
        routed prompt. ``prefill_s``: the caller's estimate of that recompute, as ``on_routed``'s
        (default the cost model's). O(1)."""
        t = self._req[rid]
        if not t.started:
            return
        prompt = t.prompt_tokens if prompt_tokens is None else prompt_tokens
        c = max(0, min(cached_tokens, prompt - 1))
        t.prefill_s = self.cost.prefill_time(prompt - c, c) if prefill_s is None else float(prefill_s)
        t.uncached_tokens = prompt - c
        t.started = False
        self._run[t.replica] -= 1
        self._pf[t.replica].pop(rid, None)
        self._q[t.replica] += t.prefill_s
        self._qp[t.replica].add(t.prefill_s, rid)
        self._qp_frozen[t.replica] = None
        self._class_queue(t)
        self._qtok[t.replica] += t.uncached_tokens
        self._nq[t.replica] += 1
        self._version += 1

    def on_finished(self, rid: int) -> None:
        """``rid`` finished, was rejected or cancelled: it leaves every count. O(1)."""
        t = self._req.pop(rid)
        if t.started:
            self._run[t.replica] -= 1
            self._pf[t.replica].pop(rid, None)
        else:
            self._unqueue(t)
        self._out[t.replica] -= 1
        self._blocks[t.replica] -= t.blocks
        self._release_held(rid, t.replica)
        self._untrack_blocks(rid, t.replica)
        self._version += 1

    def replica_load(self, replica: int) -> tuple[int, float]:
        """``replica``'s outstanding requests and queued prefill estimate (seconds), as of now,
        for a host's gauges. O(1)."""
        return self._out[replica], self._q[replica]

    def report_max_running(self, replica: int, max_running: int) -> None:
        """A replica's sequence capacity (its engine's ``max_num_seqs``; 0 = unknown). O(1)."""
        if max_running < 0:
            raise ValueError(f"max_running must be >= 0, got {max_running}")
        if self._cap[replica] != max_running:
            self._cap[replica] = int(max_running)
            self._version += 1

    def report_speed(self, replica: int, speed: float) -> None:
        """A replica's measured pace: cost-model seconds of queued prefill it works off per wall
        second (its gate's drain rate; 1.0 = as the cost model says). O(1)."""
        if not 0.0 < speed < float("inf"):
            raise ValueError(f"speed must be a finite number > 0, got {speed}")
        if self._speed[replica] != speed:
            self._speed[replica] = float(speed)
            self._version += 1

    def report_kv_usage(self, replica: int, usage: float) -> None:
        """A replica's periodic stats: the fraction of its KV blocks in use (0..1). O(1)."""
        if not 0.0 <= usage <= 1.0:
            raise ValueError(f"kv usage must be in [0, 1], got {usage}")
        self._kv[replica] = float(usage)
        self._version += 1

    # -- reads -------------------------------------------------------------------------------

    def snapshot(self) -> LoadSnapshot:
        """The load as routing policies see it: refreshed at most every ``stale_s`` seconds of
        the clock (0 = always current). O(replicas) on refresh, else O(1)."""
        now = self.clock.now()
        snap = self._snap
        if snap is not None:
            if self.stale_s > 0.0:
                if now < snap.taken_s + self.stale_s:
                    return snap
            elif self._snap_version == self._version:
                return snap
        return self._take(now)

    def outstanding_now(self) -> Sequence[int]:
        """The current outstanding count per replica, ignoring ``stale_s`` (``live().outstanding``
        without building a snapshot: the host breaks ties within a rank on it). A live view,
        not to be mutated. O(1)."""
        return self._out

    def live(self) -> LoadSnapshot:
        """The current counters, ignoring ``stale_s`` (for metrics and tests). O(replicas)."""
        return self._take(self.clock.now(), keep=False)

    # -- internals ---------------------------------------------------------------------------

    def _take(self, now: float, keep: bool = True) -> LoadSnapshot:
        # the per-replica columns read their frozen entries inline and call the rebuild only for
        # the replicas that moved (a call per replica was a third of a snapshot)
        snap = LoadSnapshot(
            taken_s=now,
            queued_prefill_s=tuple(self._q),
            queued_prefill_tokens=tuple(self._qtok),
            outstanding=tuple(self._out),
            running=tuple(self._run),
            active_blocks=tuple(self._blocks),
            kv_usage=tuple(self._kv),
            queued_prefills=tuple([f if f is not None else self._frozen_queue(j)
                                   for j, f in enumerate(self._qp_frozen)]),
            max_running=tuple(self._cap),
            speed=tuple(self._speed),
            active_prefill_tokens=tuple(self._ptok),
            unique_active_blocks=tuple(map(len, self._ab)),
            prefill_ends=tuple([self._prefill_ends(j, now) if pf else () for j, pf in enumerate(self._pf)]),
            routed_windows=tuple([f if f is not None else self._routed_window(j, now)
                                  for j, f in enumerate(self._rw_frozen)]),
            class_queues=tuple([f if f is not None else self._frozen_classes(j)
                                for j, f in enumerate(self._cq_frozen)]),
        )
        if keep:
            self._snap = snap
            self._snap_version = self._version
        return snap

    def _frozen_queue(self, j: int) -> tuple[float, ...]:
        """Replica j's waiting prefill estimates as a tuple, rebuilt only after its queue
        changed, so a snapshot copies only the queues that moved since the last one."""
        frozen = self._qp_frozen[j]
        if frozen is None:
            frozen = self._qp_frozen[j] = self._qp[j].frozen()
        return frozen

    def _frozen_classes(self, j: int) -> dict[str, tuple[float, tuple[float, ...]]]:
        """Replica j's waiting requests per class (see ``LoadSnapshot.class_queues``), rebuilt
        only after a classed request joined or left its queue. Not to be mutated."""
        frozen = self._cq_frozen[j]
        if frozen is None:
            frozen = self._cq_frozen[j] = {
                k: (max(0.0, q[0]), ps.frozen()) for k, (q, ps) in self._cq[j].items() if ps}
        return frozen

    def _class_queue(self, t: _Tracked) -> None:
        """A classed request joins its replica's class queue. O(log n + n)."""
        if not t.klass:
            return
        cq = self._cq[t.replica]
        q, ps = cq.get(t.klass) or cq.setdefault(t.klass, ([0.0], _SortedWork()))
        q[0] += t.prefill_s
        ps.add(t.prefill_s, t.rid)
        self._cq_frozen[t.replica] = None

    def _route_window(self, j: int, p: float) -> None:
        """A request priced ``p`` was routed to replica j now: it joins j's window (the oldest
        entry leaves a full one, and the next oldest becomes the window's start), and the
        window's sorted estimates follow. O(log W + W) in C."""
        w, later = self._rw[j], self._rws[j]
        if len(w) == w.maxlen:
            w.popleft()
            del later[bisect.bisect_left(later, w[0][1])]  # the new start leaves the sorted part
        if w:
            bisect.insort(later, p)
        w.append((self.clock.now(), p))
        self._rw_frozen[j] = None

    def _routed_window(self, j: int, now: float) -> tuple[float, tuple[float, ...]]:
        """Replica j's routed-work window (see ``LoadSnapshot``), rebuilt only after a request
        was routed to j: O(1), or O(W) in C once per routing to j."""
        frozen = self._rw_frozen[j]
        if frozen is None:
            w = self._rw[j]
            if len(w) < 2:
                return (now, ())  # not kept: "now" moves
            frozen = self._rw_frozen[j] = (w[0][0], tuple(self._rws[j]))
        return frozen

    def _prefill_ends(self, j: int, now: float) -> tuple[float, ...]:
        """Replica j's started requests' estimated prefill ends still ahead of ``now``; ends
        already past are dropped for good (those requests count as decoding). O(k) for the k
        requests started on j within their own prefill estimate (a handful: prefill is
        token-budgeted)."""
        pf = self._pf[j]
        if not pf:
            return ()
        done = [rid for rid, end in pf.items() if end <= now]
        for rid in done:
            del pf[rid]
        return tuple(pf.values())

    def _untrack_blocks(self, rid: int, j: int) -> None:
        """A finished ``rid``'s tracked blocks leave replica ``j``'s active blocks. O(its tracked
        blocks), O(1) when it has none."""
        hashes = self._ab_req.pop(rid, None)
        if hashes is None:
            return
        counts, where, keep = self._ab[j], self._abw, ~(1 << j)
        for h in hashes:
            c = counts[h] - 1
            if c:
                counts[h] = c
                continue
            del counts[h]
            m = where[h] & keep
            if m:
                where[h] = m
            else:
                del where[h]

    def _unqueue(self, t: _Tracked) -> None:
        j = t.replica
        self._nq[j] -= 1
        self._qtok[j] -= t.uncached_tokens
        self._qp_frozen[j] = None
        self._qp[j].remove(t.prefill_s, t.rid)
        if t.klass:
            q, ps = self._cq[j][t.klass]
            ps.remove(t.prefill_s, t.rid)
            q[0] = q[0] - t.prefill_s if ps else 0.0
            self._cq_frozen[j] = None
        # Sums of floats drift: reset to exactly 0 when nothing waits, and never go negative.
        self._q[j] = 0.0 if self._nq[j] == 0 else max(0.0, self._q[j] - t.prefill_s)



__all__ = ["LoadSnapshot", "LoadView"]
