"""The first-step hold's price (fairway/first_step.py) and its use by the engine model."""

from __future__ import annotations

import math

import pytest

from fairway.clock import ManualClock
from fairway.engine.model import EngineConfig, EngineModel
from fairway.first_step import first_step_hold_pays
from fairway.policies import make_policy
from fairway.policies.base import QueuedRequest
from sim.simulator import Simulation
from tests.factories import LinearCost, ListWorkload, chain, queued, spec

COST = LinearCost()  # a step: 0.01 s + 0.001 s per prefill token (+ 0.005 s with decodes)


def test_the_hold_pays_while_the_delay_to_first_tokens_outweighs_its_cost():
    # the step so far: 300 prefill tokens ending three prompts; a 700-token chunk would join it
    t0, t1, lost = 0.01 + 0.3, 0.01 + 1.0, (0.01 + 0.7) + (0.01 + 0.3) - (0.01 + 1.0)
    # 3 x 0.7 s saved against 0.31 s for the held one and 0.01 s for each request behind it
    most = math.floor((3 * (t1 - t0) - t0) / lost - 1e-9)
    assert most == 178

    def pays(first: int, waiting: int) -> bool:
        return first_step_hold_pays(COST, first, waiting, 300, 0, 300**2 // 3, 0, 0, 700, 0)

    assert pays(3, 0) and pays(3, most)
    assert not pays(3, most + 1)  # a deep backlog: the capacity the short step leaves idle costs more
    assert not pays(0, 0)  # nobody gets a first token in the step: nothing to spare
    # one first token: 0.7 s saved against 0.31 s still pays; a 20-token chunk does not
    assert pays(1, 0)
    assert not first_step_hold_pays(COST, 1, 0, 300, 0, 0, 0, 0, 20, 0)


def _burst(first_step_hold: bool, long_tokens: int = 3000, long_prefill: int = 0
           ) -> tuple[dict[int, float], EngineModel]:
    clock = ManualClock()
    pol = make_policy("fairway", clock=clock, cost=COST, first_step_hold=first_step_hold)
    cfg = EngineConfig(kv_blocks=1000, max_num_batched_tokens=1000, max_num_seqs=64,
                       long_prefill_token_threshold=long_prefill)
    eng = EngineModel(cfg, COST, pol, clock)
    # one burst: three short prompts and a longer one, none cached
    specs = [spec(i, 0.0, 100, 2, chain(f"c{i}", 7)) for i in range(3)]
    specs.append(spec(3, 0.0, long_tokens, 2, chain("heavy", -(-long_tokens // 16))))
    res = Simulation(ListWorkload(specs), [eng], clock).run()
    return {r.rid: r.first_token_s for r in res.finished}, eng


def test_the_engine_holds_a_long_prompt_out_of_the_step_that_ends_three_short_ones():
    shipped, eng = _burst(first_step_hold=False)
    assert eng.first_step_holds == 0
    # vLLM's order: the long prompt's 700-token chunk fills the first step with the short ones
    assert [shipped[i] for i in range(3)] == pytest.approx([1.01] * 3)
    held, eng = _burst(first_step_hold=True)
    assert eng.first_step_holds == 1
    assert [held[i] for i in range(3)] == pytest.approx([0.31] * 3)
    # the long prompt starts a step later and ends one step's overhead (0.01 s) later: its
    # chunks fill the steps that follow as before, plus the short step it stayed out of
    assert held[3] == pytest.approx(shipped[3] + 0.01)


def test_a_prompt_that_would_end_in_the_step_is_held_when_it_lengthens_the_step_most():
    # 600 tokens fit the budget with the three short prompts: without the hold all four get
    # their first token at the end of one 0.91 s step
    shipped, _ = _burst(first_step_hold=False, long_tokens=600)
    assert [shipped[i] for i in range(4)] == pytest.approx([0.91] * 4)
    # 3 x 0.6 s saved against 0.31 s: the short prompts' step ends at 0.31 s, and the 600-token
    # prompt's own step follows it (0.01 + 0.6 s, and 0.005 s for the short prompts' decodes)
    held, eng = _burst(first_step_hold=True, long_tokens=600)
    assert eng.first_step_holds == 1
    assert [held[i] for i in range(4)] == pytest.approx([0.31, 0.31, 0.31, 0.925])
    # a pick as cheap as the step's own prefills is not held: 3 x 0.1 s < 0.31 s
    same, eng = _burst(first_step_hold=True, long_tokens=100)
    assert eng.first_step_holds == 0
    assert [same[i] for i in range(4)] == pytest.approx([0.41] * 4)


def test_a_prompt_that_would_end_in_the_step_is_held_once_at_most():
    clock = ManualClock()
    pol = make_policy("fairway", clock=clock, cost=COST)
    cfg = EngineConfig(kv_blocks=1000, max_num_batched_tokens=1000, max_num_seqs=64)
    eng = EngineModel(cfg, COST, pol, clock)
    specs = [spec(i, 0.0, 100, 2, chain(f"c{i}", 7)) for i in range(3)]
    specs.append(spec(3, 0.0, 600, 2, chain("heavy", 38)))
    # three more short prompts arrive during the first step: the 600-token prompt would pay to be
    # held again, but goes into the second step with them (0.01 + 0.9 s, + 0.005 s of decodes)
    specs += [spec(i, 0.3, 100, 2, chain(f"c{i}", 7)) for i in range(4, 7)]
    res = Simulation(ListWorkload(specs), [eng], clock).run()
    first = {r.rid: r.first_token_s for r in res.finished}
    assert eng.first_step_holds == 1
    assert [first[i] for i in (0, 1, 2)] == pytest.approx([0.31] * 3)
    assert [first[i] for i in (3, 4, 5, 6)] == pytest.approx([0.31 + 0.915] * 4)


def test_under_a_long_prefill_cap_the_hold_prices_the_capped_chunk():
    # capped at 100 tokens a step, the long prompt's chunk adds 0.1 s to three first tokens,
    # less than the 0.31 s step it would wait: it goes in, and the short prompts' step is 0.41 s
    capped, eng = _burst(first_step_hold=True, long_prefill=100)
    assert eng.first_step_holds == 0
    assert [capped[i] for i in range(3)] == pytest.approx([0.41] * 3)
    # capped at 400, the chunk adds 0.4 s to each: held, as without a cap
    capped, eng = _burst(first_step_hold=True, long_prefill=400)
    assert eng.first_step_holds == 1
    assert [capped[i] for i in range(3)] == pytest.approx([0.31] * 3)


def test_a_request_is_held_only_while_it_has_waited_less_than_its_own_prefill_time():
    clock = ManualClock()
    pol = make_policy("fairway", clock=clock, cost=COST, first_step_hold=True)
    pol.attach_cache(set().__contains__)
    pol.add(queued(1, 0.0, 3000, chain("heavy", 188)))  # P = 0.01 + 3.0 s
    assert pol.may_hold_first_step(1)
    clock.advance(3.0)
    assert pol.may_hold_first_step(1)
    clock.advance(0.02)  # waited 3.02 s > P: not held again, long before the Fair lane's 12 x P
    assert not pol.may_hold_first_step(1)
    off = make_policy("fairway", clock=clock, cost=COST, first_step_hold=False)
    off.attach_cache(set().__contains__)
    off.add(queued(2, clock.now(), 3000, chain("heavy", 188)))
    assert not off.may_hold_first_step(2)
    on = make_policy("fairway", clock=clock, cost=COST)
    on.attach_cache(set().__contains__)
    on.add(queued(3, clock.now(), 3000, chain("heavy", 188)))
    assert on.may_hold_first_step(3)  # on by default


@pytest.mark.parametrize(("options", "held"), [({}, True), ({"first_step_hold": False}, False)])
def test_the_class_policy_asks_its_inner_fairway_queue(options, held):
    clock = ManualClock()
    pol = make_policy("classes", clock=clock, cost=COST, classes="interactive:tier=0,batch:tier=1",
                      inner="fairway", inner_options=options)
    pol.attach_cache(set().__contains__)
    pol.add(QueuedRequest(rid=1, arrival_s=0.0, prompt_tokens=3000, block_hashes=chain("heavy", 188),
                          priority_class="batch"))
    assert pol.may_hold_first_step(1) is held


def test_the_option_takes_true_or_false_only():
    with pytest.raises(ValueError, match="first_step_hold must be true or false, got 'maybe'"):
        make_policy("fairway", clock=ManualClock(), cost=COST, first_step_hold="maybe")
