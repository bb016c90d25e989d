"""The load view (fairway/load_view.py): the routed / started / finished lifecycle, the waiting
work and its capacity, the started prefills' ends, the routed window, reported speed, staleness,
the per-class queues and the class view they give a request."""

from __future__ import annotations

import numpy as np
import pytest

from fairway.load_view import ROUTED_WINDOW
from fairway.policies.classes import ClassesConfig
from fairway.routing import make_states
from fairway.routing.base import ClassView
from tests.fairway.routing.helpers import view


def test_load_view_lifecycle():
    lv, _ = view()
    assert lv.on_routed(1, 0, prompt_tokens=1000, cached_tokens=800) == pytest.approx(0.21)
    assert lv.on_routed(2, 0, prompt_tokens=100) == pytest.approx(0.11)
    lv.on_routed(3, 1, prompt_tokens=160, cached_tokens=160)  # capped at 159 cached: 1 token to compute
    s = lv.snapshot()
    assert s.queued_prefill_s == pytest.approx((0.32, 0.011))
    assert s.queued_prefill_tokens == (300, 1)
    assert s.outstanding == (2, 1)
    assert s.running == (0, 0)
    assert s.active_blocks == (63 + 7, 10)
    lv.on_started(1)
    lv.on_started(1)  # idempotent
    s = lv.snapshot()
    assert s.queued_prefill_s == pytest.approx((0.11, 0.011))
    assert (s.outstanding, s.running, s.waiting) == ((2, 1), (1, 0), (1, 1))
    lv.on_finished(2)  # rejected before it started: leaves Q too
    lv.on_finished(1)
    s = lv.snapshot()
    assert s.queued_prefill_s[0] == 0.0
    assert (s.outstanding[0], s.running[0], s.active_blocks[0], s.queued_prefill_tokens[0]) == (0, 0, 0, 0)
    assert 3 in lv and 1 not in lv
    with pytest.raises(KeyError):
        lv.on_finished(1)
    with pytest.raises(KeyError):
        lv.on_routed(3, 0, 10)


def test_load_view_carries_each_replicas_reported_speed():
    lv, _ = view(2)
    assert lv.snapshot().speed == (1.0, 1.0)
    lv.report_speed(1, 0.25)
    assert lv.snapshot().speed == (1.0, 0.25)
    for bad in (0.0, -1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError):
            lv.report_speed(0, bad)


def test_load_view_queue_resets_to_exact_zero():
    lv, _ = view(1)
    for rid, p in enumerate((0.1, 0.2, 0.3, 0.7)):
        lv.on_routed(rid, 0, 100, prefill_s=p)
    for rid in (2, 0, 3):
        lv.on_started(rid)
    assert lv.snapshot().queued_prefill_s[0] == pytest.approx(0.2)
    lv.on_started(1)
    assert lv.snapshot().queued_prefill_s[0] == 0.0


def test_load_view_preemption_requeues_the_work():
    lv, _ = view(1)
    lv.on_routed(1, 0, prompt_tokens=1000)
    lv.on_started(1)
    lv.on_preempted(1, cached_tokens=480, prompt_tokens=1040)
    s = lv.snapshot()
    assert s.queued_prefill_s[0] == pytest.approx(0.01 + 0.56)
    assert (s.running[0], s.queued_prefill_tokens[0], s.outstanding[0]) == (0, 560, 1)


def test_load_view_lists_the_waiting_work_sorted_and_the_capacity():
    lv, _ = view(2)
    for rid, p in ((1, 0.5), (2, 0.1), (3, 0.3), (4, 0.1)):
        lv.on_routed(rid, 0, 100, prefill_s=p)
    lv.on_routed(5, 1, 100, prefill_s=0.2)
    assert lv.snapshot().queued_prefills == ((0.1, 0.1, 0.3, 0.5), (0.2,))
    lv.on_started(4)  # one of two equal estimates leaves: the other stays
    lv.on_finished(3)  # cancelled before it started
    assert lv.snapshot().queued_prefills == ((0.1, 0.5), (0.2,))
    lv.on_preempted(4, cached_tokens=0, prompt_tokens=100)  # back in the queue, re-priced: 0.11
    qp = lv.snapshot().queued_prefills
    assert qp[0] == pytest.approx((0.1, 0.11, 0.5)) and qp[1] == (0.2,)
    assert lv.snapshot().max_running == (0, 0)
    lv.report_max_running(1, 256)
    snap = lv.snapshot()
    assert snap.max_running == (0, 256)
    assert make_states(snap, [0, 0], [0, 0])[1].max_running == 256
    with pytest.raises(ValueError):
        lv.report_max_running(0, -1)


