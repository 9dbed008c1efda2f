"""The build-prefixes stage of a run (``jobs.build_prefixes``, the chart's ``buildPrefixes`` block): the
config's recorded trajectories → decision prefixes under ``RUN_ROOT/prefixes`` (:mod:`sapd.data.prefixes`),
then the initial student saved as checkpoint 0, which every later stage starts from. Both are skipped
when already committed, so the stage can be re-run at any time.
"""

from __future__ import annotations

import time
from typing import Callable

from sapd import checkpoints, layout
from sapd.config import RunConfig, write_run_config
from sapd.data.errors import report_lines
from sapd.data.prefixes import BuildResult, PrefixOptions, build_prefixes
from sapd.metrics import Metrics
from sapd.models.loading import load_causal_lm, load_tokenizer, pin_model_path


def prefix_options(cfg: RunConfig) -> PrefixOptions:
    d = cfg.data
    return PrefixOptions(history_length=d.history_length, full_history=d.full_history, prompt_style=d.prompt_style,
                         max_prompt_tokens=d.max_prompt_tokens, val_fraction=d.val_fraction, seed=d.split_seed)


def ensure_prefixes(cfg: RunConfig, tokenizer, log: Callable[[str], None] = print,
                    show_progress: bool = True) -> BuildResult:
    """The run's prefix build (a no-op when the same build is committed)."""
    d = cfg.data
    return build_prefixes(d.input, d.format, d.benchmark, layout.prefixes_dir(cfg.run_root), tokenizer,
                          opts=prefix_options(cfg), skip_invalid=d.skip_invalid, action_wording=d.action_wording,
                          log=log, show_progress=show_progress)


def ensure_initial_checkpoint(cfg: RunConfig, log: Callable[[str], None] = print) -> None:
    """Checkpoint 0 = the initial student, with its tokenizer (a no-op when committed)."""
    if checkpoints.is_committed(cfg.run_root, 0):
        return
    log(f"checkpoint 0 ← initial student {cfg.model.student}")
    student = pin_model_path(cfg.model.student, "model.student", log)
    model = load_causal_lm(student, dtype=cfg.model.dtype)
    checkpoints.save_checkpoint(cfg.run_root, 0, model, load_tokenizer(student), None,
                                {"source": cfg.model.student, "resolved": student})


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


def run(cfg: RunConfig, *, log: Callable[[str], None] = print, show_progress: bool = True,
        metrics: Metrics | None = None) -> BuildResult:
    """The whole stage as its Job runs it: write (or check) the run root's config, build the prefixes,
    print the summary, save checkpoint 0, record the stage's time."""
    write_run_config(cfg)
    t0 = time.perf_counter()
    result = ensure_prefixes(cfg, load_tokenizer(cfg.model.student), log, show_progress)
    for line in build_summary(result):
        log(line)
    ensure_initial_checkpoint(cfg, log)
    if metrics is not None and not result.skipped:
        metrics.observe_stage("build_prefixes", time.perf_counter() - t0)
    return result
