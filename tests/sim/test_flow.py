"""Flow control in the simulator: the class mix, the per-class summary (attainment, goodput), and
the router's wait-bound check with its refusals-with-room count."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from fairway.clock import ManualClock
from fairway.cost_model import CostModel
from fairway.engine.model import EngineRequest
from fairway.policies.classes import ClassesConfig
from sim.flow import HELD, FlowControl, flow_summary
from sim.runner import RunConfig, build, run
from tests.factories import spec
from workloads.class_mix import parse_mix

CLASSES = "interactive:tier=0:objective=1,batch:tier=1:objective=30"


def small(**kw) -> RunConfig:
    base = dict(workload="rag", policy="classes", rate=12.0, duration_s=15.0, replicas=2, router="fairway",
                classes=CLASSES, class_mix="interactive=0.2,batch=0.8")
    return RunConfig(**{**base, **kw})


def test_class_mix_labels_requests_without_changing_them():
    plain, _ = build(small(classes="", class_mix=""))
    mixed, _ = build(small())
    a, b = list(plain.workload.initial()), list(mixed.workload.initial())
    assert [(s.rid, s.arrival_s, s.prompt_tokens, s.block_hashes) for s in a] == \
        [(s.rid, s.arrival_s, s.prompt_tokens, s.block_hashes) for s in b]
    assert {s.priority_class for s in a} == {""}
    share = sum(s.priority_class == "interactive" for s in b) / len(b)
    assert len(b) > 150 and 0.14 < share < 0.26
    again, _ = build(small())
    assert [s.priority_class for s in again.workload.initial()] == [s.priority_class for s in b]


def test_run_reports_per_class_ttft_attainment_and_goodput():
    res = run(small())
    flow = res["flow"]
    per = flow["classes"]
    assert set(per) == {"interactive", "batch"}
    assert sum(c["arrived"] for c in per.values()) == res["n_requests"]
    assert sum(c["finished"] for c in per.values()) == res["n_finished"]
    assert per["interactive"]["ttft_s"]["n"] == per["interactive"]["finished"] > 0
    assert 0.0 <= per["interactive"]["attainment"] <= 1.0
    assert flow["refused_with_room"] == 0 and flow["retry"] is True
    assert "flow" not in run(small(classes="", class_mix=""))


def rec(rid: int, arrival: float, ttft: float, klass: str, rejected: str = "") -> EngineRequest:
    r = EngineRequest(spec=spec(rid, arrival, 32, 4, []), seq=rid, rejected=rejected)
    r.spec.priority_class = klass
    r.first_token_s = arrival + ttft
    return r


def test_attainment_counts_refusals_as_misses_and_goodput_is_met_per_second():
    classes = ClassesConfig.parse("i:objective=1,b:tier=1:objective=30:max_wait=20")
    finished = [rec(0, 0.0, 0.5, "i"), rec(1, 2.0, 1.5, "i"), rec(2, 4.0, 25.0, ""), rec(3, 10.0, 0.2, "b")]
    rejected = [rec(4, 6.0, 0.0, "i", "refused")]
    out = flow_summary(finished, rejected, classes, None)["classes"]
    assert out["i"] == {**out["i"], "arrived": 3, "finished": 2, "refused": 1, "attainment": 1 / 3,
                        "goodput_rps": 1 / 10, "over_bound": 1}
    assert out["b"]["attainment"] == 1.0 and out["b"]["goodput_rps"] == 2 / 10 and out["b"]["over_bound"] == 1


def engines(*waits: float):
    return [SimpleNamespace(policy=SimpleNamespace(work_ahead_s=lambda c, w=w: w, queued_prefill_s=lambda w=w: w * 2))
            for w in waits]


def test_place_retries_on_the_next_replica_with_room_and_counts_refusals_with_room():
    classes = ClassesConfig.parse(CLASSES)
    s = spec(0, 0.0, 32, 4, [])
    s.priority_class = "interactive"
    flow = FlowControl(classes)
    assert flow.place(s, engines(3.0, 0.5, 0.2), [0, 2, 1]) == 2 and flow.retried == 1
    assert flow.place(s, engines(3.0, 2.0), [0, 1]) == -1 and flow.refused_with_room == 0
    today = FlowControl(classes, bounds="gate", gate_wait_s=5.0, retry=False)
    assert today.place(s, engines(3.0, 1.0), [0, 1]) == -1  # 6 s of queued work on the pick
    assert today.refused_with_room == 1 and today.refused == {"interactive": 1}


def test_mix_is_validated():
    classes = ClassesConfig.parse(CLASSES)
    assert parse_mix("interactive=1,batch=3", classes) == (("interactive", 0.25), ("batch", 0.75))
    for bad in ("gold=1", "interactive", "interactive=0", ""):
        with pytest.raises(ValueError):
            parse_mix(bad, classes)
    with pytest.raises(ValueError, match="needs --classes"):
        build(small(classes=""))


def test_strict_prefill_first_is_refused_where_no_policy_tells_the_engine_the_tiers():
    for kw in ({"classes": "", "class_mix": ""}, {"policy": "fairway"}):
        with pytest.raises(ValueError, match="--strict-prefill-first needs --classes and a policy that orders by"):
            build(small(strict_prefill_first=True, **kw))
    for policy in ("classes", "priority-fcfs", "llmd-flow"):  # the policies that order by class: accepted
        build(small(strict_prefill_first=True, policy=policy))


def held_flow(**kw) -> tuple[FlowControl, ManualClock]:
    clock = ManualClock()
    flow = FlowControl(ClassesConfig.parse("interactive:tier=0:objective=1,batch:tier=1:objective=30"),
                       gate_wait_s=5.0, hold=True, clock=clock, cost=CostModel.from_profile("h200-llama3-8b"), **kw)
    return flow, clock


def req(rid: int, klass: str, prompt: int = 64, arrival: float = 0.0):
    s = spec(rid, arrival, prompt, 4, [])
    s.priority_class = klass
    return s


def test_a_request_no_replica_has_room_for_is_held_and_released_in_class_order():
    """With a held queue a replica has room within the gates' 5 s; a batch request no replica has
    room for is held (its 30 s bound leaves 25 s of hold), an interactive one (1 s bound: no time
    to hold) is refused at once; once held, new batch requests queue behind; ``release`` places
    them in the class policy's order while the router finds room, and stops at the first that
    finds none."""
    flow, clock = held_flow()
    full = engines(6.0, 7.0)
    assert flow.place(req(0, "batch", 4000), full, [0, 1]) == HELD
    assert flow.place(req(1, "interactive"), full, [0, 1]) == -1 and flow.refused == {"interactive": 1}
    assert flow.place(req(2, "batch", 100), engines(1.0, 1.0), [0, 1]) == HELD  # others are held: it queues
    assert flow.place(req(3, "interactive"), engines(1.0, 1.0), [1, 0]) == 1  # no time to hold: placed at once
    assert flow.n_held == 2
    room = {2: 0}  # rid -> replica the router would place it on; others find none
    placed, expired = flow.release(lambda s: room.get(s.rid, -1))
    assert [(s.rid, j) for s, j in placed] == [(2, 0)] and expired == []  # the short one first (Fast lane)
    assert flow.n_held == 1
    clock.set(25.0)  # arrival + 30 s bound - 5 s for the gate
    placed, expired = flow.release(lambda s: 1)
    assert placed == [] and [s.rid for s in expired] == [0] and flow.hold_timeouts == 1
    assert flow.refused == {"interactive": 1, "batch": 1} and flow.n_held == 0


def test_a_held_run_conserves_every_request_and_reports_its_holds():
    """The product's admission in the simulator (``--hold``) at three times the load a small
    cluster takes: requests are held and placed; arrived = finished + refused + unfinished."""
    res = run(small(rate=60.0, duration_s=10.0, hold=True))
    flow = res["flow"]
    per = flow["classes"]
    assert flow["held"] > 0 and flow["hold_s"]["n"] == flow["held"]
    assert flow["refused_with_room"] == 0
    assert sum(c["arrived"] for c in per.values()) == res["n_requests"]
    assert res["n_finished"] + res["n_rejected"] + res["n_unfinished"] == res["n_requests"]


def test_with_classes_a_request_still_waiting_at_its_bound_is_shed_and_counted():
    """The product's admission with classes (``--hold``) at several times what the cluster takes,
    most of it interactive (more than the cluster takes on its own, so the router's class view
    cannot place it all within its bound): interactive requests (1 s bound) still queued at a
    replica when their bound passes are taken out and refused; no finished interactive request
    waited in a queue past its bound."""
    res = run(small(rate=60.0, duration_s=10.0, hold=True, class_mix="interactive=0.8,batch=0.2"))
    flow = res["flow"]
    assert flow["shed"] > 0
    assert flow["classes"]["interactive"]["refused"] + flow["classes"]["batch"]["refused"] >= flow["shed"]
    assert res["n_finished"] + res["n_rejected"] + res["n_unfinished"] == res["n_requests"]


def test_the_routers_class_view_raises_the_interactive_attainment_at_no_cost_to_batch():
    """4 replicas at about their capacity with the product's admission: the Fairway router with
    its class view (the default) places interactive requests that the whole queues would make
    late by the interactive work ahead of them; more of them meet their objective than without
    it, and batch goodput does not fall. The replicas' queues keep the Fair pick first on its turn
    (``fast_ahead`` 0), so the router's rule alone differs: with the default's light picks ahead,
    this 10 s run's margin is 0.006 (0.9815 against 0.9753), while the 8-replica flow benchmark
    at 2x shows the class arm's attainment up with it (docs/benchmarks.md, section 8)."""
    def flow(view: bool) -> dict:
        cfg = small(rate=80.0, duration_s=10.0, replicas=4, hold=True, router_options={"class_view": view},
                    policy_options={"inner_options": {"fast_ahead": 0.0}})
        return run(cfg)["flow"]["classes"]

    on, off = flow(True), flow(False)
    assert on["interactive"]["attainment"] > off["interactive"]["attainment"] + 0.01
    assert on["batch"]["goodput_rps"] >= off["batch"]["goodput_rps"]
