"""The distance study's harness (research/distance.py, research/distance_report.py): its config, the run
configs it makes (one knob at a time over the demo's arm), and the report's arithmetic on a ledger written
here by hand — the paired seed differences and the "within noise" reading."""

from __future__ import annotations

import json
import math

import pytest

from research.distance import DistanceStudy, load_distance_config
from research.distance_report import _paired_seed_effect, _t_interval, render_distance
from sapd.config import ConfigError, config_from_dict


def test_the_config_and_the_run_configs_it_makes(tmp_path):
    f = tmp_path / "d.yaml"
    f.write_text("rounds: 8\ncurve: [0, 4, 8]\nmethods: [sapd]\n")
    cfg = load_distance_config(f)
    assert (cfg.rounds, cfg.curve, cfg.methods) == (8, [0, 4, 8], ["sapd"])
    f.write_text("methods: [sapd, grpo]\n")
    with pytest.raises(ConfigError, match=r"methods: unknown arm\(s\) \['grpo'\]"):
        load_distance_config(f)
    f.write_text("rounds: 8\ncurve: [0, 12]\n")
    with pytest.raises(ConfigError, match="curve: checkpoints must lie in 0..rounds"):
        load_distance_config(f)
    f.write_text("roundz: 8\n")
    with pytest.raises(ConfigError, match="d.yaml:1: roundz: unknown key"):
        load_distance_config(f)
    f.write_text("rounds: 8\ncurve: [0, 8]\n")
    study = DistanceStudy(load_distance_config(f), tmp_path / "ledger", tmp_path / "cache", log=lambda s: None)
    base = config_from_dict(study.run_config("sapd", "base", 1))
    assert base.train.rounds == 8 and base.train.seed == 1 and base.validation.every_rounds == 0
    assert base.loss_cfg.no_action_step == "penalty" and base.train.lr == 1e-4  # the demo's SAPD arm
    knobs = {s: config_from_dict(study.run_config("opd_rule", s, 0)) for s in study.cfg.settings}
    assert knobs["cosine"].train.lr_schedule == "cosine" and knobs["g16"].sampling.group_size == 16
    assert knobs["traj8"].train.trajectories_per_round == 8
    assert knobs["tok_x10"].loss_cfg.lambda_tok * knobs["tok_x10"].loss_cfg.token_scale == pytest.approx(0.15)
    assert knobs["tok_x67"].loss_cfg.lambda_tok * knobs["tok_x67"].loss_cfg.token_scale == pytest.approx(1.0)
    f.write_text("rounds: 8\ncurve: [0, 8]\nsettings: {base: {}, lr_x10: {lr_scale: 10}}\n")
    scaled = DistanceStudy(load_distance_config(f), tmp_path / "ledger", tmp_path / "cache", log=lambda s: None)
    assert config_from_dict(scaled.run_config("sapd", "lr_x10", 0)).train.lr == pytest.approx(1e-3)  # 1e-4 × 10
    assert config_from_dict(scaled.run_config("opd_rule", "lr_x10", 0)).train.lr == pytest.approx(3e-3)
    for s, c in knobs.items():  # one knob at a time: everything else is the base's
        others = {k: v for k, v in c.to_dict().items() if k not in ("run_root", "loss", "train", "sampling")}
        assert others == {k: v for k, v in knobs["base"].to_dict().items()
                          if k not in ("run_root", "loss", "train", "sampling")}, s


def _point(k: int, kl: float) -> dict:
    fig = {"value": kl, "ci": [kl - 0.01, kl + 0.01]}
    overall = {"reverse_kl_per_token": fig, "reverse_kl_per_action_token": fig, "action_match": {"value": 0.4, "ci": [0.3, 0.5]},
               "recorded_logratio_per_token": fig}
    return {"checkpoint": k, **{p: {"overall": overall, "prefixes": 2, "per_prefix": {"a#0": [kl * 10, 10, 1, 4, 0.0, 5],
                                                                                     "b#1": [kl * 10, 10, 1, 4, 0.0, 5]}}
                               for p in ("val", "test", "train")}}


