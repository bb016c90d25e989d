"""The host-side KV memory view (fairway/memory_view.py): its counts by hand, and against the
engine model's block table on a memory-bound run."""

from __future__ import annotations

import random

import pytest

from fairway.clock import ManualClock
from fairway.engine.model import EngineConfig, EngineModel
from fairway.memory_view import KVMemoryView
from fairway.policies import make_policy
from tests.factories import LinearCost, chain, spec


def test_a_wanted_hash_is_free_wanted_only_while_no_running_request_holds_it():
    free = [10]
    v = KVMemoryView(lambda: free[0], ManualClock())
    v.want([1, 2, 3])
    assert (v.n_free_wanted, v.spare_blocks()) == (3, 7)
    v.hold([2, 3, 4])  # a running request's prompt holds 2 and 3 (4: not cached, nobody wants it)
    assert (v.n_free_wanted, v.spare_blocks()) == (1, 9)
    assert v.free_cached([1, 2, 3]) == 1
    v.want([1, 2])  # a second waiting request on the same prefix: still one block each
    assert v.n_free_wanted == 1 and v.n_wanted == 3
    v.hold([2])  # two running requests hold 2
    v.release([2, 3, 4])
    assert v.n_free_wanted == 2 and v.free_cached([1, 2, 3]) == 2  # 3 is free now; 2 still held
    v.release([2])
    assert v.n_free_wanted == 3
    v.unwant([1, 2, 3])
    assert v.n_free_wanted == 2  # the second request still wants 1 and 2
    v.unwant([1, 2])
    assert (v.n_free_wanted, v.n_wanted, v.n_held, v.spare_blocks()) == (0, 0, 0, 10)


def test_a_finished_prompt_is_wanted_for_the_horizon_after_it_finished():
    """Between two turns of a conversation nobody waits for its context yet: a finished prompt
    counts as wanted for ``horizon_s``, overlapping prompts once per block."""
    clock = ManualClock()
    v = KVMemoryView(lambda: 100, clock, horizon_s=10.0)
    turn1, turn2 = chain("s", 30), chain("s", 50)  # the second turn continues the first
    v.hold(turn1)
    v.release(turn1)
    v.finished(turn1)
    assert v.spare_blocks() == 70
    clock.advance(4.0)
    v.hold(turn2)  # the next turn runs: its prompt holds all of them
    assert v.spare_blocks() == 100
    v.release(turn2)
    v.finished(turn2)
    assert v.spare_blocks() == 50  # 50 distinct blocks, 30 of them wanted twice
    clock.advance(6.0)  # turn 1's horizon ends: turn 2 still wants all 50
    assert (v.spare_blocks(), v.n_wanted) == (50, 50)
    clock.advance(4.0)
    assert (v.spare_blocks(), v.n_wanted) == (100, 0)
    assert KVMemoryView(lambda: 1, clock).horizon_s == 0.0  # off unless the host asks


def test_an_evicted_block_of_a_finished_prompt_stops_counting_at_once():
    clock = ManualClock()
    v = KVMemoryView(lambda: 100, clock, horizon_s=10.0)
    ctx = chain("s", 30)
    v.finished(ctx)
    v.want(ctx[:10])  # a waiting request hits the first 10 blocks
    v.on_blocks_removed(ctx[20:])  # evicted: nobody can want them from the cache any more
    assert v.spare_blocks() == 80
    v.on_blocks_removed(ctx[5:10])  # the waiting hit's own cut comes from its policy's tracker
    assert v.spare_blocks() == 80
    clock.advance(10.0)
    assert v.spare_blocks() == 90 and v.n_wanted == 10


class _Feeder:
    """A queue's side of the view: its waiting hits, declared while the view counts."""

    def __init__(self, view: KVMemoryView, hits: list[list[int]]) -> None:
        self.view, self.hits, self.feeding = view, hits, False

    def feed_memory(self, on: bool) -> None:
        self.feeding = on
        if on:
            for hit in self.hits:
                self.view.want(hit)


def test_an_on_demand_view_keeps_records_only_and_counts_them_anew_when_needed():
    """Until a reader needs it, the view keeps the recent prompts (the running ones are the
    host's) and no counts; when one does, the counts are those the view would have kept all
    along, the recent prompts counted for their blocks still cached; when nobody does, they are
    dropped."""
    clock = ManualClock()
    cached = set(range(100))
    running: list[list[int]] = []  # the host's running prompts

    def hold(prompt: list[int]) -> None:
        running.append(prompt)
        v.hold(prompt)

    def release(prompt: list[int]) -> None:
        running.remove(prompt)
        v.release(prompt)

    v = KVMemoryView(lambda: 50, clock, horizon_s=10.0, cached=cached.__contains__, running=lambda: running,
                     on_demand=True)
    queue = _Feeder(v, [[1, 2, 3]])
    v.attach_feeder(queue)
    hold([2, 3, 4])
    hold([10, 11])
    release([10, 11])
    v.finished([10, 11])  # recent: wanted for 10 s while cached
    v.finished([20, 21, 22])
    cached.discard(22)  # evicted while nobody counted
    assert (v.counting, queue.feeding, v.n_free_wanted, v.n_held, v.spare_blocks()) == (False, False, 0, 0, 50)
    reader = object()
    v.need(reader, True)
    assert (v.counting, queue.feeding) == (True, True)
    assert v.n_held == 3 and v.n_wanted == 7  # {1, 2, 3} + {10, 11} + {20, 21}
    assert v.n_free_wanted == 5 and v.spare_blocks() == 45  # 2 and 3 are held
    v.need(object(), True)
    v.need(reader, False)  # another reader still needs it
    assert v.counting
    clock.advance(10.0)  # the recent prompts expire
    assert (v.n_wanted, v.n_free_wanted) == (3, 1)
    release([2, 3, 4])
    assert v.n_free_wanted == 3


