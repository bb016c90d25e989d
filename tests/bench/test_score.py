"""bench.score's issue-22 target ratios, on hand-made rows (no simulation)."""

from __future__ import annotations

import pytest

from bench.score import target_ratios


def cell(p99: float, mean: float, served: float) -> dict:
    return {"p50": 0.1, "p99": p99, "mean": mean, "served_rps": served, "e2e_p99": 3 * p99}


def test_open_loop_compares_with_the_better_simple_policy_only():
    row = {"fcfs": cell(20.0, 6.0, 1.0), "lpm": cell(60.0, 2.0, 3.5), "fairway": cell(50.0, 1.5, 3.6)}
    t = target_ratios(row, "fairway", closed_loop=False)
    assert t == {"p99": pytest.approx(50.0 / 20.0), "mean": pytest.approx(1.5 / 2.0)}


def test_closed_loop_also_compares_with_the_policies_serving_its_rate():
    # fcfs serves under 0.9x fairway's rate: out of the second comparison; lpm (3.5 >= 0.9 x 3.6) in
    row = {"fcfs": cell(20.0, 6.0, 1.0), "lpm": cell(60.0, 2.0, 3.5), "fairway": cell(50.0, 1.5, 3.6)}
    t = target_ratios(row, "fairway", closed_loop=True)
    assert t["p99"] == pytest.approx(2.5) and t["peers"] == ["lpm"]
    assert t["p99_at_rate"] == pytest.approx(50.0 / 60.0) and t["mean_at_rate"] == pytest.approx(0.75)


def test_closed_loop_with_no_simple_policy_at_its_rate_says_so():
    row = {"fcfs": cell(20.0, 6.0, 1.0), "lpm": cell(60.0, 2.0, 2.0), "fairway": cell(50.0, 1.5, 3.6)}
    t = target_ratios(row, "fairway", closed_loop=True)
    assert t["peers"] == [] and t["p99_at_rate"] is None and t["mean_at_rate"] is None
