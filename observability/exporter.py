"""Prometheus exporter over ``FairwayStats`` objects, and the scrape path across a Ray cluster.

Why: stats collection (``observability/stats.py``) is kept apart from the exporter (docs/design.md, Metrics).
This module owns the Prometheus side only: metric names, types, help texts (``METRICS``), a
custom ``Collector`` that reads ``FairwayStats.snapshot()`` at scrape time, and the per-process
``/metrics`` endpoint with its service discovery.

Scrape path (the Ray way, one endpoint per process): every process that records Fairway stats
(each ingress replica, each Fairway replica actor) starts a ``MetricsExporter``. It serves
``/metrics`` on an ephemeral port bound on all interfaces and registers ``node_ip:port`` in a
``TargetStore`` every process of the cluster can read: Ray's internal KV (GCS), namespace
``fairway``, keys ``fairway/metrics/<component>@<ip:port>``. The entry carries an expiry time,
refreshed every ``refresh_s`` by a daemon thread, so a process that dies without cleanup drops
out after ``ttl_s``; a clean stop (or interpreter exit) deletes it at once. ``metrics_targets()``
lists the live entries as Prometheus ``http_sd`` JSON; the ingress serves it as
``GET /metrics/targets`` on the Serve HTTP port and ``deploy/prometheus/prometheus.yml`` polls it.
Ray's and Serve's built-in metrics are a second scrape job (Ray's own file_sd,
``/tmp/ray/prom_metrics_service_discovery.json``); see ``docs/observability.md``.

Cost: a scrape is O(series) (one ``snapshot()`` per stats object); nothing here runs on the
request path.
"""

from __future__ import annotations

import atexit
import json
import logging
import socket
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

from prometheus_client import REGISTRY, CollectorRegistry, make_wsgi_app
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from observability.stats import COUNTERS, GAUGES, HISTOGRAMS, LABELS, FairwayStats

log = logging.getLogger(__name__)

KV_NAMESPACE = "fairway"
KV_PREFIX = "fairway/metrics/"


@dataclass(frozen=True, slots=True)
class MetricSpec:
    """One exported metric: the ``FairwayStats`` series it reads and its Prometheus identity.

    Invariants: ``name`` starts with ``fairway_``; counters end in ``_total``; ``_seconds`` /
    ``_ratio`` name the unit; ``labels`` are ``level``, the stats key's labels, then ``policy``.
    """

    key: str  # FairwayStats series name (observability/stats.py LABELS key)
    kind: str  # "counter" | "gauge" | "histogram"
    name: str
    help: str

    @property
    def labels(self) -> tuple[str, ...]:
        return ("level", *LABELS[self.key], "policy")


