"""Polling for the end-to-end tests (the replicas' gauges: ``observability/probe.py``)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

__all__ = ["poll"]


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
