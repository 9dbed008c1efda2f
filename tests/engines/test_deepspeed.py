"""DeepSpeed ZeRO data-parallel training on 2 CPU processes reproduces the single-process torch engine:
the same round log (losses, metrics, grad norms), the same checkpoint weights and optimizer state (each
rank writing its own share of it), and a checkpoint that plain transformers loads."""

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

pytest.importorskip("deepspeed")

from sapd import checkpoints, layout, storage  # noqa: E402
from sapd.config import config_from_dict  # noqa: E402
from sapd.run.local import run_pipeline  # noqa: E402
from sapd.run.report import read_step_log  # noqa: E402
from tests.conftest import free_port
from tests.pipeline_util import make_models, ranks_failed, tiny_config  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
QUIET = dict(log=lambda s: None, show_progress=False)
# 6 prefixes per minibatch in micro-batches of 3: one micro-batch per rank (the ranks check refuses a
# split that idles a rank in every step); the round's last minibatch is shorter, so there a rank runs a
# zero-weight pass
TRAIN = {"rounds": 2, "trajectories_per_round": 3, "minibatch_prefixes": 6, "micro_batch_prefixes": 3,
         "weight_decay": 0.01, "max_grad_norm": 0.5}
METRICS = ("loss", "loss_tok", "loss_step", "loss_rule", "teacher_student_gap", "clip_fraction", "grad_norm", "lr")


def _train_round(cfg_path: Path, k: int) -> tuple[str, float]:
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
           "OMP_NUM_THREADS": "1", "TORCH_EXTENSIONS_DIR": os.environ.get("TORCH_EXTENSIONS_DIR",
                                                                          str(REPO / ".cache" / "torch_extensions"))}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", env["MASTER_PORT"], "-m", "sapd.cli", "train-round", str(cfg_path), "--round", str(k),
           "--no-progress"]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, ranks_failed(proc)
    return out, time.perf_counter() - t0


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """A: the single-process torch reference, two rounds (round 1 resumes from checkpoint 1's optimizer
    state)."""
    tmp = tmp_path_factory.mktemp("reference")
    models = make_models(tmp / "models")
    root = tmp / "a"
    run_pipeline(config_from_dict(tiny_config(str(root), *models, train=TRAIN)), **QUIET)
    return models, root


