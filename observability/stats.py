"""Fairway's stats collection: counters, gauges and histograms as plain data, no exporter.

Why: stats collection is kept apart from the Prometheus exporter (docs/design.md, Metrics), as
vLLM's ``SchedulerStats`` and ``PrometheusStatLogger`` are. The ingress/router and
every replica own one ``FairwayStats`` each (``level`` "router" or "replica") and record into it
on their hot paths; ``observability/exporter.py`` turns ``snapshot()`` into Prometheus metric families,
the simulator or a test reads the same snapshot directly.

Labels are low-cardinality by construction: ``lane`` (a handful of lane names), ``replica`` (the
replica names of one cluster), ``status`` / ``reason`` (small fixed sets); ``level`` and
``policy`` are constant per object and added by the exporter. When ``level`` is "replica" an
empty ``replica`` argument means the object's own ``component``.

Cost: every ``observe_*`` / ``inc_*`` / ``set_*`` is one dict lookup (a tuple key) plus, for
histograms, a binary search over ~20 bucket bounds: O(log B). A short ``threading.Lock`` guards
each update, so a scrape from the exporter's HTTP thread never sees a dict change size mid-copy;
in a single asyncio thread it is uncontended (tens of nanoseconds). ``snapshot()`` is O(series).
"""

from __future__ import annotations

import math
import threading
from bisect import bisect_left
from typing import Any

# 10 ms .. 300 s, roughly log-spaced (about x1.5-2 per step), then +Inf.
TTFT_BUCKETS_S: tuple[float, ...] = (
    0.01,
    0.02,
    0.05,
    0.1,
    0.2,
    0.35,
    0.5,
    0.75,
    1.0,
    1.5,
    2.0,
    3.0,
    5.0,
    7.5,
    10.0,
    15.0,
    20.0,
    30.0,
    60.0,
    120.0,
    300.0,
    math.inf,
)
# Queue waits are often ~0 (admitted at once): two finer buckets below TTFT's first.
QUEUE_WAIT_BUCKETS_S: tuple[float, ...] = (0.001, 0.005) + TTFT_BUCKETS_S
# |estimated - actual| cached tokens / prompt tokens, in [0, 1].
ERROR_RATIO_BUCKETS: tuple[float, ...] = (0.0, 0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, math.inf)
#: A measured time over the router's expected one: factors of two around 1 (exact), with 0.8 and
#: 1.25 for "about right"
MODEL_RATIO_BUCKETS: tuple[float, ...] = (0.125, 0.25, 0.5, 0.8, 1.0, 1.25, 2.0, 4.0, 8.0, 16.0, 32.0, math.inf)

LEVELS = ("router", "replica")
REQUEST_STATUSES = ("ok", "error", "rejected", "cancelled")


def _clamp0(seconds: float) -> float:
    """Negative durations (clock skew between nodes) count as 0; NaN stays NaN (and is refused)."""
    return 0.0 if seconds < 0 else seconds


class Histogram:
    """Fixed-bucket histogram (Prometheus semantics: a value v lands in the first bucket with
    ``v <= bound``). ``observe`` is O(log B)."""

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * len(bounds)  # per bucket, not cumulative
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1
        self.sum += value

    @property
    def count(self) -> int:
        return sum(self.counts)

    def cumulative(self) -> list[int]:
        """Counts of observations ``<= bound`` per bound (the last one equals ``count``)."""
        out, acc = [], 0
        for c in self.counts:
            acc += c
            out.append(acc)
        return out


