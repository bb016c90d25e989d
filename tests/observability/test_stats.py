"""observability/stats.py: exact counts and buckets after known observations (no Prometheus, no Ray)."""

import math
import threading

import pytest

from observability.stats import (
    ERROR_RATIO_BUCKETS,
    QUEUE_WAIT_BUCKETS_S,
    TTFT_BUCKETS_S,
    FairwayStats,
    Histogram,
)


def _series(snap, group, name, **labels):
    out = [s for s in snap[group][name] if all(s["labels"][k] == v for k, v in labels.items())]
    assert len(out) == 1, out
    return out[0]


def test_ttft_buckets_span_10ms_to_5min_log_spaced():
    finite = TTFT_BUCKETS_S[:-1]
    assert TTFT_BUCKETS_S[-1] == math.inf
    assert finite[0] == 0.01 and finite[-1] == 300.0
    assert 18 <= len(finite) <= 24
    ratios = [b / a for a, b in zip(finite[:-1], finite[1:], strict=True)]
    assert all(1.3 <= r <= 2.6 for r in ratios), ratios  # roughly log-spaced, strictly increasing
    assert QUEUE_WAIT_BUCKETS_S[-len(TTFT_BUCKETS_S) :] == TTFT_BUCKETS_S
    assert ERROR_RATIO_BUCKETS[-2] == 1.0


def test_histogram_le_semantics_and_cumulative():
    h = Histogram((0.1, 1.0, math.inf))
    for v in (0.0, 0.1, 0.10001, 1.0, 5.0):
        h.observe(v)
    assert h.counts == [2, 2, 1]  # a value equal to a bound lands in that bound's bucket
    assert h.cumulative() == [2, 4, 5]
    assert h.count == 5
    assert h.sum == pytest.approx(6.20001)


def test_ttft_exact_buckets_per_lane_and_replica():
    s = FairwayStats("router", "ingress-0", policy="fairway")
    for v in (0.005, 0.01, 0.03, 0.03, 2.5):
        s.observe_ttft("fast", v, replica="r0")
    s.observe_ttft("fair", 400.0, replica="r1")
    snap = s.snapshot()
    fast = _series(snap, "histograms", "ttft", lane="fast")
    assert fast["labels"] == {"lane": "fast", "replica": "r0"}
    assert fast["bounds"] == TTFT_BUCKETS_S
    want = [2, 2, 4, 4, 4, 4, 4, 4, 4, 4, 4, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5]
    assert fast["buckets"] == want
    assert fast["count"] == 5 and fast["sum"] == pytest.approx(2.575)
    fair = _series(snap, "histograms", "ttft", lane="fair")
    assert fair["buckets"][-2] == 0 and fair["buckets"][-1] == 1  # above 300 s: only +Inf
    assert s.ttft_count() == 6 and s.ttft_count("fast") == 5 and s.ttft_count(replica="r1") == 1


def test_counters_gauges_and_labels():
    s = FairwayStats("replica", "replica-3", policy="fairway")
    s.inc_requests("fast", "ok")
    s.inc_requests("fast", "ok")
    s.inc_requests("fair", "error")
    s.inc_promotions()
    s.inc_promotions(3)
    s.set_queue_depth("fast", 7)
    s.set_queue_depth("fast", 2)  # gauges keep the last value
    s.set_queued_prefill(1.25)
    s.set_queue_wait_estimate(4.5)
    s.inc_reject("queue_full")
    s.inc_routing_decision("affinity", replica="replica-1")  # an explicit replica wins
    s.observe_queue_wait("fast", 0.0)
    snap = s.snapshot()
    assert snap["level"] == "replica" and snap["component"] == "replica-3" and snap["policy"] == "fairway"
    # an empty replica means the object's own component at level "replica"
    assert _series(snap, "counters", "requests", lane="fast")["value"] == 2
    assert _series(snap, "counters", "requests", lane="fast")["labels"]["replica"] == "replica-3"
    assert s.counter("requests") == 3 and s.counter("requests", status="error") == 1
    assert s.counter("promotions") == 4
    assert s.gauge("queue_depth", lane="fast", replica="replica-3") == 2
    assert s.gauge("queued_prefill", replica="replica-3") == 1.25
    assert s.gauge("queue_wait_estimate", replica="replica-3") == 4.5
    assert s.counter("rejects", reason="queue_full") == 1
    assert _series(snap, "counters", "routing_decisions", reason="affinity")["labels"]["replica"] == "replica-1"
    qw = _series(snap, "histograms", "queue_wait", lane="fast")
    assert qw["bounds"] == QUEUE_WAIT_BUCKETS_S and qw["buckets"][0] == 1


