"""The reproduction study on the embedded TextWorld environment (``python -m research study``).

One command builds everything from nothing and writes the results under ``--results``
(``docs/results/`` in the repository)::

    python -m research study experiments/study.yaml --out study-out --results docs/results

What it does, each piece committed in ``--out`` as it finishes, so an interrupted study resumes:

1. **Games and pools.** A seeded panel of training games per family (the offline pool every method
   trains from), a disjoint *extra* panel (only the strong teacher sees it) and a disjoint held-out
   panel (evaluation). The environment's expert plays each; its won episodes are the pools. The
   expert's episodes on the held-out games also give held-out decision prefixes, for an offline
   metric (greedy action = the expert's action) that is finer than task success.
2. **Models.** One byte-level BPE tokenizer trained on the pools' text; a small Qwen2 *student*
   shape and a larger *teacher* shape, randomly initialised. The student is SFT'd on the pool for a
   short while (it knows the format, not the games); the **SFT teacher** is the teacher shape SFT'd
   on the pool to convergence; the **strong teacher** is the SFT teacher further trained on the pool
   plus the extra games (more data than any student method sees — the paper's GRPO teacher knows more
   than its offline pool too).
3. **Table 1.** SFT, OPD, OPD+Rule and SAPD from the same student, prefixes and budget (rounds ×
   trajectories per round), under both teachers (SFT needs none), over several seeds.
4. **Table 2.** The ablations w/o OPD, w/o Rule, full-token scoring and the std-normalised step
   advantage, with the strong teacher.
5. **Table 3.** Sequential training over three families (A, then B, then C), SAPD and SFT, each stage
   trained on that family's pool alone, every earlier family evaluated after each stage.
6. **Figure 2.** SAPD and online OPD from the same student and teacher, measured in one run on this
   machine: per-round and cumulative training time (sampling, scoring, training; no evaluation or
   checkpoint saving) and held-out success over rounds.
7. **Appendix A.5.** On real scored groups of the SAPD run: exact invariance of the step branch to
   injected per-group score offsets (also through a whole training round, weights compared), the
   residual a per-*token* offset leaves when action lengths differ, sensitivity to per-response noise
   and to a swapped teacher ranking, and what std normalisation does when within-group differences
   are weak.

Every method's run is an ordinary ``sapd run`` (same pipeline, same objective, same checkpoints);
evaluation is ``sapd evaluate``'s greedy episodes. Simplifications, on purpose: tiny models trained
from scratch on a few hundred short games, so absolute numbers are far from the paper's; the learning
rate of the SAPD family and of the SFT baseline are each one fixed value (see the config), not tuned
per method.
"""

from __future__ import annotations

import json
import random
import re
import shutil
import statistics
import time
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Callable

import pyarrow as pa
import pyarrow.compute as pc

from research.a5 import a5_experiments
from research.reproduction_report import LABELS, TABLE1_METHODS, TABLE2_VARIANTS, TEACHERS, render_report
from research.sequential import Stage, run_sequential
from sapd import checkpoints, layout, storage
from sapd.baselines.online import cycling_games, run_online
from sapd.config import ConfigError, apply_file_overlay, apply_overlay, config_from_dict, dump_config, read_yaml_mapping
from sapd.data.loaders import write_native_jsonl
from sapd.data.prefixes import PrefixOptions, build_prefixes, read_prefixes
from sapd.demo.games import generate_games
from sapd.demo.models import ModelShape, data_section, ensure_init_model, ensure_tokenizer, sft_run_config
from sapd.demo.pools import count_trajectories, expert_pool, pool_texts, read_pool
from sapd.demo.progress import Progress, progress
from sapd.envs.panels import PanelSpec, textworld_specs
from sapd.envs.textworld_env import default_panel
from sapd.models.loading import load_causal_lm, load_tokenizer
from sapd.run.local import run_pipeline
from sapd.run.report import read_step_log, round_timings
from sapd.stages.evaluate import evaluate_checkpoint, offline_eval


