"""The ingress's side of the router's held queue (``fairway/routing/held.py`` orders it): a request
that every replica's gate refused waits here for room, and is sent when a gate takes it.

- **Entering.** A request the replicas refused (its pick and the one retry elsewhere) is held
  unless the least wait a refusing gate estimated already reaches past its wait bound (its
  class's ``max_wait_s``, else ``router.hold.max_wait_s``, counted from the request's headers):
  then it is refused at once, 429 with that estimate as Retry-After. The bound covers the wait at
  the router and at the gate: a request is held until its bound less the gates' own wait bound
  (``margin_s``, ``replica.max_queue_wait_s``), the most it can wait in a gate's queue once sent.
  While any request is held, a new request joins the held queue too, so it cannot overtake the
  ones held before it except by the flow-control order (a stricter tier, a fairer share, Fairway's
  lanes); but not one whose bound leaves no time to hold it (a bound at or under the gates'),
  which is sent, and refused at once if the gates refuse it.
- **Rounds.** A round starts when this ingress sees a sign of room (one of its requests had its
  first token or ended: that replica's queue moved) or every ``poll_s`` (room made by the other
  ingress replicas' requests). In a round the head of the held queue is sent with
  ``GenerateCall.ack``: a gate that queues it says so at once (an ``accepted`` chunk), and the
  next head goes; a refusal ends the round, the request staying held in its place. A refused
  probe never reached an engine, so no request runs twice.
- **Leaving.** Sent (the caller gets the accepted stream), or its hold ended unsent (429 with
  Retry-After: the last estimate a gate gave), or its client left (dropped, or its stream closed
  if a gate took it meanwhile), or held ``max_held`` already (429 at once).

The held queue is this ingress replica's own: with several ingress replicas each holds its own
requests, and each one's rounds see the room the others' requests leave through ``poll_s``.

Cost: a held request costs one probe per round that reaches it (a Ray call to a gate); a round
stops at the first refusal, so a round costs at most one refused probe. The order is the core's
``HeldQueue.head``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import heapq
import itertools
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from pydantic import BaseModel, ConfigDict, Field

from fairway.protocol import GenerateCall
from fairway.routing.held import DEFAULT_MAX_HELD, HeldQueue

logger = logging.getLogger("ray.serve")
S = TypeVar("S")

#: how often a round starts while requests are held and this ingress sees no sign of room
DEFAULT_POLL_S = 0.25
#: a probe that neither a gate's acknowledgement nor its refusal answers within this long (a
#: replica whose event loop is stuck) counts as a refusal; its send is cancelled, which takes the
#: request out of that gate's queue, so the rounds, and with them the held requests' bounds, go on
PROBE_TIMEOUT_S = 5.0
#: after a round ends in a refusal, the next starts no sooner than this: under overload every
#: first token and finish is a sign of room, and each round costs a refused probe (a Ray call)
REFUSED_PAUSE_S = 0.02


class HoldArgs(BaseModel):
    """The held queue's settings (the application's ``router.hold``)."""

    model_config = ConfigDict(extra="forbid")

    max_wait_s: float = Field(10.0, ge=0, description="the wait bound of a request without a class (seconds from "
                              "its headers; a class's own is its max_wait_s): held for room within it, else 429. "
                              "0: a request every replica refused is answered 429 at once")
    max_held: int = Field(DEFAULT_MAX_HELD, ge=0, description="requests one ingress replica holds at most")
    poll_s: float = Field(DEFAULT_POLL_S, gt=0, le=5, description="how often a round looks for room while requests "
                          "are held, besides this ingress's own first tokens and completions")


class HoldRefused(Exception):
    """The request is answered 429: ``reason`` "hold_bound" (its predicted wait passes its bound),
    "hold_timeout" (held until its bound passed) or "held_full" (``max_held`` held already)."""

    def __init__(self, message: str, reason: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.message = message
        self.reason = reason
        self.retry_after_s = retry_after_s


@dataclass(slots=True)
class _Waiter(Generic[S]):
    call: GenerateCall
    fut: asyncio.Future[tuple[S, float]]  # its stream and the seconds it was held, once a gate took it


class Holder(Generic[S]):
    """Held requests and the rounds that send them (module docstring).

    ``probe(call)`` sends ``call`` (with ``ack`` set) and returns its stream once a gate has
    accepted it, or raises: an exception with a ``refused_by`` attribute that is set means a gate
    refused it (still no room), any other is the request's own failure, passed to its caller.
    ``close(stream)`` ends a stream nobody reads. ``bound_s(call)`` is the call's wait bound.
    ``stats`` (optional) gets ``set_held``, ``observe_hold``. ``wall`` is the clock of
    ``GenerateCall.waited_from`` (``time.time``). ``margin_s``: the gates' wait bound, taken
    off every request's bound for the time it may wait at a gate once sent.
    """

    def __init__(self, queue: HeldQueue, probe: Callable[[GenerateCall], Awaitable[S]], close: Callable[[S], None],
                 bound_s: Callable[[GenerateCall], float], poll_s: float = DEFAULT_POLL_S, stats: Any = None,
                 wall: Callable[[], float] = time.time, margin_s: float = 0.0) -> None:
        self.queue = queue
        self.probe = probe
        self.close = close
        self.bound_s = bound_s
        self.poll_s = poll_s
        self.stats = stats
        self.wall = wall
        self.margin_s = margin_s
        self.probe_timeout_s = PROBE_TIMEOUT_S
        self._waiters: dict[int, _Waiter[S]] = {}
        self._deadlines: list[tuple[float, int]] = []  # heap; entries of requests gone are skipped
        self._ids = itertools.count()
        self._room = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._probing = -1  # the request a round is sending now
        self.last_wait_s = 1.0  # the last queue wait a refusing gate estimated (Retry-After)

    def __len__(self) -> int:
        return len(self._waiters)

    def _hold_end(self, call: GenerateCall) -> float:
        """When ``call``'s hold ends (wall time): its wait bound after its headers, less the
        gates' bound (it may wait that long at a gate once sent). O(1) plus ``bound_s``."""
        return call.waited_from + self.bound_s(call) - self.margin_s

    def can_hold(self, call: GenerateCall) -> bool:
        """Whether ``call``'s wait bound leaves time to hold it (it ends after the gates' bound).
        One that does not is never held, so it does not queue behind the held requests: it is
        sent, and refused if the gates refuse it. O(1)."""
        return self._hold_end(call) > self.wall()

    def room(self) -> None:
        """A sign that a replica may have room: start a round (when requests are held). O(1)."""
        if self._waiters:
            self._room.set()

    async def wait(self, call: GenerateCall, refused_wait_s: float | None = None) -> tuple[S, float]:
        """Hold ``call`` until a gate accepts it; its stream and the seconds it was held.
        ``refused_wait_s``: the least queue wait the gates that refused it estimated (None: it
        joins the requests already held). Raises ``HoldRefused``. Cancelling the wait (its
        client left) drops it."""
        deadline = self._hold_end(call)
        if refused_wait_s is not None:
            self.last_wait_s = refused_wait_s
            if self.wall() + max(refused_wait_s - self.margin_s, 0.0) > deadline:
                raise self._refused(call, "hold_bound", refused_wait_s,
                                    f"every replica's queue is full: the shortest is an estimated "
                                    f"{refused_wait_s:.1f} s of work, past this request's wait bound of "
                                    f"{self.bound_s(call):g} s")
        if self.queue.full:
            raise self._refused(call, "held_full", self.last_wait_s,
                                f"every replica's queue is full and this router holds {self.queue.max_held} "
                                f"requests already")
        rid = next(self._ids)
        fut: asyncio.Future[tuple[S, float]] = asyncio.get_running_loop().create_future()
        self.queue.hold(rid, len(call.prompt_token_ids), call.priority_class, call.tenant)
        self._waiters[rid] = _Waiter(call, fut)
        heapq.heappush(self._deadlines, (deadline, rid))
        self._gauge(call.priority_class)
        self._room.set()  # a new request may fit where the held ones did not (a stricter tier)
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._rounds())
        try:
            return await fut
        except BaseException:  # its caller left just as a gate took it: nobody reads the stream
            if fut.done() and not fut.cancelled() and fut.exception() is None:
                self.close(fut.result()[0])
            raise
        finally:
            if not fut.done():
                fut.cancel()  # its caller left: a round that is sending it closes the stream
            if rid in self._waiters and rid != self._probing:
                self._leave(rid, "gone", drop=True)

    # -- rounds --------------------------------------------------------------------------------

    async def _rounds(self) -> None:
        """Rounds while requests are held (module docstring); ends when none is."""
        while self._waiters:
            wake = self.poll_s
            if self._deadlines:
                wake = min(wake, max(0.0, self._deadlines[0][0] - self.wall()))
            try:
                await asyncio.wait_for(self._room.wait(), wake)
            except TimeoutError:
                pass
            self._room.clear()
            self._expire()
            try:
                if not await self._round():
                    await asyncio.sleep(REFUSED_PAUSE_S)
            except Exception:  # noqa: BLE001 - a bug here must not leave requests held forever
                logger.exception("ingress: a round of the held queue failed")

    async def _round(self) -> bool:
        """Send held requests in order until one is refused (False) or none is left (True)."""
        while (rid := self.queue.head()) is not None:
            w = self._waiters[rid]
            if w.fut.done():  # its caller left between rounds
                self._leave(rid, "gone", drop=True)
                continue
            self._probing = rid
            try:
                stream = await asyncio.wait_for(self.probe(dataclasses.replace(w.call, ack=True, avoid=())),
                                                self.probe_timeout_s)
            except Exception as e:  # noqa: BLE001 - a refusal keeps it held; any other failure is its answer
                if getattr(e, "refused_by", "") or isinstance(e, TimeoutError):
                    self.last_wait_s = getattr(e, "retry_after_s", None) or self.last_wait_s
                    if w.fut.done():
                        self._leave(rid, "gone", drop=True)
                    return False  # no room yet: the round ends, the request keeps its place
                self._leave(rid, "failed", drop=True)
                if not w.fut.done():
                    w.fut.set_exception(e)
                continue
            finally:
                self._probing = -1
            held_s = self._leave(rid, "sent", drop=False)
            if w.fut.done():
                self.close(stream)  # its client left while the gate took it
            else:
                w.fut.set_result((stream, held_s))
        return True

    def _expire(self) -> None:
        """Refuse the held requests whose bound has passed. O(expired log n)."""
        now = self.wall()
        while self._deadlines and self._deadlines[0][0] <= now:
            _, rid = heapq.heappop(self._deadlines)
            w = self._waiters.get(rid)
            if w is None:
                continue
            self._leave(rid, "timeout", drop=True)
            if not w.fut.done():
                bound = self.bound_s(w.call)
                w.fut.set_exception(self._refused(
                    w.call, "hold_timeout", self.last_wait_s,
                    f"every replica's queue stayed full within this request's wait bound of {bound:g} s"))

    def _leave(self, rid: int, outcome: str, drop: bool) -> float:
        """``rid`` leaves the held queue (``outcome``: how, for the metrics); the seconds it was held."""
        w = self._waiters.pop(rid)
        held_s = self.queue.drop(rid) if drop else self.queue.take(rid)
        if self.stats is not None:
            self.stats.observe_hold(w.call.priority_class, held_s, outcome)
        self._gauge(w.call.priority_class)
        return held_s

    def _gauge(self, priority_class: str) -> None:
        if self.stats is not None:  # the ingress gives every call its configured class name ("" without classes)
            self.stats.set_held(priority_class, self.queue.depth.get(priority_class, 0))

    @staticmethod
    def _refused(call: GenerateCall, reason: str, retry_after_s: float, why: str) -> HoldRefused:
        return HoldRefused(f"request {call.request_id} refused: {why}; retry later", reason, retry_after_s)


__all__ = ["DEFAULT_POLL_S", "HoldArgs", "HoldRefused", "Holder"]
