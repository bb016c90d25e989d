"""Each queue policy's exact admission order on small hand-made queues."""

from __future__ import annotations

import pytest

from fairway.clock import ManualClock
from fairway.policies import POLICIES, PolicyError, make_policy
from tests.factories import LinearCost, chain, drain_order, policy_with_cache, queued

# Cache: the 4-block "sys" prefix and the 10-block "doc" prefix.
CACHED = set(chain("sys", 4)) | set(chain("doc", 10))


def base_queue():
    """r0 cold 1000 tok (P=1.01), r1 64 of 200 cached (P=.146), r2 160 of 170 cached (P=.02),
    r3 cold 100 (P=.11); arrivals 0, 1, 2, 3."""
    return [
        queued(0, 0.0, 1000, chain("cold0", 62)),
        queued(1, 1.0, 200, chain("sys", 4) + chain("u1", 8)),
        queued(2, 2.0, 170, chain("doc", 10)),
        queued(3, 3.0, 100, chain("cold3", 6)),
    ]


def fill(name, reqs=None, **kw):
    p, clock = policy_with_cache(name, CACHED, **kw)
    for r in reqs or base_queue():
        p.add(r)
    clock.set(3.0)
    return p, clock


def test_cached_tokens_seen_at_add():
    p, _ = fill("fcfs")
    assert [p.cached_tokens(i) for i in range(4)] == [0, 64, 160, 0]


@pytest.mark.parametrize(
    "name,expected",
    [
        ("fcfs", [0, 1, 2, 3]),
        ("lpm", [2, 1, 0, 3]),
        ("srpt-oracle", [2, 3, 1, 0]),
    ],
)
def test_static_orders(name, expected):
    p, _ = fill(name)
    assert drain_order(p) == expected


def test_k_lpm_alternates_oldest_and_best_prefix():
    p, _ = fill("k-lpm", k=2)
    assert drain_order(p) == [0, 2, 1, 3]


def test_hrrn_uses_the_token_clock():
    p, _ = policy_with_cache("hrrn", CACHED)
    q = base_queue()
    p.add(q[0])
    p.on_step(500)
    p.add(q[1])
    p.on_step(300)
    p.add(q[2])
    p.add(q[3])
    p.on_step(100)
    # waited / uncached: r0 900/1000, r1 400/136, r2 100/10, r3 100/100
    assert drain_order(p) == [2, 1, 3, 0]


def test_lpm_aging_lets_an_old_cold_request_through():
    p, _ = policy_with_cache("lpm-aging", CACHED, tokens_per_pass=25)
    q = base_queue()
    p.add(q[0])
    for _ in range(10):
        p.on_step(0)
    for r in q[1:]:
        p.add(r)
    # keys: r0 0+25*11=275, r1 64+25, r2 160+25, r3 0+25
    assert drain_order(p) == [0, 2, 1, 3]
    p2, _ = policy_with_cache("lpm-aging", CACHED, tokens_per_pass=0)
    for r in base_queue():
        p2.add(r)
    assert drain_order(p2) == [2, 1, 0, 3]  # N = 0 is plain LPM


def test_vllm_sjf_prefers_short_prompts_then_ages():
    p, clock = policy_with_cache("vllm-sjf", set())
    p.add(queued(0, 0.0, 64000, chain("a", 10)))
    p.add(queued(1, 0.5, 1000, chain("b", 10)))
    clock.set(1.0)
    assert p.select().rid == 1
    p2, clock2 = policy_with_cache("vllm-sjf", set())
    p2.add(queued(0, 0.0, 40000, chain("a", 10)))
    p2.add(queued(1, 29.0, 30000, chain("b", 10)))
    clock2.set(30.0)  # r0 waited 30 s: its wait term outweighs the small length difference
    assert p2.select().rid == 0


def test_dfs_weight_heavier_subtree_first():
    reqs = base_queue() + [
        queued(4, 4.0, 300, chain("doc", 10) + chain("u4", 8)),
        queued(5, 5.0, 100, chain("sys", 4) + chain("u5", 2)),
        queued(6, 6.0, 200, chain("doc", 10) + chain("u6", 2)),
    ]
    p, _ = fill("dfs-weight", reqs)
    # doc subtree holds 3 waiting requests, sys 2, root 2 (no cached prefix: last)
    assert drain_order(p) == [2, 4, 6, 1, 5, 0, 3]


def test_ties_go_to_the_smaller_seq():
    p, _ = policy_with_cache("lpm", set())
    for rid, seq in ((7, 3), (8, 1), (9, 2)):
        p.add(queued(rid, 0.0, 100, chain(f"t{rid}", 6), seq=seq))
    assert drain_order(p) == [8, 9, 7]


def test_hits_follow_cache_events_while_waiting():
    cache: set[int] = set()
    p, _ = policy_with_cache("lpm", cache)
    p.add(queued(0, 0.0, 200, chain("x", 12)))
    p.add(queued(1, 1.0, 200, chain("y", 12)))
    assert p.select().rid == 0
    cache.update(chain("y", 5))  # a sibling's prefill cached y's first 5 blocks
    p.on_blocks_stored(chain("y", 5))
    assert p.cached_tokens(1) == 80 and p.select().rid == 1
    cache.discard(chain("y", 5)[2])  # eviction of block 2 cuts the prefix to 2 blocks
    p.on_blocks_removed([chain("y", 5)[2]])
    assert p.cached_tokens(1) == 32


def test_lpm_fcfs_fallback_is_counted():
    p, _ = fill("lpm", fcfs_above=3)
    assert p.select().rid == 0 and p.fallbacks == 1


def test_unknown_policy_and_bad_option():
    clock = ManualClock()
    with pytest.raises(PolicyError, match="unknown policy 'nope'"):
        make_policy("nope", clock=clock, cost=LinearCost())
    with pytest.raises(PolicyError, match="bad options"):
        make_policy("fcfs", clock=clock, cost=LinearCost(), wrong=1)


def test_dotted_path_policy():
    p = make_policy("fairway.policies.baselines:FCFS", clock=ManualClock(), cost=LinearCost())
    assert p.name == "fcfs"


def test_registry_has_every_issue_policy():
    assert set(POLICIES) >= {
        "fcfs", "lpm", "dfs-weight", "hrrn", "k-lpm", "lpm-aging", "vllm-sjf", "srpt-oracle",
        "fairway",
    }
    assert POLICIES["srpt-oracle"].is_bound