@dataclass
class StudyConfig:
    """Every knob of the study; ``experiments/study.yaml`` is the one committed results come from."""

    families: list[str] = field(default_factory=lambda: ["coin_near", "kitchen", "kitchen_open"])
    train_games: int = 100  # per family: the offline pool (student, SFT teacher, every method)
    extra_games: int = 50  # per family: more expert games only the strong teacher is trained on
    heldout_games: int = 10  # per family: the evaluation panel
    train_seed: int = 0
    extra_seed: int = 500
    heldout_seed: int = 1000
    history_length: int = 2
    student_shape: ModelShape = field(default_factory=ModelShape)
    teacher_shape: ModelShape = field(default_factory=lambda: ModelShape(256, 4, 4, 2, 512))
    tokenizer_vocab: int = 2048
    student_epochs: float = 2.0  # SFT epochs over the pool that make the (weak) student
    teacher_epochs: float = 8.0  # SFT epochs over the pool that make the SFT teacher
    strong_epochs: float = 4.0  # further SFT epochs over pool + extra that make the strong teacher
    pretrain_lr: float = 1e-3  # SFT of the student and the teachers
    sft_trajectories_per_round: int = 50  # rounds of the model-making SFT runs (fewer, larger checkpoints)
    rounds: int = 15  # every compared method: rounds of trajectories_per_round trajectories
    trajectories_per_round: int = 4
    group_size: int = 4
    max_new_tokens: int = 48
    temperature: float = 1.0
    lr: float = 1e-4  # the SAPD family (OPD, OPD+Rule, SAPD, ablations, online OPD)
    sft_lr: float = 1e-4  # the SFT baseline
    seeds: list[int] = field(default_factory=lambda: [0, 1, 2])  # Table 1
    ablation_seeds: list[int] = field(default_factory=lambda: [0, 1])  # Table 2
    sequential_seeds: list[int] = field(default_factory=lambda: [0])  # Table 3
    horizon: int = 15  # evaluation episodes (the experts need at most ~8 decisions on these families)
    curve_every: int = 5  # Figure 2: evaluate every this many rounds
    tables: list[str] = field(default_factory=lambda: ["table1", "table2", "table3", "figure2", "a5"])
    env_timeout_s: float = 120.0
    notes: str = ""  # Markdown the study's author adds to the report ("Notes" section): scale, caveats
    game_cache: str | None = None  # generated games (default OUT/textworld); shareable between studies


def load_study_config(path: str | None, overrides: dict[str, Any] | None = None) -> StudyConfig:
    cfg = StudyConfig()
    if path:
        apply_file_overlay(cfg, str(path), read_yaml_mapping(path))
    if overrides:
        apply_overlay(cfg, overrides)
    bad = set(cfg.tables) - {"table1", "table2", "table3", "figure2", "a5"}
    if bad:
        raise ConfigError(f"tables: unknown {sorted(bad)}")
    if "table3" in cfg.tables and len(cfg.families) < 2:
        raise ConfigError("table3 (sequential training) needs at least two families")
    return cfg


# ---------------------------------------------------------------------------------------------------
# set-up: games, pools, tokenizer, models


