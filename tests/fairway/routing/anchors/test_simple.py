"""``round-robin`` and ``pow2`` (fairway/routing/anchors/simple.py): exact picks on hand-made states."""

from __future__ import annotations

from tests.fairway.routing.helpers import last, picks, ranked, req, router, st


def test_round_robin_cycles_in_id_order():
    r = router("round-robin")
    states = [st(2), st(0), st(1)]  # order of the states does not matter
    assert ranked(r, req(), states) == [[0], [1], [2]]
    assert ranked(r, req(), states) == [[1], [2], [0]]
    assert ranked(r, req(), states) == [[2], [0], [1]]
    assert picks(r, req(), states, 3) == [0, 1, 2]
    assert last(r).reason == "round-robin"


def test_pow2_two_replicas_shorter_queue_first():
    r = router("pow2")
    assert picks(r, req(), [st(0, outstanding=3), st(1, outstanding=1)], 10) == [1] * 10
    assert ranked(r, req(), [st(0, outstanding=3), st(1, outstanding=1)]) == [[1, 0]]
    assert sorted(ranked(r, req(), [st(0, outstanding=2), st(1, outstanding=2)])[0]) == [0, 1]  # tie: the draw's order
    assert ranked(r, req(), [st(4)]) == [[4]]
    assert last(r).reason == "pow2"


def test_pow2_never_picks_the_longest_queue_and_is_seeded():
    states = [st(0, outstanding=5), st(1, outstanding=1), st(2, outstanding=9)]
    a = picks(router("pow2", seed=7), req(), states, 60)
    assert a == picks(router("pow2", seed=7), req(), states, 60)
    assert a != picks(router("pow2", seed=8), req(), states, 60)
    assert set(a) == {0, 1}  # 0 wins only when drawn with 2; 2 never wins
    r = router("pow2", seed=3)
    for _ in range(30):
        ranks = ranked(r, req(), states)
        first = ranks[0]
        assert len(first) == 2 and first[0] == min(first, key=lambda j: states[j].outstanding)
        assert len(ranks) == 2  # the pair, then the one left


def test_pow2_equal_queues_keep_the_draw_order():
    # Ray keeps the first of its random pair unless the second is strictly shorter
    r = router("pow2", seed=0)
    tie = [st(0, outstanding=2), st(1, outstanding=2)]
    firsts = [ranked(r, req(), tie)[0] for _ in range(40)]
    assert {tuple(f) for f in firsts} == {(0, 1), (1, 0)}
    again = router("pow2", seed=0)
    assert firsts == [ranked(again, req(), tie)[0] for _ in range(40)]
    assert all(ranked(r, req(), [st(0, outstanding=3), st(1, outstanding=1)]) == [[1, 0]] for _ in range(10))