METRICS: tuple[MetricSpec, ...] = (
    MetricSpec("ttft", "histogram", "fairway_ttft_seconds",
               "Time to first token. Level router: the ingress has the request's headers -> its first token at the "
               "ingress (what the client waits for). Level replica: the ingress sent it -> first token at the "
               "replica."),
    MetricSpec("e2e", "histogram", "fairway_e2e_seconds",
               "Level router: the ingress has the request's headers -> the answer's last token at the ingress."),
    MetricSpec("ingress", "histogram", "fairway_ingress_seconds",
               "Level router: the ingress has the request's headers -> it sends the request to the replicas "
               "(body, validation, tokenization, hashing)."),
    MetricSpec("dispatch", "histogram", "fairway_dispatch_seconds",
               "Level replica: the ingress sent the request -> the replica's gate has it (routing and transfer)."),
    MetricSpec("loop_lag", "histogram", "fairway_ingress_loop_lag_seconds",
               "Level router: how late the ingress's event loop ran a 100 ms timer (the wait before any request's "
               "handler starts, which no TTFT stamp sees)."),
    MetricSpec("queue_wait", "histogram", "fairway_queue_wait_seconds", "Replica gate arrival to engine admission."),
    MetricSpec("prefill", "histogram", "fairway_prefill_seconds",
               "Level replica: engine admission -> first token (the prefill and any wait inside the engine)."),
    MetricSpec("requests", "counter", "fairway_requests_total", "Finished requests by lane and status."),
    MetricSpec("promotions", "counter", "fairway_lane_promotions_total", "Requests promoted to the fair lane."),
    MetricSpec("guard_yields", "counter", "fairway_memory_guard_yields_total",
               "Fair-lane picks Fairway's memory guard gave to the fast lane."),
    MetricSpec("lost_credits", "counter", "fairway_lost_context_credits_total",
               "Arrivals whose deadline counted context the replica computed and lost as cached (lost_blocks)."),
    MetricSpec("first_step_holds", "counter", "fairway_first_step_holds_total",
               "Requests the gate kept out of the engine while its step ends others' prefills (first_step_hold)."),
    MetricSpec("queue_depth", "gauge", "fairway_queue_depth", "Requests waiting in the replica gate, per lane."),
    MetricSpec(
        "queued_prefill", "gauge", "fairway_queued_prefill_seconds",
        "Estimated prefill work queued per replica (level replica: at its gate; level router: as a request "
        "router counts it, routed and not yet started)."
    ),
    MetricSpec(
        "queue_wait_estimate",
        "gauge",
        "fairway_queue_wait_estimate_seconds",
        "Estimated wall seconds until a replica has started everything waiting at its gate.",
    ),
    MetricSpec(
        "drain_rate",
        "gauge",
        "fairway_replica_drain_rate",
        "A replica's learned pace: cost-model prefill seconds its engine works off per wall second while "
        "requests wait (1: the cost profile's pace); the routers divide their expected TTFT there by it.",
    ),
    MetricSpec(
        "estimated_cached_tokens",
        "counter",
        "fairway_estimated_cached_tokens_total",
        "Prompt tokens estimated to be cached at routing/admission time.",
    ),
    MetricSpec(
        "actual_cached_tokens",
        "counter",
        "fairway_actual_cached_tokens_total",
        "Prompt tokens the engine served from its prefix cache.",
    ),
    MetricSpec("prompt_tokens", "counter", "fairway_prompt_tokens_total", "Prompt tokens of finished requests."),
    MetricSpec(
        "cache_estimate_error",
        "histogram",
        "fairway_cache_estimate_error_ratio",
        "Per request |estimated - actual cached tokens| / prompt tokens.",
    ),
    MetricSpec(
        "routing_decisions", "counter", "fairway_routing_decisions_total", "Routing decisions by reason and replica."
    ),
    MetricSpec("ttft_model", "histogram", "fairway_router_ttft_model_ratio",
               "Level router: a request's time to first token at its replica (from the ingress sending it) over "
               "the time the router expected there when it chose it (1: exact; routers that predict one, e.g. "
               "fairway), by routing reason."),
    MetricSpec("rejects", "counter", "fairway_rejects_total", "Rejected requests by reason."),
    MetricSpec("class_ttft", "histogram", "fairway_class_ttft_seconds",
               "Level router: time to first token by request class and lane (as fairway_ttft_seconds)."),
    MetricSpec("class_objective", "counter", "fairway_class_objective_total",
               "Level router: first tokens by request class within (objective=met) or past (missed) the class's "
               "TTFT objective."),
    MetricSpec("class_rejects", "counter", "fairway_class_rejects_total",
               "Level router: requests answered with an error, by request class and reason."),
    MetricSpec("held", "gauge", "fairway_router_held_requests",
               "Level router: requests this ingress holds until a replica's queue has room, by class."),
    MetricSpec("hold", "histogram", "fairway_router_hold_seconds",
               "Level router: time a request was held at the router, by class and how it left (status: sent, timeout, "
               "gone, failed)."),
    MetricSpec("retries", "counter", "fairway_retries_total",
               "Requests the ingress sent once more, to another replica, after one refused them (by reason)."),
    MetricSpec("stream_tokens", "counter", "fairway_stream_tokens_total",
               "Level router: output tokens the ingress passed on, by how they reached it (path: call, the "
               "request's own call; channel, its replica's stream channel)."),
    MetricSpec("router_outstanding", "gauge", "fairway_router_outstanding_requests",
               "Requests a request router counts on each replica: booked or sent, not yet completed."),
    MetricSpec("view_syncs", "counter", "fairway_router_view_syncs_total",
               "Exchanges of a request router with the shared routing view, by status (ok, failed)."),
    MetricSpec("bookings_expired", "counter", "fairway_router_bookings_expired_total",
               "Requests a request router stopped counting on a replica because the replica's report, taken "
               "over 15 s after the routing, no longer held them: completions the router never heard. 0 "
               "normally."),
    MetricSpec("view_degraded", "gauge", "fairway_router_view_degraded",
               "1 while a request router routes on its own view because the shared view is unreachable."),
    MetricSpec("prefix_view_exact", "gauge", "fairway_router_prefix_view_exact",
               "1 while a request router routes on the replicas' KV events (router.prefix_view: events); "
               "0 while it falls back to its approximate prefix index."),
    MetricSpec("engine_running", "gauge", "fairway_engine_running", "Requests running in the engine."),
    MetricSpec("engine_waiting", "gauge", "fairway_engine_waiting", "Requests waiting inside the engine."),
    MetricSpec("engine_kv_usage", "gauge", "fairway_engine_kv_usage_ratio", "Engine KV cache usage (0-1)."),
    MetricSpec(
        "engine_preemptions", "counter", "fairway_engine_preemptions_total", "Engine preemptions (running total)."
    ),
)
assert {m.key for m in METRICS} == set(COUNTERS) | set(GAUGES) | set(HISTOGRAMS), "every stats series is exported"


