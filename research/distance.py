"""Why the student's distance to the teacher stalls in the demo's setting (issue 36; report:
docs/results/DISTANCE.md; config: experiments/distance.yaml; ledger: experiments/distance/).

The demo's models and logs (``sapd demo``'s student, teacher and ε-noisy logs, rebuilt by running the demo
into the cache when missing), OPD+Rule and SAPD from the student as the demo runs them, and one knob changed
at a time: a decaying learning rate, a larger G, more trajectories per round, the token term's weight
λ_tok·β. Each run's checkpoints are measured by the product's own validation code
(:func:`sapd.stages.validation.distance_records`: reverse KL(student ‖ teacher) per sampled token, G samples
per prefix at T = 1, the recorded-response log-ratio, the sampled action match) on three sets of prefixes:

- ``val`` — the clean expert's decisions on a validation panel of games (seed 2000), never used for anything
  but choosing;
- ``test`` — the demo's held-out decisions (the clean expert on the demo's held-out games): what is reported;
- ``train`` — a fixed sample of the noisy logs' own prefixes (what the arms train on).

A ``mismatch`` unit asks whether the teacher's feedback is reliable on the logs' prefixes: the logs come from
an ε-noisy expert, so a prefix may carry a noisy action in its history (a state the clean expert, and so the
teacher, never saw), and its recorded action may itself be the noise. There the teacher's own sampled action
match and its step score's ranking of the student's samples (the within-group AUC of
:func:`research.signals.signal_probe`) are compared between prefixes with a clean and a noisy history.

Every finished unit is a JSON in the ledger (a rerun skips it); large artefacts live in the cache. Run::

    python -m research distance setup            # the demo's models (the demo itself when missing), panels
    python -m research distance run --max-units 4
    python -m research distance mismatch
    python -m research distance older-teacher    # the teacher the issue was measured against, rebuilt
    python -m research distance status
    python -m research distance report           # docs/results/DISTANCE.md, distance.json, distance_*.png
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

from research.powered import Claims, Ledger, weights_hash
from research.signals import signal_probe
from sapd import checkpoints, layout, yamlio
from sapd.config import ConfigError, apply_file_overlay, apply_overlay, config_from_dict, read_yaml_mapping
from sapd.data import shards
from sapd.data.prefixes import PrefixOptions, build_prefixes, read_prefixes
from sapd.data.validation import read as validation_read
from sapd.data.validation import sample_rows, summarize
from sapd.demo.games import generate_games, panels
from sapd.demo.main import ARMS, DemoConfig, Paths, arm_config, run_demo
from sapd.demo.models import sft_rounds
from sapd.demo.pools import count_trajectories, expert_pool, read_pool
from sapd.models.generation import HFGenerator, SamplingParams, stops_for
from sapd.models.loading import load_causal_lm, load_tokenizer
from sapd.models.scoring import HFScorer
from sapd.run.local import run_pipeline
from sapd.run.report import read_step_log
from sapd.stages.validation import distance_records, teacher_records

PANELS = ("val", "test", "train")
NOTE_SECTIONS = ("short", "curves", "heldout", "knobs", "mismatch", "cost", "older", "demo")


@dataclass
class DistanceConfig:
    """The study's setting: the demo's, with the knobs it varies (experiments/distance.yaml overrides)."""

    demo: dict[str, Any] = field(default_factory=dict)  # DemoConfig fields (the demo's defaults otherwise)
    methods: list[str] = field(default_factory=lambda: ["opd_rule", "sapd"])  # the demo's arms compared
    rounds: int = 16
    # checkpoints measured on the test and train prefixes; the validation panel is measured on the last only
    curve: list[int] = field(default_factory=lambda: [0, 4, 8, 16])
    seeds: list[int] = field(default_factory=lambda: [0, 1])  # training seeds of every setting
    # one knob at a time, as run-config overlays on the demo's arm config (``lr_scale``: the arm's lr × this)
    settings: dict[str, dict[str, Any]] = field(default_factory=lambda: {
        "base": {},
        "tok_x67": {"loss": {"lambda_tok": 1.0, "token_scale": 1.0}},
        "cosine": {"train": {"lr_schedule": "cosine"}},
        "tok_x10": {"loss": {"lambda_tok": 1.0}},
        "g16": {"sampling": {"group_size": 16}},
        "traj8": {"train": {"trajectories_per_round": 8}},
    })
    val_games: int = 8  # per family: the validation panel (choosing only)
    val_seed: int = 2000
    train_sample: int = 48  # prefixes of the noisy logs measured as "train"
    group_size: int = 4  # samples per prefix for the distance (T = 1)
    eval_seed: int = 0  # the same samples' seed for every checkpoint (common random numbers)
    mismatch_group_size: int = 8
    # the author's reading of the results, by report section (short, curves, heldout, knobs, mismatch, cost,
    # demo): Markdown the report prints under that section, so regenerating it keeps the interpretation
    notes: dict[str, str] = field(default_factory=dict)


def load_distance_config(path: str | Path) -> DistanceConfig:
    cfg = DistanceConfig()
    apply_file_overlay(cfg, str(path), read_yaml_mapping(path))
    if unknown_notes := set(cfg.notes) - set(NOTE_SECTIONS):
        raise ConfigError(f"{path}: notes: unknown section(s) {sorted(unknown_notes)}; sections: {list(NOTE_SECTIONS)}")
    unknown = set(cfg.methods) - set(ARMS)
    if unknown:
        raise ConfigError(f"{path}: methods: unknown arm(s) {sorted(unknown)}; the demo's arms are {list(ARMS)}")
    if max(cfg.curve) > cfg.rounds or 0 not in cfg.curve:
        raise ConfigError(f"{path}: curve: checkpoints must lie in 0..rounds ({cfg.rounds}) and include 0")
    return cfg


def _round(x: Any) -> Any:
    return round(x, 5) if isinstance(x, float) else x


class DistanceStudy:
    def __init__(self, cfg: DistanceConfig, ledger: str | Path, cache: str | Path, *,
                 log: Callable[[str], None] = print) -> None:
        self.cfg, self.ledger, self.cache, self.log = cfg, Ledger(ledger), Path(cache).resolve(), log
        self.demo_cfg = DemoConfig()
        apply_overlay(self.demo_cfg, cfg.demo)
        self.paths = Paths(self.cache / "demo")
        self.claims = Claims(self.cache / "claims")
        self._teacher: Any = None
        self._cache_checked = False  # the cache's demo is the recorded set-up's (check_cache)

    # -- set-up ---------------------------------------------------------------------------------------

    def ensure_demo(self) -> float:
        """The demo's models, logs and held-out decisions (the demo run into the cache when any is missing;
        its arms and report are not needed here)."""
        t0 = time.perf_counter()
        teacher = self.paths.models / "teacher"
        have = ((self.paths.pools / "summary.json").is_file() and (self.paths.heldout / "_MANIFEST.json").is_file()
                and teacher.is_dir() and layout.committed_checkpoints(str(teacher))
                and layout.committed_checkpoints(str(teacher))[-1] == _sft_rounds(self.paths.configs / "teacher.yaml"))
        if not have:
            self.log(f"the demo into {self.paths.out} (its models, logs and held-out decisions)")
            run_demo(self.paths.out, self.demo_cfg, log=self.log, show_progress=False)
        return time.perf_counter() - t0

    def tokenizer(self):
        return load_tokenizer(str(self.paths.tokenizer))

    def teacher_dir(self) -> str:
        return str(checkpoints.checkpoint_model_path(str(self.paths.models / "teacher"),
                                                     _last(str(self.paths.models / "teacher"))))

    def student_dir(self) -> str:
        return str(checkpoints.checkpoint_model_path(str(self.paths.models / "student"),
                                                     _last(str(self.paths.models / "student"))))

    def panel_rows(self, name: str) -> list[dict[str, Any]]:
        """The prefixes of one measured set (module docstring), in a fixed order."""
        c, d = self.cfg, self.demo_cfg
        if name == "test":
            return read_prefixes(str(self.paths.heldout), "train").to_pylist()
        if name == "val":
            out = self.cache / "val-prefixes"
            pool = self.cache / "pools" / "val.jsonl"
            if not pool.is_file():
                games = panels({"train": (d.train_games, d.families, d.train_seed),
                                "test": (d.test_games, d.families, d.test_seed),
                                "val": (c.val_games, d.families, c.val_seed)})["val"]
                generate_games(games, self.paths.games)
                expert_pool(games, self.paths.games, pool, noise=0.0, thought=d.thought,  # type: ignore[arg-type]
                            horizon=40, env_timeout_s=d.env_timeout_s)
            build_prefixes(str(pool), "native", "textworld", str(out), self.tokenizer(),
                           opts=PrefixOptions(history_length=d.history_length, val_fraction=0.0),
                           log=lambda s: None, show_progress=False)
            return read_prefixes(str(out), "train").to_pylist()
        if name in ("train", "logs"):
            out = self.cache / "train-prefixes"
            build_prefixes(str(self.paths.pool("train_noisy")), "native", "textworld", str(out), self.tokenizer(),
                           opts=PrefixOptions(history_length=d.history_length, val_fraction=0.0),
                           log=lambda s: None, show_progress=False)
            rows = read_prefixes(str(out), "train").to_pylist()
            return rows if name == "logs" else sample_rows(rows, c.train_sample, c.eval_seed)
        raise ValueError(f"unknown panel {name!r}")

    def noise_of(self) -> dict[str, dict[str, bool]]:
        """Per logged prefix id: its recorded action is the noise (``turn``), its history holds noise (``history``)."""
        out = {}
        for t in read_pool(self.paths.pool("train_noisy")):
            noisy = set(t.metadata.get("noisy_turns", []))
            for i in range(len(t.turns)):
                out[f"{t.id}#{i}"] = {"turn": i in noisy, "history": any(j < i for j in noisy)}
        return out

    def teacher(self):
        if self._teacher is None:
            self._teacher = load_causal_lm(self.teacher_dir())
            self._teacher.eval()
        return self._teacher

    def params(self, n: int | None = None) -> SamplingParams:
        return SamplingParams(n=n or self.cfg.group_size, temperature=1.0, top_p=1.0,
                              max_new_tokens=self.demo_cfg.max_new_tokens, stop=stops_for("action"),
                              seed=self.cfg.eval_seed)

    def measure(self, model_dir: str, names: tuple[str, ...] = PANELS,
                teacher: Any = None) -> dict[str, dict[str, Any]]:
        """The distance of the model in ``model_dir`` to the teacher (the demo's, or ``teacher``) on each panel
        of ``names``: the summary and the per-prefix figures ``[reverse_kl, tokens, action_match, samples,
        recorded_logratio, recorded_tokens]`` (sums over the prefix's samples / recorded tokens)."""
        teacher = teacher if teacher is not None else self.teacher()
        tok = self.tokenizer()
        student = load_causal_lm(model_dir)
        student.eval()
        pad = tok.pad_token_id if tok.pad_token_id is not None else 0
        out = {}
        for name in names:
            rows = self.panel_rows(name)
            t0 = time.perf_counter()
            records, _ = distance_records(rows, HFGenerator(student, tok, prompts_per_batch=8),
                                          HFScorer(teacher, pad), HFScorer(student, pad), tok,
                                          "textworld", self.params())
            per = {r["prefix_id"]: [_round(r["reverse_kl"]), r["tokens"], r["action_match"], r["samples"],
                                    _round(r["recorded_teacher_logp"] - r["recorded_student_logp"]),
                                    r["recorded_tokens"]] for r in records}
            out[name] = {**_compact(summarize(records)), "per_prefix": per, "seconds": time.perf_counter() - t0}
        return out

    def setup(self) -> dict[str, Any]:
        """The demo's models and logs, the three panels, and the reference rows: the student (checkpoint 0 of
        every run) and the teacher's own samples on every panel."""
        if (done := self.ledger.get("setup")) is not None:
            return done
        demo_s = self.ensure_demo()
        tok = self.tokenizer()
        teacher_rows: dict[str, Any] = {}
        t0 = time.perf_counter()
        student = self.measure(self.student_dir())
        for name in PANELS:
            rows = self.panel_rows(name)
            recs = teacher_records(rows, HFGenerator(self.teacher(), tok, prompts_per_batch=8), "textworld",
                                   self.params())
            teacher_rows[name] = {**_compact(summarize([], recs))["overall"], "prefixes": len(rows),
                                  "per_prefix": {r["prefix_id"]: [r["action_match"], r["samples"]] for r in recs}}
            self.log(f"setup: {name}: {len(rows)} prefixes; student KL/token "
                     f"{student[name]['overall']['reverse_kl_per_token']['value']:.3f}, action match "
                     f"{student[name]['overall']['action_match']['value']:.3f}, teacher's "
                     f"{_v(teacher_rows[name].get('teacher_action_match'))}")
        noise = self.noise_of()
        return self.ledger.put("setup", {
            "demo_seconds": demo_s, "reference_seconds": time.perf_counter() - t0, "student": student,
            # the train panel's prefixes: is the recorded action the noise, is there noise in the history
            "train_noise": {pid: [int(noise[pid]["turn"]), int(noise[pid]["history"])]
                            for pid in student["train"]["per_prefix"]},
            "teacher": teacher_rows, "weights": {"student": weights_hash(self.student_dir()),
                                                 "teacher": weights_hash(self.teacher_dir())},
            "config": asdict(self.cfg)})

    def check_cache(self, setup: dict[str, Any]) -> None:
        """A recorded set-up with a new cache (another machine, a cleaned checkout): the demo is built again
        into the cache, and its models must be the recorded ones, bit for bit, or the new units would not be
        comparable with the recorded ones (the set-up's figures are measured on those weights). Checked once
        per process."""
        if self._cache_checked:
            return
        self.ensure_demo()
        found = {"student": weights_hash(self.student_dir()), "teacher": weights_hash(self.teacher_dir())}
        if found != setup["weights"]:
            raise SystemExit(f"the demo rebuilt in {self.paths.out} has other weights than the recorded set-up "
                             f"({found} against {setup['weights']}): its units would not be comparable; start "
                             "the study again with a ledger of its own (--ledger)")
        self._cache_checked = True

    # -- the runs -------------------------------------------------------------------------------------

    def units(self) -> list[tuple[str, str, str, int]]:
        """(unit, method, setting, seed): every setting of every method, the seeds in the outer loop so an
        interrupted study has whole seeds of every setting."""
        return [(f"runs/{m}.{s}-s{seed}", m, s, seed) for seed in self.cfg.seeds for s in self.cfg.settings
                for m in self.cfg.methods]

    def run_config(self, method: str, setting: str, seed: int) -> dict[str, Any]:
        d = self.demo_cfg
        base = arm_config(d, self.paths, method)
        root = str(self.cache / "runs" / f"{method}.{setting}-s{seed}")
        over: dict[str, Any] = {"run_root": root, "train": {"rounds": self.cfg.rounds, "seed": seed},
                                "validation": {"every_rounds": 0}}  # measured here, on the study's own panels
        knob = dict(self.cfg.settings[setting])
        lr_scale = knob.pop("lr_scale", None)  # the arm's own learning rate × this (the arms' rates differ)
        merged = _merge(_merge(base, over), knob)
        if lr_scale is not None:
            merged["train"]["lr"] = base["train"]["lr"] * float(lr_scale)
        return merged

    def run_unit(self, unit: str, method: str, setting: str, seed: int) -> dict[str, Any]:
        if (done := self.ledger.get(unit)) is not None:
            return done
        setup = self.setup()
        self.check_cache(setup)
        cfg = config_from_dict(self.run_config(method, setting, seed))
        self.log(f"{unit}: {cfg.train.rounds} rounds")
        t0 = time.perf_counter()
        run_pipeline(cfg, log=lambda s: None, show_progress=False)
        train_s = time.perf_counter() - t0
        curve = []
        t1 = time.perf_counter()
        for k in self.cfg.curve:
            if k == 0:  # checkpoint 0 is the student: measured once, in the set-up
                curve.append({"checkpoint": 0, **{n: setup["student"][n] for n in PANELS}})
                continue
            model_dir = str(checkpoints.checkpoint_model_path(cfg.run_root, k))
            names = PANELS if k == self.cfg.rounds else ("test", "train")  # choosing uses the last checkpoint
            curve.append({"checkpoint": k, **self.measure(model_dir, names)})
            kl = {n: curve[-1][n]["overall"]["reverse_kl_per_token"]["value"] for n in names}
            self.log(f"{unit}: checkpoint {k}: KL/token " + " ".join(f"{n} {v:.3f}" for n, v in kl.items()))
        steps = read_step_log(cfg.run_root)
        gap: dict[int, list[float]] = {}
        for s in steps:
            gap.setdefault(int(s["round"]), []).append(float(s["teacher_student_gap"]))
        res = {"method": method, "setting": setting, "seed": seed, "overrides": self.cfg.settings[setting],
               "train_seconds": train_s, "curve_seconds": time.perf_counter() - t1,
               "optimizer_steps": len(steps),
               "training_gap": {str(k): statistics.fmean(v) for k, v in sorted(gap.items())},
               "lr": [s["lr"] for s in steps], "curve": curve, "weights": setup["weights"]}
        return self.ledger.put(unit, compact_unit(res, self.cfg.rounds))

    def run(self, max_units: int | None = None) -> list[str]:
        done: list[str] = []
        for unit, method, setting, seed in self.units():
            if max_units is not None and len(done) >= max_units:
                break
            if self.ledger.get(unit) is not None or not self.claims.take(unit):
                continue
            try:
                if self.ledger.get(unit) is None:
                    self.run_unit(unit, method, setting, seed)
                    done.append(unit)
            finally:
                self.claims.release(unit)
        return done

    # -- the teacher's feedback on the logs' prefixes ---------------------------------------------------

    def mismatch(self) -> dict[str, Any]:
        """Is the teacher's feedback reliable where the logs went off the clean expert's path? Over every
        logged prefix, split by a clean / noisy history (and a recorded action that is / is not the noise):
        the teacher's own sampled action match against the recorded action, the student's, the reverse KL
        between them, and the within-group AUC of the teacher's action-only step score over the student's
        samples (correct = the recorded action, on prefixes whose recorded action is not the noise)."""
        if (done := self.ledger.get("mismatch")) is not None:
            return done
        self.setup()
        t0 = time.perf_counter()
        tok = self.tokenizer()
        rows = self.panel_rows("logs")
        noise = self.noise_of()
        student = load_causal_lm(self.student_dir())
        student.eval()
        pad = tok.pad_token_id if tok.pad_token_id is not None else 0
        G = self.cfg.mismatch_group_size
        records, _ = distance_records(rows, HFGenerator(student, tok, prompts_per_batch=8),
                                      HFScorer(self.teacher(), pad), HFScorer(student, pad), tok, "textworld",
                                      self.params(G))
        sampler_T = HFGenerator(self.teacher(), tok, prompts_per_batch=8)
        theirs = {r["prefix_id"]: r for r in teacher_records(rows, sampler_T, "textworld", self.params(G))}
        groups = {"clean history": lambda n: not n["history"] and not n["turn"],
                  "noisy history": lambda n: n["history"] and not n["turn"],
                  "recorded action is the noise": lambda n: n["turn"]}
        out: dict[str, Any] = {"prefixes": len(rows), "group_size": G, "groups": {}}
        for name, pick in groups.items():
            sel = [r for r in rows if pick(noise[r["prefix_id"]])]
            ids = {r["prefix_id"] for r in sel}
            recs = [r for r in records if r["prefix_id"] in ids]
            summ = summarize(recs, [theirs[i] for i in ids])["overall"] if recs else {}
            probe = signal_probe(student, self.teacher(), tok, sel, group_size=G,
                                 max_new_tokens=self.demo_cfg.max_new_tokens,
                                 seed=self.cfg.eval_seed) if sel and not name.startswith("recorded") else {}
            out["groups"][name] = {"prefixes": len(sel), **_compact({"overall": summ})["overall"],
                                   **{k: probe[k] for k in ("auc_action_sum", "auc_action_sum_ci", "auc_pairs",
                                                            "auc_groups", "well_formed") if k in probe}}
            g = out["groups"][name]
            self.log(f"mismatch: {name}: {len(sel)} prefixes, teacher's action match "
                     f"{_v(g.get('teacher_action_match'))}, student's {_v(g.get('action_match'))}, AUC "
                     f"{g.get('auc_action_sum', float('nan')):.3f}")
        out["seconds"] = time.perf_counter() - t0
        return self.ledger.put("mismatch", out)

    # -- what the product's validation costs per round ---------------------------------------------------

    def cost(self, rounds: int = 4) -> dict[str, Any]:
        """The cost of ``sapd run``'s own validation, measured: the demo's SAPD arm for a few rounds with a
        validation pool (``data.val_fraction`` 0.3 of the logs, so the default cap of 64 prefixes applies)
        and the product's default validation settings, every round; per round, the validation's seconds
        (its timings) against the round's sampling, scoring and training seconds."""
        if (done := self.ledger.get("cost")) is not None:
            return done
        self.setup()
        root = str(self.cache / "runs" / "cost")
        cfg = config_from_dict(_merge(self.run_config("sapd", "base", 0), {
            "run_root": root, "data": {"val_fraction": 0.3}, "train": {"rounds": rounds},
            "validation": {"every_rounds": 1}}))
        t0 = time.perf_counter()
        run_pipeline(cfg, log=lambda s: None, show_progress=False)
        wall = time.perf_counter() - t0
        steps = read_step_log(root)
        per_round = []
        for k in range(rounds + 1):
            v = validation_read(root, k)
            m = shards.read_manifest(layout.scored_dir(root, k)) or {} if k < rounds else {}
            train_s = sum(x["step_seconds"] + x.get("old_logp_seconds", 0.0) for x in steps if x["round"] == k)
            per_round.append({"checkpoint": k, "validation_seconds": v["seconds"], "validation_timings": v["timings"],
                              "prefixes": v["prefixes"], "samples": v["overall"]["samples"],
                              "round_sample_seconds": m.get("timings", {}).get("sample_seconds"),
                              "round_score_seconds": m.get("timings", {}).get("score_seconds"),
                              "round_train_seconds": train_s if k < rounds else None,
                              "round_samples": (m.get("rows", 0) * cfg.sampling.group_size) if m else None})
        out = {"rounds": rounds, "wall_seconds": wall, "settings": asdict(cfg.validation), "per_round": per_round}
        self.log("cost: " + ", ".join(f"ckpt {r['checkpoint']} validation {r['validation_seconds']:.1f} s"
                                      for r in per_round))
        return self.ledger.put("cost", out)

    # -- the starting distance ---------------------------------------------------------------------

    # the demo's teacher before it was made stronger (commit 64567ca): 3 epochs at 2e-3 over the same data
    OLDER_TEACHER: dict[str, float] = {"epochs": 3.0, "lr": 2e-3}

    def older_teacher(self) -> dict[str, Any]:
        """Why the issue measured a smaller starting distance (0.142 nats per token) than this study (0.438):
        the issue's demo built its teacher with 3 epochs at 2e-3 over the clean play, this one with 8 at 3e-3.
        The older teacher is SFT'd here from the same student on the same data with the same recipe but for
        those two numbers, and the student's distance to it, and its own sampled action match, are measured
        on the held-out decisions exactly as the set-up measures them against the demo's teacher."""
        if (done := self.ledger.get("older-teacher")) is not None:
            return done
        self.check_cache(self.setup())
        t0 = time.perf_counter()
        data = yamlio.load((self.paths.configs / "teacher.yaml").read_text())
        epochs, lr = self.OLDER_TEACHER["epochs"], self.OLDER_TEACHER["lr"]
        root = str(self.cache / "older-teacher")
        rounds = sft_rounds(epochs, count_trajectories(data["data"]["input"]), data["train"]["trajectories_per_round"])
        data["run_root"] = root
        data["train"].update(rounds=rounds, lr=lr)
        run_pipeline(config_from_dict(data), log=lambda s: None, show_progress=False)
        folder = str(checkpoints.checkpoint_model_path(root, rounds))
        older = load_causal_lm(folder)
        older.eval()
        student = self.measure(self.student_dir(), ("test",), teacher=older)["test"]
        recs = teacher_records(self.panel_rows("test"), HFGenerator(older, self.tokenizer(), prompts_per_batch=8),
                               "textworld", self.params())
        teacher = _compact(summarize([], recs))["overall"]
        out = {"epochs": epochs, "lr": lr, "rounds": rounds, "weights": weights_hash(folder),
               "student": {k: v for k, v in student.items() if k != "per_prefix"}, "teacher": teacher,
               "seconds": time.perf_counter() - t0}
        self.log(f"older teacher ({epochs:g} epochs at {lr:g}, {out['rounds']} rounds): the student's KL/token "
                 f"{student['overall']['reverse_kl_per_token']['value']:.3f}, its own sampled action match "
                 f"{_v(teacher.get('teacher_action_match'))}")
        return self.ledger.put("older-teacher", out)

    # -- status ----------------------------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        units = self.units()
        done = [u for u, *_ in units if self.ledger.get(u) is not None]
        costs = [r["train_seconds"] + r["curve_seconds"] for u in done if (r := self.ledger.get(u))]
        per = statistics.fmean(costs) if costs else None
        return {"runs": f"{len(done)}/{len(units)}", "setup": self.ledger.get("setup") is not None,
                "mismatch": self.ledger.get("mismatch") is not None, "seconds_per_run": per,
                "remaining_hours": (len(units) - len(done)) * per / 3600 if per else None,
                "spent_hours": self.spent_seconds() / 3600}

    def spent_seconds(self) -> float:
        total = 0.0
        for unit in self.ledger.units():
            r = self.ledger.get(unit) or {}
            total += sum(float(v) for k, v in r.items() if k.endswith("seconds") and isinstance(v, (int, float)))
        return total


def _sft_rounds(config: Path) -> int:
    """The rounds of the demo's SFT config at ``config`` (its last checkpoint), -1 when it is not written yet."""
    return config_from_dict(yamlio.load(config.read_text()) or {}).train.rounds if config.is_file() else -1


def compact_unit(res: dict[str, Any], rounds: int) -> dict[str, Any]:
    """A run unit as the ledger keeps it: per-prefix figures only at the last checkpoint (the paired
    analyses use those; checkpoint 0's live in the set-up unit), the summaries everywhere."""
    for point in res["curve"]:
        if point["checkpoint"] != rounds:
            point.update({n: {k: v for k, v in point[n].items() if k != "per_prefix"} for n in PANELS if n in point})
    return res


def _last(root: str) -> int:
    return layout.committed_checkpoints(root)[-1]


def _merge(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    out = dict(a)
    for k, v in b.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def _compact(summary: dict[str, Any]) -> dict[str, Any]:
    """A summary with its floats rounded (the ledger is committed)."""
    def walk(x: Any) -> Any:
        if isinstance(x, dict):
            return {k: walk(v) for k, v in x.items()}
        if isinstance(x, list):
            return [walk(v) for v in x]
        return _round(x)
    return walk(summary)


def _v(fig: dict[str, Any] | None) -> str:
    return "–" if not fig or fig.get("value") is None else f"{fig['value']:.3f}"


def mean_sd(xs: list[float]) -> tuple[float, float]:
    xs = [x for x in xs if x is not None and not math.isnan(x)]
    if not xs:
        return float("nan"), float("nan")
    return statistics.fmean(xs), statistics.stdev(xs) if len(xs) > 1 else 0.0


def config_text(cfg: DistanceConfig) -> str:
    return yamlio.dump(asdict(cfg))


