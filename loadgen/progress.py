"""A one-line progress display for ``loadgen run`` (stderr; redrawn in place with ``\\r``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TextIO

from fairway.clock import Clock


@dataclass(slots=True)
class ProgressLine:
    """Counts of a running load test, redrawn at most every ``every_s`` seconds of ``clock``.

    ``stream=None`` disables it (non-interactive runs, tests that do not look). ``close()``
    draws the final counts and ends the line.
    """

    clock: Clock
    stream: TextIO | None
    total: int | None = None
    every_s: float = 0.25
    sent: int = 0
    finished: int = 0
    failed: int = 0
    _start: float = 0.0
    _last: float = float("-inf")
    _width: int = 0

    def start(self) -> None:
        self._start = self.clock.now()

    def on_sent(self) -> None:
        self.sent += 1
        self.draw()

    def on_done(self, ok: bool) -> None:
        if ok:
            self.finished += 1
        else:
            self.failed += 1
        self.draw()

    def text(self) -> str:
        total = f"/{self.total}" if self.total is not None else ""
        in_flight = self.sent - self.finished - self.failed
        elapsed = self.clock.now() - self._start
        return (f"loadgen: sent {self.sent}{total}  ok {self.finished}  failed {self.failed}  "
                f"in flight {in_flight}  {elapsed:.1f} s")

    def draw(self, force: bool = False) -> None:
        if self.stream is None:
            return
        now = self.clock.now()
        if not force and now - self._last < self.every_s:
            return
        self._last = now
        line = self.text()
        pad = " " * max(0, self._width - len(line))
        self._width = len(line)
        self.stream.write(f"\r{line}{pad}")
        self.stream.flush()

    def close(self) -> None:
        if self.stream is None:
            return
        self.draw(force=True)
        self.stream.write("\n")
        self.stream.flush()
