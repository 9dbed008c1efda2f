"""Under DeepSpeed ZeRO 1–3 (2 CPU ranks, gloo) training projects to the vocabulary at response
positions only, through the engine's forward, with the loss, gradient norm and update of the full
(B, S, V)-logits path; ZeRO-3 builds the student partitioned (each rank holds 1/2 of it)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import free_port
from tests.pipeline_util import make_models, ranks_failed

pytest.importorskip("deepspeed")

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.parametrize("zero_stage", [1, 2, 3])
def test_head_only_logits_under_zero_match_full_logits(tmp_path, zero_stage):
    student, teacher = make_models(tmp_path / "models")
    port = str(free_port())
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": port, "PYTHONPATH": str(REPO),
           "TORCH_EXTENSIONS_DIR": os.environ.get("TORCH_EXTENSIONS_DIR", str(REPO / ".cache" / "torch_extensions"))}
    out = tmp_path / "result"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", port, "tests/head_only_ds_worker.py", student, teacher, str(zero_stage),
           str(tmp_path / "run"), str(out)]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, ranks_failed(proc)
    for rank in (0, 1):
        r = json.loads(Path(f"{out}.rank{rank}.json").read_text())
        print(f"\nZeRO-{zero_stage} rank {rank}: {json.dumps({k: v for k, v in r.items() if k != 'shapes'})}")
        assert r["loss_a"] == pytest.approx(r["loss_b"], abs=1e-6)
        assert r["grad_norm_a"] == pytest.approx(r["grad_norm_b"], rel=1e-5) and r["grad_norm_a"] > 0
        assert r["max_weight_diff"] <= 1e-6 and r["max_update"] > 1e-4  # the step moved the weights, equally
        B, S, T, V = 3, r["sequence_length"], r["response_length"], r["vocab"]
        # head-only: the head's only output is (B, T, V), T the longest response; the full path's (B, S, V)
        assert r["shapes"]["a"] == [[B, T, V]], r["shapes"]
        assert r["shapes"]["b"] == [[B, S, V]] and T < S, r["shapes"]
        if zero_stage == 3:
            assert r["local_numel"] == 0  # no whole tensor on the rank: parameters live in ds_tensor partitions
            assert r["partition_numel"] * 2 <= r["full_numel"] + 2 * r["n_params"], r  # ⌈n/2⌉ per tensor
            assert r["partition_numel"] * 2 >= r["full_numel"], r
