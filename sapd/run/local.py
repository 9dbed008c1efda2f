"""The local executor (``sapd run CONFIG``): the run's plan (:mod:`sapd.run.plan`) with every stage run in
this process, with a local folder or ``s3://`` as the run root.

Each step is its stage's one entry, ``run(ctx, step)`` (:mod:`sapd.stages.context`), the function its
Kubernetes Job runs, with one context for the whole run: its :class:`~sapd.stages.context.Engines` keep
the frozen teacher loaded once, the student sampler up across rounds (taking each round's checkpoint
weights in place) and the trainer (model, fp32 master, optimizer state) from round to round, as the
cluster's persistent workers do. On one GPU they hand it over by phase (``Engines.handoffs`` records each
move): the engines sleep while the trainer trains (vLLM's sleep mode; HF models to host memory), and the
trainer waits in host memory, the allocator's cache emptied, while they sample and score.

Every stage checks what is committed first, so killing the process at any point and starting it again
resumes from the last committed piece and — since every stage reloads its inputs from the run root and is
seeded by (seed, round, worker), and the kept trainer holds exactly what its checkpoint holds — produces
the same result as an uninterrupted run.

The run holds the run root's lease (:mod:`sapd.lease`) from before its first write to its end: a second
``sapd run`` on the same root is refused with one line naming this one; a killed one is taken over at
once by the next ``sapd run`` on the same machine (its process is gone), and elsewhere once its lease
expires (``storage.lease_ttl_s``).
"""

from __future__ import annotations

from typing import Any, Callable

from sapd import layout, lease
from sapd.config import ConfigError, RunConfig, apply_storage_settings
from sapd.engines.base import EngineFactory
from sapd.method.objective import objective_of
from sapd.metrics import Metrics
from sapd.progress import Progress
from sapd.run import plan
from sapd.run.job import push_metrics
from sapd.stages import build_prefixes, teacher_scores, train
from sapd.stages.context import Engines, Stage, StageContext, run_stage, write_config_once

# the stage module of each step of a local run (the cluster's driver creates the Job of the same name instead).
# The local plan has no evaluate step: `sapd evaluate` plays the episodes, so `sapd run` loads no environment.
STAGES: dict[str, Stage] = {"build-prefixes": build_prefixes, "teacher-scores": teacher_scores, "train": train}


def run_pipeline(cfg: RunConfig, *, log: Callable[[str], None] = print, show_progress: bool = True,
                 engine_factory: EngineFactory | None = None, metrics: Metrics | None = None,
                 progress: Progress | None = None, options: dict[str, Any] | None = None,
                 force_takeover: bool = False) -> dict:
    """Run (or resume) the whole local pipeline. ``metrics`` (default: from the environment) records stage
    timings, tokens and loss terms, and is pushed to the Pushgateway after every stage when one is set
    (:func:`sapd.run.job.push_metrics`: a rerun with nothing left to do restates the run's figures);
    ``progress`` (default: a bar on a terminal, else a line every 30 s) counts the run's steps and each
    stage's work; ``options``: stage options by stage name (``engine_factory`` is the train stage's).
    Storage retries as ``cfg.storage`` says; the run root's lease is held throughout (``force_takeover``:
    even from a live holder)."""
    if objective_of(cfg.loss_cfg).data == "online":
        raise ConfigError(f"variant {cfg.variant} needs the environment: run it with "
                          f"`sapd online --method {cfg.loss_cfg.objective}`")
    apply_storage_settings(cfg)
    metrics = metrics or Metrics.from_env("pipeline")
    progress = progress or Progress.of(log, show_progress)
    stage_options = dict(options or {})
    if engine_factory is not None:
        stage_options["train"] = train.Options(engine_factory=engine_factory)
    # one process, one device: the teacher and the student sampler stay up across rounds and sleep while the
    # trainer trains; the trainer (model, fp32 master, optimizer state) stays too, in host memory while they run
    engines = Engines(keep=True, keep_trainer=True)
    ctx = StageContext(cfg, log=progress.log, progress=progress, metrics=metrics, engines=engines,
                       options=stage_options, main=True)
    claimant = lease.Claimant.this_process("sapd run")
    with lease.holding(cfg.run_root, claimant, ttl_s=cfg.storage.lease_ttl_s, log=progress.log, force=force_takeover,
                       takeover_hint="run `sapd run` again with --force-takeover",
                       give_back="mine" if claimant.local else "no"):
        write_config_once(ctx)  # also when every step is done: a different config is refused, not ignored
        steps = plan.steps(cfg)
        done = sum(plan.missing(cfg, s) is None for s in steps)
        ran = 0
        with progress.task(f"run {cfg.run_root}", total=len(steps), unit="step", initial=done) as bar:
            while (step := plan.next_step(cfg)) is not None:
                seen = len(engines.handoffs)
                outcome = run_stage(STAGES[step.stage], ctx, step)
                for h in engines.handoffs[seen:]:
                    if h.moved:
                        ctx.log(f"hand-off: {h.what} ({h.seconds:.1f}s)")
                ctx.log(outcome.summary)
                if (why := plan.missing(cfg, step)) is not None:  # a stage that returns must have committed
                    raise RuntimeError(f"{step}: finished without committing its output ({why})")
                ran += 1
                push_metrics(cfg, metrics, "run", skipped=False, log=ctx.log)
                bar.update()
                # the last validation step goes when the build has no validation prefixes
                bar.set_total(len(plan.steps(cfg)))
        metrics.mark_success()
        # a rerun over a finished run restates what the run pushed, rather than emptying its group (its record
        # is written while the lease is held)
        push_metrics(cfg, metrics, "run", skipped=ran == 0, log=ctx.log)
    return {"run_root": cfg.run_root, "checkpoints": layout.committed_checkpoints(cfg.run_root),
            "handoffs": engines.handoffs}
