"""The TTFT floor (sim/ttft_floor.py, ``CostModel.least_ttft_array``): what any cache could hold
for a request, exactly, on small sequences; the floor met by a request served alone; and no
request of real runs, under several routers and queue orders, ever faster than its floor."""

from __future__ import annotations

import numpy as np
import pytest

from fairway.cost_model import CostModel
from sim.hit_bounds import References
from sim.runner import RunConfig, build
from sim.ttft_floor import shareable_tokens, ttft_floor
from tests.factories import chain, spec


def test_shareable_tokens_are_the_reusable_blocks_another_request_names():
    a, b, out = chain("a", 4), chain("b", 3), chain("x", 1)
    specs = [
        spec(0, 0.0, 65, 16, a + out),         # 4 reusable blocks, all in request 2; its output block x
        spec(1, 1.0, 49, 1, b),                # 3 reusable blocks, no other request has them
        spec(2, 2.0, 97, 1, a + out + chain("c", 1)),  # a's 4 blocks and 0's output block: 5 of 6 reusable
        spec(3, 3.0, 32, 1, a[:2]),            # 2 blocks, the second holds its last token: 1 reusable
    ]
    got = shareable_tokens(References.of(specs, 16), 16)
    assert got.tolist() == [64, 0, 80, 16]


def test_a_request_served_alone_takes_exactly_its_floor_when_its_prompt_is_one_chunk():
    """One request on an idle cluster: its TTFT is the floor (one step, nothing cached), and a
    prompt longer than the token budget takes more than its floor by the chunks' cross-attention."""
    for prompt in (300, 8000, 20_000):
        cfg = RunConfig(workload="mixed", policy="fcfs", rate=0.001, duration_s=1.0, replicas=1)
        sim, _ = build(cfg)
        sim.workload = _One(prompt)
        res = sim.run()
        (r,) = res.finished
        ttft = r.first_token_s - r.spec.arrival_s
        floor = ttft_floor([r.spec], sim.replicas[0].cost, 16, cfg.max_num_batched_tokens)[0]
        if prompt <= cfg.max_num_batched_tokens:
            assert ttft == pytest.approx(floor, rel=1e-12)
        else:
            assert floor < ttft < 1.1 * floor


class _One:
    """A workload of one cold request at t = 0."""

    closed_loop = False

    def __init__(self, prompt: int):
        self.prompt = prompt

    def initial(self):
        yield spec(0, 0.0, self.prompt, 4, chain("lone", (self.prompt + 4) // 16))

    def on_complete(self, spec_, finish_s):
        return []


@pytest.mark.parametrize("workload,rate,duration,router,policy,kv_blocks", [
    ("hotspot", 100, 20, "fairway", "fairway", None),
    ("hotspot", 100, 20, "dynamo", "fcfs", None),
    ("rag-spike", 60, 30, "fairway", "fairway", None),
    ("rag-spike", 60, 30, "round-robin", "lpm", None),
    ("agentic", 2, 60, "session-hash", "fairway", None),
    ("rag-spike", 60, 30, "fairway", "fairway", 3000),  # memory short: requests preempted and recomputed
])
def test_no_request_is_faster_than_its_floor(workload, rate, duration, router, policy, kv_blocks):
    cfg = RunConfig(workload=workload, policy=policy, rate=rate, duration_s=duration, replicas=4, router=router,
                    kv_blocks=kv_blocks)
    sim, _ = build(cfg)
    res = sim.run()
    assert kv_blocks is None or res.preemptions > 0
    order = sorted(res.finished, key=lambda r: (r.spec.arrival_s, r.spec.rid))
    floor = ttft_floor([r.spec for r in order], sim.replicas[0].cost, cfg.block_size, cfg.max_num_batched_tokens)
    ttft = np.array([r.first_token_s - r.spec.arrival_s for r in order])
    assert len(order) > 100
    assert np.all(ttft >= floor - 1e-12), np.min(ttft - floor)


def test_the_floor_holds_for_every_profile_where_computing_more_is_cheaper():
    """The attention term is not monotone in the tokens computed (a long prompt computed whole can
    cost less attention than one mostly cached): the floor takes the least over every hit the
    request could get, never more than any of them."""
    for name in ("h200-llama3-8b", "h200-14b", "h200-llama3-8b-graphs"):
        cost = CostModel.from_profile(name)
        prompt = np.full(64, 100_000.0)
        most = np.linspace(0, 99_999, 64).round()
        floor = cost.least_ttft_array(prompt, most, 8192)
        for i, c in enumerate(most):
            # every hit up to the most cached, in budget-sized chunks (the engine's schedule alone)
            for hit in np.linspace(0, c, 9).round():
                x = prompt[i] - hit
                k = int(np.ceil(x / 8192))
                chunks = [8192] * (k - 1) + [int(x - 8192 * (k - 1))]
                done, t = hit, 0.0
                for n in chunks:
                    t += cost.step_time(n, n * int(done), n * n, 0, 0)
                    done += n
                assert floor[i] <= t + 1e-9
