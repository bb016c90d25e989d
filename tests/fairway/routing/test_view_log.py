"""The shared view's log: exact exchanges between sources, a late joiner's replay, the ring's gap."""

from __future__ import annotations

import pytest

from fairway.routing.view_log import SourceGone, ViewLog


def test_each_source_gets_the_others_events_once_in_order():
    log = ViewLog()
    a = log.exchange("a", [("r", 1), ("r", 2)], after=0)
    assert (a.events, a.head, a.gap) == ([], 2, False)
    b = log.exchange("b", [("r", 10)], after=0)  # b joins: reads a's events, not its own
    assert (b.events, b.head) == ([("r", 1), ("r", 2)], 3)
    a = log.exchange("a", [("f", 1)], after=a.head)
    assert (a.events, a.head) == ([("r", 10)], 4)
    b = log.exchange("b", [], after=b.head)
    assert (b.events, b.head) == ([("f", 1)], 4)
    assert log.exchange("b", [], after=4).events == []


def test_a_reader_that_fell_behind_the_ring_is_told_of_the_gap():
    log = ViewLog(capacity=3)
    log.exchange("a", [("r", i) for i in range(5)], after=0)  # seqs 1-5, the ring keeps 3-5
    late = log.exchange("b", [], after=1)
    assert late.gap and late.events == [("r", 2), ("r", 3), ("r", 4)] and late.head == 5
    assert not log.exchange("b", [], after=late.head).gap


def test_capacity_must_be_positive():
    with pytest.raises(ValueError):
        ViewLog(0)


def test_a_silent_source_is_announced_gone_once():
    log = ViewLog(ttl_s=5.0)
    log.exchange("a", [("r", 1)], after=0, now=0.0)
    b = log.exchange("b", [], after=0, now=3.0)
    assert b.events == [("r", 1)]
    b = log.exchange("b", [], after=b.head, now=9.0)  # a silent for 9 s > 5 s
    assert b.events == [SourceGone("a")]
    assert log.exchange("b", [], after=b.head, now=20.0).events == []  # announced once
    a = log.exchange("a", [], after=1, now=21.0)  # a comes back: it sees its own announcement too
    assert SourceGone("a") in a.events
