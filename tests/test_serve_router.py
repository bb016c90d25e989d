"""The Ray Serve router host's reading of replica stats (``FairwayRequestRouter._apply_stats``),
without a Ray cluster: the host object is built directly and fed stats dicts as Ray would."""

from __future__ import annotations

import time

import pytest

from fairway.protocol import GenerateCall
from fairway.routing import make_states
from router.serve_router import FairwayRequestRouter
from tests.factories import chain


def host() -> tuple[FairwayRequestRouter, int]:
    r = object.__new__(FairwayRequestRouter)
    r.initialize_state(metrics=False)
    j = r.index.add_replica()
    r.load.add_replica()
    r._names.append("replica-0")
    return r, j


def book(r: FairwayRequestRouter, j: int, request_id: str, prompt: int, routed_ago_s: float) -> None:
    call = GenerateCall(request_id=request_id, prompt_token_ids=[1] * prompt,
                        block_hashes=tuple(chain(request_id, prompt // 16)), max_tokens=4, arrival_s=time.time())
    r._book("iid-" + request_id, call, call.block_hashes, j, 0, "cold")
    r._routed["iid-" + request_id].routed_at = time.time() - routed_ago_s


def test_stats_mark_starts_date_prefills_and_drop_finished_prefills():
    r, j = host()
    book(r, j, "a", 20000, 5.0)  # prefilling since 0.5 s ago
    book(r, j, "b", 20000, 5.0)  # started, first token already out
    book(r, j, "c", 20000, 5.0)  # still waiting in the gate
    p = r.load.snapshot().queued_prefills[j]
    assert len(p) == 3 and r.load.snapshot().running == (0,)
    pa = p[0]  # the three prompts cost the same
    now = time.time()
    r._apply_stats(j, {"taken_at": now - 0.1, "waiting_ids": ["c"], "prefilling": {"a": now - 0.5},
                       "kv_usage": 0.0, "max_num_seqs": 256})
    snap = r.load.snapshot()
    assert snap.running == (2,) and snap.queued_prefills[j] == pytest.approx((pa,))
    # "a" is dated from its admission, 0.5 s ago: about P - 0.5 of its prefill is left; "b" is
    # past its prefill and does not count
    (end,) = snap.prefill_ends[j]
    assert end - r.clock.now() == pytest.approx(pa - 0.5, abs=0.05)
    (state,) = make_states(r.load.snapshot(), [0], r.index.sizes())
    assert r.policy.running_prefill_s(state) == pytest.approx(pa - 0.5, abs=0.05)
    # the next report: "a" has its first token too
    r._apply_stats(j, {"taken_at": now, "waiting_ids": ["c"], "prefilling": {}, "kv_usage": 0.0})
    assert r.load.snapshot().prefill_ends[j] == ()


def test_stats_without_a_prefilling_list_date_starts_at_the_report():
    r, j = host()
    book(r, j, "a", 20000, 5.0)
    taken = time.time() - 0.2
    r._apply_stats(j, {"taken_at": taken, "waiting_ids": [], "kv_usage": 0.0})  # an older replica
    snap = r.load.snapshot()
    p = r.load._req[0].prefill_s
    (end,) = snap.prefill_ends[j]
    assert end - r.clock.now() == pytest.approx(p - 0.2, abs=0.05)  # started by ``taken`` at the latest

