"""The reproduction study (python -m research study): its config, its A.5 checks on hand-made groups, its claim table,
and — slow — the whole study at toy size through the CLI, resumed."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import pytest
import torch

from research.a5 import (
    noise_sensitivity,
    offset_invariance,
    std_normalisation,
    swapped_ranking,
    token_offset_residual,
)
from research.reproduction import Study, load_study_config
from sapd.config import ConfigError

SMOKE = Path(__file__).resolve().parents[1] / "study_smoke.yaml"


def test_config_checks_keys_and_types(tmp_path):
    cfg = load_study_config(str(SMOKE))
    assert cfg.families == ["coin_near", "kitchen"] and cfg.student_shape.hidden_size == 32
    bad = tmp_path / "bad.yaml"
    bad.write_text("famillies: [coin]\n")
    with pytest.raises(ConfigError, match=r"bad\.yaml:1: famillies: unknown key \(did you mean 'families'\?\)"):
        load_study_config(str(bad))
    bad.write_text("seeds: 3\n")
    with pytest.raises(ConfigError, match="seeds: expected a list"):
        load_study_config(str(bad))
    with pytest.raises(ConfigError, match="tables: unknown"):
        load_study_config(None, {"tables": ["table9"]})
    with pytest.raises(ConfigError, match="needs at least two families"):
        load_study_config(None, {"families": ["coin"]})


def test_runs_cover_both_tables_once(tmp_path):
    cfg = load_study_config(None, {"seeds": [0, 1], "ablation_seeds": [0]})
    runs = Study(cfg, tmp_path).table_runs()
    names = [r[0] for r in runs]
    assert len(names) == len(set(names))
    assert sum(r[1] == "sft" for r in runs) == 2  # SFT needs no teacher: once per seed
    assert sum(r[1] == "sapd" for r in runs) == 4  # two teachers × two seeds
    assert {r[1] for r in runs if r[0].endswith("-s0") and "strong" in r[0]} >= {"wo_opd", "wo_rule", "full_token",
                                                                                   "std_norm"}
    only_fig = Study(load_study_config(None, {"tables": ["figure2"]}), tmp_path).table_runs()
    assert [r[0] for r in only_fig] == ["sapd-strong_teacher-s0"]


def _groups(P=6, G=4, T=9, seed=0):
    gen = torch.Generator().manual_seed(seed)
    response = torch.ones((P, G, T), dtype=torch.bool)
    response[:, :, 7:] = torch.rand((P, G, 2), generator=gen) > 0.5
    action = torch.zeros((P, G, T), dtype=torch.bool)
    action[:, :, 3:5] = True
    action[0, 1, 5] = True  # one response with a longer action
    return {"teacher": -torch.rand((P, G, T), generator=gen, dtype=torch.float64) * 3,
            "old": -torch.rand((P, G, T), generator=gen, dtype=torch.float64) * 3,
            "response": response, "action": action, "rule": torch.zeros((P, G), dtype=torch.float64)}


def test_round_lines_are_logged_about_every_quarter_when_progress_bars_are_off(tmp_path):
    lines = []
    study = Study(load_study_config(str(SMOKE)), tmp_path, log=lines.append, show_progress=False)
    log = study._round_log("student", 10)
    for k in range(10):
        log(f"round {k}: checkpoint {k + 1} committed")
    log("prefixes: 12 train / 0 val")
    assert lines == [f"student: {k}/10 rounds" for k in (2, 4, 6, 8, 10)]
    bars = Study(load_study_config(str(SMOKE)), tmp_path, log=lines.append, show_progress=True)
    bars._round_log("student", 10)("round 9: checkpoint 10 committed")
    assert len(lines) == 5  # the progress bar shows it instead


def test_a5_checks_on_hand_made_groups():
    g = _groups()
    inv = offset_invariance(g)
    assert inv["groups"] == 6 and inv["advantage_max_abs_change"] < 1e-12 and inv["step_loss_change"] < 1e-12
    assert inv["score_shift_max_error"] < 1e-12 and inv["token_loss_change"] > 1e-3  # the token branch moves
    tok = token_offset_residual(g)
    # a per-token offset of 1 shifts r by Nᵢ: only group 0 (one action of 3 tokens, three of 2) keeps a residual
    assert tok["action_only"]["groups_with_varying_length"] == pytest.approx(1 / 6)
    assert tok["action_only"]["max_abs_residual_per_unit_offset"] == pytest.approx(0.75)
    ns = noise_sensitivity(g)
    assert all(r["bound_2eps_holds"] for r in ns["rows"])
    assert ns["rows"][0]["pairwise_order_kept"] >= ns["rows"][-1]["pairwise_order_kept"]
    sw = swapped_ranking(g)
    assert sw["groups"] == 6 and sw["swap_error"] < 1e-12 and sw["others_unchanged_error"] < 1e-12
    assert sw["best_gets_negative_advantage"] == 1.0
    sn = std_normalisation(g)
    norms = [r["step_adv_norm_median"] for r in sn["rows"]]
    assert norms[1] == pytest.approx(norms[0] / 10) and norms[3] == pytest.approx(norms[0] / 1000)
    assert all(r["std_norm_adv_norm_median"] == pytest.approx(math.sqrt(4), rel=1e-2) for r in sn["rows"])  # η: slightly under √G


@pytest.mark.slow
def test_the_whole_study_at_toy_size_and_resumed(tmp_path):
    from research.__main__ import main

    out, results = tmp_path / "study", tmp_path / "results"
    args = ["study", str(SMOKE), "--out", str(out), "--results", str(results), "--no-progress"]
    assert main(args) == 0
    res = json.loads((results / "study.json").read_text())
    assert set(res["reference"]) == {"student", "sft_teacher", "strong_teacher"}
    names = set(res["runs"])
    assert {"sft-s0", "sapd-sft_teacher-s0", "sapd-strong_teacher-s0", "opd_rule-strong_teacher-s0",
            "std_norm-strong_teacher-s0", "full_token-strong_teacher-s0"} <= names
    for r in res["runs"].values():
        assert 0.0 <= r["success"] <= 1.0 and 0.0 <= r["action_match"] <= 1.0
    seq = res["table3"]["sapd-s0"]
    assert seq["stages"] == ["coin_near", "kitchen"] and set(seq["matrix"]["kitchen"]) == {"coin_near", "kitchen"}
    f2 = res["figure2"]
    assert len(f2["sapd"]["rounds"]) == len(f2["online_opd"]["rounds"]) == 2
    assert [p["round"] for p in f2["sapd"]["curve"]] == [0, 1, 2] and f2["per_step_speedup_median"] > 0
    assert res["a5"]["groups"] > 0
    md = (results / "STUDY.md").read_text()
    for heading in ("## Table 1 analogue", "## Table 2 analogue", "## Table 3 analogue", "## Figure 2 analogue",
                    "## Appendix A.5 predictions", "## The paper's claims against these numbers"):
        assert heading in md
    assert "## Notes\n\nToy size, to test the machinery" in md  # the author's notes from the config
    assert (results / "table1_success.png").stat().st_size > 1000
    assert (results / "figure2_efficiency.png").stat().st_size > 1000

    # resumable: a second run trains and evaluates nothing again and reports the same numbers
    t0 = time.perf_counter()
    assert main(args) == 0
    again = json.loads((results / "study.json").read_text())
    assert again["runs"] == res["runs"] and again["table3"]["sapd-s0"]["matrix"] == seq["matrix"]
    assert time.perf_counter() - t0 < 120


def test_sft_models_train_in_runs_and_are_exported_to_models(tmp_path, monkeypatch):
    """A new study folder: runs/<name> is the run root, models/<name> a plain HF folder; a study folder
    from before keeps its run root in models/<name> (resumed, not retrained)."""
    import research.reproduction as study_run
    from sapd import checkpoints
    from sapd.models.loading import load_causal_lm, load_tokenizer
    from tests.pipeline_util import make_models
    student, _ = make_models(tmp_path / "tiny")
    trained: list[str] = []

    def fake_pipeline(cfg, **kw):  # one committed checkpoint per round, as the real pipeline leaves it
        trained.append(cfg.run_root)
        for k in range(cfg.train.rounds + 1):
            if not checkpoints.is_committed(cfg.run_root, k):
                checkpoints.save_checkpoint(cfg.run_root, k, load_causal_lm(student), load_tokenizer(student), None)
        return {}
    monkeypatch.setattr(study_run, "run_pipeline", fake_pipeline)
    monkeypatch.setattr(study_run, "count_trajectories", lambda data_input: 4)
    study = Study(load_study_config(str(SMOKE)), tmp_path / "new", log=lambda s: None)
    final = study._run_sft("student", student, "pool.jsonl", 1.0)
    assert trained == [str(tmp_path / "new" / "runs" / "student")] and "/runs/student/checkpoints/" in final
    exported = tmp_path / "new" / "models" / "student"
    assert (exported / "config.json").is_file() and not (exported / "config.yaml").exists()
    from transformers import AutoModelForCausalLM
    assert AutoModelForCausalLM.from_pretrained(exported) is not None

    legacy = tmp_path / "old"
    old_root = legacy / "models" / "student"
    (old_root).mkdir(parents=True)
    (old_root / "config.yaml").write_text("run_root: x\n")
    trained.clear()
    final = Study(load_study_config(str(SMOKE)), legacy, log=lambda s: None)._run_sft("student", student, "p", 1.0)
    assert trained == [str(old_root)] and final.startswith(str(old_root)) and not (legacy / "runs").exists()
