"""The embedded default (``sapd demo`` / ``make demo``): the powered study's setting
(``docs/results/ANALYSIS_PLAN.md``) at demo size on a 2-core CPU, with the embedded TextWorld environment
at both ends and none in the training loop. It shows what the study found, on one seed: the student
before, SAPD and the baseline the study compares it against (OPD+Rule), SFT on the logs, and the teacher,
on the same held-out games and decisions, with paired differences and a plain reading.

1. **Games** (seeded, disjoint panels): pre-training games of a short coin route (``coin_near``), training
   games and held-out test games of two longer ones (``coin_mid``, ``coin``), generated once into
   ``OUT/textworld/``.
2. **Pools**: the environment's expert plays them. The offline logs every method learns from are an
   **ε-noisy expert** on the training games (with probability ε it takes a random other admissible
   action, then re-plans), and its thoughts do not name the action; the teacher is trained on the
   *clean* expert there. That is the teacher–prefix mismatch SAPD is meant for.
3. **Models**: a byte-level BPE tokenizer and two small Qwen2 models from random weights, a **student**
   SFT'd on ``coin_near`` only (it knows the format, not the longer routes) and a **teacher** SFT'd on the
   clean expert's training games as well (the powered study's teacher recipe: same games, same seeds).
4. **Reference rows**: the student and the teacher on the held-out games, so the report reads the premise
   (is the teacher better?) before any arm. Steps 1–4 are the set-up; they are cached in ``OUT``.
5. **Training from the student on the noisy logs**, no environment: SFT (imitate the logs), OPD+Rule
   (the study's baseline: the teacher's token-level log-ratio on the student's own samples) and SAPD with
   the no-action treatment the study chose, each at the learning rate the study's validation sweep chose.
6. **Report**: ``OUT/REPORT.md`` (the table with 95 % intervals, each arm's paired difference to the
   student before and to the baseline, and what the numbers mean), ``OUT/success.png``,
   ``OUT/evaluation.json``, the SAPD training report ``OUT/runs/demo-sapd/report/training.png`` and the
   SAPD student as a plain Hugging Face folder, ``OUT/sapd_student``.

Every step is a unit: a rerun of an interrupted demo continues where it stopped.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Callable

from research.powered import PoweredConfig, PoweredStudy, wilson_interval
from research.powered_report import _outcomes
from research.stats import paired_bootstrap
from sapd import checkpoints
from sapd.config import apply_overlay
from sapd.run.report import write_report

# fields of research.powered.PoweredConfig: the powered study's setting (experiments/powered.yaml) with
# its student and teacher recipes unchanged — the same games, pools and seeds give the same models — and a
# smaller test panel (its first 15 games per family), 16 rounds instead of 24 and one seed. The student's
# 250 pre-training games matter: on 100 it writes malformed responses at T = 1 often enough (the study's gate
# failed at 0.945 well-formed) that OPD+Rule at the study's learning rate collapsed in a trial run
DEMO_CONFIG: dict[str, Any] = {
    "pretrain_family": "coin_near", "families": ["coin_mid", "coin"],
    "pretrain_games": 250, "teacher_pretrain_games": 100, "tokenizer_pretrain_games": 100,
    "train_games": 75, "val_games": 0, "test_games": 15,
    "noise": 0.25, "thought": "observe", "history_length": 2, "horizon": 12,
    "student_shape": {"hidden_size": 256, "layers": 4, "heads": 4, "kv_heads": 2, "intermediate_size": 512},
    "teacher_shape": {"hidden_size": 256, "layers": 4, "heads": 4, "kv_heads": 2, "intermediate_size": 512},
    "student_epochs": 10.0, "teacher_epochs": 10.0,
    "group_size": 8, "temperature": 1.0, "max_new_tokens": 64,
    "rounds": 16, "trajectories_per_round": 4, "minibatch_prefixes": 8, "warmup_steps": 5,
    "repetition_weight": 0.0,
}

# (label, variant, loss, lr): each arm at the learning rate the powered study's validation sweep chose
# (experiments/powered/selection.json); SAPD with the no-action treatment chosen there
BASELINE = "opd_rule"
DEMO_ARMS: dict[str, tuple[str, str, dict[str, Any], float]] = {
    "sft": ("SFT on the logs", "sft", {}, 3e-4),
    "opd_rule": ("OPD+Rule (baseline)", "opd_rule", {}, 3e-4),
    "sapd": ("SAPD", "sapd", {"no_action_step": "penalty"}, 1e-4),
}
BEFORE, TEACHER = "student before", "teacher"


def _markdown(rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(rows[0]) + " |", "|" + "|".join("---" for _ in rows[0]) + "|"]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows[1:]])


def _plain(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
                     for r in rows)


def _chart(rows: dict[str, dict[str, Any]], dest: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(rows)
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    for ax, key, title in ((axes[0], "success", "task success (held-out games)"),
                           (axes[1], "action_match", "action match (held-out decisions)")):
        vals = [rows[n][key] for n in names]
        los = [rows[n][key] - rows[n][f"{key}_ci"][0] for n in names]
        his = [rows[n][f"{key}_ci"][1] - rows[n][key] for n in names]
        ax.bar(range(len(names)), vals, yerr=[los, his], capsize=4,
               color=["#999999", *["#4c72b0"] * (len(names) - 2), "#55a868"])
        ax.set_xticks(range(len(names)), names, rotation=20, ha="right", fontsize=8)
        ax.set_ylim(0, 1.05)
        ax.set_title(title + " — bars: 95 % Wilson", fontsize=9)
    fig.tight_layout()
    fig.savefig(dest, dpi=110)
    plt.close(fig)


def _diff(a: dict[str, Any], b: dict[str, Any], key: str) -> dict[str, float]:
    """a − b with a bootstrap 95 % interval over the units both were evaluated on (paired)."""
    return paired_bootstrap(_outcomes([{"seed": 0, "eval": a}], key), _outcomes([{"seed": 0, "eval": b}], key))


def _reading(name: str, d: dict[str, float], what: str) -> str:
    span = f"{d['diff'] * 100:+.0f} points [{d['lo'] * 100:+.0f}, {d['hi'] * 100:+.0f}]"
    if d["lo"] > 0:
        return f"{name}: {what} {span}, better (the interval is above 0)"
    if d["hi"] < 0:
        return f"{name}: {what} {span}, worse (the interval is below 0)"
    return f"{name}: {what} {span}, not separable from 0 at this size"


def demo_config(overrides: dict[str, Any] | None = None) -> PoweredConfig:
    """The demo's setting: :data:`DEMO_CONFIG` with ``overrides`` (fields of
    :class:`research.powered.PoweredConfig`) on top; an unknown or mistyped field is a ``ConfigError``."""
    cfg = PoweredConfig()
    apply_overlay(cfg, {**DEMO_CONFIG, **(overrides or {})})
    return cfg


def run_demo(out: Path, *, log: Callable[[str], None] = print, show_progress: bool = True,
             overrides: dict[str, Any] | None = None) -> dict:
    """Run (or resume: every unit reuses what is already in ``out``) the embedded demo. ``overrides``
    change :data:`DEMO_CONFIG` (fields of :class:`research.powered.PoweredConfig`). Returns the summary
    also written to ``out/demo-summary.json``."""
    t_start = time.perf_counter()
    cfg = demo_config(overrides)
    out = Path(out).resolve()
    study = PoweredStudy(cfg, out / "units", out, log=log)
    timings: dict[str, float] = {}
    clock = [time.perf_counter()]

    def lap(stage: str) -> None:
        now = time.perf_counter()
        timings[stage] = timings.get(stage, 0.0) + now - clock[0]
        clock[0] = now

    panels = study.panels()
    log(f"[1/6] TextWorld games: {len(panels['pretrain'])} pre-training ({cfg.pretrain_family}), "
        f"{len(panels['train'])} training and {len(panels['test'])} held-out ({', '.join(cfg.families)}) → {out}")
    study.ensure_games()
    lap("set-up: games")
    log(f"[2/6] the expert plays them; the offline logs are the ε = {cfg.noise:g} noisy expert on the training games")
    pools = study.ensure_pools()
    lap("set-up: expert pools")
    log(f"[3/6] tokenizer, student ({cfg.student_epochs:g} SFT epochs on {cfg.pretrain_family}) and teacher "
        f"({cfg.teacher_epochs:g} epochs, clean expert) from random weights")
    study.ensure_models()
    lap("set-up: tokenizer, student and teacher")
    log(f"[4/6] the student before and the teacher on the {len(panels['test'])} held-out games")
    before = study.evaluate_reference("reference-student", "student", "test")["eval"]
    teacher = study.evaluate_reference("reference-teacher", "teacher", "test")["eval"]
    lap("set-up: evaluate student and teacher")
    log(f"      action match: student {before['action_match']:.2f}, teacher {teacher['action_match']:.2f}; "
        f"success: student {before['success']:.2f}, teacher {teacher['success']:.2f}")
    teacher_gap = _diff(teacher, before, "per_decision")
    evals: dict[str, dict[str, Any]] = {}
    units: dict[str, dict[str, Any]] = {}
    log(f"[5/6] from the student, on the noisy logs, no environment: {', '.join(a[0] for a in DEMO_ARMS.values())} "
        f"({cfg.rounds} rounds of {cfg.trajectories_per_round} trajectories' prefixes, G = {cfg.group_size})")
    for name, (label, variant, loss, lr) in DEMO_ARMS.items():
        units[label] = study.train_and_validate(f"demo-{name}", variant, loss, lr, 0, panel="test")
        evals[label] = units[label]["eval"]
        lap(f"train + evaluate {name}")
    evals = {BEFORE: before, **evals, TEACHER: teacher}

    log("[6/6] reports")
    sapd_root = str(study.runs / "demo-sapd")
    training_report = write_report(sapd_root)
    checkpoints.export_model(sapd_root, str(out / "sapd_student"), checkpoint=cfg.rounds)
    rows: dict[str, dict[str, Any]] = {}
    for name, ev in evals.items():
        n_games, n_dec = len(ev["per_game"]), ev["decisions"]
        rows[name] = {"success": ev["success"], "success_ci": wilson_interval(ev["success"], n_games),
                      "action_match": ev["action_match"], "action_match_ci": wilson_interval(ev["action_match"], n_dec),
                      "tll_sum": ev["tll_sum"], "format_valid": ev["format_valid"], "games": n_games,
                      "decisions": n_dec}
    base_label = DEMO_ARMS[BASELINE][0]
    readings = [_reading(f"{TEACHER} − {BEFORE}", teacher_gap, "action match")
                + ("" if teacher_gap["lo"] > 0 else " — the teacher is not clearly better than the student here, "
                   "so no arm that learns from it can be expected to gain (the premise SAPD needs does not hold)")]
    for name in [a[0] for a in DEMO_ARMS.values()]:
        for ref in (BEFORE, base_label):
            if ref == name:
                continue
            for key, unit_key, what in (("success", "per_game", "success"),
                                        ("action_match", "per_decision", "action match")):
                d = _diff(evals[name], evals[ref], unit_key)
                rows[name][f"{key}_vs_{'before' if ref == BEFORE else 'baseline'}"] = d
                readings.append(_reading(f"{name} − {ref}", d, what))
    _chart(rows, out / "success.png")
    lap("reports")
    seconds = time.perf_counter() - t_start
    setup_s = sum(v for k, v in timings.items() if k.startswith("set-up"))
    table = [["model", "success [95 % CI]", "action match [95 % CI]", "TLL", "well-formed"]]
    for name, r in rows.items():
        table.append([name, f"{r['success']:.2f} [{r['success_ci'][0]:.2f}, {r['success_ci'][1]:.2f}]",
                      f"{r['action_match']:.2f} [{r['action_match_ci'][0]:.2f}, {r['action_match_ci'][1]:.2f}]",
                      f"{r['tll_sum']:.2f}", f"{r['format_valid']:.2f}"])
    n_games, n_dec = rows[BEFORE]["games"], rows[BEFORE]["decisions"]
    caveat = (f"One training seed, {n_games} games and {n_dec} decisions: the intervals cover the games and "
              f"decisions, not the training seed. A difference in success smaller than about "
              f"{200 * (0.25 / n_games) ** 0.5:.0f} points cannot be told from game noise here, in action match about "
              f"{200 * (0.25 / n_dec) ** 0.5:.0f} points; and in the powered study an arm's success moved between "
              "training seeds with a standard deviation of about 9 points, so a one-seed success difference — even "
              "one marked better or worse above — may be the seed. The powered study (`docs/results/POWERED.md`: 4 "
              "seeds, 150 test games, learning rates chosen on a validation panel) is where the methods are "
              "compared; this demo runs its setting small enough to watch.")
    arms_text = "; ".join(f"{label} (`{variant}`{''.join(f', {k}: {v}' for k, v in loss.items())}, lr {lr:g})"
                          for label, variant, loss, lr in DEMO_ARMS.values())
    md = ["# sapd demo: learning from noisy logs with a teacher, TextWorld end to end", "",
          f"The offline logs are an ε = {cfg.noise:g} noisy expert's won episodes on {len(panels['train'])} training "
          f"games ({pools['train_noisy']['decisions']} decisions, {pools['train_noisy']['noisy_decisions']} of them "
          f"noisy). The student (SFT on {cfg.pretrain_family} only) and the teacher (also the clean expert on the "
          f"training games) are small Qwen2 models trained here from random weights. From the student, each arm "
          f"ran {cfg.rounds} rounds on the logs with no environment, at the learning rate the powered study "
          f"chose on its validation panel: {arms_text}. Evaluation: greedy episodes on {n_games} held-out games "
          f"(horizon {cfg.horizon}) and the clean expert's {n_dec} held-out decisions.", "",
          "## Held-out results", "", _markdown(table), "",
          "TLL: the teacher's log-likelihood of the student's greedy action (higher: closer to the teacher). "
          "Intervals: 95 % Wilson for one proportion; differences below: a bootstrap over the same games or "
          "decisions (paired).", "", "![held-out results](success.png)", "",
          "## What the numbers mean", "",
          *[f"- {line}." for line in readings], "",
          caveat, "",
          "## Stage timings", "", _markdown([["stage", "seconds"], *([s, f"{v:.1f}"] for s, v in timings.items()),
                                             ["set-up (games, pools, models; cached)", f"{setup_s:.1f}"],
                                             ["total", f"{seconds:.1f}"]]), "",
          "Training report of the SAPD run (loss terms, signals, stage times): `runs/demo-sapd/report/training.png`.",
          "", "## Models", "",
          "`sapd_student/` is the SAPD student as a plain Hugging Face folder (`AutoModelForCausalLM.from_pretrained` "
          "loads it). The student, the teacher and every trained arm are run roots with all their checkpoints: "
          "`models/student`, `models/teacher`, `runs/demo-<arm>`; a run root goes as it is into a run config's "
          "`model.student` / `model.teacher`, and `sapd export RUN OUT [--checkpoint K]` copies any checkpoint out.",
          ""]
    (out / "REPORT.md").write_text("\n".join(md))
    public = {n: {k: v for k, v in ev.items() if k not in ("per_decision",)} for n, ev in evals.items()}
    summary = {"benchmark": "textworld", "families": cfg.families, "test_seed": cfg.test_seed, "models": public,
               "rows": rows, "readings": readings, "timings": timings, "seconds": seconds, "setup_seconds": setup_s,
               "report": training_report,
               "files": {"report": str(out / "REPORT.md"), "evaluation": str(out / "evaluation.json"),
                         "chart": str(out / "success.png"), "sapd_student": str(out / "sapd_student")}}
    (out / "evaluation.json").write_text(json.dumps({"models": public, "rows": rows}, indent=2, default=float) + "\n")
    (out / "demo-summary.json").write_text(json.dumps(summary, indent=2, default=float) + "\n")
    log(f"\nheld-out TextWorld results ({n_games} games, {n_dec} decisions):\n{_plain(table)}\n")
    log("\n".join(readings))
    log(f"\n{caveat}")
    log(f"\nreport: {out / 'REPORT.md'}\nchart: {out / 'success.png'}\ntraining: {training_report[0]}\n"
        f"({seconds:.0f} s in all, of which set-up {setup_s:.0f} s)")
    return summary
