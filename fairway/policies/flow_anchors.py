"""Flow-control anchors (docs/design.md, Flow control): the orders the class policy is compared
with, each a key over the shared columns plus a class tier column. Baselines, not shipped.

- ``priority-fcfs``: strict priority, then arrival order: the lowest tier waiting goes first, and
  within it the oldest request. The textbook strict-priority queue (vLLM's ``priority``
  scheduling policy orders by (priority, arrival) the same way).
- ``llmd-flow``: llm-d's flow control as the Gateway API Inference Extension builds it
  (repository kubernetes-sigs/gateway-api-inference-extension). Its shard processor
  (``pkg/epp/flowcontrol/controller/internal/processor.go``) walks the priority bands from the
  most to the least important and dispatches from the first band that yields an item; within a
  band the round-robin fairness policy (``pkg/epp/flowcontrol/framework/plugins/interflow/
  roundrobin.go``; later moved under a fairness plugin package) sorts the band's flows by key
  and takes the first non-empty flow after the one it picked last (from the start when there
  was none, or it is gone); within a flow the FCFS ordering policy takes the oldest
  (``.../intraflow/fcfs.go``). Here a band is a class tier and a flow is a tenant
  (``QueuedRequest.tenant``, llm-d's fairness ID) within its band. Ours differs in two small
  ways: the cursor moves when a pick is admitted, not when it is picked (a host may select
  without admitting), and flows are never garbage-collected (llm-d's go when idle, which resets
  the cursor to the first flow).

Both take ``classes`` (a ``ClassesConfig`` or its text) for the class -> tier map; a request
without a class is in the default class. Complexity: ``select`` O(n) vectorised (plus O(F) over
a band's F flows for ``llmd-flow``); ``add``/``admit`` O(1) (O(log F) registering a new flow).
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

import numpy as np

from fairway.clock import Clock
from fairway.cost_model import CostModel
from fairway.policies.base import Admission, QueuedRequest, QueuePolicy, grow_column
from fairway.policies.classes import ClassesConfig, ClassSpec, as_classes


class _Tiered(QueuePolicy):
    """Shared: the class -> tier map and a tier column."""

    takes_classes = True

    def __init__(self, clock: Clock, cost: CostModel, block_size: int = 16,
                 classes: ClassesConfig | str | Sequence[ClassSpec] | None = None) -> None:
        super().__init__(clock, cost, block_size)
        self.config = as_classes(classes)
        self._tier_of = {c.name: c.tier for c in self.config.classes}
        self._strictest = min(self._tier_of.values(), default=0)
        self.tier = np.zeros(len(self.active), dtype=np.int64)

    def _grow_extra(self, n: int) -> None:
        self.tier = grow_column(self.tier, n)

    def _tier(self, req: QueuedRequest) -> int:
        if not self.config.classes:
            return 0
        return self._tier_of[self.config.resolve(req.priority_class)]

    def _on_add(self, slot: int, req: QueuedRequest) -> None:
        self.tier[slot] = self._tier(req)

    def best_tier(self) -> int:
        """The strictest tier waiting (0 when none waits): a gate serving several tenants' queues
        serves it first (``QueuePolicy.best_tier``). O(n)."""
        live = self._live()
        return int(self.tier[: self._hi][live].min()) if live.any() else 0

    def lower_tier(self, priority_class: str) -> bool:
        """Whether class ``priority_class`` ("" = the default) is of a tier below the strictest
        configured (``QueuePolicy.lower_tier``: the engine's strict-tier prefill). O(1)."""
        if not self.config.classes:
            return False
        return self._tier_of[self.config.resolve(priority_class)] > self._strictest

    def strict_waiting(self) -> bool:
        """Whether a request of the strictest tier configured waits (``QueuePolicy.strict_waiting``).
        O(n) vectorised."""
        if not self.config.classes:
            return False
        hi = self._hi
        return bool((self.active[:hi] & (self.tier[:hi] == self._strictest)).any())

    def _top_band(self) -> np.ndarray:
        """Mask of the live slots in the most important tier waiting. O(n)."""
        live = self._live()
        t = self.tier[: self._hi]
        return live & (t == t[live].min())

    def work_ahead_s(self, priority_class: str = "") -> float:
        """Queued prefill seconds in the class's tier and every stricter one (FCFS within a
        tier: all of it is ahead). O(n)."""
        hi = self._hi
        mine = self._tier_of.get(self.config.resolve(priority_class), 0) if self.config.classes else 0
        mask = self.active[:hi] & (self.tier[:hi] <= mine)
        return float(self.prefill_s[:hi][mask].sum())


class PriorityFCFS(_Tiered):
    """Strict priority (lowest tier first), then arrival order."""

    name = "priority-fcfs"

    def _choose(self, now: float) -> int:
        return self._argmin(self.arrival[: self._hi], self._top_band())


class LLMDFlow(_Tiered):
    """llm-d's flow control: priority band, then round-robin between the band's flows (tenants),
    then FCFS within a flow (module docstring)."""

    name = "llmd-flow"

    def __init__(self, clock: Clock, cost: CostModel, block_size: int = 16,
                 classes: ClassesConfig | str | Sequence[ClassSpec] | None = None) -> None:
        super().__init__(clock, cost, block_size, classes)
        self.flow = np.zeros(len(self.active), dtype=np.int64)
        self._flow_id: dict[str, int] = {}
        self._flow_names: list[str] = []  # flow id -> its key
        self._flows: dict[int, list[str]] = {}  # band -> its flows, sorted by key
        self._waiting: dict[tuple[int, str], int] = {}  # (band, flow) -> waiting requests
        self._last: dict[int, str] = {}  # band -> the flow admitted last

    def _grow_extra(self, n: int) -> None:
        super()._grow_extra(n)
        self.flow = grow_column(self.flow, n)

    def _on_add(self, slot: int, req: QueuedRequest) -> None:
        super()._on_add(slot, req)
        band, f = int(self.tier[slot]), req.tenant
        fid = self._flow_id.get(f)
        if fid is None:
            fid = self._flow_id[f] = len(self._flow_names)
            self._flow_names.append(f)
        self.flow[slot] = fid
        flows = self._flows.setdefault(band, [])
        i = bisect.bisect_left(flows, f)
        if i == len(flows) or flows[i] != f:
            flows.insert(i, f)
        self._waiting[band, f] = self._waiting.get((band, f), 0) + 1

    def _on_remove(self, slot: int) -> None:
        self._waiting[int(self.tier[slot]), self._flow_name(int(self.flow[slot]))] -= 1

    def _flow_name(self, fid: int) -> str:
        return self._flow_names[fid]

    def _pick_flow(self, band: int) -> str:
        flows = self._flows[band]
        last = self._last.get(band)
        start = 0
        if last is not None:
            i = bisect.bisect_left(flows, last)
            if i < len(flows) and flows[i] == last:
                start = (i + 1) % len(flows)
        for k in range(len(flows)):
            f = flows[(start + k) % len(flows)]
            if self._waiting.get((band, f), 0):
                return f
        raise AssertionError("a waiting band without a waiting flow")

    def _choose(self, now: float) -> int:
        top = self._top_band()
        band = int(self.tier[: self._hi][top][0])
        f = self._flow_id[self._pick_flow(band)]
        return self._argmin(self.arrival[: self._hi], top & (self.flow[: self._hi] == f))

    def _on_admit(self, slot: int, adm: Admission) -> None:
        self._last[int(self.tier[slot])] = self._flow_name(int(self.flow[slot]))


__all__ = ["LLMDFlow", "PriorityFCFS"]