_COUNTERS = (
    "requests",  # (lane, status, replica)
    "promotions",  # (replica,)
    "guard_yields",  # (replica,): Fairway's memory guard, Fair-lane picks that yielded to the Fast lane
    "lost_credits",  # (replica,): Fairway's lost_blocks, arrivals whose deadline counted lost context as cached
    "first_step_holds",  # (replica,): Fairway's first_step_hold, requests the gate held for others' first tokens
    "estimated_cached_tokens",  # (replica,)
    "actual_cached_tokens",  # (replica,)
    "prompt_tokens",  # (replica,)
    "routing_decisions",  # (reason, replica)
    "rejects",  # (reason, replica)
    "engine_preemptions",  # (replica,), set from the engine's own running total
    "view_syncs",  # (status,): the request router's exchanges with the shared view
    "bookings_expired",  # (replica,): level router, bookings a replica's report showed ended unheard
    "retries",  # (reason,): level router, requests the ingress sent again after a replica refused them
    "stream_tokens",  # (path,): level router, output tokens passed on, by how they came: call | channel
    "class_objective",  # (class, objective): level router, first tokens within ("met") or past ("missed") it
    "class_rejects",  # (class, reason): level router, requests of a class answered with an error, and why
)
_GAUGES = (
    "queue_depth",  # (lane, replica)
    "queued_prefill",  # (replica,): the gate's queued work, or (level router) the router's estimate
    "router_outstanding",  # (replica,): requests a request router counts on each replica
    "queue_wait_estimate",  # (replica,)
    "drain_rate",  # (replica,): the gate's learned pace, cost-model prefill seconds per wall second
    "engine_running",  # (replica,)
    "engine_waiting",  # (replica,)
    "engine_kv_usage",  # (replica,)
    "view_degraded",  # (): 1 while the shared view is unreachable
    "prefix_view_exact",  # (): 1 while routing on the replicas' KV events (prefix_view: events)
    "held",  # (class,): level router, requests this ingress holds for room (router/hold.py)
)
_HISTOGRAMS = {
    "ttft": TTFT_BUCKETS_S,  # (lane, replica)
    "queue_wait": QUEUE_WAIT_BUCKETS_S,  # (lane, replica)
    "e2e": TTFT_BUCKETS_S,  # (lane, replica): level router, headers -> the answer's last token
    "ingress": QUEUE_WAIT_BUCKETS_S,  # (): level router, headers -> sent to the replicas
    "dispatch": QUEUE_WAIT_BUCKETS_S,  # (replica,): level replica, sent by the ingress -> at the gate
    "prefill": QUEUE_WAIT_BUCKETS_S,  # (lane, replica): level replica, engine admission -> first token
    "loop_lag": QUEUE_WAIT_BUCKETS_S,  # (): level router, how late the ingress's event loop runs a timer
    "cache_estimate_error": ERROR_RATIO_BUCKETS,  # (replica,)
    "class_ttft": TTFT_BUCKETS_S,  # (class, lane): level router, TTFT by request class and lane
    "hold": QUEUE_WAIT_BUCKETS_S,  # (class, status): level router, time held at the router, by how it left
    "ttft_model": MODEL_RATIO_BUCKETS,  # (reason,): level router, the first token's time over the router's expected
}
# The label names of each series key, in key order.
LABELS: dict[str, tuple[str, ...]] = {
    "requests": ("lane", "status", "replica"),
    "promotions": ("replica",),
    "guard_yields": ("replica",),
    "lost_credits": ("replica",),
    "first_step_holds": ("replica",),
    "estimated_cached_tokens": ("replica",),
    "actual_cached_tokens": ("replica",),
    "prompt_tokens": ("replica",),
    "routing_decisions": ("reason", "replica"),
    "rejects": ("reason", "replica"),
    "engine_preemptions": ("replica",),
    "queue_depth": ("lane", "replica"),
    "queued_prefill": ("replica",),
    "router_outstanding": ("replica",),
    "queue_wait_estimate": ("replica",),
    "drain_rate": ("replica",),
    "engine_running": ("replica",),
    "engine_waiting": ("replica",),
    "engine_kv_usage": ("replica",),
    "view_syncs": ("status",),
    "bookings_expired": ("replica",),
    "retries": ("reason",),
    "stream_tokens": ("path",),
    "class_objective": ("class", "objective"),
    "class_rejects": ("class", "reason"),
    "held": ("class",),
    "hold": ("class", "status"),
    "view_degraded": (),
    "prefix_view_exact": (),
    "ttft": ("lane", "replica"),
    "queue_wait": ("lane", "replica"),
    "e2e": ("lane", "replica"),
    "ingress": (),
    "dispatch": ("replica",),
    "prefill": ("lane", "replica"),
    "loop_lag": (),
    "cache_estimate_error": ("replica",),
    "class_ttft": ("class", "lane"),
    "ttft_model": ("reason",),
}
COUNTERS = _COUNTERS
GAUGES = _GAUGES
HISTOGRAMS: dict[str, tuple[float, ...]] = dict(_HISTOGRAMS)


