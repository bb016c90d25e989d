"""observability/exporter.py: the exposition parsed back, naming conventions, promtool, the endpoint and
its service discovery (process-local store; the Ray KV path is in tests/e2e)."""

import json
import re
import subprocess
import time
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from dashboards.prom import find_promtool
from observability.exporter import (
    METRICS,
    FairwayCollector,
    MemoryStore,
    MetricsExporter,
    metrics_targets,
    render,
)
from observability.stats import TTFT_BUCKETS_S, FairwayStats

# "class": the configured request classes only (an unknown one is refused before any metric); "objective": met | missed;
# "path": call | channel (fairway_stream_tokens_total)
ALLOWED_LABELS = {"level", "lane", "replica", "policy", "status", "reason", "class", "objective", "path"}


def _filled() -> list[FairwayStats]:
    """Every series of every metric once: a router and a replica stats object."""
    r = FairwayStats("router", "ingress-0", "fairway")
    r.observe_ttft("fast", 0.03, replica="replica-0")
    r.observe_ttft("fast", 0.7, replica="replica-0")
    r.observe_ttft("fair", 12.0, replica="replica-0")
    r.observe_queue_wait("fast", 0.002, replica="replica-0")
    r.inc_requests("fast", "ok", replica="replica-0")
    r.inc_routing_decision("affinity", replica="replica-0")
    r.inc_reject("too_long")
    r.observe_cached_tokens(64, 48, 128, replica="replica-0")
    r.set_queued_prefill(0.5, replica="replica-0")
    p = FairwayStats("replica", "replica-0", "fairway")
    p.observe_ttft("fast", 0.02)
    p.observe_queue_wait("fast", 0.0)
    p.inc_requests("fast", "ok")
    p.inc_promotions(2)
    p.set_queue_depth("fast", 3)
    p.set_queue_depth("fair", 1)
    p.set_queued_prefill(0.4)
    p.set_queue_wait_estimate(1.5)
    p.observe_cached_tokens(48, 48, 128)
    p.inc_reject("queue_full")
    p.set_engine("", running=5, waiting=2, kv_usage=0.25, preemptions_total=1)
    return [r, p]


def _families(text: str) -> dict:
    return {f.name: f for f in text_string_to_metric_families(text)}


def _samples(fam, suffix: str = "", **labels):
    name = fam.name + suffix
    return [s for s in fam.samples if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())]


def test_exposition_parses_back_with_exact_values():
    fams = _families(render(_filled()))
    assert {m.name.removesuffix("_total") for m in METRICS} == set(fams)
    ttft = fams["fairway_ttft_seconds"]
    assert ttft.type == "histogram"
    (count,) = _samples(ttft, "_count", level="router", lane="fast")
    assert count.value == 2
    assert count.labels == {"level": "router", "lane": "fast", "replica": "replica-0", "policy": "fairway"}
    buckets = _samples(ttft, "_bucket", level="router", lane="fast")
    assert [b.labels["le"] for b in buckets][-1] == "+Inf"
    assert len(buckets) == len(TTFT_BUCKETS_S)
    by_le = {float(b.labels["le"]): b.value for b in buckets}
    assert by_le[0.02] == 0 and by_le[0.05] == 1 and by_le[0.75] == 2 and by_le[float("inf")] == 2
    (ttft_sum,) = _samples(ttft, "_sum", level="router", lane="fast")
    assert ttft_sum.value == pytest.approx(0.73)
    (fair,) = _samples(ttft, "_count", level="router", lane="fair")
    assert fair.value == 1
    (rep,) = _samples(ttft, "_count", level="replica")
    assert rep.value == 1 and rep.labels["replica"] == "replica-0"

    req = fams["fairway_requests"]
    assert req.type == "counter"
    assert {(s.labels["level"], s.labels["status"], s.value) for s in _samples(req, "_total")} == {
        ("router", "ok", 1.0),
        ("replica", "ok", 1.0),
    }
    (promo,) = _samples(fams["fairway_lane_promotions"], "_total")
    assert promo.value == 2 and promo.labels["level"] == "replica"
    depth = {s.labels["lane"]: s.value for s in _samples(fams["fairway_queue_depth"])}
    assert depth == {"fast": 3, "fair": 1}
    (kv,) = _samples(fams["fairway_engine_kv_usage_ratio"])
    assert kv.value == 0.25
    rejects = {(s.labels["level"], s.labels["reason"]) for s in _samples(fams["fairway_rejects"], "_total")}
    assert rejects == {("router", "too_long"), ("replica", "queue_full")}
    err = fams["fairway_cache_estimate_error_ratio"]
    (e_router,) = _samples(err, "_sum", level="router")
    assert e_router.value == pytest.approx(16 / 128)


def test_series_of_several_objects_with_the_same_labels_are_merged():
    a, b = FairwayStats("router", "i0", "p"), FairwayStats("router", "i1", "p")
    for s, v in ((a, 0.03), (b, 0.04), (b, 9.0)):
        s.observe_ttft("fast", v, replica="r")
        s.inc_requests("fast", "ok", replica="r")
    a.set_queue_depth("fast", 1, replica="r")
    b.set_queue_depth("fast", 4, replica="r")
    fams = _families(render([a, b]))
    (count,) = _samples(fams["fairway_ttft_seconds"], "_count")
    assert count.value == 3
    inf = [s for s in _samples(fams["fairway_ttft_seconds"], "_bucket") if s.labels["le"] == "0.05"]
    assert inf[0].value == 2
    (req,) = _samples(fams["fairway_requests"], "_total")
    assert req.value == 3
    (depth,) = _samples(fams["fairway_queue_depth"])
    assert depth.value == 4  # gauges: last object wins


