"""Observability end to end: the Ray scrape path, and a live cluster scraped by a real Prometheus.

- ``test_targets_registered_in_ray_kv_and_expire``: an exporter inside a Ray actor registers in
  Ray's internal KV, the driver lists it through ``metrics_targets()`` and scrapes it, and the
  entry disappears once the actor is killed (TTL expiry, no cleanup code runs).
- ``test_dashboards_on_live_cluster``: the cluster (sim engine, ``cluster/launch.py``), a real
  Prometheus using the committed ``deploy/prometheus/prometheus.yml`` (http_sd against the
  ingress's ``/metrics/targets``), load from ``python -m loadgen run``. Asserts every dashboard
  query that should have data has it, and Prometheus's per-lane router TTFT counts equal what the
  load generator finished, per lane and in total.

Both skip with the reason when Ray, the cluster helper or the prometheus binary is missing
(``scripts/monitoring.sh install`` fetches the binary).
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from dashboards.demo import check_queries
from dashboards.prom import PrometheusServer, config_for, find_prometheus
from observability.stats import FairwayStats
from tests.e2e.probes import poll

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
LOAD_S = 10.0
RATE = 4.0


def _get_json(url: str):
    with urllib.request.urlopen(url, timeout=10) as r:
        return json.load(r)


@pytest.fixture
def prometheus_binary() -> str:
    path = find_prometheus()
    if path is None:
        pytest.skip("prometheus binary not found: run scripts/monitoring.sh install (Debian's prometheus 2.42)")
    return path


def test_targets_registered_in_ray_kv_and_expire():
    ray = pytest.importorskip("ray")
    from observability.exporter import RayKVStore, metrics_targets

    started_here = not ray.is_initialized()
    if started_here and os.environ.get("RAY_ADDRESS"):  # CI's running Ray instance
        ray.init(log_to_driver=False)
    elif started_here:
        ray.init(address="local", num_cpus=1, include_dashboard=False, log_to_driver=False)  # a fresh one
    try:

        @ray.remote(num_cpus=0)
        class Recorder:
            def __init__(self) -> None:
                from observability.exporter import MetricsExporter

                self.stats = FairwayStats("replica", "kv-test-replica", "fairway")
                self.stats.observe_ttft("fast", 0.05)
                self.exporter = MetricsExporter([self.stats], "kv-test-replica", ttl_s=3.0, refresh_s=0.5)
                self.addr = self.exporter.start()

            def address(self) -> str:
                return self.addr

        actor = Recorder.remote()
        addr = ray.get(actor.address.remote())

        def mine():
            return [t for t in metrics_targets(RayKVStore()) if t["targets"] == [addr]]

        def expires_at() -> float | None:
            """The stored expiry of this actor's entry (None once it is gone)."""
            raw = [json.loads(v) for _, v in RayKVStore().items()]
            return next((e["expires_at"] for e in raw if e.get("target") == addr), None)

        (entry,) = poll(mine, 10, what="target in Ray's KV")
        assert entry["labels"] == {"component": "kv-test-replica", "level": "replica"}
        first_expiry = expires_at()
        assert first_expiry is not None, "target listed but its KV entry has no expires_at"
        with urllib.request.urlopen(f"http://{addr}/metrics", timeout=5) as r:
            assert b'fairway_ttft_seconds_count{lane="fast",level="replica"' in r.read()
        # the refresher keeps it alive: the stored expiry moves forward, and past the first expiry
        # time the target is still listed (ttl 3 s, refresh 0.5 s)
        poll(
            lambda: (expires_at() or 0.0) > first_expiry,
            10,
            interval_s=0.1,
            what="the refresher pushing the target's expires_at forward",
        )
        poll(lambda: time.time() > first_expiry, 10, interval_s=0.1, what="the wall clock passing the first expiry")
        assert mine(), "target dropped after its first expiry time: the refresher did not keep it alive"
        ray.kill(actor, no_restart=True)
        poll(lambda: not mine(), 10, what="target expired after the actor died")
    finally:
        if started_here:
            ray.shutdown()


