"""``sapd demo`` / ``make demo``: the method end to end on this CPU, in minutes, from nothing, with the same
commands a user runs.

The setting is the powered study's (``docs/results/POWERED.md``), small: a student that knows only a short
TextWorld coin route, offline logs of an ε-noisy expert on longer routes, and a teacher that saw the clean
expert there. Steps (each reused when its output is there, so a rerun finishes in seconds and an
interrupted one continues):

1. **the student's data** — seeded ``coin_near`` games (:func:`sapd.demo.games.generate_games`, on every
   core), the environment's expert playing them (:func:`sapd.demo.pools.expert_pool`), a byte-level BPE
   tokenizer trained on that text.
2. **jobs, in parallel worker processes** (:mod:`sapd.demo.workers`, one per core):

   - the **student**: SFT from random weights by ``sapd run`` on ``OUT/configs/student.yaml``;
   - beside it, the training and held-out games of the longer routes (``coin_mid``, ``coin``; disjoint
     seeds): the ε-noisy expert's logs every arm learns from, the clean expert's play (the teacher's data)
     and the clean expert on the held-out games (the held-out decisions);
   - the **teacher**: the student further SFT'd on its own data and the clean play (``teacher.yaml``);
   - the **arms**, from the student on the noisy logs with no environment: SFT on the logs, OPD+Rule (the
     baseline the study compares against) and SAPD (``OUT/configs/<arm>.yaml``: copy one to start your own);
   - **evaluation** of every model — the student before, the arms, the teacher — on the same held-out games
     (``sapd evaluate``'s greedy episodes: task success) and decisions (action match), :mod:`sapd.demo.evaluation`.
3. **report** — ``OUT/REPORT.md`` (the table with 95 % intervals, paired differences, a plain reading, the
   powered study's conclusion beside it, the time of every step), ``OUT/evaluation.json``, ``OUT/success.png``,
   ``sapd report``'s training curves of the SAPD run and ``sapd export``'s copy of the SAPD student
   (``OUT/sapd_student``).

**Why these sizes: the cost model** (single-threaded costs measured on the project's shared 2-core machine;
upper bounds). A game takes ~1 s to generate (``tw-make``, one process per game, took 3.4 s), an expert
episode 0.05 s, one SFT pass over one decision 0.026 s at 128 wide × 2 layers (prompts are ~320 tokens; 256
× 4, the powered study's shape, costs about 6× as much), an SAPD or OPD+Rule round of 4 trajectories × G = 8
about 5 s, an SFT round 0.6 s, evaluating one model on 30 games and 135 decisions 7–16 s (its distance to the
teacher, 4 samples per decision, 0.68× that: 13.4 CPU-s against 19.6 for the student's evaluation,
``bench/distance_cost.py``), a worker process's start ~5 s. The critical path is::

    100 pre-training games on 2 processes (~66 s) + their play and the tokenizer (~8 s)
    + student SFT: 100 games × 3 decisions × 20 epochs (~175 s)
    + teacher SFT: 8 epochs over ~480 decisions (~100 s)
    + SAPD, 8 rounds, and its evaluation (~58 s; OPD+Rule beside it on the other core)
    + the teacher's evaluation (~9 s) and the four models' distances to the teacher (~13 s each,
      two at a time: ~25 s) + the report (~3 s)                                  ≈ 7½ minutes

while the other core generates and plays the 70 training and held-out games during the student's SFT, and
evaluates the student and trains the SFT arm during the teacher's. The student needs its 6,000 decision-passes
at a high learning rate: with 10 epochs at 1e-3 it stayed on the plateau where it ignores the route written in
the task (action match 0.43 on the longer routes), and so would a student too small to learn it. Even at 20
epochs it may stay there (0.39–0.44 here with three training or init seeds, on another machine 0.67 with the
same seeds): the demo does not need the student to escape it, since the logs' longer routes are what the arms
learn, but it needs a teacher clearly better than the student. A teacher of 3 epochs at 2e-3 over the clean play
stayed with such a student (0.43); 8 epochs at 3e-3 reached 0.80 (6 at 5e-3: 0.76). That choice was made on the
teacher's own held-out action match with seed 0, the premise check, never on an arm's numbers.
"""

from __future__ import annotations

import json
import math
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

from sapd import checkpoints, layout, yamlio
from sapd.config import apply_file_overlay, apply_overlay, load_config, read_yaml_mapping
from sapd.data.prefixes import read_prefixes
from sapd.data.validation import paired_ratio_difference
from sapd.demo.evaluation import DECISIONS, DISTANCE, evaluate_model, heldout_distance, heldout_rows
from sapd.demo.games import generate_games, missing_games, panels
from sapd.demo.intervals import paired_bootstrap, wilson_interval
from sapd.demo.models import ModelShape, data_section, ensure_init_model, ensure_tokenizer, sft_run_config
from sapd.demo.pools import count_trajectories, expert_pool, pool_texts, read_pool
from sapd.demo.progress import duration, progress
from sapd.demo.workers import Job, cpu_count, run_jobs
from sapd.envs.panels import PanelSpec
from sapd.envs.textworld_env import GameSpec
from sapd.run.local import run_pipeline
from sapd.run.report import write_report

