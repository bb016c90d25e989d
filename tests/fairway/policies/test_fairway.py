"""Fairway's lanes: promotion, lane orders, and the stride split of capacity."""

from __future__ import annotations

import pytest

from fairway.memory_view import KVMemoryView
from fairway.policies import FAIR, FAST, FairwayConfig
from tests.factories import chain, policy_with_cache, queued

# The design's lane semantics with round numbers: theta 8, floor .25, shares .75 / .25, and the
# Fast lane picking among requests not yet promoted. Tests of the defaults say so explicitly.
CLASSIC = {"theta": 8.0, "p_floor_s": 0.25, "fair_share": 0.75, "fast_scope": "unpromoted"}


def fairway(**kw):
    return policy_with_cache("fairway", set(), **{**CLASSIC, **kw})


def test_promotion_at_theta_times_own_prefill_time_with_floor():
    p, clock = fairway(theta=2.0, p_floor_s=0.05)
    p.add(queued(0, 0.0, 1000, chain("big", 62)))  # P = 1.01 s -> due at 2.02 s
    p.add(queued(1, 0.0, 30, chain("small", 1)))  # P = .04 < floor .05 -> due at 0.1 s
    clock.set(0.099)
    p.refresh_lanes()
    assert p.lane_sizes() == {FAST: 2, FAIR: 0}
    clock.set(0.1)
    p.refresh_lanes()
    assert p.lane_sizes() == {FAST: 1, FAIR: 1}
    clock.set(2.02)
    p.refresh_lanes()
    assert p.lane_sizes() == {FAST: 0, FAIR: 2} and p.promotions == 2
    assert p.promoted_at[:2].tolist() == pytest.approx([2.02, 0.1])


def test_fast_lane_is_least_uncached_work_and_fair_lane_is_highest_ratio():
    p, clock = fairway(theta=8.0, p_floor_s=0.25)
    # fast lane at t=10: both arrived at 9.9, not yet due
    p.add(queued(0, 9.9, 500, chain("f0", 31)))
    p.add(queued(1, 9.9, 100, chain("f1", 6)))
    # fair lane: r2 waited 10 s with P=1.01 (ratio ~9.9); r3 waited 5 s with P floor .25 (20)
    p.add(queued(2, 0.0, 1000, chain("a", 62)))
    p.add(queued(3, 5.0, 30, chain("b", 1)))
    clock.set(10.0)
    p.refresh_lanes()
    assert p.lane_sizes() == {FAST: 2, FAIR: 2}
    order = []
    lanes = []
    while len(p):
        r = p.select()
        adm = p.admit(r.rid)
        order.append(r.rid)
        lanes.append(adm.lane)
    # stride: fair first (tie), then fast (pass 0), then fair again ...
    assert order == [3, 1, 2, 0]
    assert lanes == [FAIR, FAST, FAIR, FAST]


def test_stride_split_follows_the_shares():
    p, clock = fairway(fair_share=0.7)  # theta 8, floor .25
    for i in range(4):  # fair lane: promoted, equal P = 0.1 s, oldest first by ratio
        p.add(queued(i, 0.1 * i, 90, chain(f"fair{i}", 5)))
    for i in range(4, 8):  # fast lane: not due (9.9 + 8 * .25 > 10)
        p.add(queued(i, 9.9, 90, chain(f"fast{i}", 5)))
    clock.set(10.0)
    lanes = []
    while len(p):
        adm = p.admit(p.select().rid)
        lanes.append(adm.lane)
    # passes: fair += .1/.7 (.143, .286, .429, .571), fast += .1/.3 (.333, .667, ...)
    assert lanes == [FAIR, FAST, FAIR, FAIR, FAST, FAIR, FAST, FAST]


