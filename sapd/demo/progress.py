"""Progress a person can follow, on a terminal and in a log: counts, elapsed time and ETA.

On a terminal it is a tqdm bar. Anywhere else (a file, CI, ``kubectl logs``) it is one plain line at the
start, then at most one every ``every`` seconds while items finish, and one at the end — no carriage
returns::

    student SFT: 12/40 rounds (30 %), 41 s, ETA 1 min 35 s

:func:`progress` is the only door the demo (and ``research/``) use, so it can be swapped for the shared
progress helper of the stages in one place.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any, Callable, TextIO


def duration(seconds: float) -> str:
    """``42 s``, ``3 min 05 s``, ``1 h 02 min``."""
    s = int(round(max(seconds, 0.0)))
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60} min {s % 60:02d} s"
    return f"{s // 3600} h {s % 3600 // 60:02d} min"


def _terminal(stream: TextIO) -> bool:
    """A terminal a bar can be drawn on (a pseudo-terminal of width 0 cannot show one)."""
    try:
        return stream.isatty() and os.get_terminal_size(stream.fileno()).columns > 0
    except (AttributeError, OSError, ValueError):
        return False


class Progress:
    """A counter towards ``total`` that reports itself (see the module docstring). ``log`` prints a line
    (used when not on a terminal); ``bar`` False prints lines on a terminal too (None: a bar on a
    terminal); ``initial``: items already done before (reused); ``enabled=False`` reports nothing."""

    def __init__(self, desc: str, total: int, unit: str = "", *, log: Callable[[str], None] = print,
                 every: float = 10.0, stream: TextIO | None = None, enabled: bool = True, bar: bool | None = None,
                 initial: int = 0) -> None:
        self.desc, self.total, self.unit, self.log, self.every = desc, total, unit, log, every
        self.n = self.initial = initial
        self.start = self.last = time.monotonic()
        self.enabled = enabled
        stream = stream or sys.stderr
        self._bar: Any = None
        if enabled and (_terminal(stream) if bar is None else bar):
            from tqdm import tqdm
            self._bar = tqdm(total=total, desc=desc, unit=f" {unit}" if unit else "it", file=stream,
                             initial=initial, leave=True, dynamic_ncols=True)
        elif enabled:
            self.log(self.line())

    def line(self) -> str:
        """``desc: n/total unit (pct), elapsed, ETA …``"""
        elapsed = time.monotonic() - self.start
        unit = f" {self.unit}" if self.unit else ""
        text = f"{self.desc}: {self.n}/{self.total}{unit}"
        if self.total:
            text += f" ({100 * self.n / self.total:.0f} %)"
        text += f", {duration(elapsed)}"
        done_here = self.n - self.initial  # the rate counts only what this run did
        if done_here > 0 and self.n < self.total:
            text += f", ETA {duration(elapsed / done_here * (self.total - self.n))}"
        return text

    def update(self, n: int = 1) -> None:
        self.n += n
        if self._bar is not None:
            self._bar.update(n)
            return
        now = time.monotonic()
        if self.enabled and (now - self.last >= self.every or self.n >= self.total):
            self.last = now
            self.log(self.line())

    def set(self, n: int) -> None:
        """Set the count (a worker reports its absolute progress)."""
        if n != self.n:
            self.update(n - self.n)

    def heartbeat(self) -> None:
        """A line (or a redrawn bar) now, even if nothing finished: long items still show time passing."""
        if self._bar is not None:
            self._bar.refresh()
        elif self.enabled:
            self.last = time.monotonic()
            self.log(self.line())

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        elif self.enabled and self.n < self.total:
            self.log(self.line())
        self.enabled = False

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def progress(desc: str, total: int, unit: str = "", *, log: Callable[[str], None] = print, every: float = 10.0,
             enabled: bool = True, bar: bool | None = None, initial: int = 0) -> Progress:
    """A :class:`Progress` bar (terminal) or line logger (elsewhere) for ``total`` items, ``initial`` of them
    done already; nothing at all when none is left to do."""
    return Progress(desc, total, unit, log=log, every=every, enabled=enabled and initial < total, bar=bar,
                    initial=initial)
