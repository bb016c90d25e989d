"""SVF / 1-bit SVF admission orders, Sorted-F's batches, the offline lower bound, and the CLI."""

from __future__ import annotations

import json
from itertools import combinations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fairway.clock import ManualClock
from fairway.cost_model import CostModel
from fairway.offline import (
    MODES,
    PLANNERS,
    Budget,
    Job,
    execute,
    f_value,
    lower_bound,
    min_f_batch,
    plan_sorted_f,
)
from fairway.policies import POLICIES, PolicyError, make_policy
from fairway.policies.base import QueuedRequest
from sim.cli import main
from tests.factories import LinearCost, chain, drain_order, policy_with_cache, queued

CACHED = set(chain("sys", 4)) | set(chain("doc", 10))
COST = CostModel.from_profile("h200-llama3-8b")


def with_output(q: QueuedRequest, out: int) -> QueuedRequest:
    q.output_tokens = out
    return q


def svf_queue() -> list[QueuedRequest]:
    """(prompt, cached, output hint): r0 (1000, 0, 300), r1 (200, 64, 10), r2 (170, 160, 100),
    r3 (100, 0, 120), r4 (300, 0, unknown)."""
    return [
        with_output(queued(0, 0.0, 1000, chain("cold0", 62)), 300),
        with_output(queued(1, 1.0, 200, chain("sys", 4) + chain("u1", 8)), 10),
        with_output(queued(2, 2.0, 170, chain("doc", 10)), 100),
        with_output(queued(3, 3.0, 100, chain("cold3", 6)), 120),
        with_output(queued(4, 4.0, 300, chain("cold4", 18)), 0),
    ]


def fill(name: str, **kw):
    p, _ = policy_with_cache(name, CACHED, **kw)
    for q in svf_queue():
        p.add(q)
    return p


def test_svf_volume_formula():
    p = fill("svf")
    # o * (L - c) + o (o + 1) / 2
    assert p.volume(0) == 300 * 1000 + 300 * 301 / 2
    assert p.volume(1) == 10 * 136 + 55
    assert p.volume(2) == 100 * 10 + 5050
    assert p.volume(4) == 128 * 300 + 128 * 129 / 2  # no hint: the default 128 tokens


@pytest.mark.parametrize(
    "name,kw,expected",
    [
        # volumes: r1 1415, r2 6050, r3 19260, r4 46656, r0 345150
        ("svf", {}, [1, 2, 3, 4, 0]),
        # cache-blind: r2 charged its whole 170-token context, 22050 > r3's 19260
        ("svf", {"cached_weight": 1.0}, [1, 3, 2, 4, 0]),
        # one bit: r1, r2, r3 short (84 tokens), r0 long (222), r4 unknown (128):
        # r2 4410, r3 11970, r1 14994, r4 46656, r0 246753; r1's short answer is lost in its class
        ("svf-1bit", {}, [2, 3, 1, 4, 0]),
        # threshold at 5: every hinted request is long (222 tokens), the unhinted r4 at 128:
        # r2 26973, r4 46656, r3 46953, r1 54945, r0 246753
        ("svf-1bit", {"long_above": 5}, [2, 4, 3, 1, 0]),
        # long priced at 1000 tokens: r4 46656, r2 510500, r3 600500, r1 636500, r0 1500500
        ("svf-1bit", {"long_above": 5, "long_output_tokens": 1000, "short_output_tokens": 1},
         [4, 2, 3, 1, 0]),
    ],
)
def test_svf_orders(name, kw, expected):
    assert drain_order(fill(name, **kw)) == expected


def test_svf_1bit_threshold_is_strict():
    p, _ = policy_with_cache("svf-1bit", set())
    p.add(with_output(queued(0, 0.0, 100, chain("a", 6)), 128))  # at the threshold: short
    p.add(with_output(queued(1, 0.0, 100, chain("b", 6)), 129))  # above: long
    assert p.volume(0) == 84 * 100 + 84 * 85 / 2
    assert p.volume(1) == 222 * 100 + 222 * 223 / 2


def test_svf_ties_go_to_seq_and_hits_follow_cache_events():
    cache: set[int] = set()
    p, _ = policy_with_cache("svf", cache)
    p.add(with_output(queued(0, 0.0, 200, chain("x", 12), seq=1), 50))
    p.add(with_output(queued(1, 0.0, 200, chain("y", 12), seq=0), 50))
    assert p.select().rid == 1
    cache.update(chain("x", 5))
    p.on_blocks_stored(chain("x", 5))
    assert p.select().rid == 0  # 80 tokens now cached: a smaller volume


def test_svf_registered_and_checked():
    assert {"svf", "svf-1bit"} <= set(POLICIES)
    with pytest.raises(ValueError, match="cached_weight"):
        make_policy("svf", clock=ManualClock(), cost=LinearCost(), cached_weight=2.0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="short_output_tokens"):
        make_policy("svf-1bit", clock=ManualClock(), cost=LinearCost(), short_output_tokens=0)  # type: ignore[arg-type]
    with pytest.raises(PolicyError, match="bad options"):
        make_policy("svf", clock=ManualClock(), cost=LinearCost(), nope=1)  # type: ignore[arg-type]


# -- Sorted-F ------------------------------------------------------------------------------

TINY = [Job(0, 30, 10), Job(1, 10, 40), Job(2, 20, 5), Job(3, 25, 20), Job(4, 5, 2),
        Job(5, 50, 30), Job(6, 8, 60)]
TINY_BUDGET = Budget(kv_blocks=100, block_size=1)


