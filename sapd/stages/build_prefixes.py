"""The build-prefixes stage of a run (``sapd.jobs.build_prefixes``, the chart's ``buildPrefixes`` block): the
config's recorded trajectories → decision prefixes under ``RUN_ROOT/prefixes`` (:mod:`sapd.data.prefixes`),
then the initial student saved as checkpoint 0, which every later stage starts from. Both are skipped
when already committed, so the stage can be re-run at any time. Entry: :func:`run` (the stage interface
of :mod:`sapd.stages.context`).
"""

from __future__ import annotations

from typing import Callable

import torch

from sapd import checkpoints, layout
from sapd.config import RunConfig
from sapd.data.errors import report_lines
from sapd.data.prefixes import BuildResult, PrefixOptions, build_prefixes
from sapd.models.loading import load_causal_lm, load_tokenizer, pin_model_path
from sapd.progress import Progress
from sapd.stages.context import Outcome, StageContext, Step


def prefix_options(cfg: RunConfig) -> PrefixOptions:
    d = cfg.data
    return PrefixOptions(history_length=d.history_length, full_history=d.full_history, prompt_style=d.prompt_style,
                         max_prompt_tokens=d.max_prompt_tokens, val_fraction=d.val_fraction, seed=d.split_seed)


def ensure_prefixes(cfg: RunConfig, tokenizer, log: Callable[[str], None] = print,
                    show_progress: bool = True, progress: Progress | None = None) -> BuildResult:
    """The run's prefix build (a no-op when the same build is committed)."""
    d = cfg.data
    return build_prefixes(d.input, d.format, d.benchmark, layout.prefixes_dir(cfg.run_root), tokenizer,
                          opts=prefix_options(cfg), skip_invalid=d.skip_invalid, action_wording=d.action_wording,
                          log=log, show_progress=show_progress, progress=progress)


def ensure_initial_checkpoint(cfg: RunConfig, log: Callable[[str], None] = print) -> bool:
    """Checkpoint 0 = the initial student, with its tokenizer (a no-op when committed), in ``model.dtype``.
    In half precision its fp32 master is the student's own weights, loaded in float32 (exactly the file's
    values, whether it stores float32 or bfloat16), so training starts from them rather than from their
    rounding. → whether it was written now."""
    if checkpoints.is_committed(cfg.run_root, 0):
        return False
    log(f"checkpoint 0 ← initial student {cfg.model.student}")
    student = pin_model_path(cfg.model.student, "model.student", log)
    half = cfg.model.dtype != "float32"
    model = load_causal_lm(student, dtype="float32" if half else cfg.precision())
    master = checkpoints.master_shard(model) if half else None
    if half:  # the folder holds the master's rounding, for sampling and evaluation
        dtype = getattr(torch, cfg.model.dtype)
        model = model.to(dtype)
        model.config.dtype = dtype
    checkpoints.save_checkpoint(cfg.run_root, 0, model, load_tokenizer(student), None,
                                {"source": cfg.model.student, "resolved": student}, optimizer=master)
    return True


def build_summary(result: BuildResult) -> list[str]:
    """What a build read, refused, built and kept, as plain lines (the CLI and the Job print them). The
    counts add up: records read = valid + invalid by reason."""
    m = result.manifest
    s = m["stats"]
    invalid = m["invalid"]
    valid = m.get("valid_records", m["records_read"] - invalid["total"])
    lines = []
    if result.skipped:
        lines.append(f"{result.out}: already committed (build {m['build_id'][:12]}), nothing redone")
    lines.append(f"format: {m.get('format_read', m['format'])}")
    lines.append(f"files: {len(m['files'])}; records read: {m['records_read']} = {valid} valid + "
                 f"{invalid['total']} invalid")
    lines.append(f"trajectories: {s['trajectories']} (from the {valid} valid records)")
    if invalid["total"]:
        lines.append("invalid records by reason:")
        lines.extend(report_lines(invalid))
    limit = m["options"]["max_prompt_tokens"]
    lines.append(f"prefixes: {s['prefixes_built']} built, {s['filtered_too_long']} filtered "
                 f"({'no length limit' if limit is None else f'prompt > {limit} tokens'}), {s['kept']} kept; "
                 f"longest prompt {s['max_prompt_tokens_seen']} tokens")
    lines.append(f"split: train {s['train']} prefixes / {s['train_trajectories']} trajectories, "
                 f"val {s['val']} / {s['val_trajectories']}")
    if s["by_category"]:
        lines.append("by category: " + ", ".join(f"{k} {v}" for k, v in sorted(s["by_category"].items())))
    lines.append(f"committed: {result.out}")
    return lines


def run(ctx: StageContext, step: Step) -> Outcome:
    """The stage (every door calls it through :func:`sapd.stages.context.run_stage`): build the prefixes,
    log what the build read, refused and kept, save checkpoint 0. → the build."""
    cfg = ctx.cfg
    tokenizer = ctx.engines.tokenizer or load_tokenizer(cfg.model.student)
    if ctx.engines.keep:
        ctx.engines.tokenizer = tokenizer
    ctx.startup.mark("engines_ready")  # the tokenizer is what the build needs (checkpoint 0 is a copy, later)
    ctx.startup.mark("first_work")
    result = ensure_prefixes(cfg, tokenizer, ctx.log, progress=ctx.progress)
    for line in build_summary(result):
        ctx.log(line)
    saved = ensure_initial_checkpoint(cfg, ctx.log)
    stats = result.manifest["stats"]
    skipped = result.skipped and not saved
    return Outcome(f"prefixes: {stats['train']} train / {stats['val']} val "
                   f"({'already committed' if result.skipped else 'built'}); checkpoint 0 "
                   f"{'saved' if saved else 'committed'}", skipped, result)
