"""Every rank on its own GPU from the first byte (issue #37 item 4): under torchrun with 2 processes, the
train job resolves ``model.device: cuda`` to ``cuda:LOCAL_RANK``, makes it the process's current device and
only then loads the student onto it; an explicit ``cuda:N`` that would put every rank on one GPU is
refused. No GPU here: tests/rank_device_worker.py records the device each rank sets and passes to the
loader, through the real door (``sapd.jobs.train.main``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from sapd.config import ConfigError, config_from_dict
from sapd.models.devices import rank_device
from tests.conftest import free_port
from tests.pipeline_util import make_models, ranks_failed, tiny_config

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_two_ranks_each_load_onto_their_own_gpu(tmp_path):
    from sapd.stages.build_prefixes import ensure_initial_checkpoint
    student, teacher = make_models(tmp_path / "models")
    cfg = config_from_dict(tiny_config(str(tmp_path / "run"), student, teacher, model={"device": "cuda"},
                                       train={"engine": "deepspeed", "minibatch_prefixes": 4,
                                              "micro_batch_prefixes": 2}))
    ensure_initial_checkpoint(cfg, log=lambda s: None)  # what the train stage reads before its model
    config = tmp_path / "run.yaml"
    from sapd.config import dump_config
    config.write_text(dump_config(cfg))
    port = str(free_port())
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu", "PYTHONPATH": str(REPO)}
    out = tmp_path / "result"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", port, "tests/rank_device_worker.py", str(config), str(out)]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, ranks_failed(proc)
    for r in (0, 1):
        rank = json.loads(Path(f"{out}.rank{r}.json").read_text())
        assert rank["local_rank"] == r
        # the current device is this rank's GPU before the model is loaded, and the model goes onto it
        assert rank["events"] == [["set_device", f"cuda:{r}"], ["load", f"cuda:{r}"]], rank


def test_the_device_a_rank_resolves():
    assert rank_device("cuda", {"LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}) == "cuda:1"
    assert rank_device("cuda", {}) == "cuda" and rank_device("cpu", {"LOCAL_RANK": "1"}) == "cpu"
    assert rank_device("cuda:1", {"LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}) == "cuda:1"
    assert rank_device("cuda:3", {"LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"}) == "cuda:3"  # one rank: its choice
    with pytest.raises(ConfigError, match=r"model.device: cuda:0 under torchrun would put every rank on GPU 0"):
        rank_device("cuda:0", {"LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"})