def test_the_view_needs_a_way_to_recount_before_it_can_be_on_demand():
    with pytest.raises(ValueError, match="cached"):
        KVMemoryView(lambda: 1, ManualClock(), on_demand=True)
    with pytest.raises(ValueError, match="running"):
        KVMemoryView(lambda: 1, ManualClock(), cached=lambda h: True, on_demand=True)


def test_a_release_must_name_a_held_prompt():
    v = KVMemoryView(lambda: 1, ManualClock())
    v.hold([1, 2])
    with pytest.raises(KeyError):
        v.release([1, 3])


@pytest.mark.parametrize("toggle", [False, True], ids=["always", "on-and-off"])
def test_the_view_fed_by_its_host_follows_the_engine_on_a_memory_bound_run(toggle: bool):
    """Sessions on a shared system prompt whose contexts grow turn by turn, in a KV pool that
    holds a few of them: waiting contexts are evicted, requests preempted. At every step the
    view's counts equal its definition computed afresh (each waiting request's hit by a walk of
    the block table; held: the running requests' prompts), and never exceed what the block
    table's reference counts say is free: a block computed twice (two requests prefilling the
    same prefix at once) leaves the table's copy free while a running request holds the same
    content, which the view counts as held (vLLM keeps both copies under one hash). On and off
    (``toggle``: the guard never needs it, a reader needs it now and then): while it counts, the
    same; while it does not, nothing."""
    rng = random.Random(3)
    clock = ManualClock()
    cost = LinearCost()
    pol = make_policy("fairway", clock=clock, cost=cost, memory_guard=True, guard_horizon_s=0.0,
                      guard_loss=1.0 if toggle else 0.0)
    eng = EngineModel(EngineConfig(kv_blocks=300, max_num_batched_tokens=512), cost, pol, clock)
    view = eng.memory
    assert view is not None
    reader, switches, counted = object(), 0, 0
    system = chain("sys", 20)
    context = {s: 0 for s in range(12)}  # session -> context blocks after the system prompt
    rid = checked = 0
    for _ in range(400):
        if rng.random() < 0.5:  # a turn of a random session: its context plus a few new blocks
            s = rng.randrange(12)
            context[s] += rng.randrange(2, 12)
            n = len(system) + context[s]
            eng.add(spec(rid, clock.now(), n * 16 + 5, rng.randrange(20, 120), system + chain(f"s{s}", context[s])))
            rid += 1
        dt = eng.start_step() if eng.has_work() else None
        if dt is not None:
            clock.advance(dt)
            eng.finish_step()
        if toggle and rng.random() < 0.1:
            before = view.counting
            view.need(reader, not before)
            switches += view.counting != before
        if not view.counting:
            assert (view.n_free_wanted, view.n_held, view.n_wanted) == (0, 0, 0)
            checked += 1
            continue
        counted += 1
        pool = eng.pool
        held = {h for r in eng.running for h in r.spec.block_hashes}  # prompt blocks only: output is unhashed here
        wanted_free: set[int] = set()
        table_free: set[int] = set()
        for r in eng.reqs.values():
            if r in eng.running:
                continue
            n = max(0, (r.target - 1) // 16)
            hit = r.spec.block_hashes[: len(pool.longest_hit(r.spec.block_hashes[:n]))]
            assert pol.hit_blocks(r.rid) == len(hit)
            assert view.free_cached(hit) == sum(h not in held for h in hit) <= pool.free_cached(hit)
            wanted_free.update(h for h in hit if h not in held)
            table_free.update(h for h in hit if pool.ref[pool.cached[h]] == 0)
        assert view.n_free_wanted == len(wanted_free) <= len(table_free)
        assert view.spare_blocks() == pool.num_free - len(wanted_free)
        checked += 1
    assert eng.preemptions > 0 and pool.evictions > 0  # the run was memory-bound
    assert checked == 400
    if view.counting:
        assert view.n_held == len({h for r in eng.running for h in r.spec.block_hashes})
    if toggle:  # it counted part of the run, and was switched on and off many times
        assert switches >= 20 and 100 <= counted < 400
    else:
        assert counted == 400