def brute_force_min_f(jobs, left, budget):
    best = None
    for k in range(1, len(left) + 1):
        for c in combinations(left, k):
            if sum(budget.blocks(jobs[i]) for i in c) <= budget.kv_blocks and k <= budget.max_num_seqs:
                f = f_value([jobs[i].output for i in c])
                if best is None or f < best:
                    best = f
    return best


def test_sorted_f_exact_batches_on_a_tiny_backlog():
    # {2, 4}: F = 7/4 beats {2, 4, 0}: 17/9; then {0, 3}: 30/4; 5, 1 and 6 share no room
    assert plan_sorted_f(TINY, TINY_BUDGET) == [[4, 2], [0, 3], [5], [1], [6]]
    assert PLANNERS["fcfs"](TINY, TINY_BUDGET) == [[0, 1], [2, 3, 4], [5], [6]]
    assert PLANNERS["shortest-first"](TINY, TINY_BUDGET) == [[4, 2, 0], [3], [5], [1], [6]]
    assert PLANNERS["svf"](TINY, TINY_BUDGET) == [[4, 2, 0], [3, 1], [5], [6]]


def test_sorted_f_batches_have_non_decreasing_f():
    plan = plan_sorted_f(TINY, TINY_BUDGET)
    fs = [f_value([TINY[i].output for i in b]) for b in plan]
    assert fs == sorted(fs)


jobs_st = st.lists(
    st.tuples(st.integers(1, 60), st.integers(1, 40)), min_size=1, max_size=8
).map(lambda xs: [Job(i, p, o) for i, (p, o) in enumerate(xs)])


@settings(max_examples=60, deadline=None)
@given(jobs=jobs_st, kv=st.integers(100, 260), seqs=st.integers(1, 8), bs=st.sampled_from([1, 16]))
def test_min_f_batch_is_the_brute_force_optimum(jobs, kv, seqs, bs):
    budget = Budget(kv_blocks=-(-kv // bs), block_size=bs, max_num_seqs=seqs)
    left = [j.rid for j in jobs if budget.fits(j)]
    while left:
        batch = min_f_batch(jobs, left, budget)
        assert batch and set(batch) <= set(left) and len(batch) <= seqs
        assert sum(budget.blocks(jobs[i]) for i in batch) <= budget.kv_blocks
        assert f_value([jobs[i].output for i in batch]) == pytest.approx(brute_force_min_f(jobs, left, budget))
        left = [i for i in left if i not in batch]


@settings(max_examples=40, deadline=None)
@given(
    jobs=st.lists(st.tuples(st.integers(1, 3000), st.integers(1, 60)), min_size=1, max_size=12)
    .map(lambda xs: [Job(i, p, o) for i, (p, o) in enumerate(xs)]),
    kv_blocks=st.integers(200, 1200),
    seqs=st.integers(1, 16),
    tokens=st.sampled_from([512, 8192]),
)
def test_lower_bound_is_below_every_planner(jobs, kv_blocks, seqs, tokens):
    budget = Budget(kv_blocks=kv_blocks, max_num_seqs=seqs, max_num_batched_tokens=tokens)
    jobs = [Job(i, j.prompt, j.output) for i, j in enumerate(x for x in jobs if budget.fits(x))]
    if not jobs:
        return
    lb = lower_bound(jobs, budget, COST)
    assert np.all(lb.own_s > 0) and np.all(np.diff(lb.kth_s) >= 0)
    for name, planner in PLANNERS.items():
        plan = planner(jobs, budget)
        for mode in MODES:
            out = execute(jobs, plan, budget, COST, mode)
            assert np.all(np.isfinite(out.finish_s)), (name, mode)
            # the k-th completion is at least the bound's k-th value, so the sum is too
            assert np.all(np.sort(out.finish_s) >= lb.kth_s * (1 - 1e-9)), (name, mode)
            assert np.all(out.finish_s >= lb.own_s * (1 - 1e-9)), (name, mode)
            assert out.finish_s.sum() >= lb.sum_s * (1 - 1e-9)


def test_execute_single_job_matches_the_cost_model():
    budget = Budget(kv_blocks=100)
    out = execute([Job(0, 100, 3)], [[0]], budget, COST, "static")
    t1 = COST.step_time(100, 0, 100 * 100, 0, 0)
    t2 = t1 + COST.step_time(0, 0, 0, 1, 100)
    t3 = t2 + COST.step_time(0, 0, 0, 1, 101)
    assert out.first_token_s[0] == pytest.approx(t1)
    assert out.finish_s[0] == pytest.approx(t3) and out.steps == 3


def test_execute_rejects_bad_plans():
    with pytest.raises(ValueError, match="every job"):
        execute(TINY, [[0, 1]], TINY_BUDGET, COST)
    with pytest.raises(ValueError, match="infeasible"):
        execute(TINY, [[0, 1, 2, 3, 4, 5, 6]], TINY_BUDGET, COST)


def test_offline_cli_runs(tmp_path, capsys):
    out = tmp_path / "off.json"
    rc = main(["offline", "--workload", "mixed", "--n", "40", "--kv-tokens", "32768", "--json", str(out)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "lower bound" in text and "sorted-f" in text
    res = json.loads(out.read_text())
    assert {(r["planner"], r["mode"]) for r in res["rows"]} == {(p, m) for p in PLANNERS for m in MODES}
    assert all(r["ratio_to_bound"] >= 1.0 for r in res["rows"])
    assert main(["offline", "--workload", "mixed", "--n", "5", "--planners", "nope"]) == 2


def test_sim_runs_svf():
    assert main(["run", "--workload", "mixed", "--duration", "5", "--policy", "svf-1bit"]) == 0
