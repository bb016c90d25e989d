"""PRISM: query-aware admission over a demand-aware radix tree, agreeing with demand retention.

A baseline (``PUBLISHED_BASELINES``), rebuilt from the published description (docs/design.md, PEEK and PRISM):

- **Demand-aware tree.** ``DemandQueue``'s pending tree counts, per block, the waiting requests
  that need it. The same counts drive retention (``retention = "prism"``: the engine model
  evicts the cached block with the least queued demand first, LRU among equals) and admission,
  so the blocks the engine keeps are the ones the admission order is about to read.
- **Query-aware key.** Each request is priced by its own exact-prefix hit: P_r is the estimated
  prefill time of its uncached tokens. A request whose next uncached block is needed by
  d_r waiting requests (itself included) unlocks that block for all of them, so its cost is
  amortised: C_r = P_r / d_r. Admission takes the highest response ratio (W_r + C_r) / C_r: at
  equal waits the cheapest amortised work first, and the ratio of a waiting request grows
  without bound, so none starves (HRRN's bound). No floor on C_r: a floor makes every request
  cheaper than it equal, and the order among them arrival order (FCFS), which under memory
  pressure throws away the reuse the ratio is meant to keep.
- **Soft holds.** A request whose next block an admitted request is computing (``held``) goes
  after every request not held, so it usually follows once the block is stored, with a hit;
  unlike PEEK, PRISM never leaves the engine idle for a hold.

Complexity: ``select`` O(n) vectorised (one ratio pass and a masked argmin); the rest as
``DemandQueue``.
"""

from __future__ import annotations

import numpy as np

from fairway.policies.demand import DemandQueue


class PRISM(DemandQueue):
    """PRISM queue policy. Options: ``hold_factor`` and ``p_floor_s`` (the soft-hold deadline,
    see ``DemandQueue``)."""

    name = "prism"
    retention = "prism"

    @property
    def held_picks(self) -> int:
        """Selects that found only held requests (and picked one anyway)."""
        return self.held_selects

    def amortised_cost(self) -> np.ndarray:
        """C_r over slots [0, _hi). O(n) vectorised."""
        hi = self._hi
        d = np.maximum(self.front_demand[:hi], 1)
        return np.maximum(self.prefill_s[:hi] / d, 1e-9)  # P > 0 always (the last token)

    def _choose(self, now: float) -> int:
        self._expire(now)
        hi = self._hi
        ok = self._not_held()
        mask = ok if ok.any() else self.active[:hi]
        c = self.amortised_cost()
        ratio = (np.maximum(now - self.arrival[:hi], 0.0) + c) / c
        return self._argmin(-ratio, mask)
