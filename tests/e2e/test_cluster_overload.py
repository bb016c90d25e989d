"""End-to-end overload behaviour on the real cluster: a slowed-down engine (speed 0.1), a tiny
gate queue and a small prefill budget, so bursts queue at the gate and overflow it; API keys for
two tenants; three request classes: ``interactive`` (tier 0), ``bulk`` (tier 1, a 120 s wait
bound: held at the router; the default tenant class of ``bulkco``) and ``batch`` (tier 1, a 5 s
wait bound, the gates' own, so a request every gate refuses is answered 429 at once and one still
queued after 5 s is answered 429 then; the class of a request without one). Each test runs on two
such clusters: the engines first-come-first-served (``replica.strict_tiers: false``, as stock
vLLM), and with strict tiers (``replica.strict_tiers``, the default with two tiers: the engines
serve the interactive tier's prefill first). HAProxy, the HTTP ingress, drops a client silent for
3 s here (``CLIENT_TIMEOUT_S``; a minute by default), so the held and slow answers below also show
that a server's silence is not cut by it."""

from __future__ import annotations

import asyncio
import contextlib
import os
import select
import socket
import threading
import time

import aiohttp
import pytest
import requests

from cluster.launch import HAPROXY_TIMEOUT_HTTP_REQUEST_S, running_cluster, serve_env
from observability.probe import per_replica, total
from tests.e2e.probes import poll, wait_routers_idle
from tests.e2e.test_cluster_http import MODEL, prompt_ids

pytestmark = pytest.mark.e2e


KEYS_ENV = {"FAIRWAY_TEST_KEYS": "k-alice=alice,k-bulk=bulkco"}
CLIENT_TIMEOUT_S = 3  # HAProxy's inactivity bound on a client (RAY_SERVE_HAPROXY_TIMEOUT_CLIENT_S)
ALICE = {"authorization": "Bearer k-alice"}
BULKCO = {"authorization": "Bearer k-bulk"}


@pytest.fixture(scope="module", params=[False, True], ids=["fcfs-engine", "strict-tiers"])
def cluster(request):
    """(url, strict): the cluster, once with the engines FCFS and once with strict tiers (the default)."""
    env = {**KEYS_ENV, "RAY_SERVE_HAPROXY_TIMEOUT_CLIENT_S": str(CLIENT_TIMEOUT_S)}
    with running_cluster(num_replicas=2, engine_args={"speed": 0.1}, api_key="k-alice", env=env,
                         auth={"keys_env": "FAIRWAY_TEST_KEYS",
                               "tenants": {"bulkco": {"default_class": "bulk", "classes": ["bulk", "batch"]}}},
                         replica={"max_queue": 3, "prefill_budget_tokens": 512, "strict_tiers": request.param},
                         classes=[{"name": "interactive", "tier": 0, "objective_s": 5.0, "max_wait_s": 60.0},
                                  {"name": "bulk", "tier": 1, "objective_s": 60.0, "max_wait_s": 120.0},
                                  {"name": "batch", "tier": 1, "objective_s": 60.0, "max_wait_s": 5.0}]) as u:
        yield u, request.param


@pytest.fixture
def slow(cluster):
    return cluster[0]


def test_overflow_gets_429_at_once_and_accepted_requests_complete(slow):
    """24 cold batch requests at once: those both tried gates refuse get 429 at once (their 5 s
    bound leaves no time to hold them), those still queued 5 s later get 429 then; the rest
    complete."""
    async def run() -> list[tuple[int, float, str | None, str]]:
        async with aiohttp.ClientSession() as s:
            async def one(i: int):
                payload = {"model": MODEL, "prompt": prompt_ids(300 + i, 4000), "max_tokens": 2, "ignore_eos": True}
                loop = asyncio.get_running_loop()
                t0 = loop.time()
                async with s.post(f"{slow}/v1/completions", json=payload, headers=ALICE,
                                  timeout=aiohttp.ClientTimeout(total=300)) as r:
                    body = await r.json()
                    if r.status == 200:
                        assert body["usage"]["completion_tokens"] == 2
                    else:
                        assert body["error"]["type"] == "rate_limit_error"
                    return (r.status, loop.time() - t0, r.headers.get("Retry-After"),
                            body.get("error", {}).get("message", ""))
            return await asyncio.gather(*(one(i) for i in range(24)))

    retried = total(slow, "router", "fairway_retries_total")
    results = asyncio.run(run())
    codes = [c for c, _, _, _ in results]
    assert set(codes) <= {200, 429}
    late = [took for c, took, _, msg in results if c == 429 and "waited in its queue" in msg]
    full = [took for c, took, _, msg in results if c == 429 and "waited in its queue" not in msg]
    assert len(full) >= 1 and len(full) + len(late) == codes.count(429), results
    # a queue-full 429 reaches the client only after both replicas refused: each was sent once more
    assert total(slow, "router", "fairway_retries_total") - retried >= len(full)
    assert codes.count(200) >= 2
    assert all(took < 5.0 for took in full)  # refused at once, not after waiting
    assert all(4.5 <= took < 10.0 for took in late)  # answered once its 5 s bound passed in a queue
    for code, _, retry, _ in results:
        if code == 429:
            assert retry is not None and int(retry) >= 1