def test_the_report_reads_seeds_and_noise_from_a_ledger(tmp_path):
    f = tmp_path / "d.yaml"
    f.write_text("rounds: 8\ncurve: [0, 8]\nseeds: [0, 1, 2]\nsettings: {base: {}, cosine: {train: {lr_schedule: cosine}}}\n"
                 "notes: {knobs: 'The reading of the knobs, kept across regenerations.'}\n")
    study = DistanceStudy(load_distance_config(f), tmp_path / "ledger", tmp_path / "cache", log=lambda s: None)
    start = _point(0, 0.14)
    study.ledger.put("setup", {"student": {p: start[p] for p in ("val", "test", "train")},
                               "teacher": {p: {"teacher_action_match": {"value": 0.8, "ci": [0.7, 0.9]}} for p in ("val", "test", "train")},
                               "weights": {"student": "s", "teacher": "t"}, "config": {}, "train_noise": {"a#0": [0, 0], "b#1": [0, 1]}})
    finals = {("opd_rule", "base"): [0.09, 0.10, 0.095], ("opd_rule", "cosine"): [0.07, 0.075, 0.08],
              ("sapd", "base"): [0.11, 0.12, 0.10], ("sapd", "cosine"): [0.12, 0.10, 0.11]}
    for (m, s), vals in finals.items():
        for seed, v in enumerate(vals):
            study.ledger.put(f"runs/{m}.{s}-s{seed}", {"method": m, "setting": s, "seed": seed, "train_seconds": 10.0, "optimizer_steps": 30,
                                                      "curve_seconds": 1.0, "curve": [start, _point(8, v)],
                                                      "training_gap": {"0": -0.15}})
    out = render_distance(study, tmp_path / "results")
    text = open(out).read()
    summary = json.loads((tmp_path / "results" / "distance.json").read_text())
    eff = summary["knobs"]["opd_rule.cosine"]["effect"]["test"]
    assert eff["per_seed"] == pytest.approx([-0.02, -0.025, -0.015]) and not eff["within_noise"]
    assert summary["knobs"]["sapd.cosine"]["effect"]["test"]["within_noise"]  # +0.01, −0.02, +0.01: holds 0
    m, lo, hi = _t_interval([-0.02, -0.025, -0.015])
    assert m == pytest.approx(-0.02) and hi - m == pytest.approx(4.303 * 0.005 / math.sqrt(3), rel=1e-3)
    assert "| OPD+Rule | cosine | 0.075 ± 0.005 | -0.020 [-0.032, -0.008] |" in text
    assert "*within noise*" in text and "training seeds [0, 1, 2] planned (seeds 0, 1, 2 recorded)" in text
    assert text.index("The reading of the knobs, kept across regenerations.") > text.index("## 3. What each knob")
    f.write_text("notes: {knobz: x}\n")
    with pytest.raises(ConfigError, match=r"notes: unknown section\(s\) \['knobz'\]"):
        load_distance_config(f)
    assert "OPD+Rule (the demo's setting, 3 seeds): held-out KL 0.140 →" in text
    assert (tmp_path / "results" / "distance_curves.png").is_file() and (tmp_path / "results" / "distance_knobs.png").is_file()
    assert _paired_seed_effect({}, {}, "test") is None
    # the issue's starting distance: the section waits for its unit, then shows both teachers' rows
    assert "(not run yet: `python -m research distance older-teacher`)" in text
    older = _point(0, 0.2)["test"]
    study.ledger.put("older-teacher", {"epochs": 3.0, "lr": 0.002, "rounds": 8, "weights": "o", "seconds": 1.0,
                                       "student": {k: v for k, v in older.items() if k != "per_prefix"},
                                       "teacher": {"teacher_action_match": {"value": 0.6, "ci": [0.5, 0.7]}}})
    text = open(render_distance(study, tmp_path / "results")).read()
    assert "| the older (3 epochs at 0.002) | 0.200 [" in text and "0.600 [0.500, 0.700]" in text
    assert "| the demo's (8 epochs at 0.003) | 0.140 [" in text


def test_a_rebuilt_cache_with_other_weights_is_refused(tmp_path, monkeypatch):
    """A recorded set-up and a cache built again (another machine, a cleaned checkout): new units are added only
    when the rebuilt demo's models hash as the recorded ones; otherwise the study stops, naming both."""
    import research.distance as distance
    f = tmp_path / "d.yaml"
    f.write_text("rounds: 4\ncurve: [0, 4]\n")
    study = DistanceStudy(load_distance_config(f), tmp_path / "ledger", tmp_path / "cache", log=lambda s: None)
    built: list[int] = []
    monkeypatch.setattr(study, "ensure_demo", lambda: built.append(1) or 0.0)
    monkeypatch.setattr(study, "student_dir", lambda: "S")
    monkeypatch.setattr(study, "teacher_dir", lambda: "T")
    hashes = {"S": "s1", "T": "t1"}
    monkeypatch.setattr(distance, "weights_hash", lambda d: hashes[d])
    with pytest.raises(SystemExit, match=r"other weights than the recorded set-up .*'student': 's1'.*'student': 's0'"):
        study.check_cache({"weights": {"student": "s0", "teacher": "t1"}})
    study.check_cache({"weights": {"student": "s1", "teacher": "t1"}})
    study.check_cache({"weights": {"student": "s1", "teacher": "t1"}})  # once per process
    assert len(built) == 2
