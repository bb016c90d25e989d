"""More than one machine: a local two-node Ray cluster (``ray.cluster_utils.Cluster``), one
replica per node, and routing still prefix-aware across nodes."""

from __future__ import annotations

import os
import socket

import pytest

from cluster.launch import post_json
from tests.e2e.probes import wait_routers_idle
from tests.e2e.test_cluster_http import MODEL, prompt_ids

pytestmark = pytest.mark.e2e

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def two_nodes():
    import ray
    from ray import serve
    from ray.cluster_utils import Cluster

    from cluster.app import build_app

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2})
    cluster.add_node(num_cpus=2)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address)
    port = free_port()
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port}, proxy_location="HeadOnly")
        # replicate=false: as in test_cluster_http.py, an idle cluster's only family must stay on its holder
        serve.run(build_app({"num_replicas": 2, "max_replicas_per_node": 1,
                             "engine_args": {"kv_blocks": 4000},
                             "router": {"policy": "fairway", "policy_options": {"replicate": False}}}),
                  name="fairway", route_prefix="/")
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()
        cluster.shutdown()
        os.environ.pop("RAY_ADDRESS", None)


def replica_nodes() -> dict[str, str]:
    """Live replica actor name -> node id, from the GCS (no dashboard needed)."""
    from ray._private import state

    return {a["Name"]: a["Address"]["NodeID"] for a in state.actors().values()
            if "FairwayReplica" in a.get("Name", "") and a.get("State") == "ALIVE"}


def test_replicas_on_both_nodes_and_affinity_holds(two_nodes):
    nodes = replica_nodes()
    assert len(nodes) == 2 and len(set(nodes.values())) == 2, nodes
    seen: dict[int, set[str]] = {}
    for family in (11, 12, 13, 14):
        shared = prompt_ids(family, 3000)
        for k in range(3):
            wait_routers_idle(two_nodes)  # the previous request no longer counts as queued
            status, body, _ = post_json(f"{two_nodes}/v1/completions",
                                        {"model": MODEL, "prompt": shared + prompt_ids(900 + 10 * family + k, 20),
                                         "max_tokens": 2, "ignore_eos": True})
            assert status == 200
            cached = body["usage"]["prompt_tokens_details"]["cached_tokens"]
            assert cached == (0 if k == 0 else 3000 // 16 * 16)
            seen.setdefault(family, set()).add(body["fairway"]["replica"])
    assert all(len(v) == 1 for v in seen.values()), seen
    # the four families are not all on one replica (both nodes serve)
    assert len(set().union(*seen.values())) == 2, seen


def test_dead_replica_loses_no_request_silently(two_nodes):
    """Kill one replica while requests stream: each request either completes or gets a clear
    503 with Retry-After at once (none hangs), and new requests keep being served."""
    import asyncio

    import aiohttp
    import ray

    async def one(s: aiohttp.ClientSession, i: int) -> tuple[int, dict]:
        payload = {"model": MODEL, "prompt": prompt_ids(700 + i, 1500), "max_tokens": 200, "ignore_eos": True}
        async with s.post(f"{two_nodes}/v1/completions", json=payload, timeout=aiohttp.ClientTimeout(total=120)) as r:
            return r.status, await r.json()

    async def run() -> list[tuple[int, dict]]:
        async with aiohttp.ClientSession() as s:
            tasks = [asyncio.create_task(one(s, i)) for i in range(12)]
            await asyncio.sleep(0.5)
            victim = sorted(replica_nodes())[0]
            ray.kill(ray.get_actor(victim, namespace="serve"), no_restart=True)
            return await asyncio.gather(*tasks)

    results = asyncio.run(run())
    print("statuses after the kill:", sorted(s for s, _ in results))
    for status, body in results:
        if status == 200:
            assert body["usage"]["completion_tokens"] == 200
        else:
            assert status == 503, (status, body)
            assert "unavailable" in body["error"]["message"] or "retry" in body["error"]["message"]
    assert any(s == 200 for s, _ in results)
    # the survivor (and the replacement Ray Serve starts) keep serving
    for k in range(3):
        status, body, _ = post_json(f"{two_nodes}/v1/completions",
                                    {"model": MODEL, "prompt": prompt_ids(800 + k, 200), "max_tokens": 2,
                                     "ignore_eos": True})
        assert status == 200, body
