"""The embedded default (``sapd demo`` / ``make demo``): the whole method on a 2-core CPU in about
six minutes, with the embedded TextWorld environment at both ends and none in the training loop.

It is the reproduction study's machinery (:mod:`sapd.study.run`) at demo size, one method, one seed:

1. **Games**: a seeded panel of training games in two short families (``coin_near``, ``coin_mid``:
   walk the route the task spells out, two or three rooms, and take the coin) and a disjoint held-out
   panel, generated once into ``OUT/textworld/``.
2. **Expert pool**: the environment's expert plays every training game; its won episodes are the
   offline pool (``OUT/pools/train.jsonl``, native JSONL with ``<think>…</think><action>…</action>``).
3. A byte-level BPE **tokenizer** trained on the pool's text; two small Qwen2 models from random
   weights: a **teacher** (hidden 256, 4 layers) SFT'd on the pool for several epochs, and a weaker
   **student** (hidden 128, 4 layers) SFT'd for a few — it knows the format, not yet the games.
4. **SAPD** rounds: the student samples G responses per recorded prefix, the frozen teacher scores
   them, the student is updated — no environment.
5. **Evaluation** of the student before, the student after SAPD and the teacher: greedy episodes on
   the held-out games (task success per family and overall) and the offline held-out action match
   (greedy action = the expert's, on the expert's held-out decisions).
6. **Reports**: ``OUT/REPORT.md`` (tables, stage timings), ``OUT/success.png`` (success by family),
   ``OUT/evaluation.json`` and the training report ``OUT/runs/sapd/report/training.png`` (loss terms,
   signals, stage timings).

Simplifications, on purpose: tiny models trained from scratch, a few dozen games per family, one seed
and a held-out panel of a few games per family (one game moves a family's success by a large step),
so the numbers show the method end to end, not the paper's effect sizes. ``sapd study`` runs the
comparisons (baselines, ablations, seeds) behind ``docs/results/``.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Callable

from sapd import checkpoints
from sapd.run.report import write_report
from sapd.study.run import Study, load_study_config

# SAPD with responses that have no action kept out of the step group: with Eq. 6 as written a tiny
# student's malformed samples score 0 while its well-formed ones score < 0, and SAPD then teaches it to
# drop the action (docs/results/STUDY.md); the loss is otherwise the paper's
DEMO_VARIANT = "sapd_exclude"
MODELS = ("student before", "student after SAPD", "teacher")

DEMO_CONFIG: dict[str, Any] = {
    "families": ["coin_near", "coin_mid"], "train_games": 30, "extra_games": 0, "heldout_games": 8,
    "student_shape": {"hidden_size": 128, "layers": 4, "heads": 4, "kv_heads": 2, "intermediate_size": 256},
    "teacher_shape": {"hidden_size": 256, "layers": 4, "heads": 4, "kv_heads": 2, "intermediate_size": 512},
    "student_epochs": 10.0, "teacher_epochs": 8.0, "sft_trajectories_per_round": 20,
    "rounds": 10, "trajectories_per_round": 4, "group_size": 4, "lr": 5e-5, "horizon": 12, "tables": [],
}


def _success_chart(evals: dict[str, dict], families: list[str], dest: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cats = [*families, "overall"]
    width = 0.8 / len(evals)
    fig, ax = plt.subplots(figsize=(1.8 * len(cats) + 2, 4))
    for i, (name, e) in enumerate(evals.items()):
        vals = [e["by_family"].get(c, 0.0) for c in families] + [e["success"]]
        ax.bar([x + (i - (len(evals) - 1) / 2) * width for x in range(len(cats))], vals, width, label=name)
    ax.set_xticks(range(len(cats)), cats)
    ax.set_ylim(0, 1.05)
    ax.set_ylabel("task success")
    ax.set_title("held-out TextWorld games (greedy)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(dest, dpi=110)
    plt.close(fig)


def _markdown(rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(rows[0]) + " |", "|" + "|".join("---" for _ in rows[0]) + "|"]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows[1:]])


def _plain(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
                     for r in rows)


def run_demo(out: Path, *, log: Callable[[str], None] = print, show_progress: bool = True,
             overrides: dict[str, Any] | None = None) -> dict:
    """Run (or resume: every stage reuses what is already in ``out``) the embedded demo. ``overrides``
    change :data:`DEMO_CONFIG` (fields of :class:`sapd.study.run.StudyConfig`). Returns the summary also
    written to ``out/demo-summary.json``."""

    t_start = time.perf_counter()
    cfg = load_study_config(None, {**DEMO_CONFIG, **(overrides or {})})
    study = Study(cfg, out, log=log, show_progress=show_progress)
    out = study.out
    timings: dict[str, float] = {}
    clock = [time.perf_counter()]

    def lap(stage: str) -> None:
        now = time.perf_counter()
        timings[stage] = timings.get(stage, 0.0) + now - clock[0]
        clock[0] = now

    panels = study.panels()
    log(f"[1/6] TextWorld games: {len(panels['train'])} training (seed {cfg.train_seed}+), {len(panels['heldout'])} "
        f"held-out (seed {cfg.heldout_seed}+), families {', '.join(cfg.families)} → {study.cache}")
    study.ensure_games()
    lap("generate games")
    log("[2/6] the expert plays the training games: the offline pool")
    pools = study.ensure_pools()
    lap("collect expert")
    log(f"[3/6] tokenizer, then teacher ({cfg.teacher_epochs:g} SFT epochs) and student "
        f"({cfg.student_epochs:g} epochs) from random weights")
    models = study.ensure_models(("student", "sft_teacher"))
    lap("tokenizer, teacher and student SFT")
    log(f"[4/6] SAPD: {cfg.rounds} rounds of {cfg.trajectories_per_round} trajectories' prefixes, G={cfg.group_size}, "
        "no environment")
    root = str(study.runs / "sapd")
    study.run_method("sapd", DEMO_VARIANT, "sft_teacher", 0, models, evaluate=False)
    checkpoints.export_model(root, str(study.models / "sapd_student"), checkpoint=cfg.rounds)
    lap("SAPD")
    log(f"[5/6] evaluation: greedy episodes on the {len(panels['heldout'])} held-out games")
    evals = {"student before": study.evaluate_model_dir("student", models["student"]),
             "student after SAPD": study.evaluate(root, cfg.rounds),
             "teacher": study.evaluate_model_dir("sft_teacher", models["sft_teacher"])}
    lap("evaluate (held-out games)")

    log("[6/6] reports")
    training_report = write_report(root)
    summary = {"benchmark": "textworld", "families": cfg.families, "heldout_seed": cfg.heldout_seed, "models": evals}
    (out / "evaluation.json").write_text(json.dumps(summary, indent=2) + "\n")
    _success_chart(evals, cfg.families, out / "success.png")
    lap("reports")
    seconds = time.perf_counter() - t_start
    rows = [["model", *cfg.families, "overall", "action match", "format valid", "invalid steps"]]
    for name, e in evals.items():
        rows.append([name, *(f"{e['by_family'].get(f, 0.0):.2f}" for f in cfg.families), f"{e['success']:.2f}",
                     f"{e['action_match']:.2f}", f"{e['format_valid']:.2f}", f"{e['invalid_step_rate']:.2f}"])
    md = ["# sapd demo: TextWorld end to end", "",
          f"Families {', '.join(cfg.families)}. Offline pool: the expert's {pools['train']['won']} won episodes "
          f"({pools['train']['decisions']} decisions) on {len(panels['train'])} training games; evaluation: greedy "
          f"episodes on {len(panels['heldout'])} held-out games (horizon {cfg.horizon}), and the offline action match "
          "on the expert's held-out decisions. Teacher and student are small Qwen2 models trained here from random "
          f"weights; SAPD (variant `{DEMO_VARIANT}`) ran {cfg.rounds} rounds from the student with the frozen "
          "teacher, no environment.", "",
          "## Held-out results", "", _markdown(rows), "", "![success by family](success.png)", "",
          "## Stage timings", "", _markdown([["stage", "seconds"], *([s, f"{v:.1f}"] for s, v in timings.items()),
                                             ["total", f"{seconds:.1f}"]]), "",
          "Training report (loss terms, signals, SAPD stage times): `runs/sapd/report/training.png`.", "",
          "## Models", "",
          "`models/student`, `models/sft_teacher` and `models/sapd_student` (the student after SAPD) are plain "
          "Hugging Face folders (weights, config, tokenizer, chat template): `AutoModelForCausalLM.from_pretrained` "
          "loads them, and they go as they are into a run config's `model.student` / `model.teacher`. Their run "
          "roots, with every checkpoint, are `runs/student`, `runs/sft_teacher` and `runs/sapd` "
          "(`sapd export RUN OUT [--checkpoint K]` copies any checkpoint out the same way).", ""]
    (out / "REPORT.md").write_text("\n".join(md))
    summary = {"evals": evals, "report": training_report, "timings": timings, "seconds": seconds,
               "files": {"report": str(out / "REPORT.md"), "evaluation": str(out / "evaluation.json"),
                         "chart": str(out / "success.png")}}
    (out / "demo-summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    log(f"\nheld-out TextWorld results (success by family, overall; offline action match):\n{_plain(rows)}")
    log(f"\nreport: {out / 'REPORT.md'}\nchart: {out / 'success.png'}\ntraining: {training_report[0]}\n"
        f"({seconds:.0f} s in all)")
    return summary
