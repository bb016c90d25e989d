"""Two ingress replicas, two request routers, one shared routing view (``router.shared_view``),
with the exact prefix view (``router.prefix_view: events``: the replicas publish their KV events).

Repeats of a long shared prefix land on the replica that holds it and report its cached tokens,
whichever ingress replica served them; and with one ingress replica killed under load, every
request gets an answer and the routers (the survivor, and the replacement Serve starts, which
reads the shared log first) keep the prefix on its replica.
"""

from __future__ import annotations

import asyncio
import os
import time
import urllib.error

import pytest

from cluster.launch import post_json
from fairway.routing.view_log import Event, SourceGone
from observability.exporter import free_port
from observability.probe import total
from tests.e2e.probes import wait_routers_idle
from tests.factories import prompt_ids

pytestmark = pytest.mark.e2e

MODEL = "fairway-tiny"
SHARED = 4000  # tokens: 250 full blocks


@pytest.fixture(scope="module")
def url():
    import ray
    from ray import serve

    from cluster.app import build_app

    ray.init(num_cpus=4, include_dashboard=False)
    port = free_port()
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        # the router's defaults, hot-prefix replication included: one family is all the traffic
        # here, but the cluster is idle between the requests, so no copy would serve it sooner
        serve.run(build_app({"num_replicas": 3, "ingress_replicas": 2,
                             "router": {"policy": "fairway", "prefix_view": "events"},
                             "engine_args": {"kv_blocks": 4000, "host_kv_blocks": 4000}}),
                  name="fairway", route_prefix="/")
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()
        os.environ.pop("RAY_ADDRESS", None)


def complete(url: str, prompt: list[int]) -> dict:
    status, body, _ = post_json(f"{url}/v1/completions",
                                {"model": MODEL, "prompt": prompt, "max_tokens": 2, "ignore_eos": True})
    assert status == 200, body
    return body


def ingress_actors() -> list[str]:
    from ray._private import state

    return sorted(a["Name"] for a in state.actors().values()
                  if "FairwayIngress" in a.get("Name", "") and a.get("State") == "ALIVE")


def test_a_prefix_stays_on_its_replica_whichever_ingress_serves_it(url):
    assert len(ingress_actors()) == 2
    ingresses: set[str] = set()
    for family in range(3):
        shared = prompt_ids(1000 + family, SHARED)
        first = complete(url, shared + prompt_ids(family, 24))
        holder = first["fairway"]["replica"]
        ingresses.add(first["fairway"]["ingress"])
        for k in range(6):
            wait_routers_idle(url)  # both routers: the previous request no longer counts as queued
            body = complete(url, shared + prompt_ids(100 + 10 * family + k, 24))
            ingresses.add(body["fairway"]["ingress"])
            assert body["fairway"]["replica"] == holder, f"family {family} request {k} left its replica"
            assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == SHARED
    # 21 requests over two ingress replicas: both served some (all on one: probability 2^-20)
    assert len(ingresses) == 2, ingresses


def test_the_replicas_kv_events_reach_the_shared_view(url):
    import ray

    holder = complete(url, prompt_ids(3000, SHARED) + prompt_ids(3001, 24))["fairway"]["replica"]
    hub = ray.get_actor("fairway-view-fairway", namespace="fairway")
    deadline = time.monotonic() + 30
    while True:  # the holder's engine stored the prompt's 250 blocks; its publisher sends them within 10 ms
        kv = ray.get(hub.exchange.remote("test-probe", [], 0, True)).kv
        if holder in kv and len(kv[holder]) >= SHARED // 16:
            break
        assert time.monotonic() < deadline, f"the holder's blocks never reached the hub: {sorted(kv)}"
        time.sleep(0.2)
    assert len(kv) == 3  # every replica publishes (heartbeats at least), and only they do


