"""Summaries of a simulation run: the JSON schema shared by ``sim run`` and ``loadgen run``.

The shared part lives in ``fairway.summary`` (one function over plain per-request records, used
by both hosts); this module turns engine records into those samples and adds what only the
simulator knows. Stats are computed from the request records only (no exporter here:
docs/design.md, Metrics).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from fairway.engine.model import EngineRequest
from fairway.summary import EXPENSIVE_FRACTION, RequestSample, pct, summarize_samples

__all__ = ["EXPENSIVE_FRACTION", "pct", "sample_of", "summarize"]


def sample_of(r: EngineRequest) -> RequestSample:
    """A finished engine request as the shared summary sees it (work = estimated prefill
    seconds at arrival)."""
    return RequestSample(
        ttft_s=r.ttft_s,
        queue_wait_s=r.admitted_s - r.spec.arrival_s,
        lane=r.lane,
        prompt_tokens=r.spec.prompt_tokens,
        cached_tokens=max(0, r.cached_tokens),
        work=r.est_prefill_at_arrival_s,
        e2e_s=r.finished_s - r.spec.arrival_s,
        output_tokens=r.generated,
    )


def summarize(finished: Sequence[EngineRequest]) -> dict[str, Any]:
    """TTFT overall, per lane and per class, queue wait, the cache hit ratio, and how many
    requests were preempted."""
    out = summarize_samples([sample_of(r) for r in finished])
    out["preempted_requests"] = sum(1 for r in finished if r.preemptions)
    return out
