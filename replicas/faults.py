"""Injected faults, for reliability tests and soaks: a replica that reads a fault file.

Why a file: a test must reach one chosen replica of a running cluster (a stall, a slowdown) without
a control path through the request router, which would pick the replica itself. With
``fault_file`` set (off by default; never in a production config), each replica polls the file's
modification time every ``POLL_S`` and, when it changes, applies the entry under its own name
(its Serve replica id, the ``component`` label of its metrics target) or under ``"*"``:

    {"<replica id>": {"stall": true}, "*": {"slowdown": 5}}

``stall``: the engine stops stepping (its actor stays alive and answers health checks: the gate's
watchdog must find it); ``slowdown``: every engine step takes that many times longer. Engines
that apply no faults (vLLM: ``Engine.set_fault``'s default) ignore it. An entry absent or removed
means no fault.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
from typing import Any

from fairway.protocol import Engine

logger = logging.getLogger("ray.serve")

POLL_S = 0.2


class FaultFile:
    """Polls ``path`` and applies this replica's entry to ``engine.set_fault`` (module docstring)."""

    def __init__(self, path: str, name: str, engine: Engine) -> None:
        self.path = path
        self.name = name
        self.engine = engine
        self._mtime: float | None = None
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._poll())

    def check(self) -> dict[str, Any] | None:
        """Apply the file's entry for this replica if the file changed; the entry applied, or None."""
        try:
            mtime = os.stat(self.path).st_mtime
        except OSError:
            mtime = None
        if mtime == self._mtime:
            return None
        self._mtime = mtime
        entry: dict[str, Any] = {}
        if mtime is not None:
            try:
                with open(self.path) as f:
                    faults = json.load(f)
                entry = dict(faults.get(self.name) or faults.get("*") or {})
            except (OSError, ValueError, AttributeError) as e:
                logger.warning("replica %s: fault file %s unreadable: %s", self.name, self.path, e)
                return None
        if self.engine.set_fault(stall=bool(entry.get("stall", False)), slowdown=float(entry.get("slowdown", 1.0))):
            logger.warning("replica %s: injected fault %s", self.name, entry or "none")
        return entry

    async def _poll(self) -> None:
        while True:
            self.check()
            await asyncio.sleep(POLL_S)


def write_faults(path: str | os.PathLike, faults: dict[str, Any]) -> None:
    """Replace the fault file at once (a rename), so a replica never reads half of it."""
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(faults, f)
    os.replace(tmp, path)
