"""Summaries of a workload, independent of any engine: a zero-queue driver and the uncached
work a perfect (infinite, never-evicting) prefix cache would leave.

These are for tests and for describing workloads; the simulator is the real host.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np

from fairway.request import RequestSpec, Workload, WorkloadError


def drain(
    workload: Workload,
    service_s: float | Callable[[RequestSpec], float] = 1.0,
    *,
    max_requests: int = 10_000_000,
) -> list[RequestSpec]:
    """Issue every request of ``workload`` and complete each ``service_s`` after its arrival
    (no queueing, unbounded capacity), feeding completions back to a closed-loop workload.

    Returns all specs in issue order. Completions are processed in ``(finish_s, seq)`` order,
    ``seq`` from a counter of this call, so ties are deterministic. Raises ``WorkloadError``
    past ``max_requests`` (a workload that never drains). O(n log n).
    """
    service = service_s if callable(service_s) else (lambda _s, d=float(service_s): d)
    issued: list[RequestSpec] = []
    heap: list[tuple[float, int, RequestSpec]] = []
    seq = 0

    def issue(specs: Iterable[RequestSpec]) -> None:
        nonlocal seq
        for s in specs:
            issued.append(s)
            if len(issued) > max_requests:
                raise WorkloadError(f"workload issued more than {max_requests} requests")
            heapq.heappush(heap, (s.arrival_s + service(s), seq, s))
            seq += 1

    issue(workload.initial())
    while heap:
        finish, _, spec = heapq.heappop(heap)
        if workload.closed_loop:
            issue(workload.on_complete(spec, finish))
    return issued


def perfect_cache_uncached(specs: Iterable[RequestSpec], block_size: int) -> np.ndarray:
    """Per request (in the given order), prompt tokens not served by a perfect prefix cache
    holding every block of every earlier request in arrival order (ties by rid).

    A cached prefix counts in whole blocks and, as in vLLM, at least one token is computed.
    Returned in the order of ``specs``. O(total blocks).
    """
    specs = list(specs)
    order = sorted(range(len(specs)), key=lambda i: (specs[i].arrival_s, specs[i].rid))
    seen: set[int] = set()
    out = np.zeros(len(specs), dtype=np.int64)
    for i in order:
        s = specs[i]
        n_prompt = s.prompt_tokens // block_size
        hit = 0
        for h in s.block_hashes[:n_prompt]:
            if h not in seen:
                break
            hit += 1
        out[i] = max(1, s.prompt_tokens - hit * block_size)
        seen.update(s.block_hashes)
    return out


@dataclass(frozen=True, slots=True)
class WorkloadSummary:
    """Means per request; ``uncached`` assumes a perfect cache (``perfect_cache_uncached``)."""

    n: int
    duration_s: float  # last arrival
    prompt_tokens: float
    uncached_tokens: float
    output_tokens: float
    kinds: dict[str, int]


def summarize(specs: list[RequestSpec], block_size: int) -> WorkloadSummary:
    if not specs:
        return WorkloadSummary(0, 0.0, 0.0, 0.0, 0.0, {})
    unc = perfect_cache_uncached(specs, block_size)
    kinds: dict[str, int] = {}
    for s in specs:
        kinds[s.kind] = kinds.get(s.kind, 0) + 1
    return WorkloadSummary(
        n=len(specs),
        duration_s=max(s.arrival_s for s in specs),
        prompt_tokens=float(np.mean([s.prompt_tokens for s in specs])),
        uncached_tokens=float(unc.mean()),
        output_tokens=float(np.mean([s.output_tokens for s in specs])),
        kinds=dict(sorted(kinds.items())),
    )
