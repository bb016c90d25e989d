"""The gate's drain rate (replicas/drain.py): exact values on hand-made timelines."""

from __future__ import annotations

import math

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
    """A half-life of 1 busy second: the first 1 s at rate 0.1 weighs half as much after 1 s more
    at rate 1.0. The busy sum is the decayed integral over the 2 busy seconds, (1 - 1/4) / ln 2 =
    1.082 s, so the rate is (0.05 + 1 + 1) / (1.082 + 1) with the prior."""
    d = DrainRate(half_life_s=1.0, prior=1.0, prior_weight_s=1.0)
    d.observe(0.0, busy=True)
    d.took(1.0, 0.1)
    d.took(2.0, 1.0)
    assert d.rate() == pytest.approx((0.05 + 1.0 + 1.0) / (0.75 / math.log(2) + 1.0), rel=1e-12)


def test_the_rate_does_not_depend_on_how_often_it_is_observed():
    """The same timeline (busy 0-7 s with admissions at 2, 5 and 7 s, idle 7-9 s, busy 9-12 s with
    one at 11 s; both half-lives 5 s, so everything decays by wall time) read by a gate that looks
    only at those instants and by one that also looks every 10 ms: both read the hand-computed
    rate, the decayed work over the decayed integral of the busy spans, each with the prior.
    Before the busy sum was an integral, each look added its span undecayed: 0.587 and 0.657."""
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

    work = 1.0 * 2 ** -2 + 0.5 * 2 ** -1.4 + 2.0 * 2 ** -1 + 1.5 * 2 ** -0.2  # each decayed to 12 s
    busy = 5.0 / math.log(2) * ((2 ** -1 - 2 ** -2.4) + (1.0 - 2 ** -0.6))  # spans 0-7 s and 9-12 s
    expected = (work + 1.0) / (busy + 1.0)  # 0.658
    assert timeline(False) == pytest.approx(expected, rel=1e-9)
    assert timeline(True) == pytest.approx(expected, rel=1e-9)


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
