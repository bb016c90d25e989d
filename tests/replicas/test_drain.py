"""The gate's drain rate (replicas/drain.py): exact values on hand-made timelines."""

from __future__ import annotations

import pytest

from replicas.drain import DrainRate


def test_prior_until_measured():
    d = DrainRate(prior=1.0, prior_weight_s=1.0)
    assert d.rate() == 1.0 and d.wait_s(3.0) == 3.0


def test_rate_counts_only_busy_time():
    """Idle time (nothing waiting) is not the engine's pace: 2 s of work over 4 busy seconds, with
    an idle gap of 100 s in between, is (2 + 1) / (4 + 1) with the prior, before decay."""
    d = DrainRate(half_life_s=1e9, prior=1.0, prior_weight_s=1.0, idle_half_life_s=1e9)
    d.observe(0.0, busy=True)
    d.took(2.0, 1.0)
    d.observe(2.0, busy=False)
    d.took(50.0, 5.0)  # admitted with nothing waiting: not counted
    d.observe(102.0, busy=True)
    d.took(104.0, 1.0)
    assert d.rate() == pytest.approx(3.0 / 5.0, rel=1e-6)
    assert d.wait_s(1.2) == pytest.approx(2.0, rel=1e-6)


def test_old_measures_decay_with_busy_time():
    """A half-life of 1 busy second: the first interval (1 s, 0.1 s of work) weighs half as much
    once the second (1 s, 1.0 s of work) closes, so the rate is (0.05 + 1 + 1) / (0.5 + 1 + 1)
    with the prior."""
    d = DrainRate(half_life_s=1.0, prior=1.0, prior_weight_s=1.0)
    d.observe(0.0, busy=True)
    d.took(1.0, 0.1)
    d.took(2.0, 1.0)
    assert d.rate() == pytest.approx((0.05 + 1.0 + 1.0) / (0.5 + 1.0 + 1.0), rel=1e-12)


def test_the_rate_does_not_depend_on_how_often_it_is_observed():
    """The same timeline (busy 0-7 s with admissions at 2, 5 and 7 s, idle 7-9 s, busy 9-12 s with
    one at 11 s; both half-lives 5 s) read by a gate that looks only at those instants and by one
    that also looks every 10 ms: both read the hand-computed rate. Each interval closes at its
    admission, the older ones decayed by its busy seconds; the idle spell decays everything by
    wall time; the interval open at 12 s (1 s) is shorter than the mean closed one, so it does not
    count yet."""
    def timeline(extra_looks: bool) -> float:
        d = DrainRate(half_life_s=5.0, prior=1.0, prior_weight_s=1.0, idle_half_life_s=5.0)
        marks = {0.0: ("busy", 0.0), 2.0: ("took", 1.0), 5.0: ("took", 0.5), 7.0: ("idle", 2.0),
                 9.0: ("busy", 0.0), 11.0: ("took", 1.5), 12.0: ("end", 0.0)}
        busy = False
        for step in range(1201):
            t = step / 100
            mark = marks.get(t)
            if mark is None:
                if extra_looks:
                    d.observe(t, busy)
                continue
            kind, work = mark
            if kind == "took":
                d.took(t, work)
            elif kind == "idle":
                d.took(t, work)
                busy = False
            elif kind == "busy":
                busy = True
            d.observe(t, busy)
        return d.rate()

    sums = [1.0, 2.0, 1.0]  # work, busy seconds and count of the closed intervals: 0-2 s

    def decay(keep: float) -> None:
        sums[:] = [x * keep for x in sums]

    for open_s, idle_before_s, took in ((3.0, 0.0, 0.5), (2.0, 0.0, 2.0), (2.0, 2.0, 1.5)):
        decay(2 ** (-idle_before_s / 5.0))  # 7-9 s idle, by wall time
        decay(2 ** (-open_s / 5.0))  # the older intervals, by the closing one's busy seconds
        sums[0] += took
        sums[1] += open_s
        sums[2] += 1.0
    work, busy, count = sums
    assert 1.0 < busy / count  # the open second is not overdue
    expected = (work + 1.0) / (busy + 1.0)
    assert timeline(False) == pytest.approx(expected, rel=1e-9)
    assert timeline(True) == pytest.approx(expected, rel=1e-9)


def test_a_steady_pace_reads_the_same_between_lumps():
    """One admission of 2 s of work every 10 busy seconds (a pace of 0.2; half-life 5 s, so each
    older interval keeps a quarter): after 12 intervals the rate is the steady (W + 1) / (B + 1)
    with the prior (0.256), the same just after an admission and just before the next. A busy sum
    decayed over each span instead read 0.446 just after each admission and 0.203 before the next."""
    d = DrainRate(half_life_s=5.0, prior=1.0, prior_weight_s=1.0)
    d.observe(0.0, busy=True)
    for i in range(1, 13):
        d.took(10.0 * i, 2.0)
    after = d.rate()
    d.observe(129.99, busy=True)
    before = d.rate()
    q = 0.25
    w, b = 2.0 * (1 - q ** 12) / (1 - q), 10.0 * (1 - q ** 12) / (1 - q)
    assert after == pytest.approx((w + 1.0) / (b + 1.0), rel=1e-12)
    assert before == after


def test_an_overdue_interval_counts_beyond_the_mean_one():
    """Three requests admitted at one instant close one interval (2 s), not three: the mean closed
    interval stays 2 s. Busy 5 s more with no admission, 3 s of it past the mean: the rate is
    (3 + 1) / (2 + 1 + 3)."""
    d = DrainRate(half_life_s=1e9, prior=1.0, prior_weight_s=1.0)
    d.observe(0.0, busy=True)
    for _ in range(3):
        d.took(2.0, 1.0)
    assert d.rate() == pytest.approx(4.0 / 3.0)
    d.observe(3.5, busy=True)
    assert d.rate() == pytest.approx(4.0 / 3.0)  # 1.5 s open: not yet due
    d.observe(7.0, busy=True)
    assert d.rate() == pytest.approx(4.0 / 6.0)


def test_an_idle_spell_returns_the_rate_to_the_prior():
    """4 busy seconds at 0.25 (1 s of work) give (1 + 1) / (4 + 1) = 0.4; 10 idle seconds at an
    idle half-life of 5 s keep a quarter of both sums: (0.25 + 1) / (1 + 1) = 0.625; busy time
    decays by its own half-life only."""
    d = DrainRate(half_life_s=1e9, prior=1.0, prior_weight_s=1.0, idle_half_life_s=5.0)
    d.observe(0.0, busy=True)
    d.took(4.0, 1.0)
    d.observe(4.0, busy=False)
    assert d.rate() == pytest.approx(2.0 / 5.0)
    d.observe(14.0, busy=False)
    assert d.rate() == pytest.approx((0.25 + 1.0) / (1.0 + 1.0))
    d.observe(1e6, busy=True)  # a long idle spell: the prior alone
    assert d.rate() == pytest.approx(1.0)
    with pytest.raises(ValueError):
        DrainRate(idle_half_life_s=0.0)


def test_floor_and_validation():
    d = DrainRate(prior=1.0, prior_weight_s=0.001, floor=0.05)
    d.observe(0.0, busy=True)
    d.observe(1000.0, busy=True)  # busy for long, nothing finished: a stuck engine
    assert d.rate() == 0.05
    with pytest.raises(ValueError):
        DrainRate(half_life_s=0.0)
