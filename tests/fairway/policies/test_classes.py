"""The flow-control class policy: strict tiers, weighted fair sharing of prefill work within a
tier, the inner policy's lanes within a class, and the default-class pass-through."""

from __future__ import annotations

import pytest

from fairway.policies import ClassesConfig, ClassQueues, ClassSpec, make_policy
from fairway.policies.base import QueuedRequest
from tests.factories import LinearCost, chain, drain_order, policy_with_cache

EXACT = LinearCost(per_token=1 / 1024, overhead=0.0)  # binary fractions: virtual times tie exactly


def req(rid: int, arrival: float, prompt: int, klass: str = "", hashes=()) -> QueuedRequest:
    return QueuedRequest(rid=rid, arrival_s=arrival, prompt_tokens=prompt, block_hashes=list(hashes), seq=rid,
                         priority_class=klass)


def classes(spec: str, inner: str = "fcfs", **kw):
    return policy_with_cache("classes", set(), cost=EXACT, classes=spec, inner=inner, **kw)


def test_strict_tiers_first_then_the_inner_order():
    p, _ = classes("hi:tier=0,lo:tier=1")
    for rid, t, k in [(0, 0.0, "lo"), (1, 1.0, "hi"), (2, 2.0, "lo"), (3, 3.0, "hi")]:
        p.add(req(rid, t, 64, k))
    assert drain_order(p) == [1, 3, 0, 2]


def test_weights_share_prefill_work_between_classes_of_a_tier():
    p, _ = classes("a:weight=2,b:weight=1")
    for i in range(6):
        p.add(req(i, float(i), 64, "a"))
    for i in range(3):
        p.add(req(10 + i, float(i), 64, "b"))
    # equal work per request: a gets two admissions per one of b; ties go to the configured order
    assert drain_order(p) == [0, 10, 1, 2, 11, 3, 4, 12, 5]


def test_sharing_counts_prefill_seconds_not_requests():
    p, _ = classes("a,b")
    for i in range(3):
        p.add(req(i, float(i), 256, "a"))  # 0.25 s each
    for i in range(8):
        p.add(req(10 + i, float(i), 64, "b"))  # 0.0625 s each: four of them are one of a's
    assert drain_order(p) == [0, 10, 11, 12, 13, 1, 14, 15, 16, 17, 2]


def test_an_idle_class_banks_no_credit():
    p, _ = classes("a,b")
    for i in range(4):
        p.add(req(i, 0.0, 64, "a"))
    for rid in (0, 1, 2):  # a alone: its virtual time runs ahead
        assert p.select().rid == rid and p.admit(rid).rid == rid
    p.add(req(10, 1.0, 64, "b"))
    p.add(req(11, 1.0, 64, "b"))
    # b starts at the tier's virtual time (a's last admission), not at 0: it alternates with a
    assert drain_order(p) == [10, 3, 11]


