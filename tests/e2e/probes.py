"""Polling helpers for the end-to-end tests; the replica gauges come from ``observability/probe.py``."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from observability.probe import idle, replica_gauges

__all__ = ["idle", "poll", "replica_gauges"]


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