def test_burst_promotes_to_fair_lane(slow):
    """Cold 4k-token prompts in a burst wait many times their own prefill time on the
    slowed engine: some are served from the Fair lane, and every accepted one completes."""
    async def run():
        async with aiohttp.ClientSession() as s:
            async def one(i: int):
                payload = {"model": MODEL, "prompt": prompt_ids(500 + i, 300 if i % 4 == 0 else 2000),
                           "max_tokens": 2, "ignore_eos": True, "priority": "bulk"}
                async with s.post(f"{slow}/v1/completions", json=payload, headers=ALICE,
                                  timeout=aiohttp.ClientTimeout(total=300)) as r:
                    return r.status, await r.json()
            return await asyncio.gather(*(one(i) for i in range(8)))

    results = asyncio.run(run())
    ok = [b for c, b in results if c == 200]
    assert len(ok) >= 6
    seen = [(b["fairway"]["lane"], b["fairway"]["promoted"], round(b["fairway"]["queue_wait_s"], 2)) for b in ok]
    assert any(p for _, p, _ in seen), seen
    assert {lane for lane, _, _ in seen} <= {"fast", "fair"}
    assert all(b["usage"]["completion_tokens"] == 2 for b in ok)


def test_an_interactive_request_goes_before_a_waiting_batch_backlog(slow):
    """Four cold bulk requests (4,000 tokens) queue on the two slowed replicas; 0.3 s later
    two interactive ones arrive, half as long again. Fairway's lanes alone would serve them last (least
    work first); their class puts them first: each finishes before the last batch request on its
    replica, and the classes are counted against their objectives.

    The premise is an even split of the bulk requests (with three on one replica, the other has
    none waiting for an interactive request to pass), so it starts once the router no longer
    counts the tests before's requests on a replica (its completion callbacks can lag the
    answers) and the replicas' learned paces, which the router divides its estimates by, are
    within 10% of each other. Two CI runs still split them 3/1 (2026-12-06; the cause is not
    known, docs/reliability.md), so an interactive request is checked only against bulk requests
    that were waiting on its replica when it arrived, and the test skips, naming the split, when
    the router left it none to pass."""
    wait_routers_idle(slow)
    def paces_even() -> bool:
        rates = list(per_replica(slow, "fairway_replica_drain_rate").values())
        return len(rates) == 2 and min(rates) > 0 and max(rates) <= 1.1 * min(rates)

    poll(paces_even, 60.0, "the replicas' learned paces within 10% of each other", interval_s=0.5,
         describe=lambda: per_replica(slow, "fairway_replica_drain_rate"))
    met = total(slow, "router", "fairway_class_objective_total")

    async def run():
        async with aiohttp.ClientSession() as s:
            async def one(i: int, klass: str, n: int, after: float):
                await asyncio.sleep(after)
                payload = {"model": MODEL, "prompt": prompt_ids(900 + i, n), "max_tokens": 2, "ignore_eos": True,
                           "priority": klass}
                async with s.post(f"{slow}/v1/completions", json=payload, headers=ALICE,
                                  timeout=aiohttp.ClientTimeout(total=300)) as r:
                    return r.status, await r.json(), asyncio.get_running_loop().time()
            batch = [one(i, "bulk", 4000, 0.0) for i in range(4)]
            interactive = [one(10 + i, "interactive", 6000, 0.3) for i in range(2)]
            return await asyncio.gather(*batch, *interactive)

    results = asyncio.run(run())
    assert [c for c, _, _ in results] == [200] * 6, [b for _, b, _ in results]
    assert [b["fairway"]["class"] for _, b, _ in results] == ["bulk"] * 4 + ["interactive"] * 2
    assert total(slow, "router", "fairway_class_objective_total") - met == 6
    checked = 0
    for _, b, done in results[4:]:
        waiting = [d for _, x, d in results[:4]  # queued behind the running one when it arrived, 0.3 s later
                   if x["fairway"]["replica"] == b["fairway"]["replica"] and x["fairway"]["queue_wait_s"] > 0.3]
        if waiting:
            assert done < max(waiting), (b["fairway"], [x["fairway"] for _, x, _ in results])
            checked += 1
    if not checked:
        pytest.skip("the router left no bulk request waiting where the interactive ones went: "
                    f"{[(x['fairway']['replica'], x['fairway']['class']) for _, x, _ in results]}")


