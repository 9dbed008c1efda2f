"""π_old is computed once per round in total: on 2 ranks each computes its share of the round's
micro-batches and the ranks exchange them; the values and the losses built on them equal today's
every-rank-computes-everything path to ≤ 1e-6 (2 CPU processes, gloo)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import free_port
from tests.pipeline_util import make_models, ranks_failed

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_old_logprobs_once_per_round_on_two_ranks(tmp_path):
    student, teacher = make_models(tmp_path / "models")
    port = str(free_port())
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
    out = tmp_path / "result"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", port, "tests/old_logp_worker.py", student, teacher, str(tmp_path / "run"), str(out)]
    proc = subprocess.run(cmd, cwd=REPO, env={**env, "PYTHONPATH": str(REPO)}, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, ranks_failed(proc)
    ranks = [json.loads(Path(f"{out}.rank{r}.json").read_text()) for r in (0, 1)]
    # 3 micro-batches over 2 ranks: 2 forward passes each (rank 1's second is the dropped repeat), against
    # 3 per rank (6 in all) when every rank computes the whole round
    assert [r["passes"] for r in ranks] == [2, 2] and [r["forwards"] for r in ranks] == [2, 2]
    for r in ranks:
        assert r["lengths_equal"]
        assert r["max_diff"] <= 1e-6, r
        for shared, everything in r["losses"]:
            assert abs(shared - everything) <= 1e-6, r["losses"]
    assert sum(ranks[0]["losses"], []) == pytest.approx(sum(ranks[1]["losses"], []), abs=1e-6)