def test_a_lane_that_was_empty_banks_no_credit():
    p, clock = fairway()
    for i in range(10):
        p.add(queued(i, 9.9, 90, chain(f"fast{i}", 5)))
    clock.set(10.0)
    for _ in range(6):
        p.admit(p.select().rid)
    assert p.passes[FAST] == pytest.approx(6 * 0.1 / 0.25)
    # two requests reach the Fair lane now; it restarts at the Fast lane's pass
    p.add(queued(100, 0.0, 90, chain("late0", 5)))
    p.add(queued(101, 0.0, 90, chain("late1", 5)))
    lanes = [p.admit(p.select().rid).lane for _ in range(4)]
    # with banked credit (pass 0) the Fair lane would take both first: [FAIR, FAIR, FAST, FAST]
    assert lanes == [FAIR, FAST, FAIR, FAST]


def test_empty_lane_gives_the_other_everything():
    p, clock = fairway()
    for i in range(3):
        p.add(queued(i, 9.9, 90, chain(f"x{i}", 5)))
    clock.set(10.0)
    assert [p.admit(p.select().rid).lane for _ in range(3)] == [FAST] * 3


def test_fast_lane_sees_promoted_requests_by_default():
    """Under overload everything is promoted; with fast_scope="all" the Fast lane still admits
    the least-work request of the whole queue for its share, so cheap requests keep moving."""
    p, clock = policy_with_cache("fairway", set())  # defaults: fast_scope all, share .6
    assert FairwayConfig().fast_scope == "all"
    p.add(queued(0, 0.0, 1000, chain("big", 62)))  # P 1.01, due 12 * 1.01
    p.add(queued(1, 5.0, 50, chain("small", 3)))  # P .06 -> floor .1, due 6.2
    clock.set(20.0)
    p.refresh_lanes()
    assert p.lane_sizes() == {FAST: 0, FAIR: 2}
    first = p.admit(p.select().rid)  # Fair lane (tie on pass): earliest deadline is r1
    assert (first.rid, first.lane) == (1, FAIR)
    p.add(queued(2, 19.0, 50, chain("small2", 3)))  # not promoted yet, cheap
    second = p.admit(p.select().rid)  # Fast lane's turn: least work of all waiting
    assert (second.rid, second.lane) == (2, FAST)
    third = p.admit(p.select().rid)
    assert (third.rid, third.lane, third.promoted) == (0, FAIR, True)


def test_deadline_never_moves_later_on_eviction():
    cache: set[int] = set(chain("d", 30))
    p, clock = policy_with_cache("fairway", cache, **CLASSIC)
    p.add(queued(0, 0.0, 500, chain("d", 31)))  # 480 of 500 cached
    due = p.due[0]
    cache.clear()
    p.on_blocks_removed(chain("d", 30)[:1])
    assert p.cached_tokens(0) == 0 and p.due[0] == due
    cache2: set[int] = set(chain("d", 30))
    p2, _ = policy_with_cache("fairway", cache2, **CLASSIC, sticky_due=False)
    p2.add(queued(0, 0.0, 500, chain("d", 31)))
    cache2.clear()
    p2.on_blocks_removed(chain("d", 30)[:1])
    assert p2.due[0] > due  # recomputed from the now-cold P


def _after_eviction(evicted: list[int], still: set[int] | None = None, **kw):
    """CLASSIC Fairway remembering evictions (``lost_blocks``, ``lost_scope="evicted"``) over a cache that
    held ``evicted`` and dropped them (one event each, in order), keeping ``still``."""
    cache: set[int] = set(still or ()) | set(evicted)
    p, clock = policy_with_cache("fairway", cache, **{**CLASSIC, "lost_blocks": 65536, "lost_scope": "evicted", **kw})
    for h in evicted:
        cache.discard(h)
        p.on_blocks_removed([h])
    return p, clock