class FairwayStats:
    """Counters, gauges and histograms of one process (the ingress, or one replica).

    ``level``: "router" (the ingress / request router: TTFT as the client sees it, routing
    decisions, rejects before a replica) or "replica" (the gate: queue wait, lanes, promotions,
    queue depth, engine figures). ``component``: the process's name (e.g. the replica name); it
    becomes the scrape target's label, not a metric label. ``policy``: the queue or router policy
    name, a constant label on every series.
    """

    def __init__(self, level: str, component: str, policy: str = "") -> None:
        if level not in LEVELS:
            raise ValueError(f"level must be one of {LEVELS}, got {level!r}")
        self.level = level
        self.component = component
        self.policy = policy
        self._lock = threading.Lock()
        self._counters: dict[str, dict[tuple[str, ...], float]] = {k: {} for k in _COUNTERS}
        self._gauges: dict[str, dict[tuple[str, ...], float]] = {k: {} for k in _GAUGES}
        self._hists: dict[str, dict[tuple[str, ...], Histogram]] = {k: {} for k in _HISTOGRAMS}

    # -- helpers -------------------------------------------------------------------------------

    def _replica(self, replica: str) -> str:
        if not replica and self.level == "replica":
            return self.component
        return replica

    def _inc(self, name: str, key: tuple[str, ...], n: float) -> None:
        if n < 0:
            raise ValueError(f"counter {name} cannot decrease (n={n})")
        with self._lock:
            d = self._counters[name]
            d[key] = d.get(key, 0) + n

    def _set(self, name: str, key: tuple[str, ...], value: float) -> None:
        with self._lock:
            self._gauges[name][key] = value

    def _observe(self, name: str, key: tuple[str, ...], value: float) -> None:
        if not math.isfinite(value):
            raise ValueError(f"{name}: cannot observe {value}")
        with self._lock:
            h = self._hists[name].get(key)
            if h is None:
                h = self._hists[name][key] = Histogram(_HISTOGRAMS[name])
            h.observe(value)

    # -- the recording API (hot path, O(1) / O(log B)) ----------------------------------------

    def observe_ttft(self, lane: str, seconds: float, replica: str = "") -> None:
        """Time to first token of one request: level router, from the moment the ingress had the
        request's headers to its first token there (what the client waits for); level replica,
        from the ingress sending it to the first token at the replica."""
        self._observe("ttft", (lane, self._replica(replica)), _clamp0(seconds))

    def observe_e2e(self, lane: str, seconds: float, replica: str = "") -> None:
        """Headers at the ingress -> the answer's last token there, of one finished request."""
        self._observe("e2e", (lane, self._replica(replica)), _clamp0(seconds))

    def observe_ingress(self, seconds: float) -> None:
        """Headers at the ingress -> the request sent to the replicas: body, validation,
        tokenization, hashing (and any wait for the ingress's event loop or tokenizer threads)."""
        self._observe("ingress", (), _clamp0(seconds))

    def observe_dispatch(self, seconds: float, replica: str = "") -> None:
        """The ingress sending a request -> the replica's gate having it: Ray's routing (the
        request router's decision, its wait for a replica slot) and the transfer."""
        self._observe("dispatch", (self._replica(replica),), _clamp0(seconds))

    def observe_loop_lag(self, seconds: float) -> None:
        """How late the ingress's event loop ran a periodic timer: the wait every request's
        handler had before it even started (requests wait there before ``ReceivedAt`` stamps them)."""
        self._observe("loop_lag", (), _clamp0(seconds))

    def observe_prefill(self, lane: str, seconds: float, replica: str = "") -> None:
        """Admission into the engine -> the first token: the prefill, and any wait inside the engine."""
        self._observe("prefill", (lane, self._replica(replica)), _clamp0(seconds))

    def observe_queue_wait(self, lane: str, seconds: float, replica: str = "") -> None:
        """Gate arrival -> admission into the engine of one request."""
        self._observe("queue_wait", (lane, self._replica(replica)), _clamp0(seconds))

    def inc_requests(self, lane: str, status: str, replica: str = "") -> None:
        """One finished request: status "ok" | "error" | "rejected" | "cancelled" (its client
        went away first)."""
        if status not in REQUEST_STATUSES:
            raise ValueError(f"status must be one of {REQUEST_STATUSES}, got {status!r}")
        self._inc("requests", (lane, status, self._replica(replica)), 1)

    def inc_promotions(self, n: int = 1, replica: str = "") -> None:
        """Requests promoted from the fast lane to the fair lane (deadline reached)."""
        self._inc("promotions", (self._replica(replica),), n)

    def inc_guard_yields(self, n: int = 1, replica: str = "") -> None:
        """Fair-lane picks that Fairway's memory guard gave to the Fast lane's (they would have
        evicted more waiting context than they keep)."""
        self._inc("guard_yields", (self._replica(replica),), n)

    def inc_lost_credits(self, n: int = 1, replica: str = "") -> None:
        """Arrivals whose deadline Fairway's ``lost_blocks`` pulled in: it counted context this
        replica computed and lost before they arrived as cached."""
        self._inc("lost_credits", (self._replica(replica),), n)

    def inc_first_step_holds(self, n: int = 1, replica: str = "") -> None:
        """Requests the gate held out of the engine while the step in it ends others' prefills
        (Fairway's ``first_step_hold``)."""
        self._inc("first_step_holds", (self._replica(replica),), n)

    def set_queue_depth(self, lane: str, n: int, replica: str = "") -> None:
        """Requests waiting in ``lane`` now."""
        self._set("queue_depth", (lane, self._replica(replica)), n)

    def set_queued_prefill(self, seconds: float, replica: str = "") -> None:
        """Estimated prefill seconds of the work routed to / waiting at a replica (Q_j)."""
        self._set("queued_prefill", (self._replica(replica),), max(0.0, seconds))

    def set_drain_rate(self, rate: float, replica: str = "") -> None:
        """The gate's learned pace (``replicas/drain.py``): cost-model prefill seconds its engine
        works off per wall second; the request routers divide their expected TTFT there by it."""
        self._set("drain_rate", (self._replica(replica),), max(0.0, rate))

    def set_queue_wait_estimate(self, seconds: float, replica: str = "") -> None:
        """The gate's estimated wait of its queue (wall seconds; the bound ``max_queue_wait_s`` reads it)."""
        self._set("queue_wait_estimate", (self._replica(replica),), max(0.0, seconds))

    def observe_cached_tokens(self, estimated: int, actual: int, prompt_tokens: int, replica: str = "") -> None:
        """One finished request's estimated (router's index / gate) vs actual (engine) cached
        prompt tokens; the estimate error |est - actual| / prompt goes into a histogram."""
        key = (self._replica(replica),)
        self._inc("estimated_cached_tokens", key, max(0, estimated))
        self._inc("actual_cached_tokens", key, max(0, actual))
        self._inc("prompt_tokens", key, max(0, prompt_tokens))
        if prompt_tokens > 0:
            err = min(1.0, abs(estimated - actual) / prompt_tokens)
            self._observe("cache_estimate_error", key, err)

    def set_router_load(self, replica: str, outstanding: int, queued_prefill_s: float) -> None:
        """What a request router counts on ``replica``: requests booked or sent and not yet
        completed, and the estimated prefill seconds of those not yet started."""
        with self._lock:
            self._gauges["router_outstanding"][(replica,)] = outstanding
            self._gauges["queued_prefill"][(replica,)] = _clamp0(queued_prefill_s)

    def observe_ttft_model(self, reason: str, ratio: float) -> None:
        """How far the router's model was off for one request: its first token's time at the
        replica (from the ingress sending it) over the time the router expected when it chose that
        replica (``Ranking.expected_s``), under the decision's ``reason``."""
        self._observe("ttft_model", (reason or "choice",), _clamp0(ratio))

    def inc_routing_decision(self, reason: str, replica: str = "") -> None:
        """One routing decision and why: "affinity" | "fair" | "fallback" | "least-load" ..."""
        self._inc("routing_decisions", (reason, self._replica(replica)), 1)

    def observe_class_ttft(self, priority_class: str, seconds: float, objective_s: float, lane: str = "") -> None:
        """The router-level TTFT of one request of ``priority_class`` (served from ``lane`` of its
        class's queue), and whether it met the class's TTFT objective (``objective_s``): goodput
        is the share that did."""
        seconds = _clamp0(seconds)
        self._observe("class_ttft", (priority_class, lane), seconds)
        self._inc("class_objective", (priority_class, "met" if seconds <= objective_s else "missed"), 1)

    def inc_class_reject(self, priority_class: str, reason: str) -> None:
        """A request of ``priority_class`` answered with an error for ``reason`` (``inc_reject``'s
        reasons, and the held queue's "hold_bound" | "hold_timeout" | "held_full")."""
        self._inc("class_rejects", (priority_class, reason), 1)

    def set_held(self, priority_class: str, n: int) -> None:
        """Requests of ``priority_class`` this ingress holds until a replica has room."""
        self._set("held", (priority_class,), n)

    def observe_hold(self, priority_class: str, seconds: float, outcome: str) -> None:
        """How long a request of ``priority_class`` was held at the router, by how it left:
        "sent" (a gate took it) | "timeout" | "gone" (its client left) | "failed"."""
        self._observe("hold", (priority_class, outcome), _clamp0(seconds))

    def inc_retry(self, reason: str) -> None:
        """The ingress sent a request again, once, after a replica refused it for ``reason``
        (``queue_full``: its gate was full, its engine never saw the request)."""
        self._inc("retries", (reason,), 1)

    def inc_stream_tokens(self, by_call: int, by_channel: int) -> None:
        """One answer's output tokens as the ingress passed them on: those that came on the
        request's own call and those that came on its replica's stream channel."""
        self._inc("stream_tokens", ("call",), by_call)
        self._inc("stream_tokens", ("channel",), by_channel)

    def inc_view_sync(self, status: str) -> None:
        """One exchange of the request router with the shared view: "ok" | "failed"."""
        self._inc("view_syncs", (status,), 1)

    def inc_bookings_expired(self, n: int, replica: str = "") -> None:
        """Bookings a request router dropped because ``replica``'s report showed them ended without
        the router hearing it (``Bookings.apply_stats``): 0 unless a completion was lost."""
        self._inc("bookings_expired", (self._replica(replica),), n)

    def set_view_degraded(self, degraded: bool) -> None:
        """Whether the request router routes on its own view because the shared one is unreachable."""
        self._set("view_degraded", (), 1.0 if degraded else 0.0)

    def set_prefix_view_exact(self, exact: bool) -> None:
        """Whether the request router routes on the exact prefix view (the replicas' KV events are
        current) rather than its approximate index."""
        self._set("prefix_view_exact", (), 1.0 if exact else 0.0)

    def inc_reject(self, reason: str, replica: str = "") -> None:
        """One rejected request: "queue_full" | "too_long" | "bad_request" | "invalid_json" |
        "unknown_field" | "unsupported_parameter" | "unknown_model" | "body_too_large" | "body_too_complex" |
        "bodies_in_flight" | "body_timeout" | "headers_too_large" | "unauthorized" | "forbidden" | "replica_dead" |
        "overloaded" | "stalled" | "engine_failed" | "timeout" | "internal" | "hold_bound" |
        "hold_timeout" | "held_full" | "past_bound"."""
        self._inc("rejects", (reason, self._replica(replica)), 1)

    def set_engine(self, replica: str, running: int, waiting: int, kv_usage: float, preemptions_total: int = 0) -> None:
        """The engine's figures (sim engine, or vLLM's own metrics): requests running in it,
        requests at the replica not yet in it (``waiting``), KV usage in [0, 1], and its running
        total of preemptions."""
        r = self._replica(replica)
        with self._lock:
            self._gauges["engine_running"][(r,)] = running
            self._gauges["engine_waiting"][(r,)] = waiting
            self._gauges["engine_kv_usage"][(r,)] = min(1.0, max(0.0, kv_usage))
            prev = self._counters["engine_preemptions"].get((r,), 0)
            # a counter never goes down: an engine restart (total back to 0) keeps the old value
            self._counters["engine_preemptions"][(r,)] = max(prev, preemptions_total)

    # -- reading -------------------------------------------------------------------------------

    def snapshot(self) -> dict[str, Any]:
        """Plain data, O(series). Shape::

            {"level": str, "component": str, "policy": str,
             "counters":   {name: [{"labels": {label: value}, "value": float}, ...]},
             "gauges":     {name: [{"labels": {...}, "value": float}, ...]},
             "histograms": {name: [{"labels": {...}, "bounds": (...), "buckets": [cumulative],
                                    "count": int, "sum": float}, ...]}}

        Names are the keys of ``LABELS``; series are sorted by label values (deterministic).
        Invariant: a histogram's ``buckets[-1] == count`` (the last bound is +Inf).
        """
        with self._lock:
            counters = {k: sorted(d.items()) for k, d in self._counters.items()}
            gauges = {k: sorted(d.items()) for k, d in self._gauges.items()}
            hists = {
                k: [(key, h.bounds, h.cumulative(), h.sum) for key, h in sorted(d.items())]
                for k, d in self._hists.items()
            }

        def lab(name: str, key: tuple[str, ...]) -> dict[str, str]:
            return dict(zip(LABELS[name], key, strict=True))

        return {
            "level": self.level,
            "component": self.component,
            "policy": self.policy,
            "counters": {k: [{"labels": lab(k, key), "value": v} for key, v in s] for k, s in counters.items()},
            "gauges": {k: [{"labels": lab(k, key), "value": v} for key, v in s] for k, s in gauges.items()},
            "histograms": {
                k: [
                    {"labels": lab(k, key), "bounds": b, "buckets": cum, "count": cum[-1], "sum": sm}
                    for key, b, cum, sm in s
                ]
                for k, s in hists.items()
            },
        }

    # -- conveniences for tests and logs ------------------------------------------------------

    def ttft_count(self, lane: str | None = None, replica: str | None = None) -> int:
        """TTFT observations, summed over the series matching ``lane`` / ``replica`` (None = any)."""
        return self._hist_count("ttft", lane, replica)

    def _hist_count(self, name: str, lane: str | None, replica: str | None) -> int:
        with self._lock:
            return sum(
                h.count
                for (ln, rp), h in self._hists[name].items()
                if (lane is None or ln == lane) and (replica is None or rp == replica)
            )

    def counter(self, name: str, **labels: str) -> float:
        """Sum of counter ``name`` over the series whose labels match ``labels``."""
        names = LABELS[name]
        with self._lock:
            return sum(
                v
                for key, v in self._counters[name].items()
                if all(key[names.index(k)] == val for k, val in labels.items())
            )

    def gauge(self, name: str, **labels: str) -> float | None:
        """Value of gauge ``name`` for exactly ``labels`` (None if never set)."""
        names = LABELS[name]
        key = tuple(labels.get(n, "") for n in names)
        with self._lock:
            return self._gauges[name].get(key)
