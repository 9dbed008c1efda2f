"""One step of a run in this process, as its Kubernetes Job runs it: the body of every stage door
(``python -m jobs.<stage>`` and ``sapd train-round``), so that each door is its flags and one call of
:func:`~sapd.run.job.stage_main`.

The body: the run config from ``--config``/``--run-root``; the stage's share of ``sapd check`` (unless
``--no-check``: :func:`sapd.run.check.preflight`); the metrics (served on ``/metrics`` by rank 0 while the
stage runs when ``SAPD_METRICS_PORT`` is set — the chart sets it for training — and pushed to the
Pushgateway at the end); progress (a bar on a terminal, a line every 30 s in a pod's log, plain lines
with ``--no-progress``); the stage through :func:`sapd.stages.context.run_stage` (the config written or
checked, the stage timed), its one-line outcome; errors as one line and an exit code (:mod:`sapd.entry`).
Under torchrun only rank 0 logs and pushes.
"""

from __future__ import annotations

import argparse
import os
from typing import Any, Callable

from sapd.config import RunConfig
from sapd.entry import add_config_flags, config_from_args, log_line, run_main
from sapd.metrics import Metrics
from sapd.progress import Progress
from sapd.run.check import preflight
from sapd.stages.context import Stage, StageContext, Step, is_main_process, run_stage


def job_parser(prog: str, doc: str | None) -> argparse.ArgumentParser:
    """A stage door's parser: its docstring's first line as the description, and the run-config flags."""
    p = argparse.ArgumentParser(prog=prog, description=(doc or "").splitlines()[0] if doc else None)
    add_config_flags(p)
    return p


def stage_main(prog: str, stage: Stage, args: argparse.Namespace, step: Step, *,
               options: Callable[[RunConfig], dict[str, Any]] | None = None, checks: str | None = None) -> int:
    """Run ``step`` of ``stage`` as its Job does (see the module docstring) → the exit code. ``options``:
    the stage's options from the door's flags (``{stage name: Options}``, given the run config);
    ``checks``: which share of ``sapd check`` runs first (default: the step's stage's)."""

    def body() -> None:
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
        ctx = StageContext(cfg, log=progress.log, progress=progress, metrics=metrics,
                           options=options(cfg) if options else {}, main=main)
        outcome = run_stage(stage, ctx, step)
        ctx.log(outcome.summary)
        if main:
            metrics.mark_success()
            metrics.push()

    return run_main(prog, body)
