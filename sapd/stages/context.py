"""The one interface of every stage: ``run(ctx, step) -> Outcome``.

Each stage module (:mod:`~sapd.stages.build_prefixes`, :mod:`~sapd.stages.teacher_scores`,
:mod:`~sapd.stages.train`, :mod:`~sapd.stages.evaluate`) exposes ``run(ctx: StageContext, step: Step)``, and
every door runs it through :func:`run_stage`: the local executor (``sapd run``, every step of the plan in
one process), the stage's Job (``python -m jobs.<stage>``) and ``sapd train-round``, both through
:func:`sapd.run.job.stage_main`. So the three run the same function per step and cannot differ in what
they record or commit.

- :class:`Step`: a step of the run's plan (:mod:`sapd.run.plan`): a stage and its round.
- :class:`StageContext`: the run config, where lines go (``log``), progress (:class:`~sapd.progress.Progress`),
  the metrics, the engines a stage may keep for the next round (:class:`Engines`: the local executor keeps
  the student sampler and the frozen teacher loaded across rounds; a Job keeps nothing), and the stage's
  own options from its door (``options``: a stage-specific dataclass by stage name, e.g. the
  teacher-scores worker).
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


@dataclass
class Engines:
    """What a stage may keep loaded for the next round. Empty in a Job (the process ends with the stage);
    the local executor passes one instance to every step, so the frozen teacher loads once per run and the
    student sampler takes each round's weights in place (:func:`sapd.stages.teacher_scores.student_generator`)."""

    keep: bool = False  # the caller keeps them for a later step (the local executor); a Job does not
    tokenizer: Any = None  # the student's (= the teacher's) tokenizer
    student: Any = None  # sapd.models.generation.Generator: round k's sampler
    teacher: Any = None  # sapd.stages.teacher_scores.TeacherScorer: the frozen teacher
    teacher_path: str | None = None  # the teacher folder it was loaded from (a run root pinned to one checkpoint)


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


class Stage(Protocol):
    """A stage module."""

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
