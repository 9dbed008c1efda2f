"""One rank of the sharded-optimizer resharding check (tests/checkpoints/test_sharded_optimizer.py runs it as one
process or under ``torchrun``, gloo, CPU). For every job in the JSON list ``argv[1]``:

* ``{"do": "save", "engine", "zero", "model", "root"}`` — train round 0 (3 optimizer steps) from the model
  folder, save checkpoint 1 (weights + this world's optimizer shards) into ``root``, then keep training
  round 1 in the same process: the uninterrupted run's round-1 losses;
* ``{"do": "resume", "engine", "zero", "root", "into"}`` — copy-free resume on this world size and engine:
  checkpoint 1 of ``root`` (the weights, and the optimizer state resharded onto this layout) trains round
  1; also the whole restored state gathered back (test-side only) against the saved one.

Writes ``{out}.rank{r}.json`` with, per job, the round-1 losses, the restored state's largest difference
and the share of the state this rank held."""

from __future__ import annotations

import gc
import json
import random
import sys
from typing import Any

import torch

from sapd import checkpoints
from sapd.config import config_from_dict
from sapd.engines.deepspeed_engine import init_distributed, load_partitioned, make_deepspeed_engine
from sapd.engines.torch_engine import TorchEngine, make_torch_engine
from sapd.method.objective import sft_loss
from sapd.models.loading import load_causal_lm, load_tokenizer
from sapd.models.scoring import response_logprobs
from sapd.stages import train
from tests.pipeline_util import tiny_config

# 6 sequences per minibatch in micro-batches of 2 (3 micro-batches: uneven over 2 ranks), 18 per round
TRAIN = {"minibatch_prefixes": 6, "micro_batch_prefixes": 2, "lr": 3e-3, "weight_decay": 0.01, "max_grad_norm": 1.0,
         "rounds": 4}


def _data(vocab: int, k: int) -> list[tuple[list[int], list[int]]]:
    rng = random.Random(100 + k)  # the same on every rank
    return [([rng.randrange(5, vocab) for _ in range(rng.randint(3, 9))],
             [rng.randrange(5, vocab) for _ in range(rng.randint(2, 7))]) for _ in range(18)]


def _engine(job: dict[str, Any], model_dir: str, root: str):
    cfg = config_from_dict(tiny_config(root, model_dir, model_dir,
                                       train={**TRAIN, "engine": job["engine"], "zero_stage": job.get("zero", 0)}))
    if job["engine"] == "torch":
        model = load_causal_lm(model_dir, trainable=True)
        return cfg, make_torch_engine(model, cfg)
    init_distributed()
    model = load_partitioned(model_dir, cfg) if job["zero"] == 3 else load_causal_lm(model_dir, trainable=True)
    return cfg, make_deepspeed_engine(model, cfg)


def _round(cfg, engine, k: int, global_step: int) -> tuple[list[float], int]:
    model = engine.model
    model.train()
    vocab = engine.module.config.vocab_size

    def micro_loss(chunk):
        logp, mask = response_logprobs(model, [c[0] for c in chunk], [c[1] for c in chunk], 0)
        return sft_loss(logp, mask, "token_mean")

    records, step = train.optimizer_steps(cfg, k, engine, _data(vocab, k), micro_loss, global_step,
                                          lambda r: "", log=lambda s: None, show_progress=False)
    return [r["loss"] for r in records], step


def _full_state(engine) -> dict[int, dict[str, torch.Tensor]]:
    """Every parameter's whole state, gathered (test-side only: training never does this)."""
    if isinstance(engine, TorchEngine):
        return {i: {k: v.clone() for k, v in s.items() if k != "step"}
                for i, s in engine.optimizer.state_dict()["state"].items()}
    from deepspeed.utils import safe_get_full_optimizer_state
    return {i: {key: safe_get_full_optimizer_state(p, key).detach().float().reshape(getattr(p, "ds_shape", p.shape))
                for key in checkpoints.STATE_KEYS} for i, p in enumerate(engine.module.parameters())}


def main(jobs_json: str, out: str) -> None:
    jobs = json.loads(jobs_json)
    results = []
    rank = 0
    for job in jobs:
        torch.manual_seed(0)
        random.seed(0)
        if job["do"] == "save":
            cfg, engine = _engine(job, job["model"], job["root"])
            rank = engine.rank
            _, step = _round(cfg, engine, 0, 0)
            shard = engine.optimizer_shard()
            tokenizer = load_tokenizer(job["model"])
            checkpoints.save_checkpoint(job["root"], 1, engine.module, tokenizer, train._trainer_state(engine, 0, step),
                                        gather=engine.gather, is_main=engine.is_main, optimizer=shard)
            engine.barrier()
            held = shard.held_elements() / sum(shard.numels)
            losses, _ = _round(cfg, engine, 1, step)
            results.append({"job": job, "losses": losses, "held": held, "world": engine.world_size})
        else:
            root = job["root"]
            model_dir = str(checkpoints.checkpoint_model_path(root, 1))
            cfg, engine = _engine(job, model_dir, job["into"])
            rank = engine.rank
            state = checkpoints.load_trainer_state(root, 1)
            how = checkpoints.restore_optimizer(root, 1, engine, state, log=lambda s: None)
            train._restore_rng(state)
            saved = checkpoints.consolidated_optimizer_state(root, 1)
            got = _full_state(engine)
            worst = max(float((got[i][key].float() - saved["state"][i][key].float()).abs().max())
                        for i in got for key in checkpoints.STATE_KEYS)
            held = engine.optimizer_shard().held_elements() / sum(engine.optimizer_shard().numels)
            losses, _ = _round(cfg, engine, 1, state["global_step"])
            results.append({"job": job, "losses": losses, "restored": how, "max_state_diff": worst, "held": held,
                            "world": engine.world_size})
        del engine
        gc.collect()
    with open(f"{out}.rank{rank}.json", "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