def test_deadline_counts_the_prefix_evicted_before_arrival_as_cached():
    # 480 of the prompt's 500 tokens were computed here and evicted before it arrived: its
    # deadline is that of a 20-token prefill (P = .03 -> floor .25: 0 + 8 * .25), its Fast-lane
    # work stays the cold 500 tokens'
    p, _ = _after_eviction(chain("d", 30))
    p.add(queued(0, 0.0, 500, chain("d", 31)))
    assert p.cached_tokens(0) == 0 and p.prefill_s[0] == pytest.approx(0.51)
    assert p.due[0] == pytest.approx(2.0) and p.lost_credits == 1
    cold, _ = _after_eviction(chain("d", 30), lost_blocks=0)  # no memory: the cold deadline
    cold.add(queued(0, 0.0, 500, chain("d", 31)))
    assert cold.due[0] == pytest.approx(8 * 0.51) and cold.lost_credits == 0


def test_the_lost_prefix_joins_the_cached_blocks_and_stops_at_the_first_block_never_held():
    # blocks 0-9 cached, 10-19 evicted, 20 never held, 21-29 evicted: 20 blocks (320 tokens) count
    d = chain("d", 30)
    p, _ = _after_eviction(d[10:20] + d[21:], still=set(d[:10]))
    p.add(queued(0, 1.0, 800, d + chain("e", 20)))
    assert p.cached_tokens(0) == 160  # due 1 + 8 * .65 without the credit
    assert p.due[0] == pytest.approx(1.0 + 8 * (0.01 + 0.001 * 480))
    # a prompt none of whose blocks this replica ever held gets no credit
    p.add(queued(1, 1.0, 500, chain("x", 31)))
    assert p.due[1] == pytest.approx(1.0 + 8 * 0.51) and p.lost_credits == 1


def test_the_lost_memory_forgets_the_oldest_evictions_past_lost_blocks():
    d = chain("d", 10)
    p, _ = _after_eviction(d, lost_blocks=5)  # remembers d[5:10] only
    assert p.evicted.oldest_first() == d[5:]
    p.add(queued(0, 0.0, 400, d + chain("e", 15)))  # block 0 forgotten: no credit
    assert p.due[0] == pytest.approx(8 * 0.41) and p.lost_credits == 0
    p.on_blocks_removed([d[5]])  # evicted again: the newest
    assert p.evicted.oldest_first() == d[6:] + [d[5]]
    # without the sticky deadline there is nothing to pull in, and nothing is remembered
    q, _ = _after_eviction(d, sticky_due=False)
    assert q.evicted is None


def test_the_turns_scope_credits_only_a_prompt_that_continues_one_admitted_here():
    # lost_scope="turns" remembers the last block of each admitted prompt, not evicted blocks:
    # a follow-up turn whose earlier turn ran here (and whose context was then evicted) counts
    # that context as cached, up to the earlier prompt's end; a prompt that only shares a prefix
    # with what ran here (its shared blocks evicted too) gets no credit
    cache: set[int] = set()
    p, clock = policy_with_cache("fairway", cache, **CLASSIC)  # the defaults: 65,536 prompt ends
    assert (p.config.lost_blocks, p.config.lost_scope) == (65536, "turns")
    sys_prompt, turn1 = chain("s", 10), chain("t", 20)
    p.add(queued(0, 0.0, 481, sys_prompt + turn1))  # 30 cacheable blocks: the last is its end
    p.admit(p.select().rid)
    cache.update(sys_prompt + turn1)
    p.on_blocks_stored(sys_prompt + turn1)
    cache.clear()
    p.on_blocks_removed(sys_prompt + turn1)  # context evicted between turns
    assert p.evicted.oldest_first() == [turn1[-1]]  # the eviction itself is not remembered
    clock.set(1.0)
    p.add(queued(1, 1.0, 800, sys_prompt + turn1 + chain("u", 20)))  # the follow-up turn
    due = p.due[p._slot_of[1]]  # a 320-token prefill's: 1 + 8 * .33, not the cold 1 + 8 * .81
    assert p.cached_tokens(1) == 0 and due == pytest.approx(1.0 + 8 * (0.01 + 0.001 * 320))
    p.add(queued(2, 1.0, 500, sys_prompt + chain("v", 21)))  # shares the system prompt only
    assert p.due[p._slot_of[2]] == pytest.approx(1.0 + 8 * 0.51) and p.lost_credits == 1
    with pytest.raises(ValueError, match="lost_scope"):
        FairwayConfig(lost_scope="shared")


