"""bench/gpu_check.py in its CPU dry-run mode: the GPU proof script itself works end to end (models built
from a config, the HF pipeline timed, DeepSpeed ZeRO-2 on the same scored round agreeing with the torch
engine, vLLM reported as skipped where it is not installed) and writes its table."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_gpu_check_dry_run(tmp_path):
    pytest.importorskip("deepspeed")
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "TORCH_EXTENSIONS_DIR": os.environ.get("TORCH_EXTENSIONS_DIR", str(REPO / ".cache" / "torch_extensions"))}
    proc = subprocess.run([sys.executable, "bench/gpu_check.py", "--dry-run", "--out", str(tmp_path)], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads((tmp_path / "gpu_check.json").read_text())
    assert res["mode"] == "dry-run (CPU)" and res["parameters"] > 0
    hf = res["hf_torch"]
    assert hf["status"] == "ok" and hf["rounds"] == 2 and hf["optimizer_steps"] >= 2
    assert hf["sample_tokens_per_s"] > 0 and hf["score_tokens_per_s"] > 0 and hf["step_seconds_median"] > 0
    ds = res["deepspeed_zero2"]
    assert ds["status"] == "ok" and ds["rounds"] == 1 and ds["first_loss_vs_torch"] < 1e-5
    reuse = res["engine_reuse"]
    assert reuse["status"] == "ok" and reuse["tokens_match_fresh"] is True and reuse["in_place_seconds"] > 0
    vllm = res["vllm"]
    assert vllm["status"] == "skipped" and vllm["reason"]
    md = (tmp_path / "gpu_check.md").read_text()
    assert "| hf_torch | ok |" in md and "| deepspeed_zero2 | ok |" in md and "| vllm | skipped" in md
    assert "student engine reuse: ok; in-place weight load" in md
    assert not (tmp_path / "gpu-check-work").exists()  # scratch removed
