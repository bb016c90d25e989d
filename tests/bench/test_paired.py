"""The paired comparison (``bench/paired.py``): the bootstrap on hand-made samples whose answer
is known, the pairing's refusal of unequal runs, and one real pair of simulator runs."""

from __future__ import annotations

import numpy as np
import pytest

from bench.paired import main, pair, paired_ratios, ttfts
from bench.yardstick import Point, Run, run_one


def by_figure(rows):
    return {r.figure: r for r in rows}


def test_identical_runs_give_a_ratio_of_one_with_no_spread():
    x = np.random.default_rng(1).exponential(1.0, 500)
    rows = by_figure(paired_ratios(x, x.copy(), np.random.default_rng(0), boot=300))
    for r in rows.values():
        assert (r.ratio, r.low, r.high, r.above) == (1.0, 1.0, 1.0, 0.0)


def test_a_uniform_slowdown_is_the_same_ratio_in_every_draw():
    x = np.random.default_rng(2).exponential(1.0, 400)
    rows = by_figure(paired_ratios(x, 1.5 * x, np.random.default_rng(0), boot=300, threshold=1.05))
    for r in rows.values():
        assert r.ratio == pytest.approx(1.5) and r.low == pytest.approx(1.5) and r.high == pytest.approx(1.5)
        assert r.above == 1.0


def test_one_request_crossing_the_p99_moves_it_far_and_the_interval_reaches_down_to_one():
    # 1,000 requests, the slowest ten far above the rest (4-5 s against at most 1 s): the p99 is
    # the foot of that gap. One fast request made slow (5 s) lifts the p99 across the gap; a draw
    # without that request (about 37% of them) sees no change, so the interval starts at 1, and
    # in a draw that already holds eleven of the slow requests the p99 is above the gap anyway
    x = np.concatenate([np.linspace(0.01, 1.0, 990), np.linspace(4.0, 5.0, 10)])
    y = x.copy()
    y[500] = 5.0
    rows = by_figure(paired_ratios(x, y, np.random.default_rng(0), boot=2000, level=0.9))
    assert rows["p50"].ratio == pytest.approx(1.0, abs=2e-3) and rows["p50"].high < 1.01
    assert rows["p99"].ratio > 3.0 and rows["p99"].low == 1.0 and rows["p99"].high > 3.0
    assert 0.1 < rows["p99"].above < 0.5
    assert rows["mean"].ratio == pytest.approx(y.sum() / x.sum())


def test_the_draws_are_the_injected_rngs():
    x = np.random.default_rng(3).exponential(1.0, 300)
    y = x * np.random.default_rng(4).uniform(0.8, 1.3, 300)
    a = paired_ratios(x, y, np.random.default_rng(7), boot=500)
    assert a == paired_ratios(x, y, np.random.default_rng(7), boot=500)
    assert a != paired_ratios(x, y, np.random.default_rng(8), boot=500)


def test_runs_that_finished_different_requests_are_refused_by_name():
    with pytest.raises(ValueError, match=r"1 differ, e.g. \[3\]"):
        pair({1: 0.1, 2: 0.2}, {1: 0.1, 2: 0.2, 3: 0.3})
    xb, xc = pair({2: 0.2, 1: 0.1}, {1: 0.5, 2: 0.7})
    assert xb.tolist() == [0.1, 0.2] and xc.tolist() == [0.5, 0.7]  # aligned by request id
    with pytest.raises(ValueError, match="equal-length"):
        paired_ratios(np.ones(3), np.ones(4), np.random.default_rng(0))
    with pytest.raises(ValueError, match="boot"):
        paired_ratios(np.ones(3), np.ones(3), np.random.default_rng(0), boot=0)


def test_one_real_pair_of_runs_matches_the_yardsticks_figures():
    p = Point("rag", "rag", 4, 20)
    a, b = Run(p, "round-robin", "approx", 0, replicas=2), Run(p, "fairway", "approx", 0, replicas=2)
    xa, xb = pair(ttfts(a), ttfts(b))
    plain = run_one(a), run_one(b)
    assert xa.size == plain[0]["n_finished"] > 0
    rows = by_figure(paired_ratios(xa, xb, np.random.default_rng(0), boot=200))
    for f in ("p50", "p99", "mean"):
        assert rows[f].base == pytest.approx(plain[0]["ttft_s"][f])
        assert rows[f].candidate == pytest.approx(plain[1]["ttft_s"][f])
        assert rows[f].low <= rows[f].ratio <= rows[f].high or rows[f].low == rows[f].high


def test_the_command_refuses_an_unknown_point_or_router(capsys):
    with pytest.raises(SystemExit):
        main(["--point", "no-such-point", "--candidate", "fairway"])
    assert "unknown point 'no-such-point'; known: " in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--point", "agentic @2", "--candidate", "no-such-router"])
    assert "not a router spec this build can make: no-such-router" in capsys.readouterr().err