def test_hit_changes_reorder_the_fast_lane():
    cache: set[int] = set()
    p, clock = policy_with_cache("fairway", cache)
    p.add(queued(0, 0.0, 300, chain("a", 18)))
    p.add(queued(1, 0.0, 400, chain("b", 25)))
    assert p.select().rid == 0
    cache.update(chain("b", 24))
    p.on_blocks_stored(chain("b", 24))
    assert p.select().rid == 1  # now only 16 tokens uncached


def test_config_bounds():
    with pytest.raises(ValueError):
        FairwayConfig(theta=0)
    with pytest.raises(ValueError):
        FairwayConfig(fair_share=1.0)
    with pytest.raises(ValueError):
        FairwayConfig(fair_order="oldest")
    with pytest.raises(ValueError, match="guard_aging"):
        FairwayConfig(guard_aging=-1.0)
    for bad in (-0.1, 1.0):
        with pytest.raises(ValueError, match="fast_ahead"):
            FairwayConfig(fast_ahead=bad)
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="lost_blocks"):
            FairwayConfig(lost_blocks=bad)


def _guarded(spare: list[int], cached: set[int], held: frozenset[int] = frozenset(), **options):
    """Defaults plus the memory guard acting whenever memory binds, with a memory view whose host reports as many free
    blocks as keep ``spare[0]`` of them needed by no waiting request; the cached blocks in
    ``held`` are held by running requests."""
    options.setdefault("guard_loss", 0.0)  # whenever memory binds, unless a test says otherwise
    options.setdefault("fast_ahead", 0.0)  # the guard alone reorders (fast_ahead would let the warm picks by too)
    p, clock = policy_with_cache("fairway", cached, memory_guard=True, **options)
    view = KVMemoryView(lambda: spare[0] + view.n_free_wanted, clock)
    p.attach_memory(view)
    view.hold(held)
    return p, clock


def _cold_head_and_two_warm(p, clock):
    p.add(queued(0, 0.0, 1600, chain("cold", 100)))  # 100 new blocks, nothing cached: due 19.32
    p.add(queued(1, 25.0, 336, chain("w1", 21)))  # 20 of 21 blocks cached: 1 new block
    p.add(queued(2, 25.0, 336, chain("w2", 21)))
    clock.set(30.0)  # all three promoted; the Fair lane's head (EDF) is the cold r0


def test_memory_guard_lets_warm_requests_pass_a_cold_fair_head_only_when_memory_binds():
    warm = set(chain("w1", 20)) | set(chain("w2", 20))
    order, acts = {}, {}
    for spare in (0, 99, 100):
        p, clock = _guarded([spare], set(warm))
        _cold_head_and_two_warm(p, clock)
        order[spare] = [(a.rid, a.lane) for a in (p.admit(p.select().rid) for _ in range(3))]
        acts[spare] = p.guard_acts
    assert acts == {0: 2, 99: 2, 100: 0}  # the decisions it changed: the two yields
    # spare 0 or 99: r0 would evict 100 - spare > 0 blocks of others and keeps none of its own;
    # each warm pick keeps 20 and needs 1: they go first, on the Fast lane's account
    assert order[0] == order[99] == [(1, FAST), (2, FAST), (0, FAIR)]
    # 100 spare blocks: r0 evicts nobody's context, so the lanes decide as without the guard
    assert order[100] == [(0, FAIR), (1, FAST), (2, FAST)]
    p, clock = policy_with_cache("fairway", set(warm), fast_ahead=0.0)  # no guard (and no memory view)
    _cold_head_and_two_warm(p, clock)
    assert [p.admit(p.select().rid).rid for _ in range(3)] == [0, 1, 2]


