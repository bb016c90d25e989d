"""Engine model: step timing, prefix hits, chunked prefill, memory-bound admission, preemption."""

from __future__ import annotations

import pytest

from fairway.clock import ManualClock
from fairway.engine.model import EngineConfig, EngineModel
from fairway.policies import make_policy
from fairway.policies.hits import HitTracker
from sim.simulator import Simulation
from tests.factories import LinearCost, ListWorkload, chain, spec


def engine(kv_blocks=100, policy="fcfs", budget=8192, max_seqs=256, long_prefill=0, **kw):
    clock = ManualClock()
    cost = LinearCost()
    pol = make_policy(policy, clock=clock, cost=cost, **kw)
    cfg = EngineConfig(kv_blocks=kv_blocks, max_num_batched_tokens=budget, max_num_seqs=max_seqs,
                       long_prefill_token_threshold=long_prefill)
    return EngineModel(cfg, cost, pol, clock), clock


def run(eng, clock, specs):
    sim = Simulation(ListWorkload(specs), [eng], clock)
    return sim.run()


def test_single_request_timeline():
    eng, clock = engine()
    res = run(eng, clock, [spec(0, 0.0, 100, 3, chain("a", 6))])
    (r,) = res.finished
    assert r.first_token_s == pytest.approx(0.11)  # .01 + 100 * .001
    assert r.finished_s == pytest.approx(0.11 + 2 * 0.015)  # two decode steps
    assert r.cached_tokens == 0 and r.admitted_s == 0.0


def test_prefix_hit_skips_cached_tokens():
    eng, clock = engine()
    a = spec(0, 0.0, 100, 2, chain("sys", 4) + chain("a", 2))
    b = spec(1, 1.0, 100, 2, chain("sys", 4) + chain("b", 2))
    res = run(eng, clock, [a, b])
    rb = [r for r in res.finished if r.rid == 1][0]
    assert rb.cached_tokens == 64
    assert rb.ttft_s == pytest.approx(0.01 + 36 * 0.001)


def test_fully_cached_prompt_still_computes_last_token():
    eng, clock = engine()
    a = spec(0, 0.0, 64, 1, chain("s", 4))
    b = spec(1, 1.0, 64, 1, chain("s", 4))
    res = run(eng, clock, [a, b])
    rb = [r for r in res.finished if r.rid == 1][0]
    assert rb.cached_tokens == 48  # (64 - 1) // 16 blocks at most


def test_chunked_prefill_under_token_budget():
    eng, clock = engine(budget=64)
    res = run(eng, clock, [spec(0, 0.0, 200, 1, chain("a", 12))])
    (r,) = res.finished
    assert eng.steps == 4  # 64 + 64 + 64 + 8
    assert r.first_token_s == pytest.approx(4 * 0.01 + 0.2)


@pytest.mark.parametrize(("threshold", "short_first", "long_first"), [(0, 1.01, 1.01), (300, 0.41, 1.035)])
def test_the_long_prefill_threshold_caps_each_request_s_chunk(threshold, short_first, long_first):
    """vLLM's ``long_prefill_token_threshold``: a 900-token prompt and a 100-token one arrive
    together. Uncapped they share one 1,000-token step (1.01 s). Capped at 300, the long one
    computes 300 tokens a step: the short one's first token comes with the first step (0.01 +
    0.4 s), the long one's after two more (0.01 + 0.3 + 0.005 s with the short one's decode, then
    0.31 s: the last, where it is alone and the cap is lifted, has only 300 tokens left)."""
    eng, clock = engine(budget=1000, long_prefill=threshold)
    res = run(eng, clock, [spec(0, 0.0, 900, 2, chain("long", 57)), spec(1, 0.0, 100, 2, chain("s", 7))])
    first = {r.rid: r.first_token_s for r in res.finished}
    assert first == pytest.approx({0: long_first, 1: short_first})
    assert eng.steps == (2 if threshold == 0 else 4)  # each with the decode step that ends them


def test_the_long_prefill_threshold_is_lifted_while_one_request_is_all_there_is():
    """As vLLM does: with nobody to starve, a lone 900-token prompt takes the whole budget in
    one step (0.91 s), not three capped ones (0.93 s)."""
    eng, clock = engine(budget=1000, long_prefill=300)
    (r,) = run(eng, clock, [spec(0, 0.0, 900, 1, chain("long", 57))]).finished
    assert r.first_token_s == pytest.approx(0.91) and eng.steps == 1
    with pytest.raises(ValueError, match="long_prefill_token_threshold"):
        EngineConfig(long_prefill_token_threshold=-1)


def test_memory_bounds_admission():
    eng, clock = engine(kv_blocks=10)
    a = spec(0, 0.0, 100, 20, chain("a", 7))  # 7 prompt blocks, grows to 8
    b = spec(1, 0.0, 100, 2, chain("b", 6))
    res = run(eng, clock, [a, b])
    ra, rb = sorted(res.finished, key=lambda r: r.rid)
    assert rb.admitted_s >= ra.finished_s
    assert res.preemptions == 0


