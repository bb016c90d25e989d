"""Session-aware admission: hold new cold work back while the KV cache holds waiting sessions.

In a memory-bound closed loop (agent sessions whose contexts together exceed the KV cache), the
free pool holds little but the contexts of sessions waiting for their next turn. Admitting a
*cold* request (a session's first turn, or a request with little of its prompt cached) then
allocates over one of those contexts, and that session's next turn arrives cold in its turn: a
chain of recomputes. The gate tries to break the chain by deciding *what enters* (it never
chooses what is evicted, so it works with a stock engine and with the replica gate). Measured on
the agentic closed loop at concurrency 100 it does not pay: the free pool there is all waiting
contexts, so every cold request is held to its bound (docs/history/2026-12-01-kv-memory.md).
Off by default.

Rule (``SessionAdmission.should_hold``), checked when a request is about to be admitted:

- A request is **cold** if it is a session's first turn (``hold_first_turn``) or if less than
  ``cold_fraction`` of its prompt is cached. Warm requests (cheap follow-ups) always pass.
- A cold request is **held** if admitting it would allocate more new blocks than the free blocks
  that nobody waits for (free blocks minus those holding a queued request's cacheable prefix or a
  waiting session's context): it would evict a waiting session's context.
- **No starvation**: a cold request is held at most until ``arrival + bound``, with
  ``bound = clamp(hold_factor * P, min_hold_s, max_hold_s)`` and P its estimated prefill time
  when first held; then it is admitted ahead of the queue policy's pick (as soon as memory fits,
  head-of-line like any admission). Never held when nothing is running (an idle engine holds no
  one: work conservation, and no wake-up is needed to release it).
- ``guard`` extends or relaxes the bound (``AdmissionConfig``); measured in
  docs/history/2026-12-01-kv-memory.md, none of the variants is a default anywhere.
- A session is **waiting** from the finish of one of its turns until its next turn arrives or
  ``session_horizon_s`` passes (then it is presumed over, and its context is evictable).

``HeldQueue`` keeps the held requests in deadline order; ``WaitingSessions`` the finished
sessions' contexts until the next turn or the horizon. Both are pure (no clock reads: the host
passes ``now``), so the engine model and the replica gate can drive them alike.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class AdmissionConfig:
    """The gate's knobs (fixed across workloads).

    cold_fraction: a request with a smaller cached fraction of its prompt is cold (0..1).
    hold_first_turn: a session's first turn (``turn == 0``) is cold whatever its cached fraction.
    hold_factor, min_hold_s, max_hold_s: the starvation bound, arrival + clamp(hold_factor * P,
        min_hold_s, max_hold_s) seconds.
    session_horizon_s: how long a finished turn's session counts as waiting for its next turn.
    guard: who the bound applies to. "held": the requests the gate held; past it they are
        admitted before anyone else as soon as memory fits. "all": every waiting request gets the
        same bound and priority past it (an oldest-first override of the queue policy); a request
        preempted after its first token counts it from its re-queueing. "policy": a held request
        past its bound goes back to the queue policy's order and is not held again in this wait.
    preempt_for_due: the engine preempts the newest decoding requests to make room for an overdue
        request that waits for its first token, instead of waiting for memory to drain.
    """

    cold_fraction: float = 0.5
    hold_first_turn: bool = True
    hold_factor: float = 8.0
    min_hold_s: float = 2.0
    max_hold_s: float = 10.0
    session_horizon_s: float = 10.0
    preempt_for_due: bool = False
    guard: str = "held"

    def __post_init__(self) -> None:
        if not 0.0 <= self.cold_fraction <= 1.0:
            raise ValueError("cold_fraction must be in [0, 1]")
        if self.hold_factor < 0 or self.min_hold_s < 0 or self.max_hold_s < self.min_hold_s:
            raise ValueError("need hold_factor >= 0 and 0 <= min_hold_s <= max_hold_s")
        if self.session_horizon_s < 0:
            raise ValueError("session_horizon_s must be >= 0")
        if self.guard not in ("held", "all", "policy"):
            raise ValueError("guard must be 'held', 'all' or 'policy'")


@dataclass(frozen=True, slots=True)
class Candidate:
    """A request about to be admitted, as the gate sees it."""

    rid: int
    arrival_s: float
    prompt_tokens: int
    cached_tokens: int  # served from cache (any tier)
    new_blocks: int  # blocks the admission allocates
    est_prefill_s: float
    first_turn: bool = False


class SessionAdmission:
    """The hold rule of the module docstring. O(1) per decision."""

    __slots__ = ("config",)

    def __init__(self, config: AdmissionConfig | None = None) -> None:
        self.config = config or AdmissionConfig()

    def is_cold(self, c: Candidate) -> bool:
        cfg = self.config
        if cfg.hold_first_turn and c.first_turn:
            return True
        return c.cached_tokens < cfg.cold_fraction * c.prompt_tokens

    def deadline(self, c: Candidate) -> float:
        """The latest time ``c`` may be held to: arrival + clamp(hold_factor * P, min, max)."""
        cfg = self.config
        bound = min(cfg.max_hold_s, max(cfg.min_hold_s, cfg.hold_factor * c.est_prefill_s))
        return c.arrival_s + bound

    def should_hold(self, c: Candidate, now: float, free_blocks: int, free_wanted_blocks: int,
                    running: int) -> bool:
        """True if ``c`` waits: cold, something is running, its deadline is not reached, and it
        needs more new blocks than the free blocks nobody waits for."""
        if running <= 0 or not self.is_cold(c) or now >= self.deadline(c):
            return False
        return c.new_blocks > free_blocks - free_wanted_blocks


class HeldQueue(Generic[T]):
    """Held requests by deadline (then hold order). ``add``/``remove`` O(1); ``in_order``
    O(n log n) on the few held."""

    __slots__ = ("_items", "_seq")

    def __init__(self) -> None:
        self._items: dict[int, tuple[float, int, T]] = {}
        self._seq = 0

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, rid: int) -> bool:
        return rid in self._items

    def add(self, rid: int, deadline_s: float, item: T) -> None:
        if rid in self._items:
            raise KeyError(f"request {rid} is already held")
        self._seq += 1
        self._items[rid] = (deadline_s, self._seq, item)

    def remove(self, rid: int) -> T:
        return self._items.pop(rid)[2]

    def deadline(self, rid: int) -> float:
        return self._items[rid][0]

    def in_order(self) -> list[tuple[int, float, T]]:
        """(rid, deadline, item), earliest deadline first (ties: the earlier hold)."""
        ordered = sorted(self._items.items(), key=lambda kv: kv[1][:2])
        return [(rid, d, item) for rid, (d, _, item) in ordered]


class WaitingSessions:
    """Contexts of sessions between a finished turn and their next turn (or the horizon).

    ``finish`` O(1) (the hashes are kept, not copied); ``arrive`` O(1); ``expire`` O(expired).
    The horizon is one constant, so expiry order is finish order: a deque suffices."""

    __slots__ = ("horizon_s", "_by_session", "_fifo", "_seq")

    def __init__(self, horizon_s: float) -> None:
        self.horizon_s = horizon_s
        self._by_session: dict[int, tuple[int, Sequence[int]]] = {}
        self._fifo: deque[tuple[float, int, int]] = deque()
        self._seq = 0

    def __len__(self) -> int:
        return len(self._by_session)

    def finish(self, session: int, now: float, hashes: Sequence[int]) -> Sequence[int] | None:
        """Session ``session`` now waits with context ``hashes``; returns the context it replaced
        (None if it was not waiting), which the host un-declares."""
        old = self._by_session.pop(session, None)
        self._seq += 1
        self._by_session[session] = (self._seq, hashes)
        self._fifo.append((now + self.horizon_s, self._seq, session))
        return None if old is None else old[1]

    def arrive(self, session: int) -> Sequence[int] | None:
        """The session's next turn arrived: it no longer waits; returns its context, if any."""
        old = self._by_session.pop(session, None)
        return None if old is None else old[1]

    def expire(self, now: float) -> list[Sequence[int]]:
        """Contexts of the sessions whose horizon ended at or before ``now``."""
        out: list[Sequence[int]] = []
        fifo = self._fifo
        while fifo and fifo[0][0] <= now:
            _, seq, session = fifo.popleft()
            cur = self._by_session.get(session)
            if cur is not None and cur[0] == seq:
                del self._by_session[session]
                out.append(cur[1])
        return out