def test_load_view_lists_the_started_prefills_until_their_estimated_end():
    lv, clock = view(2)
    for rid, p in ((1, 0.5), (2, 0.2), (3, 0.4)):
        lv.on_routed(rid, 0, 100, prefill_s=p)
    lv.on_routed(4, 1, 100, prefill_s=1.0)
    clock.set(1.0)
    lv.on_started(1)  # ends at 1.5
    lv.on_started(2, started_at=0.9)  # the host learned of it late: ends at 1.1
    lv.on_started(4, started_at=5.0)  # never later than now: ends at 2.0
    assert lv.snapshot().prefill_ends == ((1.5, pytest.approx(1.1)), (2.0,))
    clock.set(1.2)
    lv.on_started(3)  # ends at 1.6
    snap = lv.snapshot()
    assert snap.prefill_ends == ((1.5, 1.6), (2.0,))  # 1.1 has passed: decoding
    assert make_states(snap, [0, 0], [0, 0])[0].prefill_ends == (1.5, 1.6)
    lv.on_finished(1)  # finished (or cancelled) early
    lv.on_preempted(4, cached_tokens=0, prompt_tokens=100)  # back in the queue
    assert lv.snapshot().prefill_ends == ((1.6,), ())
    lv.on_started(4)  # restarted at 1.2, re-priced at 0.11 s: ends at 1.31
    lv.on_prefill_done(4)  # a host that saw its first token says so: gone before its estimate
    lv.on_prefill_done(99)  # unknown (already finished): ignored
    assert lv.snapshot().prefill_ends == ((1.6,), ())
    clock.set(1.6)
    lv.on_routed(5, 1, 100, prefill_s=0.1)
    assert lv.snapshot().prefill_ends == ((), ())


def test_load_view_keeps_a_window_of_the_work_routed_lately():
    lv, clock = view(2)
    lv.on_routed(1, 0, 100, prefill_s=0.5)
    assert lv.snapshot().routed_windows == ((0.0, ()), (0.0, ()))  # one arrival: no rate yet
    clock.set(1.0)
    lv.on_routed(2, 0, 100, prefill_s=0.9)
    clock.set(2.0)
    lv.on_routed(3, 0, 100, prefill_s=0.3)
    lv.on_finished(2)  # finishing does not leave the window: it is the arrival rate
    snap = lv.snapshot()
    assert snap.routed_windows[0] == (0.0, (0.3, 0.9))
    s0 = make_states(snap, [0, 0], [0, 0])[0]
    assert (s0.routed_since, s0.routed_prefills) == (0.0, (0.3, 0.9))
    # bounded: the last ROUTED_WINDOW arrivals, the oldest of them marking the window's start
    for i in range(ROUTED_WINDOW + 2):
        clock.set(10.0 + i)
        lv.on_routed(100 + i, 1, 100, prefill_s=i / 100)
    t0, ps = lv.snapshot().routed_windows[1]
    assert t0 == 12.0 and ps == pytest.approx(tuple(i / 100 for i in range(3, ROUTED_WINDOW + 2)))