def test_memory_guard_with_guard_overdue_acts_only_while_that_share_of_the_queue_is_promoted():
    """A cold head (due 19.32) and two warm requests that arrived at 19 (due 20.2). At t = 30 all
    three are promoted (share 1.0): the guard acts at guard_overdue 0.75 as at 0. At t = 20 only
    the cold head is (share 1/3): at 0.75 the lanes decide as without the guard, at 0.3 the
    guard acts."""
    warm = set(chain("w1", 20)) | set(chain("w2", 20))
    for overdue, at, expected in ((0.75, 30.0, [1, 2, 0]), (0.75, 20.0, [0, 1, 2]), (0.3, 20.0, [1, 2, 0])):
        p, clock = _guarded([0], set(warm), guard_overdue=overdue)
        p.add(queued(0, 0.0, 1600, chain("cold", 100)))
        p.add(queued(1, 19.0, 336, chain("w1", 21)))
        p.add(queued(2, 19.0, 336, chain("w2", 21)))
        clock.set(at)
        assert [p.admit(p.select().rid).rid for _ in range(3)] == expected, (overdue, at)


def test_memory_guard_does_not_yield_to_a_pick_that_also_destroys_more_than_it_keeps():
    p, clock = _guarded([0], set())
    p.add(queued(0, 0.0, 1600, chain("cold", 100)))  # Fair head, due 19.32
    p.add(queued(1, 25.0, 160, chain("small", 10)))  # Fast pick: cold too, 10 new blocks
    clock.set(30.0)
    assert [(a.rid, a.lane) for a in (p.admit(p.select().rid) for _ in range(2))] == [(0, FAIR), (1, FAST)]
    assert p.yields == 0


def test_memory_guard_counts_only_the_hit_that_waiting_puts_at_risk():
    """A request whose hit is a prefix that running requests hold (a new session's first turn on
    the shared system prompt) saves nothing by going first: it does not pass the cold head."""
    shared = chain("sys", 20)
    p, clock = _guarded([0], set(shared), held=frozenset(shared))
    p.add(queued(0, 0.0, 1600, chain("cold", 100)))  # Fair head, due 19.32
    p.add(queued(1, 25.0, 336, shared + chain("new", 1)))  # 20 blocks cached, all held: 1 new
    clock.set(30.0)
    assert [(a.rid, a.lane) for a in (p.admit(p.select().rid) for _ in range(2))] == [(0, FAIR), (1, FAST)]
    assert p.yields == 0


def test_memory_guard_orders_the_fast_lane_by_cache_kept_when_memory_binds():
    """The least-work pick (a first turn on a held shared prefix) would only take memory; when
    it does not fit in the spare blocks, the Fast lane takes the longest cached prefix instead."""
    shared = chain("sys", 20)
    warm = chain("w", 30)
    order = {}
    for spare in (0, 10):
        p, clock = _guarded([spare], set(shared) | set(warm), held=frozenset(shared))
        p.add(queued(0, 0.0, 336, shared + chain("new", 1)))  # 1 new block, saves nothing
        p.add(queued(1, 0.0, 640, warm + chain("w-new", 10)))  # 30 own blocks at risk, 10 new
        order[spare] = [(a.rid, a.lane) for a in (p.admit(p.select().rid) for _ in range(2))]
        assert p.guard_acts == (1 if spare == 0 else 0)  # one Fast-lane pick changed, no yield
    assert order[0] == [(1, FAST), (0, FAST)]
    assert order[10] == [(0, FAST), (1, FAST)]  # r0 fits in the spare blocks: least work first


