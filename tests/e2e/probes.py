"""What a test reads from a live cluster besides HTTP answers: the replicas' own gauges.

``replica_gauges(url)`` scrapes every replica's metrics endpoint (listed at the ingress's
``/metrics/targets``) and sums, over replicas, the gauges that say whether anything is left in a
replica: requests in the engine, requests waiting at its gate, and KV blocks in use.
"""

from __future__ import annotations

import json
import time
import urllib.request
from collections.abc import Callable
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

GAUGES = ("fairway_engine_running", "fairway_engine_waiting", "fairway_engine_kv_usage")


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as r:
        return r.read().decode()


def replica_gauges(url: str) -> dict[str, float]:
    """``GAUGES`` summed over the replicas listed at ``{url}/metrics/targets`` (plus ``replicas``:
    how many were scraped)."""
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


def poll(fn: Callable[[], Any], timeout_s: float, what: str, interval_s: float = 0.2,
         describe: Callable[[], Any] | None = None) -> Any:
    """``fn()`` until it returns something true, or ``TimeoutError`` naming ``what`` and the last
    value (or ``describe()``, the state worth showing) after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    last = None
    while time.monotonic() < deadline:
        last = fn()
        if last:
            return last
        time.sleep(interval_s)
    if describe is not None:
        last = describe()
    raise TimeoutError(f"{what} not met after {timeout_s}s (last: {last!r})")
