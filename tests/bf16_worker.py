"""One process (or one rank under ``torchrun``, gloo, CPU) of the bf16-master checks in
tests/engines/test_bf16_master.py. For every job in the JSON list ``argv[1]``:

* ``{"do": "train", "config": {...}}`` — the train stage of round 0 (:func:`sapd.stages.train.run_train_stage`,
  what ``sapd train-round`` runs) on a run root the test seeded with a scored round and checkpoint 0;
* ``{"do": "pipeline", "config": {...}}`` — ``sapd run``'s :func:`sapd.run.local.run_pipeline` (one process);
* ``{"do": "restore", "config": {...}, "root": R, "model_from": K0}`` — an engine of the config built from
  checkpoint ``K0``'s model folder of ``R``, then checkpoint 1's optimizer state restored into it: how, the
  log, the fp32 master and the bf16 module weights it leaves, gathered whole (test-side only) and compared
  with the saved master (or, where the checkpoint has none — :func:`write_as_before_master` — with the
  bf16 weights it started from).

Writes ``{out}.rank{r}.json``: per job its log lines and figures."""

from __future__ import annotations

import gc
import io
import json
import sys
from typing import Any

import torch

from sapd import checkpoints, layout, storage


def write_as_before_master(root: str, k: int, moments_dtype: torch.dtype = torch.float32) -> None:
    """Rewrite checkpoint ``k`` of ``root`` in place as sapd wrote it before it kept an fp32 master: its
    optimizer state in format dcp-adamw/1 (the moments only, in ``moments_dtype``: the torch engine's were
    bf16 then); checkpoint 0 (a master and no moments) without any state. The commit marker records the
    digests of the files as rewritten (the model folder's are kept), so loading them is still checked."""
    marker = checkpoints.read_marker(root, k)
    state = checkpoints.load_trainer_state(root, k)
    assert state is not None and "files" in marker
    desc = state[checkpoints.SHARDED_KEY]
    state_dir = layout.checkpoint_state_dir(root, k)
    files = {name: d for name, d in marker["files"].items() if not name.startswith("state/")}
    if desc["step"] is None:
        storage.delete_prefix(checkpoints.optimizer_dir(root, k))
        storage.delete(storage.join(state_dir, "trainer.pt"))
        marker = {key: v for key, v in marker.items() if key != "optimizer"}
        storage.write_json(layout.checkpoint_marker(root, k), {**marker, "has_state": False, "files": files})
        return
    whole = checkpoints.consolidated_optimizer_state(root, k)
    assert whole is not None
    tensors = [{key: whole["state"][i][key].reshape(-1).to(moments_dtype) for key in checkpoints.STATE_KEYS}
               for i in range(len(desc["numels"]))]
    old = checkpoints.OptimizerShard(desc["numels"], [[(0, t)] for t in tensors], desc["hyper"], desc["step"], True,
                                     [tuple(s) for s in desc["shapes"]], checkpoints.STATE_KEYS)
    storage.delete_prefix(checkpoints.optimizer_dir(root, k))
    written = checkpoints.save_optimizer_shards(checkpoints.optimizer_dir(root, k), old)
    files.update(checkpoints.record_optimizer_files(root, k, written))
    legacy = {key: v for key, v in desc.items() if key != "keys"}
    buf = io.BytesIO()
    torch.save({**state, checkpoints.SHARDED_KEY: {**legacy, "format": "dcp-adamw/1"}}, buf)
    files["state/trainer.pt"] = storage.digest(buf.getbuffer())
    storage.write_bytes(storage.join(state_dir, "trainer.pt"), buf.getvalue())
    storage.write_json(layout.checkpoint_marker(root, k),
                       {**marker, "optimizer": "dcp-adamw/1", "files": dict(sorted(files.items()))})


def _full_master_and_weights(engine) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(fp32 master, bf16 module weight) of every parameter, whole (collectives under DeepSpeed)."""
    out = []
    for i, p in enumerate(engine.module.parameters()):
        if hasattr(engine, "masters"):  # the torch engine
            out.append((engine.masters[i].detach().clone(), p.detach().clone()))
            continue
        from deepspeed.utils import safe_get_full_fp32_param
        master = safe_get_full_fp32_param(p).detach().float().reshape(getattr(p, "ds_shape", p.shape)).clone()
        with engine.gather([p]):
            weight = p.detach().clone()
        out.append((master, weight))
    return out


def restore_and_compare(job: dict[str, Any], lines: list[str]) -> dict[str, Any]:
    from sapd.config import config_from_dict
    from sapd.engines.base import engine_factory_for
    from sapd.engines.deepspeed_engine import init_distributed, load_partitioned
    from sapd.models.loading import load_causal_lm

    cfg = config_from_dict(job["config"])
    root = job["root"]
    if cfg.train.engine == "deepspeed":
        init_distributed()
    folder = str(checkpoints.checkpoint_model_path(root, job["model_from"]))
    if cfg.train.engine == "deepspeed" and cfg.train.zero_stage == 3:
        model = load_partitioned(folder, cfg)
    else:
        model = load_causal_lm(folder, dtype=cfg.model.dtype, trainable=True)
    engine = engine_factory_for(cfg)(model, cfg)
    before = [w for _, w in _full_master_and_weights(engine)]
    how = checkpoints.restore_optimizer(root, 1, engine, checkpoints.load_trainer_state(root, 1), log=lines.append)
    saved = checkpoints.consolidated_optimizer_state(root, 1)
    assert saved is not None
    after = _full_master_and_weights(engine)
    wanted = [saved["state"][i]["master"] if "master" in saved["state"][i] else b.float()
              for i, b in enumerate(before)]
    return {"restored": how, "rank": engine.rank,
            "master_vs_saved": max(float((m - w).abs().max()) for (m, _), w in zip(after, wanted)),
            "weights_vs_master_rounding": max(float((b.float() - m.to(torch.bfloat16).float()).abs().max())
                                              for m, b in after),
            "weights_changed_by_restore": sum(int((b0 != b).sum()) for b0, (_, b) in zip(before, after))}


def main(jobs_json: str, out: str) -> None:
    from sapd.config import config_from_dict

    results = []
    rank = 0
    for job in json.loads(jobs_json):
        lines: list[str] = []
        torch.manual_seed(0)
        if job["do"] == "train":
            from sapd.stages.train import run_train_stage
            run_train_stage(config_from_dict(job["config"]), 0, log=lines.append, show_progress=False)
            results.append({"job": job["do"], "log": lines})
        elif job["do"] == "pipeline":
            from sapd.run.local import run_pipeline
            run_pipeline(config_from_dict(job["config"]), log=lines.append, show_progress=False)
            results.append({"job": job["do"], "log": lines})
        else:
            figures = restore_and_compare(job, lines)
            rank = figures.pop("rank")
            results.append({"job": job["do"], "log": lines, **figures})
        if torch.distributed.is_initialized():
            rank = torch.distributed.get_rank()
        gc.collect()
    with open(f"{out}.rank{rank}.json", "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