def test_snapshot_columns_kept_in_order_equal_a_rebuild_from_the_requests_after_random_operations():
    """The waiting estimates (whole queue and per class) and the routed window are kept sorted as
    requests come and go, not re-sorted per snapshot: after random routings (with equal prices),
    starts, preemptions and finishes they equal a plain rebuild from the live requests."""
    rng = np.random.default_rng(7)
    lv, clock = view(3)
    live: dict[int, tuple[int, float, str, bool]] = {}  # rid -> replica, P, class, started
    routed: list[list[tuple[float, float]]] = [[], [], []]  # per replica: (time, P) in routing order
    for rid in range(600):
        clock.set(rid * 0.1)
        op = rng.random()
        if op < 0.5 or not live:
            j, p, k = int(rng.integers(3)), float(rng.choice([0.1, 0.2, 0.2, 0.5, rng.random()])), ""
            k = str(rng.choice(["", "a", "b"]))
            lv.on_routed(rid, j, 100, prefill_s=p, klass=k)
            live[rid] = (j, p, k, False)
            routed[j].append((clock.now(), p))
        else:
            r = int(rng.choice(sorted(live)))
            j, p, k, started = live[r]
            if op < 0.7 and not started:
                lv.on_started(r)
                live[r] = (j, p, k, True)
            elif op < 0.8 and started:
                lv.on_preempted(r, prompt_tokens=100)
                live[r] = (j, lv.cost.prefill_time(100, 0), k, False)
            else:
                lv.on_finished(r)
                del live[r]
        snap = lv.snapshot()
        for j in range(3):
            waiting = [(p, k) for (jj, p, k, started) in live.values() if jj == j and not started]
            assert snap.queued_prefills[j] == tuple(sorted(p for p, _ in waiting))
            want = {k: tuple(sorted(p for p, kk in waiting if kk == k)) for k in ("a", "b")}
            assert {k: v[1] for k, v in snap.class_queues[j].items()} == {k: v for k, v in want.items() if v}
            w = routed[j][-ROUTED_WINDOW:]
            if len(w) >= 2:
                assert snap.routed_windows[j] == (w[0][0], tuple(sorted(p for _, p in w[1:])))


def test_load_view_staleness():
    lv, clock = view(2, stale_s=10.0)
    first = lv.snapshot()
    lv.on_routed(1, 0, 100)
    lv.report_kv_usage(1, 0.5)
    clock.set(9.99)
    assert lv.snapshot() is first
    assert lv.live().outstanding == (1, 0)
    clock.set(10.0)
    s = lv.snapshot()
    assert s.taken_s == 10.0 and s.outstanding == (1, 0) and s.kv_usage == (0.0, 0.5)
    lv.on_finished(1)
    clock.set(19.0)
    assert lv.snapshot() is s
    live, clock = view(1, stale_s=0.0)
    a = live.snapshot()
    assert live.snapshot() is a  # nothing changed: the same snapshot
    live.on_routed(1, 0, 100)
    assert live.snapshot().outstanding == (1,)
    with pytest.raises(ValueError):
        live.report_kv_usage(0, 1.5)
    with pytest.raises(ValueError):
        view(1, stale_s=-1.0)


def test_load_view_queues_classed_requests_per_class():
    lv, _ = view(2)
    for rid, p, k in ((1, 0.5, "batch"), (2, 0.1, "interactive"), (3, 0.3, "batch"), (4, 0.2, "")):
        lv.on_routed(rid, 0, 100, prefill_s=p, klass=k)
    lv.on_routed(5, 1, 100, prefill_s=0.4, klass="interactive")
    s = lv.snapshot()
    assert s.class_queues[0] == {"batch": (pytest.approx(0.8), (0.3, 0.5)), "interactive": (0.1, (0.1,))}
    assert s.class_queues[1] == {"interactive": (0.4, (0.4,))}
    assert s.queued_prefills[0] == (0.1, 0.2, 0.3, 0.5)  # the whole queue, unclassed request included
    lv.on_started(3)
    lv.on_finished(2)  # cancelled while waiting: its class's queue empties
    assert lv.snapshot().class_queues[0] == {"batch": (0.5, (0.5,))}
    lv.on_preempted(3, cached_tokens=0, prompt_tokens=100)  # back in its class's queue, re-priced
    assert lv.snapshot().class_queues[0] == {"batch": (pytest.approx(0.61), (0.11, 0.5))}
    for rid in (1, 3):
        lv.on_started(rid)
    assert lv.snapshot().class_queues[0] == {}


