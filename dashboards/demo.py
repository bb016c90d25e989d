"""The exporter -> Prometheus -> dashboards pipeline on synthetic traffic, without a cluster.

    python -m dashboards.demo --duration 60 --out out/dashboards-demo/

One router-level and two replica-level ``FairwayStats`` (the processes of a small cluster) are
fed synthetic requests, each exported by a ``MetricsExporter`` on its own port and registered in a
process-local target store; a real Prometheus discovers them through the exporter's
``/metrics/targets`` (the committed config's http_sd job), scrapes them, and every dashboard
query is checked for data; then the PNGs are rendered. ``tests/dashboards/test_dashboards.py`` runs a short
version. Traffic is seeded (``random.Random(seed)``); wall time only drives the scrapes.
"""

from __future__ import annotations

import argparse
import random
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dashboards.prom import PrometheusServer, config_for, find_prometheus
from dashboards.queries import QUERIES, Query, promql
from observability.exporter import MemoryStore, MetricsExporter
from observability.stats import FairwayStats

LANES = ("fast", "fair")
REASONS = ("affinity", "fair", "least-load")


@dataclass
class SyntheticCluster:
    """A router stats object and ``n_replicas`` replica stats objects fed by ``step``."""

    n_replicas: int = 2
    seed: int = 0
    policy: str = "fairway"
    router: FairwayStats = field(init=False)
    replicas: list[FairwayStats] = field(init=False)
    completed: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)
        self.router = FairwayStats("router", "ingress-0", self.policy)
        self.replicas = [FairwayStats("replica", f"replica-{i}", self.policy) for i in range(self.n_replicas)]
        self.queued = [0] * self.n_replicas

    def step(self, n: int, phase: float = 0.0) -> None:
        """``n`` requests finish now; ``phase`` in [0, 1) modulates load (a slow wave)."""
        rng = self.rng
        load = 1.0 + 0.8 * abs((phase * 2) % 2 - 1)
        for _ in range(n):
            j = rng.randrange(self.n_replicas)
            rep = self.replicas[j]
            name = rep.component
            lane = "fast" if rng.random() < 0.75 else "fair"
            base = 0.08 if lane == "fast" else 0.6
            ttft = rng.lognormvariate(0, 0.6) * base * load
            wait = max(0.0, ttft - 0.05 * rng.random())
            prompt = rng.randint(500, 6000)
            actual = int(prompt * rng.choice((0.0, 0.5, 0.9)))
            est = max(0, min(prompt, actual + rng.randint(-200, 200)))
            reason = rng.choice(REASONS)
            self.router.inc_routing_decision(reason, name)
            self.router.observe_ttft_model(reason, rng.lognormvariate(0, 0.5) * load)  # the router's model, off by load
            self.router.observe_ttft(lane, ttft + 0.002, name)
            self.router.observe_ingress(0.001 * rng.random())
            self.router.observe_loop_lag(0.002 * rng.random())
            self.router.observe_e2e(lane, ttft + 0.002 + 0.5 * rng.random(), name)
            if rng.random() < 0.2:  # a fifth interactive (1 s objective), the rest batch (30 s)
                self.router.observe_class_ttft("interactive", ttft + 0.002, 1.0, lane)
            else:
                self.router.observe_class_ttft("batch", ttft + 0.002, 30.0, lane)
                if load > 1.0:  # past capacity some batch requests wait at the router for room
                    self.router.observe_hold("batch", 0.5 * load * rng.random(), "sent")
            self.router.inc_requests(lane, "ok", name)
            self.router.observe_cached_tokens(est, actual, prompt, name)
            rep.observe_queue_wait(lane, wait)
            rep.observe_ttft(lane, ttft)
            rep.observe_dispatch(0.001)
            rep.observe_prefill(lane, max(0.0, ttft - wait - 0.001))
            rep.inc_requests(lane, "ok")
            rep.observe_cached_tokens(est, actual, prompt)
            if lane == "fair" and rng.random() < 0.3:
                rep.inc_promotions()
            self.completed[lane] = self.completed.get(lane, 0) + 1
        if rng.random() < 0.1:
            j = rng.randrange(self.n_replicas)
            self.router.inc_reject("overloaded", self.replicas[j].component)
            self.router.inc_class_reject("batch", "hold_timeout")
            self.replicas[j].inc_reject("queue_full")
        for j, rep in enumerate(self.replicas):
            self.queued[j] = max(0, self.queued[j] + rng.randint(-3, 3))
            for lane in LANES:
                rep.set_queue_depth(lane, self.queued[j] if lane == "fast" else self.queued[j] // 3)
            q_s = 0.05 * self.queued[j] * load
            rep.set_queued_prefill(q_s)
            rep.set_queue_wait_estimate(3 * q_s)
            self.router.set_router_load(rep.component, self.queued[j], q_s * 1.1)
            rep.set_engine("", running=rng.randint(4, 32), waiting=rng.randint(0, 4), kv_usage=0.3 + 0.5 * rng.random())
        self.router.set_held("batch", max(0, round(20 * (load - 1.4))))

    @property
    def all_stats(self) -> list[FairwayStats]:
        return [self.router, *self.replicas]


def check_queries(client: Any, rate_window: str, at: float | None = None) -> dict[str, list[Query]]:
    """Run every dashboard query once; {"with_data": [...], "empty": [...], "empty_expected": [...]}."""
    out: dict[str, list[Query]] = {"with_data": [], "empty": [], "empty_expected": []}
    for q in QUERIES:
        res = client.query(promql(q.expr, rate_window), at)
        if res:
            out["with_data"].append(q)
        elif q.expect_data:
            out["empty"].append(q)
        else:
            out["empty_expected"].append(q)
    return out


class Demo:
    """Exporters + feeder thread for a ``SyntheticCluster``; a context manager."""

    def __init__(self, cluster: SyntheticCluster, rate_per_s: float = 20.0, tick_s: float = 0.2) -> None:
        self.cluster = cluster
        self.rate = rate_per_s
        self.tick_s = tick_s
        self.store = MemoryStore()
        self.exporters = [
            MetricsExporter(s, s.component, bind_host="127.0.0.1", store=self.store, ttl_s=3600, refresh_s=600)
            for s in cluster.all_stats
        ]
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._feed, name="fairway-demo-feed", daemon=True)
        self.t0 = 0.0

    @property
    def targets_url(self) -> str:
        return f"http://{self.exporters[0].address}/metrics/targets"

    def __enter__(self) -> Demo:
        for e in self.exporters:
            e.start()
        self.t0 = time.monotonic()
        self._thread.start()
        return self

    def _feed(self) -> None:
        acc = 0.0
        while not self._stop.wait(self.tick_s):
            acc += self.rate * self.tick_s
            n, acc = int(acc), acc - int(acc)
            phase = ((time.monotonic() - self.t0) / 60.0) % 1.0
            with self._lock:
                self.cluster.step(n, phase)

    def pause(self) -> None:
        self._stop.set()
        self._thread.join()

    def __exit__(self, *exc: object) -> None:
        self.pause()
        for e in self.exporters:
            e.stop()


