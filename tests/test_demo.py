"""The embedded demo end to end at a very small size: games, expert pool, SFT teacher/student, SAPD,
held-out evaluation and the reports."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("textworld")


@pytest.mark.slow
def test_demo_small(tmp_path):
    from sapd.demo import MODELS, run_demo

    out = tmp_path / "demo-out"
    summary = run_demo(out, log=lambda s: None, show_progress=False, families=["simple", "coin"],
                       train_games_per_family=2, heldout_games_per_family=1, teacher_rounds=2, student_rounds=1,
                       sapd_rounds=1, horizon=3, max_new_tokens=16)
    for name in ("REPORT.md", "success.png", "evaluation.json", "demo-summary.json", "sapd/report/training.png",
                 "pool/textworld_expert.jsonl"):
        assert (out / name).is_file(), name
    evaluation = json.loads((out / "evaluation.json").read_text())
    assert set(evaluation["models"]) == set(MODELS)
    for name, e in evaluation["models"].items():
        assert set(e["by_category"]) == {"simple", "coin"}, name
        assert all(0.0 <= c["success"] <= 1.0 and c["episodes"] == 1 for c in e["by_category"].values())
        assert e["overall"]["episodes"] == 2
    report = (out / "REPORT.md").read_text()
    assert all(name in report for name in MODELS) and "Stage timings" in report
    assert summary["seconds"] > 0