def test_requests_every_gate_refused_are_held_and_served_once(slow):
    """Twelve cold requests of class ``bulk`` at once, by its three paths (the body's
    ``priority``, the ``X-Fairway-Class`` header, the tenant's default): more than the two
    slowed replicas' queues take, so some are refused by both gates; those wait at the router and
    are sent when a gate has room. Every one is answered 200, the held ones say so, and each
    reached an engine exactly once (the replicas finished twelve requests)."""
    held_before = total(slow, "router", "fairway_router_hold_seconds_count")
    ok_before = total(slow, "replica", "fairway_requests_total")

    async def run():
        async with aiohttp.ClientSession() as s:
            async def one(i: int):
                payload = {"model": MODEL, "prompt": prompt_ids(1300 + i, 2000), "max_tokens": 2, "ignore_eos": True}
                headers = dict(ALICE)
                if i % 3 == 0:
                    payload["priority"] = "bulk"
                elif i % 3 == 1:
                    headers["X-Fairway-Class"] = "bulk"
                else:
                    headers = BULKCO
                async with s.post(f"{slow}/v1/completions", json=payload, headers=headers,
                                  timeout=aiohttp.ClientTimeout(total=300)) as r:
                    return r.status, await r.json()
            return await asyncio.gather(*(one(i) for i in range(12)))

    results = asyncio.run(run())
    assert [c for c, _ in results] == [200] * 12, [b for c, b in results if c != 200]
    assert {b["fairway"]["class"] for _, b in results} == {"bulk"}
    assert all(b["usage"]["completion_tokens"] == 2 for _, b in results)
    held = [b["fairway"]["held_s"] for _, b in results if "held_s" in b["fairway"]]
    assert held, "no request was held: the burst did not fill both gates"
    print(f"held at the router: {len(held)} of 12, for {min(held):.2f}-{max(held):.2f} s")
    assert total(slow, "router", "fairway_router_hold_seconds_count") - held_before == len(held)
    assert total(slow, "replica", "fairway_requests_total") - ok_before == 12  # none ran twice


def test_with_strict_tiers_an_interactive_prompt_is_not_computed_behind_a_running_batch_prefill(cluster):
    """Four cold 16,000-token bulk prompts, so every replica has one, each two steps of prefill
    (8,192 tokens a step, 10x slowed); 0.3 s later an interactive 300-token prompt. The FCFS engine
    (as stock vLLM) runs the bulk prompt's second chunk before it, and the gate holds it until the
    bulk request's first token: its first token comes after that one. With strict tiers the gate
    lets it past the bulk backlog and the engine computes it alone in the next step: its first
    token comes before the first token of the bulk request on its replica."""
    slow, strict = cluster
    async def run():
        async with aiohttp.ClientSession() as s:
            async def one(i: int, klass: str, n: int, after: float):
                await asyncio.sleep(after)
                loop = asyncio.get_running_loop()
                sent = loop.time()
                payload = {"model": MODEL, "prompt": prompt_ids(1300 + i, n), "max_tokens": 2, "ignore_eos": True,
                           "priority": klass}
                async with s.post(f"{slow}/v1/completions", json=payload, headers=ALICE,
                                  timeout=aiohttp.ClientTimeout(total=300)) as r:
                    body = await r.json()
                    return r.status, body, sent + body.get("fairway", {}).get("ttft_s", 0.0)
            return await asyncio.gather(*(one(i, "bulk", 16_000, 0.0) for i in range(4)),
                                        one(4, "interactive", 300, 0.3))

    results = asyncio.run(run())
    assert [c for c, _, _ in results] == [200] * 5, [b for _, b, _ in results]
    _, fast, first = results[4]
    bulk = [t for _, b, t in results[:4] if b["fairway"]["replica"] == fast["fairway"]["replica"]]
    assert bulk and (first < min(bulk)) == strict, ([(b["fairway"], t) for _, b, t in results], first, bulk)


def test_a_tenant_limited_to_its_classes_cannot_name_another(cluster):
    """``bulkco`` may use ``bulk`` and ``batch`` only: naming ``interactive`` gets 403 naming its
    classes, through ``serve run``'s config, and ``batch`` is served."""
    url, strict = cluster
    if strict:
        pytest.skip("the tenant's classes do not depend on the engines' order: checked on the other cluster")
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 1}
    r = requests.post(f"{url}/v1/completions", json={**body, "priority": "interactive"}, headers=BULKCO, timeout=60)
    assert r.status_code == 403, r.text
    assert "tenant 'bulkco' may not use request class 'interactive'; its classes: bulk, batch" in r.json()["error"][
        "message"]
    r = requests.post(f"{url}/v1/completions", json={**body, "priority": "batch"}, headers=BULKCO, timeout=60)
    assert r.status_code == 200 and r.json()["fairway"]["class"] == "batch", r.text