def test_make_states_gives_a_classed_request_its_class_queue_and_the_work_ahead_of_it():
    classes = ClassesConfig.parse("interactive:tier=0,gold:tier=1:weight=3,batch:tier=1:weight=1,bulk:tier=2")
    lv, _ = view(1)
    for rid, p, k in ((1, 0.4, "interactive"), (2, 0.6, "gold"), (3, 0.9, "batch"), (4, 0.2, "batch"),
                      (5, 5.0, "bulk")):
        lv.on_routed(rid, 0, 100, prefill_s=p, klass=k)
    snap = lv.snapshot()

    def state(k: str):
        return make_states(snap, [0], [0], klass=k, classes=classes)[0]

    assert state("interactive").class_view == ClassView(0.4, (0.4,), 0.0)  # tier 0: nothing ahead of its class
    # batch: tier 0 whole, and gold's share while batch's 1.1 s drain: min(0.6, 1.1 * 3)
    v = state("batch").class_view
    assert (v.queued_s, v.queued, v.ahead_s) == (pytest.approx(1.1), (0.2, 0.9), pytest.approx(0.4 + 0.6))
    assert state("gold").class_view.ahead_s == pytest.approx(0.4 + 0.2)  # batch's share: min(1.1, 0.6 / 3)
    assert state("bulk").class_view.ahead_s == pytest.approx(0.4 + 0.6 + 1.1)
    assert state("bulk").queued_prefill_s == pytest.approx(7.1)  # the whole queue stays beside it
    assert make_states(snap, [0], [0])[0].class_view is None  # no class: no class view


def test_make_states_puts_every_snapshot_column_in_its_named_field():
    """make_states builds the states positionally (for speed): a distinct value per column, per
    replica, must land in the field of the same name."""
    from dataclasses import fields

    from fairway.load_view import LoadSnapshot

    cols = {f.name: (f"{f.name}-0", f"{f.name}-1") for f in fields(LoadSnapshot) if f.name not in
            ("taken_s", "routed_windows", "class_queues")}
    snap = LoadSnapshot(taken_s=0.0, routed_windows=((0.5, ("w0",)), (1.5, ("w1",))), **cols)  # type: ignore[arg-type]
    states = make_states(snap, ["m0", "m1"], ["i0", "i1"], host=["h0", "h1"], new=["n0", "n1"])  # type: ignore[list-item]
    for j, s in enumerate(states):
        assert s.replica == j
        for name, vals in cols.items():  # each column has a state field of its name
            assert getattr(s, name) == vals[j], name
        assert (s.matched_blocks, s.index_blocks, s.host_blocks, s.new_blocks) == (f"m{j}", f"i{j}", f"h{j}", f"n{j}")
        assert (s.routed_since, s.routed_prefills) == ((0.5, 1.5)[j], (f"w{j}",))


def test_class_views_are_kept_while_a_replicas_class_queues_stand_and_rebuilt_when_they_move():
    from fairway.routing.base import ClassViews

    classes = ClassesConfig.parse("interactive:tier=0,batch:tier=1")
    lv, _ = view(2)
    lv.on_routed(1, 0, 100, prefill_s=0.4, klass="interactive")
    lv.on_routed(2, 1, 100, prefill_s=0.9, klass="batch")
    views = ClassViews()
    first = make_states(lv.snapshot(), [0, 0], [0, 0], klass="batch", classes=classes, views=views)
    assert [s.class_view for s in first] == [ClassView(0.0, (), 0.4), ClassView(0.9, (0.9,), 0.0)]
    lv.on_routed(3, 1, 100, prefill_s=0.3, klass="interactive")  # only replica 1's queues move
    second = make_states(lv.snapshot(), [0, 0], [0, 0], klass="batch", classes=classes, views=views)
    assert second[0].class_view is first[0].class_view  # kept
    assert second[1].class_view == ClassView(0.9, (0.9,), 0.3)  # rebuilt
    fresh = make_states(lv.snapshot(), [0, 0], [0, 0], klass="batch", classes=classes)
    assert [s.class_view for s in second] == [s.class_view for s in fresh]
