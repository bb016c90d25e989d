"""``ShortestFirstPool``: jobs start in the order of their deadlines (arrival plus own cost)."""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import Future

import pytest

from router.work_pool import ShortestFirstPool


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_jobs_start_by_arrival_plus_cost_and_a_long_one_is_passed_only_by_jobs_due_before_it():
    """One thread, held busy while six jobs arrive: a long job at t=0 (cost 10), short ones at
    t=0 (cost 1), t=5 (cost 1), t=9 (cost 2) and t=10.5 (cost 0), and one due at once
    (``submit``) at t=11. Their deadlines 10, 1, 6, 11, 10.5 and 11 give the start order: the
    long job goes before every job due after it, however short, and of two due together the
    first in goes first."""
    clock = Clock()
    pool = ShortestFirstPool(1, clock=clock)
    gate, started, order = threading.Event(), threading.Event(), []
    pool.submit_costed(0.0, lambda: (started.set(), gate.wait()))
    assert started.wait(5)
    for at, cost, name in ((0, 10, "long"), (0, 1, "a"), (5, 1, "b"), (9, 2, "c"), (10.5, 0, "d")):
        clock.now = 100.0 + at
        pool.submit_costed(cost, order.append, name)
    clock.now = 111.0
    pool.submit(order.append, "now")
    assert pool.waiting == 6
    gate.set()
    pool.shutdown(wait=True)
    assert order == ["a", "b", "long", "d", "c", "now"]


def test_results_and_errors_reach_the_caller_and_a_shut_pool_takes_nothing():
    pool = ShortestFirstPool(2)
    assert pool.submit_costed(0.5, sum, [1, 2, 3]).result(5) == 6
    assert pool.submit(int, "12", base=3).result(5) == 5  # keyword arguments, as Executor.submit
    with pytest.raises(ZeroDivisionError):
        pool.submit(lambda: 1 / 0).result(5)

    async def off_the_loop() -> str:
        return await asyncio.get_running_loop().run_in_executor(pool, str.upper, "ok")

    assert asyncio.run(off_the_loop()) == "OK"
    pool.shutdown()
    with pytest.raises(RuntimeError, match="shut down"):
        pool.submit(int, "1")


def test_jobs_not_started_are_cancelled_at_a_shutdown_that_asks_it():
    pool = ShortestFirstPool(1)
    gate, started = threading.Event(), threading.Event()
    running = pool.submit(lambda: (started.set(), gate.wait(5))[1])
    assert started.wait(5)
    queued: Future = pool.submit(int, "1")
    threading.Timer(0.05, gate.set).start()
    pool.shutdown(wait=True, cancel_futures=True)
    assert running.result(5) is True and queued.cancelled()
    with pytest.raises(ValueError, match="threads"):
        ShortestFirstPool(0)
