"""How much of the routed traffic each shared prefix draws: the Fairway router's replication signal.

Why: a per-request rule never replicates a hot prefix. The request that would seed a new holder
pays the whole recompute, while the gain (a smaller batch on every holder for every later
request of that prefix) goes to the requests after it, so a hot prefix stays on the few
replicas that got it first. Comparing a prefix's share of the traffic with its holders' share
of the replicas says when one more holder is worth it, with no time constant or threshold to
tune.

A prefix is named by the chained hash of its last block (the chain makes the hash name the whole
prefix). Rates are averages since first sighting: (n - 1) / (now - first) for the n sightings of
one prefix, and the same over every decision; their ratio is the prefix's share of the traffic.
A rate from fewer than ``MIN_SIGHTINGS`` sightings is not reported.

Complexity: O(1) per observation (a dict probe and an LRU touch); memory is bounded by
``max_prefixes`` (the least recently seen prefix is forgotten first).
"""

from __future__ import annotations

from collections import OrderedDict

#: Sightings before a prefix's rate is used: two intervals, the fewest that estimate a rate.
MIN_SIGHTINGS = 3


class PrefixShares:
    """Per-prefix share of the routing decisions (see the module docstring). Pure: the caller
    passes the clock's time."""

    __slots__ = ("max_prefixes", "_seen", "_n", "_first")

    def __init__(self, max_prefixes: int = 65_536) -> None:
        if max_prefixes < 1:
            raise ValueError("max_prefixes must be >= 1")
        self.max_prefixes = max_prefixes
        self._seen: OrderedDict[int, list[float]] = OrderedDict()  # key -> [sightings, first time]
        self._n = 0
        self._first = 0.0

    def observe(self, now: float) -> None:
        """One routing decision at ``now`` (every request, shared prefix or not). O(1)."""
        if self._n == 0:
            self._first = now
        self._n += 1

    def share(self, key: int, now: float) -> float | None:
        """Record a sighting of prefix ``key`` at ``now`` (after ``observe`` for the same
        decision) and return its share of the decisions, or None while it has fewer than
        ``MIN_SIGHTINGS`` sightings or no time has passed. O(1)."""
        entry = self._seen.get(key)
        if entry is None:
            entry = self._seen[key] = [0, now]
            if len(self._seen) > self.max_prefixes:
                self._seen.popitem(last=False)
        else:
            self._seen.move_to_end(key)
        entry[0] += 1
        n, first = entry
        if n < MIN_SIGHTINGS or now <= first or now <= self._first or self._n < 2:
            return None
        return ((n - 1) / (now - first)) / ((self._n - 1) / (now - self._first))

    def __len__(self) -> int:
        return len(self._seen)


__all__ = ["MIN_SIGHTINGS", "PrefixShares"]
