"""PrefixIndex: per-replica longest match, exact LRU aging, feedback, and events == BlockPool."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator

import numpy as np
import pytest

from fairway.engine.block_pool import BlockPool
from fairway.prefix_index import PrefixIndex
from tests.factories import chain

A = chain("a", 8)
B = chain("b", 8)


def check_invariants(idx: PrefixIndex) -> None:
    """Bit j of _where[h] is set iff replica j holds h or h is in flight to j; no hash without a
    holder; in-flight counts are positive."""
    seen: dict[int, int] = {}
    for j in range(idx.num_replicas):
        for h in idx.blocks(j):
            seen[h] = seen.get(h, 0) | (1 << j)
    for j, fly in enumerate(idx._fly):
        for h, n in fly.items():
            assert n > 0
            seen[h] = seen.get(h, 0) | (1 << j)
    assert seen == idx._where
    assert len(idx) == len(seen)


# -- match -------------------------------------------------------------------------------------


def test_match_stops_at_first_miss_per_replica():
    idx = PrefixIndex(4)
    idx.record_routed(0, A[:6])
    idx.record_routed(1, A[:3] + A[4:6])  # holds A[4], A[5] but not A[3]
    idx.record_routed(3, B[:5])
    assert idx.match(A) == [6, 3, 0, 0]
    assert idx.match(B) == [0, 0, 0, 5]
    assert idx.match(A[1:]) == [5, 2, 0, 0]  # a chain is looked up from its head only by callers
    assert idx.match([]) == [0, 0, 0, 0]
    assert [idx.match_one(j, A) for j in range(4)] == [6, 3, 0, 0]
    check_invariants(idx)


def test_match_full_prompt_and_no_replicas():
    idx = PrefixIndex(2)
    idx.record_routed(0, A)
    idx.record_routed(1, A)
    assert idx.match(A) == [8, 8]
    assert PrefixIndex(0).match(A) == []


class CountingDict(dict):
    def __init__(self, *a):
        super().__init__(*a)
        self.probes = 0

    def get(self, k, default=None):
        self.probes += 1
        return super().get(k, default)


def test_match_walk_ends_when_no_replica_matches():
    idx = PrefixIndex(3)
    idx.record_routed(0, A[:2])
    idx.record_routed(1, A[:3])
    idx._where = CountingDict(idx._where)
    assert idx.match(A + B) == [2, 3, 0]
    assert idx._where.probes == 4  # A[0..2] hit, A[3] misses for everyone: stop
    idx._where.probes = 0
    assert idx.match(B) == [0, 0, 0]
    assert idx._where.probes == 1


def test_match_does_not_refresh_ages():
    idx = PrefixIndex(1, capacity_blocks=4)
    idx.record_routed(0, A[:2])
    idx.record_routed(0, B[:2])
    before = list(idx.blocks(0))
    idx.match(A)
    assert list(idx.blocks(0)) == before


# -- approx mode: LRU aging --------------------------------------------------------------------


def test_lru_aging_order_exact():
    idx = PrefixIndex(2, capacity_blocks=4)
    a, b, c = A, B, chain("c", 2)
    # Blocks are touched tail first, so a request's head is its most recent block.
    assert idx.record_routed(0, a[:3]) == 0
    assert list(idx.blocks(0)) == [a[2], a[1], a[0]]
    assert idx.record_routed(0, b[:2]) == 1  # 5 > 4: the oldest, a[2] (a's tail), ages out
    assert list(idx.blocks(0)) == [a[1], a[0], b[1], b[0]]
    assert idx.match(a) == [2, 0]
    assert idx.record_routed(0, a[:1]) == 0  # a routed hit refreshes a[0]
    assert list(idx.blocks(0)) == [a[1], b[1], b[0], a[0]]
    assert idx.record_routed(0, c[:2]) == 2  # a[1] then b[1] age out
    assert list(idx.blocks(0)) == [b[0], a[0], c[1], c[0]]
    assert idx.match(a) == [1, 0]
    assert idx.match(b) == [1, 0]
    assert idx.size(1) == 0
    check_invariants(idx)


def test_approx_touches_equal_a_one_by_one_lru_after_random_operations():
    # the bulk touch (new hashes inserted, then only what needs it moved) against the plain rule:
    # each block touched tail first, oldest dropped past capacity; prompts whose held blocks are
    # the head (the usual case), held blocks in the middle or tail, and a hash twice in a prompt
    rng = np.random.default_rng(11)
    for cap in (None, 3, 17):
        idx = PrefixIndex(2, capacity_blocks=cap)
        ref: list[dict[int, None]] = [{}, {}]
        for _ in range(300):
            j = int(rng.integers(0, 2))
            hashes = [int(x) for x in rng.integers(0, 40, size=int(rng.integers(0, 12)))]
            if rng.random() < 0.5:
                hashes = sorted(set(hashes))  # a chain-like prompt: distinct, head first
            aged = idx.record_routed(j, hashes) if rng.random() < 0.7 else idx.on_feedback(j, hashes, 0, 16)
            before = len(ref[j])
            for h in reversed(hashes):
                ref[j].pop(h, None)
                ref[j][h] = None
            n = max(0, len(ref[j]) - cap) if cap is not None else 0
            for h in list(ref[j])[:n]:
                del ref[j][h]
            assert aged == n, (before, hashes)
            assert list(idx.blocks(j)) == list(ref[j])
        check_invariants(idx)


def test_a_request_longer_than_capacity_keeps_its_head():
    idx = PrefixIndex(1, capacity_blocks=3)
    assert idx.record_routed(0, A) == 5
    assert list(idx.blocks(0)) == [A[2], A[1], A[0]]
    assert idx.match(A) == [3]


def test_capacity_is_per_replica_and_shared_hashes_survive_elsewhere():
    idx = PrefixIndex(2, capacity_blocks=[2, None])
    idx.record_routed(0, A[:2])
    idx.record_routed(1, A[:2])
    idx.record_routed(0, B[:2])  # A ages out of replica 0 only
    assert idx.match(A) == [0, 2]
    assert idx.match(B) == [2, 0]
    assert idx.sizes() == [2, 2]
    check_invariants(idx)


def test_unbounded_by_default_and_bad_arguments():
    idx = PrefixIndex(1)
    idx.record_routed(0, list(range(10_000)))
    assert idx.size(0) == 10_000
    with pytest.raises(ValueError, match="mode"):
        PrefixIndex(1, mode="exact")
    with pytest.raises(ValueError, match="capacities"):
        PrefixIndex(2, capacity_blocks=[1])
    with pytest.raises(ValueError):
        PrefixIndex(1, capacity_blocks=0)


def test_clear_and_add_replica():
    idx = PrefixIndex(2)
    idx.record_routed(0, A[:3])
    idx.record_routed(1, A[:2])
    idx.clear_replica(0)
    assert idx.match(A) == [0, 2]
    assert idx.add_replica(capacity_blocks=2) == 2
    idx.record_routed(2, A[:4])
    assert idx.match(A) == [0, 2, 2]
    check_invariants(idx)


# -- approx mode: feedback ---------------------------------------------------------------------


def test_feedback_refreshes_the_served_prompt_and_keeps_what_it_computed():
    idx = PrefixIndex(2)
    idx.record_routed(0, A[:6])
    idx.record_routed(1, A[:6])
    idx.record_routed(0, B[:1])  # B[0] is now the most recent on 0
    # The engine hit 2 blocks; it recomputed A[2..5], so all six are cached there now.
    assert idx.on_feedback(0, A[:6], cached_tokens=2 * 16 + 5, block_size=16, estimated_blocks=6) == 0
    assert idx.match(A) == [6, 6]
    assert list(idx.blocks(0)) == [B[0], A[5], A[4], A[3], A[2], A[1], A[0]]  # head newest
    check_invariants(idx)


def test_overestimate_shrinks_capacity_and_a_good_estimate_grows_it_back():
    idx = PrefixIndex(1, capacity_blocks=16)
    idx.record_routed(0, B[:6])
    idx.record_routed(0, A[:8])
    assert idx.capacity(0) == 16
    # estimated 8, engine hit 3: it holds less than the index thought; capacity 16 - 5 = 11
    assert idx.on_feedback(0, A[:8], cached_tokens=3 * 16, block_size=16, estimated_blocks=8) == 3
    assert idx.capacity(0) == 11 and list(idx.blocks(0))[:3] == [B[2], B[1], B[0]]
    # a hit as long as estimated: +max(1, 8 // 8) = 1 block
    assert idx.on_feedback(0, A[:8], cached_tokens=8 * 16, block_size=16, estimated_blocks=8) == 0
    assert idx.capacity(0) == 12
    # never below 1/8 of the configured capacity
    idx.on_feedback(0, A[:8], cached_tokens=0, block_size=16, estimated_blocks=100)
    assert idx.capacity(0) == 2 and len(idx) == 2
    check_invariants(idx)


def test_feedback_inserts_reported_hits_the_index_lost():
    idx = PrefixIndex(1, capacity_blocks=3)
    idx.record_routed(0, B[:3])
    assert idx.on_feedback(0, A[:3], cached_tokens=48, block_size=16) == 3
    assert list(idx.blocks(0)) == [A[2], A[1], A[0]]
    assert idx.match(A) == [3] and idx.match(B) == [0]
    check_invariants(idx)


# -- events mode -------------------------------------------------------------------------------


def test_events_mode_ignores_routing_and_feedback():
    idx = PrefixIndex(1, mode="events")
    assert idx.record_routed(0, A) == 0
    assert idx.on_feedback(0, A, 0, 16) == 0
    assert idx.match(A) == [0]
    idx.on_kv_events(0, [(True, A[0]), (True, A[1]), (False, A[1]), (False, B[0])])
    assert idx.match(A) == [1]
    approx = PrefixIndex(1)
    approx.on_kv_events(0, [(True, A[0])])  # no-op in approx mode
    assert approx.match(A) == [0]


def _random_pool_ops(pool: BlockPool, rng: np.random.Generator, ops: int, families: list[list[int]]) -> Iterator[None]:
    """Random admissions (a prefix of a family: hit, allocate, hash most new blocks) and
    releases on ``pool``; yields after each operation that changed it, for the caller's checks."""
    held: list[list[int]] = []
    for _ in range(ops):
        if held and (rng.random() < 0.45 or pool.num_free < 4):
            blocks = held.pop(int(rng.integers(len(held))))
            pool.release(blocks)
        else:
            fam = families[int(rng.integers(len(families)))]
            hashes = fam[: int(rng.integers(1, len(fam) + 1))]
            hit = pool.longest_hit(hashes)
            need = len(hashes) - len(hit)
            if pool.free_after_touch(hit) < need:
                continue
            pool.touch(hit)
            new = pool.allocate(need)
            for b, h in zip(new, hashes[len(hit):], strict=True):
                if rng.random() < 0.9:  # some blocks stay unhashed (never completed)
                    pool.cache_block(b, h)
            held.append(hit + new)
        yield


