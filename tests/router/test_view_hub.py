"""The exact prefix view's pieces without Ray: the replica's event batches (``KvPublisher``), the
hub's block sets (``ViewHub.publish``), the index that falls back (``FallbackIndex``) and the
snapshot replacement of one replica's blocks (``PrefixIndex.replace_blocks``)."""

from __future__ import annotations

import asyncio

from fairway.prefix_index import PrefixIndex
from fairway.routing.fallback_index import FallbackIndex
from fairway.routing.view_log import KvDelta, KvFull, TierDelta
from replicas.kv_publisher import KvPublisher
from router.view_hub import ViewHub
from tests.factories import chain


def publisher(held: list[int], answers: list[object]):
    sent: list[list] = []

    async def send(events):
        sent.append(events)
        a = answers.pop(0)
        if isinstance(a, Exception):
            raise a
        return a

    return KvPublisher("r0", send, lambda: list(held)), sent


def test_the_publisher_sends_the_whole_set_first_then_merged_deltas_and_heartbeats():
    held = [1, 2]
    pub, sent = publisher(held, [False, False, False])
    pub.on_stored([3])
    assert asyncio.run(pub.flush()) and sent[-1] == [KvFull("r0", [1, 2])]  # the set replaces the delta
    pub.on_stored([4, 5])
    pub.on_removed([4, 1])  # 4 stored then removed within the period: its last event wins
    pub.on_stored([6])
    assert asyncio.run(pub.flush()) and sent[-1] == [KvDelta("r0", [5, 6], [4, 1])]
    assert asyncio.run(pub.flush()) and sent[-1] == []  # nothing new: a heartbeat
    assert (pub.sent_batches, pub.sent_hashes) == (2, 2 + 4)


def test_a_failed_or_unknown_publish_makes_the_next_one_carry_the_whole_set():
    held = [1]
    pub, sent = publisher(held, [False, ConnectionError("hub gone"), False, True, False])
    asyncio.run(pub.flush())
    pub.on_stored([2])
    held.append(2)
    assert not asyncio.run(pub.flush()) and pub.failures == 1  # the delta [2] is lost with the call
    assert asyncio.run(pub.flush()) and sent[-1] == [KvFull("r0", [1, 2])]
    pub.on_removed([1])
    asyncio.run(pub.flush())  # the hub answers "unknown" (it restarted): the next call resends
    held.remove(1)
    asyncio.run(pub.flush())
    assert sent[-1] == [KvFull("r0", [2])]


def test_the_hub_keeps_each_replicas_block_set_and_snapshots_it():
    hub = ViewHub()
    assert hub.publish("replica:a", [KvFull("a", [1, 2, 3])], now=0.0) is False
    assert hub.publish("replica:a", [KvDelta("a", [4], [1])], now=0.1) is False
    ex = hub.exchange("router-x", [], 0, snapshot=True, now=0.2)
    assert sorted(ex.kv["a"]) == [2, 3, 4] and ex.head == 2 and len(ex.events) == 2
    assert hub.exchange("router-x", [], ex.head, now=0.3).kv is None  # only when asked


def test_the_publisher_carries_tier_events_beside_the_kv_batch_and_the_host_only_set_when_whole():
    """A host KV tier: tier events merge per hash (last wins) into a second event after the KV
    one; the whole set carries the host-only hashes; with none host-only, an empty host-only set."""
    held, host = [1, 2, 3], [3]
    sent: list[list] = []

    async def send(events):
        sent.append(events)
        return False

    pub = KvPublisher("r0", send, lambda: list(held), host_only=lambda: list(host))
    pub.on_tier([(True, 9)])  # before the first call: the whole set replaces it
    assert asyncio.run(pub.flush()) and sent[-1] == [KvFull("r0", [1, 2, 3], [3])]
    pub.on_stored([4])
    pub.on_tier([(True, 1), (True, 2), (False, 3)])
    pub.on_tier([(False, 2)])  # 2 became host-only and back within the period: last wins
    assert asyncio.run(pub.flush()) and sent[-1] == [KvDelta("r0", [4], []), TierDelta("r0", [1], [3, 2])]
    pub.on_tier([(False, 1)])  # tier events alone (a reload): no KV event
    assert asyncio.run(pub.flush()) and sent[-1] == [TierDelta("r0", [], [1])]
    assert (pub.sent_batches, pub.sent_hashes) == (3, 4 + (1 + 3) + 1)
    pub._full, host[:] = True, []  # resend with nothing host-only: exactly the old event
    assert asyncio.run(pub.flush()) and sent[-1] == [KvFull("r0", [1, 2, 3])]


