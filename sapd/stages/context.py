"""The one interface of every stage: ``run(ctx, step) -> Outcome``.

Each stage module (:mod:`~sapd.stages.build_prefixes`, :mod:`~sapd.stages.teacher_scores`,
:mod:`~sapd.stages.train`, :mod:`~sapd.stages.evaluate`) exposes ``run(ctx: StageContext, step: Step)``, and
every door runs it through :func:`run_stage`: the local executor (``sapd run``, every step of the plan in
one process), the stage's Job (``python -m sapd.jobs.<stage>``) and ``sapd train-round``, both through
:func:`sapd.run.job.stage_main`. So the three run the same function per step and cannot differ in what
they record or commit.

- :class:`Step`: a step of the run's plan (:mod:`sapd.run.plan`): a stage and its round.
- :class:`StageContext`: the run config, where lines go (``log``), progress (:class:`~sapd.progress.Progress`),
  the metrics, the engines a stage may keep for the next round (:class:`Engines`: the local executor keeps
  the student sampler and the frozen teacher loaded across rounds; a persistent worker keeps those, or the
  trainer with its optimizer state; a one-round Job keeps nothing), the process's start-up clock
  (:class:`Startup`), and the stage's own options from its door (``options``: a stage-specific dataclass by
  stage name, e.g. the teacher-scores worker).
- :func:`run_stage`: the one place that writes (or checks) the run root's config
  (:func:`write_config_once`), times the stage and records that time.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Literal, Protocol

from sapd.config import RunConfig, write_run_config
from sapd.metrics import Metrics
from sapd.progress import Progress

StageName = Literal["build-prefixes", "teacher-scores", "train", "evaluate"]
STAGE_NAMES: tuple[StageName, ...] = ("build-prefixes", "teacher-scores", "train", "evaluate")


@dataclass(frozen=True)
class Step:
    """One step of the plan: ``stage`` for ``round`` (None for build-prefixes; for evaluate, the checkpoint,
    None for the newest committed one)."""

    stage: StageName
    round: int | None = None

    def __str__(self) -> str:
        return self.stage if self.round is None else f"{self.stage}-r{self.round}"


@dataclass(frozen=True)
class HandOff:
    """The device changing hands between phases on a GPU that sampling, scoring and training share (``sapd
    run``): what moved (``student engine released``, ``trainer to host memory``, …), in which round, when it
    started (wall clock) and how long it took, and whether anything moved (nothing does on a CPU)."""

    round: int
    what: str
    started_at: float
    seconds: float
    moved: bool = True


@dataclass
class Engines:
    """What a stage may keep loaded for the next round. Empty in a one-round Job (the process ends with the
    stage); the local executor and a persistent worker pass one instance to every step, so the frozen
    teacher loads once per run and the student sampler takes each round's weights in place
    (:func:`sapd.stages.teacher_scores.student_generator`); a persistent trainer keeps its model, engine and
    optimizer state from round to round (:class:`sapd.stages.train.Trainer`)."""

    keep: bool = False  # the caller keeps them for a later step (the local executor, a persistent worker)
    # the student sampler gives the device back between rounds (sapd run: training runs on the same device);
    # a persistent scoring worker has its own device and keeps its engine awake
    release: bool = True
    keep_trainer: bool = False  # the train stage keeps its Trainer for the next round (a persistent trainer)
    tokenizer: Any = None  # the student's (= the teacher's) tokenizer
    student: Any = None  # sapd.models.generation.Generator: round k's sampler
    student_checkpoint: int | None = None  # the checkpoint the sampler holds
    teacher: Any = None  # sapd.stages.teacher_scores.TeacherScorer: the frozen teacher
    teacher_path: str | None = None  # the teacher folder it was loaded from (a run root pinned to one checkpoint)
    trainer: Any = None  # sapd.stages.train.Trainer: the model, engine and state at one checkpoint
    # local copies of checkpoints this process downloaded, by index (a persistent worker removes the old ones)
    fetched: dict[int, Any] = field(default_factory=dict)
    released: bool = False  # the kept student and teacher gave the device back (to the trainer) last round
    handoffs: list[HandOff] = field(default_factory=list)  # every hand-off of the device, in order

    def hand_off(self, k: int, what: str, fn: Callable[[], Any]) -> Any:
        """Run one hand-off (``fn``, which returns whether anything moved; None counts as moved), timed and
        recorded in :attr:`handoffs`."""
        started, t0 = time.time(), time.perf_counter()
        moved = fn()
        self.handoffs.append(HandOff(k, what, started, time.perf_counter() - t0, moved is not False))
        return moved


def process_started_at() -> float:
    """The wall-clock time this process started (Linux: /proc, to 10 ms; elsewhere: when this module was
    imported, which misses the interpreter's own start)."""
    try:
        ticks = os.sysconf("SC_CLK_TCK")
        with open("/proc/self/stat") as f:
            started = int(f.read().rsplit(")", 1)[1].split()[19]) / ticks  # field 22: starttime since boot
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return time.time() - (uptime - started)
    except (OSError, ValueError, IndexError):
        return _IMPORTED_AT


_IMPORTED_AT = time.time()
STARTUP_PHASES = ("imports", "models_loaded", "engines_ready", "first_work")


@dataclass
class Startup:
    """How long a stage process took to get to work, once per process: seconds from the process's start to
    the end of its imports (the door's ``main``), to its models loaded (weights in memory), to its engines
    ready (the vLLM engines started, the training engine built and its optimizer state restored), and to its
    first work (the first prefix sampled, the first π_old forward). :meth:`mark` records a phase the first
    time it is reached; reaching ``first_work`` calls ``report`` with the line
    (``startup: imports 2.1s, models loaded 5.3s, engines ready 5.3s, first work 5.4s``) and the figures
    (the door logs the line and sets ``sapd_startup_seconds``). A phase never reached (everything was
    committed) is left out."""

    started_at: float = field(default_factory=process_started_at)
    seconds: dict[str, float] = field(default_factory=dict)
    report: Callable[[str, dict[str, float]], None] | None = None
    waited: float = 0.0  # of it, seconds a persistent worker waited for its first round's input (said in the line)

    def mark(self, phase: str) -> None:
        if phase not in STARTUP_PHASES:
            raise ValueError(f"unknown start-up phase {phase!r}; expected one of {STARTUP_PHASES}")
        if phase in self.seconds:
            return
        now = time.time() - self.started_at
        for earlier in STARTUP_PHASES[:STARTUP_PHASES.index(phase)]:  # a phase implies the ones before it
            self.seconds.setdefault(earlier, now)
        self.seconds[phase] = now
        if phase == "first_work" and self.report is not None:
            self.report(self.line(), dict(self.seconds))

    def line(self) -> str:
        waited = f"; {self.waited:.1f}s of it waiting for the first input" if self.waited else ""
        return "startup: " + ", ".join(f"{p.replace('_', ' ')} {self.seconds[p]:.1f}s" for p in STARTUP_PHASES
                                       if p in self.seconds) + f" (since the process started{waited})"


@dataclass
class Outcome:
    """What a stage did, for its door: one line to log, whether everything was committed already."""

    summary: str
    skipped: bool = False  # its output was committed already: nothing redone
    value: Any = None  # the stage's own result (the build, the workers' results, the commit marker, the evaluation)


def is_main_process() -> bool:
    """Rank 0 of a torchrun launch (``RANK``), or a plain process: the one that logs, writes and pushes."""
    return int(os.environ.get("RANK", "0")) == 0


@dataclass
class StageContext:
    cfg: RunConfig
    log: Callable[[str], None] = print
    progress: Progress = field(default_factory=lambda: Progress(mode="lines"))
    metrics: Metrics = field(default_factory=lambda: Metrics.from_env("sapd"))
    engines: Engines = field(default_factory=Engines)
    # what a door chose beyond the config, by stage name (each stage's own ``Options`` dataclass): the
    # teacher-scores worker, the train engine, the evaluation panel; a stage without an entry uses its defaults
    options: dict[str, Any] = field(default_factory=dict)
    main: bool = field(default_factory=is_main_process)  # this process logs, writes the config and pushes metrics
    config_written: bool = False  # write_run_config ran in this context (once per process is enough)
    startup: Startup = field(default_factory=Startup)  # the stages mark its phases; the door reports it


class Stage(Protocol):
    """A stage module. It may also define ``prepare(ctx, step, wait_for_checkpoint)``: what a persistent
    worker loads while it waits for its first round's input (:func:`sapd.run.job.stage_main`), given a
    function that waits until checkpoint k is committed."""

    def run(self, ctx: StageContext, step: Step) -> Outcome: ...


def write_config_once(ctx: StageContext) -> None:
    """The run root's resolved config, written by the first stage (or checked: a run root holding a
    different one is refused before any work), once per context, by the main process."""
    if ctx.main and not ctx.config_written:
        write_run_config(ctx.cfg)
        ctx.config_written = True


def run_stage(stage: Stage, ctx: StageContext, step: Step) -> Outcome:
    """Run one step: :func:`write_config_once`, then the stage; its wall time is recorded
    (``sapd_stage_duration_seconds{stage=…}``) unless it found everything committed."""
    write_config_once(ctx)
    t0 = time.perf_counter()
    outcome = stage.run(ctx, step)
    if not outcome.skipped and ctx.main:
        ctx.metrics.observe_stage(step.stage.replace("-", "_"), time.perf_counter() - t0)
    return outcome
