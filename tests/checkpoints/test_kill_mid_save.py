"""SIGKILL in the middle of writing the sharded optimizer state: the checkpoint stays uncommitted, and the
round run again ends exactly where the uninterrupted run ends (weights, optimizer state — the fp32 master
of a bf16 run included — and the next round's losses). The kill is a real SIGKILL of the training process,
sent by itself from inside the write of its optimizer shard (a ``sitecustomize`` hook put on the path of
that run only), on one process (torch engine, float32 and bf16) and on rank 1 of 2 (DeepSpeed ZeRO-2 in
bf16, rank 0 then taken down by torchrun)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import textwrap
from pathlib import Path

import pytest
import torch
import yaml

from sapd import checkpoints, layout
from sapd.config import config_from_dict
from sapd.run.local import run_pipeline
from sapd.run.report import read_step_log
from sapd.stages.build_prefixes import ensure_initial_checkpoint
from tests.pipeline_util import cpu_ranks_env, make_models, ranks_command, tiny_config

REPO = Path(__file__).resolve().parents[2]
TRAIN = {"rounds": 2, "trajectories_per_round": 3, "minibatch_prefixes": 4, "micro_batch_prefixes": 2,
         "weight_decay": 0.01}

HOOK = textwrap.dedent('''
    import os, signal
    if os.environ.get("RANK", "0") == os.environ.get("SAPD_TEST_KILL_RANK"):
        from sapd import storage
        _write = storage.AtomicWriter.write

        def write(self, data):
            n = _write(self, data)
            if "/state/optimizer/__" in self.uri and self.tell() > 0:  # part of its shard is written
                os.kill(os.getpid(), signal.SIGKILL)
            return n

        storage.AtomicWriter.write = write
''')


def _train_round(cfg_path: Path, k: int, ranks: int, kill_rank: int | None = None, hook_dir: Path | None = None):
    env = cpu_ranks_env()
    env.pop("SAPD_TEST_KILL_RANK", None)
    if kill_rank is not None:
        assert hook_dir is not None
        env["PYTHONPATH"] = f"{hook_dir}{os.pathsep}{REPO}"
        env["SAPD_TEST_KILL_RANK"] = str(kill_rank)
    cmd = ranks_command(["-m", "sapd.cli", "train-round", str(cfg_path), "--round", str(k), "--no-progress"], ranks)
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    """Committed inputs of two rounds (prefixes, scored rounds 0 and 1, checkpoint 0) from a torch run."""
    tmp = tmp_path_factory.mktemp("inputs")
    models = make_models(tmp / "models")
    root = tmp / "src"
    run_pipeline(config_from_dict(tiny_config(str(root), *models, train=TRAIN)), log=lambda s: None,
                 show_progress=False)
    return models, root


def _seed(src: Path, root: Path, cfg: dict) -> None:
    """The committed inputs; checkpoint 0 of a bf16 run is its own (the bf16 folder and the fp32 master)."""
    bf16 = cfg["model"].get("dtype") == "bfloat16"
    for uri in (layout.prefixes_dir(str(src)), layout.round_dir(str(src), 0), layout.round_dir(str(src), 1),
                *(() if bf16 else (layout.checkpoint_dir(str(src), 0),))):
        rel = os.path.relpath(uri, src)
        shutil.copytree(src / rel, root / rel)
    if bf16:
        ensure_initial_checkpoint(config_from_dict(cfg), lambda s: None)


@pytest.mark.slow
@pytest.mark.parametrize("engine,ranks,dtype", [("torch", 1, "float32"), ("torch", 1, "bfloat16"),
                                                ("deepspeed", 2, "bfloat16")])
def test_sigkill_mid_optimizer_save_resumes_exactly(tmp_path, inputs, engine, ranks, dtype):
    if engine == "deepspeed":
        pytest.importorskip("deepspeed")
    models, src = inputs
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(HOOK)
    roots = {}
    for name in ("uninterrupted", "killed"):
        root = tmp_path / name
        raw = tiny_config(str(root), *models, model={"dtype": dtype}, train={**TRAIN, "engine": engine,
                                                                              "zero_stage": 2})
        _seed(src, root, raw)
        cfg = tmp_path / f"{name}.yaml"
        cfg.write_text(yaml.safe_dump(raw))
        roots[name] = (root, cfg)

    root, cfg = roots["uninterrupted"]
    for k in (0, 1):
        proc = _train_round(cfg, k, ranks)
        assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]

    root_k, cfg_k = roots["killed"]
    killed = _train_round(cfg_k, 0, ranks, kill_rank=ranks - 1, hook_dir=hook)
    assert killed.returncode != 0
    if ranks == 1:
        assert killed.returncode == -signal.SIGKILL
    else:
        assert "Signals.SIGKILL" in killed.stderr or "exitcode  : -9" in killed.stderr, killed.stderr[-3000:]
    assert not checkpoints.is_committed(str(root_k), 1)
    shard_dir = Path(checkpoints.optimizer_dir(str(root_k), 1))
    assert shard_dir.is_dir() and not (shard_dir / ".metadata").exists()  # killed inside the shard writes
    for k in (0, 1):
        proc = _train_round(cfg_k, k, ranks)
        assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    assert not list(Path(root_k).rglob("*.sapd-tmp"))  # the killed writer's temp file went with the redo

    for k in (1, 2):
        wa = checkpoints.load_checkpoint_model(str(root), k).state_dict()
        wb = checkpoints.load_checkpoint_model(str(root_k), k).state_dict()
        for name in wa:
            assert torch.equal(wa[name], wb[name]), (k, name)
        oa = checkpoints.consolidated_optimizer_state(str(root), k)["state"]
        ob = checkpoints.consolidated_optimizer_state(str(root_k), k)["state"]
        for i in oa:
            assert oa[i].keys() == ob[i].keys() and ("master" in oa[i]) == (dtype == "bfloat16")
            for key in oa[i]:
                assert torch.equal(oa[i][key], ob[i][key]), (k, i, key)
    la, lb = read_step_log(str(root)), read_step_log(str(root_k))
    assert [s["loss"] for s in lb] == [s["loss"] for s in la] and len(la) >= 4