def test_fast_ahead_and_the_guard_share_one_fast_alternative_per_decision():
    """On the Fair lane's turn both ``fast_ahead`` and the guard look at the Fast lane's pick; it
    is worked out once, so the guard's act on it (the least-work pick evicts, the most cached one
    is taken) counts once, as without ``fast_ahead``."""
    shared, warm = chain("sys", 20), chain("w", 30)
    seen = {}
    for ahead in (0.0, 0.1):
        p, clock = _guarded([0], set(shared) | set(warm), held=frozenset(shared), fast_ahead=ahead)
        p.add(queued(9, 0.0, 1600, chain("cold", 100)))  # the Fair head once promoted: evicts 100 blocks
        p.add(queued(0, 25.0, 336, shared + chain("new", 1)))  # least work, saves nothing
        p.add(queued(1, 25.0, 640, warm + chain("w-new", 10)))  # 30 own blocks at risk
        clock.set(30.0)
        seen[ahead] = (p.select().rid, p.guard_acts)
    assert seen == {0.0: (1, 2), 0.1: (1, 2)}


def test_memory_guard_with_aging_lets_an_overdue_head_through_once_it_is_late_enough():
    """A cold head r0 (due 19.32, 100 new blocks, no spare block: it evicts) and two warm
    requests (20 of 21 blocks cached, 320 tokens) that arrived 0.5 s before ``at``, not yet due.
    With ``guard_aging`` 50 the evicting pick gives way to the most cached tokens + 50 per
    second late: at 24 r0 is 4.68 s late (234 < 320), so the warm requests go first; at 29 it is
    9.68 s late (484 > 320) and goes first. The yielding guard (``guard_aging=0``) holds r0
    back at 29 too, however late it is; with 100 spare blocks r0 evicts nothing and the lanes
    decide."""
    warm = set(chain("w1", 20)) | set(chain("w2", 20))
    runs = {}
    for aging, spare, at in ((50.0, 0, 24.0), (50.0, 0, 29.0), (0.0, 0, 29.0), (50.0, 100, 24.0)):
        p, clock = _guarded([spare], set(warm), guard_aging=aging)
        p.add(queued(0, 0.0, 1600, chain("cold", 100)))
        p.add(queued(1, at - 0.5, 336, chain("w1", 21)))
        p.add(queued(2, at - 0.5, 336, chain("w2", 21)))
        clock.set(at)
        runs[aging, spare, at] = ([(a.rid, a.lane) for a in (p.admit(p.select().rid) for _ in range(3))],
                                  p.guard_acts, p.yields)
    assert runs == {
        (50.0, 0, 24.0): ([(1, FAST), (2, FAST), (0, FAIR)], 2, 2),  # two evicting picks of r0 replaced
        (50.0, 0, 29.0): ([(0, FAIR), (1, FAST), (2, FAST)], 0, 0),  # r0 is its own aged pick
        (0.0, 0, 29.0): ([(1, FAST), (2, FAST), (0, FAIR)], 2, 2),  # two yields
        (50.0, 100, 24.0): ([(0, FAIR), (1, FAST), (2, FAST)], 0, 0),  # nothing evicted: the lanes' order
    }


@pytest.mark.parametrize("sticky", [True, False])
def test_a_folded_eviction_cut_leaves_the_columns_of_one_change_per_step(sticky):
    """Fairway folds an eviction batch's cut (HitTracker's path) into one update: cached tokens,
    P and the deadline end as the base class's one _on_hit_change per step leaves them."""
    import random

    from fairway.cost_model import CostModel
    from fairway.policies.base import QueuePolicy

    rng = random.Random(7)
    cost = CostModel.from_profile()  # P is not monotone in the hit everywhere: the fold takes the min
    folded, _ = policy_with_cache("fairway", set(), cost=cost, **{**CLASSIC, "sticky_due": sticky})
    stepped, _ = policy_with_cache("fairway", set(), cost=cost, **{**CLASSIC, "sticky_due": sticky})
    for rid in range(40):
        n = rng.randrange(2, 400)
        prompt, arrival = n * 16 + rng.randrange(1, 16), rng.random()
        for p in (folded, stepped):
            p.add(queued(rid, arrival, prompt, chain(f"r{rid}", n)))
        old = n
        path = sorted(rng.sample(range(old), min(old, rng.randrange(1, 6))), reverse=True)
        folded._on_hit_cut(rid, old, path)
        QueuePolicy._on_hit_cut(stepped, rid, old, path)
    for col in ("cached", "prefill_s", "due"):
        assert getattr(folded, col).tolist() == getattr(stepped, col).tolist()


