"""One step of a run in this process, as its Kubernetes Job runs it: the body of every stage door
(``python -m sapd.jobs.<stage>`` and ``sapd train-round``), so that each door is its flags and one call of
:func:`~sapd.run.job.stage_main`.

The body: the run config from ``--config``/``--run-root``; the stage's share of ``sapd check`` (unless
``--no-check``: :func:`sapd.run.check.preflight`); the metrics (served on ``/metrics`` by rank 0 while the
stage runs when ``SAPD_METRICS_PORT`` is set — the chart sets it for training — and pushed to the
Pushgateway at the end, :func:`push_metrics`: a stage that found its work committed restates the
figures that the run which did the work pushed, so dashboards never lose a series); progress (a bar
on a terminal, a line every 30 s in a pod's log, plain lines with ``--no-progress``); the run root's
lease (:func:`stage_lease`); the stage through :func:`sapd.stages.context.run_stage` (the config written
or checked, the stage timed), its one-line outcome; errors as one line and an exit code (:mod:`sapd.entry`).
Under torchrun only rank 0 logs, holds the lease and pushes. The process's start-up (imports, models
loaded, engines ready, first work: :class:`~sapd.stages.context.Startup`) is one ``startup:`` line and the
gauge ``sapd_startup_seconds{phase}``.

**A worker that stays up** (:class:`Rounds`, the doors' ``--rounds N``: the cluster's persistent teacher-scores
and train workers): one process runs the stage for rounds K, K+1, … (N of them; 0: to the run's last round) with
one context whose engines it keeps — the teacher and the student sampler (new weights in place each round), or
the trainer with its optimizer state. Before its first round it loads what that round needs while the round's
input is still being made (a stage's ``prepare``: the scoring worker's teacher; the trainer's checkpoint k,
engine and optimizer state, once checkpoint k is committed). Before each round it waits until the round's input
is committed (:func:`sapd.run.plan.wait_for_input`: checkpoint k, or round k's scored manifest), polling every
``poll_seconds``, a line every 30 s, at most ``timeout_seconds`` (then exit 75: the pod is retried); a round
whose output is committed already is skipped, and a worker's own part that is written is not redone, so a
replacement of a killed worker picks up where it stopped and every round is committed once. The metrics are
pushed (and recorded) after every round; the lease is held for all of its rounds.
"""

from __future__ import annotations

import argparse
import contextlib
import os
from dataclasses import dataclass
from typing import Any, Callable, Iterator

from sapd import layout, lease, storage
from sapd.config import RunConfig
from sapd.entry import add_config_flags, config_from_args, log_line, run_main
from sapd.metrics import Metrics
from sapd.progress import Progress
from sapd.run import plan
from sapd.run.check import preflight
from sapd.stages.context import Engines, Stage, StageContext, Startup, Step, is_main_process, run_stage


@dataclass(frozen=True)
class Rounds:
    """The rounds a worker serves: ``first`` and ``count`` of them (0: through the run's last round), each
    once its input is committed (polled every ``poll_seconds``, for at most ``timeout_seconds``). With one
    round the worker keeps nothing; with more it keeps its engines from round to round."""

    first: int
    count: int = 1
    poll_seconds: float = 2.0
    timeout_seconds: float = 86400.0

    def steps(self, stage: str, cfg: RunConfig) -> list[Step]:
        if self.first >= cfg.train.rounds:  # round R (the last checkpoint): its validation alone, asked by name
            return [Step(stage, self.first)]  # type: ignore[arg-type]  # a stage name
        last = cfg.train.rounds if self.count == 0 else min(cfg.train.rounds, self.first + self.count)
        return [Step(stage, k) for k in range(self.first, last)]  # type: ignore[arg-type]  # a stage name

    @property
    def persistent(self) -> bool:
        return self.count != 1


def job_parser(prog: str, doc: str | None) -> argparse.ArgumentParser:
    """A stage door's parser: its docstring's first line as the description, and the run-config flags."""
    p = argparse.ArgumentParser(prog=prog, description=(doc or "").splitlines()[0] if doc else None)
    add_config_flags(p)
    return p