# the compared arms: (label, variant, loss overrides); the learning rates are DemoConfig.lrs
ARMS: dict[str, tuple[str, str, dict[str, Any]]] = {
    "sft": ("SFT on the logs", "sft", {}),
    "opd_rule": ("OPD+Rule (baseline)", "opd_rule", {}),
    "sapd": ("SAPD", "sapd", {"no_action_step": "penalty"}),
}
BASELINE = "opd_rule"
BEFORE, TEACHER = "student before", "teacher"

# docs/results/POWERED.md "In short" (tests/demo/test_demo.py checks these numbers against it)
POWERED_CONCLUSION = (
    "The powered study (docs/results/POWERED.md: the same setting with larger models, 4 training seeds, 150 "
    "held-out games, learning rates chosen per arm on a validation panel) found SAPD and OPD+Rule not "
    "separable: sapd − opd_rule: action match -2.7 [-7.4, +1.4] pts, success +4.5 [-8.7, +17.0] pts; by "
    "its pre-registered rule the claim that SAPD beats OPD+Rule is refuted at that scale, and no arm ended "
    "above the student's success.")


@dataclass
class DemoConfig:
    """The demo's setting; ``sapd demo --config FILE`` overrides any field (YAML, unknown keys are errors)."""

    pretrain_family: str = "coin_near"  # the student's family: it learns the format and short routes
    families: list[str] = field(default_factory=lambda: ["coin_mid", "coin"])  # longer routes: logs and held-out
    pretrain_games: int = 100  # coin_near games: the student's SFT data (the teacher's too)
    train_games: int = 20  # per family: the noisy logs' games (the teacher saw the clean expert on them)
    test_games: int = 15  # per family: held-out games (and the clean expert's decisions on them)
    pretrain_seed: int = 0
    train_seed: int = 100
    test_seed: int = 3000
    noise: float = 0.25  # ε of the noisy expert that records the logs
    noise_seed: int = 0
    thought: str = "observe"  # the expert's thoughts name the room, never the action
    history_length: int = 2
    horizon: int = 12  # decisions per held-out episode
    tokenizer_vocab: int = 1024
    shape: ModelShape = field(default_factory=lambda: ModelShape(128, 2, 4, 2, 256))  # the student's (and teacher's)
    student_epochs: float = 20.0  # SFT passes over the pre-training pool, from random weights
    student_lr: float = 5e-3  # high for a small model: it must learn to read the route from the task in few steps
    teacher_epochs: float = 8.0  # further SFT passes of the student over its own data and the clean training play
    teacher_lr: float = 3e-3  # with 8 epochs: clearly better than the student even when the student plateaus
    sft_trajectories_per_round: int = 50
    sft_minibatch_prefixes: int = 8
    group_size: int = 8
    temperature: float = 1.0
    max_new_tokens: int = 64
    rounds: int = 8  # every arm: rounds of trajectories_per_round trajectories of the logs
    trajectories_per_round: int = 4
    minibatch_prefixes: int = 8
    # per arm: what the powered study's validation sweep chose for its 256×4 models (not re-tuned here)
    lrs: dict[str, float] = field(default_factory=lambda: {"sft": 3e-4, "opd_rule": 3e-4, "sapd": 1e-4})
    # samples per held-out decision (T = 1) for each model's distance to the teacher (the teacher's own is 0):
    # measured (bench/distance_cost.py), one model's costs 0.68× its held-out evaluation at 4, 0.51× at 2
    distance_group_size: int = 4
    seed: int = 0  # the arms' training seed
    workers: int = 0  # parallel jobs (one thread each); 0: one per core, at most 4
    env_timeout_s: float = 120.0


def demo_config(path: str | Path | None = None, overrides: dict[str, Any] | None = None) -> DemoConfig:
    """:class:`DemoConfig` with a YAML file's fields (read by the project's reader: ``1e-3`` is a float) and
    then ``overrides`` on top; an unknown or mistyped field is a ``ConfigError`` naming ``file:line``."""
    cfg = DemoConfig()
    if path is not None:
        apply_file_overlay(cfg, str(path), read_yaml_mapping(path))
    if overrides:
        apply_overlay(cfg, overrides)
    if unknown := set(cfg.lrs) - set(ARMS):
        raise ValueError(f"lrs: unknown arm(s) {sorted(unknown)}; the arms are {list(ARMS)}")
    cfg.lrs = {**DemoConfig().lrs, **cfg.lrs}  # an arm the file does not name keeps its rate
    return cfg


# ---------------------------------------------------------------------------------------------------
# the jobs (run in worker processes; module-level so they can be sent there)


def _watch_rounds(root: str, rounds: int, report: Callable[[str, int, int, str], None]) -> threading.Event:
    """Report the committed checkpoints of ``root`` every 2 s until the returned event is set."""
    stop = threading.Event()

    def watch() -> None:
        while not stop.wait(2.0):
            report("training", max(len(layout.committed_checkpoints(root)) - 1, 0), rounds, "rounds")
    threading.Thread(target=watch, daemon=True).start()
    return stop


