"""bench/stage_efficiency.py in its dry-run mode: each stage's time and its floor are measured and the
ratio printed."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def test_stage_efficiency_dry_run(tmp_path):
    out = tmp_path / "eff.json"
    proc = subprocess.run([sys.executable, "bench/stage_efficiency.py", "--dry-run", "--json", str(out),
                           "--stages", "sampling,scoring,pi_old,training"], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    res = json.loads(out.read_text())
    assert set(res) == {"sampling", "scoring", "pi_old", "training"}
    for r in res.values():
        assert r["seconds"] > 0 and r["floor_seconds"] > 0 and r["ratio"] > 0
    assert 0 < res["sampling"]["tokens"] <= 2 * 6  # G=2 responses of ≤ 6 tokens
    assert res["scoring"]["tokens"] > 2 * 6  # the prompt once + both responses
    assert "| sampling |" in proc.stdout and "| scoring |" in proc.stdout and "ratio to floor" in proc.stdout
    # π_old and training run over the same P·G sequences as their floors: 2 prefixes × G=2, prompt + 6 tokens
    assert res["pi_old"]["tokens"] == res["training"]["tokens"] == 4 * (res["scoring"]["tokens"] - 2 * 6 + 6)
    assert "| pi_old |" in proc.stdout and "| training |" in proc.stdout


@pytest.mark.slow
def test_stage_efficiency_deepspeed_ranks_dry_run(tmp_path):
    """One training round of the same committed inputs by the torch engine and by DeepSpeed on 1 and 2
    ranks under torchrun: each measured, the same optimizer steps in each, the ratios printed."""
    pytest.importorskip("deepspeed")
    out = tmp_path / "ds.json"
    proc = subprocess.run([sys.executable, "bench/stage_efficiency.py", "--dry-run", "--stages", "deepspeed",
                           "--json", str(out)], cwd=REPO, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    res = json.loads(out.read_text())
    runs = ("torch_1_process", "deepspeed_1_rank", "deepspeed_2_ranks", "deepspeed_1_rank_spinning")
    assert set(res) == {*runs, "deepspeed_ranks"}
    steps = {res[r]["optimizer_steps"] for r in runs}
    assert len(steps) == 1 and steps.pop() >= 1  # every engine trained the same round
    assert {res[r]["prefixes"] for r in runs} == {res["torch_1_process"]["prefixes"]} and res["torch_1_process"]["prefixes"] > 0
    for r in runs:
        assert res[r]["wall_seconds"] > res[r]["loop_seconds"] > 0
    d = res["deepspeed_ranks"]
    assert d["wall_ratio_2_vs_1"] == res["deepspeed_2_ranks"]["wall_seconds"] / res["deepspeed_1_rank"]["wall_seconds"]
    assert "2 ranks vs 1 rank (DeepSpeed): wall" in proc.stdout and "| deepspeed_2_ranks | 2 × " in proc.stdout
