"""Engine model under random arrivals and aborts at any point, as the ``sim`` engine drives it
(a client may leave while its request waits, runs, or sits in the step in flight between
``start_step`` and ``finish_step``): after every operation the model's bookkeeping is exact and
it stays live.

Checked after each operation: every waiting request's tracked hit (the admission shortcut's
input) equals a fresh walk of the pool; the requests are the running ones plus the waiting ones,
disjoint, and only running ones hold blocks; the pool's reference counts and free queue match
the running requests' blocks; the scheduled step holds running requests only. Liveness: a
``start_step`` on an empty engine with work waiting schedules something, and one that schedules
nothing is followed by one that does (a step that preempted admits nothing, the next one does;
with no host tier nothing else may return None while work waits),
and once arrivals stop every request finishes, with output at least every few steps, leaving
every block free. Seeded, so a failure replays exactly.
"""

from __future__ import annotations

import random

import pytest

from fairway.clock import ManualClock
from fairway.cost_model import DEFAULT_PROFILE, CostModel
from fairway.engine.model import EngineConfig, EngineModel
from fairway.policies import make_policy
from fairway.request import RequestSpec

BS = 16
MASK = (1 << 61) - 1


def hashes(rng: random.Random, n: int) -> tuple[int, ...]:
    """``n`` chained block hashes from a few roots over a two-letter alphabet (with rare
    unique blocks), so prompts share prefixes of every length and outputs can be hit again."""
    h = rng.randrange(3)
    out = []
    for _ in range(n):
        c = rng.randrange(2) if rng.random() < 0.85 else 2 + rng.randrange(10**6)
        h = (h * 1_000_003 + c + 1) & MASK
        out.append(h)
    return tuple(out)


def check(eng: EngineModel, in_step: bool) -> None:
    pool, pol = eng.pool, eng.policy
    for rid, q in pol._items.items():
        assert pol.hit_blocks(rid) == len(pool.longest_hit(pol._cacheable(q))), rid
        assert not eng.reqs[rid].blocks
    running = [r.rid for r in eng.running]
    assert len(set(running)) == len(running) and set(running).isdisjoint(pol._items)
    assert set(eng.reqs) == set(running) | set(pol._items)
    ref = [0] * pool.num_blocks
    for r in eng.running:
        for b in r.blocks:
            ref[b] += 1
        assert len(r.blocks) * BS >= r.num_computed
    assert ref == pool.ref
    assert set(pool.free) == {b for b, n in enumerate(ref) if n == 0}
    assert all(pool.block_hash[b] == h for h, b in pool.cached.items())
    if in_step:
        assert all(r in eng.running and n > 0 for r, n in eng._batch)
    else:
        assert eng._batch == []


def drive(seed: int, policy: str, n_ops: int) -> EngineModel:
    rng = random.Random(seed)
    kv = rng.choice([8, 24, 64, 160])
    clock = ManualClock()
    cost = CostModel.from_profile(DEFAULT_PROFILE)
    cfg = EngineConfig(BS, rng.choice([64, 256, 8192]), rng.choice([2, 256]), kv)
    eng = EngineModel(cfg, cost, make_policy(policy, clock=clock, cost=cost, block_size=BS), clock)
    live: set[int] = set()
    in_step = False
    idle_steps = 0  # start_step calls in a row that scheduled nothing
    for rid in range(n_ops):
        x = rng.random()
        if x < 0.25:  # an arrival, possibly mid-step; one too large for the pool is rejected
            prompt = rng.randint(1, kv * BS)
            out = rng.randint(1, 48)
            s = RequestSpec(rid=rid, arrival_s=clock.now(), prompt_tokens=prompt, output_tokens=out,
                            block_hashes=hashes(rng, (prompt + out) // BS))
            if not eng.add(s).rejected:
                live.add(rid)
            idle_steps = 0
        elif x < 0.4 and live:  # a client leaves: waiting, running, or in the step in flight
            victim = rng.choice(sorted(live))
            assert eng.abort(victim)
            live.discard(victim)
            idle_steps = 0
        elif in_step:
            live -= {r.rid for r in eng.finish_step()}
            in_step = False
        elif eng.has_work():
            empty = not eng.running
            dt = eng.start_step()
            if dt is None:
                # an empty engine has every block free, and ``add`` took only requests that fit
                # the whole pool: its head is always admitted (a lower tracked hit only asks more)
                assert not empty, "an empty engine with work waiting scheduled nothing"
                idle_steps += 1
                assert idle_steps < 2, "start_step scheduled nothing twice with work waiting"
            else:
                idle_steps = 0
                clock.advance(dt)
                in_step = True
        check(eng, in_step)
        assert live == set(eng.reqs)
    if in_step:
        eng.finish_step()
    quiet = 0
    while eng.has_work():  # drain: no more arrivals
        tokens, n = sum(r.generated for r in eng.reqs.values()), len(eng.reqs)
        dt = eng.start_step()
        if dt is None:
            assert eng.start_step() is not None or not eng.has_work()
            eng.finish_step()
            continue
        clock.advance(dt)
        eng.finish_step()
        check(eng, False)
        progressed = len(eng.reqs) < n or sum(r.generated for r in eng.reqs.values()) > tokens
        quiet = 0 if progressed else quiet + 1
        assert quiet < 100, "steps without output"
    assert eng.reqs == {} and eng.pool.num_free == kv
    return eng


@pytest.mark.parametrize("seed", range(6))
def test_random_arrivals_and_aborts_keep_the_model_exact_and_live(seed):
    eng = drive(seed, "fcfs", 700)  # the sim engine's queue
    assert eng.steps > 0


@pytest.mark.parametrize("policy", ["lpm", "fairway"])
def test_the_same_under_reordering_policies(policy):
    drive(11, policy, 700)
