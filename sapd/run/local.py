"""The local executor (``sapd run CONFIG``): the run's plan (:mod:`sapd.run.plan`) with every stage run in
this process, with a local folder or ``s3://`` as the run root.

Every stage checks what is committed first, so killing the process at any point and starting it
again resumes from the last committed piece and — since every stage reloads its inputs from the run
root and is seeded by (seed, round, worker) — produces the same result as an uninterrupted run. The
frozen teacher is loaded once for the whole run; the student sampler is built once and takes each
round's checkpoint weights in place.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable

from sapd import layout
from sapd.config import ConfigError, RunConfig, write_run_config
from sapd.data.scored import commit_round
from sapd.metrics import Metrics
from sapd.models.loading import check_same_tokenizer, load_tokenizer, pin_model_path
from sapd.run import plan
from sapd.stages import build_prefixes, teacher_scores
from sapd.stages.train import EngineFactory, run_train_stage


def run_pipeline(cfg: RunConfig, *, log: Callable[[str], None] = print, show_progress: bool = True,
                 engine_factory: EngineFactory | None = None, metrics: Metrics | None = None) -> dict:
    """Run (or resume) the whole local pipeline. ``metrics`` (default: from the environment) records stage
    timings, tokens and loss terms, and is pushed to the Pushgateway after every stage when one is set."""
    root = cfg.run_root
    if cfg.loss_cfg.objective == "grpo":
        raise ConfigError("variant grpo needs the environment: run it with `sapd online --method grpo`")
    metrics = metrics or Metrics.from_env("pipeline")
    write_run_config(cfg)
    tokenizer = load_tokenizer(cfg.model.student)
    scoring_cfg = cfg  # the teacher pinned once: a run root given as the teacher stays at one checkpoint
    if cfg.loss_cfg.objective != "sft":
        teacher_dir = pin_model_path(cfg.model.teacher, "model.teacher", log)
        scoring_cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, teacher=teacher_dir))
        check_same_tokenizer(tokenizer, load_tokenizer(teacher_dir))
    teacher: teacher_scores.TeacherScorer | None = None
    generator = None  # the student engine, kept across rounds (new weights in place)
    while (step := plan.next_step(cfg)) is not None:
        t0 = time.perf_counter()
        if step.stage == "build-prefixes":
            build = build_prefixes.ensure_prefixes(cfg, tokenizer, log, show_progress)
            log(f"prefixes: {build.manifest['stats']['train']} train / {build.manifest['stats']['val']} val "
                f"({'already committed' if build.skipped else 'built'}, {time.perf_counter() - t0:.1f}s)")
            if not build.skipped:
                metrics.observe_stage("build_prefixes", time.perf_counter() - t0)
            build_prefixes.ensure_initial_checkpoint(cfg, log)
        elif step.stage == "teacher-scores":
            k = step.round
            assert k is not None
            teacher = teacher or teacher_scores.teacher_scorer(scoring_cfg, tokenizer)
            generator = teacher_scores.student_generator(cfg, k, tokenizer, reuse=generator)
            for w in range(cfg.workers):
                result = teacher_scores.run_worker(scoring_cfg, k, w, generator, teacher, tokenizer, log=log,
                                                   show_progress=show_progress)
                teacher_scores.record_metrics(metrics, k, result)
            commit_round(cfg, k)
            teacher_scores.release_student(generator)  # the engine stays up; training gets the device
        elif step.stage == "train":
            assert step.round is not None
            run_train_stage(cfg, step.round, engine_factory=engine_factory, log=log, show_progress=show_progress,
                            on_step=lambda rec: metrics.record_step(rec, cfg.sampling.group_size))
            metrics.observe_stage("train", time.perf_counter() - t0)
            log(f"round {step.round}: checkpoint {step.round + 1} committed")
        if (why := plan.missing(cfg, step)) is not None:  # a stage that returns must have committed its output
            raise RuntimeError(f"{step}: finished without committing its output ({why})")
        metrics.push()
    metrics.mark_success()
    metrics.push()
    return {"run_root": root, "checkpoints": layout.committed_checkpoints(root)}
