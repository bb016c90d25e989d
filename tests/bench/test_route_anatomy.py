"""The route anatomy (``bench/route_anatomy.py``): the decision classes, the bursts' table on
hand-made placements, and one real run that the instrumentation leaves exactly as it was."""

from __future__ import annotations

import pytest

from bench.route_anatomy import CLASSES, Anatomy, anatomy, classify, main, render
from bench.yardstick import Point, Run, run_one


def test_a_decision_is_cold_on_the_holder_or_away_by_the_engines_true_matches():
    assert classify([0, 0, 0], 1) == "cold"
    assert classify([10, 0], 0) == "holder"
    assert classify([10, 9], 1) == "holder"  # within NEAR (0.9) of the longest match
    assert classify([10, 8], 1) == "away"
    assert classify([0, 8], 0) == "away"


def test_one_real_run_is_classed_whole_and_unchanged_by_the_instrumentation():
    p = Point("rag", "rag", 4, 20)
    blind, fairway = Run(p, "round-robin", "approx", 0, replicas=2), Run(p, "fairway", "approx", 0, replicas=2)
    a, b = anatomy(blind), anatomy(fairway)
    plain = run_one(blind)
    assert sum(a.counts.values()) == len(a.ttft) == len(a.placed) == plain["n_finished"] > 0
    assert {pick for _, pick, _, _ in a.placed} == {0, 1}  # round-robin: both replicas
    assert a.hit == pytest.approx(plain["hit"]) and a.quantiles()["p50"] == pytest.approx(plain["ttft_s"]["p50"])
    # a cache-blind router leaves the holder and recomputes; the Fairway router keeps more on it
    assert a.counts["away"] > 0 and a.recomputed_blocks["away"] > 0
    assert a.recomputed_blocks["cold"] == 0  # nothing to recompute where nothing was cached
    assert b.counts["away"] < a.counts["away"] and b.hit > a.hit
    assert 0 <= a.over_promised <= sum(a.counts.values()) and (a.over_blocks > 0) == (a.over_promised > 0)
    text = render("rag @4", {"fairway": [b], "round-robin": [a]})
    assert "| fairway | " in text and "| round-robin | " in text and "fairway / round-robin" in text
    assert f"| {b.over_promised} ({b.over_blocks:,}) |" in text
    assert all(c in text for c in CLASSES)


def test_an_unknown_point_is_refused_with_the_known_ones(capsys):
    with pytest.raises(SystemExit):
        main(["--point", "nowhere @1"])
    assert "known:" in capsys.readouterr().err


def test_the_bursts_table_finds_the_cheap_requests_placed_with_a_heavy_one_of_their_burst():
    a = Anatomy()
    assert a.bursts() is None  # nothing placed
    a.placed = [(0.0, 0, 100, 0.3), (0.0, 0, 5000, 0.6),  # a cheap and a heavy one together at t=0 on 0
                (0.0, 1, 200, 0.1), (0.0, 1, 2000, 0.2),  # a cheap and a middling one on 1
                (3.0, 0, 300, 0.12), (3.0, 1, 4096, 0.7),  # the next burst: apart
                (6.0, 1, 50, 0.25), (6.0, 1, 8000, 0.9)]  # together again
    assert a.bursts() == {"cheap": 4, "with_heavy": 0.5, "p50_with": pytest.approx(0.275), "p50_alone": 0.11,
                          "p50_cheap": pytest.approx(0.185), "heavy": 3, "p50_heavy": 0.7}
    a.placed = [(0.0, 0, 100, 0.3), (1.0, 0, 5000, 0.6)]  # no two at one instant: not bursty
    assert a.bursts() is None
