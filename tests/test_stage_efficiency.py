"""bench/stage_efficiency.py in its dry-run mode: each stage's time and its floor are measured and the
ratio printed."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_stage_efficiency_dry_run(tmp_path):
    out = tmp_path / "eff.json"
    proc = subprocess.run([sys.executable, "bench/stage_efficiency.py", "--dry-run", "--json", str(out)], cwd=REPO,
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
