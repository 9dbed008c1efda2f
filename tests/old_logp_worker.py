"""One rank of the π_old-once check (run by tests/stages/test_old_logp_once.py under ``torchrun``, gloo, no
DeepSpeed): π_old computed as a 1/W share per rank and exchanged, against today's path where every
rank computes it for the whole round. Writes ``{out}.rank{r}.json``."""

from __future__ import annotations

import json
import random
import sys

import torch
import torch.distributed as dist

from sapd.config import config_from_dict
from sapd.data.scored import ScoredPrefix
from sapd.models.loading import load_causal_lm
from sapd.stages import train
from tests.pipeline_util import tiny_config


class GlooEngine:
    """The part of the Engine protocol :func:`train.recompute_old_logprobs` uses."""

    @property
    def rank(self) -> int:
        return dist.get_rank()

    @property
    def world_size(self) -> int:
        return dist.get_world_size()

    def all_gather_object(self, obj):
        out = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out


def make_prefixes(n: int, G: int, vocab: int) -> list[ScoredPrefix]:
    rng = random.Random(7)  # the same on every rank
    out = []
    for p in range(n):
        responses = [[rng.randrange(5, vocab) for _ in range(rng.randint(2, 9))] for _ in range(G)]
        out.append(ScoredPrefix(
            f"p{p}", [rng.randrange(5, vocab) for _ in range(rng.randint(4, 20))], responses,
            [[-rng.random() * 3 for _ in r] for r in responses], [[rng.random() < 0.7 for _ in r] for r in responses],
            [rng.random() for _ in range(G)]))
    return out


def main(model_dir: str, teacher_dir: str, run_root: str, out: str) -> None:
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = load_causal_lm(model_dir)
    model.eval()
    pad, vocab = 0, model.config.vocab_size
    passes_seen = [0]
    model.get_output_embeddings().register_forward_hook(lambda *a: passes_seen.__setitem__(0, passes_seen[0] + 1))
    shared = make_prefixes(5, 3, vocab)  # 3 micro-batches of 2: rank 0 takes two, rank 1 one (+ a dropped repeat)
    passes = train.recompute_old_logprobs(model, shared, pad, 2, engine=GlooEngine())
    shared_forwards = passes_seen[0]
    everything = make_prefixes(5, 3, vocab)
    train.recompute_old_logprobs(model, everything, pad, 2)  # today's: the whole round on every rank
    diff = max(abs(a - b) for x, y in zip(shared, everything) for ra, rb in zip(x.old_logp_G_T, y.old_logp_G_T)
               for a, b in zip(ra, rb))
    lengths_equal = all([len(r) for r in x.old_logp_G_T] == [len(r) for r in x.responses_G_T] for x in shared)
    cfg = config_from_dict(tiny_config(run_root, model_dir, teacher_dir))
    model.train()
    losses = []
    for s in range(0, 5, 2):
        a, _ = train._micro_loss(model, cfg, shared[s:s + 2], pad)
        b, _ = train._micro_loss(model, cfg, everything[s:s + 2], pad)
        losses.append([float(a), float(b)])
    with open(f"{out}.rank{dist.get_rank()}.json", "w") as f:
        json.dump({"passes": passes, "forwards": shared_forwards, "max_diff": diff, "lengths_equal": lengths_equal,
                   "losses": losses}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:5])
