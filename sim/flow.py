"""Flow control in the simulator: a class mix on any workload, the router's wait-bound check, and
the per-class summary (docs/design.md, Flow control).

- ``ClassMix`` labels each request of a workload with a class drawn from a mix by its own seeded
  RNG (a stream apart from the workload's, so the requests themselves are the ones the workload
  makes without classes); every turn of a session shares its first turn's class.
- ``FlowControl`` is the router-side admission the issue asks for, as far as the simulator
  models it: a request goes to the router's pick when that replica's predicted wait for its class
  (``QueuePolicy.work_ahead_s``: the queued prefill seconds its queue order puts ahead of it) is
  within the class's wait bound; otherwise, with ``retry``, to the next replica in the router's
  ranking that has room; otherwise it is refused at once (answered, as a 429 would be). Every
  refusal made while some replica had room is counted (``refused_with_room``; target 0). With
  ``bounds="gate"`` every request has today's gate bound instead of its class's, on all the
  replica's queued work, and ``retry=False`` is today's cluster (a refused request is not tried
  elsewhere). The router holds nothing: a request is placed or refused on arrival (the held
  queue at the router is not modelled).

Complexity: ``place`` O(N) ``work_ahead_s`` calls at worst (each O(n) in the replica's queue),
one on the common path.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator, Sequence
from typing import Any, Literal

import numpy as np

from fairway.engine.model import EngineModel, EngineRequest
from fairway.policies.classes import ClassesConfig
from fairway.request import RequestSpec, Workload
from fairway.summary import pct, short_pct


def parse_mix(text: str, classes: ClassesConfig) -> tuple[tuple[str, float], ...]:
    """``interactive=0.2,batch=0.8`` -> ((name, probability), ...), normalised; every name must
    be a configured class and every share > 0."""
    out: list[tuple[str, float]] = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, eq, v = part.partition("=")
        if not eq:
            raise ValueError(f"bad class mix entry {part!r}: expected name=share")
        name = classes.resolve(name.strip())
        try:
            share = float(v)
        except ValueError:
            raise ValueError(f"bad share {v!r} for class {name}") from None
        if not share > 0:
            raise ValueError(f"class {name}: share must be > 0")
        out.append((name, share))
    if not out:
        raise ValueError("an empty class mix")
    total = sum(s for _, s in out)
    return tuple((n, s / total) for n, s in out)


class ClassMix(Workload):
    """``inner``'s requests, each labelled with a class drawn from ``mix`` (module docstring)."""

    def __init__(self, inner: Workload, mix: Sequence[tuple[str, float]], seed: int) -> None:
        self.inner = inner
        self.name = inner.name
        self.closed_loop = inner.closed_loop
        self.names = [n for n, _ in mix]
        self.cum = np.cumsum([p for _, p in mix])
        self.rng = np.random.default_rng([seed, 25])  # apart from the workload's own stream
        self._session: dict[int, str] = {}

    def __getattr__(self, attr: str) -> Any:  # the inner workload's other attributes
        return getattr(self.inner, attr)

    def _label(self, spec: RequestSpec) -> RequestSpec:
        c = self._session.get(spec.session) if spec.session >= 0 else None
        if c is None:
            i = int(np.searchsorted(self.cum, self.rng.random(), side="right"))
            c = self.names[min(i, len(self.names) - 1)]
            if spec.session >= 0:
                self._session[spec.session] = c
        spec.priority_class = c
        return spec

    def initial(self) -> Iterator[RequestSpec]:
        for spec in self.inner.initial():
            yield self._label(spec)

    def on_complete(self, spec: RequestSpec, finish_s: float) -> list[RequestSpec]:
        return [self._label(s) for s in self.inner.on_complete(spec, finish_s)]


class FlowControl:
    """The router's wait-bound check and its counters (module docstring)."""

    def __init__(self, classes: ClassesConfig, bounds: Literal["class", "gate"] = "class",
                 gate_wait_s: float = 5.0, retry: bool = True) -> None:
        self.classes = classes
        self.bounds = bounds
        self.gate_wait_s = gate_wait_s
        self.retry = retry
        self.refused: Counter[str] = Counter()
        self.refused_with_room = 0
        self.retried = 0

    def bound_s(self, spec: RequestSpec) -> float:
        if self.bounds == "gate":
            return self.gate_wait_s
        return self.classes.spec(spec.priority_class).wait_bound_s

    def wait_s(self, engine: EngineModel, spec: RequestSpec) -> float:
        """The predicted wait of ``spec`` on ``engine``: its queue's work ahead of the request's
        class, or all of it (``bounds="gate"``, as today's gate counts)."""
        if self.bounds == "gate":
            return engine.policy.queued_prefill_s()
        return engine.policy.work_ahead_s(spec.priority_class)

    def place(self, spec: RequestSpec, engines: Sequence[EngineModel], order: Sequence[int]) -> int:
        """The replica for ``spec``: the first of ``order`` (the router's preference, its pick
        first) within the bound, only the pick without ``retry``; -1: refused."""
        bound = self.bound_s(spec)
        for k, j in enumerate(order if self.retry else order[:1]):
            if self.wait_s(engines[j], spec) <= bound:
                self.retried += k > 0
                return j
        self.refused[self.classes.resolve(spec.priority_class)] += 1
        if any(self.wait_s(e, spec) <= bound for e in engines):
            self.refused_with_room += 1
        return -1


def flow_summary(finished: Sequence[EngineRequest], rejected: Sequence[EngineRequest],
                 classes: ClassesConfig, flow: FlowControl | None) -> dict[str, Any]:
    """Per class: arrivals, finishes, refusals, TTFT p50/p99, objective attainment (met / arrived,
    a refusal counting as a miss), goodput (met per second of arrivals) and how many finished
    requests waited past the class's wait bound for their first token; plus the refusals made
    while a replica had room. O(n log n)."""
    arrivals = [r.spec.arrival_s for r in finished] + [r.spec.arrival_s for r in rejected]
    span = max(arrivals) - min(arrivals) if len(arrivals) > 1 else 0.0
    ttft: dict[str, list[float]] = {c: [] for c in classes.names}
    n_rej: Counter[str] = Counter(classes.resolve(r.spec.priority_class) for r in rejected)
    for r in finished:
        ttft[classes.resolve(r.spec.priority_class)].append(r.ttft_s)
    per: dict[str, Any] = {}
    for c in classes.classes:
        t = np.asarray(ttft[c.name], dtype=float)
        arrived = len(t) + n_rej[c.name]
        met = int(np.count_nonzero(t <= c.objective_s))
        per[c.name] = {
            "arrived": arrived, "finished": len(t), "refused": n_rej[c.name],
            "ttft_s": short_pct(pct(t)), "objective_s": c.objective_s, "wait_bound_s": c.wait_bound_s,
            "attainment": met / arrived if arrived else 1.0,
            "goodput_rps": met / span if span else 0.0,
            "over_bound": int(np.count_nonzero(t > c.wait_bound_s)),
        }
    out: dict[str, Any] = {"classes": per}
    if flow is not None:
        out.update(bounds=flow.bounds, retry=flow.retry, refused_with_room=flow.refused_with_room,
                   retried=flow.retried)
    return out


__all__ = ["ClassMix", "FlowControl", "flow_summary", "parse_mix"]