def _random_pool_run(pool: BlockPool, idx: PrefixIndex, j: int, rng: np.random.Generator, ops: int,
                     families: list[list[int]]) -> None:
    for _ in _random_pool_ops(pool, rng, ops, families):
        idx.on_kv_events(j, pool.drain_events())
        assert set(idx.blocks(j)) == set(pool.cached)
    for fam in families:
        assert idx.match_one(j, fam) == len(pool.longest_hit(fam))


def test_events_mode_equals_block_pool_after_random_operations():
    rng = np.random.default_rng(1234)
    families = [chain(f"f{i}", 6) for i in range(5)] + [chain("f0", 3) + chain("g", 3)]
    idx = PrefixIndex(2, mode="events")
    pools = [BlockPool(14, block_size=4), BlockPool(9, block_size=4)]
    for j, pool in enumerate(pools):
        _random_pool_run(pool, idx, j, rng, 400, families)
    for fam in families:
        assert idx.match(fam) == [len(p.longest_hit(fam)) for p in pools]
    check_invariants(idx)


# -- events mode: routed prompts count as held until they finish ---------------------------------


def test_events_mode_counts_routed_prompts_until_released():
    idx = PrefixIndex(2, mode="events")
    idx.record_routed(1, A[:4])  # routed, nothing computed yet
    assert idx.match(A[:4]) == [0, 4] and idx.match_one(1, A[:6]) == 4 and idx.size(1) == 0
    idx.on_kv_events(1, [(True, h) for h in A[:2]])  # the engine computed two blocks
    idx.record_routed(1, A[:4])  # a sibling in flight too
    idx.release(1, A[:4])
    assert idx.match(A[:4]) == [0, 4]  # the sibling still holds them in flight
    check_invariants(idx)
    idx.on_feedback(1, A[:4], 32, 16)  # the sibling finished (feedback releases in events mode)
    assert idx.match(A[:4]) == [0, 2]  # what remains is what the engine reported stored
    idx.on_kv_events(1, [(False, A[0])])
    assert idx.match(A[:4]) == [0, 0] and idx._fly == [{}, {}]
    check_invariants(idx)