StatsSource = FairwayStats | Iterable[FairwayStats] | Callable[[], Iterable[FairwayStats]]


def _stats_list(source: StatsSource) -> list[FairwayStats]:
    if isinstance(source, FairwayStats):
        return [source]
    if callable(source):
        return list(source())
    return list(source)


def _fmt_bound(b: float) -> str:
    return "+Inf" if b == float("inf") else repr(float(b))


class FairwayCollector(Collector):
    """A prometheus_client custom collector reading ``FairwayStats`` snapshots at scrape time.

    ``source``: one stats object, an iterable (a list is read live, so objects appended later are
    exported too) or a callable returning them. Series with identical labels from several objects
    are summed (counters, histograms) or last-wins (gauges). O(series) per scrape.
    """

    def __init__(self, source: StatsSource) -> None:
        self._source = source

    def collect(self) -> Iterator[Any]:
        snaps = [s.snapshot() for s in _stats_list(self._source)]
        for spec in METRICS:
            group = {"counter": "counters", "gauge": "gauges", "histogram": "histograms"}[spec.kind]
            merged: dict[tuple[str, ...], Any] = {}
            for snap in snaps:
                for series in snap[group][spec.key]:
                    lv = (snap["level"], *(series["labels"][n] for n in LABELS[spec.key]), snap["policy"])
                    if spec.kind == "gauge":
                        merged[lv] = series["value"]
                    elif spec.kind == "counter":
                        merged[lv] = merged.get(lv, 0) + series["value"]
                    else:
                        prev = merged.get(lv)
                        if prev is None:
                            merged[lv] = (series["bounds"], list(series["buckets"]), series["sum"])
                        else:
                            merged[lv] = (
                                prev[0],
                                [a + b for a, b in zip(prev[1], series["buckets"], strict=True)],
                                prev[2] + series["sum"],
                            )
            if spec.kind == "counter":
                fam: Any = CounterMetricFamily(spec.name, spec.help, labels=spec.labels)
                for lv, v in sorted(merged.items()):
                    fam.add_metric(lv, v)
            elif spec.kind == "gauge":
                fam = GaugeMetricFamily(spec.name, spec.help, labels=spec.labels)
                for lv, v in sorted(merged.items()):
                    fam.add_metric(lv, v)
            else:
                fam = HistogramMetricFamily(spec.name, spec.help, labels=spec.labels)
                for lv, (bounds, cum, total) in sorted(merged.items()):
                    fam.add_metric(lv, [(_fmt_bound(b), c) for b, c in zip(bounds, cum, strict=True)], total)
            yield fam


class _GlobalRegistryCollector(Collector):
    """Re-exports prometheus_client's process-global registry (vLLM's ``vllm:`` metrics when the
    engine is vLLM in-process, process_* figures) on the same endpoint."""

    def collect(self) -> Iterator[Any]:
        yield from REGISTRY.collect()


def make_registry(source: StatsSource, include_global_registry: bool = False) -> CollectorRegistry:
    """A fresh registry (never the global one) holding a ``FairwayCollector`` over ``source``."""
    reg = CollectorRegistry(auto_describe=False)
    reg.register(FairwayCollector(source))
    if include_global_registry:
        reg.register(_GlobalRegistryCollector())
    return reg