@pytest.mark.slow
# "auto" runs G full sequences under DeepSpeed; "on" runs each prompt once (two forward calls per
# micro-batch on every rank, so ZeRO-3's collective forward stays in step across uneven shares)
@pytest.mark.parametrize("zero_stage,shared_prompt", [(1, "auto"), (2, "auto"), (3, "auto"), (3, "on")])
def test_deepspeed_zero_on_two_ranks_matches_one_process(tmp_path, reference, zero_stage, shared_prompt):
    from transformers import AutoModelForCausalLM
    models, root_a = reference
    root_b = tmp_path / "b"
    # B: the same committed inputs (prefixes, round 0's and round 1's scored shards, checkpoint 0), its
    # own config (run_root b, engine deepspeed), then each round trained by DeepSpeed on 2 processes
    for uri in (layout.prefixes_dir(str(root_a)), layout.round_dir(str(root_a), 0), layout.round_dir(str(root_a), 1),
                layout.checkpoint_dir(str(root_a), 0)):
        rel = os.path.relpath(uri, root_a)
        shutil.copytree(root_a / rel, root_b / rel)
    # ZeRO-3 writes its checkpoints in several small shards, each gathered on its own
    shard = {"checkpoint_shard_mb": 0.1} if zero_stage == 3 else {}
    cfg_b = tiny_config(str(root_b), *models, train={**TRAIN, "engine": "deepspeed", "zero_stage": zero_stage,
                                                     "shared_prompt": shared_prompt, **shard})
    cfg_path = tmp_path / "b.yaml"
    cfg_path.write_text(yaml.safe_dump(cfg_b))
    seconds = []
    for k in (0, 1):
        out, s = _train_round(cfg_path, k)
        seconds.append(s)
        assert f"round {k}: checkpoint {k + 1} committed" in out, out[-3000:]

    steps_a, steps_b = read_step_log(str(root_a)), read_step_log(str(root_b))
    assert [s["step"] for s in steps_b] == [s["step"] for s in steps_a] and len(steps_a) >= 4
    assert [s["prefixes"] for s in steps_b] == [s["prefixes"] for s in steps_a]
    micro_counts = {-(-s["prefixes"] // TRAIN["micro_batch_prefixes"]) for s in steps_a}
    assert any(n % 2 for n in micro_counts) and any(n > 1 for n in micro_counts), micro_counts  # uneven shares
    diffs = {key: max(abs(x[key] - y[key]) for x, y in zip(steps_a, steps_b)) for key in METRICS}
    print(f"\nZeRO-{zero_stage}, 2 ranks vs 1 process: max |diff| {json.dumps(diffs)}; "
          f"torchrun seconds per round {[round(s, 1) for s in seconds]}")
    for key in METRICS:
        assert [y[key] for y in steps_b] == pytest.approx([x[key] for x in steps_a], rel=1e-4, abs=1e-7), key

    for k in (1, 2):
        wa = checkpoints.load_checkpoint_model(str(root_a), k).state_dict()
        folder_b = checkpoints.checkpoint_model_path(str(root_b), k)
        assert (folder_b / "model.safetensors.index.json").exists() == (zero_stage == 3), sorted(folder_b.iterdir())
        model_b = AutoModelForCausalLM.from_pretrained(str(folder_b))
        wb = model_b.state_dict()
        assert wa.keys() == wb.keys()
        worst = max((wa[n] - wb[n]).abs().max().item() for n in wa)
        print(f"checkpoint {k}: max |weight diff| {worst:.3g}")
        for name in wa:
            torch.testing.assert_close(wb[name], wa[name], rtol=0, atol=1e-5, msg=name)
        sa, sb = checkpoints.load_trainer_state(str(root_a), k), checkpoints.load_trainer_state(str(root_b), k)
        assert (sb["global_step"], sb["round"]) == (sa["global_step"], sa["round"])
        # each rank wrote its own share of the optimizer state; gathered here (the test's own doing)
        assert {Path(f).name for f in storage.list_files(checkpoints.optimizer_dir(str(root_b), k))} == \
            {".metadata", "__0_0.distcp", "__1_0.distcp", checkpoints.ITEM_DIGESTS}
        # and rank 0 committed the digests of both ranks' files (gathered), each item's included
        items = storage.read_json(storage.join(checkpoints.optimizer_dir(str(root_b), k), checkpoints.ITEM_DIGESTS))
        assert set(items) == {"__0_0.distcp", "__1_0.distcp"} and all(items.values())
        assert {"state/optimizer/__0_0.distcp", "state/optimizer/__1_0.distcp"} <= \
            set(checkpoints.read_marker(str(root_b), k)["files"])
        oa, ob = checkpoints.consolidated_optimizer_state(str(root_a), k), checkpoints.consolidated_optimizer_state(str(root_b), k)
        assert ob["state"].keys() == oa["state"].keys() and ob["param_groups"][0]["params"] == oa["param_groups"][0]["params"]
        for i, entry in oa["state"].items():
            assert float(ob["state"][i]["step"]) == float(entry["step"])
            for key in ("exp_avg", "exp_avg_sq"):
                torch.testing.assert_close(ob["state"][i][key], entry[key], rtol=1e-4, atol=1e-8)
    # the DeepSpeed checkpoint's optimizer state, gathered, is torch AdamW's (tests/checkpoints/test_sharded_optimizer.py
    # resumes such checkpoints on other world sizes and engines)
    torch.optim.AdamW(model_b.parameters()).load_state_dict(checkpoints.consolidated_optimizer_state(str(root_b), 2))
