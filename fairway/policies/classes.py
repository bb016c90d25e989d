"""Request classes and the flow-control queue policy: strict tiers, then weighted fair sharing of
prefill work between the classes of a tier, then the inner queue policy (Fairway's lanes) within
a class (docs/design.md, Flow control).

Why: an interactive request and a bulk-evaluation request are the same to a queue that orders by
cached work and waiting time, so a batch flood takes an interactive tenant's TTFT. Classes decide
whose work comes first; Fairway's lanes keep deciding, within a class, which of its requests
goes next.

- **Tiers** are strict: a class of tier 0 is admitted before any class of tier 1 that is waiting.
- **Within a tier**, start-time fair queueing over estimated prefill seconds (the cost model's,
  at the request's current cache hit), not request counts: each class has a virtual time that an
  admission advances by ``est_prefill_s / weight``; the backlogged class with the least virtual
  time goes next (ties: the order the classes are configured in). A class that becomes
  backlogged starts at its tier's virtual time (that of the last admission), so idling banks no
  credit.
- **Within a class**, the inner policy (``inner``, default ``fairway``) unchanged: one instance
  per class, each with its own lanes and cache view.
- **The default class**: a request whose class is ``""`` belongs to ``ClassesConfig.default``
  (the last class configured, unless named). With no classes configured there is one inner
  policy and every call passes straight through: the same order, the same admissions.

Complexity: ``add``/``remove``/``admit`` O(1) plus the inner policy's; ``select`` O(C) over the
C classes plus the chosen inner policy's ``select`` (one per class that offers nothing, at
worst); cache events fan out to every class's policy (O(C) each).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from fairway.clock import Clock
from fairway.cost_model import CostModel
from fairway.policies.base import Admission, QueuedRequest, QueuePolicy
from fairway.policies.groups import QueueGroup

D = TypeVar("D")  # the default of ``ClassesConfig.wait_bound_for``


@dataclass(frozen=True, slots=True)
class ClassSpec:
    """One request class.

    name: what requests carry (``QueuedRequest.priority_class``); non-empty, no ``:,=`` in it.
    tier: strict priority, lower first (>= 0).
    weight: share of its tier's prefill work when every class of the tier is backlogged (> 0).
    objective_s: the TTFT objective (seconds, > 0): a request meets it when its TTFT <= this.
    max_wait_s: the wait bound (seconds, > 0): a request whose predicted wait exceeds it is
        answered at once (refused) rather than queued; None = ``objective_s``.
    """

    name: str
    tier: int = 0
    weight: float = 1.0
    objective_s: float = 1.0
    max_wait_s: float | None = None

    def __post_init__(self) -> None:
        if not self.name or any(c in self.name for c in ":,=[];"):
            raise ValueError(f"bad class name {self.name!r}: non-empty, without ':,=[];'")
        if self.tier < 0:
            raise ValueError(f"class {self.name}: tier must be >= 0")
        if not self.weight > 0:
            raise ValueError(f"class {self.name}: weight must be > 0")
        if not self.objective_s > 0:
            raise ValueError(f"class {self.name}: objective must be > 0 seconds")
        if self.max_wait_s is not None and not self.max_wait_s > 0:
            raise ValueError(f"class {self.name}: max_wait must be > 0 seconds")

    @property
    def wait_bound_s(self) -> float:
        return self.objective_s if self.max_wait_s is None else self.max_wait_s


_KEYS = {"tier": ("tier", int), "weight": ("weight", float), "objective": ("objective_s", float),
         "max_wait": ("max_wait_s", float)}


@dataclass(frozen=True, slots=True)
class ClassesConfig:
    """The configured classes, in order (the order breaks ties between classes of one tier).
    ``default``: the class of requests that name none (``""``: the last class). Empty: no
    classes (every request in one default class, the policy a pass-through)."""

    classes: tuple[ClassSpec, ...] = ()
    default: str = ""

    def __post_init__(self) -> None:
        names = [c.name for c in self.classes]
        if len(set(names)) != len(names):
            raise ValueError(f"duplicate class names in {names}")
        if self.default and self.default not in names:
            raise ValueError(f"default class {self.default!r} is not one of {names}")

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(c.name for c in self.classes)

    @property
    def default_name(self) -> str:
        """The class a request without one belongs to ("" with no classes)."""
        return self.default or (self.classes[-1].name if self.classes else "")

    def resolve(self, name: str) -> str:
        """The configured class ``name`` stands for ("" = the default); ``ValueError`` naming the
        valid classes for an unknown one. O(C)."""
        return self.spec(name).name if name else self.default_name

    def for_request(self, priority: int | str | None = None, header: str = "", tenant_default: str = "") -> str:
        """The class of a request: the body's ``priority`` (a class name, or an integer tier as
        vLLM's ``priority``: lower first, the first class configured with that tier), else the
        ``header``'s class name, else its tenant's default, else the cluster's default. Without
        classes, only ``priority`` 0 (vLLM's default) is accepted and the class is "".
        ``ValueError`` that names the valid values otherwise. O(C)."""
        if isinstance(priority, bool):
            raise ValueError("priority must be a class name or an integer tier, not a boolean")
        if isinstance(priority, int):
            if not self.classes:
                if priority == 0:
                    return ""
                raise ValueError(f"priority {priority}: this server has no request classes configured, so only "
                                 "priority 0 is accepted")
            for c in self.classes:
                if c.tier == priority:
                    return c.name
            tiers = sorted({c.tier for c in self.classes})
            raise ValueError(f"no request class has priority (tier) {priority}; valid: "
                             f"{', '.join(map(str, tiers))}, or a class name: {', '.join(self.names)}")
        for name in (priority, header, tenant_default):
            if name:
                return self.resolve(name)
        return self.default_name

    def wait_bound_for(self, name: str, default: D) -> float | D:
        """The wait bound of a request of class ``name`` ("" = the default class): its class's
        ``wait_bound_s``; ``default`` when no classes are configured. O(C)."""
        return self.spec(name).wait_bound_s if self.classes else default

    def spec(self, name: str) -> ClassSpec:
        """The spec of class ``name`` ("" = the default); ``ValueError`` for an unknown one.
        O(C), one plain loop: the router asks once per replica on every classed decision."""
        want = name or self.default_name
        for c in self.classes:
            if c.name == want:
                return c
        raise ValueError(f"unknown class {want!r}; valid: {', '.join(self.names) or '(none configured)'}")

    def others_ahead_s(self, name: str, own_s: float, queued: Mapping[str, float]) -> float:
        """The queued prefill seconds of other classes that a request of class ``name`` waits
        for, given its own class's queued work ``own_s`` and every class's (``queued``, seconds
        by class name): every class of a stricter tier whole, and from each other class u of
        its tier the share fair queueing serves meanwhile, min(Q_u, own_s * w_u / w_c). The
        same rule orders a gate's queue (``ClassQueues``) and prices a replica at the router.
        O(C)."""
        if not queued:
            return 0.0
        me = self.spec(name)
        ahead = 0.0
        for s in self.classes:
            w = queued.get(s.name, 0.0)
            if s.name == me.name or s.tier > me.tier or w <= 0.0:
                continue
            ahead += w if s.tier < me.tier else min(w, own_s * s.weight / me.weight)
        return ahead

    @classmethod
    def parse(cls, text: str, default: str = "") -> ClassesConfig:
        """``interactive:tier=0:objective=1,batch:tier=1:objective=30:weight=1:max_wait=60`` ->
        config (keys: tier, weight, objective, max_wait); "" -> no classes."""
        out = []
        for part in filter(None, (p.strip() for p in text.split(","))):
            name, *kvs = part.split(":")
            kw: dict[str, Any] = {}
            for kv in kvs:
                k, eq, v = kv.partition("=")
                if not eq or k.strip() not in _KEYS:
                    raise ValueError(f"bad class option {kv!r} in {part!r}; keys: {', '.join(_KEYS)}")
                field, typ = _KEYS[k.strip()]
                try:
                    kw[field] = typ(v)
                except ValueError:
                    raise ValueError(f"bad value {v!r} for {k} in {part!r}") from None
            out.append(ClassSpec(name.strip(), **kw))
        return cls(tuple(out), default)


def as_classes(classes: ClassesConfig | str | Sequence[ClassSpec] | None) -> ClassesConfig:
    """A policy option as a config: a config, its text form (``ClassesConfig.parse``), specs, or
    None (no classes)."""
    if classes is None:
        return ClassesConfig()
    if isinstance(classes, ClassesConfig):
        return classes
    if isinstance(classes, str):
        return ClassesConfig.parse(classes)
    return ClassesConfig(tuple(classes))


class ClassQueues(QueueGroup, QueuePolicy):
    """The flow-control queue policy (module docstring): a drop-in ``QueuePolicy`` over one inner
    policy per class. The base class's columns stay empty; every call goes to the class's inner
    policy."""

    name = "classes"
    takes_classes = True

    def __init__(self, clock: Clock, cost: CostModel, block_size: int = 16,
                 classes: ClassesConfig | str | Sequence[ClassSpec] | None = None, inner: str = "fairway",
                 inner_options: dict[str, Any] | None = None) -> None:
        super().__init__(clock, cost, block_size)
        from fairway.policies import make_policy  # the registry imports this module

        self.config = as_classes(classes)
        if inner == self.name:
            raise ValueError("classes cannot nest")
        specs = self.config.classes or (ClassSpec("default"),)
        self.specs = {c.name: c for c in specs}
        self._all = ClassesConfig(tuple(specs))  # the classes, the default one included
        self.queues: dict[str, QueuePolicy] = {
            c.name: make_policy(inner, clock=clock, cost=cost, block_size=block_size, **(inner_options or {}))
            for c in specs}
        self._share_evicted()  # one replica, one memory of lost context (lost_blocks)
        first = next(iter(self.queues.values()))
        self.has_lanes = first.has_lanes  # type: ignore[misc]
        self.retention = first.retention  # type: ignore[misc]
        # tiers in order, each with its classes in configured order
        self._tiers: list[list[str]] = [
            [c.name for c in specs if c.tier == t] for t in sorted({c.tier for c in specs})]
        self._default = self.config.default_name or specs[0].name
        self.vtime = dict.fromkeys(self.queues, 0.0)
        self.vnow = {c.tier: 0.0 for c in specs}  # per tier: the virtual time of its last admission
        self._class_of: dict[int, str] = {}  # rid -> class, while waiting
        self._chosen = ""  # the class of the last select()

    def _class(self, req: QueuedRequest) -> str:
        name = req.priority_class
        if not name or len(self.queues) == 1 and not self.config.classes:
            return self._default
        if name not in self.queues:
            raise ValueError(f"unknown class {name!r}; valid: {', '.join(self.queues)}")
        return name

    # -- the host protocol, per class ------------------------------------------------------------

    def add(self, req: QueuedRequest) -> None:
        if req.rid in self._class_of:
            raise KeyError(f"request {req.rid} is already queued")
        c = self._class(req)
        q = self.queues[c]
        if not len(q):  # backlogged from now: start at the tier's virtual time
            self.vtime[c] = max(self.vtime[c], self.vnow[self.specs[c].tier])
        q.add(req)
        self._class_of[req.rid] = c

    def remove(self, rid: int) -> QueuedRequest:
        return self.queues[self._class_of.pop(rid)].remove(rid)

    def select(self) -> QueuedRequest | None:
        """The first tier with a class that offers a request; in it, the backlogged class with
        the least virtual time (ties: configured order). O(C) plus the inner ``select``s."""
        for tier in self._tiers:
            ready = [c for c in tier if len(self.queues[c])]
            if len(ready) > 1:
                ready.sort(key=lambda c: self.vtime[c])  # stable: configured order breaks ties
            for c in ready:
                req = self.queues[c].select()
                if req is not None:
                    self._chosen = c
                    return req
        return None

    def admit(self, rid: int) -> Admission:
        c = self._class_of.pop(rid)
        adm = self.queues[c].admit(rid)
        tier = self.specs[c].tier
        self.vnow[tier] = max(self.vnow[tier], self.vtime[c])
        self.vtime[c] += adm.est_prefill_s / self.specs[c].weight
        return adm

    def get(self, rid: int) -> QueuedRequest:
        return self.queues[self._class_of[rid]].get(rid)

    def class_of(self, rid: int) -> str:
        """The class of a waiting request."""
        return self._class_of[rid]

    def cached_tokens(self, rid: int) -> int:
        return self.queues[self._class_of[rid]].cached_tokens(rid)

    def may_hold_first_step(self, rid: int) -> bool:
        return self.queues[self._class_of[rid]].may_hold_first_step(rid)

    def __len__(self) -> int:
        return len(self._class_of)

    def __contains__(self, rid: int) -> bool:
        return rid in self._class_of

    def _choose(self, now: float) -> int:  # pragma: no cover - select() is overridden
        raise NotImplementedError

    # -- fan-out -------------------------------------------------------------------------------

    def attach_cache(self, contains: Callable[[int], bool]) -> None:
        if self._class_of:
            raise RuntimeError("attach_cache must be called on an empty queue")
        for q in self.queues.values():
            q.attach_cache(contains)

    def on_step(self, prefill_tokens: int) -> None:
        super().on_step(prefill_tokens)
        for q in self.queues.values():
            q.on_step(prefill_tokens)

    def best_tier(self) -> int:
        """The strictest tier with a waiting request (0 when none waits). O(C)."""
        for tier in self._tiers:
            if any(len(self.queues[c]) for c in tier):
                return self.specs[tier[0]].tier
        return 0

    def lower_tier(self, priority_class: str) -> bool:
        """Whether class ``priority_class`` ("" = the default) is of a tier below the strictest
        configured. O(1)."""
        c = self._default if not priority_class else priority_class
        return self.specs[c].tier > self.specs[self._tiers[0][0]].tier

    def strict_waiting(self) -> bool:
        """Whether a request of the strictest tier's classes waits. O(C)."""
        return any(len(self.queues[c]) for c in self._tiers[0])

    def class_sizes(self) -> dict[str, int]:
        """Waiting requests per class (classes with none left out)."""
        return self.group_sizes()

    def work_ahead_s(self, priority_class: str = "") -> float:
        """The queued prefill seconds a new request of ``priority_class`` waits for: every class
        of a stricter tier, its own class's queue Q_c, and from each other class u of its tier
        the share fair queueing serves meanwhile, min(Q_u, Q_c * w_u / w_c). O(C) inner sums."""
        c = self._default if not priority_class or priority_class not in self.queues else priority_class
        own = self.queues[c].queued_prefill_s()
        queued = {u: q.queued_prefill_s() for u, q in self.queues.items() if len(q)}
        return own + self._all.others_ahead_s(c, own, queued)


__all__ = ["ClassQueues", "ClassSpec", "ClassesConfig", "as_classes"]
