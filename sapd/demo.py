"""The embedded default (``sapd demo`` / ``make demo``): the whole method on one CPU in a few minutes,
with the embedded TextWorld environment at both ends and none in the training loop.

1. **Games**: a fixed panel of generated TextWorld training games (a few families, seed 0) and a
   disjoint held-out panel (the same families, seeds from 1000), generated once into ``OUT/textworld/``.
2. **Expert pool**: the environment's expert plays every training game (:func:`collect_expert`);
   the won episodes are written as a native JSONL pool (``OUT/pool/textworld_expert.jsonl``).
3. A byte-level BPE **tokenizer** trained on the pool's prompt/response text and the shipped samples;
   the pipeline builds the decision prefixes from the pool (``format: native``, ``benchmark: textworld``).
4. A tiny Qwen2 model (random init) → **teacher** by SFT on the pool for many rounds; a weaker
   **student** by SFT for fewer rounds from the same init.
5. **SAPD** rounds: student samples G responses per prefix, the frozen teacher scores them, the student
   is updated — no environment.
6. **Evaluation** of student-before, student-after and teacher: greedy episodes on the held-out games
   (task success per family and overall, :func:`~sapd.evaluate.evaluate_checkpoint`), plus the offline
   validation on the pool's held-out prefixes (format validity, expert-action match).
7. **Reports**: the training report (``OUT/sapd/report/training.png``), ``OUT/evaluation.json``,
   ``OUT/success.png`` (success by family) and ``OUT/REPORT.md`` (the tables and the stage timings).

Simplifications, on purpose: the models are tiny (2 layers, hidden 128, randomly initialised, no
pre-training), the pool is a few dozen expert episodes with templated thoughts, and SAPD runs a handful
of rounds with G = 4 — so the numbers show the machinery end to end, not the paper's effect sizes; a
tiny student may well not improve, and the demo reports whatever comes out. The held-out panel is small
(a few games per family), so one game moves a family's success by a large step. Evaluation episodes
are cut at ``horizon`` = 20 decisions (the benchmark's default is 50; the expert needs at most about 11
on these families) and responses at 64 new tokens (an expert response is about 30-40), which keeps an
untrained model that never emits a valid action from dominating the CPU time.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Callable

from sapd.cli import SAMPLE_DATA, SAMPLES

DEMO_MODEL = dict(hidden_size=128, layers=2, heads=4, kv_heads=2, intermediate_size=256)
DEMO_FAMILIES = ("simple", "coin", "cook_take", "cook_open")  # tw-make cannot make treasure-1001
TRAIN_SEED, HELDOUT_SEED = 0, 1000
MODELS = ("student before", "student after SAPD", "teacher")


def _pool_texts(trajectories) -> list[str]:
    """The text the models will see: every step prompt of the pool and every expert response."""
    from sapd.benchmarks import get_benchmark
    from sapd.data.prompts import render_messages

    spec = get_benchmark("textworld")
    texts = []
    for traj in trajectories:
        for t, turn in enumerate(traj.turns):
            texts.extend(m["content"] for m in render_messages(traj, t, spec, spec.history_length))
            texts.append(turn.response)
    return texts


def _success_chart(evals: dict[str, dict], dest: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cats = [*next(iter(evals.values()))["by_category"], "overall"]
    width = 0.8 / len(evals)
    fig, ax = plt.subplots(figsize=(1.6 * len(cats) + 2, 4))
    for i, (name, e) in enumerate(evals.items()):
        vals = [e["by_category"][c]["success"] for c in cats[:-1]] + [e["overall"]["success"]]
        ax.bar([x + (i - (len(evals) - 1) / 2) * width for x in range(len(cats))], vals, width, label=name)
    n = next(iter(evals.values()))["overall"]["episodes"]
    ax.set_xticks(range(len(cats)), cats)
    ax.set_ylim(0, 1.05)
    ax.set_ylabel("task success")
    ax.set_title(f"held-out TextWorld games ({n} episodes, greedy)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(dest, dpi=110)
    plt.close(fig)


def _success_table(evals: dict[str, dict]) -> list[list[str]]:
    cats = list(next(iter(evals.values()))["by_category"])
    rows = [["model", *cats, "overall", "mean steps", "invalid steps"]]
    for name, e in evals.items():
        rows.append([name, *(f"{e['by_category'][c]['success']:.2f}" for c in cats), f"{e['overall']['success']:.2f}",
                     f"{e['overall']['mean_steps']:.1f}", f"{e['overall']['invalid_step_rate']:.2f}"])
    return rows


def _markdown(rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(rows[0]) + " |", "|" + "|".join("---" for _ in rows[0]) + "|"]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows[1:]])


def _plain(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
                     for r in rows)


def run_demo(out: Path, *, log: Callable[[str], None] = print, show_progress: bool = True,
             families: tuple[str, ...] | list[str] = DEMO_FAMILIES, train_games_per_family: int = 5,
             heldout_games_per_family: int = 2, teacher_rounds: int = 30, student_rounds: int = 8,
             sapd_rounds: int = 6, horizon: int = 20, max_new_tokens: int = 64,
             offline_validation: bool = True) -> dict:
    """Run (or resume: every stage reuses what is already in ``out``) the embedded demo. Returns the
    summary also written to ``out/demo-summary.json``."""
    from sapd import checkpoints
    from sapd.agent_loop import collect_expert
    from sapd.config import config_from_dict
    from sapd.data.loaders import write_native_jsonl
    from sapd.data.prefixes import read_prefixes
    from sapd.data.schema import Trajectory
    from sapd.demo_tokenizer import build_tokenizer
    from sapd.evaluate import episode_specs, evaluate_checkpoint
    from sapd.envs.textworld_env import default_panel, ensure_panel
    from sapd.models.loading import load_tokenizer
    from sapd.models.tiny import build_tiny_model
    from sapd.offline_eval import offline_eval
    from sapd.pipeline import run_pipeline
    from sapd.report import write_report

    t_start = time.perf_counter()
    out.mkdir(parents=True, exist_ok=True)
    families = list(families)
    timings: dict[str, float] = {}
    clock = [time.perf_counter()]

    def lap(stage: str) -> None:
        now = time.perf_counter()
        timings[stage] = timings.get(stage, 0.0) + now - clock[0]
        clock[0] = now

    # 1. games ---------------------------------------------------------------------------------------
    cache = out.resolve() / "textworld"  # absolute: tw-make runs in its own working directory
    train_panel = default_panel(train_games_per_family, families, TRAIN_SEED)
    heldout_panel = default_panel(heldout_games_per_family, families, HELDOUT_SEED)
    if {g.game_id for g in train_panel} & {g.game_id for g in heldout_panel}:
        raise ValueError("training and held-out panels overlap: use fewer training games per family")
    log(f"[1/7] TextWorld games: {len(train_panel)} training (seed {TRAIN_SEED}+), {len(heldout_panel)} held-out "
        f"(seed {HELDOUT_SEED}+), families {', '.join(families)} → {cache}")
    ensure_panel(train_panel + heldout_panel, cache, log=log)
    lap("generate games")

    # 2. expert pool ---------------------------------------------------------------------------------
    pool = out / "pool" / "textworld_expert.jsonl"
    if pool.is_file():
        trajs = [Trajectory.from_dict(json.loads(line)) for line in pool.read_text(encoding="utf-8").splitlines()
                 if line.strip()]
    else:
        episodes = collect_expert(episode_specs("textworld", families=families, games_per_family=train_games_per_family,
                                                seed=TRAIN_SEED, cache_dir=cache))
        trajs = [t for t in episodes if t.success]
        pool.parent.mkdir(parents=True, exist_ok=True)
        write_native_jsonl(trajs, str(pool))
        log(f"[2/7] expert: won {len(trajs)}/{len(episodes)} training games, "
            f"{sum(len(t.turns) for t in trajs)} decisions → {pool}")
    lap("collect expert")

    # 3. tokenizer -----------------------------------------------------------------------------------
    tok_dir = out / "tokenizer"
    if (tok_dir / "tokenizer.json").is_file():
        tokenizer = load_tokenizer(str(tok_dir))
    else:
        log(f"[3/7] training a tokenizer on the pool and the shipped samples → {tok_dir}")
        samples = [(SAMPLE_DATA / f).read_text(encoding="utf-8") for f, _, _ in SAMPLES]
        tokenizer = build_tokenizer(_pool_texts(trajs) + samples, tok_dir)
    init = out / "models" / "init"
    if not (init / "config.json").is_file():
        build_tiny_model(tokenizer, init, **DEMO_MODEL)
    lap("tokenizer")

    # 4. teacher and student by SFT on the pool ------------------------------------------------------
    data = {"input": str(pool), "format": "native", "benchmark": "textworld", "val_fraction": 0.2}
    sft = {"variant": "sft", "data": data, "model": {"student": str(init)},
           "train": {"trajectories_per_round": 8, "minibatch_prefixes": 8, "micro_batch_prefixes": 8, "lr": 3e-3}}
    roots = {"teacher": str(out / "teacher-sft"), "student": str(out / "student-sft"), "sapd": str(out / "sapd")}
    for who, rounds in (("teacher", teacher_rounds), ("student", student_rounds)):
        log(f"[4/7] {who}: SFT on the expert pool for {rounds} rounds from the random tiny Qwen2")
        run_pipeline(config_from_dict({**sft, "run_root": roots[who], "train": {**sft["train"], "rounds": rounds}}),
                     log=log, show_progress=show_progress)
        lap(f"{who} SFT")
    teacher = str(checkpoints.checkpoint_model_path(roots["teacher"], teacher_rounds))
    student = str(checkpoints.checkpoint_model_path(roots["student"], student_rounds))

    # 5. SAPD ----------------------------------------------------------------------------------------
    log(f"[5/7] SAPD: {sapd_rounds} rounds, G=4, no environment")
    run_pipeline(config_from_dict({
        "run_root": roots["sapd"], "variant": "sapd", "data": data, "model": {"student": student, "teacher": teacher},
        "sampling": {"group_size": 4, "max_new_tokens": 96, "prompts_per_batch": 8},
        "train": {"rounds": sapd_rounds, "trajectories_per_round": 2, "minibatch_prefixes": 8,
                  # 1e-3 collapsed the tiny student's output format within 6 rounds; 1e-4 keeps it
                  "micro_batch_prefixes": 4, "lr": 1e-4}}), log=log, show_progress=show_progress)
    lap("SAPD")

    # 6. evaluation ----------------------------------------------------------------------------------
    which = {"student before": (roots["student"], student_rounds), "student after SAPD": (roots["sapd"], sapd_rounds),
             "teacher": (roots["teacher"], teacher_rounds)}
    log(f"[6/7] evaluation: greedy episodes on the {len(heldout_panel)} held-out games")
    evals = {}
    for name, (root, k) in which.items():
        e = evaluate_checkpoint(root, k, "textworld", families=families, games_per_family=heldout_games_per_family,
                                seed=HELDOUT_SEED, horizon=horizon, max_new_tokens=max_new_tokens, cache_dir=cache,
                                log=log, show_progress=show_progress)
        evals[name] = {key: e[key] for key in ("overall", "by_category", "seed", "games_per_family", "horizon")}
        evals[name]["episodes_file"] = str(Path(root) / "evals" / f"{k:06d}" / "textworld.episodes.jsonl")
    lap("evaluate (held-out games)")
    offline = {}
    if offline_validation:
        val = read_prefixes(str(out / "sapd" / "prefixes"), "val")
        log(f"[6/7] offline validation on {len(val)} held-out prefixes of the pool")
        for name, (root, k) in which.items():
            offline[name] = offline_eval(checkpoints.load_checkpoint_model(root, k), tokenizer, val, "textworld",
                                         max_new_tokens=max_new_tokens)
        lap("offline validation")

    # 7. reports -------------------------------------------------------------------------------------
    log("[7/7] reports")
    training_report = write_report(roots["sapd"])
    (out / "evaluation.json").write_text(json.dumps({"benchmark": "textworld", "families": families,
                                                     "heldout_seed": HELDOUT_SEED, "models": evals,
                                                     "offline_validation": offline}, indent=2) + "\n")
    _success_chart(evals, out / "success.png")
    lap("reports")
    seconds = time.perf_counter() - t_start
    rows = _success_table(evals)
    md = [
        "# sapd demo: TextWorld end to end", "",
        f"Families {', '.join(families)}. Training pool: the expert's {len(trajs)} won episodes on "
        f"{len(train_panel)} games (seeds {TRAIN_SEED}…); evaluation: greedy episodes on {len(heldout_panel)} "
        f"held-out games (seeds {HELDOUT_SEED}…), horizon {next(iter(evals.values()))['horizon']}. "
        f"Teacher: {teacher_rounds} SFT rounds; student: {student_rounds} SFT rounds; SAPD: {sapd_rounds} rounds "
        "from the student with the frozen teacher. Tiny random-init models: the machinery end to end, not the "
        "paper's effect sizes.", "",
        "## Task success on the held-out games", "", _markdown(rows), "", "![success by family](success.png)", "",
    ]
    if offline:
        n = next(iter(offline.values()))["prefixes"]
        md += [f"## Offline validation ({n} held-out prefixes of the pool)", "",
               _markdown([["model", "format valid", "expert-action match", "repeated action"],
                          *([name, f"{o['format_valid']:.2f}", f"{o['action_match']:.2f}",
                             f"{o['repeated_action']:.2f}"] for name, o in offline.items())]), ""]
    md += ["## Stage timings", "", _markdown([["stage", "seconds"], *([s, f"{v:.1f}"] for s, v in timings.items()),
                                              ["total", f"{seconds:.1f}"]]), "",
           "Training report (loss terms, signals, SAPD stage times): `sapd/report/training.png`.", ""]
    (out / "REPORT.md").write_text("\n".join(md))
    summary = {"evals": evals, "offline_validation": offline, "report": training_report, "timings": timings,
               "seconds": seconds, "files": {"report": str(out / "REPORT.md"),
                                             "evaluation": str(out / "evaluation.json"),
                                             "chart": str(out / "success.png")}}
    (out / "demo-summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    log(f"\ntask success on {len(heldout_panel)} held-out TextWorld games:\n{_plain(rows)}")
    if offline:
        log("\noffline validation: " + "; ".join(f"{name} action match {o['action_match']:.2f}"
                                                 for name, o in offline.items()))
    log(f"\nreport: {out / 'REPORT.md'}\nchart: {out / 'success.png'}\ntraining: {training_report[0]}\n"
        f"({seconds:.0f} s in all)")
    return summary