def render(source: StatsSource) -> str:
    """The Prometheus text exposition of ``source`` (tests, debugging)."""
    from prometheus_client import generate_latest

    return generate_latest(make_registry(source)).decode()


# -- service discovery -----------------------------------------------------------------------


class TargetStore(Protocol):
    """Where scrape targets are registered; every process of the cluster must see the same one."""

    def put(self, key: str, value: bytes) -> None: ...

    def delete(self, key: str) -> None: ...

    def items(self) -> list[tuple[str, bytes]]: ...


class MemoryStore:
    """A process-local store: single-process runs and tests without Ray."""

    def __init__(self) -> None:
        self._d: dict[str, bytes] = {}
        self._lock = threading.Lock()

    def put(self, key: str, value: bytes) -> None:
        with self._lock:
            self._d[key] = value

    def delete(self, key: str) -> None:
        with self._lock:
            self._d.pop(key, None)

    def items(self) -> list[tuple[str, bytes]]:
        with self._lock:
            return sorted(self._d.items())


class RayKVStore:
    """Ray's internal KV (in the GCS): visible from every driver, actor and Serve replica of the
    cluster. Keys live in namespace ``fairway`` under ``fairway/metrics/``."""

    def put(self, key: str, value: bytes) -> None:
        from ray.experimental import internal_kv

        internal_kv._internal_kv_put(KV_PREFIX + key, value, overwrite=True, namespace=KV_NAMESPACE)

    def delete(self, key: str) -> None:
        from ray.experimental import internal_kv

        internal_kv._internal_kv_del(KV_PREFIX + key, namespace=KV_NAMESPACE)

    def items(self) -> list[tuple[str, bytes]]:
        from ray.experimental import internal_kv

        out = []
        for k in internal_kv._internal_kv_list(KV_PREFIX, namespace=KV_NAMESPACE):
            v = internal_kv._internal_kv_get(k, namespace=KV_NAMESPACE)
            if v is not None:
                key = k.decode() if isinstance(k, bytes) else k
                out.append((key[len(KV_PREFIX) :], v))
        return sorted(out)


_MEMORY_STORE = MemoryStore()  # the fallback when Ray is not initialized in this process


def _ray_ready() -> bool:
    try:
        import ray
        from ray.experimental import internal_kv
    except ImportError:
        return False
    return ray.is_initialized() and internal_kv._internal_kv_initialized()


def default_store() -> TargetStore:
    """Ray's internal KV when this process is part of a Ray cluster, else a process-local store."""
    return RayKVStore() if _ray_ready() else _MEMORY_STORE


def node_ip() -> str:
    """The address other nodes reach this process at: Ray's node IP, else a local guess."""
    if _ray_ready():
        import ray.util

        return ray.util.get_node_ip_address()
    return "127.0.0.1"


def metrics_targets(store: TargetStore | None = None, now: float | None = None) -> list[dict[str, Any]]:
    """Live scrape targets as Prometheus http_sd JSON:
    ``[{"targets": ["ip:port"], "labels": {"component": ..., "level": ...}}]``.

    Entries past their expiry (a process that died without cleanup) are skipped and deleted.
    O(targets) store reads.
    """
    store = store or default_store()
    now = time.time() if now is None else now
    out = []
    for key, raw in store.items():
        try:
            entry = json.loads(raw)
        except ValueError:
            continue
        if entry.get("expires_at", 0) < now:
            try:
                store.delete(key)
            except Exception:  # noqa: BLE001 - best effort cleanup
                pass
            continue
        out.append({"targets": [entry["target"]], "labels": dict(entry.get("labels", {}))})
    return out


async def metrics_targets_async(store: TargetStore | None = None) -> list[dict[str, Any]]:
    """``metrics_targets`` off the event loop (its KV reads are blocking GCS calls): for async
    HTTP handlers such as the ingress's ``GET /metrics/targets``."""
    import asyncio

    return await asyncio.to_thread(metrics_targets, store)


# -- the per-process endpoint ----------------------------------------------------------------


