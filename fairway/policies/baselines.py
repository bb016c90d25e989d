"""Baseline queue policies (docs/design.md, Queue baselines), each a key over the shared columns
(``BASELINE_POLICIES``; the published schedulers rebuilt are ``PUBLISHED_BASELINES``).

Every class states its key; "first" means admitted first; ties go to the smaller host ``seq``
(arrival order). Sources: vLLM (fcfs, sjf), SGLang (lpm, dfs-weight, hrrn, lpm with aging),
arXiv 2502.04677 (k-LPM).
"""

from __future__ import annotations

import numpy as np

from fairway.clock import Clock
from fairway.cost_model import CostModel
from fairway.policies.base import Admission, QueuedRequest, QueuePolicy, grow_column


class FCFS(QueuePolicy):
    """First come, first served (vLLM's default): smallest arrival first."""

    name = "fcfs"

    def _choose(self, now: float) -> int:
        return self._argmin(self.arrival[: self._hi])


class LPM(QueuePolicy):
    """Longest prefix match first (SGLang ``lpm``, reuse-first): most cached tokens first.

    ``fcfs_above``: SGLang silently switches to FCFS above 128 waiting; here that degradation is
    off by default and, when set, counted in ``fallbacks``.
    """

    name = "lpm"

    def __init__(
        self, clock: Clock, cost: CostModel, block_size: int = 16, fcfs_above: int | None = None
    ) -> None:
        super().__init__(clock, cost, block_size)
        self.fcfs_above = fcfs_above
        self.fallbacks = 0

    def _choose(self, now: float) -> int:
        if self.fcfs_above is not None and len(self) > self.fcfs_above:
            self.fallbacks += 1
            return self._argmin(self.arrival[: self._hi])
        return self._argmin(-self.cached[: self._hi].astype(float))


class SRPTOracle(QueuePolicy):
    """Least uncached prefill work first with the exact cache view: a reference bound on mean
    TTFT (shortest remaining processing time), not a product policy: it starves long jobs."""

    name = "srpt-oracle"
    is_bound = True

    def _choose(self, now: float) -> int:
        return self._argmin(self.prefill_s[: self._hi])


class HRRN(QueuePolicy):
    """Highest response ratio next (SGLang PR #32911).

    key = waited tokens / uncached tokens, highest first, where waited tokens are the prefill
    tokens the engine processed since the request was queued (a token clock, not seconds), and a
    request with nothing uncached goes first.
    """

    name = "hrrn"

    def __init__(self, clock: Clock, cost: CostModel, block_size: int = 16) -> None:
        super().__init__(clock, cost, block_size)
        self.queued_at_tokens = np.zeros(len(self.active), dtype=np.int64)

    def _grow_extra(self, n: int) -> None:
        self.queued_at_tokens = grow_column(self.queued_at_tokens, n)

    def _on_add(self, slot: int, req: QueuedRequest) -> None:
        self.queued_at_tokens[slot] = self.processed_tokens

    def _choose(self, now: float) -> int:
        hi = self._hi
        waited = (self.processed_tokens - self.queued_at_tokens[:hi]).astype(float)
        uncached = (self.prompt[:hi] - self.cached[:hi]).astype(float)
        ratio = np.divide(waited, uncached, out=np.full(hi, np.inf), where=uncached > 0)
        return self._argmin(-ratio)


class LPMAging(QueuePolicy):
    """LPM with aging (SGLang PR #31723): key = cached tokens + N x scheduling passes waited,
    highest first. A pass is one engine step. SGLang's default N = 0 is plain LPM; we default to
    N = 25 tokens per pass (the value its tests use)."""

    name = "lpm-aging"

    def __init__(
        self, clock: Clock, cost: CostModel, block_size: int = 16, tokens_per_pass: float = 25.0
    ) -> None:
        super().__init__(clock, cost, block_size)
        self.tokens_per_pass = tokens_per_pass
        self.queued_at_step = np.zeros(len(self.active), dtype=np.int64)

    def _grow_extra(self, n: int) -> None:
        self.queued_at_step = grow_column(self.queued_at_step, n)

    def _on_add(self, slot: int, req: QueuedRequest) -> None:
        self.queued_at_step[slot] = self.steps

    def _choose(self, now: float) -> int:
        hi = self._hi
        passes = (self.steps - self.queued_at_step[:hi] + 1).astype(float)
        return self._argmin(-(self.cached[:hi] + self.tokens_per_pass * passes))


