"""One step of a run in this process, as its Kubernetes Job runs it: the body of every stage door
(``python -m jobs.<stage>`` and ``sapd train-round``), so that each door is its flags and one call of
:func:`~sapd.run.job.stage_main`.

The body: the run config from ``--config``/``--run-root``; the stage's share of ``sapd check`` (unless
``--no-check``: :func:`sapd.run.check.preflight`); the metrics (served on ``/metrics`` by rank 0 while the
stage runs when ``SAPD_METRICS_PORT`` is set — the chart sets it for training — and pushed to the
Pushgateway at the end); progress (a bar on a terminal, a line every 30 s in a pod's log, plain lines
with ``--no-progress``); the run root's lease (:func:`stage_lease`); the stage through
:func:`sapd.stages.context.run_stage` (the config written or checked, the stage timed), its one-line
outcome; errors as one line and an exit code (:mod:`sapd.entry`). Under torchrun only rank 0 logs, holds
the lease and pushes.
"""

from __future__ import annotations

import argparse
import contextlib
import os
from typing import Any, Callable, Iterator

from sapd import lease
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
        with stage_lease(cfg, step.stage, prog, main=main, log=log, force=getattr(args, "force_takeover", False)):
            outcome = run_stage(stage, ctx, step)
        ctx.log(outcome.summary)
        if main:
            metrics.mark_success()
            metrics.push()

    return run_main(prog, body)


@contextlib.contextmanager
def stage_lease(cfg: RunConfig, stage: str, prog: str, *, main: bool, log: Callable[[str], None],
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
    claimant = lease.Claimant.this_process(prog)
    hint = "run it again with --force-takeover"
    if stage == "evaluate":
        if not claimant.local:
            lease.check_not_held(cfg.run_root, claimant)
        yield
        return
    with lease.holding(cfg.run_root, claimant, ttl_s=cfg.storage.lease_ttl_s, log=log, force=force, takeover_hint=hint,
                       give_back="mine" if claimant.local else "no"):
        yield
