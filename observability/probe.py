"""Read a live cluster's replica gauges over HTTP (tests and benchmarks).

``replica_names(url)`` lists the live replicas; ``replica_gauges(url)`` scrapes every replica's
metrics endpoint listed at the ingress's ``/metrics/targets`` and sums, over replicas, the gauges
that say whether anything is left in a replica: requests in its engine, requests waiting at its
gate, and KV blocks in use; ``wait_idle`` waits until nothing is. ``router_outstanding(url)``
sums, over the request routers, the requests each still counts on a replica.
``histograms(url, level, names)`` sums histograms' buckets over the processes of a level, one scrape each;
``total(url, level, name)`` one counter or gauge; ``per_replica(url, name)`` one replica by one.
"""

from __future__ import annotations

import json
import time
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

GAUGES = ("fairway_engine_running", "fairway_engine_waiting", "fairway_engine_kv_usage_ratio")


def _get(url: str, headers: dict[str, str] | None = None) -> str:
    req = urllib.request.Request(url, headers=headers or {})
    with urllib.request.urlopen(req, timeout=10) as r:
        return r.read().decode()


def _targets(url: str, level: str) -> list[dict]:
    """The entries of ``{url}/metrics/targets`` (Prometheus http_sd JSON) of one ``level``."""
    return [e for e in json.loads(_get(f"{url}/metrics/targets")) if e["labels"].get("level") == level]


def _sum_gauges(url: str, level: str, names: tuple[str, ...]) -> tuple[int, dict[str, float]]:
    """How many ``level`` processes are listed at ``{url}/metrics/targets``, and the samples of
    ``names`` summed over them (and over their labels): one scrape of each."""
    targets = [t for e in _targets(url, level) for t in e["targets"]]
    out = dict.fromkeys(names, 0.0)
    for t in targets:
        for name, v in _scrape(t, names).items():
            out[name] += v
    return len(targets), out


def _scrape(target: str, names: tuple[str, ...]) -> dict[str, float]:
    """The samples of ``names`` in one process's metrics (``host:port``), each summed over its labels."""
    out = dict.fromkeys(names, 0.0)
    for fam in text_string_to_metric_families(_get(f"http://{target}/metrics")):
        for s in fam.samples:
            if s.name in out:
                out[s.name] += s.value
    return out


def total(url: str, level: str, name: str) -> float:
    """The samples of ``name`` (a counter's ``..._total``, or a gauge) summed over the ``level``
    processes listed at ``{url}/metrics/targets`` and over their labels."""
    return _sum_gauges(url, level, (name,))[1][name]


def per_replica(url: str, name: str) -> dict[str, float]:
    """``name``'s samples on each replica listed at ``{url}/metrics/targets`` (by its
    ``component``), summed over its other labels: one scrape of each."""
    return {e["labels"]["component"]: sum(_scrape(t, (name,))[name] for t in e["targets"])
            for e in _targets(url, "replica")}


def replica_names(url: str) -> list[str]:
    """The live replicas' names (their Serve replica ids: the ``component`` label), sorted."""
    return sorted(e["labels"]["component"] for e in _targets(url, "replica"))


def replica_gauges(url: str) -> dict[str, float]:
    """``GAUGES`` summed over the replicas listed at ``{url}/metrics/targets``, plus ``replicas``:
    how many were scraped."""
    n, out = _sum_gauges(url, "replica", GAUGES)
    out["replicas"] = float(n)
    return out


def router_outstanding(url: str) -> tuple[int, float]:
    """How many request routers are listed at ``{url}/metrics/targets``, and the requests they
    count on replicas (``fairway_router_outstanding_requests``, summed over routers and replicas):
    booked or sent, not yet completed. 0 once the cluster is idle, unless bookings leak."""
    name = "fairway_router_outstanding_requests"
    n, out = _sum_gauges(url, "router", (name,))
    return n, out[name]


def idle(g: dict[str, float], replicas: int) -> bool:
    """All ``replicas`` scraped, nothing running or waiting, no KV block in use."""
    return g["replicas"] == replicas and g["fairway_engine_running"] == g["fairway_engine_waiting"] == 0 \
        and g["fairway_engine_kv_usage_ratio"] == 0


def wait_idle(url: str, replicas: int, timeout_s: float) -> float | None:
    """Seconds until ``idle`` holds for ``replicas`` replicas, or None if not within ``timeout_s``
    (polled every 0.2 s)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        try:
            if idle(replica_gauges(url), replicas):
                return round(time.monotonic() - t0, 1)
        except OSError:
            pass
        time.sleep(0.2)
    return None


__all__ = ["GAUGES", "idle", "replica_gauges", "replica_names", "router_outstanding", "wait_idle"]


def histograms(url: str, level: str, names: tuple[str, ...]) -> dict[str, tuple[dict[float, float], float, float]]:
    """Histograms ``names`` (e.g. ``fairway_ttft_seconds``), each summed over the ``level``
    processes listed at ``{url}/metrics/targets`` and over its labels: (cumulative count per upper
    bound, sum, count). One scrape of each process for all of them."""
    out: dict[str, tuple[dict[float, float], float, float]] = {n: ({}, 0.0, 0.0) for n in names}
    for t in [t for e in _targets(url, level) for t in e["targets"]]:
        for fam in text_string_to_metric_families(_get(f"http://{t}/metrics")):
            if fam.name not in out:
                continue
            buckets, total, count = out[fam.name]
            for s in fam.samples:
                if s.name == fam.name + "_bucket":
                    le = float(s.labels["le"])
                    buckets[le] = buckets.get(le, 0.0) + s.value
                elif s.name == fam.name + "_sum":
                    total += s.value
                elif s.name == fam.name + "_count":
                    count += s.value
            out[fam.name] = (buckets, total, count)
    return out


def histogram(url: str, level: str, name: str) -> tuple[dict[float, float], float, float]:
    """``histograms`` for one name."""
    return histograms(url, level, (name,))[name]
