"""What a workload hands to a host: one request's shape, and the workload protocol.

A ``RequestSpec`` carries everything the engine model and the policies need, and nothing about
how it is served: arrival time, prompt and output lengths, and the chained block hashes of the
whole sequence (prompt then output tokens), so that a follow-up turn whose prompt extends this
one's context hits the blocks this request produced.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np


@dataclass(slots=True)
class RequestSpec:
    """One request as a workload defines it.

    Invariants: ``len(block_hashes) == (prompt_tokens + output_tokens) // block_size``
    (full blocks only); ``arrival_s >= 0``; ``prompt_tokens >= 1``; ``output_tokens >= 1``.
    """

    rid: int
    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    block_hashes: tuple[int, ...]
    session: int = -1
    turn: int = 0
    tenant: str | None = None
    kind: str = ""  # workload-specific label, e.g. "cheap" / "cold" / "agent"
    priority_class: str = ""  # flow-control class (fairway/policies/classes.py); "" = the default class
    tokens: np.ndarray | None = field(default=None, repr=False)  # prompt token ids, if kept


class Workload(ABC):
    """A source of requests.

    Open-loop workloads yield every request from ``initial()`` in arrival order and return
    nothing from ``on_complete``. Closed-loop workloads yield first turns from ``initial()`` and
    the next turn of a session from ``on_complete`` (arrival = finish + think time).
    """

    name: str = "workload"
    closed_loop: bool = False

    @abstractmethod
    def initial(self) -> Iterator[RequestSpec]:
        """Requests whose arrival is known up front, in non-decreasing arrival order."""

    def on_complete(self, spec: RequestSpec, finish_s: float) -> list[RequestSpec]:
        """Follow-up requests caused by ``spec`` finishing at ``finish_s`` (closed loop)."""
        return []


class WorkloadError(ValueError):
    """A workload cannot be built or driven: unknown name, bad parameter, missing or malformed
    trace (the message names the file and line), or a completion the workload never issued."""
