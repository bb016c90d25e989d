"""Every PromQL expression of the Fairway dashboards, in one list, with the panels they feed.

``dashboards/build.py`` turns ``PANELS`` + ``QUERIES`` into Grafana JSON, ``dashboards/render.py``
runs the same expressions against Prometheus for the PNGs, and the tests check that each
expression returns data (``expect_data``) on a live cluster. Expressions use Grafana's
``$__rate_interval``; ``promql()`` substitutes a concrete window outside Grafana.

Metric names: ``observability/exporter.py`` ``METRICS`` (conventions: docs/design.md, Metrics).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

RATE = "$__rate_interval"


@dataclass(frozen=True, slots=True)
class Panel:
    """One dashboard panel. ``main``: drawn in the PNG render too. ``kind``: "timeseries" |
    "stat". ``stack``: "" | "normal" | "percent". Layout: Grafana grid units (24 wide)."""

    dashboard: str  # "overview" | "replicas"
    key: str
    title: str
    kind: str
    unit: str
    row: str
    w: int = 12
    h: int = 8
    main: bool = True
    stack: str = ""
    description: str = ""


@dataclass(frozen=True, slots=True)
class Query:
    """One PromQL target of a panel.

    ``expect_data``: a cluster under steady load (sim engine, no overload) must return at least
    one series for it; False for metrics that only appear on events (rejects, promotions).
    ``metrics``: the fairway_* metric names it reads (checked against the exporter), and the
    HAProxy exporter's series it reads (checked against ``HAPROXY_SERIES``).
    """

    panel: str
    ref: str
    expr: str
    legend: str
    expect_data: bool = True

    @property
    def metrics(self) -> tuple[str, ...]:
        return tuple(sorted(set(re.findall(r"\b(?:fairway|haproxy)_[a-z0-9_]+", self.expr))))


def promql(expr: str, rate_interval: str = "30s") -> str:
    """``expr`` with Grafana's ``$__rate_interval`` replaced by a concrete range."""
    return expr.replace(RATE, rate_interval)


def _sel(metric: str, sel: str) -> str:
    return f"{metric}{{{sel}}}" if sel else metric


def _q(quantile: float, metric: str, by: str, sel: str) -> str:
    """The ``quantile`` of histogram ``metric`` per ``by`` over the rate window."""
    return f"histogram_quantile({quantile}, sum by ({by}, le) (rate({_sel(metric + '_bucket', sel)}[{RATE}])))"


def _ratio(num: str, den: str, by: str, sel: str = "") -> str:
    """rate(num) / rate(den), summed per ``by``."""
    return f"sum by ({by}) (rate({_sel(num, sel)}[{RATE}])) / sum by ({by}) (rate({_sel(den, sel)}[{RATE}]))"


DASHBOARDS: dict[str, dict[str, str]] = {
    "overview": {
        "uid": "fairway-overview",
        "title": "Fairway / Overview",
        "description": "Per-lane TTFT, lane split, queues, cache hits, routing and rejects of a Fairway cluster.",
    },
    "replicas": {
        "uid": "fairway-replicas",
        "title": "Fairway / Replicas",
        "description": "Per-replica load: queued prefill work, engine running/waiting, KV usage, hits and TTFT.",
    },
}

#: The series of HAProxy's own exporter (Ray's HTTP ingress; the Prometheus job ``haproxy``) that
#: the dashboards read: absent without HAProxy, so their queries expect no data.
HAPROXY_SERIES = ("haproxy_frontend_current_sessions", "haproxy_frontend_http_responses_total",
                  "haproxy_frontend_request_errors_total")

