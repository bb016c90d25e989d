"""The exact prefix view's pieces without Ray: the replica's event batches (``KvPublisher``), the
hub's block sets (``ViewHub.publish``), the index that falls back (``FallbackIndex``) and the
snapshot replacement of one replica's blocks (``PrefixIndex.replace_blocks``)."""

from __future__ import annotations

import asyncio

from fairway.prefix_index import PrefixIndex
from fairway.routing.fallback_index import FallbackIndex
from replicas.kv_publisher import KvPublisher
from router.view_hub import ViewHub
from tests.factories import chain


def publisher(held: list[int], answers: list[object]):
    sent: list[list[tuple]] = []

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
    assert asyncio.run(pub.flush()) and sent[-1] == [("kv-full", "r0", [1, 2])]  # the set replaces the delta
    pub.on_stored([4, 5])
    pub.on_removed([4, 1])  # 4 stored then removed within the period: its last event wins
    pub.on_stored([6])
    assert asyncio.run(pub.flush()) and sent[-1] == [("kv", "r0", [5, 6], [4, 1])]
    assert asyncio.run(pub.flush()) and sent[-1] == []  # nothing new: a heartbeat
    assert (pub.sent_batches, pub.sent_hashes) == (2, 2 + 4)


def test_a_failed_or_unknown_publish_makes_the_next_one_carry_the_whole_set():
    held = [1]
    pub, sent = publisher(held, [False, ConnectionError("hub gone"), False, True, False])
    asyncio.run(pub.flush())
    pub.on_stored([2])
    held.append(2)
    assert not asyncio.run(pub.flush()) and pub.failures == 1  # the delta [2] is lost with the call
    assert asyncio.run(pub.flush()) and sent[-1] == [("kv-full", "r0", [1, 2])]
    pub.on_removed([1])
    asyncio.run(pub.flush())  # the hub answers "unknown" (it restarted): the next call resends
    held.remove(1)
    asyncio.run(pub.flush())
    assert sent[-1] == [("kv-full", "r0", [2])]


def test_the_hub_keeps_each_replicas_block_set_and_snapshots_it():
    hub = ViewHub()
    assert hub.publish("replica:a", [("kv-full", "a", [1, 2, 3])], now=0.0) is False
    assert hub.publish("replica:a", [("kv", "a", [4], [1])], now=0.1) is False
    ex = hub.exchange("router-x", [], 0, snapshot=True, now=0.2)
    assert sorted(ex.kv["a"]) == [2, 3, 4] and ex.head == 2 and len(ex.events) == 2
    assert hub.exchange("router-x", [], ex.head, now=0.3).kv is None  # only when asked


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