class Study:
    """Paths and steps of one study folder. Every step returns at once when its output is committed."""

    def __init__(self, cfg: StudyConfig, out: str | Path, *, log: Callable[[str], None] = print,
                 show_progress: bool = False) -> None:
        self.cfg, self.out, self.log, self.show_progress = cfg, Path(out).resolve(), log, show_progress
        self.cache = Path(cfg.game_cache).resolve() if cfg.game_cache else self.out / "textworld"
        self.pools = self.out / "pools"
        self.models = self.out / "models"
        self.runs = self.out / "runs"

    def progress(self, desc: str, total: int, unit: str) -> Progress:
        """Progress of one set-up step: a bar on a terminal with progress shown, lines otherwise."""
        return progress(desc, total, unit, log=self.log, bar=None if self.show_progress else False)

    # -- games and pools ------------------------------------------------------------------------------

    def panels(self) -> dict[str, list]:
        c = self.cfg
        return {"train": default_panel(c.train_games, c.families, c.train_seed),
                "extra": default_panel(c.extra_games, c.families, c.extra_seed) if c.extra_games else [],
                "heldout": default_panel(c.heldout_games, c.families, c.heldout_seed)}

    def ensure_games(self) -> None:
        """Generate every panel's games, in two processes (:func:`sapd.demo.games.generate_games`)."""
        panels = self.panels()
        ids = {name: {g.game_id for g in p} for name, p in panels.items()}
        if ids["train"] & ids["heldout"] or ids["extra"] & (ids["train"] | ids["heldout"]):
            raise ValueError("the train, extra and held-out panels overlap: move train_seed, extra_seed or "
                             "heldout_seed")
        games = [g for p in panels.values() for g in p]
        with self.progress("TextWorld games", len(games), "game") as bar:
            generate_games(games, self.cache, progress=bar.update)

    def pool_path(self, name: str) -> Path:
        return self.pools / f"{name}.jsonl"

    def family_pool_dir(self, family: str) -> Path:
        return self.pools / "by_family" / family

    def ensure_pools(self) -> dict[str, Any]:
        """The expert's won episodes on each panel, as native JSONL; the pool also split by family (for
        sequential training) and pool + extra side by side in one folder (the strong teacher's input)."""
        summary_path = self.pools / "summary.json"
        if summary_path.is_file():
            return json.loads(summary_path.read_text())
        self.ensure_games()
        self.pools.mkdir(parents=True, exist_ok=True)
        summary = {}
        for name, panel in self.panels().items():
            if not panel:
                continue
            summary[name] = expert_pool(panel, self.cache, self.pool_path(name), env_timeout_s=self.cfg.env_timeout_s)
            self.log(f"expert pool '{name}': won {summary[name]['won']}/{len(panel)} games, "
                     f"{summary[name]['decisions']} decisions")
        train = read_pool(self.pool_path("train"))
        for fam in self.cfg.families:
            d = self.family_pool_dir(fam)
            d.mkdir(parents=True, exist_ok=True)
            write_native_jsonl([t for t in train if t.category == fam], str(d / "pool.jsonl"))
        strong = self.pools / "pool_plus_extra"
        strong.mkdir(exist_ok=True)
        shutil.copy(self.pool_path("train"), strong / "train.jsonl")
        if self.pool_path("extra").is_file():
            shutil.copy(self.pool_path("extra"), strong / "extra.jsonl")
        summary_path.write_text(json.dumps(summary, indent=2) + "\n")
        return summary

    # -- tokenizer and models -------------------------------------------------------------------------

    def tokenizer_dir(self) -> Path:
        return self.models / "tokenizer"

    def ensure_tokenizer(self):
        def texts() -> list[str]:
            trajs = [t for name in ("train", "extra") if self.pool_path(name).is_file()
                     for t in read_pool(self.pool_path(name))]
            return pool_texts(trajs, self.cfg.history_length)
        return ensure_tokenizer(self.tokenizer_dir(), texts, self.cfg.tokenizer_vocab)

    def _run_sft(self, name: str, init: str, data_input: str, epochs: float) -> str:
        """SFT ``init`` on ``data_input`` for ``epochs`` passes in the run root ``runs/<name>``, its final
        model exported to ``models/<name>`` (a plain Hugging Face folder); returns the final checkpoint's
        model folder. A study folder from before the exports keeps its run root at ``models/<name>``."""
        c = self.cfg
        legacy = self.models / name
        root = legacy if (legacy / "config.yaml").is_file() else self.runs / name
        cfg = config_from_dict(sft_run_config(root, init, data_input, epochs=epochs,
                                              trajectories=count_trajectories(data_input),
                                              trajectories_per_round=c.sft_trajectories_per_round,
                                              lr=c.pretrain_lr, history_length=c.history_length))
        rounds = cfg.train.rounds
        if not checkpoints.is_committed(str(root), rounds):
            self.log(f"{name}: SFT {epochs:g} epoch(s) = {rounds} rounds of {c.sft_trajectories_per_round} "
                     f"trajectories from {Path(init).name}")
        t0 = time.perf_counter()
        run_pipeline(cfg, log=self._round_log(name, rounds), show_progress=self.show_progress)
        if time.perf_counter() - t0 > 1:
            self.log(f"{name}: done in {time.perf_counter() - t0:.0f} s")
        final = layout.checkpoint_model_dir(str(root), rounds)
        if root != legacy and not (legacy / "config.json").is_file():
            checkpoints.export_model(str(root), str(legacy), checkpoint=rounds)
        return final

    def _round_log(self, name: str, rounds: int) -> Callable[[str], None]:
        """Without progress bars, a pipeline's round lines at about every quarter of its rounds."""
        every = max(1, rounds // 4)

        def log(line: str) -> None:
            m = re.match(r"round (\d+):", line)
            done = int(m.group(1)) + 1 if m else 0
            if not self.show_progress and done and (done % every == 0 or done == rounds):
                self.log(f"{name}: {done}/{rounds} rounds")
        return log

    def _data(self, data_input: str) -> dict[str, Any]:
        return data_section(data_input, self.cfg.history_length)

    def ensure_models(self, which: tuple[str, ...] = ("student", "sft_teacher", "strong_teacher")) -> dict[str, str]:
        """The model folders of ``which`` (student, sft_teacher, strong_teacher), trained when missing."""
        self.ensure_pools()
        tok = self.ensure_tokenizer()
        inits = {who: ensure_init_model(tok, self.models / f"init-{who}", shape, seed)
                 for who, shape, seed in (("student", self.cfg.student_shape, 0),
                                          ("teacher", self.cfg.teacher_shape, 1))}
        pool = str(self.pool_path("train"))
        out = {"student": self._run_sft("student", inits["student"], pool, self.cfg.student_epochs)}
        out["sft_teacher"] = self._run_sft("sft_teacher", inits["teacher"], pool, self.cfg.teacher_epochs)
        if "strong_teacher" in which:
            # without extra games the strong teacher is the SFT teacher trained longer on the pool
            data = str(self.pools / "pool_plus_extra") if self.cfg.extra_games else pool
            out["strong_teacher"] = self._run_sft("strong_teacher", out["sft_teacher"], data, self.cfg.strong_epochs)
        return out

    # -- evaluation -----------------------------------------------------------------------------------

    def heldout_prefixes(self):
        out = str(self.out / "heldout-prefixes")
        build_prefixes(str(self.pool_path("heldout")), "native", "textworld", out, self.ensure_tokenizer(),
                       opts=PrefixOptions(history_length=self.cfg.history_length, val_fraction=0.0),
                       log=lambda s: None, show_progress=False)
        return read_prefixes(out, "train")

    def evaluate(self, root: str, k: int, families: list[str] | None = None) -> dict[str, Any]:
        """Held-out task success (greedy episodes) and the offline held-out action match of checkpoint k;
        both written into the run root and reused."""
        fams = families or self.cfg.families
        name = "study-heldout" if families is None else "study-heldout-" + "-".join(fams)
        dest = storage.join(layout.evals_dir(root, k), f"{name}.json")
        if storage.exists(dest):
            return storage.read_json(dest)
        panel = PanelSpec("textworld", families=tuple(fams), games_per_family=self.cfg.heldout_games,
                          seed=self.cfg.heldout_seed, cache_dir=str(self.cache))
        e = evaluate_checkpoint(root, k, panel, horizon=self.cfg.horizon, max_new_tokens=self.cfg.max_new_tokens,
                                env_timeout_s=self.cfg.env_timeout_s, log=lambda s: None, show_progress=False)
        pref = self.heldout_prefixes()
        if families is not None:
            pref = pref.filter(pc.is_in(pref.column("category"), value_set=pa.array(fams)))
        off = offline_eval(checkpoints.load_checkpoint_model(root, k),
                           load_tokenizer(str(checkpoints.checkpoint_model_path(root, k))), pref, "textworld",
                           max_new_tokens=self.cfg.max_new_tokens)
        res = {"checkpoint": k, "success": e["overall"]["success"],
               "by_family": {c: v["success"] for c, v in e["by_category"].items()},
               "invalid_step_rate": e["overall"]["invalid_step_rate"], "mean_steps": e["overall"]["mean_steps"],
               "action_match": off["action_match"], "action_match_by_family": off["action_match_by_category"],
               "format_valid": off["format_valid"], "repeated_action": off["repeated_action"]}
        storage.write_json(dest, res)
        # the per-episode file of sapd evaluate stays beside it; its summary is folded into this one
        return res

    def evaluate_model_dir(self, name: str, model_dir: str) -> dict[str, Any]:
        """Evaluate a model folder (a reference model) through a one-checkpoint run root."""
        root = self.out / "reference" / name
        if not checkpoints.is_committed(str(root), 0):
            checkpoints.save_checkpoint(str(root), 0, load_causal_lm(model_dir), load_tokenizer(model_dir), None,
                                        {"source": model_dir})
            self._write_prompt_config(root)
        return self.evaluate(str(root), 0)

    def _write_prompt_config(self, root: Path) -> None:
        """Evaluation prompts follow the run's resolved config; a reference root needs one too."""
        cfg = config_from_dict({"run_root": str(root), "data": self._data(str(self.pool_path("train")))})
        (root / "config.yaml").write_text(dump_config(cfg))

    # -- the compared runs ------------------------------------------------------------------------------

    def method_config(self, name: str, variant: str, teacher: str | None, seed: int, models: dict[str, str],
                      data_input: str | None = None, rounds: int | None = None) -> dict[str, Any]:
        c = self.cfg
        sft = variant == "sft"
        return {
            "run_root": str(self.runs / name), "variant": variant,
            "data": self._data(data_input or str(self.pool_path("train"))),
            "model": {"student": models["student"], "teacher": models[teacher] if teacher else ""},
            "sampling": {"group_size": c.group_size, "max_new_tokens": c.max_new_tokens,
                         "temperature": c.temperature, "prompts_per_batch": 8},
            "train": {"rounds": rounds or c.rounds, "trajectories_per_round": c.trajectories_per_round,
                      "minibatch_prefixes": 8, "micro_batch_prefixes": 4 if not sft else 8,
                      "lr": c.sft_lr if sft else c.lr, "seed": seed},
        }

    def run_method(self, name: str, variant: str, teacher: str | None, seed: int,
                   models: dict[str, str], evaluate: bool = True) -> dict[str, Any] | None:
        cfg = config_from_dict(self.method_config(name, variant, teacher, seed, models))
        if not checkpoints.is_committed(cfg.run_root, cfg.train.rounds):
            self.log(f"run {name}: {LABELS.get(variant, variant)}"
                     + (f" with the {LABELS[teacher]}" if teacher else "")
                     + f", seed {seed}, {cfg.train.rounds} rounds")
            t0 = time.perf_counter()
            run_pipeline(cfg, log=self._round_log(f"run {name}", cfg.train.rounds), show_progress=self.show_progress)
            self.log(f"run {name}: trained in {time.perf_counter() - t0:.0f} s")
        if not evaluate:
            return None
        res = self.evaluate(cfg.run_root, cfg.train.rounds)
        self.log(f"run {name}: held-out success {res['success']:.3f}, action match {res['action_match']:.3f}")
        return res

    def table_runs(self) -> list[tuple[str, str, str | None, int]]:
        """(run name, variant, teacher, seed) of Tables 1 and 2, seed by seed: the first seed's runs
        (every method and ablation once) come first, so a partial study already has every row."""
        c = self.cfg
        runs: list[tuple[str, str, str | None, int]] = []
        t1 = "table1" in c.tables or "figure2" in c.tables or "a5" in c.tables
        for seed in dict.fromkeys([*c.seeds, *c.ablation_seeds]):
            if t1 and seed in c.seeds:
                runs.append((f"sft-s{seed}", "sft", None, seed))
                for teacher in TEACHERS:
                    for m in TABLE1_METHODS[1:]:
                        runs.append((f"{m}-{teacher}-s{seed}", m, teacher, seed))
            if "table2" in c.tables and seed in c.ablation_seeds:
                for v in TABLE2_VARIANTS:
                    runs.append((f"{v}-strong_teacher-s{seed}", v, "strong_teacher", seed))
        if "table1" not in c.tables:  # figure 2 and A.5 need only the strong-teacher SAPD run of seed 0
            runs = [r for r in runs if r[0] == f"sapd-strong_teacher-s{c.seeds[0]}" or r[1] in TABLE2_VARIANTS]
        return runs

    def finished_run(self, name: str) -> dict[str, Any] | None:
        """The evaluation of a compared run, if it has been trained and evaluated."""
        dest = self.runs / name / "evals" / f"{self.cfg.rounds:06d}" / "study-heldout.json"
        return json.loads(dest.read_text()) if dest.is_file() else None


# ---------------------------------------------------------------------------------------------------
# the study


def run_study(cfg: StudyConfig, out: str | Path, results: str | Path, *, worker: int = 0, workers: int = 1,
              report_only: bool = False, log: Callable[[str], None] = print,
              show_progress: bool = False) -> dict[str, Any] | None:
    """Run (or resume) the whole study and write the report. Order: the models, the first seed's runs,
    then Appendix A.5, Figure 2 and Table 3, then the other seeds — so an interrupted study already has
    every row. ``report_only``: train nothing, report what is finished. With ``workers`` > 1 this
    process only trains every ``workers``-th of the independent runs (start one process per worker,
    then one more with ``workers`` = 1 to finish the rest and write the report); returns None then."""
    study = Study(cfg, out, log=log, show_progress=show_progress)
    models = study.ensure_models()
    runs = study.table_runs()
    if workers > 1:
        for i, (name, variant, teacher, seed) in enumerate(runs):
            if i % workers == worker:
                study.run_method(name, variant, teacher, seed, models)
        return None
    out_d: dict[str, Any] = {"config": asdict(cfg), "pools": study.ensure_pools()}
    out_d["reference"] = {who: study.evaluate_model_dir(who, path) for who, path in models.items()}
    first = [r for r in runs if r[3] == cfg.seeds[0]]
    if not report_only:
        for name, variant, teacher, seed in first:
            study.run_method(name, variant, teacher, seed, models)
    sapd_first = f"sapd-strong_teacher-s{cfg.seeds[0]}"
    if "a5" in cfg.tables and study.finished_run(sapd_first):
        out_d["a5"] = a5_experiments(study, models)
    if "figure2" in cfg.tables and study.finished_run(sapd_first):
        if not report_only or checkpoints.is_committed(str(study.runs / f"online_opd-strong_teacher-s{cfg.seeds[0]}"),
                                                       cfg.rounds):
            out_d["figure2"] = efficiency(study, models)
    if "table3" in cfg.tables:
        out_d["table3"] = sequential_tables(study, models, report_only=report_only)
    out_d["runs"], out_d["runs_planned"] = {}, [r[0] for r in runs]
    for name, variant, teacher, seed in runs:
        done = study.finished_run(name)
        if done is None and not report_only:
            done = study.run_method(name, variant, teacher, seed, models)
        if done is not None:
            out_d["runs"][name] = done
    write_results(study, out_d, Path(results))
    return out_d


def sequential_tables(study: Study, models: dict[str, str], report_only: bool = False) -> dict[str, Any]:
    """Table 3: each family's pool in turn, SAPD (strong teacher) and SFT, the forgetting matrix
    (``report_only``: the sequences already finished)."""
    c = study.cfg
    fams = c.families[:3]
    res: dict[str, Any] = {}
    for seed in c.sequential_seeds:
        for variant in ("sapd", "sft"):
            teacher = "strong_teacher" if variant == "sapd" else None
            base = study.method_config("unused", variant, teacher, seed, models)
            stages = [Stage(f, {"input": str(study.family_pool_dir(f))},
                            eval_specs=partial(textworld_specs, [f], c.heldout_games, c.heldout_seed, study.cache),
                            eval_benchmark="textworld")
                      for f in fams]
            root = study.out / "sequential" / f"{variant}-s{seed}"
            if report_only:
                if (root / "sequential.json").is_file():
                    res[f"{variant}-s{seed}"] = json.loads((root / "sequential.json").read_text())
                continue
            study.log(f"table 3: sequential {variant}, seed {seed}: {' → '.join(fams)}")
            res[f"{variant}-s{seed}"] = run_sequential(base, stages, str(root), variant=variant, horizon=c.horizon,
                                                       max_new_tokens=c.max_new_tokens,
                                                       env_timeout_s=c.env_timeout_s, log=lambda s: None,
                                                       show_progress=study.show_progress)
    return res


def efficiency(study: Study, models: dict[str, str]) -> dict[str, Any]:
    """Figure 2: SAPD (the Table 1 configuration: strong teacher, first seed) and online OPD from the same
    student and teacher with the same rounds, trained one after the other in this process — so both are
    timed on the same machine under the same load (the Table 1 runs may have shared the CPU with other
    workers); per-round times from the round manifests / online summaries and the step logs; held-out
    success every ``curve_every`` rounds."""
    c = study.cfg
    seed = c.seeds[0]
    sapd_name = f"figure2-sapd-strong_teacher-s{seed}"
    sapd_root = str(study.runs / sapd_name)
    study.run_method(sapd_name, "sapd", "strong_teacher", seed, models, evaluate=False)
    online_cfg = config_from_dict(study.method_config(f"online_opd-strong_teacher-s{seed}", "opd", "strong_teacher",
                                                      seed, models))
    panel = textworld_specs(c.families, c.train_games, c.train_seed, study.cache)
    random.Random(seed).shuffle(panel)
    if not checkpoints.is_committed(online_cfg.run_root, c.rounds):
        study.log(f"figure 2: online OPD, {c.rounds} rounds of {c.trajectories_per_round} episodes")
    run_online(online_cfg, cycling_games(panel, c.trajectories_per_round), "online_opd", horizon=c.horizon,
               env_timeout_s=c.env_timeout_s, log=lambda s: None, show_progress=study.show_progress)

    def per_round(root: str, online: bool) -> list[dict[str, float]]:
        steps = read_step_log(root)
        train: dict[int, float] = {}
        for s in steps:
            train[s["round"]] = train.get(s["round"], 0.0) + s["step_seconds"] + s.get("old_logp_seconds", 0.0)
        rows = []
        if online:
            for k in range(c.rounds):
                summ = storage.read_json(storage.join(layout.round_dir(root, k), "online.json"))
                t = summ["timings"]
                rows.append({"round": k, "rollout": t["sample_seconds"], "score": t["score_seconds"],
                             "train": train.get(k, 0.0), "decisions": summ["rows"]})
        else:
            for r in round_timings(root):
                rows.append({"round": r["round"], "rollout": r.get("sample_seconds", 0.0),
                             "score": r.get("score_seconds", 0.0), "train": train.get(r["round"], 0.0)})
        for r in rows:
            r["total"] = r["rollout"] + r["score"] + r["train"]
        return rows

    curve_ks = sorted({0, *range(c.curve_every, c.rounds + 1, c.curve_every), c.rounds})
    out: dict[str, Any] = {}
    for method, root, online in (("sapd", sapd_root, False), ("online_opd", online_cfg.run_root, True)):
        rows = per_round(root, online)
        curve = [{"round": k, **{key: study.evaluate(root, k)[key] for key in ("success", "action_match")}}
                 for k in curve_ks]
        out[method] = {"rounds": rows, "curve": curve, "run_root": root}
    s_tot = sum(r["total"] for r in out["sapd"]["rounds"])
    o_tot = sum(r["total"] for r in out["online_opd"]["rounds"])
    s_med = statistics.median(r["total"] for r in out["sapd"]["rounds"])
    o_med = statistics.median(r["total"] for r in out["online_opd"]["rounds"])
    out["per_step_speedup_median"] = o_med / s_med if s_med else float("nan")
    out["cumulative_speedup"] = o_tot / s_tot if s_tot else float("nan")
    return out


# ---------------------------------------------------------------------------------------------------
# the report


def write_results(study: Study, res: dict[str, Any], dest: Path) -> None:
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "study.json").write_text(json.dumps(res, indent=2, default=str) + "\n")
    render_report(res, dest)
    study.log(f"wrote {dest / 'STUDY.md'} and its figures")
