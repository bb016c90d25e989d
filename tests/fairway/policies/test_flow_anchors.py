"""The flow-control anchors: strict-priority FCFS and llm-d's band / round-robin flows / FCFS."""

from __future__ import annotations

from fairway.policies.base import QueuedRequest
from tests.factories import drain_order, policy_with_cache


def req(rid: int, arrival: float, klass: str = "", tenant: str = "", prompt: int = 64) -> QueuedRequest:
    return QueuedRequest(rid=rid, arrival_s=arrival, prompt_tokens=prompt, block_hashes=[], seq=rid,
                         priority_class=klass, tenant=tenant)


def test_priority_fcfs_is_tier_then_arrival():
    p, _ = policy_with_cache("priority-fcfs", set(), classes="hi:tier=0,lo:tier=1")
    for rid, t, k in [(0, 0.0, "lo"), (1, 1.0, "hi"), (2, 2.0, "lo"), (3, 3.0, "hi"), (4, 0.5, "")]:
        p.add(req(rid, t, k, prompt=64 + 100 * rid))  # size does not matter
    assert drain_order(p) == [1, 3, 0, 4, 2]  # "" is the default class, lo


def test_priority_fcfs_without_classes_is_fcfs():
    p, _ = policy_with_cache("priority-fcfs", set())
    for rid, t in [(0, 2.0), (1, 0.0), (2, 1.0)]:
        p.add(req(rid, t, "x"))
    assert drain_order(p) == [1, 2, 0]
    assert p.work_ahead_s("x") == 0.0  # empty now


def test_llmd_round_robin_between_flows_of_a_band_fcfs_within():
    p, _ = policy_with_cache("llmd-flow", set(), classes="hi:tier=0,lo:tier=1")
    for rid, t in [(0, 0.0), (1, 1.0), (2, 2.0)]:
        p.add(req(rid, t, "lo", "t1"))
    for rid, t in [(3, 3.0), (4, 4.0)]:
        p.add(req(rid, t, "lo", "t2"))
    p.add(req(5, 9.0, "hi", "t2"))
    assert drain_order(p) == [5, 0, 3, 1, 4, 2]


def test_llmd_flows_go_in_key_order_and_the_cursor_follows_the_last_admitted():
    p, _ = policy_with_cache("llmd-flow", set(), classes="only")
    p.add(req(0, 0.0, "", "b"))
    p.add(req(1, 1.0, "", "b"))
    p.add(req(2, 2.0, "", "a"))
    for rid in (2, 0):  # no cursor yet: the first key, "a"; then "b"
        assert p.select().rid == rid and p.admit(rid).rid == rid
    p.add(req(3, 3.0, "", "a"))
    p.add(req(4, 4.0, "", "c"))
    assert drain_order(p) == [4, 3, 1]  # after "b": "c", then around to "a", then "b"


def test_anchor_work_ahead_counts_its_tier_and_stricter_ones():
    from tests.factories import LinearCost
    p, _ = policy_with_cache("llmd-flow", set(), cost=LinearCost(per_token=1 / 1024, overhead=0.0),
                             classes="hi:tier=0,lo:tier=1")
    p.add(req(0, 0.0, "hi", prompt=256))
    p.add(req(1, 0.0, "lo", prompt=512))
    assert p.work_ahead_s("hi") == 0.25 and p.work_ahead_s("lo") == 0.75 and p.work_ahead_s("") == 0.75


def test_the_anchors_report_the_strictest_tier_waiting():
    """A gate serving several tenants' queues asks each for its strictest tier waiting."""
    for name in ("priority-fcfs", "llmd-flow"):
        p, _ = policy_with_cache(name, set(), classes="hi:tier=0,lo:tier=2")
        assert p.best_tier() == 0  # nothing waits
        p.add(req(0, 0.0, "lo"))
        assert p.best_tier() == 2
        p.add(req(1, 1.0, "hi"))
        assert p.best_tier() == 0
        p.remove(1)
        assert p.best_tier() == 2