def test_dashboards_on_live_cluster(prometheus_binary, tmp_path):
    try:
        cluster = importlib.import_module("cluster.launch")
    except ImportError as e:
        pytest.skip(f"cluster/launch.py (running_cluster) not available: {e}")

    with cluster.running_cluster() as base_url:
        ready_at = time.time()  # the warm-up requests (running_cluster's readiness probes) are done
        base_url = base_url.rstrip("/")
        targets_url = f"{base_url}/metrics/targets"

        def levels():
            targets = _get_json(targets_url)
            found = {t["labels"].get("level") for t in targets}
            return targets if {"router", "replica"} <= found else None

        targets = poll(levels, 60, what="router and replica targets at /metrics/targets")
        cfg = config_for(targets_url, scrape_interval="1s")
        with PrometheusServer(cfg, binary=prometheus_binary, data_dir=tmp_path / "prom") as prom:
            prom.wait_for_targets(len(targets), timeout_s=30)
            count_q = 'sum by (lane) (fairway_ttft_seconds_count{level="router"})'

            def router_counts() -> dict[str, float]:
                return {s["metric"].get("lane", ""): float(s["value"][1]) for s in prom.client.query(count_q)}

            def scraped_after(t: float) -> bool:
                """Every target listed now has an ``up`` sample from a scrape started after ``t``:
                Prometheus commits a scrape's samples with its ``up``, so the counters read then
                are queryable and include everything finished before ``t``."""
                listed = {a for e in _get_json(targets_url) for a in e["targets"]}
                fresh = {
                    s["metric"].get("instance")
                    for s in prom.client.query('timestamp(up{job="fairway"})')
                    if float(s["value"][1]) > t
                }
                return listed <= fresh

            # the baseline: a scrape of every target after the warm-up shows all of its requests
            poll(lambda: scraped_after(ready_at), 30, interval_s=0.25, what="a scrape of every target after warm-up")
            before = router_counts()

            out_json = tmp_path / "load.json"
            cmd = [
                sys.executable, "-m", "loadgen", "run", "--url", base_url, "--workload", "mixed",
                "--rate", str(RATE), "--duration", str(LOAD_S), "--seed", "0", "--json", str(out_json),
                "--no-progress",
            ]  # fmt: skip
            start = time.time()
            proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
            assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
            res = json.loads(out_json.read_text())
            n_finished = res["n_finished"]
            assert n_finished > 0, res
            want = {lane: v["n"] for lane, v in res["ttft_by_lane_s"].items()}
            assert sum(want.values()) == n_finished, res["ttft_by_lane_s"]

            def delta() -> dict[str, float]:
                now = router_counts()
                return {k: v - before.get(k, 0.0) for k, v in now.items() if v - before.get(k, 0.0) > 0}

            # the load generator has exited: a scrape of every target after now shows every request
            load_done_at = time.time()
            poll(
                lambda: scraped_after(load_done_at), 30, interval_s=0.25, what="a scrape of every target after the load"
            )
            got = delta()

            # every dashboard query returns data (those that should), over a window covering the load
            window = f"{int(time.time() - start) + 10}s"
            checked = check_queries(prom.client, window)
            empty = [f"{q.panel}/{q.ref}: {q.expr}" for q in checked["empty"]]

            from dashboards.render import render_all

            # drawn before the assertions, kept for a look (out/ is git-ignored)
            report = render_all(prom.client, ROOT / "out" / "dashboards-e2e", start - 5, time.time(), scrape_s=1.0)
            for r in report.values():
                assert Path(r["path"]).stat().st_size > 10_000

            assert got == {lane: float(n) for lane, n in want.items()}, (got, want)
            assert sum(got.values()) == n_finished
            assert not empty, "dashboard queries without data:\n" + "\n".join(empty)

            # the committed config's haproxy job: the HTTP ingress's own answers, every request of the load
            if cluster.serve_env(dict(os.environ)).get("RAY_SERVE_ENABLE_HA_PROXY") == "1":
                ok_q = 'sum(haproxy_frontend_http_responses_total{job="haproxy",proxy="http_frontend",code="2xx"})'

                def answered() -> float | None:
                    v = sum(float(x["value"][1]) for x in prom.client.query(ok_q))
                    return v if v >= n_finished else None

                poll(answered, 30, interval_s=0.5, what="HAProxy's 2xx count through the haproxy job")
