"""The embedded demo end to end at a very small size: games, expert pool, SFT teacher and student, SAPD,
held-out evaluation and the reports."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("textworld")

TOY = {"train_games": 2, "heldout_games": 1, "student_epochs": 1.0, "teacher_epochs": 2.0,
       "sft_trajectories_per_round": 2, "rounds": 1, "trajectories_per_round": 2, "group_size": 2,
       "max_new_tokens": 12, "horizon": 3, "tokenizer_vocab": 600,
       "student_shape": {"hidden_size": 32, "layers": 2, "heads": 2, "kv_heads": 1, "intermediate_size": 64},
       "teacher_shape": {"hidden_size": 48, "layers": 2, "heads": 2, "kv_heads": 1, "intermediate_size": 96}}


@pytest.mark.slow
def test_demo_small(tmp_path):
    from sapd.study.demo import MODELS, run_demo

    out = tmp_path / "demo-out"
    summary = run_demo(out, log=lambda s: None, show_progress=False, overrides=TOY)
    for name in ("REPORT.md", "success.png", "evaluation.json", "demo-summary.json", "runs/sapd/report/training.png",
                 "pools/train.jsonl"):
        assert (out / name).is_file(), name
    evaluation = json.loads((out / "evaluation.json").read_text())
    assert set(evaluation["models"]) == set(MODELS)
    for name, e in evaluation["models"].items():
        assert set(e["by_family"]) == {"coin_near", "coin_mid"}, name
        assert all(0.0 <= v <= 1.0 for v in e["by_family"].values()) and 0.0 <= e["action_match"] <= 1.0
    report = (out / "REPORT.md").read_text()
    assert all(name in report for name in MODELS) and "Stage timings" in report
    assert summary["seconds"] > 0
    # the SAPD run trained from the student with the teacher frozen: its checkpoint 0 is the student
    from sapd import layout
    assert layout.committed_checkpoints(str(out / "runs" / "sapd")) == [0, 1]

    # its models are plain Hugging Face folders, each its run root's final checkpoint
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from sapd.models.loading import load_causal_lm, model_folder
    for name in ("student", "sft_teacher", "sapd_student"):
        folder = out / "models" / name
        assert not (folder / "config.yaml").exists() and (folder / "config.json").is_file(), name
        tok = AutoTokenizer.from_pretrained(folder)
        ids = tok(tok.apply_chat_template([{"role": "user", "content": "look"}], tokenize=False,
                                          add_generation_prompt=True), return_tensors="pt").input_ids
        run = out / "runs" / ("sapd" if name == "sapd_student" else name)
        import torch
        with torch.no_grad():
            plain = AutoModelForCausalLM.from_pretrained(folder)(ids).logits
            ours = load_causal_lm(model_folder(str(run)))(ids).logits
        assert torch.allclose(plain, ours, atol=1e-5), name

    # what the demo wrote plugs into the next commands as it is: its student (a model folder), its trained
    # teacher (a run root: it stands for its newest committed model) and its pool, in `sapd run`, then
    # `sapd evaluate`
    import subprocess
    import sys
    from pathlib import Path

    import yaml
    mine = tmp_path / "byo"
    cfg = {"run_root": str(mine), "variant": "sapd",
           "model": {"student": str(out / "models" / "student"), "teacher": str(out / "runs" / "sft_teacher")},
           "data": {"input": str(out / "pools" / "train.jsonl"), "format": "native", "benchmark": "textworld"},
           "sampling": {"group_size": 2, "max_new_tokens": 12},
           "train": {"rounds": 1, "trajectories_per_round": 2, "minibatch_prefixes": 2, "micro_batch_prefixes": 2,
                     "lr": 1e-6}}
    (tmp_path / "byo.yaml").write_text(yaml.safe_dump(cfg))
    sapd = [sys.executable, "-m", "sapd.cli"]
    repo = Path(__file__).resolve().parents[1]
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
    assert not [line for line in (run.stderr + ev.stderr).splitlines() if any(n in line for n in noise)]