def train_job(report: Callable[[str, int, int, str], None], config: str) -> dict[str, Any]:
    """``sapd run CONFIG`` (without its checks; the demo's configs are its own) → ``{run_root, seconds}``."""
    t0 = time.perf_counter()
    cfg = load_config(config)
    report("training", max(len(layout.committed_checkpoints(cfg.run_root)) - 1, 0), cfg.train.rounds, "rounds")
    stop = _watch_rounds(cfg.run_root, cfg.train.rounds, report)
    try:
        run_pipeline(cfg, log=lambda s: None, show_progress=False)
    finally:
        stop.set()
    report("training", cfg.train.rounds, cfg.train.rounds, "rounds")
    return {"run_root": cfg.run_root, "seconds": time.perf_counter() - t0}


def evaluate_job(report: Callable[[str, int, int, str], None], root: str, panel: dict[str, Any], prefixes: str,
                 horizon: int, max_new_tokens: int, env_timeout_s: float | None, config: str | None = None) -> dict:
    """Train first when ``config`` is given (an arm), then evaluate the run's newest checkpoint; the
    evaluation with ``train_seconds`` added."""
    t0 = time.perf_counter()
    if config is not None:
        train_job(report, config)
    train_s = time.perf_counter() - t0
    k = layout.committed_checkpoints(root)[-1]
    rows = read_prefixes(prefixes, "train").to_pylist()
    return {**evaluate_model(root, k, panel=PanelSpec(**panel), rows=rows, horizon=horizon,
                             max_new_tokens=max_new_tokens, env_timeout_s=env_timeout_s, report=report),
            "train_seconds": train_s}


def distance_job(report: Callable[[str, int, int, str], None], root: str, teacher: str, prefixes: str,
                 max_new_tokens: int, group_size: int) -> dict[str, Any]:
    """The newest checkpoint of ``root``'s distance to the teacher on the held-out decisions
    (:func:`sapd.demo.evaluation.heldout_distance`)."""
    k = layout.committed_checkpoints(root)[-1]
    rows = read_prefixes(prefixes, "train").to_pylist()
    return heldout_distance(root, k, teacher, rows, max_new_tokens=max_new_tokens, group_size=group_size,
                            report=report)


def sft_job(report: Callable[[str, int, int, str], None], config: str, root: str, init: str, data: str,
            epochs: float, sft: dict[str, Any], comment: str) -> dict[str, Any]:
    """Write the ``sapd run`` config that SFTs ``init`` on ``data`` for ``epochs`` (now that the data is there
    to count), then run it (:func:`train_job`)."""
    _write_config(Path(config), sft_run_config(root, init, data, epochs=epochs, trajectories=count_trajectories(data),
                                               **sft), f"{comment}\nsapd run {config}")
    return train_job(report, config)