def test_preemption_recomputes_and_everything_finishes():
    eng, clock = engine(kv_blocks=10)
    a = spec(0, 0.0, 64, 60, chain("a", 7))
    b = spec(1, 0.0, 64, 60, chain("b", 7))
    res = run(eng, clock, [a, b])
    assert len(res.finished) == 2 and res.n_unfinished == 0
    ra, rb = sorted(res.finished, key=lambda r: r.rid)
    assert rb.preemptions >= 1 and ra.preemptions == 0  # the newest is the victim
    assert eng.pool.num_free == eng.pool.num_blocks  # nothing leaked


def test_too_long_request_is_rejected_not_stuck():
    eng, clock = engine(kv_blocks=4)
    res = run(eng, clock, [spec(0, 0.0, 100, 2, chain("a", 6)), spec(1, 0.0, 20, 2, chain("b", 1))])
    assert [r.rid for r in res.rejected] == [0] and "KV blocks" in res.rejected[0].rejected
    assert [r.rid for r in res.finished] == [1]


def test_policy_hits_equal_the_engine_cache_during_a_run():
    eng, clock = engine(kv_blocks=40, policy="lpm")
    specs = [spec(i, 0.01 * i, 96 + 16 * (i % 3), 4, chain("sys", 3) + chain(f"u{i % 4}", 5))
             for i in range(30)]
    checked = []
    orig = eng.start_step

    def checked_step():
        tracker: HitTracker = eng.policy._tracker  # the policy's live view
        for rid in list(eng.policy._items):
            q = eng.policy._items[rid]
            want = len(eng.pool.longest_hit(eng.policy._cacheable(q)))
            assert tracker.hit(rid) == want
            checked.append(rid)
        return orig()

    eng.start_step = checked_step
    res = run(eng, clock, specs)
    assert len(res.finished) == 30 and checked


def test_abort_frees_a_waiting_and_a_running_request_at_once():
    """One running mid-prefill (inside a scheduled step) and one waiting behind it for memory:
    aborting both leaves the engine empty, every block free, and the step's end applies nothing."""
    eng, clock = engine(kv_blocks=20, budget=64)
    running = eng.add(spec(0, 0.0, 200, 5, chain("a", 12)))  # 13 blocks, chunked over 4 steps
    waiting = eng.add(spec(1, 0.0, 200, 5, chain("b", 12)))  # cannot fit beside it
    assert eng.start_step() is not None
    assert eng.scheduled == [running] and eng.num_waiting == 1
    assert eng.abort(1) and eng.abort(0)
    assert running.aborted and waiting.aborted
    assert eng.reqs == {} and eng.running == [] and eng.num_waiting == 0
    assert eng.pool.num_free == 20 and not eng.has_work()
    assert eng.finish_step() == [] and running.num_computed == 0
    assert not eng.abort(0)  # gone: a second abort is a no-op


def test_abort_keeps_the_computed_prefix_cached():
    """As vLLM does, the blocks an aborted request completed stay in the prefix cache (free,
    evictable), so the next request with that prefix hits them."""
    eng, clock = engine(kv_blocks=40, budget=64)
    eng.add(spec(0, 0.0, 200, 50, chain("a", 12)))
    for _ in range(2):  # two 64-token chunks: 8 blocks computed and hashed
        clock.advance(eng.start_step())
        eng.finish_step()
    assert eng.abort(0)
    assert eng.pool.num_free == 40
    assert len(eng.pool.longest_hit(chain("a", 12))) == 8


def test_memory_view_is_free_blocks_that_no_waiting_request_needs():
    eng, clock = engine(policy="fairway", guard_loss=0.0)  # the default guard, acting whenever memory binds
    plain, _ = engine(policy="fairway", memory_guard=False)
    assert eng.memory is not None and plain.memory is None  # only a policy that reads it pays for it
    view = eng.memory.spare_blocks
    assert eng.policy._memory is eng.memory and plain.policy._memory is None
    run(eng, clock, [spec(0, 0.0, 160, 1, chain("a", 10))])  # leaves 10 cached free blocks
    assert eng.pool.num_free == 100 and view() == 100 - 10  # a next turn may want them (10 s)
    clock.advance(10.0)
    assert view() == 100  # nobody does
    eng.add(spec(1, clock.now(), 320, 1, chain("a", 20)))  # waits, its first 10 blocks cached
    assert view() == 100 - 10


def test_the_default_guard_keeps_no_counts_while_no_waiting_request_loses_context():
    """The default Fairway (memory guard on, ``guard_loss`` 0.1): a host keeps the view, but it
    counts only while a tenth of the admitted prefill is context lost while waiting. Cold
    prompts in a large pool lose nothing: after the first admission the view keeps its records
    only, and the guard never yields."""
    eng, clock = engine(policy="fairway")
    view = eng.memory
    assert view is not None and view.counting  # nothing admitted yet: 0 lost of 0
    run(eng, clock, [spec(i, 0.01 * i, 160, 1, chain(f"a{i}", 10)) for i in range(6)])
    assert not view.counting and (view.n_held, view.n_wanted) == (0, 0) and eng.policy.yields == 0