class MetricsExporter:
    """``/metrics`` for one process plus its registration in the target store.

    ``start()`` binds ``bind_host:port`` (0 = ephemeral) and returns ``"advertise_ip:port"``;
    ``stop()`` deregisters and closes. The server also answers ``/metrics/targets`` with the
    cluster's http_sd JSON (handy without an ingress). Thread-based (prometheus_client's WSGI
    server), so it works inside Ray actors and Serve replicas whatever their event loop does.
    """

    def __init__(
        self,
        source: StatsSource,
        component: str,
        *,
        level: str | None = None,
        bind_host: str = "0.0.0.0",
        advertise_host: str | None = None,
        port: int = 0,
        store: TargetStore | None = None,
        ttl_s: float = 15.0,
        refresh_s: float = 5.0,
        include_global_registry: bool = False,
        extra_labels: dict[str, str] | None = None,
    ) -> None:
        if refresh_s <= 0 or ttl_s <= refresh_s:
            raise ValueError(f"need 0 < refresh_s < ttl_s, got refresh_s={refresh_s}, ttl_s={ttl_s}")
        self.source = source
        self.component = component
        self.level = level
        self.bind_host = bind_host
        self.advertise_host = advertise_host
        self.port = port
        self.store = store
        self.ttl_s = ttl_s
        self.refresh_s = refresh_s
        self.include_global_registry = include_global_registry
        self.extra_labels = dict(extra_labels or {})
        self.address = ""
        self._server: Any = None
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    @property
    def key(self) -> str:
        return f"{self.component}@{self.address}"

    def _level(self) -> str:
        if self.level:
            return self.level
        levels = sorted({s.level for s in _stats_list(self.source)})
        return levels[0] if len(levels) == 1 else "+".join(levels) or "unknown"

    def _entry(self) -> bytes:
        labels = {"component": self.component, "level": self._level(), **self.extra_labels}
        return json.dumps({"target": self.address, "labels": labels, "expires_at": time.time() + self.ttl_s}).encode()

    def start(self) -> str:
        from wsgiref.simple_server import WSGIRequestHandler, make_server

        from prometheus_client.exposition import ThreadingWSGIServer

        if self._server is not None:
            return self.address
        store = self.store = self.store or default_store()
        metrics_app = make_wsgi_app(make_registry(self.source, self.include_global_registry))

        def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
            if environ.get("PATH_INFO", "").rstrip("/") == "/metrics/targets":
                body = json.dumps(metrics_targets(store)).encode()
                start_response("200 OK", [("Content-Type", "application/json")])
                return [body]
            return metrics_app(environ, start_response)

        class _Quiet(WSGIRequestHandler):
            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
                pass

        self._server = make_server(self.bind_host, self.port, app, ThreadingWSGIServer, handler_class=_Quiet)
        port = self._server.server_port
        host = self.advertise_host or (self.bind_host if self.bind_host not in ("0.0.0.0", "") else node_ip())
        self.address = f"{host}:{port}"
        t = threading.Thread(target=self._server.serve_forever, name=f"fairway-metrics-{port}", daemon=True)
        t.start()
        self._threads.append(t)
        store.put(self.key, self._entry())
        r = threading.Thread(target=self._refresh_loop, name=f"fairway-metrics-sd-{port}", daemon=True)
        r.start()
        self._threads.append(r)
        atexit.register(self.stop)
        log.info("fairway metrics for %s at http://%s/metrics", self.component, self.address)
        return self.address

    def _refresh_loop(self) -> None:
        while not self._stop.wait(self.refresh_s):
            try:
                self.store.put(self.key, self._entry())  # type: ignore[union-attr]
            except Exception as e:  # noqa: BLE001 - keep serving; the entry just expires
                log.warning("fairway metrics: target refresh failed: %s", e)

    def stop(self) -> None:
        """Deregister and close the endpoint (idempotent)."""
        if self._server is None:
            return
        self._stop.set()
        try:
            self.store.delete(self.key)  # type: ignore[union-attr]
        except Exception:  # noqa: BLE001 - at interpreter exit Ray may be gone already
            pass
        self._server.shutdown()
        self._server.server_close()
        self._server = None
        for t in self._threads:
            t.join(timeout=2.0)
        self._threads.clear()
        try:
            atexit.unregister(self.stop)
        except Exception:  # noqa: BLE001
            pass


def free_port(host: str = "127.0.0.1") -> int:
    """A currently free TCP port (for tests that must fix a port before starting a server)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
