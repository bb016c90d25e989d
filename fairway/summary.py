"""The latency summary shared by ``sim run`` and ``loadgen run``: one function over plain records.

Both hosts reduce a finished request to a ``RequestSample`` (TTFT, queue wait, lane, prompt and
cached tokens, and a "work" number that splits cheap from expensive requests) and call
``summarize_samples``, so the two JSON files have the same keys computed the same way:

- ``ttft_s``, ``queue_wait_s``: ``pct`` dicts (p50/p90/p99/mean/max/n). A sample whose queue
  wait is unknown (``None``; a server that does not report it) is left out of ``queue_wait_s``.
- ``ttft_by_lane_s``: ``{lane: {p50, p99, n}}`` over samples with a non-empty lane, sorted.
- ``ttft_by_class_s``: ``expensive`` = the top ``EXPENSIVE_FRACTION`` by ``work`` (all samples
  tied at the cut when none exceeds it), ``cheap`` = the rest.
- ``cache_hit_ratio``: sum of cached tokens / sum of prompt tokens (0 when there are none).
- ``e2e_s``: arrival (send) to the last token, over samples that know it; ``tpot_s``: per request
  with two or more output tokens, (e2e - TTFT) / (output tokens - 1), the time per output token
  after the first as ``vllm bench serve`` reports TPOT. Both ``pct`` dicts.

Complexity: O(n log n) (percentiles).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

EXPENSIVE_FRACTION = 0.10  # top 10% of requests by uncached work at arrival


@dataclass(frozen=True, slots=True)
class RequestSample:
    """One finished request as the summary sees it.

    ``work``: uncached work at arrival in any unit (the simulator uses its estimated prefill
    seconds, the HTTP load generator ``prompt_tokens - cached_tokens``); only its order matters.
    ``e2e_s``: arrival to the last token (None: unknown); ``output_tokens``: tokens generated
    (0: unknown). Invariant: ``0 <= cached_tokens <= prompt_tokens``.
    """

    ttft_s: float
    queue_wait_s: float | None
    lane: str
    prompt_tokens: int
    cached_tokens: int
    work: float
    e2e_s: float | None = None
    output_tokens: int = 0


def pct(values: Sequence[float] | np.ndarray) -> dict[str, float]:
    """p50/p90/p99/mean/max of ``values`` (NaN-free; empty -> zeros with n=0)."""
    a = np.asarray(values, dtype=float)
    if a.size == 0:
        return {"p50": 0.0, "p90": 0.0, "p99": 0.0, "mean": 0.0, "max": 0.0, "n": 0}
    p50, p90, p99 = np.percentile(a, [50, 90, 99])
    return {
        "p50": float(p50),
        "p90": float(p90),
        "p99": float(p99),
        "mean": float(a.mean()),
        "max": float(a.max()),
        "n": int(a.size),
    }


def short_pct(d: dict[str, float]) -> dict[str, float]:
    """The p50/p99/n subset of a ``pct`` dict (per-lane and per-class entries)."""
    return {"p50": d["p50"], "p99": d["p99"], "n": d["n"]}


def summarize_samples(samples: Sequence[RequestSample]) -> dict[str, Any]:
    """TTFT overall, per lane and per class, queue wait, and the cache hit ratio (see the module
    docstring for the keys)."""
    ttft = np.array([s.ttft_s for s in samples], dtype=float)
    wait = np.array([s.queue_wait_s for s in samples if s.queue_wait_s is not None], dtype=float)
    out: dict[str, Any] = {"ttft_s": pct(ttft), "queue_wait_s": pct(wait)}
    lanes: dict[str, list[float]] = {}
    for s in samples:
        if s.lane:
            lanes.setdefault(s.lane, []).append(s.ttft_s)
    out["ttft_by_lane_s"] = {k: short_pct(pct(v)) for k, v in sorted(lanes.items())}
    if len(samples):
        work = np.array([s.work for s in samples], dtype=float)
        cut = np.quantile(work, 1.0 - EXPENSIVE_FRACTION)
        exp = work > cut if np.any(work > cut) else work >= cut
        out["ttft_by_class_s"] = {
            "cheap": short_pct(pct(ttft[~exp])),
            "expensive": short_pct(pct(ttft[exp])),
        }
    else:
        out["ttft_by_class_s"] = {"cheap": short_pct(pct([])), "expensive": short_pct(pct([]))}
    prompt = sum(s.prompt_tokens for s in samples)
    cached = sum(s.cached_tokens for s in samples)
    out["cache_hit_ratio"] = cached / prompt if prompt else 0.0
    out["e2e_s"] = pct([s.e2e_s for s in samples if s.e2e_s is not None])
    out["tpot_s"] = pct([(s.e2e_s - s.ttft_s) / (s.output_tokens - 1) for s in samples
                         if s.e2e_s is not None and s.output_tokens > 1])
    return out


def served_rate(start_s: Sequence[float], finish_s: Sequence[float]) -> float:
    """Finished requests per second from the first arrival (``start_s``) to the last finish:
    the rate a run delivered. In a fixed-concurrency loop the offered rate follows it, so two
    policies' latencies compare only at their served rates (docs/benchmarks.md, 2.3). 0 for no
    request or an empty span. O(n)."""
    if not len(finish_s):
        return 0.0
    span = max(finish_s) - min(start_s)
    return len(finish_s) / span if span > 0 else 0.0


def realized_rate(send_times_s: Sequence[float]) -> float:
    """Requests per second between the first and the last send: ``(n - 1) / span`` (0 if the
    span is empty), as ``sim run`` computes it over arrivals."""
    if len(send_times_s) < 2:
        return 0.0
    first, last = min(send_times_s), max(send_times_s)
    return (len(send_times_s) - 1) / (last - first) if last > first else 0.0
