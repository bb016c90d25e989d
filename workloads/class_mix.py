"""A class mix on any workload: each request labelled with a request class drawn from a mix.

Why: flow control is judged on a mix of classes (say 20% interactive, 80% batch) over the
shared workloads; the simulator (``sim/runner.py``) and the load generator (``loadgen``, which
sends the class as the body's ``priority``) draw the same labels for the same seed. The draw
uses its own seeded RNG (a stream apart from the workload's, so the requests themselves are the
ones the workload makes without classes); every turn of a session shares its first turn's class.

Complexity: O(log C) per request (a binary search over the mix's cumulative shares).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from fairway.policies.classes import ClassesConfig
from fairway.request import RequestSpec, Workload


def parse_class_values(text: str, label: str, what: str) -> list[tuple[str, float]]:
    """``name=value,...`` -> [(name, value), ...], every name non-empty and every value > 0;
    ``ValueError`` naming the entry as a ``label`` ("mix entry", "objective") and the value as
    ``what`` ("share", "seconds")."""
    out: list[tuple[str, float]] = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, eq, v = part.partition("=")
        try:
            value = float(v) if eq and name.strip() else -1.0
        except ValueError:
            value = -1.0
        if not value > 0:
            raise ValueError(f"bad class {label} {part!r}: expected name={what} with {what} > 0")
        out.append((name.strip(), value))
    return out


def parse_mix(text: str, classes: ClassesConfig | None = None) -> tuple[tuple[str, float], ...]:
    """``interactive=0.2,batch=0.8`` -> ((name, probability), ...), normalised; every share > 0,
    and every name a configured class of ``classes`` (None: any non-empty name, for a client that
    does not know the server's classes; the server names the valid ones in its 400)."""
    pairs = parse_class_values(text, "mix entry", "share")
    out = [(classes.resolve(n) if classes is not None else n, s) for n, s in pairs]
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


__all__ = ["ClassMix", "parse_class_values", "parse_mix"]