def test_within_a_class_the_fairway_lanes_are_unchanged():
    reqs = [(0, 0.0, 1000, "big"), (1, 0.0, 30, "small"), (2, 0.0, 300, "mid"), (3, 0.1, 60, "s2")]
    plain, _ = policy_with_cache("fairway", set())
    wrapped, _ = policy_with_cache("classes", set(), classes="x:tier=0,y:tier=1")
    for p, k in ((plain, ""), (wrapped, "y")):
        for rid, t, n, fam in reqs:
            p.add(req(rid, t, n, k, chain(fam, n // 16)))
    assert drain_order(plain) == drain_order(wrapped) == [1, 3, 2, 0]  # least uncached work first


def test_no_classes_is_a_pass_through():
    plain, c1 = policy_with_cache("fairway", set())
    wrapped, c2 = policy_with_cache("classes", set())
    adms = []
    for p, clock in ((plain, c1), (wrapped, c2)):
        for rid in range(12):
            n = 40 + (rid * 389) % 900
            p.add(req(rid, rid * 0.01, n, "anything" if rid % 2 else "", chain(f"f{rid % 3}", n // 16)))
        out = []
        while len(p):
            clock.advance(1.0)
            r = p.select()
            out.append(p.admit(r.rid))
        adms.append([(a.rid, a.lane, a.promoted, a.est_prefill_s) for a in out])
    assert adms[0] == adms[1]
    assert wrapped.has_lanes and wrapped.promotions == plain.promotions > 0


def test_requests_without_a_class_join_the_default_class():
    p, _ = classes("hi:tier=0,lo:tier=1")
    p.add(req(0, 0.0, 64, ""))
    p.add(req(1, 1.0, 64, "hi"))
    assert p.class_of(0) == "lo" and drain_order(p) == [1, 0]
    q, _ = policy_with_cache("classes", set(), classes=ClassesConfig(
        (ClassSpec("hi"), ClassSpec("lo", tier=1)), default="hi"))
    q.add(req(0, 0.0, 64, ""))
    assert q.class_of(0) == "hi"


def test_unknown_class_names_the_valid_ones():
    p, _ = classes("hi:tier=0,lo:tier=1")
    with pytest.raises(ValueError, match="valid: hi, lo"):
        p.add(req(0, 0.0, 64, "gold"))


def test_work_ahead_counts_stricter_tiers_and_a_fair_share_of_the_own_tier():
    p, _ = classes("hi:tier=0,a:tier=1,b:tier=1:weight=3")
    p.add(req(0, 0.0, 256, "hi"))  # 0.25
    p.add(req(1, 0.0, 512, "a"))  # 0.5
    p.add(req(2, 0.0, 1024, "b"))  # 1.0
    assert p.work_ahead_s("hi") == 0.25
    assert p.work_ahead_s("a") == 0.25 + 0.5 + min(1.0, 0.5 * 3)
    assert p.work_ahead_s("b") == 0.25 + 1.0 + min(0.5, 1.0 / 3)
    assert p.queued_prefill_s() == 1.75


def test_remove_and_cache_events_reach_the_class_queue():
    cache = {*chain("f", 4)}
    p, _ = policy_with_cache("classes", cache, classes="a,b")
    p.add(req(0, 0.0, 100, "a", chain("f", 6)))
    p.add(req(1, 0.0, 100, "b", chain("g", 6)))
    assert p.cached_tokens(0) == 64 and p.cached_tokens(1) == 0
    cache.update(chain("g", 2))
    p.on_blocks_stored(chain("g", 2))
    assert p.cached_tokens(1) == 32
    assert p.remove(0).rid == 0 and len(p) == 1 and 0 not in p and p.class_sizes() == {"b": 1}


@pytest.mark.parametrize("spec, match", [
    ("a:tier=-1", "tier"), ("a:weight=0", "weight"), ("a:objective=0", "objective"), ("a,a", "duplicate"),
    ("a:colour=red", "bad class option"), ("a:tier=x", "bad value"), ("", None),
])
def test_config_is_validated(spec, match):
    if match is None:
        assert ClassesConfig.parse(spec).classes == ()
        return
    with pytest.raises(ValueError, match=match):
        ClassesConfig.parse(spec)


def test_parse_and_defaults():
    c = ClassesConfig.parse("interactive:tier=0:objective=1,batch:tier=1:objective=30:weight=2:max_wait=60")
    assert c.names == ("interactive", "batch") and c.default_name == "batch"
    assert c.spec("interactive").wait_bound_s == 1.0 and c.spec("").wait_bound_s == 60.0
    assert c.spec("batch").weight == 2.0
    with pytest.raises(ValueError, match="nest"):
        make_policy("classes", clock=None, cost=EXACT, inner="classes")  # type: ignore[arg-type]
    assert isinstance(make_policy("classes", clock=None, cost=EXACT), ClassQueues)  # type: ignore[arg-type]


def test_a_config_spec_builds_the_class_policy_with_its_classes():
    from fairway.policies import validated_policy

    name, opts = validated_policy("classes[classes=hi:tier=0,lo:tier=1:weight=2;inner=fcfs]")
    assert name == "classes" and opts == {"classes": "hi:tier=0,lo:tier=1:weight=2", "inner": "fcfs"}
    with pytest.raises(ValueError, match="weight"):
        validated_policy("classes[classes=hi:weight=0]")


@pytest.mark.parametrize("priority, header, tenant, want", [
    (None, "", "", "batch"),  # the default: the last class
    ("interactive", "batch", "batch", "interactive"),  # the body first
    (0, "batch", "", "interactive"),  # an integer tier, as vLLM's priority: the first class of that tier
    (1, "", "", "bulk"),  # the first class configured with tier 1
    (None, "batch", "interactive", "batch"),  # then the header
    (None, "", "interactive", "interactive"),  # then the tenant's default
])
def test_a_requests_class_comes_from_its_body_then_header_then_tenant(priority, header, tenant, want):
    cfg = ClassesConfig.parse("interactive:tier=0,bulk:tier=1,batch:tier=1")
    assert cfg.for_request(priority, header, tenant) == want


@pytest.mark.parametrize("cfg, priority, header, match", [
    ("interactive:tier=0", 2, "", "no request class has priority \\(tier\\) 2; valid: 0, or a class name: interactive"),
    ("interactive:tier=0", "gold", "", "unknown class 'gold'; valid: interactive"),
    ("interactive:tier=0", None, "gold", "unknown class 'gold'"),
    ("", 1, "", "no request classes configured, so only priority 0"),
    ("", "gold", "", "unknown class 'gold'; valid: \\(none configured\\)"),
    ("", True, "", "not a boolean"),
])
def test_an_unknown_class_or_tier_names_the_valid_ones(cfg, priority, header, match):
    with pytest.raises(ValueError, match=match):
        ClassesConfig.parse(cfg).for_request(priority, header)


def test_without_classes_priority_zero_and_nothing_are_the_default():
    assert ClassesConfig().for_request(0) == "" and ClassesConfig().for_request(None) == ""


def test_best_tier_is_the_strictest_tier_waiting():
    pol, _ = classes("interactive:tier=0,batch:tier=2")
    assert pol.best_tier() == 0  # nothing waits
    pol.add(req(0, 0.0, 64, "batch"))
    assert pol.best_tier() == 2
    pol.add(req(1, 0.0, 64, "interactive"))
    assert pol.best_tier() == 0
    pol.remove(1)
    assert pol.best_tier() == 2


def test_a_requests_wait_bound_is_its_classes_or_the_default_without_classes():
    c = ClassesConfig.parse("interactive:objective=1,batch:tier=1:objective=30:max_wait=60")
    assert c.wait_bound_for("interactive", None) == 1.0 and c.wait_bound_for("", None) == 60.0
    assert ClassesConfig().wait_bound_for("", 10.0) == 10.0 and ClassesConfig().wait_bound_for("", None) is None


def test_the_classes_fairway_queues_share_one_memory_of_evicted_blocks():
    cache = set(chain("d", 30))
    p, _ = policy_with_cache("classes", cache, classes="a,b", inner="fairway",
                             inner_options={"lost_blocks": 65536, "lost_scope": "evicted"})
    a, b = p.queues["a"], p.queues["b"]
    assert a.evicted is b.evicted  # one replica, one memory, from the start
    cache.clear()
    p.on_blocks_removed(chain("d", 30))  # recorded once
    assert a.evicted.oldest_first() == chain("d", 30)
    # class b's queue credits the prefix evicted before its request arrived (theta 12, P floor .1)
    p.add(req(0, 0.0, 500, "b", chain("d", 31)))
    assert b.due[b._slot_of[0]] == pytest.approx(12 * 0.1) and b.lost_credits == 1
    assert b.prefill_s[b._slot_of[0]] == pytest.approx(0.51)


def test_the_classes_fairway_queues_share_one_memory_of_the_prompts_admitted():
    # lost_scope="turns": a follow-up turn in class b continues a prompt admitted in class a
    cache: set[int] = set()
    p, _ = policy_with_cache("classes", cache, classes="a,b", inner="fairway",
                             inner_options={"lost_blocks": 65536, "lost_scope": "turns"})
    a, b = p.queues["a"], p.queues["b"]
    p.add(req(0, 0.0, 481, "a", chain("d", 30)))
    p.admit(p.select().rid)
    assert b.evicted.oldest_first() == [chain("d", 30)[-1]]
    p.add(req(1, 0.0, 500, "b", chain("d", 31)))  # 480 tokens of it ran in class a
    assert b.due[b._slot_of[1]] == pytest.approx(12 * 0.1) and b.lost_credits == 1 and a.lost_credits == 0
