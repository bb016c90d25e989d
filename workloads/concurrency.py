"""Fixed-concurrency mode for any workload (as ``bench_serving --max-concurrency`` runs).

``ConcurrencyWorkload(inner, C)`` keeps at most C requests outstanding (issued and not yet
completed) and is itself closed loop:
- ``initial()`` releases the first C requests of ``inner.initial()``, all at arrival 0.
- ``on_complete(spec, t)`` frees one slot and refills free slots with arrival ``t``.
- The inner arrival times are ignored: only the inner order and content are kept. For a
  closed-loop inner (agentic sessions), its follow-ups (from ``inner.on_complete``) are queued
  and released *before* any fresh inner request, so C slots behave like C users who each finish
  a session before starting the next; the inner think time is dropped (a slot counts a request
  at the engine, not a user thinking).
- The offered number of requests is whatever the inner workload holds (``rate * duration_s``
  for synthetic open loop), so the run ends when they are all served.
- Specs are the inner specs with a new rid (0, 1, ... in release order) and the release time
  as arrival; block hashes, lengths, session and kind are kept.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from dataclasses import replace

from fairway.request import RequestSpec, Workload, WorkloadError


class ConcurrencyWorkload(Workload):
    """At most ``concurrency`` requests of ``inner`` outstanding; see the module docstring."""

    closed_loop = True

    def __init__(self, inner: Workload, concurrency: int) -> None:
        if isinstance(concurrency, bool) or not isinstance(concurrency, int) or concurrency < 1:
            raise WorkloadError(f"concurrency must be an integer >= 1, got {concurrency!r}")
        self.inner = inner
        self.concurrency = concurrency
        self.name = f"{inner.name}@c{concurrency}"
        self._reset()

    def _reset(self) -> None:
        self._source: Iterator[RequestSpec] = iter(())
        self._ready: deque[RequestSpec] = deque()  # inner follow-ups, released first
        self._inner_of: dict[int, RequestSpec] = {}  # outstanding: our rid -> inner spec
        self._next_rid = 0

    @property
    def outstanding(self) -> int:
        """Requests released and not yet completed (never more than ``concurrency``)."""
        return len(self._inner_of)

    def _pull(self) -> RequestSpec | None:
        if self._ready:
            return self._ready.popleft()
        return next(self._source, None)

    def _release(self, inner_spec: RequestSpec, at_s: float) -> RequestSpec:
        # The inner keeps its own rid (it looks the request up by it), with the release time
        # as arrival so that its finish >= arrival check holds.
        inner_spec = replace(inner_spec, arrival_s=at_s)
        spec = replace(inner_spec, rid=self._next_rid)
        self._inner_of[spec.rid] = inner_spec
        self._next_rid += 1
        return spec

    def _fill(self, at_s: float) -> list[RequestSpec]:
        out: list[RequestSpec] = []
        while len(self._inner_of) < self.concurrency:
            nxt = self._pull()
            if nxt is None:
                break
            out.append(self._release(nxt, at_s))
        return out

    def initial(self) -> Iterator[RequestSpec]:
        """The first ``concurrency`` requests at arrival 0; restarts the inner workload."""
        self._reset()
        self._source = iter(self.inner.initial())
        return iter(self._fill(0.0))

    def on_complete(self, spec: RequestSpec, finish_s: float) -> list[RequestSpec]:
        """Free ``spec``'s slot, pass the completion to a closed-loop inner, refill. O(1)
        amortised plus the inner's own cost."""
        inner_spec = self._inner_of.pop(spec.rid, None)
        if inner_spec is None:
            raise WorkloadError(f"on_complete for rid {spec.rid}: not an outstanding request")
        if self.inner.closed_loop:
            self._ready.extend(self.inner.on_complete(inner_spec, finish_s))
        return self._fill(finish_s)