def test_the_hub_keeps_each_replicas_host_only_set_and_snapshots_it():
    hub = ViewHub(ttl_s=3.0)
    assert hub.publish("replica:a", [KvFull("a", [1, 2, 3], [3])], now=0.0) is False
    assert hub.publish("replica:b", [KvFull("b", [7])], now=0.0) is False
    assert hub.publish("replica:a", [KvDelta("a", [4], []), TierDelta("a", [1, 2], [3])], now=0.1) is False
    ex = hub.exchange("router-x", [], 0, snapshot=True, now=0.2)
    assert sorted(ex.kv["a"]) == [1, 2, 3, 4] and ex.kv["b"] == [7]
    assert {uid: sorted(hs) for uid, hs in ex.host.items()} == {"a": [1, 2]}  # b holds none: left out
    assert [type(e) for e in ex.events] == [KvFull, KvFull, KvDelta, TierDelta]  # replayed as published
    assert hub.publish("replica:a", [TierDelta("a", [], [1, 2])], now=0.3) is False
    assert hub.exchange("router-x", [], 0, snapshot=True, now=0.4).host == {}
    assert hub.publish("replica:a", [KvFull("a", [1, 2], [2])], now=0.5) is False
    assert hub.host == {"a": {2}}
    assert hub.publish("replica:a", [KvFull("a", [1, 2])], now=0.6) is False  # no host-only now
    assert hub.host == {}
    hub.publish("replica:a", [KvFull("a", [5], [5])], now=0.7)
    hub.exchange("router-x", [], 0, now=10.0)  # a silent past the ttl: gone, its sets with it
    assert "a" not in hub.kv and "a" not in hub.host


def test_the_fallback_index_writes_both_and_reads_the_active_one():
    idx = FallbackIndex(2)
    doc = chain("doc", 8)
    idx.record_routed(0, doc)  # in flight to 0: both know it
    idx.on_kv_events(1, [(True, h) for h in doc[:4]])  # replica 1's engine holds half: exact only
    assert idx.mode == "approx" and idx.match(doc) == [8, 0]
    idx.use_exact(True)
    assert idx.mode == "events" and idx.match(doc) == [8, 4]
    idx.on_feedback(0, doc, cached_tokens=0, block_size=16, estimated_blocks=0)  # finished: out of flight
    assert idx.match(doc) == [0, 4]
    idx.use_exact(False)
    assert idx.match(doc) == [8, 0]  # the approximate index still believes replica 0 holds it


def test_replace_blocks_keeps_the_prompts_in_flight():
    idx = PrefixIndex(1, mode="events")
    idx.on_kv_events(0, [(True, 1), (True, 2)])
    idx.record_routed(0, [5])
    idx.replace_blocks(0, [2, 3])
    assert sorted(idx.blocks(0)) == [2, 3] and idx.match([5]) == [1] and idx.match([1]) == [0]


def test_the_cost_benchmark_ends_with_the_routers_index_equal_to_the_caches():
    from bench.kv_events import measure

    costs, same = measure(batch=20, replicas=3, repeats=3)
    assert same and set(costs) == {"publisher", "hub", "router"} and all(v > 0 for v in costs.values())


def test_the_replica_wires_the_sim_engines_tier_events_to_its_publisher(monkeypatch):
    """``FairwayReplica._publish_kv`` with a sim engine: the host tier's tier events and host-only
    set reach the publisher (the policy keeps its KV listener); without a host tier, none."""
    from types import SimpleNamespace

    from ray import serve

    from fairway.hashing import block_hashes
    from replicas.deployment import FairwayReplica, ReplicaArgs
    from replicas.engines import make_engine
    from tests.replicas.engines.test_sim_engine import call, run

    monkeypatch.setattr(serve, "get_replica_context", lambda: SimpleNamespace(app_name="app"))
    monkeypatch.setattr(KvPublisher, "start", lambda self: None)  # no hub here: batches are read directly

    async def serve_two(host_kv_blocks: int):
        engine = make_engine("sim", speed=1000.0, kv_blocks=8, max_model_len=2048, host_kv_blocks=host_kv_blocks)
        await engine.start()
        seen: list[int] = []
        rep = object.__new__(FairwayReplica)
        rep.engine, rep.name, rep.args = engine, "r0", ReplicaArgs(publish_kv_events=True)
        rep.gate = SimpleNamespace(policy=SimpleNamespace(on_blocks_stored=seen.extend, on_blocks_removed=seen.extend))
        pub = rep._publish_kv()
        pub._full = False  # as after the first call
        a, b = list(range(100, 212)), list(range(1000, 1112))
        try:
            await run(engine, call("a", a, max_tokens=1))
            await run(engine, call("b", b, max_tokens=1))
        finally:
            await engine.shutdown()
        delta = pub.batch()
        pub._full = True
        return delta, pub.batch(), seen, block_hashes(a), block_hashes(b)

    delta, full, seen, ha, hb = asyncio.run(serve_two(64))
    evicted = [ha[i] for i in (6, 5, 4, 3, 2, 1)]  # b pushed a's blocks but its first out of the GPU
    assert delta == [KvDelta("r0", ha + hb, []), TierDelta("r0", evicted, [])]
    assert full == [KvFull("r0", [ha[0]] + hb + evicted, evicted)]  # GPU blocks, then the host tier
    assert seen == ha + hb  # the policy's listener: both tiers cached, nothing removed
    delta, full, seen, ha, hb = asyncio.run(serve_two(0))  # no host tier: evicted means removed
    assert delta == [KvDelta("r0", [ha[0]] + hb, evicted)]
    assert full == [KvFull("r0", [ha[0]] + hb)]  # the whole set without a host-only part, as before
    assert seen == ha + evicted + hb


def test_the_hub_is_not_created_from_a_process_outside_a_ray_cluster():
    """Ray would initialize itself on the actor call and start or join whatever cluster it finds
    (a test run beside the cluster tests joined theirs): ``get_hub`` refuses, and Ray stays down."""
    import pytest
    import ray

    from router.view_hub import get_hub

    with pytest.raises(RuntimeError, match="not connected to one"):
        get_hub("app")
    assert not ray.is_initialized()
