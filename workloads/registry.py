"""Workloads by name: an open registry of factories, and ``make_workload``.

``WORKLOADS`` maps a name to a factory taking ``WorkloadArgs``; add one with
``register_workload``. A factory registered with ``arg="PATH"`` answers ``"name:PATH"``
requests (as ``trace:PATH`` does). Built in:

| name | what |
| --- | --- |
| ``rag`` / ``rag-spike`` | open-loop RAG; ``-spike`` adds ``BurstSchedule()`` bursts |
| ``mixed`` / ``mixed-spike`` | open-loop 80/20 cheap-reuse / cold mix; ``-spike`` adds bursts |
| ``hotspot`` | ``mixed`` with one shared prefix for 90% of requests (router hot-spotting) |
| ``agentic`` / ``agentic-spike`` | closed-loop sessions; ``-spike`` adds a ``Swarm()`` of 100 |
| ``trace:PATH`` | replay: ``.jsonl`` Mooncake or Qwen-Bailian, ``.csv`` timing-only (Azure) + ``PrefixModel``;
  PATH may be a ``workloads.traces.KNOWN_TRACES`` name (``trace:mooncake-toolagent``) |

Parameter meaning: ``rate`` is requests/s for open-loop synthetic workloads (the base rate for
``-spike``), new sessions/s for agentic, and is ignored by trace replays (their timestamps set
the rate; use ``time_scale``). ``duration_s`` ends arrivals (sessions keep running to their
end; a trace is cut there). Left out (``None``), it is ``DEFAULT_DURATION_S`` for a synthetic
workload and the whole trace for a replay. ``time_scale`` applies to traces
only; another value than 1 for a synthetic workload is an error rather than silently ignored.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from fairway.hashing import DEFAULT_BLOCK_SIZE
from fairway.request import Workload, WorkloadError
from workloads.arrivals import BurstSchedule
from workloads.concurrency import ConcurrencyWorkload
from workloads.synthetic import AgenticWorkload, MixedParams, MixedWorkload, RagWorkload, Swarm
from workloads.traces import trace_workload


@dataclass(frozen=True, slots=True)
class WorkloadArgs:
    """What ``make_workload`` hands a factory. ``arg`` is the text after ``name:``, if any."""

    name: str
    arg: str | None
    rate: float
    duration_s: float
    rng: np.random.Generator
    block_size: int
    time_scale: float
    keep_tokens: bool


WorkloadFactory = Callable[[WorkloadArgs], Workload]

DEFAULT_DURATION_S = 300.0  # seconds of arrivals of a synthetic workload when none is given

WORKLOADS: dict[str, WorkloadFactory] = {}
_ARG: dict[str, str] = {}  # name -> placeholder of its required argument
_REPLAYS: set[str] = set()  # names whose arrivals end with their data (traces), not a duration


def register_workload(
    name: str, factory: WorkloadFactory, *, arg: str | None = None, replace: bool = False, replay: bool = False
) -> None:
    """Register ``factory`` under ``name``. With ``arg`` (a placeholder such as ``"PATH"``) it
    answers ``name:VALUE`` requests and gets ``VALUE`` as ``WorkloadArgs.arg``. A ``replay``
    (a trace) runs to its end unless a duration is given."""
    if not name or ":" in name:
        raise WorkloadError(f"bad workload name {name!r}: must be non-empty, without ':'")
    if name in WORKLOADS and not replace:
        raise WorkloadError(f"workload {name!r} is already registered")
    WORKLOADS[name] = factory
    if arg:
        _ARG[name] = arg
    else:
        _ARG.pop(name, None)
    if replay:
        _REPLAYS.add(name)
    else:
        _REPLAYS.discard(name)


def known_workloads() -> list[str]:
    """Names as a user writes them, e.g. ``rag``, ``trace:PATH``."""
    return sorted(f"{n}:{_ARG[n]}" if n in _ARG else n for n in WORKLOADS)


def _unknown(name: str) -> WorkloadError:
    return WorkloadError(f"unknown workload {name!r}; known: {', '.join(known_workloads())}")


def _synthetic_only(a: WorkloadArgs) -> None:
    if a.time_scale != 1.0:
        raise WorkloadError(
            f"time_scale applies to trace replays only; for {a.name!r} change rate instead"
        )
    if not math.isfinite(a.duration_s):
        raise WorkloadError(f"{a.name!r} needs a finite duration_s")


def _synthetic(a: WorkloadArgs) -> dict[str, object]:
    """The keyword arguments every synthetic workload takes, after checking they apply."""
    _synthetic_only(a)
    return {"rate": a.rate, "duration_s": a.duration_s, "block_size": a.block_size, "keep_tokens": a.keep_tokens}


def _rag(a: WorkloadArgs, bursts: BurstSchedule | None = None) -> Workload:
    return RagWorkload(a.rng, bursts=bursts, **_synthetic(a))  # type: ignore[arg-type]


def _mixed(a: WorkloadArgs, bursts: BurstSchedule | None = None, params: MixedParams | None = None) -> Workload:
    return MixedWorkload(a.rng, bursts=bursts, params=params, **_synthetic(a))  # type: ignore[arg-type]


#: One very popular prefix (90% of requests share it): the hot-spotting case for routers.
HOTSPOT = MixedParams(cheap_fraction=0.9, n_prefixes=1)


def _agentic(a: WorkloadArgs, swarm: Swarm | None = None) -> Workload:
    return AgenticWorkload(a.rng, swarm=swarm, **_synthetic(a))  # type: ignore[arg-type]


def _trace(a: WorkloadArgs) -> Workload:
    assert a.arg is not None
    return trace_workload(
        a.arg,
        a.rng,
        block_size=a.block_size,
        time_scale=a.time_scale,
        duration_s=a.duration_s,
        keep_tokens=a.keep_tokens,
    )


register_workload("rag", _rag)
register_workload("rag-spike", lambda a: _rag(a, BurstSchedule()))
register_workload("mixed", _mixed)
register_workload("mixed-spike", lambda a: _mixed(a, BurstSchedule()))
register_workload("hotspot", lambda a: _mixed(a, None, HOTSPOT))
register_workload("agentic", _agentic)
register_workload("agentic-spike", lambda a: _agentic(a, Swarm()))
register_workload("trace", _trace, arg="PATH", replay=True)


def make_workload(
    name: str,
    *,
    rate: float,
    duration_s: float | None = None,
    seed: int,
    block_size: int = DEFAULT_BLOCK_SIZE,
    time_scale: float = 1.0,
    concurrency: int | None = None,
    keep_tokens: bool = False,
) -> Workload:
    """Build the workload ``name`` (see the module docstring), seeded by ``seed``.

    Same arguments, same specs. ``concurrency`` wraps the result in ``ConcurrencyWorkload``.
    Raises ``WorkloadError`` (a ``ValueError``) for an unknown name or a bad parameter.
    """
    if not (isinstance(rate, (int, float)) and rate > 0 and math.isfinite(rate)):
        raise WorkloadError(f"rate must be a positive finite number, got {rate!r}")
    if duration_s is not None and not (isinstance(duration_s, (int, float)) and duration_s > 0):
        raise WorkloadError(f"duration_s must be > 0, got {duration_s!r}")
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise WorkloadError(f"seed must be an integer >= 0, got {seed!r}")
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise WorkloadError(f"block_size must be an integer >= 1, got {block_size!r}")
    if not (time_scale > 0 and math.isfinite(time_scale)):
        raise WorkloadError(f"time_scale must be a positive finite number, got {time_scale!r}")
    key, sep, arg = name.partition(":")
    factory = WORKLOADS.get(key)
    if factory is None or bool(sep) != (key in _ARG):
        raise _unknown(name)
    if sep and not arg:
        raise WorkloadError(f"workload {key!r} needs an argument: {key}:{_ARG[key]}")
    if duration_s is None:
        duration_s = math.inf if key in _REPLAYS else DEFAULT_DURATION_S
    args = WorkloadArgs(
        name=name,
        arg=arg if sep else None,
        rate=float(rate),
        duration_s=float(duration_s),
        rng=np.random.default_rng(int(seed)),
        block_size=block_size,
        time_scale=float(time_scale),
        keep_tokens=keep_tokens,
    )
    workload = factory(args)
    workload.name = name
    if concurrency is not None:
        workload = ConcurrencyWorkload(workload, concurrency)
    return workload


class RunWorkloadFields(Protocol):
    """The fields a run config needs to name its workload (``sim.runner.RunConfig`` and
    ``loadgen.http_run.HttpRunConfig`` both have them)."""

    workload: str
    rate: float
    duration_s: float | None
    seed: int
    block_size: int
    time_scale: float
    concurrency: int | None


def make_workload_from(cfg: RunWorkloadFields) -> Workload:
    """``make_workload`` from a run config: the one place the simulator and the HTTP load
    generator build a workload, so both replay the same requests."""
    return make_workload(
        cfg.workload,
        rate=cfg.rate,
        duration_s=cfg.duration_s,
        seed=cfg.seed,
        block_size=cfg.block_size,
        time_scale=cfg.time_scale,
        concurrency=cfg.concurrency,
    )