def play_games(games: list[GameSpec], pools: dict[str, float], cfg: DemoConfig, p: Paths, what: str, *,
               workers: int, log: Callable[[str], None] = print, bar: bool | None = False,
               report: Callable[[str, int, int, str], None] | None = None) -> bool:
    """Generate ``games`` and let the expert play them into the pools ``{name: ε}`` (every pool on all of
    ``games``), with progress (``what``: the games' name in it); False when all of it was there already."""
    def counter(phase: str, total: int, unit: str, initial: int = 0):
        if report is None:
            return progress(phase, total, unit, log=log, bar=bar, initial=initial)
        return _Reported(report, phase, total, unit, initial)

    missing = missing_games(games, p.games)
    with counter(f"{what} games", len(games), "games", len(games) - len(missing)) as b:
        generate_games(missing, p.games, workers=workers, progress=b.update)
    # a pool's summary is written after the pool: it marks the pool complete
    todo = {name: noise for name, noise in pools.items() if not (p.pools / f"{name}.summary.json").is_file()}
    with counter(f"{what} games: expert episodes", len(games) * len(todo), "episodes") as b:
        for name, noise in todo.items():
            summary = expert_pool(games, p.games, p.pool(name), noise=noise, noise_seed=cfg.noise_seed,
                                  thought=cfg.thought, horizon=40, env_timeout_s=cfg.env_timeout_s,  # type: ignore[arg-type]
                                  progress=b.update)
            (p.pools / f"{name}.summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    return bool(missing or todo)


class _Reported:
    """A counter that reports to a job's ``report`` (the parent shows it)."""

    def __init__(self, report: Callable[[str, int, int, str], None], phase: str, total: int, unit: str,
                 initial: int = 0) -> None:
        self.report, self.phase, self.total, self.unit, self.n = report, phase, total, unit, initial
        if initial < total:
            report(phase, initial, total, unit)

    def set(self, n: int) -> None:
        if n != self.n:
            self.n = n
            self.report(self.phase, n, self.total, self.unit)

    def update(self, n: int = 1) -> None:
        self.set(self.n + n)

    def __enter__(self) -> _Reported:
        return self

    def __exit__(self, *exc: object) -> None:
        pass


def logs_job(report: Callable[[str, int, int, str], None], panels: dict[str, list[dict[str, Any]]],
             cfg: dict[str, Any], out: str, pools: dict[str, tuple[str, float]]) -> dict[str, Any]:
    """The training and held-out games, generated and played: the ε-noisy logs and the clean expert's play on
    the training games, the clean expert on the held-out games (their decision prefixes, for evaluation), the
    teacher's data folder; ``{pool: summary}``."""
    c, p = demo_config(overrides=cfg), Paths(Path(out))
    for panel, what in (("train", "training"), ("test", "held-out")):
        play_games([GameSpec(**g) for g in panels[panel]], {name: noise for name, (on, noise) in pools.items()
                                                            if on == panel}, c, p, what, workers=1, report=report)
    tokenizer = ensure_tokenizer(p.tokenizer, lambda: [], c.tokenizer_vocab)
    heldout_rows(p.pool("test"), p.heldout, tokenizer, c.history_length)
    p.teacher_data.mkdir(parents=True, exist_ok=True)
    for name in ("pretrain", "train_clean"):
        dest = p.teacher_data / f"{name}.jsonl"
        if not dest.is_file():
            dest.write_bytes(p.pool(name).read_bytes())
    summary = {name: json.loads((p.pools / f"{name}.summary.json").read_text())
               for name in ("pretrain", *pools)}
    (p.pools / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")  # written last: the logs are done
    return summary


def _finished(config: str, evaluated: bool = False, distance: bool = False) -> bool:
    """The run of ``config`` has its last checkpoint (and, with ``evaluated``, both its evaluations; with
    ``distance``, its distance to the teacher)."""
    if not Path(config).is_file():
        return False
    cfg = load_config(config)
    k = cfg.train.rounds
    if not checkpoints.is_committed(cfg.run_root, k):
        return False
    evals = Path(layout.evals_dir(cfg.run_root, k))
    return ((not evaluated or ((evals / "textworld.json").is_file() and (evals / DECISIONS).is_file()))
            and (not distance or (evals / DISTANCE).is_file()))


# ---------------------------------------------------------------------------------------------------
# the demo


class Timings:
    """Seconds per step and per job, kept in ``OUT/timings.json``: what a rerun only reused keeps the time of
    the run that did the work, so the report always says what the work cost."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.recorded: dict[str, float] = json.loads(path.read_text()) if path.is_file() else {}
        self.seconds: dict[str, float] = {}
        self.clock = time.perf_counter()

    def record(self, name: str, seconds: float, worked: bool) -> None:
        self.seconds[name] = seconds if worked or name not in self.recorded else self.recorded[name]

    def lap(self, step: str, worked: bool) -> None:
        now = time.perf_counter()
        self.record(step, now - self.clock, worked)
        self.clock = now

    def save(self) -> None:
        self.path.write_text(json.dumps({**self.recorded, **self.seconds}, indent=1) + "\n")


class Paths:
    """Everything the demo writes under ``out``."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.games = out / "textworld"
        self.pools = out / "pools"
        self.configs = out / "configs"
        self.models = out / "models"
        self.runs = out / "runs"
        self.tokenizer = self.models / "tokenizer"
        self.heldout = out / "heldout-prefixes"
        self.teacher_data = self.pools / "teacher"  # the teacher's SFT data: the student's and the clean expert's

    def pool(self, name: str) -> Path:
        return self.pools / f"{name}.jsonl"


def _write_config(path: Path, data: dict[str, Any], comment: str) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    text = "".join(f"# {line}\n" for line in comment.splitlines()) + yamlio.dump(data)
    if not path.is_file() or path.read_text(encoding="utf-8") != text:
        path.write_text(text, encoding="utf-8")
    return str(path)


def arm_config(cfg: DemoConfig, p: Paths, arm: str) -> dict[str, Any]:
    """The ``sapd run`` overlay of one arm: from the student, on the noisy logs, frozen teacher."""
    _, variant, loss = ARMS[arm]
    return {"run_root": str(p.runs / arm), "variant": variant, **({"loss": loss} if loss else {}),
            "data": data_section(p.pool("train_noisy"), cfg.history_length),
            "model": {"student": str(p.models / "student"),
                      "teacher": "" if variant == "sft" else str(p.models / "teacher")},
            "sampling": {"group_size": cfg.group_size, "max_new_tokens": cfg.max_new_tokens,
                         "temperature": cfg.temperature, "top_p": 1.0, "prompts_per_batch": 8},
            "rules": {"repetition_weight": 0.0},
            "train": {"rounds": cfg.rounds, "trajectories_per_round": cfg.trajectories_per_round,
                      "minibatch_prefixes": cfg.minibatch_prefixes, "micro_batch_prefixes": 8,
                      "lr": cfg.lrs[arm], "warmup_steps": 5, "max_grad_norm": 1.0, "seed": cfg.seed}}


def _reading(name: str, d: dict[str, float], what: str) -> str:
    span = f"{d['diff'] * 100:+.0f} points [{d['lo'] * 100:+.0f}, {d['hi'] * 100:+.0f}]"
    if d["lo"] > 0:
        return f"{name}: {what} {span}, better (the interval is above 0)"
    if d["hi"] < 0:
        return f"{name}: {what} {span}, worse (the interval is below 0)"
    return f"{name}: {what} {span}, not separable from 0 at this size"


def _kl_diff(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """a − b of the reverse KL to the teacher per sampled token, paired over the held-out decisions."""
    ids = sorted(set(a["distance"]["per_decision"]) & set(b["distance"]["per_decision"]))
    pa, pb = a["distance"]["per_decision"], b["distance"]["per_decision"]
    d = paired_ratio_difference([pa[i][0] for i in ids], [pa[i][1] for i in ids], [pb[i][0] for i in ids],
                                [pb[i][1] for i in ids])
    return {"diff": d["diff"], "lo": d["ci"][0], "hi": d["ci"][1], "units": len(ids)}


def _kl_reading(name: str, d: dict[str, Any], before: float) -> str:
    rel = f"{d['diff'] / before:+.0%} of the student's" if before else "from a student at 0"
    if d["lo"] is None:
        return f"{name}: reverse KL to the teacher {d['diff']:+.3f} nats per token ({rel}), one decision: no interval"
    span = f"{d['diff']:+.3f} nats per token [{d['lo']:+.3f}, {d['hi']:+.3f}], {rel}"
    if d["hi"] < 0:
        return f"{name}: reverse KL to the teacher {span}, closer to the teacher (the interval is below 0)"
    if d["lo"] > 0:
        return f"{name}: reverse KL to the teacher {span}, further from the teacher (the interval is above 0)"
    return f"{name}: reverse KL to the teacher {span}, not separable from 0 at this size"


def _nats(x: float | None) -> str:
    return "–" if x is None else f"{x:.3f}"


def _kl_cell(r: dict[str, Any]) -> str:
    if "reverse_kl" not in r:
        return "–"
    if "sampled_action_match" not in r:  # the teacher against itself
        return "0 (itself)"
    lo, hi = r["reverse_kl_ci"]
    return f"{r['reverse_kl']:.3f}" + (f" [{lo:.3f}, {hi:.3f}]" if lo is not None else "")


def _moving_sentence(rows: dict[str, dict[str, Any]], rounds: int) -> str:
    """What moving toward the teacher did and did not buy, in plain words, from the rows' numbers."""
    before = rows[BEFORE]
    parts, closer, gained = [], [], []
    for arm in ARMS:
        name, r = ARMS[arm][0], rows[ARMS[arm][0]]
        d = r["reverse_kl_vs_before"]
        lo, hi = (d["lo"], d["hi"]) if d["lo"] is not None else (-math.inf, math.inf)
        way = "closer to" if hi < 0 else "further from" if lo > 0 else "not measurably nearer to"
        if hi < 0:
            closer.append(name)
        for key in ("action_match", "success"):
            if r[f"{key}_vs_before"]["lo"] > 0:
                gained.append(f"{name}'s {key.replace('_', ' ')}")
        parts.append(f"{name} ended {way} the teacher ({before['reverse_kl']:.3f} → {r['reverse_kl']:.3f} nats per "
                     f"sampled token, {d['diff'] / max(before['reverse_kl'], 1e-12):+.0%}; on the action tokens "
                     f"{_nats(before['reverse_kl_action'])} → {_nats(r['reverse_kl_action'])})")
    teacher = rows[TEACHER]
    bought = ("it bought no separable gain in held-out action match or success" if not gained else
              "it bought a separable gain in " + ", ".join(gained))
    lead = (f"Moving toward the teacher, in {rounds} round{'' if rounds == 1 else 's'}: " + "; ".join(parts) + ". ")
    if not closer:
        return lead + "No arm moved measurably closer to the teacher here, so there is nothing for closeness to buy."
    return (lead + f"For {' and '.join(closer)}, {bought}: the teacher agrees with the expert on "
            f"{teacher['action_match']:.0%} of the held-out decisions and the student before on "
            f"{before['action_match']:.0%}, while "
            + ", ".join(f"{n} agrees on {rows[n]['action_match']:.0%}" for n in closer)
            + " — a student closer to the teacher's distribution token by token is not yet one that picks the "
            "teacher's actions (docs/results/DISTANCE.md measures why the distance stalls).")


def _diff(a: dict[str, Any], b: dict[str, Any], key: str) -> dict[str, float]:
    """a − b, paired over the games or decisions both were evaluated on."""
    value = (lambda v: v[0]) if key == "per_decision" else (lambda v: v)
    return paired_bootstrap({0: {u: value(v) for u, v in a[key].items()}},
                            {0: {u: value(v) for u, v in b[key].items()}})


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
    kl = all("reverse_kl" in r for r in rows.values())
    fig, axes = plt.subplots(1, 3 if kl else 2, figsize=(15 if kl else 10, 3.8))
    if kl:
        ax = axes[2]
        vals = [rows[n]["reverse_kl"] for n in names]
        errs = [[max(v - (rows[n]["reverse_kl_ci"][0] or v), 0) for n, v in zip(names, vals)],
                [max((rows[n]["reverse_kl_ci"][1] or v) - v, 0) for n, v in zip(names, vals)]]
        ax.bar(range(len(names)), vals, yerr=errs, capsize=4,
               color=["#999999", *["#4c72b0"] * (len(names) - 2), "#55a868"])
        ax.set_xticks(range(len(names)), names, rotation=20, ha="right", fontsize=8)
        ax.set_title("reverse KL to the teacher, nats / sampled token — bars: 95 %", fontsize=9)
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


def run_demo(out: str | Path, cfg: DemoConfig | None = None, *, log: Callable[[str], None] = print,
             show_progress: bool = True) -> dict[str, Any]:
    """Run (or resume) the demo into ``out``; returns the summary also written to ``out/demo-summary.json``."""
    cfg = cfg or DemoConfig()
    t_start = time.perf_counter()
    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar()  # the demo's own bars say what runs; transformers' would come between them
    p = Paths(Path(out))
    bar = None if show_progress else False
    workers = cfg.workers or min(cpu_count(), 4)
    p.out.mkdir(parents=True, exist_ok=True)
    timings = Timings(p.out / "timings.json")
    pan = panels({"pretrain": (cfg.pretrain_games, [cfg.pretrain_family], cfg.pretrain_seed),
                  "train": (cfg.train_games, cfg.families, cfg.train_seed),
                  "test": (cfg.test_games, cfg.families, cfg.test_seed)})

    # 1. the student's games and logs, and the tokenizer: on every core, before anything can train
    log(f"[1/3] the student's data: {len(pan['pretrain'])} {cfg.pretrain_family} games, generated and played by "
        f"the expert; a byte-level BPE tokenizer on their text → {p.out}")
    worked = play_games(pan["pretrain"], {"pretrain": 0.0}, cfg, p, cfg.pretrain_family, workers=workers, log=log,
                        bar=bar)
    tokenizer = ensure_tokenizer(p.tokenizer, lambda: pool_texts(read_pool(p.pool("pretrain")), cfg.history_length),
                                 cfg.tokenizer_vocab)
    init = ensure_init_model(tokenizer, p.models / "init-student", cfg.shape, seed=0)
    timings.lap("the student's games, logs and tokenizer", worked)

    # 2. models, arms and evaluation: `sapd run` configs and `sapd evaluate`, as parallel jobs
    arm_configs = {arm: _write_config(p.configs / f"{arm}.yaml", arm_config(cfg, p, arm),
                                      f"The demo's {ARMS[arm][0]} arm: from the student, on the noisy logs.\n"
                                      f"sapd run {p.configs / f'{arm}.yaml'}")
                   for arm in ARMS}
    sft = {"trajectories_per_round": cfg.sft_trajectories_per_round, "history_length": cfg.history_length,
           "minibatch_prefixes": cfg.sft_minibatch_prefixes, "warmup_steps": 10}
    student: dict[str, Any] = {
        "config": str(p.configs / "student.yaml"), "root": str(p.models / "student"), "init": init,
        "data": str(p.pool("pretrain")), "epochs": cfg.student_epochs, "sft": {**sft, "lr": cfg.student_lr},
        "comment": f"The demo's student: SFT from random weights ({cfg.shape.hidden_size} wide, {cfg.shape.layers} "
                   f"layers) on the expert's {cfg.pretrain_family} games."}
    teacher: dict[str, Any] = {
        "config": str(p.configs / "teacher.yaml"), "root": str(p.models / "teacher"),
        "init": str(p.models / "student"), "data": str(p.teacher_data), "epochs": cfg.teacher_epochs,
        "sft": {**sft, "lr": cfg.teacher_lr},
        "comment": "The demo's teacher: the student, further SFT'd on the clean expert's training games of "
                   f"{', '.join(cfg.families)} (and the student's data)."}
    logs = {"panels": {name: [asdict(g) for g in pan[name]] for name in ("train", "test")}, "cfg": asdict(cfg),
            "out": str(p.out),
            "pools": {"train_clean": ("train", 0.0), "train_noisy": ("train", cfg.noise), "test": ("test", 0.0)}}
    heldout_panel = asdict(PanelSpec("textworld", families=tuple(cfg.families), games_per_family=cfg.test_games,
                                     seed=cfg.test_seed, cache_dir=str(p.games)))
    common = {"panel": heldout_panel, "prefixes": str(p.heldout), "horizon": cfg.horizon,
              "max_new_tokens": cfg.max_new_tokens, "env_timeout_s": cfg.env_timeout_s}
    data = ("student SFT", "logs and held-out games")
    jobs = [Job("student SFT", sft_job, student, inline=_finished(student["config"])),
            Job("logs and held-out games", logs_job, logs, inline=(p.pools / "summary.json").is_file()),
            Job("teacher SFT", sft_job, teacher, after=data, inline=_finished(teacher["config"])),
            *(Job(ARMS[arm][0], evaluate_job, {"root": str(p.runs / arm), "config": arm_configs[arm], **common},
                  after=("teacher SFT",) if ARMS[arm][1] != "sft" else data,
                  inline=_finished(arm_configs[arm], evaluated=True))
              for arm in ("sapd", "opd_rule", "sft")),
            Job(BEFORE, evaluate_job, {"root": student["root"], **common}, after=data,
                inline=_finished(student["config"], evaluated=True)),
            Job(TEACHER, evaluate_job, {"root": teacher["root"], **common}, after=("teacher SFT",),
                inline=_finished(teacher["config"], evaluated=True)),
            # every model's distance to the teacher (the teacher's own is 0), once the teacher and the model are
            # there (the arms' first: they end the critical path)
            *(Job(f"{name}: distance", distance_job, {"root": root, "teacher": teacher["root"],
                                                       "prefixes": str(p.heldout), "max_new_tokens": cfg.max_new_tokens,
                                                       "group_size": cfg.distance_group_size},
                  after=(name, "teacher SFT"), inline=_finished(config, distance=True))
              for name, root, config in ((ARMS["sapd"][0], str(p.runs / "sapd"), arm_configs["sapd"]),
                                         (ARMS["opd_rule"][0], str(p.runs / "opd_rule"), arm_configs["opd_rule"]),
                                         (BEFORE, student["root"], student["config"]),
                                         (ARMS["sft"][0], str(p.runs / "sft"), arm_configs["sft"])))]
    log(f"[2/3] {workers} jobs at a time: the student's SFT ({cfg.student_epochs:g} epochs); the training and "
        f"held-out games of {', '.join(cfg.families)} (the ε = {cfg.noise:g} noisy expert's logs, the clean "
        f"expert's play for the teacher, held-out decisions); the teacher (the student after "
        f"{cfg.teacher_epochs:g} more epochs on the clean play); from the student, on the noisy logs and with no "
        f"environment, {', '.join(ARMS[a][0] for a in ARMS)} ({cfg.rounds} rounds of "
        f"{cfg.trajectories_per_round} trajectories, G = {cfg.group_size}); every model on the held-out games "
        "and decisions")
    results = run_jobs(jobs, workers=workers, log=log, bar=bar)
    timings.lap("models, arms and evaluation (parallel jobs)", not all(j.inline for j in jobs))
    for job in jobs:
        res = results[job.name]
        if "seconds" in res:
            timings.record(f"job {job.name}", res.get("train_seconds", 0.0) + res["seconds"], not job.inline)
    pool_summary = results["logs and held-out games"]

    # 3. report
    log("[3/3] report")
    evals = {BEFORE: results[BEFORE], **{ARMS[a][0]: results[ARMS[a][0]] for a in ARMS}, TEACHER: results[TEACHER]}
    for name in evals:
        if f"{name}: distance" in results:
            evals[name] = {**evals[name], "distance": results[f"{name}: distance"]}
    training_report = write_report(str(p.runs / "sapd"))
    checkpoints.export_model(str(p.runs / "sapd"), str(p.out / "sapd_student"), checkpoint=cfg.rounds)
    timings.lap("report", True)
    timings.save()
    return write_outputs(cfg, p, evals, pool_summary, timings.seconds, t_start, training_report, log)


def write_outputs(cfg: DemoConfig, p: Paths, evals: dict[str, dict[str, Any]], pool_summary: dict[str, Any],
                  timings: dict[str, float], t_start: float, training_report: list[str],
                  log: Callable[[str], None]) -> dict[str, Any]:
    """REPORT.md, evaluation.json, success.png and demo-summary.json; the table and reading printed."""
    rows: dict[str, dict[str, Any]] = {}
    for name, ev in evals.items():
        rows[name] = {"success": ev["success"], "success_ci": wilson_interval(ev["success"], ev["games"]),
                      "action_match": ev["action_match"],
                      "action_match_ci": wilson_interval(ev["action_match"], ev["decisions"]),
                      "format_valid": ev["format_valid"], "games": ev["games"], "decisions": ev["decisions"]}
        if "distance" in ev:  # the reverse KL to the teacher per sampled token, and the sampled action match
            dist = ev["distance"]["summary"]
            rows[name].update({"reverse_kl": dist["reverse_kl_per_token"]["value"],
                               "reverse_kl_ci": dist["reverse_kl_per_token"]["ci"],
                               "reverse_kl_action": dist["reverse_kl_per_action_token"]["value"],
                               "sampled_action_match": dist["action_match"]["value"],
                               "sampled_action_match_ci": dist["action_match"]["ci"]})
        elif name == TEACHER:  # its distance to itself: 0 by definition, not measured
            rows[name].update({"reverse_kl": 0.0, "reverse_kl_ci": [0.0, 0.0], "reverse_kl_action": 0.0})
    base = ARMS[BASELINE][0]
    gap = _diff(evals[TEACHER], evals[BEFORE], "per_decision")
    premise = gap["lo"] > 0
    readings = [_reading(f"{TEACHER} − {BEFORE}", gap, "action match")
                + ("" if premise else " — the teacher is NOT clearly better than the student here, so the premise "
                   "SAPD needs does not hold in this run and no arm that learns from the teacher can be "
                   "expected to gain")]
    for arm in ARMS:
        name = ARMS[arm][0]
        for ref in (BEFORE, base) if arm == "sapd" else (BEFORE,):
            for key, unit, what in (("success", "per_game", "success"), ("action_match", "per_decision",
                                                                          "action match")):
                d = _diff(evals[name], evals[ref], unit)
                rows[name][f"{key}_vs_{'before' if ref == BEFORE else 'baseline'}"] = d
                readings.append(_reading(f"{name} − {ref}", d, what))
        if "distance" in evals[name]:
            d = _kl_diff(evals[name], evals[BEFORE])
            rows[name]["reverse_kl_vs_before"] = d
            readings.append(_kl_reading(f"{name} − {BEFORE}", d, rows[BEFORE]["reverse_kl"]))
    _chart(rows, p.out / "success.png")
    seconds = time.perf_counter() - t_start
    table = [["model", "success [95 % CI]", "action match [95 % CI]", "reverse KL to the teacher [95 % CI]",
              "well-formed"]]
    for name, r in rows.items():
        table.append([name, f"{r['success']:.2f} [{r['success_ci'][0]:.2f}, {r['success_ci'][1]:.2f}]",
                      f"{r['action_match']:.2f} [{r['action_match_ci'][0]:.2f}, {r['action_match_ci'][1]:.2f}]",
                      _kl_cell(r), f"{r['format_valid']:.2f}"])
    n_games, n_dec = rows[BEFORE]["games"], rows[BEFORE]["decisions"]
    sapd = rows[ARMS["sapd"][0]]
    moved = sapd["success_vs_before"]["diff"]
    won = "more games than" if moved > 0 else "fewer games than" if moved < 0 else "as many games as"
    plain = (f"In plain words: on these {n_games} held-out games the SAPD student won {won} the student before "
             f"({rows[BEFORE]['success']:.0%} → {sapd['success']:.0%}) and agreed with the expert on "
             f"{sapd['action_match']:.0%} of {n_dec} held-out decisions (before: {rows[BEFORE]['action_match']:.0%}; "
             f"OPD+Rule: {rows[base]['action_match']:.0%}). One training seed: the intervals cover the games and "
             f"decisions, not the seed, so a difference marked better or worse may still be the seed's.")
    moving = _moving_sentence(rows, cfg.rounds) if all("reverse_kl" in r for r in rows.values()) else ""
    caveat = POWERED_CONCLUSION + " This demo runs that setting small enough to watch; it shows how the method " \
        "runs and how its numbers are read, not whether it wins."
    steps = {k: v for k, v in timings.items() if not k.startswith("job ")}
    timing_rows = [["step", "seconds"], *([step, f"{v:.0f}"] for step, v in steps.items()),
                   ["in all", f"{sum(steps.values()):.0f}"],
                   *([f"&nbsp;&nbsp;{k}", f"{v:.0f}"] for k, v in timings.items() if k.startswith("job "))]
    md = ["# sapd demo: learning from noisy logs with a teacher, TextWorld end to end", "",
          f"The logs are an ε = {cfg.noise:g} noisy expert's won episodes on {pool_summary['train_noisy']['won']} "
          f"training games ({pool_summary['train_noisy']['decisions']} decisions, "
          f"{pool_summary['train_noisy']['noisy_decisions']} of them noisy). The student (SFT on "
          f"{cfg.pretrain_family} only) and the teacher (also the clean expert on the training games) are small "
          f"Qwen2 models trained here from random weights. From the student, each arm ran {cfg.rounds} rounds on "
          f"the logs with no environment: " + "; ".join(f"{ARMS[a][0]} (`{ARMS[a][1]}`, lr {cfg.lrs[a]:g})"
                                                          for a in ARMS)
          + f". Evaluation: greedy episodes on {n_games} held-out games (horizon {cfg.horizon}) and the clean "
          f"expert's {n_dec} held-out decisions.", "",
          "## Held-out results", "", _markdown(table), "",
          "Intervals: 95 % Wilson for one proportion; differences below: a bootstrap over the same games or "
          "decisions (paired). Reverse KL(model ‖ teacher): nats per sampled token, "
          f"{cfg.distance_group_size} samples per held-out decision at T = 1 scored by the teacher (the figure "
          "`sapd run` validates every round; the teacher's own is 0), its interval and its differences by the "
          "delta method over the same decisions.", "", "![held-out results](success.png)", "",
          "## What the numbers mean", "", *[f"- {line}." for line in readings], "", plain, "",
          *([moving, ""] if moving else []), caveat, "",
          "## Run it yourself", "",
          "Every model here was made by `sapd run` on a config in `configs/` (copy one to start your own: "
          "`sapd run configs/sapd.yaml`), evaluated by `sapd evaluate`'s code, and the SAPD run's training "
          "curves are `sapd report runs/sapd` (`runs/sapd/report/training.png`). `sapd_student/` is the SAPD "
          "student as a plain Hugging Face folder; `models/student`, `models/teacher` and `runs/<arm>` are run "
          "roots (a run root goes as it is into a config's `model.student` / `model.teacher`).", "",
          "## Stage timings", "",
          f"On {cpu_count()} cores; the jobs (indented) ran {cfg.workers or min(cpu_count(), 4)} at a time in the "
          f"step before the report. This run took {duration(seconds)}; a rerun reuses everything and keeps "
          "these times.", "", _markdown(timing_rows), ""]
    (p.out / "REPORT.md").write_text("\n".join(md), encoding="utf-8")
    public = {n: {k: ({**v, "per_decision": None} if k == "distance" else v) for k, v in ev.items()
                  if k != "per_decision"} for n, ev in evals.items()}
    (p.out / "evaluation.json").write_text(json.dumps({"models": public, "rows": rows}, indent=2, default=float) + "\n")
    summary = {"rows": rows, "readings": readings, "premise_holds": premise, "timings": timings,
               "seconds": seconds, "pools": pool_summary, "training_report": training_report,
               "config": asdict(cfg)}
    (p.out / "demo-summary.json").write_text(json.dumps(summary, indent=2, default=float) + "\n")
    log(f"\nheld-out TextWorld results ({n_games} games, {n_dec} decisions):\n{_plain(table)}\n")
    log("\n".join(readings))
    log(f"\n{plain}\n\n" + (f"{moving}\n\n" if moving else "") + caveat)
    log(f"\nreport: {p.out / 'REPORT.md'}   configs: {p.configs}/   ({duration(seconds)} in all)")
    return summary