def test_events_mode_removal_keeps_a_block_still_in_flight():
    idx = PrefixIndex(1, mode="events")
    idx.on_kv_events(0, [(True, A[0])])
    idx.record_routed(0, A[:1])
    idx.on_kv_events(0, [(False, A[0])])  # evicted while a request routed there is unfinished
    assert idx.match(A[:1]) == [1]
    idx.release(0, A[:1])
    assert idx.match(A[:1]) == [0] and len(idx) == 0
    check_invariants(idx)


def test_clearing_a_replica_drops_its_flight():
    idx = PrefixIndex(2, mode="events")
    idx.record_routed(0, A[:3])
    idx.record_routed(1, A[:3])
    idx.clear_replica(0)
    assert idx.match(A[:3]) == [0, 3]
    check_invariants(idx)


def test_clearing_a_replica_that_holds_blocks_also_in_flight_there():
    # a replica died while a request routed to it was unfinished, and its engine had already
    # stored that prompt's blocks: each block is both held and in flight on it (and held elsewhere)
    idx = PrefixIndex(2, mode="events")
    idx.on_kv_events(0, [(True, h) for h in A[:3]])
    idx.on_kv_events(1, [(True, h) for h in A[:1]])
    idx.record_routed(0, A[:4])
    idx.clear_replica(0)
    assert idx.match(A[:4]) == [0, 1] and len(idx) == 1
    check_invariants(idx)


