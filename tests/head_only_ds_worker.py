"""One rank of the DeepSpeed head-only check (tests/engines/test_deepspeed_head_only.py runs it under
``torchrun``, 2 CPU ranks, gloo): for ZeRO stage ``argv[2]``, the head-only engine (DeepSpeed wrapped
around :class:`sapd.models.scoring.HeadOnlyLM`, what ``train.engine: deepspeed`` builds) against
DeepSpeed around the plain HF model (the full (B, S, V) logits): the same loss, the same global grad
norm, the same updated weights; the head's output shapes of both; with ZeRO-3 the model as built by
``load_partitioned`` (what each rank holds). Writes ``{out}.rank{r}.json``."""

from __future__ import annotations

import json
import sys

import torch

from sapd.config import config_from_dict
from sapd.engines.deepspeed_engine import DeepSpeedEngine, deepspeed_config, load_partitioned, make_deepspeed_engine
from sapd.models.scoring import HeadOnlyLM, response_logprobs
from tests.pipeline_util import tiny_config


def main(model_dir: str, teacher_dir: str, stage: str, run_root: str, out: str) -> None:
    import deepspeed
    cfg = config_from_dict(tiny_config(run_root, model_dir, teacher_dir,
                                       train={"engine": "deepspeed", "zero_stage": int(stage), "lr": 1e-2}))
    result: dict = {}

    def build():
        if int(stage) == 3:
            return load_partitioned(model_dir, cfg)
        from sapd.models.loading import load_causal_lm
        return load_causal_lm(model_dir, trainable=True)

    from sapd.engines.deepspeed_engine import init_distributed
    init_distributed()
    world = torch.distributed.get_world_size()
    lm_a = build()
    if int(stage) == 3:  # what each rank holds right after construction: its partition only
        result["local_numel"] = sum(p.data.numel() for p in lm_a.parameters())
        result["partition_numel"] = sum(p.ds_tensor.numel() for p in lm_a.parameters())
        result["full_numel"] = sum(p.ds_numel for p in lm_a.parameters())
        result["n_params"] = len(list(lm_a.parameters()))
    a = make_deepspeed_engine(lm_a, cfg)
    assert isinstance(a.model.module, HeadOnlyLM)
    lm_b = build()
    ds_b, _, _, _ = deepspeed.initialize(model=lm_b, model_parameters=lm_b.parameters(),
                                         config=deepspeed_config(cfg, world))
    b = DeepSpeedEngine(ds_b, lm_b, cfg)
    shapes: dict[str, list] = {"a": [], "b": []}
    lm_a.get_output_embeddings().register_forward_hook(lambda m, i, o: shapes["a"].append(list(o.shape)))
    lm_b.get_output_embeddings().register_forward_hook(lambda m, i, o: shapes["b"].append(list(o.shape)))
    rank = torch.distributed.get_rank()
    g = torch.Generator().manual_seed(rank)
    vocab = lm_a.config.vocab_size
    prompts = [torch.randint(5, vocab, (n,), generator=g).tolist() for n in (30, 22, 41)]
    responses = [torch.randint(5, vocab, (n,), generator=g).tolist() for n in (6, 9, 4)]
    for name, eng in (("a", a), ("b", b)):
        eng.model.train()
        logp, mask = response_logprobs(eng.model, prompts, responses, 0)
        loss = -(logp * mask).sum() / mask.sum()
        eng.backward(loss)
        result[f"loss_{name}"] = float(loss)
        result[f"grad_norm_{name}"] = eng.step(1e-2)
    params_a, params_b = list(lm_a.parameters()), list(lm_b.parameters())
    from sapd.models.loading import load_causal_lm
    before = list(load_causal_lm(model_dir).parameters())  # an ordinary model: the ZeRO-3 switch is off again
    with a.gather(params_a), b.gather(params_b):
        result["max_weight_diff"] = max((x.detach() - y.detach()).abs().max().item() for x, y in zip(params_a, params_b))
        result["max_update"] = max((x.detach() - y).abs().max().item() for x, y in zip(params_a, before))
    result["shapes"] = shapes
    result["sequence_length"] = max(len(p) + len(r) for p, r in zip(prompts, responses))
    result["response_length"] = max(len(r) for r in responses)
    result["vocab"] = vocab
    with open(f"{out}.rank{rank}.json", "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(*sys.argv[1:6])
