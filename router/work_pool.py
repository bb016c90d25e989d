"""The ingress's tokenizer threads, serving the shortest jobs first.

Why: tokenization runs off the event loop on a few threads (one per CPU). A first-in-first-out
pool lets one client stall every other: 40 prompts of 1 MB at once (over the context, each
refused after a prefix of about 260,000 characters is tokenized, 0.1 s) kept a 2-token request
waiting 2.2 s behind them. Here a job's place is its deadline: its arrival plus its own estimated
time (``cost_s``, from its characters). A short job goes before the long ones that arrived with
it, and a long job is passed only by jobs due before it, so none waits for ever; a short job waits
at most for the jobs already running. The same rule as the Fair lane's, for tokenizer time.

``submit`` (no cost: due at once) keeps it a ``concurrent.futures.Executor``, so
``loop.run_in_executor`` works with it. O(log jobs) per submit and per start.
"""

from __future__ import annotations

import functools
import heapq
import itertools
import threading
import time
from collections.abc import Callable
from concurrent.futures import Executor, Future
from typing import Any

#: Seconds of tokenizer time per character of text, rounded up from the shipped tokenizers here
#: (fairway-tiny's: about 430 ns a character on the 2-core development machine, 2026-12-05).
TOKENIZE_S_PER_CHAR = 5e-7


class ShortestFirstPool(Executor):
    """Threads that run submitted calls in the order of their deadlines (module docstring)."""

    def __init__(self, threads: int, name: str = "work", clock: Callable[[], float] = time.monotonic) -> None:
        if threads < 1:
            raise ValueError("threads must be >= 1")
        self._clock = clock
        self._jobs: list[tuple[float, int, Future[Any], Callable[..., Any], tuple[Any, ...]]] = []
        self._order = itertools.count()  # ties: first in, first out
        self._ready = threading.Condition()
        self._closed = False
        self._threads = [threading.Thread(target=self._serve, name=f"{name}_{i}", daemon=True)
                         for i in range(threads)]
        for t in self._threads:
            t.start()

    def submit_costed(self, cost_s: float, fn: Callable[..., Any], /, *args: Any) -> Future[Any]:
        """Run ``fn(*args)`` on a thread once the jobs due before ``now + cost_s`` have started."""
        fut: Future[Any] = Future()
        with self._ready:
            if self._closed:
                raise RuntimeError("the pool is shut down")
            heapq.heappush(self._jobs, (self._clock() + max(cost_s, 0.0), next(self._order), fut, fn, args))
            self._ready.notify()
        return fut

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:  # type: ignore[override]
        """``Executor.submit``: a job due at once."""
        if kwargs:
            return self.submit_costed(0.0, functools.partial(fn, *args, **kwargs))
        return self.submit_costed(0.0, fn, *args)

    @property
    def waiting(self) -> int:
        """Jobs not yet started."""
        with self._ready:
            return len(self._jobs)

    def _serve(self) -> None:
        while True:
            with self._ready:
                while not self._jobs and not self._closed:
                    self._ready.wait()
                if not self._jobs:
                    return
                _, _, fut, fn, args = heapq.heappop(self._jobs)
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn(*args))
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                fut.set_exception(e)

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """Start nothing new; with ``cancel_futures``, drop the jobs not started; with ``wait``,
        return once the threads have finished what they took."""
        with self._ready:
            self._closed = True
            if cancel_futures:
                for _, _, fut, _, _ in self._jobs:
                    fut.cancel()
                self._jobs.clear()
            self._ready.notify_all()
        if wait:
            for t in self._threads:
                t.join()


__all__ = ["TOKENIZE_S_PER_CHAR", "ShortestFirstPool"]
