"""The demo's independent jobs (train a model, evaluate one) in worker processes, each single-threaded.

Models this small keep two cores busier as two one-thread processes than as one two-thread process, so
the student and the teacher train at once, then the arms and the evaluations. A job is a top-level
function called in a worker with its keyword arguments and ``report``: ``report(phase, done, total, unit)``
becomes a progress bar (or line) in the parent, :mod:`sapd.demo.progress`. A job starts once the jobs
it comes ``after`` have finished, in the order given. While jobs run, the parent shows each running
job's progress at least every ``heartbeat`` seconds, so a long round is never silent.

Workers are spawned (not forked: the parent may hold torch's thread pools and open files), and an error
in a job stops the others and is raised in the parent with the job's name.
"""

from __future__ import annotations

import os
import queue
import time
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from dataclasses import dataclass, field
from multiprocessing import get_context
from typing import Any, Callable

from sapd.demo.progress import Progress, progress

Report = Callable[[str, int, int, str], None]  # (phase, done, total, unit)

_events: Any = None  # the queue of this worker process (set by _start_worker)


@dataclass
class Job:
    name: str  # shown in progress lines: "student SFT"
    fn: Callable[..., Any]  # a module-level function: fn(report=…, **kwargs)
    kwargs: dict[str, Any] = field(default_factory=dict)
    after: tuple[str, ...] = ()  # names of the jobs whose results it needs (they run first)
    inline: bool = False  # run in this process (a job whose work is already done: it only reads its results)


def _start_worker(events: Any, threads: int) -> None:
    global _events
    _events = events
    os.environ["OMP_NUM_THREADS"] = str(threads)
    # a worker shares the parent's terminal: only the parent draws bars (from the reports), so none of the
    # libraries' own (transformers loading a model, …) lands between them
    os.environ["TQDM_DISABLE"] = "1"
    import torch
    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar()
    torch.set_num_threads(threads)


def _run(name: str, fn: Callable[..., Any], kwargs: dict[str, Any]) -> Any:
    def report(phase: str, done: int, total: int, unit: str = "") -> None:
        _events.put((name, phase, done, total, unit))
    return fn(report=report, **kwargs)


def cpu_count() -> int:
    """Cores this process may use."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def run_jobs(jobs: list[Job], *, workers: int, log: Callable[[str], None] = print, bar: bool | None = None,
             heartbeat: float = 20.0) -> dict[str, Any]:
    """Run ``jobs`` (each after its ``after`` jobs) in ``workers`` single-threaded processes; returns
    ``{name: result}``. ``bar``: progress bars on a terminal (None), or lines (False)."""
    names = {j.name for j in jobs}
    for j in jobs:
        if missing := [a for a in j.after if a not in names]:
            raise ValueError(f"job {j.name!r} comes after unknown job(s) {missing}")
    ctx = get_context("spawn")
    events = ctx.Queue()
    results: dict[str, Any] = {}
    waiting = list(jobs)
    running: dict[Future, Job] = {}
    bars: dict[tuple[str, str], Progress] = {}
    last_line = time.monotonic()

    def logged(line: str) -> None:
        nonlocal last_line
        last_line = time.monotonic()
        log(line)

    def drain(timeout: float) -> None:
        try:
            event = events.get(timeout=timeout)
        except queue.Empty:
            return
        while True:
            name, phase, done, total, unit = event
            key = (name, phase)
            if name in results:  # a late event of a job already finished (and reported complete)
                pass
            elif key not in bars:
                for (n, p), b in list(bars.items()):  # a job's earlier phase is over
                    if n == name:
                        b.set(b.total)
                        b.close()
                        del bars[(n, p)]
                bars[key] = progress(f"{name}: {phase}", total, unit, log=logged, bar=bar, initial=done)
            if key in bars:
                b = bars[key]
                b.total = total
                b.set(done)
            try:
                event = events.get_nowait()
            except queue.Empty:
                return

    def quiet(phase: str, done: int, total: int, unit: str = "") -> None:
        pass

    while ready := [j for j in waiting if j.inline and all(a in results for a in j.after)]:
        for job in ready:  # done already: read its results here, without starting a worker
            waiting.remove(job)
            results[job.name] = job.fn(report=quiet, **job.kwargs)
    if not waiting:
        return results
    with ProcessPoolExecutor(workers, mp_context=ctx, initializer=_start_worker, initargs=(events, 1)) as pool:
        try:
            while waiting or running:
                for job in [j for j in waiting if all(a in results for a in j.after)]:
                    if job.inline:
                        waiting.remove(job)
                        results[job.name] = job.fn(report=quiet, **job.kwargs)
                        continue
                    if len(running) >= workers:
                        break
                    waiting.remove(job)
                    running[pool.submit(_run, job.name, job.fn, job.kwargs)] = job
                if not running:
                    if waiting:
                        raise RuntimeError(f"jobs {[j.name for j in waiting]} wait for jobs that never ran")
                    break
                done, _ = wait(list(running), timeout=0.5, return_when=FIRST_COMPLETED)
                drain(0.5)
                for fut in done:
                    job = running.pop(fut)
                    results[job.name] = fut.result()  # a job's error is raised here, with its traceback
                    for key in [k for k in bars if k[0] == job.name]:
                        b = bars.pop(key)
                        b.set(b.total)  # it returned, so its last phase is complete (its last event may lag)
                        b.close()
                if running and time.monotonic() - last_line >= heartbeat:
                    for (name, _), b in bars.items():
                        if any(j.name == name for j in running.values()):
                            b.heartbeat()
                    last_line = time.monotonic()
        except BaseException:
            for fut in running:
                fut.cancel()
            for proc in list(getattr(pool, "_processes", {}).values()):  # stop the jobs still running
                proc.terminate()
            raise
        finally:
            drain(0.1)
            for b in bars.values():
                b.close()
    return results
