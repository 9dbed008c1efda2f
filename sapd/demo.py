"""The embedded default (``sapd demo`` / ``make demo``): the whole offline method on one CPU in a few
minutes, from the shipped sample data only.

1. A byte-level BPE tokenizer trained on the samples, and decision prefixes for every sample file.
2. A tiny Qwen2 model (random init) → **teacher** by SFT on the ALFWorld expert trajectories for many
   rounds; a weaker **student** by SFT for a few rounds from the same init.
3. **SAPD** rounds: student samples G responses per prefix, the frozen teacher scores them, the
   student is updated — no environment anywhere.
4. Offline validation of student-before, student-after and teacher on held-out prefixes (format
   validity, recorded-action match), and the training report (PNG + JSON).

Simplifications, on purpose: the models are tiny and the data is 6 hand-written ALFWorld trajectories,
so the numbers show the machinery working, not the paper's effect sizes; task success needs an
environment, which the evaluation stage adds.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Callable

from sapd.cli import SAMPLE_DATA, SAMPLES

DEMO_MODEL = dict(hidden_size=128, layers=2, heads=4, kv_heads=2, intermediate_size=256)


def _data() -> dict:
    return {"input": str(SAMPLE_DATA / "alfworld_eto.json"), "format": "eto", "benchmark": "alfworld",
            "val_fraction": 0.2}


def run_demo(out: Path, *, log: Callable[[str], None] = print, show_progress: bool = True,
             teacher_rounds: int = 30, student_rounds: int = 12, sapd_rounds: int = 6) -> dict:
    from sapd import checkpoints
    from sapd.cli import print_build_summary
    from sapd.config import config_from_dict
    from sapd.data.prefixes import PrefixOptions, build_prefixes, read_prefixes
    from sapd.demo_tokenizer import build_tokenizer
    from sapd.models.loading import load_tokenizer
    from sapd.models.tiny import build_tiny_model
    from sapd.offline_eval import offline_eval
    from sapd.pipeline import run_pipeline
    from sapd.report import write_report

    t_start = time.perf_counter()
    out.mkdir(parents=True, exist_ok=True)
    tok_dir = out / "tokenizer"
    if (tok_dir / "tokenizer.json").is_file():
        tokenizer = load_tokenizer(str(tok_dir))
    else:
        log(f"[1/4] training a tokenizer on the shipped samples → {tok_dir}")
        tokenizer = build_tokenizer([(SAMPLE_DATA / f).read_text(encoding="utf-8") for f, _, _ in SAMPLES], tok_dir)
    for fname, fmt, bench in SAMPLES:
        dest = out / "prefixes" / Path(fname).stem
        log(f"[1/4] prefixes of {fname} ({fmt}, {bench}) → {dest}")
        result = build_prefixes(str(SAMPLE_DATA / fname), fmt, bench, str(dest), tokenizer, opts=PrefixOptions(),
                                skip_invalid=True, log=log, show_progress=show_progress)
        print_build_summary(result)

    init = out / "models" / "init"
    if not (init / "config.json").is_file():
        build_tiny_model(tokenizer, init, **DEMO_MODEL)
    sft = {"variant": "sft", "data": _data(), "model": {"student": str(init)},
           "train": {"trajectories_per_round": 8, "minibatch_prefixes": 8, "micro_batch_prefixes": 8, "lr": 3e-3}}
    log(f"[2/4] teacher: SFT for {teacher_rounds} rounds from a random tiny Qwen2")
    teacher_root = str(out / "teacher-sft")
    run_pipeline(config_from_dict({**sft, "run_root": teacher_root,
                                   "train": {**sft["train"], "rounds": teacher_rounds}}), log=log,
                 show_progress=show_progress)
    log(f"[2/4] student: SFT for {student_rounds} rounds from the same init (a weaker policy)")
    student_root = str(out / "student-sft")
    run_pipeline(config_from_dict({**sft, "run_root": student_root,
                                   "train": {**sft["train"], "rounds": student_rounds}}), log=log,
                 show_progress=show_progress)
    teacher = str(checkpoints.checkpoint_model_path(teacher_root, teacher_rounds))
    student = str(checkpoints.checkpoint_model_path(student_root, student_rounds))

    log(f"[3/4] SAPD: {sapd_rounds} rounds, G=4, no environment")
    sapd_root = str(out / "sapd")
    sapd_cfg = config_from_dict({
        "run_root": sapd_root, "variant": "sapd", "data": _data(), "model": {"student": student, "teacher": teacher},
        "sampling": {"group_size": 4, "max_new_tokens": 96, "prompts_per_batch": 8},
        "train": {"rounds": sapd_rounds, "trajectories_per_round": 2, "minibatch_prefixes": 8,
                  "micro_batch_prefixes": 4, "lr": 1e-3}})
    run_pipeline(sapd_cfg, log=log, show_progress=show_progress)

    log("[4/4] offline validation on held-out prefixes and the report")
    val = read_prefixes(str(out / "sapd" / "prefixes"), "val")
    evals = {}
    for name, root, k in (("student before", student_root, student_rounds), ("student after SAPD", sapd_root, sapd_rounds),
                          ("teacher", teacher_root, teacher_rounds)):
        model = checkpoints.load_checkpoint_model(root, k)
        evals[name] = offline_eval(model, tokenizer, val, "alfworld", max_new_tokens=96)
    report = write_report(sapd_root)
    summary = {"evals": evals, "report": report, "seconds": time.perf_counter() - t_start}
    (out / "demo-summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    log(f"\n{'':<20} {'format valid':>12} {'action match':>12} {'repeats':>8}   ({len(val)} held-out prefixes)")
    for name, e in evals.items():
        log(f"{name:<20} {e['format_valid']:>12.2f} {e['action_match']:>12.2f} {e['repeated_action']:>8.2f}")
    log(f"\nreport: {report[0]}\nsummary: {out / 'demo-summary.json'} ({summary['seconds']:.0f} s in all)")
    return summary