def test_memory_guard_with_guard_loss_acts_only_while_waiting_requests_lose_their_cached_context():
    """guard_loss 0.5: the guard acts while at least half of the recently admitted prefill is
    context the requests had cached while waiting and lost before admission. A first admission
    that lost nothing turns it off (the cold head goes first, as without the guard); one whose
    20 cached blocks were evicted while it waited turns it on (the warm requests pass)."""
    warm = set(chain("w1", 20)) | set(chain("w2", 20))
    orders = {}
    for lost in (False, True):
        cache = set(warm) | set(chain("x", 20))
        p, clock = _guarded([0], cache, guard_loss=0.5)
        p.add(queued(9, 0.0, 336, chain("x", 21)))  # 20 blocks cached at arrival
        if lost:
            cache -= set(chain("x", 20))
            p.on_blocks_removed(chain("x", 20)[::-1])  # evicted tail first while it waits
        assert p.admit(p.select().rid).rid == 9
        _cold_head_and_two_warm(p, clock)
        orders[lost] = [p.admit(p.select().rid).rid for _ in range(3)]
    assert orders == {False: [0, 1, 2], True: [1, 2, 0]}


def _big_due_and_cheap(p, clock, n_cheap: int, cheap_tokens: int = 50):
    p.add(queued(0, 0.0, 1000, chain("big", 62)))  # P 1.01, due at 12.12: promoted at t = 20
    for i in range(1, n_cheap + 1):  # arrived at 19.0: due at 20.2 or later, still in the Fast lane
        p.add(queued(i, 19.0, cheap_tokens, chain(f"c{i}", -(-cheap_tokens // 16))))
    clock.set(20.0)


def _drain(p) -> list[tuple[int, str]]:
    out = []
    while len(p):
        a = p.admit(p.select().rid)
        out.append((a.rid, a.lane))
    return out


def test_fast_ahead_lets_much_lighter_fast_picks_precede_the_fair_pick_within_one_fair_quantum():
    """A Fair pick that an engine admits first takes its step's whole token budget, so light
    requests behind it wait a step; with fast_ahead they go first, charged to the Fast lane,
    while the Fast lane stays within one Fair quantum (P 1.01 / share 0.6 = 1.683) of the Fair
    lane's pass: 11 cheap picks at 0.06 / 0.4 = 0.15 each (1.65), not 12 (1.80)."""
    p, clock = policy_with_cache("fairway", set())  # the default, fast_ahead 0.1
    assert FairwayConfig().fast_ahead == 0.1
    _big_due_and_cheap(p, clock, 13)
    assert p.prefill_s[:2].tolist() == pytest.approx([1.01, 0.06])
    assert _drain(p) == [(i, FAST) for i in range(1, 12)] + [(0, FAIR), (12, FAST), (13, FAST)]
    assert p.aheads == 11
    off, clock = policy_with_cache("fairway", set(), fast_ahead=0.0)  # the Fair pick first on its turn
    _big_due_and_cheap(off, clock, 13)
    assert _drain(off) == [(0, FAIR)] + [(i, FAST) for i in range(1, 14)] and off.aheads == 0


def test_fast_ahead_keeps_the_fair_pick_first_when_the_fast_pick_is_not_much_lighter():
    p, clock = policy_with_cache("fairway", set())
    _big_due_and_cheap(p, clock, 2, cheap_tokens=150)  # P 0.16 > 0.1 x 1.01
    assert p.prefill_s[1] > 0.1 * p.prefill_s[0]
    assert _drain(p) == [(0, FAIR), (1, FAST), (2, FAST)] and p.aheads == 0
