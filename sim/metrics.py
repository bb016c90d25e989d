"""Summaries of a simulation run: the JSON schema shared by ``sim run`` and ``loadgen run``.

Stats are computed from the request records only (no exporter here, STYLE.md #15).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from sim.engine import EngineRequest

EXPENSIVE_FRACTION = 0.10  # top 10% of requests by uncached work at arrival


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


def _short(d: dict[str, float]) -> dict[str, float]:
    return {"p50": d["p50"], "p99": d["p99"], "n": d["n"]}


def summarize(finished: Sequence[EngineRequest]) -> dict[str, Any]:
    """TTFT overall, per lane and per class, queue wait, and the cache hit ratio."""
    ttft = np.array([r.ttft_s for r in finished], dtype=float)
    wait = np.array([r.admitted_s - r.spec.arrival_s for r in finished], dtype=float)
    out: dict[str, Any] = {"ttft_s": pct(ttft), "queue_wait_s": pct(wait)}
    lanes: dict[str, list[float]] = {}
    for r in finished:
        if r.lane:
            lanes.setdefault(r.lane, []).append(r.ttft_s)
    out["ttft_by_lane_s"] = {k: _short(pct(v)) for k, v in sorted(lanes.items())}
    if len(finished):
        work = np.array([r.est_prefill_at_arrival_s for r in finished])
        cut = np.quantile(work, 1.0 - EXPENSIVE_FRACTION)
        exp = work > cut if np.any(work > cut) else work >= cut
        out["ttft_by_class_s"] = {
            "cheap": _short(pct(ttft[~exp])),
            "expensive": _short(pct(ttft[exp])),
        }
    else:
        out["ttft_by_class_s"] = {"cheap": _short(pct([])), "expensive": _short(pct([]))}
    prompt = sum(r.spec.prompt_tokens for r in finished)
    cached = sum(max(0, r.cached_tokens) for r in finished)
    out["cache_hit_ratio"] = cached / prompt if prompt else 0.0
    out["preempted_requests"] = sum(1 for r in finished if r.preemptions)
    return out
