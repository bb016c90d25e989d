"""What a replica's host knows of its KV memory without the engine's block table.

The memory guard (``fairway/policies/fairway.py``) asks the KV pool two questions: how many free
blocks no waiting request needs (an allocation up to that size evicts nobody's cached context),
and how many of a waiting request's hit blocks no running request holds (what its waiting can
lose to eviction). vLLM answers neither; it reports how many blocks are free (its
``kv_cache_usage`` counts a cached block that nobody references as free). The rest any host can
count itself: the waiting requests' hits are the queue policies' (``HitTracker``), the running
requests' prompts are the host's (it admitted them). A cached block is free exactly when no
running request holds it, so

    spare = free - |{h : wanted, and no running request's prompt holds h}|

where h is wanted while a waiting request's hit holds it, or, while it stays cached, for
``horizon_s`` after a request whose prompt holds it finished: in a multi-turn conversation or an
agent's loop the next turn continues the last one's context, and between the two turns nobody
waits for it yet (the engine model's session-aware admission keeps the same horizon per session;
a host without session ids keeps it per finished prompt). The host passes the cache's removed
events (``on_blocks_removed``), so an evicted block stops counting at once; a waiting request's
hit stops counting through its policy's hit tracking.

The simulator's engine model feeds this view as the replica gate does, so what the simulator
measures of the guard is what the product runs. Approximations, the same on either host: a
running request holds its whole prompt's blocks from admission (those beyond its hit are not
cached yet, so no waiting hit names them), and its output blocks are not counted (no waiting
request's prompt continues a running request's output). One on the live path only: a request
vLLM preempts stays held at its gate (vLLM does not say), so its blocks count as held until it
finishes.

On demand (``on_demand=True``, what the hosts build): the counts cost one interpreted step per
prompt block at each admission and finish and per block a waiting hit gains or loses, which is most
of a simulated replica's work on long prompts; a reader that asks only in some states (the guard
only while context is being lost, ``guard_loss``) says when it needs them (``need``). Until then
the view keeps only the recent prompts (O(1) each; the running ones are the host's, which it
lists on demand: ``running()``); when a reader first needs it, it counts them anew, and the
queues that feed it (``attach_feeder``) declare their waiting hits; when nobody needs it, the
counts are dropped and the queues stop declaring. Counting anew gives the counts the
incremental path keeps, but for one case: a recent prompt's block evicted and cached again
since counts as wanted (it is, by the definition above); incrementally it stays dropped.

Complexity: ``hold`` / ``release`` / ``finished`` O(prompt blocks) while counting, O(1) else;
``want`` / ``unwant`` O(blocks passed); ``spare_blocks`` O(1) amortised (each finished prompt
expires once) plus the host's free count; ``free_cached`` O(blocks asked); a first ``need``
O(running and recent prompts' blocks + waiting hits).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Sequence
from itertools import filterfalse
from typing import Protocol

from fairway.clock import Clock


class MemoryFeeder(Protocol):
    """A queue that declares its waiting requests' hits to a view (``want`` / ``unwant``)."""

    def feed_memory(self, on: bool) -> None:
        """From now on declare (``on``: the current hits first) or stop declaring."""


