"""Progress of a generation job: done/total, tokens/s, $ spent, ETA, errors.

On a terminal (``stream.isatty()``) one bar line is redrawn in place at most 5 times a second; the
log still gets a line at every 10 % step. Elsewhere (Snakemake log files, CI) plain log lines are
written every ``every_s`` seconds and at every 10 % step. Nothing secret is ever part of a line.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from typing import Callable, TextIO

#: Where a job's messages go (one line each, no newline).
Log = Callable[[str], None]


def stderr_log(message: str) -> None:
    """The default :data:`Log`: a line on stderr, flushed."""
    print(message, file=sys.stderr, flush=True)


def _duration(seconds: float | None) -> str:
    if seconds is None or seconds != seconds or seconds == float("inf"):
        return "?"
    seconds = int(round(seconds))
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}h{m:02d}m" if h else (f"{m}m{s:02d}s" if m else f"{s}s")


@dataclass
class Progress:
    label: str
    total: int
    log: Callable[[str], None]
    stream: TextIO | None = None
    tty: bool | None = None
    every_s: float = 10.0
    done: int = 0
    ok: int = 0
    final_errors: int = 0
    retries: int = 0
    in_flight: int = 0
    completion_tokens: int = 0
    cost: float = 0.0
    started: float = field(default_factory=time.monotonic)
    _last_log: float = 0.0
    _last_draw: float = 0.0
    _step: int = 0
    _drawn: bool = False

    def __post_init__(self) -> None:
        if self.stream is None:
            self.stream = sys.stderr
        if self.tty is None:
            try:
                self.tty = bool(self.stream.isatty())
            except (AttributeError, ValueError):
                self.tty = False
        self._last_log = self.started

    # -- numbers --------------------------------------------------------------------------------
    @property
    def elapsed(self) -> float:
        return max(time.monotonic() - self.started, 1e-9)

    @property
    def eta(self) -> float | None:
        if self.done == 0:
            return None
        return (self.total - self.done) * self.elapsed / self.done

    def line(self) -> str:
        pct = 100.0 * self.done / self.total if self.total else 100.0
        return (f"{self.label}: {self.done}/{self.total} ({pct:.0f}%), {self.completion_tokens / self.elapsed:,.0f} tok/s, "
                f"${self.cost:.4f}, ETA {_duration(self.eta)}, {self.final_errors} error(s), {self.retries} retr"
                f"{'y' if self.retries == 1 else 'ies'}, {self.in_flight} in flight")

    def bar(self, width: int = 24) -> str:
        frac = self.done / self.total if self.total else 1.0
        filled = int(frac * width)
        return f"\r{self.label} [{'#' * filled}{'.' * (width - filled)}] " + self.line().split(": ", 1)[1] + "\x1b[K"

    # -- events ---------------------------------------------------------------------------------
    def update(self, force: bool = False) -> None:
        now = time.monotonic()
        step = (10 * self.done // self.total) if self.total else 10
        stepped = step > self._step
        if stepped:
            self._step = step
        if self.tty:
            if stepped:
                if self._drawn:
                    self.stream.write("\r\x1b[K")
                self.log(self.line())
            if force or stepped or now - self._last_draw >= 0.2:
                self._last_draw = now
                self.stream.write(self.bar())
                self.stream.flush()
                self._drawn = True
        elif force or stepped or now - self._last_log >= self.every_s:
            self._last_log = now
            self.log(self.line())

    def close(self) -> None:
        if self.tty and self._drawn:
            self.stream.write(self.bar() + "\n")
            self.stream.flush()
