"""`bench/round_overhead.py` as its user runs it: one command, the harness, a real S3 server; a short run
(2 rounds, the three modes its last line compares and the persistent workers as plain processes) that must
end with its line and with every mode's weights equal to `sapd run`'s, bit for bit; the processes' logs
are kept, each line stamped with its time. The timings themselves are the bench's report, not asserted:
they depend on the machine's load (docs/results/ROUND_OVERHEAD.md has the measured figures)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_the_bench_runs_every_mode_and_ends_with_its_line(tmp_path):
    out = tmp_path / "round_overhead.json"
    proc = subprocess.run([sys.executable, "bench/round_overhead.py", "--rounds", "2",
                           "--modes", "sapd-run,per-round,persistent,processes", "--json", str(out), "--keep"],
                          cwd=REPO, capture_output=True, text=True, timeout=3000)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    lines = proc.stdout.strip().splitlines()
    assert re.fullmatch(r"round overhead: persistent \d+\.\d\d× sapd run, per-round Jobs \d+\.\d\d× \(2 rounds\)",
                        lines[-1]), lines[-1]
    assert "checkpoint 2 of every run without overlap: the same weights, bit for bit" in proc.stdout
    data = json.loads(out.read_text())
    runs = {r["mode"]: r for r in data["runs"]}
    assert set(runs) == {"sapd-run", "per-round", "persistent", "processes"}
    assert re.search(r"^persistent workers as processes, no cluster: \d+\.\d\d× sapd run; the persistent Jobs "
                     r"\d+\.\d\d× those processes' rounds$", proc.stdout, re.M), proc.stdout
    kept = Path(re.search(r"^kept: (\S+) ", proc.stdout, re.M).group(1))
    try:
        trainer = (kept / "rb-processes-0-train.log").read_text()
        # each line stamped with its seconds since the command; the trainer committed both rounds, in order
        stamps = [float(m) for m in re.findall(r"^\[ *([\d.]+)\] round \d: checkpoint \d committed", trainer, re.M)]
        assert len(stamps) == 2 and stamps[0] < stamps[1], trainer
        assert "model load: student checkpoint 0 for training" in trainer
    finally:
        shutil.rmtree(kept, ignore_errors=True)
    for r in runs.values():
        assert sorted(int(k) for k in r["commits"]) == [0, 1, 2]  # every checkpoint seen committed, in order
        assert 0 < r["rounds_s"] < r["total_s"]
    assert len({r["weights_sha256"] for r in runs.values()}) == 1
