"""The TTFT floor: a lower bound on every request's TTFT that no router and no queue order can
beat on a request sequence, so a run's TTFT quantiles can be read against the least any design
could reach (docs/cost-model.md, "The TTFT floor").

Per request: the prefill of its prompt from its arrival, with no wait, with as much of it cached
as any cache could hold (``shareable_tokens``: its reusable prompt blocks that another request of
the sequence also references, as prompt or output; a block no other request has can never be
cached for it, whatever the router and the eviction order), priced by
``CostModel.least_ttft_array`` with the engine's token budget as the largest chunk. Each
request's TTFT is at least its floor, so each quantile of a run's TTFTs is at least the same
quantile of the floors (order statistics are monotone).

Complexity: O(B) over the B block references of ``References`` (built once per run, shared with
the hit bounds), vectorised.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from fairway.cost_model import CostModel
from fairway.request import RequestSpec
from sim.hit_bounds import References


def shareable_tokens(refs: References, block_size: int) -> np.ndarray:
    """For each request of ``refs`` (its order: by arrival), the most prompt tokens any cache
    could hold when it is admitted: its reusable prompt blocks that another reference names.
    Chained hashes name their whole prefix, so these are a leading run of its blocks. O(B)."""
    n = len(refs.lens)
    shared = (refs.count[refs.ids] >= 2) & refs.counted
    owner = np.repeat(np.arange(n), refs.lens)
    return np.bincount(owner, weights=shared, minlength=n).astype(np.int64) * block_size


def ttft_floor(specs: Sequence[RequestSpec], cost: CostModel, block_size: int, max_num_batched_tokens: int,
               refs: References | None = None) -> np.ndarray:
    """Each request's TTFT floor (seconds), in arrival order (``References``' order); ``refs``:
    ``References.of(specs, block_size)`` if already built. O(B)."""
    if refs is None:
        refs = References.of(specs, block_size)
    return cost.least_ttft_array(refs.prompts, shareable_tokens(refs, block_size), max_num_batched_tokens)


__all__ = ["shareable_tokens", "ttft_floor"]
