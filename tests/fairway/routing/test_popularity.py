"""Prefix shares (fairway/routing/popularity.py): rates since first sighting over all decisions."""

from __future__ import annotations

import pytest

from fairway.routing.popularity import PrefixShares


def test_prefix_shares_are_rates_since_first_sighting_relative_to_all_decisions():
    sh = PrefixShares(max_prefixes=2)
    for t in (0.0, 1.0):
        sh.observe(t)
    assert sh.share(7, 1.0) is None  # first sighting
    sh.observe(2.0)
    assert sh.share(7, 2.0) is None  # two sightings: one interval is not yet a rate
    sh.observe(3.0)
    # prefix 7: 2 intervals over 2 s = 1/s; all decisions: 3 intervals over 3 s = 1/s
    assert sh.share(7, 3.0) == pytest.approx(1.0)
    for t in (4.0, 5.0, 6.0):
        sh.observe(t)
    # no sighting of 7 at 4 and 5: 3 intervals over 5 s against 6 over 6 s
    assert sh.share(7, 6.0) == pytest.approx(0.6)
    sh.share(8, 6.0)
    sh.share(9, 6.0)  # a third prefix: the least recently seen (7) is forgotten
    assert len(sh) == 2
    assert sh.share(7, 6.5) is None  # counted again from scratch
    with pytest.raises(ValueError):
        PrefixShares(max_prefixes=0)
