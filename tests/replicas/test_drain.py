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
    """A half-life of 1 busy second: the first 1 s at rate 0.1 weighs half as much after 1 s more
    at rate 1.0, so the rate is (0.05 + 1 + 1) / (0.5 + 1 + 1) = 0.82 with the prior."""
    d = DrainRate(half_life_s=1.0, prior=1.0, prior_weight_s=1.0)
    d.observe(0.0, busy=True)
    d.took(1.0, 0.1)
    d.took(2.0, 1.0)
    assert d.rate() == pytest.approx((0.05 + 1.0 + 1.0) / (0.5 + 1.0 + 1.0))


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