def test_approx_mode_release_is_a_no_op():
    idx = PrefixIndex(1)
    idx.record_routed(0, A[:3])
    idx.release(0, A[:3])
    assert idx.match(A[:3]) == [3]


# -- events mode: host-tier hits (tier events) ---------------------------------------------------


# -- approx mode, in-flight prompts pinned ----------------------------------------------------


def test_pinned_prompts_hold_while_in_flight_and_the_free_pool_gets_what_is_left():
    """Capacity 4 blocks. Two prompts of 3 blocks in flight are both held (6 > 4: an engine
    keeps a running request's blocks whatever its cache's size). A finished prompt joins the
    free pool, which holds the capacity less the blocks in flight: 1 block while B runs (A's
    head: the tail goes first), then all of B when it finishes too."""
    idx = PrefixIndex(1, capacity_blocks=4, pin_in_flight=True)
    idx.record_routed(0, A[:3])
    idx.record_routed(0, B[:3])
    assert idx.match(A) == [3] and idx.match(B) == [3] and idx.size(0) == 6 and idx.holds(0, B[2])
    check_invariants(idx)
    assert idx.on_feedback(0, A[:3], 0, block_size=16) == 2
    assert idx.match(A) == [1] and idx.match(B) == [3] and list(idx.blocks(0)) == [A[0]]
    check_invariants(idx)
    assert idx.on_feedback(0, B[:3], 0, block_size=16) == 0
    assert list(idx.blocks(0)) == [A[0], B[2], B[1], B[0]] and idx.match(A) == [1] and idx.size(0) == 4
    check_invariants(idx)


def test_a_routed_prompt_leaves_the_free_pool_and_a_failed_one_is_forgotten():
    """A's blocks in the free pool are in use again once a request with them is routed (held
    once, not twice); a request that ends without a report (``release``) leaves nothing."""
    idx = PrefixIndex(2, capacity_blocks=8, pin_in_flight=True)
    idx.record_routed(0, A[:4])
    idx.on_feedback(0, A[:4], 0, block_size=16)
    assert list(idx.blocks(0)) == A[3::-1] and idx.size(0) == 4
    idx.record_routed(0, A[:6])
    assert list(idx.blocks(0)) == [] and idx.size(0) == 6 and idx.match(A) == [6, 0]
    idx.release(0, A[:6])
    assert idx.match(A) == [0, 0] and idx.size(0) == 0
    check_invariants(idx)