PANELS: tuple[Panel, ...] = (
    # -- overview ---------------------------------------------------------------------------
    Panel("overview", "req_rate", "Requests/s", "stat", "reqps", "Summary", w=6, h=4, main=False),
    Panel("overview", "ttft_p99_all", "TTFT p99 (router)", "stat", "s", "Summary", w=6, h=4, main=False),
    Panel("overview", "hit_all", "Prefix hit ratio (actual)", "stat", "percentunit", "Summary", w=6, h=4, main=False),
    Panel("overview", "reject_rate", "Rejects/s", "stat", "reqps", "Summary", w=6, h=4, main=False),
    Panel(
        "overview",
        "ttft_lane",
        "TTFT p50 / p90 / p99 per lane (router)",
        "timeseries",
        "s",
        "Latency",
        description="histogram_quantile over fairway_ttft_seconds{level=router}: from the moment the ingress has "
                    "the request's headers to its first token there (what the client waits for).",
    ),
    Panel(
        "overview",
        "ttft_lane_replica_level",
        "TTFT p90 per lane (replica gate)",
        "timeseries",
        "s",
        "Latency",
        description="The TTFT as measured at the replica: from the ingress sending the request (after "
                    "tokenization) to the first token at the replica.",
    ),
    Panel("overview", "queue_wait", "Queue wait p50 / p90 per lane", "timeseries", "s", "Latency"),
    Panel(
        "overview",
        "ttft_parts",
        "Where the time goes (p90)",
        "timeseries",
        "s",
        "Latency",
        description="p90 of each stage: ingress (headers -> sent to the replicas: body, tokenization), routing "
                    "hop (sent -> at the replica's gate), gate wait, prefill (admission -> first token), beside "
                    "the client's TTFT and end-to-end time as the ingress measures them, and how late the ingress's "
                    "event loop runs (a wait before any of these stamps).",
    ),
    Panel(
        "overview",
        "lane_split",
        "Lane split of traffic",
        "timeseries",
        "percentunit",
        "Traffic and lanes",
        stack="percent",
        description="Share of finished requests per lane (router level).",
    ),
    Panel("overview", "req_status", "Requests/s by lane and status", "timeseries", "reqps", "Traffic and lanes"),
    Panel("overview", "queue_depth", "Queue depth per replica and lane", "timeseries", "short", "Traffic and lanes"),
    Panel("overview", "promotions", "Lane promotions/s per replica", "timeseries", "ops", "Traffic and lanes"),
    Panel(
        "overview",
        "hit_ratio",
        "Prefix hit ratio: estimated vs actual",
        "timeseries",
        "percentunit",
        "Cache",
        description="Cached prompt tokens / prompt tokens: the estimate (router index or gate) vs what the engine hit.",
    ),
    Panel(
        "overview",
        "estimate_error",
        "Cache estimate error p50 / p90 (|est - actual| / prompt)",
        "timeseries",
        "percentunit",
        "Cache",
    ),
    Panel(
        "overview",
        "routing",
        "Routing decisions/s by reason",
        "timeseries",
        "ops",
        "Routing and rejects",
        stack="normal",
    ),
    Panel("overview", "router_model", "Router's TTFT model: first token / expected, p50 and p90 by reason",
          "timeseries", "short", "Routing and rejects",
          description="Per request, its time to first token at the replica over the time the router expected there "
                      "when it chose it (fairway_router_ttft_model_ratio; 1: exact). Far above 1: waits the "
                      "router's model does not see, e.g. for sequence slots in a burst (docs/observability.md)."),
    Panel("overview", "router_state", "Router ledgers: requests counted per replica, expired bookings and failed "
          "view syncs", "timeseries", "short", "Routing and rejects", main=False,
          description="What the request routers count on each replica (fairway_router_outstanding_requests, "
                      "summed over routers; 0 on an idle cluster), bookings a replica's report showed ended "
                      "unheard (fairway_router_bookings_expired_total, per minute; 0 normally, a lost completion "
                      "otherwise) and failed exchanges with the shared routing view (docs/reliability.md)."),
    Panel("overview", "rejects", "Rejects/s by reason", "timeseries", "reqps", "Routing and rejects", stack="normal"),
    Panel("overview", "front_door", "HTTP ingress (HAProxy): open connections and its own refusals/s", "timeseries",
          "short", "Routing and rejects",
          description="From HAProxy's exporter (job haproxy): client connections (its limit: 4,096, "
                      "RAY_SERVE_HAPROXY_MAXCONN), and the "
                      "answers HAProxy gives itself, which reach no fairway_* metric: request errors such as the "
                      "408 for a header that took over 10 s, and 4xx / 5xx answers by code (docs/reliability.md)."),
    Panel("overview", "class_ttft", "TTFT p50 / p99 per request class (router)", "timeseries", "s",
          "Request classes", description="With classes configured (docs/design.md, Flow control)."),
    Panel("overview", "class_attainment", "TTFT objective attainment per request class", "timeseries",
          "percentunit", "Request classes",
          description="The share of first tokens within the class's objective_s (goodput)."),
    Panel("overview", "held", "Requests held at the router per class, and their hold p90", "timeseries", "short",
          "Request classes", description="Requests every replica's queue refused for now, waiting at the ingress "
          "for room (router/hold.py); the hold time of those sent."),
    Panel("overview", "class_rejects", "Refusals/s per request class and reason", "timeseries", "reqps",
          "Request classes", stack="normal"),
    # -- replicas ---------------------------------------------------------------------------
    Panel(
        "replicas",
        "queued_prefill",
        "Queued prefill work and estimated wait per replica",
        "timeseries",
        "s",
        "Load",
        description="Q_j: estimated prefill seconds routed to / waiting at each replica (router view and gate); "
        "wait: the gate's estimate in wall seconds (its bound max_queue_wait_s refuses new requests beyond it).",
    ),
    Panel("replicas", "engine_running", "Engine running per replica", "timeseries", "short", "Load"),
    Panel("replicas", "engine_waiting", "Waiting per replica (not yet in the engine)", "timeseries", "short", "Load"),
    Panel("replicas", "kv_usage", "KV cache usage per replica", "timeseries", "percentunit", "Load"),
    Panel("replicas", "replica_rps", "Requests/s per replica", "timeseries", "reqps", "Traffic", stack="normal"),
    Panel("replicas", "replica_routing", "Routing decisions/s per replica", "timeseries", "ops", "Traffic"),
    Panel("replicas", "replica_hit", "Actual prefix hit ratio per replica", "timeseries", "percentunit", "Traffic"),
    Panel("replicas", "replica_ttft", "TTFT p90 per replica (replica gate)", "timeseries", "s", "Traffic"),
    Panel("replicas", "preemptions", "Engine preemptions/s per replica", "timeseries", "ops", "Engine", main=False),
    Panel("replicas", "replica_rejects", "Rejects/s per replica", "timeseries", "reqps", "Engine", main=False),
)

