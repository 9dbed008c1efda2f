"""Progress of long work, one helper for every stage, executor and script: counts, rate and ETA.

- On a terminal (``mode="auto"`` with a TTY, or ``"bar"``): one status line on stderr, redrawn in place at
  most ten times a second and at least once a second, the open tasks side by side
  (``run 3/9 steps | round 1 sampling 12/40 prefixes 30% 0:42 ETA 1:38``); log lines printed through
  :meth:`Progress.log` go above it.
- In a log (``"auto"`` without a TTY — a pod's ``kubectl logs`` — or ``"lines"``): plain lines through the
  ``log`` callable, no carriage returns: every ``every`` seconds (30) one line with the open tasks side by
  side, also while a single item takes longer than that (a background timer), so a reader never waits
  more than ``every`` seconds for a line; a task that was in a line prints its last one when it closes.
  Work shorter than ``every`` prints nothing: the stages log their own one-line summaries.
- ``"off"``: nothing.

::

    progress = Progress(log=print)                     # or ctx.progress in a stage
    with progress.task("round 0 sampling", total=len(prompts), unit="prefix") as bar:
        generator.generate(prompts, params, progress=bar)   # a task is the callable progress(n)
"""

from __future__ import annotations

import shutil
import sys
import threading
import time
from typing import Callable, Literal, TextIO

Mode = Literal["auto", "bar", "lines", "off"]