def test_silent_connections_are_dropped_and_a_silent_server_is_not_cut(cluster):
    """Connections that send part of a request and then nothing are closed by HAProxy after its
    client bound (with Ray's default, an hour, 4,096 of them stalled every other client), while an
    answer whose first byte comes after that bound (a non-streamed answer from the slowed engine)
    is still delivered whole."""
    url, strict = cluster
    if serve_env(dict(os.environ)).get("RAY_SERVE_ENABLE_HA_PROXY") != "1":
        pytest.skip("Serve's own proxy is the HTTP ingress here, not HAProxy")
    if strict:
        pytest.skip("HAProxy's client bound does not depend on the engines' order: checked on the other cluster")
    slow_answer: dict = {}

    def ask() -> None:
        t0 = time.monotonic()
        r = requests.post(f"{url}/v1/completions", headers=ALICE, timeout=120,
                          json={"model": MODEL, "prompt": "a long answer", "max_tokens": 120, "ignore_eos": True})
        slow_answer.update(status=r.status_code, took=time.monotonic() - t0, body=r.json())

    asker = threading.Thread(target=ask)
    asker.start()
    port = int(url.rsplit(":", 1)[1])
    socks = []
    for _ in range(20):
        s = socket.create_connection(("127.0.0.1", port), timeout=5)
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")  # and then nothing
        socks.append(s)
    opened, closed = time.monotonic(), {}
    while len(closed) < len(socks) and time.monotonic() < opened + CLIENT_TIMEOUT_S + 10:
        ready, _, _ = select.select([s for s in socks if s.fileno() not in closed], [], [], 0.2)
        for s in ready:
            try:
                while s.recv(4096):  # HAProxy's 408 page, then the close
                    pass
            except OSError:  # or a reset
                pass
            closed[s.fileno()] = time.monotonic() - opened
    for s in socks:
        s.close()
    assert len(closed) == len(socks), f"{len(socks) - len(closed)} silent connections still open"
    assert all(CLIENT_TIMEOUT_S - 0.5 <= t <= CLIENT_TIMEOUT_S + 5 for t in closed.values()), closed
    asker.join(120)
    assert slow_answer["status"] == 200, slow_answer
    assert slow_answer["body"]["usage"]["completion_tokens"] == 120
    assert slow_answer["took"] > CLIENT_TIMEOUT_S + 0.5, slow_answer  # its first byte came after the bound


def test_a_header_trickled_a_byte_at_a_time_is_cut_at_the_header_bound(cluster):
    """A client that sends its header a byte every half second never falls silent for HAProxy's
    client bound (3 s here), which restarts at each byte; the header bound that ``serve_env``
    adds to Ray's HAProxy (``HAPROXY_TIMEOUT_HTTP_REQUEST_S``, 10 s) answers it 408 and closes
    the connection, and another client is served meanwhile."""
    url, strict = cluster
    if serve_env(dict(os.environ)).get("RAY_SERVE_ENABLE_HA_PROXY") != "1":
        pytest.skip("Serve's own proxy is the HTTP ingress here, not HAProxy")
    if strict:
        pytest.skip("HAProxy's header bound does not depend on the engines' order: checked on the other cluster")
    bound = float(HAPROXY_TIMEOUT_HTTP_REQUEST_S)
    port = int(url.rsplit(":", 1)[1])
    s = socket.create_connection(("127.0.0.1", port), timeout=5)
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Trickle: ")
    opened, answer, served = time.monotonic(), b"", {}

    def ask() -> None:
        r = requests.post(f"{url}/v1/completions", headers=ALICE, timeout=60,
                          json={"model": MODEL, "prompt": "meanwhile", "max_tokens": 2, "ignore_eos": True})
        served.update(status=r.status_code)

    asker = threading.Thread(target=ask)
    asker.start()
    while time.monotonic() < opened + bound + 10:
        try:
            s.sendall(b"a")
        except OSError:  # closed under the write
            break
        ready, _, _ = select.select([s], [], [], 0.5)
        if ready:
            try:
                chunk = s.recv(4096)
            except OSError:  # a reset
                break
            if not chunk:
                break
            answer += chunk
    took = time.monotonic() - opened
    s.settimeout(1.0)
    with contextlib.suppress(OSError):  # what came before a close under the write
        while chunk := s.recv(4096):
            answer += chunk
    s.close()
    assert answer.startswith(b"HTTP/1.1 408"), answer[:80]
    assert bound - 0.5 <= took <= bound + 5, took
    asker.join(60)
    assert served == {"status": 200}