QUERIES: tuple[Query, ...] = (
    # -- overview: summary stats ------------------------------------------------------------
    Query("req_rate", "A", f'sum(rate(fairway_requests_total{{level="router"}}[{RATE}]))', "requests/s"),
    Query("ttft_p99_all", "A", _q(0.99, "fairway_ttft_seconds", "level", 'level="router"'), "p99"),
    Query(
        "hit_all",
        "A",
        f"max({_ratio('fairway_actual_cached_tokens_total', 'fairway_prompt_tokens_total', 'level')})",
        "hit ratio",
    ),
    Query("reject_rate", "A", f"sum(rate(fairway_rejects_total[{RATE}])) or vector(0)", "rejects/s"),
    # -- latency ----------------------------------------------------------------------------
    Query("ttft_lane", "A", _q(0.5, "fairway_ttft_seconds", "lane", 'level="router"'), "{{lane}} p50"),
    Query("ttft_lane", "B", _q(0.9, "fairway_ttft_seconds", "lane", 'level="router"'), "{{lane}} p90"),
    Query("ttft_lane", "C", _q(0.99, "fairway_ttft_seconds", "lane", 'level="router"'), "{{lane}} p99"),
    Query("ttft_lane_replica_level", "A", _q(0.9, "fairway_ttft_seconds", "lane", 'level="replica"'), "{{lane}} p90"),
    Query("queue_wait", "A", _q(0.5, "fairway_queue_wait_seconds", "lane", 'level="replica"'), "{{lane}} p50"),
    Query("queue_wait", "B", _q(0.9, "fairway_queue_wait_seconds", "lane", 'level="replica"'), "{{lane}} p90"),
    Query("ttft_parts", "A", _q(0.9, "fairway_ingress_seconds", "level", 'level="router"'), "ingress"),
    Query("ttft_parts", "B", _q(0.9, "fairway_dispatch_seconds", "level", 'level="replica"'), "routing hop"),
    Query("ttft_parts", "C", _q(0.9, "fairway_queue_wait_seconds", "level", 'level="replica"'), "gate wait"),
    Query("ttft_parts", "D", _q(0.9, "fairway_prefill_seconds", "level", 'level="replica"'), "prefill"),
    Query("ttft_parts", "E", _q(0.9, "fairway_ttft_seconds", "level", 'level="router"'), "TTFT (client)"),
    Query("ttft_parts", "F", _q(0.9, "fairway_e2e_seconds", "level", 'level="router"'), "end to end"),
    Query("ttft_parts", "G", _q(0.9, "fairway_ingress_loop_lag_seconds", "level", 'level="router"'),
          "ingress loop lag"),
    # -- request classes --------------------------------------------------------------------
    # (data only with classes configured, which deploy/cluster.yaml does not: the demo pipeline has them)
    Query("class_ttft", "A", _q(0.5, "fairway_class_ttft_seconds", "class", 'level="router"'), "{{class}} p50",
          expect_data=False),
    Query("class_ttft", "B", _q(0.99, "fairway_class_ttft_seconds", "class", 'level="router"'), "{{class}} p99",
          expect_data=False),
    Query("class_attainment", "A",
          f'sum by (class) (rate(fairway_class_objective_total{{level="router",objective="met"}}[{RATE}])) / '
          f'sum by (class) (rate(fairway_class_objective_total{{level="router"}}[{RATE}]))', "{{class}}",
          expect_data=False),
    Query("held", "A", 'sum by (class) (fairway_router_held_requests{level="router"})', "{{class}} held",
          expect_data=False),
    Query("held", "B", _q(0.9, "fairway_router_hold_seconds", "class", 'level="router",status="sent"'),
          "{{class}} hold p90 (s)", expect_data=False),
    Query("class_rejects", "A", f'sum by (class, reason) (rate(fairway_class_rejects_total{{level="router"}}[{RATE}]))',
          "{{class}} {{reason}}", expect_data=False),
    # -- traffic and lanes ------------------------------------------------------------------
    Query(
        "lane_split",
        "A",
        f'sum by (lane) (rate(fairway_requests_total{{level="router",status="ok"}}[{RATE}]))',
        "{{lane}}",
    ),
    Query(
        "req_status",
        "A",
        f'sum by (lane, status) (rate(fairway_requests_total{{level="router"}}[{RATE}]))',
        "{{lane}} {{status}}",
    ),
    Query("queue_depth", "A", 'sum by (replica, lane) (fairway_queue_depth{level="replica"})', "{{replica}} {{lane}}"),
    Query(
        "promotions",
        "A",
        f"sum by (replica) (rate(fairway_lane_promotions_total[{RATE}]))",
        "{{replica}}",
        expect_data=False,
    ),
    # -- cache ------------------------------------------------------------------------------
    Query(
        "hit_ratio",
        "A",
        _ratio("fairway_estimated_cached_tokens_total", "fairway_prompt_tokens_total", "level"),
        "{{level}} estimated",
    ),
    Query(
        "hit_ratio",
        "B",
        _ratio("fairway_actual_cached_tokens_total", "fairway_prompt_tokens_total", "level"),
        "{{level}} actual",
    ),
    Query("estimate_error", "A", _q(0.5, "fairway_cache_estimate_error_ratio", "level", ""), "{{level}} p50"),
    Query("estimate_error", "B", _q(0.9, "fairway_cache_estimate_error_ratio", "level", ""), "{{level}} p90"),
    # -- routing and rejects ----------------------------------------------------------------
    Query("routing", "A", f"sum by (reason) (rate(fairway_routing_decisions_total[{RATE}]))", "{{reason}}"),
    Query("router_model", "A", _q(0.5, "fairway_router_ttft_model_ratio", "reason", ""), "{{reason}} p50"),
    Query("router_model", "B", _q(0.9, "fairway_router_ttft_model_ratio", "reason", ""), "{{reason}} p90"),
    Query("router_state", "A", 'sum by (replica) (fairway_router_outstanding_requests{level="router"})',
          "{{replica}} counted"),
    Query("router_state", "B", "sum by (replica) (increase(fairway_router_bookings_expired_total[1m]))",
          "{{replica}} expired/min", expect_data=False),
    Query("router_state", "C", f'sum(rate(fairway_router_view_syncs_total{{status="failed"}}[{RATE}]))',
          "view syncs failed/s", expect_data=False),
    Query(
        "rejects",
        "A",
        f"sum by (level, reason) (rate(fairway_rejects_total[{RATE}]))",
        "{{level}} {{reason}}",
        expect_data=False,
    ),
    Query("front_door", "A", 'sum(haproxy_frontend_current_sessions{proxy="http_frontend"})', "open connections",
          expect_data=False),
    Query("front_door", "B", f'sum(rate(haproxy_frontend_request_errors_total{{proxy="http_frontend"}}[{RATE}]))',
          "request errors/s (e.g. 408)", expect_data=False),
    Query("front_door", "C", 'sum by (code) (rate(haproxy_frontend_http_responses_total{proxy="http_frontend",'
          f'code=~"4xx|5xx"}}[{RATE}]))', "{{code}}/s", expect_data=False),
    # -- replicas ---------------------------------------------------------------------------
    Query("queued_prefill", "A", "max by (level, replica) (fairway_queued_prefill_seconds)", "{{replica}} ({{level}})"),
    Query("queued_prefill", "B", "max by (replica) (fairway_queue_wait_estimate_seconds)", "{{replica}} (wait)"),
    Query("engine_running", "A", "max by (replica) (fairway_engine_running)", "{{replica}}"),
    Query("engine_waiting", "A", "max by (replica) (fairway_engine_waiting)", "{{replica}}"),
    Query("kv_usage", "A", "max by (replica) (fairway_engine_kv_usage_ratio)", "{{replica}}"),
    Query(
        "replica_rps",
        "A",
        f'sum by (replica, lane) (rate(fairway_requests_total{{level="replica"}}[{RATE}]))',
        "{{replica}} {{lane}}",
    ),
    Query(
        "replica_routing",
        "A",
        f"sum by (replica, reason) (rate(fairway_routing_decisions_total[{RATE}]))",
        "{{replica}} {{reason}}",
    ),
    Query(
        "replica_hit",
        "A",
        _ratio("fairway_actual_cached_tokens_total", "fairway_prompt_tokens_total", "replica"),
        "{{replica}}",
    ),
    Query("replica_ttft", "A", _q(0.9, "fairway_ttft_seconds", "replica", 'level="replica"'), "{{replica}}"),
    Query("preemptions", "A", f"sum by (replica) (rate(fairway_engine_preemptions_total[{RATE}]))", "{{replica}}"),
    Query(
        "replica_rejects",
        "A",
        f'sum by (replica, reason) (rate(fairway_rejects_total{{level="replica"}}[{RATE}]))',
        "{{replica}} {{reason}}",
        expect_data=False,
    ),
)


def panel_queries(panel_key: str) -> list[Query]:
    """The queries of one panel, in ref order."""
    return sorted((q for q in QUERIES if q.panel == panel_key), key=lambda q: q.ref)


def dashboard_panels(dashboard: str) -> list[Panel]:
    return [p for p in PANELS if p.dashboard == dashboard]