def duration(seconds: float) -> str:
    """``0:42``, ``12:05``, ``1:02:03``.

    >>> duration(42.4), duration(725), duration(3723)
    ('0:42', '12:05', '1:02:03')
    """
    s = int(round(max(seconds, 0.0)))
    h, rem = divmod(s, 3600)
    m, s = divmod(rem, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


def _plural(unit: str, n: float) -> str:
    if n == 1 or not unit or unit.endswith("s"):
        return unit
    return unit + "es" if unit.endswith(("x", "sh", "ch")) else unit + "s"


class Task:
    """One piece of long work: ``update(n)`` (or call it) as items finish; a context manager."""

    def __init__(self, owner: Progress, desc: str, total: int | None, unit: str, initial: int) -> None:
        self.owner, self.desc, self.total, self.unit = owner, desc, total, unit
        self.n = initial
        self._initial = initial
        self.start = time.monotonic()
        self.printed = False  # lines mode: it was in a line (so it prints its last one when it closes)
        self.closed = False

    # -- counting -----------------------------------------------------------------------------------

    def update(self, n: int = 1) -> None:
        self.n += n
        self.owner._changed(self)

    __call__ = update

    def set_total(self, total: int | None) -> None:
        self.total = total

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.owner._closed(self)

    def __enter__(self) -> Task:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- rendering ----------------------------------------------------------------------------------

    def status(self, now: float | None = None) -> str:
        """``round 0 sampling: 12/40 prefixes (30%), 0:42 elapsed, ETA 1:38`` (no ETA before the first item
        or without a total)."""
        now = time.monotonic() if now is None else now
        elapsed = now - self.start
        done = self.n - self._initial  # items done in this process: the rate and ETA are of those
        unit = _plural(self.unit, self.total if self.total is not None else self.n)
        if self.total:
            share = f"{100 * self.n / self.total:.0f}%"
            text = f"{self.desc}: {self.n}/{self.total} {unit} ({share}), {duration(elapsed)}"
        else:
            text = f"{self.desc}: {self.n} {unit}, {duration(elapsed)}"
        if self.closed:
            return text + " in all"
        text += " elapsed"
        if done > 0 and elapsed > 0:
            rate = done / elapsed
            if self.total:
                text += f", ETA {duration(max(self.total - self.n, 0) / rate)}"
            elif rate >= 1:
                text += f", {rate:.2f} {_plural(self.unit, 2)}/s"
            else:
                text += f", {1 / rate:.1f} s per {self.unit}"
        return text


class Progress:
    """Progress reporting for long work (see the module docstring). ``log``: where line-mode updates go
    (a job's log); ``every``: seconds between two lines of a task in a log; ``stream``: the terminal
    the bar is drawn on (stderr)."""

    def __init__(self, log: Callable[[str], None] = print, *, mode: Mode = "auto", every: float = 30.0,
                 stream: TextIO | None = None) -> None:
        self._log = log
        self.stream = stream if stream is not None else sys.stderr
        if mode == "auto":
            isatty = getattr(self.stream, "isatty", None)
            mode = "bar" if isatty is not None and isatty() else "lines"
        self.mode: Mode = mode
        self.every = every
        self._open: list[Task] = []
        self._lock = threading.RLock()
        self._drawn = 0.0  # bar mode: when the status line was last drawn; lines mode: when a line was printed
        self._width = 0  # bar mode: characters of the status line on screen
        self._wake = threading.Event()
        self._timer: threading.Thread | None = None

    @classmethod
    def of(cls, log: Callable[[str], None] = print, show_progress: bool = True) -> Progress:
        """The progress of a function that takes ``show_progress``: a bar on a terminal, else lines."""
        return cls(log, mode="auto" if show_progress else "lines")

    # -- the API ------------------------------------------------------------------------------------

    def task(self, desc: str, total: int | None = None, unit: str = "item", *, initial: int = 0) -> Task:
        """A new task (close it, or use it as a context manager). ``initial``: items already done (a resumed
        run), shown in the count but not in the rate."""
        t = Task(self, desc, total, unit, initial)
        if self.mode != "off":
            with self._lock:
                if not self._open:
                    self._drawn = time.monotonic()  # lines mode: the first line comes `every` seconds from now
                self._open.append(t)
                self._ensure_timer()
                if self.mode == "bar":
                    self._draw(force=True)
        return t

    __call__ = task

    def log(self, line: str) -> None:
        """A log line that does not tear the status line on a terminal (it is cleared, the line printed, the
        status drawn again below it)."""
        with self._lock:
            if self.mode == "bar" and self._width:
                self._clear()
                self._log(line)
                self._draw(force=True)
            else:
                self._log(line)

    # -- internals ----------------------------------------------------------------------------------

    def _changed(self, task: Task) -> None:
        if self.mode == "off" or task.closed:
            return
        with self._lock:
            if self.mode == "bar":
                self._draw()
            elif time.monotonic() - self._drawn >= self.every:
                self._line()

    def _closed(self, task: Task) -> None:
        if self.mode == "off":
            return
        with self._lock:
            if task in self._open:
                self._open.remove(task)
            if self.mode == "bar":
                self._clear()
                self._draw(force=True)
            elif task.printed:
                self._log(task.status())
            if not self._open:
                self._wake.set()

    def _line(self) -> None:
        """Lines mode: one line with every open task."""
        self._drawn = now = time.monotonic()
        for t in self._open:
            t.printed = True
        self._log(" | ".join(t.status(now) for t in self._open))

    def _clear(self) -> None:
        if self._width:
            self.stream.write("\r" + " " * self._width + "\r")
            self.stream.flush()
            self._width = 0

    def _draw(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._drawn < 0.1:
            return
        self._drawn = now
        if not self._open:
            return
        text = " | ".join(t.status(now) for t in self._open)
        text = text[:_columns() - 1]
        pad = max(self._width - len(text), 0)
        self.stream.write("\r" + text + " " * pad)
        self.stream.flush()
        self._width = len(text)

    def _ensure_timer(self) -> None:
        if self._timer is not None and self._timer.is_alive():
            return
        self._wake.clear()
        self._timer = threading.Thread(target=self._tick, name="sapd-progress", daemon=True)
        self._timer.start()

    def _tick(self) -> None:
        """The heartbeat: redraw the bar every second, or print a line when none was printed for ``every``
        seconds; ends when no task is open."""
        while True:
            with self._lock:
                if not self._open:
                    self._timer = None
                    return
            wait = 1.0 if self.mode == "bar" else max(0.05, self._drawn + self.every - time.monotonic())
            if self._wake.wait(wait):
                self._wake.clear()
                continue
            with self._lock:
                if self.mode == "bar":
                    self._draw(force=True)
                elif time.monotonic() - self._drawn >= self.every:
                    self._line()


def _columns() -> int:
    try:
        return shutil.get_terminal_size((100, 20)).columns
    except (OSError, ValueError):
        return 100


QUIET = Progress(lambda line: None, mode="off")  # for callers that want no progress at all