def test_a_block_in_flight_twice_survives_aging_out_of_the_free_pool():
    """Two requests share A's head; the first finishes (its blocks join the free pool while the
    head is still in flight for the second); the pool then ages everything out (capacity 3,
    3 blocks in flight): the shared head is still held, in flight."""
    idx = PrefixIndex(1, capacity_blocks=3, pin_in_flight=True)
    idx.record_routed(0, A[:2])
    idx.record_routed(0, A[:1] + B[:2])
    idx.on_feedback(0, A[:2], 0, block_size=16)
    assert list(idx.blocks(0)) == [] and idx.match(A) == [1] and idx.match(A[:1] + B[:2]) == [3]
    check_invariants(idx)


def test_pinned_approx_equals_a_one_by_one_model_after_random_operations():
    """Random routings, reports and failures on 3 replicas (capacity 12 blocks, prompts from
    three families sharing heads, some with a block twice, and reports of prompts never routed)
    against a plain model: per replica, counts of the prompts in flight and a free pool (an
    OrderedDict touched block by block, tail first, aged to the capacity less the blocks in
    flight)."""
    rng = np.random.default_rng(7)
    fams = [chain(f, 10) for f in "xyz"]
    stray = chain("w", 10)  # blocks never routed
    idx = PrefixIndex(3, capacity_blocks=12, pin_in_flight=True)
    fly: list[dict[int, int]] = [{} for _ in range(3)]
    pool: list[OrderedDict[int, None]] = [OrderedDict() for _ in range(3)]
    live: list[tuple[int, list[int]]] = []

    def age(j: int) -> None:
        while len(pool[j]) > max(0, 12 - len(fly[j])):
            pool[j].popitem(last=False)

    def prompt() -> list[int]:
        hs = fams[int(rng.integers(3))][: int(rng.integers(1, 11))]
        return hs + hs[:2] if rng.random() < 0.15 else hs  # a block twice

    for _ in range(1500):
        op = rng.integers(4)
        if op == 3:  # a report of a prompt never routed there (nothing leaves flight)
            j, hs = int(rng.integers(3)), stray[: int(rng.integers(1, 11))]
            idx.on_feedback(j, hs, 0, block_size=16)
            for h in reversed(hs):
                pool[j][h] = None
                pool[j].move_to_end(h)
            age(j)
            check_invariants(idx)
            continue
        if op == 0 or not live:
            j, hs = int(rng.integers(3)), prompt()
            idx.record_routed(j, hs)
            for h in hs:
                fly[j][h] = fly[j].get(h, 0) + 1
                pool[j].pop(h, None)
            age(j)
            live.append((j, hs))
            continue
        j, hs = live.pop(int(rng.integers(len(live))))
        for h in hs:
            fly[j][h] -= 1
            if not fly[j][h]:
                del fly[j][h]
        if op == 1:
            idx.on_feedback(j, hs, 0, block_size=16)
            for h in reversed(hs):
                pool[j][h] = None
                pool[j].move_to_end(h)
            age(j)
        else:
            idx.release(j, hs)
        check_invariants(idx)
        for f in fams:
            want = []
            for k in range(3):
                n = 0
                while n < len(f) and (f[n] in fly[k] or f[n] in pool[k]):
                    n += 1
                want.append(n)
            assert idx.match(f) == want
        assert [list(idx.blocks(k)) for k in range(3)] == [list(p) for p in pool]


def test_match_tiers_splits_gpu_and_host_hits_per_replica():
    idx = PrefixIndex(4, mode="events")
    for j, n in ((0, 8), (1, 8), (2, 5), (3, 0)):
        idx.on_kv_events(j, [(True, h) for h in A[:n]])
    idx.on_tier_events(1, [(True, h) for h in A[3:8]])  # 3 GPU + 5 host
    idx.on_tier_events(2, [(True, A[0])])  # its whole match sits behind a host-only head block
    idx.on_tier_events(0, [(True, A[6]), (True, A[4])])  # first host-only block: A[4]
    matched, host = idx.match_tiers(A)
    assert matched == idx.match(A) == [8, 8, 5, 0]
    assert host == [4, 5, 5, 0]
    assert idx.match_tiers(A[:4]) == ([4, 4, 4, 0], [0, 1, 4, 0])
    assert idx.match_tiers(B) == ([0, 0, 0, 0], [0, 0, 0, 0])
    assert idx.host_only(1) == set(A[3:8])


