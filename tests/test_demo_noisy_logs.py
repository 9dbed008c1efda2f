"""The next demo (sapd.study.demo_noisy_logs, not yet ``sapd demo``) end to end at a very small size:
games, noisy and clean expert pools, student and teacher, SFT / OPD+Rule / SAPD from the student,
held-out evaluation with paired differences, the reports and a resumed rerun."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("textworld")

TOY = {"pretrain_games": 3, "train_games": 2, "test_games": 1, "student_epochs": 1.0, "teacher_epochs": 1.0,
       "sft_trajectories_per_round": 4, "rounds": 1, "trajectories_per_round": 2, "group_size": 2,
       "max_new_tokens": 24, "horizon": 3, "tokenizer_vocab": 400,
       "student_shape": {"hidden_size": 32, "layers": 1, "heads": 2, "kv_heads": 1, "intermediate_size": 64},
       "teacher_shape": {"hidden_size": 32, "layers": 1, "heads": 2, "kv_heads": 1, "intermediate_size": 64}}


@pytest.mark.slow
def test_noisy_logs_demo_small(tmp_path):
    from sapd.study.demo_noisy_logs import BEFORE, DEMO_ARMS, TEACHER, run_demo

    out = tmp_path / "demo-out"
    lines: list[str] = []
    summary = run_demo(out, log=lines.append, show_progress=False, overrides=TOY)
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