def add_rounds_flags(p: argparse.ArgumentParser) -> None:
    """``--round K`` and the flags of a worker that stays up for several rounds (:class:`Rounds`)."""
    p.add_argument("--round", type=int, required=True, metavar="K", help="the (first) round")
    p.add_argument("--rounds", type=int, default=None, metavar="N",
                   help="serve rounds K … K+N-1, each once its input is committed, keeping the models loaded "
                        "from round to round (0: through the run's last round); without it: round K, whose input "
                        "must be committed already")
    p.add_argument("--poll-seconds", type=float, default=2.0,
                   help="with --rounds: seconds between two checks of a round's input (default 2); around when "
                        "the previous round's wait predicts it, every tenth of that")
    p.add_argument("--input-timeout-seconds", type=float, default=86400.0,
                   help="with --rounds: give up (exit 75, retried) when a round's input is not committed after "
                        "this long (default 86400)")


def rounds_from_args(args: argparse.Namespace) -> Rounds | None:
    """The door's :class:`Rounds` (None without ``--rounds``: round K alone, no waiting)."""
    if args.rounds is None:
        return None
    if args.rounds < 0:
        raise ValueError(f"--rounds {args.rounds}: expected 0 (to the run's last round) or a positive count")
    return Rounds(args.round, args.rounds, args.poll_seconds, args.input_timeout_seconds)


def stage_main(prog: str, stage: Stage, args: argparse.Namespace, step: Step, *,
               options: Callable[[RunConfig], dict[str, Any]] | None = None, checks: str | None = None,
               rounds: Rounds | None = None, command: str | None = None) -> int:
    """Run ``step`` of ``stage`` as its Job does (see the module docstring) → the exit code. ``options``:
    the stage's options from the door's flags (``{stage name: Options}``, given the run config);
    ``checks``: which share of ``sapd check`` runs first (default: the step's stage's); ``rounds``: the
    rounds a persistent worker serves (from ``step.round`` on; default: ``step`` alone); ``command``: how
    the lease names this process, the command a person sees in ``ps`` or the pod spec (default: the door
    ``python -m sapd.jobs.<prog>``)."""

    def body() -> None:
        startup = Startup()
        startup.mark("imports")  # the door's module, and the stage's with it, are imported: main() runs
        cfg = config_from_args(args)
        main = is_main_process()
        log = log_line if main else (lambda line: None)
        if not getattr(args, "no_check", False):
            preflight(cfg, checks or step.stage, log=log)
        metrics = Metrics.from_env(step.stage.replace("-", "_"))
        if main and (port := os.environ.get("SAPD_METRICS_PORT")):
            # a long stage (training) serves /metrics while it runs, on the pod IP when the chart says
            metrics.serve(int(port), addr=os.environ.get("SAPD_METRICS_ADDR") or "0.0.0.0")
        progress = Progress.of(log, not getattr(args, "no_progress", False))
        persistent = rounds is not None and rounds.persistent  # keeps its engines from round to round
        # a persistent worker keeps every engine for the next round; its device is its own (no release)
        engines = Engines(keep=persistent, release=False, keep_trainer=persistent)
        ctx = StageContext(cfg, log=progress.log, progress=progress, metrics=metrics, engines=engines,
                           options=options(cfg) if options else {}, main=main, startup=startup)

        def report(line: str, seconds: dict[str, float]) -> None:
            ctx.log(line)
            metrics.record_startup(seconds)
        startup.report = report
        steps = rounds.steps(step.stage, cfg) if rounds is not None else [step]
        if persistent:
            assert rounds is not None
            ctx.log(f"{step.stage} worker: rounds {steps[0].round}–{steps[-1].round} of {cfg.train.rounds}, "
                    "each once its input is committed" if steps else
                    f"{step.stage} worker: no round from {rounds.first} on (the run has {cfg.train.rounds})")
        with stage_lease(cfg, step.stage, command or f"python -m sapd.jobs.{prog}", main=main, log=log,
                         force=getattr(args, "force_takeover", False)):
            last: tuple[Step, bool] | None = None  # the last round's step, and whether it was skipped
            prepared = False
            started = False  # this worker ran a round before this one
            expect: float | None = None  # how long the next input's wait is likely to take
            for s in steps:
                if rounds is not None:  # a worker started ahead of its input: wait for it, skip what is done
                    if plan.missing(cfg, s) is None:
                        ctx.log(f"stage {s}: committed, skipping")
                        last = (s, True)
                        continue

                    def wait(need: Step | None, s: Step = s, expect: float | None = None) -> float | None:
                        assert rounds is not None
                        waited = plan.wait_for_input(cfg, s, poll_seconds=rounds.poll_seconds, log=ctx.log,
                                                     timeout_seconds=rounds.timeout_seconds, need=need,
                                                     expect_seconds=expect)
                        if waited and "first_work" not in startup.seconds:
                            startup.waited += waited  # the start-up line says how much of it was waiting
                        return waited

                    if persistent and not prepared and (prepare := getattr(stage, "prepare", None)) is not None:
                        # load what the first round needs while its input is being made
                        prepare(ctx, s, lambda k: wait(plan.checkpoint_step(k)))
                    prepared = True
                    waited = wait(None, expect=expect)
                    if main and waited:
                        metrics.input_wait.labels(stage=s.stage.replace("-", "_")).observe(waited)
                    if waited is not None and started:
                        # the other stage's round, from this worker's commit to its input's: the next wait's
                        # likely length (the first wait holds the start-up, so it predicts nothing)
                        expect = waited
                started = True
                outcome = run_stage(stage, ctx, s)
                ctx.log(outcome.summary)
                last = (s, outcome.skipped)
                if main and persistent:  # every round's figures, as it commits
                    push_metrics(cfg, metrics, str(s), skipped=outcome.skipped, log=ctx.log)
            if main:  # its figures' record is written while the lease is held
                metrics.mark_success()
                if last is None:
                    metrics.push()
                else:
                    push_metrics(cfg, metrics, str(last[0]), skipped=last[1], log=ctx.log)

    return run_main(prog, body)


