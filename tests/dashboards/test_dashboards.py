"""dashboards/: committed JSON equals the code, queries read exported metrics, the PNG renderer,
and the exporter -> Prometheus -> dashboard-queries pipeline on synthetic traffic."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from dashboards import build
from dashboards.prom import config_for, find_prometheus
from dashboards.queries import DASHBOARDS, HAPROXY_SERIES, PANELS, QUERIES, RATE, promql
from dashboards.render import legend, parse_duration, rate_interval, render_all
from observability.exporter import METRICS

ROOT = Path(__file__).resolve().parents[2]


def test_committed_json_equals_generated():
    res = subprocess.run(
        [sys.executable, "-m", "dashboards.build", "--check"], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert res.returncode == 0, res.stderr


def test_check_detects_stale_missing_and_extra_files(tmp_path):
    assert build.main(["--out", str(tmp_path)]) == 0
    assert build.check(tmp_path) == []
    path = build.json_path("overview", tmp_path)
    path.write_text(path.read_text().replace("TTFT", "TTFX", 1))
    (tmp_path / "other.json").write_text("{}")
    build.json_path("replicas", tmp_path).unlink()
    problems = build.check(tmp_path)
    assert len(problems) == 3
    assert "differs" in problems[0] and "missing" in problems[1] and "not generated" in problems[2]
    assert build.main(["--check", "--out", str(tmp_path)]) == 1


def test_queries_read_only_exported_metrics():
    exported = set()
    for m in METRICS:
        exported.add(m.name)
        if m.kind == "histogram":
            exported |= {m.name + "_bucket", m.name + "_count", m.name + "_sum"}
    exported |= set(HAPROXY_SERIES)  # HAProxy's own exporter, Ray's HTTP ingress
    for q in QUERIES:
        assert q.metrics, q
        assert set(q.metrics) <= exported, (q.panel, q.metrics)
        # HAProxy's series are absent without HAProxy: no query of them may expect data
        assert not (q.expect_data and any(m.startswith("haproxy_") for m in q.metrics)), q


def test_panels_and_queries_are_consistent():
    keys = [p.key for p in PANELS]
    assert len(set(keys)) == len(keys)
    assert {q.panel for q in QUERIES} == set(keys)  # every panel has queries, every query a panel
    refs = [(q.panel, q.ref) for q in QUERIES]
    assert len(set(refs)) == len(refs)
    assert {p.dashboard for p in PANELS} == set(DASHBOARDS)
    # the panels the issue asks for
    titles = " | ".join(p.title.lower() for p in PANELS)
    for needed in (
        "ttft p50 / p90 / p99 per lane",
        "lane split",
        "queue depth per replica and lane",
        "estimated vs actual",
        "routing",
        "queued prefill",
        "kv cache usage",
        "rejects",
    ):
        assert needed in titles, needed


def test_generated_dashboards_are_valid_grafana_models():
    all_exprs = {q.expr for q in QUERIES}
    seen = set()
    for name in DASHBOARDS:
        d = json.loads(build.render_json(name))
        assert d["schemaVersion"] >= 39 and d["uid"] == DASHBOARDS[name]["uid"]
        assert d["templating"]["list"][0]["type"] == "datasource"
        ids = [p["id"] for p in d["panels"]]
        assert len(set(ids)) == len(ids)
        for p in d["panels"]:
            g = p["gridPos"]
            assert 0 <= g["x"] and g["x"] + g["w"] <= 24
            if p["type"] == "row":
                continue
            assert p["datasource"]["uid"] == "${datasource}"
            for t in p["targets"]:
                assert t["expr"] in all_exprs
                seen.add(t["expr"])
    assert seen == all_exprs  # every query is on a dashboard


def test_promql_substitution_and_render_helpers():
    assert all(RATE in q.expr or "rate(" not in q.expr for q in QUERIES)
    assert "$__" not in promql(QUERIES[0].expr, "30s")
    assert rate_interval(2, 2) == "8s" and rate_interval(30, 2) == "32s"
    assert parse_duration("15m") == 900 and parse_duration("90") == 90
    assert legend("{{lane}} p90", {"lane": "fast"}) == "fast p90"
    assert legend("{{missing}}", {}) == "value"


class _FakeProm:
    """query_range answers a 60 s ramp per lane for every expression."""

    def query_range(self, expr, start, end, step):
        ts = [start + i * step for i in range(int((end - start) / step) + 1)]
        return [
            {
                "metric": {"lane": lane, "replica": "replica-0", "level": "router", "reason": "affinity"},
                "values": [[t, str(k * (i + 1) / len(ts))] for i, t in enumerate(ts)],
            }
            for k, lane in ((1.0, "fast"), (0.5, "fair"))
        ]


def test_render_writes_one_png_per_dashboard(tmp_path):
    report = render_all(_FakeProm(), tmp_path, 1_000_000.0, 1_000_060.0)
    assert set(report) == set(DASHBOARDS)
    for r in report.values():
        png = Path(r["path"])
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert r["panels"] >= 6 and r["empty"] == []


def test_prometheus_config_is_the_committed_one_with_another_url():
    text = config_for("http://10.1.2.3:8000/metrics/targets", "/x/sd.json", scrape_interval="1s")
    assert "http://10.1.2.3:8000/metrics/targets" in text and "/x/sd.json" in text
    assert "127.0.0.1:8000" not in text


@pytest.fixture(scope="module")
def prometheus_binary():
    path = find_prometheus()
    if path is None:
        pytest.skip("prometheus binary not found: run scripts/monitoring.sh install (Debian's prometheus 2.42)")
    return path


@pytest.mark.e2e
def test_pipeline_exporter_prometheus_dashboards(prometheus_binary, tmp_path):
    """Real exporters (process-local target store) + a real Prometheus using the committed config's
    http_sd job: every dashboard query that should have data has it, and Prometheus's per-lane
    router TTFT counts equal the requests the synthetic load finished."""
    from dashboards.demo import run_demo

    report = run_demo(duration_s=6.0, out_dir=tmp_path)
    assert report["queries_empty"] == []
    # the request-class panels have data wherever classes are configured (the demo has two)
    assert not any(q.startswith("class_") for q in report["queries_empty_expected"]), report
    assert sum(report["completed"].values()) > 50
    assert report["prom_router_ttft_counts"] == {k: float(v) for k, v in report["completed"].items()}
    for r in report["render"].values():
        assert Path(r["path"]).stat().st_size > 10_000
