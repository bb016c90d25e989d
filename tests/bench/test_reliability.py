"""The soak's hostile tally: which wrong answers an ingress-replica kill explains
(``bench.reliability.excuse_ingress_kills``), on hand-made misses with exact results; and the
soak's verdict (``soak_failures``) on a hand-made report, one fault at a time."""

from __future__ import annotations

import pytest

from bench.reliability import SOAK_EVENTS, excuse_ingress_kills, soak_failures
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


def soak_report() -> dict:
    """A one-minute soak at 4 req/s that passed (the figures of a real run, docs/reliability.md)."""
    return {"duration_s": 60.0, "rate": 4.0, "engines_idle_after_s": 1.5,
            "accounting": {"sent": 278, "completed": 252, "lost": 0, "cut": 13},
            "hostile": {"sent": 290, "wrong": 0, "at_ingress_kill": 1, "wrong_examples": []},
            "events": [{"at_s": 15.0, "event": "kill replica", "actor": "FairwayReplica#a"},
                       {"at_s": 27.0, "event": "kill ingress", "actor": "FairwayIngress#b"},
                       {"at_s": 39.0, "event": "stall replica", "replica": "FairwayReplica#c"},
                       {"at_s": 54.0, "event": "stall lifted"}]}


def test_a_clean_soak_passes():
    assert soak_failures(soak_report()) == []


@pytest.mark.parametrize(("path", "value", "named"), [
    (("accounting", "lost"), 1, "lost 1 requests"),
    (("accounting", "cut"), 17, "cut 17 streams"),
    (("accounting", "completed"), 166, "completed 166 of 278"),
    (("hostile", "sent"), 99, "sent only 99"),
    (("hostile", "wrong"), 2, "2 hostile requests answered wrongly"),
    (("hostile", "at_ingress_kill"), 2, "2 hostile requests lost at the ingress kill"),
    (("engines_idle_after_s",), None, "did not end empty"),
])
def test_each_failed_check_is_named_alone(path, value, named):
    rep = soak_report()
    node = rep
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    failures = soak_failures(rep)
    assert len(failures) == 1 and named in failures[0], failures


def test_a_missing_or_misordered_fault_event_fails():
    rep = soak_report()
    rep["events"] = rep["events"][1:]  # the replica kill missing: "stall lifted" is third, with no actor
    assert soak_failures(rep) == [f"events {SOAK_EVENTS[1:]}, not {SOAK_EVENTS}",
                                  "a fault event names no actor or replica"]
    rep = soak_report()
    del rep["events"][0]["actor"]
    assert soak_failures(rep) == ["a fault event names no actor or replica"]