class KLPM(QueuePolicy):
    """k-LPM (arXiv 2502.04677): each cycle of k admissions serves the oldest request first,
    then k-1 longest-prefix-match requests. k = 1 is FCFS, k = inf is LPM. The paper leaves k
    tunable; the default k = 4 is a middle setting, not a tuned one (no sweep over k)."""

    name = "k-lpm"

    def __init__(self, clock: Clock, cost: CostModel, block_size: int = 16, k: int = 4) -> None:
        super().__init__(clock, cost, block_size)
        if k < 1:
            raise ValueError("k must be >= 1")
        self.k = k
        self._pos = 0

    def _choose(self, now: float) -> int:
        if self._pos % self.k == 0:
            return self._argmin(self.arrival[: self._hi])
        return self._argmin(-self.cached[: self._hi].astype(float))

    def _on_admit(self, slot: int, adm: Admission) -> None:
        self._pos += 1


class VLLMSJF(QueuePolicy):
    """vLLM's proposed ``sjf`` (PR #29366): highest score first, where
    score = 0.5 * sigmoid((wait - 5 s) / 5 s) + 0.5 * sigmoid(-(prompt - 32768) / 32768).
    Cache-blind: it looks at prompt length, not uncached tokens."""

    name = "vllm-sjf"

    def __init__(
        self,
        clock: Clock,
        cost: CostModel,
        block_size: int = 16,
        time_median_s: float = 5.0,
        length_median: float = 32768.0,
    ) -> None:
        super().__init__(clock, cost, block_size)
        self.time_median_s = time_median_s
        self.length_median = length_median

    def _choose(self, now: float) -> int:
        hi = self._hi
        w = now - self.arrival[:hi]
        tm, lm = self.time_median_s, self.length_median
        s_wait = 1.0 / (1.0 + np.exp(-(w - tm) / tm))
        s_len = 1.0 / (1.0 + np.exp((self.prompt[:hi] - lm) / lm))
        return self._argmin(-(0.5 * s_wait + 0.5 * s_len))


class DFSWeight(QueuePolicy):
    """SGLang ``dfs-weight``: walk the tree of cached prefixes depth-first, heavier subtrees
    (more waiting requests below) first, a node's descendants before the requests that end at it;
    requests with no cached prefix come last, in arrival order.

    The order is computed once per scheduling pass (engine step), as SGLang does, and consumed
    in order; requests that arrive mid-pass wait for the next pass. Complexity: O(sum of waiting
    requests' cached blocks) per pass.
    """

    name = "dfs-weight"

    def __init__(self, clock: Clock, cost: CostModel, block_size: int = 16) -> None:
        super().__init__(clock, cost, block_size)
        self._order: list[int] = []
        self._next = 0  # index of the first not-yet-consumed entry of _order
        self._order_step = -1

    def _rebuild(self) -> None:
        children: dict[int, list[int]] = {}
        ends: dict[int, list[int]] = {}
        weight: dict[int, int] = {}
        root = -1
        reqs = sorted(self._items.values(), key=lambda r: (r.seq, r.rid))
        for r in reqs:
            hit = int(self.cached[self._slot_of[r.rid]]) // self.block_size
            hs = r.block_hashes
            parent = root
            weight[root] = weight.get(root, 0) + 1
            for i in range(hit):
                node = hs[i]
                if node not in weight:
                    children.setdefault(parent, []).append(node)
                    weight[node] = 0
                weight[node] += 1
                parent = node
            ends.setdefault(parent, []).append(r.rid)
        order: list[int] = []
        stack: list[tuple[int, bool]] = [(root, False)]
        while stack:
            node, expanded = stack.pop()
            if expanded:
                order.extend(ends.get(node, ()))
                continue
            stack.append((node, True))
            kids = sorted(children.get(node, ()), key=lambda c: -weight[c])  # stable
            for c in reversed(kids):
                stack.append((c, False))
        self._order = order
        self._next = 0
        self._order_step = self.steps

    def _choose(self, now: float) -> int:
        if self._order_step != self.steps:
            self._rebuild()
        for _ in range(2):
            while self._next < len(self._order):
                slot = self._slot_of.get(self._order[self._next])
                if slot is not None:
                    return slot
                self._next += 1
            self._rebuild()  # pass exhausted but requests remain (arrived mid-pass)
        raise AssertionError("dfs-weight order lost a queued request")
