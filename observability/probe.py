"""Read a live cluster's replica gauges over HTTP (tests and benchmarks).

``replica_gauges(url)`` scrapes every replica's metrics endpoint listed at the ingress's
``/metrics/targets`` and sums, over replicas, the gauges that say whether anything is left in a
replica: requests in its engine, requests waiting at its gate, and KV blocks in use.
"""

from __future__ import annotations

import json
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

GAUGES = ("fairway_engine_running", "fairway_engine_waiting", "fairway_engine_kv_usage")


def _get(url: str, headers: dict[str, str] | None = None) -> str:
    req = urllib.request.Request(url, headers=headers or {})
    with urllib.request.urlopen(req, timeout=10) as r:
        return r.read().decode()


def replica_gauges(url: str) -> dict[str, float]:
    """``GAUGES`` summed over the replicas listed at ``{url}/metrics/targets``, plus ``replicas``:
    how many were scraped."""
    targets = [t for e in json.loads(_get(f"{url}/metrics/targets")) if e["labels"].get("level") == "replica"
               for t in e["targets"]]
    out = dict.fromkeys(GAUGES, 0.0)
    for t in targets:
        for fam in text_string_to_metric_families(_get(f"http://{t}/metrics")):
            for s in fam.samples:
                if s.name in out:
                    out[s.name] += s.value
    out["replicas"] = float(len(targets))
    return out


def idle(g: dict[str, float], replicas: int) -> bool:
    """All ``replicas`` scraped, nothing running or waiting, no KV block in use."""
    return g["replicas"] == replicas and g["fairway_engine_running"] == g["fairway_engine_waiting"] == 0 \
        and g["fairway_engine_kv_usage"] == 0


__all__ = ["GAUGES", "idle", "replica_gauges"]