def push_metrics(cfg: RunConfig, metrics: Metrics, step: str, *, skipped: bool,
                 log: Callable[[str], None] = log_line) -> None:
    """Push a step's metrics to the Pushgateway (when one is set). A push replaces its group, so a step
    that did its work first records what it pushes in the run root (:func:`sapd.layout.pushed_metrics_uri`),
    and a step that found its work committed pushes that record again, with only the figures it set
    itself (its success time) on top — or, with no record (a stage committed by a process that died
    before its push), only those, leaving the rest of the group alone (:meth:`~sapd.metrics.Metrics.push_skip`)."""
    if not metrics.pushgateway:
        return
    uri = layout.pushed_metrics_uri(cfg.run_root, metrics.group, step)
    if not skipped:
        storage.write_text(uri, metrics.exposition())
        metrics.push()
        return
    committed = storage.read_text(uri) if storage.exists(uri) else None
    how = metrics.push_skip(committed)
    log(f"metrics: {step} was committed already: " + (
        f"restated its committed figures ({uri}) to the Pushgateway" if how == "restated" else
        "no committed figures recorded; pushed this run's own beside the group's others"))


@contextlib.contextmanager
def stage_lease(cfg: RunConfig, stage: str, command: str, *, main: bool, log: Callable[[str], None],
                force: bool = False) -> Iterator[None]:
    """How a stage door run alone takes part in the run root's lease (docs/FAULTS.md, "A second writer"):

    - a stage that writes the run's state (build-prefixes, teacher-scores, train) holds it for the stage:
      a door started by hand claims it as itself (and gives it back at the end); a stage Job of a release
      claims it as the release (``SAPD_LEASE_OWNER``, which the chart sets in every pod), sharing it with
      the release's driver and its other Jobs, and leaves it to them;
    - an evaluation only adds ``evals/K/`` files beside a running run (the CronJob does exactly that): it
      takes no lease; given an owner (``SAPD_LEASE_OWNER``) it refuses a root another owner holds.

    Either way another owner's live lease is refused with one line naming it (``--force-takeover`` takes it
    over). Only the main process of a torchrun group (rank 0) takes part."""
    if not main:
        yield
        return
    claimant = lease.Claimant.this_process(command)
    hint = "run it again with --force-takeover"
    if stage == "evaluate":
        if not claimant.local:
            lease.check_not_held(cfg.run_root, claimant)
        yield
        return
    with lease.holding(cfg.run_root, claimant, ttl_s=cfg.storage.lease_ttl_s, log=log, force=force, takeover_hint=hint,
                       give_back="mine" if claimant.local else "no"):
        yield