def run_demo(duration_s: float, out_dir: Path | None, scrape: str = "1s", seed: int = 0) -> dict[str, Any]:
    """Feed, scrape, check queries and (with ``out_dir``) render; returns a report."""
    from dashboards.render import render_all

    if not find_prometheus():
        raise FileNotFoundError("no prometheus binary: run scripts/monitoring.sh install")
    cluster = SyntheticCluster(seed=seed)
    with Demo(cluster) as demo:
        cfg = config_for(demo.targets_url, ray_sd_file="/nonexistent/ray_sd.json", scrape_interval=scrape)
        with PrometheusServer(cfg) as prom:
            prom.wait_for_targets(len(demo.exporters))
            start = time.time()
            time.sleep(duration_s)
            demo.pause()
            time.sleep(2 * float(scrape.rstrip("s")) + 0.5)  # a final scrape of the last counts
            end = time.time()
            checked = check_queries(prom.client, f"{max(10, int(duration_s))}s")
            router_counts = {
                s["metric"]["lane"]: float(s["value"][1])
                for s in prom.client.query('sum by (lane) (fairway_ttft_seconds_count{level="router"})')
            }
            report: dict[str, Any] = {
                "completed": dict(cluster.completed),
                "prom_router_ttft_counts": router_counts,
                "queries_with_data": len(checked["with_data"]),
                "queries_empty": [f"{q.panel}/{q.ref}" for q in checked["empty"]],
                "queries_empty_expected": [f"{q.panel}/{q.ref}" for q in checked["empty_expected"]],
            }
            if out_dir is not None:
                scrape_s = float(scrape.rstrip("s"))
                report["render"] = render_all(
                    prom.client, out_dir, start, end, scrape_s=scrape_s, note="synthetic demo data"
                )
    return report


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dashboards.demo", description=__doc__.splitlines()[0])
    ap.add_argument("--duration", type=float, default=60.0, help="seconds of synthetic traffic")
    ap.add_argument("--out", type=Path, default=Path("out/dashboards-demo"), help="PNG output directory")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    report = run_demo(args.duration, args.out, seed=args.seed)
    for k, v in report.items():
        print(f"{k}: {v}")
    ok = not report["queries_empty"] and report["completed"] == {
        k: int(v) for k, v in report["prom_router_ttft_counts"].items()
    }
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