def test_router_level_keeps_empty_replica():
    s = FairwayStats("router", "ingress-0")
    s.inc_requests("", "rejected")
    assert s.snapshot()["counters"]["requests"][0]["labels"] == {"lane": "", "status": "rejected", "replica": ""}


def test_cached_tokens_and_estimate_error():
    s = FairwayStats("router", "ingress-0")
    s.observe_cached_tokens(estimated=64, actual=32, prompt_tokens=128, replica="r0")  # error 0.25
    s.observe_cached_tokens(estimated=0, actual=0, prompt_tokens=100, replica="r0")  # error 0
    s.observe_cached_tokens(estimated=5, actual=0, prompt_tokens=0, replica="r0")  # no prompt: no ratio
    assert s.counter("estimated_cached_tokens") == 69
    assert s.counter("actual_cached_tokens") == 32
    assert s.counter("prompt_tokens") == 228
    err = _series(s.snapshot(), "histograms", "cache_estimate_error", replica="r0")
    assert err["count"] == 2 and err["sum"] == pytest.approx(0.25)
    # bounds (0, .01, .02, .05, .1, .2, .3, ...): 0 in the first bucket, 0.25 in (0.2, 0.3]
    assert err["buckets"][:7] == [1, 1, 1, 1, 1, 1, 2]


def test_ttft_model_ratio_by_routing_reason():
    s = FairwayStats("router", "ingress-0")
    s.observe_ttft_model("affinity", 1.1)  # about right
    s.observe_ttft_model("affinity", 6.0)  # the model missed a 6x longer wait
    s.observe_ttft_model("", 0.5)  # a decision with no reason counts as the hosts count it
    aff = _series(s.snapshot(), "histograms", "ttft_model", reason="affinity")
    assert aff["count"] == 2 and aff["sum"] == pytest.approx(7.1)
    # bounds (0.125, 0.25, 0.5, 0.8, 1, 1.25, 2, 4, 8, ...): 1.1 in (1, 1.25], 6 in (4, 8]
    assert aff["buckets"][:9] == [0, 0, 0, 0, 0, 1, 1, 1, 2]
    assert _series(s.snapshot(), "histograms", "ttft_model", reason="choice")["count"] == 1


def test_engine_figures_and_monotonic_preemptions():
    s = FairwayStats("replica", "r0")
    s.set_engine("r0", running=3, waiting=1, kv_usage=0.4, preemptions_total=5)
    s.set_engine("r0", running=2, waiting=0, kv_usage=1.7, preemptions_total=2)  # engine restarted
    assert s.gauge("engine_running", replica="r0") == 2
    assert s.gauge("engine_waiting", replica="r0") == 0
    assert s.gauge("engine_kv_usage", replica="r0") == 1.0  # clamped to [0, 1]
    assert s.counter("engine_preemptions") == 5  # a counter never goes down


def test_invalid_inputs():
    with pytest.raises(ValueError):
        FairwayStats("cluster", "x")
    s = FairwayStats("router", "x")
    with pytest.raises(ValueError):
        s.inc_requests("fast", "weird")
    with pytest.raises(ValueError):
        s.inc_promotions(-1)
    with pytest.raises(ValueError):
        s.observe_ttft("fast", math.nan)
    s.observe_ttft("fast", -0.5)  # clock skew across nodes: clamped to 0, not dropped
    assert _series(s.snapshot(), "histograms", "ttft", lane="fast")["buckets"][0] == 1


def test_snapshot_is_plain_data_and_deterministic():
    s = FairwayStats("replica", "r0", "fairway")
    for lane in ("b", "a", "c"):
        s.observe_ttft(lane, 0.1)
        s.inc_requests(lane, "ok")
    snap = s.snapshot()
    assert [x["labels"]["lane"] for x in snap["histograms"]["ttft"]] == ["a", "b", "c"]
    assert snap == s.snapshot()
    s.observe_ttft("a", 0.1)  # the snapshot is a copy
    assert snap["histograms"]["ttft"][0]["count"] == 1


def test_concurrent_updates_and_snapshots():
    """A scrape thread snapshotting while another thread records never fails or loses counts."""
    s = FairwayStats("replica", "r0")
    stop = threading.Event()
    errors = []

    def scrape():
        while not stop.is_set():
            try:
                s.snapshot()
            except Exception as e:  # noqa: BLE001
                errors.append(e)

    t = threading.Thread(target=scrape)
    t.start()
    try:
        for i in range(20000):
            s.observe_ttft(f"lane{i % 50}", 0.01 * (i % 7))
            s.inc_requests(f"lane{i % 50}", "ok")
    finally:
        stop.set()
        t.join()
    assert not errors
    assert s.ttft_count() == 20000 and s.counter("requests") == 20000
