"""The soak's hostile tally: which wrong answers an ingress-replica kill explains
(``bench.reliability.excuse_ingress_kills``), on hand-made misses with exact results."""

from __future__ import annotations

from bench.reliability import excuse_ingress_kills
from cluster.launch import HAPROXY_BUFSIZE

BIG = int(HAPROXY_BUFSIZE) + 1


def miss(what: str, size: int, sent: float, done: float) -> dict:
    return {"what": what, "bytes": size, "sent_s": sent, "done_s": done}


def test_only_a_request_too_big_to_replay_and_in_flight_at_the_kill_is_excused():
    events = [{"at_s": 15.0, "event": "kill replica", "actor": "r"},
              {"at_s": 27.0, "done_s": 28.5, "event": "kill ingress", "actor": "i"}]
    misses = [
        miss("big, in flight at the kill", BIG, 28.4, 28.45),
        miss("big, answered before the kill began", BIG, 26.0, 26.8),
        miss("big, sent after the kill returned", BIG, 28.7, 28.8),
        miss("small, in flight at the kill", 100, 27.5, 27.6),  # HAProxy replays these: still wrong
        miss("big, at the replica kill", BIG, 15.0, 15.2),
    ]
    rep = excuse_ingress_kills({"sent": 9, "by_status": {}, "wrong": 5, "wrong_examples": [], "misses": misses},
                               events)
    assert rep["at_ingress_kill"] == 1
    assert rep["at_ingress_kill_examples"] == ["big, in flight at the kill"]
    assert rep["wrong"] == 4
    assert rep["wrong_examples"] == ["big, answered before the kill began", "big, sent after the kill returned",
                                     "small, in flight at the kill", "big, at the replica kill"]


def test_without_an_ingress_kill_every_miss_stays_wrong():
    rep = excuse_ingress_kills({"sent": 1, "by_status": {}, "wrong": 1, "wrong_examples": [],
                                "misses": [miss("big", BIG, 1.0, 2.0)]}, [])
    assert (rep["wrong"], rep["at_ingress_kill"]) == (1, 0)
