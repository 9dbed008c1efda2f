"""The embedded demo (``sapd demo``, sapd.study.demo) end to end at a very small size, the way a user runs
it — the command line —: games, noisy and clean expert pools, student and teacher, SFT / OPD+Rule / SAPD
from the student, held-out evaluation with paired differences, the reports, a resumed rerun, and what it
wrote plugged into ``sapd run`` and ``sapd evaluate``."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("textworld")

TOY = {"pretrain_games": 3, "train_games": 2, "test_games": 1, "student_epochs": 1.0, "teacher_epochs": 1.0,
       "sft_trajectories_per_round": 4, "rounds": 1, "trajectories_per_round": 2, "group_size": 2,
       "max_new_tokens": 24, "horizon": 3, "tokenizer_vocab": 400,
       "student_shape": {"hidden_size": 32, "layers": 1, "heads": 2, "kv_heads": 1, "intermediate_size": 64},
       "teacher_shape": {"hidden_size": 32, "layers": 1, "heads": 2, "kv_heads": 1, "intermediate_size": 64}}


def test_demo_config_errors_name_the_file(tmp_path, capsys):
    from sapd.cli import main

    bad = tmp_path / "bigger.yaml"
    bad.write_text("test_gamse: 30\n")
    assert main(["demo", "--out", str(tmp_path / "out"), "--config", str(bad)]) == 2
    err = capsys.readouterr().err
    assert str(bad) in err and "test_gamse: unknown key (did you mean 'test_games'?)" in err
    assert not (tmp_path / "out").exists()  # nothing generated before the setting was checked


@pytest.mark.slow
def test_demo_small(tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    import yaml
    from sapd.study.demo import BEFORE, DEMO_ARMS, TEACHER, run_demo

    out = tmp_path / "demo-out"
    (tmp_path / "toy.yaml").write_text(yaml.safe_dump(TOY))
    sapd = [sys.executable, "-m", "sapd.cli"]
    repo = Path(__file__).resolve().parents[1]
    cli = subprocess.run([*sapd, "demo", "--out", str(out), "--config", str(tmp_path / "toy.yaml"), "--no-progress"],
                         capture_output=True, text=True, timeout=1500, cwd=repo)
    assert cli.returncode == 0, cli.stderr[-3000:]
    lines = cli.stdout.splitlines()
    summary = json.loads((out / "demo-summary.json").read_text())
    for name in ("REPORT.md", "success.png", "evaluation.json", "demo-summary.json",
                 "runs/demo-sapd/report/training.png", "pools/train_noisy.jsonl", "sapd_student/config.json"):
        assert (out / name).is_file(), name
    labels = [BEFORE, *(a[0] for a in DEMO_ARMS.values()), TEACHER]
    evaluation = json.loads((out / "evaluation.json").read_text())
    assert list(evaluation["rows"]) == labels
    for name, r in evaluation["rows"].items():
        assert r["games"] == 2 and r["decisions"] >= 2, name  # 1 game per family, the same panel for every model
        assert r["success_ci"][0] <= r["success"] <= r["success_ci"][1], name
    # every arm is read against the student before and against the baseline, paired on the same units
    sapd_row = evaluation["rows"]["SAPD"]
    d = sapd_row["success_vs_before"]
    assert d["units"] == 2 and d["lo"] <= d["diff"] <= d["hi"]
    assert d["diff"] == pytest.approx(sapd_row["success"] - evaluation["rows"][BEFORE]["success"])
    report = (out / "REPORT.md").read_text()
    assert all(name in report for name in labels) and "What the numbers mean" in report and "Stage timings" in report
    assert "SAPD − OPD+Rule (baseline): success" in report
    # the premise first: the teacher against the student before, evaluated as part of the set-up
    assert summary["readings"][0].startswith(f"{TEACHER} − {BEFORE}: action match")
    assert "set-up: evaluate student and teacher" in summary["timings"]
    assert summary["seconds"] > summary["setup_seconds"] > 0
    # the arms trained from the student with the teacher frozen: checkpoint 0 of each is the student
    from sapd import layout
    assert layout.committed_checkpoints(str(out / "runs" / "demo-sapd")) == [0, 1]
    # the printed summary shows the table and the reading
    assert any("held-out TextWorld results" in x for x in lines) and any("SAPD − student before" in x for x in lines)

    # a rerun resumes: every unit is recorded, nothing is trained again
    import time
    t0 = time.perf_counter()
    again = run_demo(out, log=lambda s: None, show_progress=False, overrides=TOY)
    assert again["rows"]["SAPD"]["success"] == summary["rows"]["SAPD"]["success"]
    assert time.perf_counter() - t0 < summary["seconds"]

    # the SAPD student is a plain Hugging Face folder, the run's final checkpoint
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from sapd.models.loading import load_causal_lm, model_folder
    folder = out / "sapd_student"
    tok = AutoTokenizer.from_pretrained(folder)
    ids = tok(tok.apply_chat_template([{"role": "user", "content": "look"}], tokenize=False,
                                      add_generation_prompt=True), return_tensors="pt").input_ids
    with torch.no_grad():
        plain = AutoModelForCausalLM.from_pretrained(folder)(ids).logits
        ours = load_causal_lm(model_folder(str(out / "runs" / "demo-sapd")))(ids).logits
    assert torch.allclose(plain, ours, atol=1e-5)

    # what the demo wrote plugs into the next commands as it is: its SAPD student (a model folder), its
    # teacher (a run root: it stands for its newest committed model) and its logs, in `sapd run`, then
    # `sapd evaluate`
    mine = tmp_path / "byo"
    cfg = {"run_root": str(mine), "variant": "sapd",
           "model": {"student": str(out / "sapd_student"), "teacher": str(out / "models" / "teacher")},
           "data": {"input": str(out / "pools" / "train_noisy.jsonl"), "format": "native", "benchmark": "textworld"},
           "sampling": {"group_size": 2, "max_new_tokens": 12},
           "train": {"rounds": 1, "trajectories_per_round": 2, "minibatch_prefixes": 2, "micro_batch_prefixes": 2,
                     "lr": 1e-6}}
    (tmp_path / "byo.yaml").write_text(yaml.safe_dump(cfg))
    run = subprocess.run([*sapd, "run", str(tmp_path / "byo.yaml"), "--no-progress"], capture_output=True,
                         text=True, timeout=900, cwd=repo)
    assert run.returncode == 0, run.stderr[-3000:]
    assert layout.committed_checkpoints(str(mine)) == [0, 1]
    ev = subprocess.run([*sapd, "evaluate", "--run", str(mine), "--benchmark", "textworld", "--families", "coin_near",
                         "--games-per-family", "1", "--horizon", "2", "--max-new-tokens", "12",
                         "--cache", str(tmp_path / "games"), "--no-progress"],
                        capture_output=True, text=True, timeout=900, cwd=repo)
    assert ev.returncode == 0, ev.stderr[-3000:]
    result = json.loads((mine / "evals" / "000001" / "textworld.json").read_text())
    assert result["checkpoint"] == 1 and result["overall"]["episodes"] == 1
    # notices a user cannot act on are silenced at the source (DeepSpeed's accelerator line; transformers'
    # generation-config and padding notices: sapd samples with its own loop, pads and masks itself)
    noise = ("Setting accelerator", "generation flags are not valid", "Setting `pad_token_id`",
             "attention mask and the pad token id were not set", "GenerationConfig")
    assert not [line for line in (cli.stderr + run.stderr + ev.stderr).splitlines() if any(n in line for n in noise)]