def test_host_tier_blocks_reach_the_shared_view_and_a_host_hit_is_served_there(url):
    """The engines keep blocks evicted from the GPU in a host tier (engine_args.host_kv_blocks):
    distinct prompts overflow the holder of the first one until its blocks are host-only there,
    which the hub learns from the replica's tier events; the first prompt again then goes to its
    holder and is served from the host tier (cached, reloaded instead of recomputed)."""
    import aiohttp
    import ray

    first = prompt_ids(8000, SHARED) + prompt_ids(8001, 24)
    holder = complete(url, first)["fairway"]["replica"]
    hub = ray.get_actor("fairway-view-fairway", namespace="fairway")

    def host_only() -> int:
        host = ray.get(hub.exchange.remote("test-probe", [], 0, True)).host or {}
        return len(host.get(holder, ()))

    async def burst(seeds: range) -> None:
        async with aiohttp.ClientSession() as s:
            async def one(k: int) -> None:
                payload = {"model": MODEL, "prompt": prompt_ids(9000 + k, SHARED), "max_tokens": 2, "ignore_eos": True}
                async with s.post(f"{url}/v1/completions", json=payload,
                                  timeout=aiohttp.ClientTimeout(total=60)) as r:
                    assert r.status == 200, await r.text()
            await asyncio.gather(*(one(k) for k in seeds))

    deadline = time.monotonic() + 120
    k = 0
    while host_only() < SHARED // 16:  # the first prompt's 251 blocks are the holder's oldest
        assert time.monotonic() < deadline, f"no host-only blocks reached the hub for {holder}"
        asyncio.run(burst(range(k, k + 6)))
        k += 6
    wait_routers_idle(url)
    again = complete(url, first)
    assert again["fairway"]["replica"] == holder
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= SHARED


def test_killing_one_ingress_replica_loses_no_request(url):
    import aiohttp
    import ray

    shared = prompt_ids(5000, SHARED)
    holder = complete(url, shared + prompt_ids(5001, 24))["fairway"]["replica"]

    async def one(s: aiohttp.ClientSession, k: int) -> tuple[int, str]:
        payload = {"model": MODEL, "prompt": shared + prompt_ids(6000 + k, 24), "max_tokens": 100, "ignore_eos": True}
        async with s.post(f"{url}/v1/completions", json=payload, timeout=aiohttp.ClientTimeout(total=60)) as r:
            return r.status, await r.text()

    async def run() -> list[tuple[int, str] | BaseException]:
        async with aiohttp.ClientSession() as s:
            tasks = [asyncio.create_task(one(s, k)) for k in range(24)]
            await asyncio.sleep(0.3)
            ray.kill(ray.get_actor(ingress_actors()[0], namespace="serve"), no_restart=True)
            return await asyncio.gather(*tasks, return_exceptions=True)

    results = asyncio.run(run())
    # every request ended: served, an HTTP error, or a connection cut by the dying replica; none hung
    statuses = [r[0] if isinstance(r, tuple) else type(r).__name__ for r in results]
    assert all(s == 200 or (isinstance(s, int) and s >= 500) or s in ("ClientPayloadError",
               "ServerDisconnectedError", "ClientOSError") for s in statuses), statuses
    assert statuses.count(200) >= 1
    # the hub announces the dead router once it has been silent for its TTL (3 s): from then on
    # the others no longer count its requests as running on the holder
    hub = ray.get_actor("fairway-view-fairway", namespace="fairway")
    deadline = time.monotonic() + 30
    def router_gone(e: Event) -> bool:  # not this test's own probe, nor a replica's publisher
        return isinstance(e, SourceGone) and e.source != "test-probe" and not e.source.startswith("replica:")

    while not any(router_gone(e) for e in ray.get(hub.exchange.remote("test-probe", [], 0)).events):
        assert time.monotonic() < deadline, "the dead ingress's router was never announced gone"
        time.sleep(0.2)
    # the routers left (the survivor and Serve's replacement, which starts from the hub's snapshot)
    # keep the family where it is cached: the holder, or a replica the burst above copied it to
    # (with the exact view a router knows every replica that computed the prefix)
    served = []
    for k in range(8):
        wait_routers_idle(url)  # the killed router's metrics entry expires within its TTL (15 s)
        try:
            served.append(complete(url, shared + prompt_ids(7000 + k, 24)))
        except (urllib.error.URLError, AssertionError):
            continue  # the replacement may still be starting: a retriable error, not a hang
    assert len(served) >= 4
    for body in served:
        assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == SHARED, (holder, body["fairway"])
    # every router heard every completion: none had to expire a booking its replica no longer held
    # (Bookings.apply_stats), which would hide a lost completion behind the idle wait above
    assert total(url, "router", "fairway_router_bookings_expired_total") == 0
