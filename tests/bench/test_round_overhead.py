"""`bench/round_overhead.py` as its user runs it: one command, the harness, a real S3 server; a short run
(2 rounds, the three modes its last line compares) that must end with its line and with every mode's
weights equal to `sapd run`'s, bit for bit. The timings themselves are the bench's report, not asserted:
they depend on the machine's load (docs/results/EFFICIENCY.md has the measured figures)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_the_bench_runs_every_mode_and_ends_with_its_line(tmp_path):
    out = tmp_path / "round_overhead.json"
    proc = subprocess.run([sys.executable, "bench/round_overhead.py", "--rounds", "2",
                           "--modes", "sapd-run,per-round,persistent", "--json", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=3000)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    lines = proc.stdout.strip().splitlines()
    assert re.fullmatch(r"round overhead: persistent \d+\.\d\d× sapd run, per-round Jobs \d+\.\d\d× \(2 rounds\)",
                        lines[-1]), lines[-1]
    assert "checkpoint 2 of every run without overlap: the same weights, bit for bit" in proc.stdout
    data = json.loads(out.read_text())
    runs = {r["mode"]: r for r in data["runs"]}
    assert set(runs) == {"sapd-run", "per-round", "persistent"}
    for r in runs.values():
        assert sorted(int(k) for k in r["commits"]) == [0, 1, 2]  # every checkpoint seen committed, in order
        assert 0 < r["rounds_s"] < r["total_s"]
    assert len({r["weights_sha256"] for r in runs.values()}) == 1