class KVMemoryView:
    """Reference counts of the block hashes that running requests hold and that waiting
    requests' hits (or recently finished prompts) want, and the count of hashes wanted and held
    by nobody (cached, free, wanted).

    ``free_blocks()``: the engine's free KV blocks (cached-but-unreferenced ones included);
    ``clock``: the host's clock (finished prompts expire ``horizon_s`` after they finished; 0: at
    once); on demand, ``cached(h)`` (whether a block is in the engine's cache) and ``running()``
    (the prompt of each request ``hold`` took and ``release`` has not given back)."""

    __slots__ = ("_free_blocks", "_clock", "horizon_s", "_held", "_wanted", "_recent", "_recent_n",
                 "n_free_wanted", "_cached", "_running", "_feeders", "_needed", "_on_demand", "counting")

    def __init__(self, free_blocks: Callable[[], int], clock: Clock, horizon_s: float = 0.0,
                 cached: Callable[[int], bool] | None = None,
                 running: Callable[[], Iterable[Sequence[int]]] | None = None, on_demand: bool = False) -> None:
        if horizon_s < 0:
            raise ValueError("horizon_s must be >= 0")
        if on_demand and (cached is None or running is None):
            raise ValueError("an on-demand view needs the host's cached(h) and running() to count anew")
        self._free_blocks = free_blocks
        self._clock = clock
        self.horizon_s = horizon_s
        self._cached = cached
        self._held: dict[int, int] = {}  # hash -> running requests whose prompt holds it
        self._wanted: dict[int, int] = {}  # hash -> waiting hits and recent prompts that hold it
        self._recent: deque[tuple[float, Sequence[int]]] = deque()  # (expiry, prompt) in finish order
        self._recent_n: dict[int, int] = {}  # hash -> recent prompts holding it (of those in _wanted)
        self.n_free_wanted = 0  # hashes wanted and held by no running request
        self._running = running  # the host's running prompts, one per running request (on demand)
        self._feeders: list[MemoryFeeder] = []  # the queues that declare their waiting hits
        self._needed: set[int] = set()  # the readers that need the counts now (on demand)
        self._on_demand = on_demand
        self.counting = not on_demand  # whether the counts are kept now

    # -- on demand -------------------------------------------------------------------------

    def attach_feeder(self, feeder: MemoryFeeder) -> None:
        """A queue whose waiting requests' hits this view counts: it is told to declare them
        (``feeder.feed_memory(True)``: its current hits, then each change) while the view counts,
        and to stop when it does not."""
        self._feeders.append(feeder)
        if self.counting:
            feeder.feed_memory(True)

    def need(self, reader: object, on: bool) -> None:
        """``reader`` needs the counts from now on (``on``) or no longer. An on-demand view counts
        while some reader needs it; O(1) but for the change (counting anew, or dropping)."""
        key = id(reader)
        if on:
            self._needed.add(key)
        else:
            self._needed.discard(key)
        if self._on_demand and bool(self._needed) != self.counting:
            self._recount() if self._needed else self._drop_counts()

    def _recount(self) -> None:
        """Count the records anew: the running prompts, the recent prompts' cached blocks, and
        (from the feeders) the waiting hits."""
        self.counting = True
        for prompt in self._running():  # type: ignore[misc]
            self.n_free_wanted -= _add_all(self._held, prompt, self._wanted, True)
        self._expire()
        cached = self._cached
        for _, prompt in self._recent:
            self._want_recent([h for h in prompt if cached(h)])  # type: ignore[misc]
        for f in self._feeders:
            f.feed_memory(True)

    def _drop_counts(self) -> None:
        self.counting = False
        for f in self._feeders:
            f.feed_memory(False)
        self._held.clear()
        self._wanted.clear()
        self._recent_n.clear()
        self.n_free_wanted = 0

    # -- the host's events -----------------------------------------------------------------

    def hold(self, hashes: Iterable[int]) -> None:
        """A request was admitted: its prompt's blocks are referenced until ``release`` (an
        on-demand host lists it in ``running()`` from then on)."""
        if self.counting:
            self.n_free_wanted -= _add_all(self._held, hashes, self._wanted, True)

    def release(self, hashes: Iterable[int]) -> None:
        """A running request left the engine (finished, aborted, preempted): the hashes
        ``hold`` took."""
        if self.counting:
            self.n_free_wanted += _drop_all(self._held, hashes, self._wanted, True)

    def finished(self, hashes: Sequence[int]) -> None:
        """A request whose prompt held ``hashes`` finished (after ``release``): its context is
        wanted for ``horizon_s`` more, by the turn that may continue it."""
        if self.horizon_s > 0 and hashes:
            if self.counting:
                self._want_recent(hashes)
            else:
                self._expire()
            self._recent.append((self._clock.now() + self.horizon_s, hashes))

    def _want_recent(self, hashes: Sequence[int]) -> None:
        """A recent prompt's (cached) blocks are wanted, and counted as a recent prompt's, which
        an eviction drops at once."""
        self.want(hashes)
        counts = self._recent_n
        for h in hashes:
            counts[h] = counts.get(h, 0) + 1

    def on_blocks_removed(self, hashes: Iterable[int]) -> None:
        """The engine evicted these blocks: the recent prompts stop wanting them (a waiting
        request's hit stops through its policy's hit tracking). O(hashes)."""
        counts = self._recent_n
        if not counts:
            return
        gone: list[int] = []
        for h in hashes:
            k = counts.pop(h, 0)
            if k:
                gone.extend([h] * k)
        if gone:
            self.unwant(gone)

    def _expire(self) -> None:
        """Drop the recent prompts whose horizon ended. A block evicted meanwhile was dropped
        then (and one cached again and wanted by a later prompt loses that want early)."""
        recent = self._recent
        if recent:
            now = self._clock.now()
            counts = self._recent_n
            while recent and recent[0][0] <= now:
                prompt = recent.popleft()[1]
                if not self.counting:
                    continue
                gone = [h for h in prompt if h in counts]
                _drop_all(counts, gone, {}, True)  # (how many left is not needed here)
                self.unwant(gone)

    def want(self, hashes: Iterable[int]) -> None:
        """Blocks joined a waiting request's cached prefix."""
        self.n_free_wanted += _add_all(self._wanted, hashes, self._held, False)

    def unwant(self, hashes: Iterable[int]) -> None:
        """Blocks left a waiting request's cached prefix (evicted, or the request left the queue)."""
        self.n_free_wanted -= _drop_all(self._wanted, hashes, self._held, False)

    def spare_blocks(self) -> int:
        """Free blocks that no waiting request's hit needs (negative when the host's free count
        lags behind its hits)."""
        self._expire()
        return self._free_blocks() - self.n_free_wanted

    def free_cached(self, hashes: Iterable[int]) -> int:
        """How many of ``hashes`` (cached blocks) no running request holds."""
        return sum(1 for _ in filterfalse(self._held.__contains__, hashes))

    @property
    def n_held(self) -> int:
        """Distinct hashes some running request holds."""
        return len(self._held)

    @property
    def n_wanted(self) -> int:
        """Distinct hashes some waiting request's hit (or a recent prompt) holds."""
        self._expire()
        return len(self._wanted)


def _add_all(counts: dict[int, int], hashes: Iterable[int], other: dict[int, int], in_other: bool) -> int:
    """Add one to each hash's count; return how many hashes entered ``counts`` that are in
    ``other`` (``in_other``) or not in it. One interpreted loop, no call per hash."""
    entered = 0
    for h in hashes:
        n = counts.get(h, 0)
        counts[h] = n + 1
        if not n and (h in other) is in_other:
            entered += 1
    return entered


def _drop_all(counts: dict[int, int], hashes: Iterable[int], other: dict[int, int], in_other: bool) -> int:
    """Take one off each hash's count (a key leaves at 0); return how many left ``counts`` that
    are in ``other`` (``in_other``) or not in it."""
    left = 0
    for h in hashes:
        n = counts[h]
        if n > 1:
            counts[h] = n - 1
        else:
            del counts[h]
            if (h in other) is in_other:
                left += 1
    return left


__all__ = ["KVMemoryView", "MemoryFeeder"]