def test_tier_events_back_on_the_gpu_and_dropped():
    idx = PrefixIndex(2, mode="events")
    idx.on_kv_events(0, [(True, h) for h in A[:4]])
    idx.on_tier_events(0, [(True, A[1]), (True, A[2])])
    assert idx.match_tiers(A[:4]) == ([4, 0], [3, 0])
    idx.on_tier_events(0, [(False, A[1])])  # reloaded: a GPU hit again
    assert idx.match_tiers(A[:4]) == ([4, 0], [2, 0])
    idx.on_kv_events(0, [(False, A[2])])  # dropped from the host tier: both streams say so
    idx.on_tier_events(0, [(False, A[2]), (False, A[2])])  # a repeated removal is ignored
    assert idx.match_tiers(A[:4]) == ([2, 0], [0, 0])
    assert idx._hwhere == {} and idx.host_only(0) == set()


def test_tier_split_with_a_shared_host_only_hash_and_flight():
    idx = PrefixIndex(2, mode="events")
    for j in (0, 1):
        idx.on_kv_events(j, [(True, h) for h in A[:3]])
        idx.on_tier_events(j, [(True, A[2])])
    idx.record_routed(1, A[:6])  # in flight: counts as held, GPU (not host-only)
    assert idx.match_tiers(A) == ([3, 6], [1, 4])
    idx.on_tier_events(0, [(False, A[2])])
    assert idx._hwhere == {A[2]: 0b10}
    assert idx.match_tiers(A) == ([3, 6], [0, 4])


def test_tier_state_is_cleared_and_snapshotted():
    idx = PrefixIndex(2, mode="events")
    idx.on_kv_events(0, [(True, h) for h in A[:4]])
    idx.on_tier_events(0, [(True, A[3])])
    idx.replace_blocks(0, A[:3])  # A[3] is no longer held at all: its host-only mark goes too
    assert idx.host_only(0) == set() and idx._hwhere == {}
    idx.replace_blocks(0, A[:3], host_only=[A[1]])
    assert idx.match_tiers(A) == ([3, 0], [2, 0])
    idx.clear_replica(0)
    assert idx._hwhere == {} and idx.match_tiers(A) == ([0, 0], [0, 0])


def test_approx_mode_has_no_tier_information():
    idx = PrefixIndex(2)
    idx.record_routed(0, A[:4])
    idx.on_tier_events(0, [(True, A[0])])  # no-op in approx mode
    idx.replace_blocks(0, A[:4], host_only=[A[0]])  # no-op in approx mode
    assert idx.match_tiers(A) == ([4, 0], [0, 0])


def test_events_mode_tiers_equal_block_pool_with_a_host_tier_after_random_operations():
    rng = np.random.default_rng(7)
    families = [chain(f"f{i}", 6) for i in range(5)] + [chain("f0", 3) + chain("g", 3)]
    idx = PrefixIndex(2, mode="events")
    pools = [BlockPool(14, block_size=4, host_blocks=10), BlockPool(9, block_size=4, host_blocks=4)]
    for j, pool in enumerate(pools):
        for _ in _random_pool_ops(pool, rng, 400, families):
            idx.on_kv_events(j, pool.drain_events())
            idx.on_tier_events(j, pool.drain_tier_events())
            assert set(idx.blocks(j)) == set(pool.cached) | set(pool.host)
            assert idx.host_only(j) == set(pool.host) - set(pool.cached)
    for fam in families:
        matched, host = idx.match_tiers(fam)
        for j, pool in enumerate(pools):
            gpu = len(pool.longest_hit(fam))
            total = gpu + pool.host_hit(fam, gpu)
            first_host = next((i for i, h in enumerate(fam) if h in pool.host and h not in pool.cached), len(fam))
            assert matched[j] >= total  # the index also counts GPU blocks after a host-only one
            assert matched[j] - host[j] == min(first_host, matched[j])
    check_invariants(idx)
