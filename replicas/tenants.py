"""One replica queue shared fairly between tenants: fair queueing across tenants, the queue
policy's own order within each.

Why: with API keys, a tenant that floods a replica must not starve a quiet one. A single queue
ordered by Fairway (or any policy) admits by cached work and waiting time, whoever sent it, so a
tenant that sends five times its share takes about five sixths of the admissions and the quiet
tenant waits behind its backlog. Here each tenant has its own queue (a policy object of the
replica's kind), and the gate asks for the next request of the backlogged tenant that has received
the least service so far:

- service is counted in prefill work: an admission costs its uncached prompt tokens plus one
  block (so a fully cached request is not free); each tenant's virtual time is its service so far;
- start-time fair queueing: a tenant that becomes backlogged starts at the system's virtual time
  (the virtual time of the last admission), so idling banks no credit and a newcomer is served
  at once, not after catching up;
- ties go to the tenant name's order, so the order is exact and reproducible.

Fair queueing orders who enters the engine next, but entering needs room: in an overload the
flood's running requests hold every sequence slot and all the KV memory, and the quiet tenant's
request, first in line, waits for them to finish. So the gate keeps room for a quiet tenant
(``reserve``): a tenant seen within ``recent_s`` that holds fewer prompt tokens in the engine
than the one being admitted is owed one sequence slot and room for the largest prompt it sent
recently; the admission must leave that much free. A quiet tenant's next request then finds room
at once, and the flood loses only that margin. A tenant that holds more is owed nothing, so the
reserve never holds back the quiet tenant itself, and a tenant gone quiet for ``recent_s`` is
owed nothing either (the engine is whole again for the others).

With one tenant (no API keys) this is the policy itself: the same order, the same admissions.

Complexity: ``select`` is O(T) over the T backlogged tenants plus the chosen policy's own
``select``; ``reserve`` O(T); cache events fan out to every tenant's policy (O(T) each).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence

from fairway.memory_view import KVMemoryView
from fairway.policies.base import Admission, QueuedRequest, QueuePolicy
from fairway.policies.groups import QueueGroup


class TenantQueues(QueueGroup):
    """The queue-policy calls the gate makes, over one policy per tenant (module docstring).
    ``first`` serves the tenant ``""`` (requests without API keys); ``factory`` builds the
    policy of each other tenant on its first request (None: every tenant shares ``first``, no
    fairness between them)."""

    def __init__(self, first: QueuePolicy, factory: Callable[[], QueuePolicy] | None = None,
                 block_size: int = 16, recent_s: float = 30.0) -> None:
        self.factory = factory
        self.block_size = block_size
        self.recent_s = recent_s
        self.seen: dict[str, tuple[float, int]] = {}  # tenant -> (last arrival, largest prompt since recent_s)
        self.held: dict[str, int] = {}  # tenant -> prompt tokens of its requests in the engine
        # rid in the engine -> (tenant, prompt tokens, its prompt's hashes: held in the memory view)
        self._admitted: dict[int, tuple[str, int, Sequence[int]]] = {}
        self.queues: dict[str, QueuePolicy] = {"": first}
        self.vtime: dict[str, float] = {"": 0.0}
        self.vnow = 0.0  # the system's virtual time: the last admission's start
        self._tenant: dict[int, str] = {}  # rid -> tenant, while waiting
        self._contains: Callable[[int], bool] | None = None
        self._memory: KVMemoryView | None = None  # the engine's memory view, for policies that read it

    # -- the policy calls ----------------------------------------------------------------------

    def _queue(self, tenant: str) -> QueuePolicy:
        if self.factory is None:
            return self.queues[""]
        q = self.queues.get(tenant)
        if q is None:
            q = self.queues[tenant] = self.factory()
            if self._contains is not None:
                q.attach_cache(self._contains)
            if self._memory is not None:
                q.attach_memory(self._memory)
            self._share_evicted()  # it reads the evictions seen before its first request too
            self.vtime[tenant] = self.vnow
        return q

    def add(self, req: QueuedRequest, tenant: str = "") -> None:
        tenant = tenant if self.factory is not None else ""
        q = self._queue(tenant)
        if len(q) == 0:  # backlogged from now: start at the system's virtual time
            self.vtime[tenant] = max(self.vtime[tenant], self.vnow)
        q.add(req)
        self._tenant[req.rid] = tenant
        now = req.arrival_s
        last, biggest = self.seen.get(tenant, (now, 0))
        self.seen[tenant] = (now, req.prompt_tokens if now - last > self.recent_s else max(biggest, req.prompt_tokens))

    def remove(self, rid: int) -> QueuedRequest:
        return self.queues[self._tenant.pop(rid)].remove(rid)

    def select(self, skip: Collection[str] = ()) -> QueuedRequest | None:
        """The next request: from the backlogged tenant (not in ``skip``) with the least virtual
        time whose policy offers one (a policy may hold its whole queue back, e.g. PEEK's
        siblings waiting for a pioneer's blocks: the next tenant goes then). O(T) with one
        tenant offering, O(T log T) at worst."""
        if len(self.queues) == 1:
            return None if "" in skip else self.queues[""].select()
        ready = (t for t, q in self.queues.items() if len(q) and t not in skip)
        # request classes' strict tiers hold across tenants: the strictest tier waiting goes first
        for t in sorted(ready, key=lambda t: (self.queues[t].best_tier(), self.vtime[t], t)):
            req = self.queues[t].select()
            if req is not None:
                return req
        return None

    def admit(self, rid: int) -> Admission:
        tenant = self._tenant.pop(rid)
        q = self.queues[tenant]
        hashes = q.get(rid).block_hashes if self._memory is not None else ()
        adm = q.admit(rid)  # (may start the memory view's counting, which lists held_prompts)
        self.vnow = max(self.vnow, self.vtime[tenant])
        self.vtime[tenant] += adm.prompt_tokens - adm.cached_tokens + self.block_size
        self._admitted[rid] = (tenant, adm.prompt_tokens, hashes)
        self.held[tenant] = self.held.get(tenant, 0) + adm.prompt_tokens
        if self._memory is not None:  # its prompt's blocks are held from now until ``release``
            self._memory.hold(hashes)
        return adm

    def held_prompts(self) -> list[Sequence[int]]:
        """The prompts of the admitted requests still in the engine (what the memory view holds).
        O(admitted)."""
        return [hashes for _, _, hashes in self._admitted.values()]

    def release(self, rid: int) -> None:
        """An admitted request left the engine (finished, failed or cancelled). O(1)."""
        got = self._admitted.pop(rid, None)
        if got is None:
            return
        tenant, tokens, hashes = got
        self.held[tenant] -= tokens
        if self._memory is not None:  # left the engine: its context is wanted a while by a next turn
            self._memory.release(hashes)
            self._memory.finished(hashes)

    def get(self, rid: int) -> QueuedRequest:
        """The waiting request ``rid``, whatever its tenant. O(1)."""
        return self.queues[self._tenant[rid]].get(rid)

    def cached_tokens(self, rid: int) -> int:
        """The tracked cached tokens of waiting ``rid``, in its tenant's queue. O(1)."""
        return self.queues[self._tenant[rid]].cached_tokens(rid)

    def may_hold_first_step(self, rid: int) -> bool:
        """Whether its tenant's queue lets the gate hold ``rid`` back a step. O(1)."""
        return self.queues[self._tenant[rid]].may_hold_first_step(rid)

    def tenant_of(self, rid: int) -> str:
        """The tenant of a waiting request."""
        return self._tenant[rid]

    def reserve(self, tenant: str, now: float) -> tuple[int, int]:
        """(prompt tokens, sequence slots) that admitting a request of ``tenant`` must leave free
        for the other recent tenants holding less than it (the module docstring). O(T)."""
        if self.factory is None:
            return 0, 0
        mine = self.held.get(tenant, 0)
        tokens = slots = 0
        for t, (last, biggest) in self.seen.items():
            if t != tenant and now - last <= self.recent_s and self.held.get(t, 0) < mine:
                tokens += biggest
                slots += 1
        return tokens, slots

    def __len__(self) -> int:
        return len(self._tenant)

    def __contains__(self, rid: int) -> bool:
        return rid in self._tenant

    def tenant_sizes(self) -> dict[str, int]:
        """Waiting requests per tenant ("" for requests without a key)."""
        return self.group_sizes()

    # -- aggregates the gate reports -----------------------------------------------------------

    def work_ahead_s(self, tenant: str = "", priority_class: str = "") -> float:
        """The queued prefill work (cost-model seconds) a new request of ``tenant`` and
        ``priority_class`` waits for before it can start: with fair queueing, the work its own
        tenant's queue puts ahead of it, Q_t, and, from every other tenant u, the share served
        meanwhile, min(Q_u, Q_t) (equal service); with one queue, all of it. Each Q counts only
        the work its policy orders ahead of the class (all of it without classes). So a quiet
        tenant is not refused for a flood's backlog, nor an interactive request for a batch
        backlog. O(T)."""
        if self.factory is None or len(self.queues) == 1:
            return sum(q.work_ahead_s(priority_class) for q in self.queues.values())
        work = {t: q.work_ahead_s(priority_class) for t, q in self.queues.items() if len(q)}
        own = work.pop(tenant, 0.0)
        return own + sum(min(w, own) for w in work.values())

    # -- the engine's cache --------------------------------------------------------------------

    def attach_cache(self, contains: Callable[[int], bool]) -> None:
        self._contains = contains
        for q in self.queues.values():
            q.attach_cache(contains)

    def attach_memory(self, view: KVMemoryView) -> None:
        """Share the engine's memory view with every tenant's policy (those created later too),
        and hold each admitted request's prompt in it until ``release``. After ``attach_cache``."""
        self._memory = view
        super().attach_memory(view)


__all__ = ["TenantQueues"]
