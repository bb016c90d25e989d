"""The engine's strict-tier prefill option (``EngineConfig.strict_prefill_first``): a step in
which the strictest tier has prefill to run runs no lower tier's prefill and admits none;
decodes go on; without classes nothing changes."""

from __future__ import annotations

import pytest

from fairway.clock import ManualClock
from fairway.engine.model import EngineConfig, EngineModel
from fairway.policies import make_policy
from fairway.policies.base import QueuedRequest
from fairway.request import RequestSpec
from sim.simulator import Simulation
from tests.factories import LinearCost, ListWorkload, chain, spec

CLASSES = "hi:tier=0,lo:tier=1"


def engine(strict: bool, policy: str = "classes", budget: int = 64):
    clock = ManualClock()
    cost = LinearCost()  # step = .01 + .001 per prefill token (+ .005 with decodes)
    kw = {"classes": CLASSES, "inner": "fcfs"} if policy == "classes" else {}
    if policy in ("priority-fcfs", "llmd-flow"):
        kw = {"classes": CLASSES}
    pol = make_policy(policy, clock=clock, cost=cost, **kw)
    cfg = EngineConfig(kv_blocks=100, max_num_batched_tokens=budget, strict_prefill_first=strict)
    return EngineModel(cfg, cost, pol, clock), clock


def queued(rid: int, klass: str) -> QueuedRequest:
    return QueuedRequest(rid=rid, arrival_s=0.0, prompt_tokens=16, block_hashes=[], seq=rid, priority_class=klass)


def classed(rid: int, arrival: float, prompt: int, output: int, klass: str) -> RequestSpec:
    s = spec(rid, arrival, prompt, output, chain(f"p{rid}", -(-prompt // 16)))
    s.priority_class = klass
    return s


def first_tokens(strict: bool, specs: list[RequestSpec], policy: str = "classes") -> dict[int, float]:
    eng, clock = engine(strict, policy)
    res = Simulation(ListWorkload(specs), [eng], clock).run()
    assert len(res.finished) == len(specs)
    return {r.rid: r.first_token_s for r in res.finished}


def test_a_strict_arrival_does_not_wait_behind_a_running_lower_tier_prefill():
    specs = [classed(0, 0.0, 200, 2, "lo"), classed(1, 0.03, 32, 1, "hi")]
    # off (vLLM's order): lo's chunks take each step's 64 tokens at .074 and .148; hi is admitted
    # with lo's last 8 tokens at .222, in a step of 40 prefill tokens
    off = first_tokens(False, specs)
    assert off[1] == pytest.approx(0.222 + 0.01 + 0.040)
    assert off[0] == pytest.approx(off[1])
    # on: at .074 lo's chunk waits and hi runs alone (.042); lo then needs 64 + 64 + 8 tokens
    on = first_tokens(True, specs)
    assert on[1] == pytest.approx(0.074 + 0.042)
    assert on[0] == pytest.approx(on[1] + 2 * 0.074 + 0.018)


def test_a_lower_tier_pick_is_not_admitted_while_the_strict_tier_prefills():
    specs = [classed(0, 0.0, 100, 2, "hi"), classed(1, 0.0, 16, 1, "lo")]
    # off: hi takes 64, then its 36 with lo's 16 admitted beside them (.062)
    off = first_tokens(False, specs)
    assert off[0] == pytest.approx(0.074 + 0.062)
    assert off[1] == pytest.approx(off[0])
    # on: hi's last 36 tokens run alone (.046); lo comes in the next step, beside hi's decode
    on = first_tokens(True, specs)
    assert on[0] == pytest.approx(0.074 + 0.046)
    assert on[1] == pytest.approx(on[0] + 0.01 + 0.016 + 0.005)


def test_lower_tier_decodes_go_on_while_the_strict_tier_prefills():
    specs = [classed(0, 0.0, 16, 3, "lo"), classed(1, 0.02, 48, 1, "hi")]
    eng, clock = engine(True)
    res = Simulation(ListWorkload(specs), [eng], clock).run()
    lo, hi = sorted(res.finished, key=lambda r: r.rid)
    # lo's prefill (.026), then hi's prefill beside lo's first decode (.01 + .048 + .005), then
    # lo's last decode (.015)
    assert hi.first_token_s == pytest.approx(0.026 + 0.063)
    assert lo.finished_s == pytest.approx(hi.first_token_s + 0.015)


def test_without_classes_the_option_changes_nothing():
    specs = [classed(0, 0.0, 200, 2, ""), classed(1, 0.03, 32, 1, ""), classed(2, 0.05, 100, 3, "")]
    assert first_tokens(True, specs, "fcfs") == first_tokens(False, specs, "fcfs")


@pytest.mark.parametrize("name", ["classes", "priority-fcfs", "llmd-flow"])
def test_the_class_ordered_policies_name_their_lower_tiers_and_their_strict_waiting(name):
    p = make_policy(name, clock=ManualClock(), cost=LinearCost(), classes="a:tier=1,b:tier=2,c:tier=1")
    assert [p.lower_tier(c) for c in ("a", "b", "c", "")] == [False, True, False, False]  # "": the last, c
    assert not p.strict_waiting()
    p.add(queued(0, "b"))
    assert not p.strict_waiting()
    p.add(queued(1, "c"))
    assert p.strict_waiting()
    if name != "classes":  # the anchors without classes: one tier
        assert not make_policy(name, clock=ManualClock(), cost=LinearCost()).lower_tier("")
    assert not make_policy("fcfs", clock=ManualClock(), cost=LinearCost()).lower_tier("x")



def test_an_anchor_on_the_strict_engine_runs_the_strict_arrival_first():
    # the first test's timeline, with priority-fcfs ordering the engine's queue
    specs = [classed(0, 0.0, 200, 2, "lo"), classed(1, 0.03, 32, 1, "hi")]
    assert first_tokens(True, specs, "priority-fcfs")[1] == pytest.approx(0.074 + 0.042)
    assert first_tokens(False, specs, "priority-fcfs")[1] == pytest.approx(0.222 + 0.01 + 0.040)