def test_metric_names_follow_conventions():
    names = [m.name for m in METRICS]
    assert len(set(names)) == len(names)
    for m in METRICS:
        assert re.fullmatch(r"fairway_[a-z][a-z0-9_]*", m.name), m.name  # prefix, snake_case, no colons
        assert m.help and m.help.endswith("."), m.name
        assert set(m.labels) <= ALLOWED_LABELS, m.labels  # low-cardinality labels only
        assert m.labels[0] == "level" and m.labels[-1] == "policy"
        if m.kind == "counter":
            assert m.name.endswith("_total"), m.name
        else:
            assert not m.name.endswith("_total"), m.name
        if m.kind == "histogram":
            assert m.name.endswith(("_seconds", "_ratio")), m.name  # base units
        assert not re.search(r"_(ms|milliseconds|percent|minutes)\b", m.name), m.name
    assert "fairway_engine_kv_usage_ratio" in names  # 0-1 values end in _ratio


def test_the_probes_read_exported_metric_names():
    """observability/probe.py sums samples by name: a name the exporter does not write reads as
    0 for ever (the KV usage gauge was read as fairway_engine_kv_usage, so wait_idle never saw a
    block in use)."""
    from observability.exporter import METRICS
    from observability.probe import GAUGES

    assert set(GAUGES) <= {m.name for m in METRICS}


def test_promtool_check_metrics_on_a_scrape():
    promtool = find_promtool()
    if promtool is None:
        pytest.skip("promtool not found: run scripts/monitoring.sh install (Debian's prometheus package)")
    text = render(_filled())
    res = subprocess.run([promtool, "check", "metrics"], input=text.encode(), capture_output=True, timeout=30)
    assert res.returncode == 0 and not res.stdout.strip() and not res.stderr.strip(), (res.stdout, res.stderr)


def test_collector_reads_a_live_list():
    objs: list[FairwayStats] = []
    c = FairwayCollector(objs)
    assert all(not fam.samples for fam in c.collect())
    s = FairwayStats("replica", "r9")
    s.inc_requests("fast", "ok")
    objs.append(s)
    (req,) = [f for f in c.collect() if f.name == "fairway_requests"]
    assert req.samples[0].labels["replica"] == "r9"


def _get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=5) as r:
        return r.read()


def test_exporter_serves_metrics_and_registers_target():
    store = MemoryStore()
    stats = _filled()
    exp = MetricsExporter(stats, "replica-0", bind_host="127.0.0.1", store=store, ttl_s=60, refresh_s=0.05)
    addr = exp.start()
    try:
        assert re.fullmatch(r"127\.0\.0\.1:\d+", addr)
        fams = _families(_get(f"http://{addr}/metrics").decode())
        assert "fairway_ttft_seconds" in fams
        sd = metrics_targets(store)
        assert sd == [{"targets": [addr], "labels": {"component": "replica-0", "level": "replica+router"}}]
        assert json.loads(_get(f"http://{addr}/metrics/targets")) == sd
        # the refresher keeps pushing the expiry forward
        first = json.loads(store.items()[0][1])["expires_at"]
        deadline = time.monotonic() + 5
        while json.loads(store.items()[0][1])["expires_at"] == first and time.monotonic() < deadline:
            time.sleep(0.02)
        assert json.loads(store.items()[0][1])["expires_at"] > first
    finally:
        exp.stop()
    assert metrics_targets(store) == []
    exp.stop()  # idempotent


def test_expired_targets_are_dropped_and_deleted():
    store = MemoryStore()

    def entry(target, labels, expires_at):
        return json.dumps({"target": target, "labels": labels, "expires_at": expires_at}).encode()

    store.put("dead@10.0.0.1:1", entry("10.0.0.1:1", {}, 100.0))
    store.put("live@10.0.0.2:2", entry("10.0.0.2:2", {"level": "replica"}, 300.0))
    store.put("junk", b"not json")
    assert metrics_targets(store, now=200.0) == [{"targets": ["10.0.0.2:2"], "labels": {"level": "replica"}}]
    assert [k for k, _ in store.items()] == ["junk", "live@10.0.0.2:2"]


def test_exporter_rejects_bad_ttl():
    with pytest.raises(ValueError):
        MetricsExporter([], "x", ttl_s=5, refresh_s=5)


def test_metrics_targets_async_reads_the_same_store():
    import asyncio

    from observability.exporter import metrics_targets_async

    store = MemoryStore()
    store.put("a@1.2.3.4:5", json.dumps({"target": "1.2.3.4:5", "labels": {}, "expires_at": time.time() + 60}).encode())
    assert (
        asyncio.run(metrics_targets_async(store))
        == metrics_targets(store)
        == [{"targets": ["1.2.3.4:5"], "labels": {}}]
    )
