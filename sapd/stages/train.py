"""The train stage of round k (``sapd.jobs.train``, the chart's ``train`` block), top to bottom: checkpoint k +
round k's scored shards → checkpoint k+1.

1. Load the student from checkpoint k (it sampled round k, so it *is* π_old) and its trainer state; in
   bf16 the optimizer updates the fp32 master stored with it, and the bf16 weights are its rounding.
2. Recompute π_old log-probs of every sampled token with these training weights, once, before any
   update (sampler log-probs from another engine may differ numerically; ratios must start at 1).
   Once in total: on W ranks each computes a 1/W share and the ranks exchange the results.
3. For ``epochs_per_round`` passes, shuffle the round's groups and cut them into minibatches of
   ``minibatch_prefixes`` prefixes (× G responses); each minibatch is one optimizer step, accumulated
   over micro-batches of ``micro_batch_prefixes``; gradient clipping; learning-rate schedule.
   On W ranks (``train.engine: deepspeed`` under torchrun) rank r takes micro-batches r, r+W, … of
   each minibatch, weighted so that the rank-averaged gradient is the one-process minibatch gradient.
4. Write the per-step log (each step's and the round's update of the weights the optimizer keeps:
   :class:`UpdateProbe`), then checkpoint k+1 (HF model + optimizer/RNG/cursor), committed last
   (by rank 0).

A persistent trainer (``ctx.engines.keep_trainer``: the cluster's train workers that stay up for the run)
keeps step 1's result (:class:`Trainer`: the model, the engine with its optimizer state and fp32 master,
the trainer state) from round to round: round k+1 starts from the weights and optimizer state checkpoint
k+1 was written from, which are the values a fresh process loads from it, so a killed trainer that
restarts from the last commit ends the run with the same weights.

With ``train.overlap: one_step`` round k (k ≥ 1) was sampled by checkpoint k−1: π_old is still recomputed
with the training weights (checkpoint k), and the loss weights every token by min(π_old/μ, c), μ the
sampler's own log-probs (:func:`sapd.method.objective.behaviour_weights`).

The SFT baseline (:func:`sft_round`) uses the same data path, engine and checkpoint format with
cross-entropy on the recorded responses of the round's prefixes.

Simplifications, on purpose: the schedule is a function of (round, optimizer step), so a resumed run
reproduces it exactly without a scheduler object. Each prefix's prompt runs once over its repeated KV
cache for the G responses (``train.shared_prompt``, :func:`shared_prompt_group`) for the student too —
π_old, the reference and the trained forward — where it was measured faster (the torch engine on a CPU
model, "auto"); elsewhere the G full prompt + response sequences run in one batch. Both give the same
log-probs (tests/models/test_models.py).

The engine that runs backward and the optimizer step (plain torch, or DeepSpeed ZeRO under torchrun) is
:mod:`sapd.engines`' (``train.engine``, :func:`sapd.engines.base.engine_factory_for`); this module writes
the round's loop against its protocol, :class:`sapd.engines.base.Engine`.

Entry: :func:`run` (the stage interface of :mod:`sapd.stages.context`), on every process torchrun starts.
"""

from __future__ import annotations

import json
import math
import os
import random
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from sapd import checkpoints, layout, storage
from sapd.config import ConfigError, RunConfig, micro_batch_problem, sampler_checkpoint
from sapd.data.batches import round_batch
from sapd.data.scored import ScoredPrefix, read_scored, scored_prefixes
from sapd.data.scored import committed_manifest as scored_manifest
from sapd.engines.base import Engine, EngineFactory, engine_factory_for
from sapd.engines.deepspeed_engine import load_partitioned
from sapd.method.objective import LossInputs, loss_for, objective_of, required_inputs
from sapd.models.devices import bind_rank_device, rank_device
from sapd.models.loading import load_tokenizer
from sapd.models.scoring import response_logprobs, response_logprobs_and_entropy
from sapd.progress import QUIET, Progress
from sapd.stages.context import Engines, Outcome, StageContext, Startup, Step


def learning_rate(cfg: RunConfig, k: int, global_step: int) -> float:
    """Warmup over optimizer steps, then constant / linear / cosine decay over rounds."""
    tc = cfg.train
    warm = min(1.0, (global_step + 1) / tc.warmup_steps) if tc.warmup_steps > 0 else 1.0
    progress = k / max(tc.rounds, 1)
    if tc.lr_schedule == "linear":
        decay = 1.0 - progress
    elif tc.lr_schedule == "cosine":
        decay = 0.5 * (1.0 + math.cos(math.pi * progress))
    else:
        decay = 1.0
    return tc.lr * warm * decay


# ---------------------------------------------------------------------------------------------------
# the round


def _stack_P_G_T(prefixes: Sequence[ScoredPrefix], field: str, T: int, dtype: torch.dtype) -> torch.Tensor:
    """P×G×T tensor of a ragged per-token field (``*_G_T`` lists), zero-padded to T."""
    P, G = len(prefixes), len(prefixes[0].responses_G_T)
    out = torch.zeros((P, G, T), dtype=dtype)
    for p, sp in enumerate(prefixes):
        for i, values in enumerate(getattr(sp, field)):
            if values:
                out[p, i, :len(values)] = torch.tensor(values, dtype=dtype)
    return out


def _flat_PG(prefixes: Sequence[ScoredPrefix]) -> tuple[list[list[int]], list[list[int]]]:
    """(prompt, response) token lists of every response, prefix-major: row p·G + i."""
    prompts = [sp.prompt for sp in prefixes for _ in sp.responses_G_T]
    responses = [r for sp in prefixes for r in sp.responses_G_T]
    return prompts, responses


def shared_prompt_group(mode: str, model, G: int, engine: str = "torch", zero_stage: int = 0) -> int | None:
    """The group size to pass to the log-prob functions when each prompt runs once over its repeated
    KV cache (``train.shared_prompt``), else None (G full sequences in one batch). "auto": the torch
    engine on a CPU model only (where it was measured faster). Every micro-batch is two forward calls
    either way, so ZeRO-3 ranks (whose forward is a collective) stay in step."""
    if mode == "off" or G < 2:
        return None
    if mode == "auto" and (engine != "torch" or next(model.parameters()).device.type != "cpu"):
        return None
    return G


@torch.no_grad()
def recompute_old_logprobs(model, prefixes: list[ScoredPrefix], pad_id: int, micro: int,
                           field: str = "old_logp_G_T", engine: Engine | None = None,
                           shared_prompt: str = "off", train_engine: str = "torch", zero_stage: int = 0) -> int:
    """π_old of every sampled token with the training weights (fills ``old_logp_G_T``); with
    ``field="ref_logp_G_T"`` and the initial policy as ``model``, the reference log-probs of the KL term.

    Once per round in total: the prefixes are cut into micro-batches of ``micro`` and, with ``engine``
    on W ranks, rank r computes micro-batches r, r+W, … only; the ranks then exchange their results
    (``all_gather_object``), so every rank ends with every prefix's π_old, each computed by exactly one
    rank. The micro-batches are the ones one process cuts, so the values are the one-process values.
    Every rank runs the same number of forward passes (a ZeRO-3 forward is a collective): a rank short
    of one repeats the last micro-batch and drops the result. → this rank's forward passes."""
    chunks = [prefixes[s:s + micro] for s in range(0, len(prefixes), micro)]
    W, rank = (engine.world_size, engine.rank) if engine is not None else (1, 0)
    mine = list(range(rank, len(chunks), W))
    passes = -(-len(chunks) // W)
    computed: dict[int, list[list[list[float]]]] = {}
    for j in range(passes):
        index = mine[j] if j < len(mine) else None
        chunk = chunks[len(chunks) - 1 if index is None else index]
        prompts, responses = _flat_PG(chunk)
        G = len(chunk[0].responses_G_T)
        logp_PG_T, _ = response_logprobs(model, prompts, responses, pad_id,
                                         group_size=shared_prompt_group(shared_prompt, model, G, train_engine,
                                                                        zero_stage))
        if index is None:
            continue
        computed[index] = [[logp_PG_T[q * G + i, :len(r)].tolist() for i, r in enumerate(sp.responses_G_T)]
                           for q, sp in enumerate(chunk)]
    if engine is not None:  # a world of one runs the exchange too (on a GPU: the one NCCL collective it can prove)
        for part in engine.all_gather_object(computed):
            computed.update(part)
    for index, chunk in enumerate(chunks):
        for sp, values in zip(chunk, computed[index]):
            setattr(sp, field, values)
    return passes


def load_reference(cfg: RunConfig, log: Callable[[str], None] = print):
    """Checkpoint 0 (the initial policy), for the KL term."""
    t0 = time.perf_counter()
    ref = checkpoints.load_checkpoint_model(cfg.run_root, 0, cfg.model.dtype, rank_device(cfg.model.device))
    ref.eval()
    log(f"model load: reference checkpoint 0 for loss.kl_coef ({time.perf_counter() - t0:.1f}s)")
    return ref


def compute_reference_logprobs(cfg: RunConfig, prefixes: list[ScoredPrefix], pad_id: int,
                               engine: Engine | None = None, reference: Any = None,
                               log: Callable[[str], None] = print) -> float:
    """The initial policy's (checkpoint 0's) log-probs of every sampled token, for ``loss.kl_coef`` > 0
    (SDAR's KL to the initial policy). Loads checkpoint 0 for the purpose and frees it, unless given as
    ``reference`` (a persistent trainer keeps it); returns seconds."""
    t0 = time.perf_counter()
    ref = reference if reference is not None else load_reference(cfg, log)
    recompute_old_logprobs(ref, prefixes, pad_id, cfg.train.micro_batch_prefixes, field="ref_logp_G_T", engine=engine,
                           shared_prompt=cfg.train.shared_prompt, train_engine=cfg.train.engine,
                           zero_stage=cfg.train.zero_stage)
    del ref
    return time.perf_counter() - t0


# the LossInputs built from a chunk's scored prefixes: per-token fields → (ScoredPrefix field, dtype), and
# per-response ones; each only when the objective takes it (sapd.method.objective.required_inputs)
_PER_TOKEN = {"old_logp_P_G_T": ("old_logp_G_T", torch.float32),
              "teacher_logp_P_G_T": ("teacher_logp_G_T", torch.float32),
              "ref_logp_P_G_T": ("ref_logp_G_T", torch.float32),
              "behaviour_logp_P_G_T": ("sampler_logp_G_T", torch.float32),
              "action_mask_P_G_T": ("action_mask_G_T", torch.bool)}
_PER_RESPONSE = {"rule_scores_P_G": "rule_scores_G", "advantage_P_G": "advantage_G"}


def _micro_loss(model, cfg: RunConfig, chunk: list[ScoredPrefix], pad_id: int,
                stale: bool = False) -> tuple[torch.Tensor, dict[str, float]]:
    """The objective's loss on one micro-batch: the student's forward, then the inputs its function takes
    (``stale``: the round was sampled by an older checkpoint, so the sampler's log-probs go in too)."""
    need = required_inputs(cfg.loss_cfg) | ({"behaviour_logp_P_G_T"} if stale else set())
    prompts, responses = _flat_PG(chunk)
    P, G = len(chunk), len(chunk[0].responses_G_T)
    shared = shared_prompt_group(cfg.train.shared_prompt, model, G, cfg.train.engine, cfg.train.zero_stage)
    entropy_P_G_T = None
    if "entropy_P_G_T" in need:
        new_logp_PG_T, response_mask_PG_T, entropy_PG_T = response_logprobs_and_entropy(model, prompts, responses,
                                                                                       pad_id, group_size=shared)
    else:
        new_logp_PG_T, response_mask_PG_T = response_logprobs(model, prompts, responses, pad_id, group_size=shared)
    T = new_logp_PG_T.shape[-1]
    device = new_logp_PG_T.device
    if "entropy_P_G_T" in need:
        entropy_P_G_T = entropy_PG_T.view(P, G, T)
    given: dict[str, torch.Tensor] = {}
    for name in need:
        if name in _PER_TOKEN:
            field, dtype = _PER_TOKEN[name]
            given[name] = _stack_P_G_T(chunk, field, T, dtype).to(device)
        elif name in _PER_RESPONSE:
            values = [getattr(sp, _PER_RESPONSE[name]) for sp in chunk]
            if any(v is None for v in values):
                raise ValueError(f"objective {cfg.loss_cfg.objective!r} needs {name}, which the round's rows do not "
                                 "carry" + (" (only `sapd online --method grpo` writes it)"
                                            if name == "advantage_P_G" else ""))
            given[name] = torch.tensor(values, dtype=torch.float32, device=device)
    return loss_for(cfg.loss_cfg, LossInputs(new_logp_PG_T.view(P, G, T), response_mask_PG_T.view(P, G, T),
                                             entropy_P_G_T=entropy_P_G_T, **given))


def _restore_rng(state: dict[str, Any] | None) -> None:
    """The random state a checkpoint stores: Python's, torch's CPU generator's, and on a GPU this process's CUDA
    generator's (dropout and any sampling on the device) where the checkpoint has one."""
    if state and "rng" in state:
        random.setstate(state["rng"]["python"])
        torch.set_rng_state(state["rng"]["torch"])
        cuda = state["rng"].get("cuda")
        if cuda is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.set_rng_state(cuda)


def _rng_state() -> dict[str, Any]:
    """This process's random state (see :func:`_restore_rng`): the CUDA generator's of its current device where
    this process uses CUDA."""
    out = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda"] = torch.cuda.get_rng_state()
    return out


def micro_batches(minibatch: list, micro: int) -> list[list]:
    """A minibatch cut into micro-batches of ``micro`` prefixes (the last one shorter)."""
    return [minibatch[s:s + micro] for s in range(0, len(minibatch), micro)]


@dataclass
class _Rank:
    rank: int
    world_size: int


def round_passes(n_prefixes: int, cfg: RunConfig, world_size: int) -> tuple[int, int]:
    """(forward/backward passes that carry weight, all passes) of one epoch over ``n_prefixes`` on
    ``world_size`` ranks: the minibatches and micro-batches :func:`optimizer_steps` cuts, shared by
    :func:`micro_batch_share`. 16 ranks, minibatch 16 of 143 prefixes: 36 of 144 with micro-batches of 4,
    143 of 144 with one prefix each."""
    tc = cfg.train
    items = list(range(n_prefixes))
    weighted = total = 0
    for start in range(0, n_prefixes, tc.minibatch_prefixes):
        mb = items[start:start + tc.minibatch_prefixes]
        chunks = micro_batches(mb, tc.micro_batch_prefixes)
        for r in range(world_size):
            for _, weight, _ in micro_batch_share(chunks, len(mb), _Rank(r, world_size)):  # type: ignore[arg-type]
                total += 1
                weighted += weight > 0
    return weighted, total


def micro_batch_share(chunks: list, n: int, engine: Engine) -> list[tuple[Any, float, float]]:
    """This rank's micro-batches of a minibatch of ``n`` prefixes: (chunk, loss weight, metric weight).

    One process: every micro-batch, weighted len/n, which decomposes the minibatch mean over prefixes
    exactly. W ranks: micro-batch j goes to rank j % W with loss weight W·len/n, because DeepSpeed
    *averages* the accumulated gradients over ranks (÷W): the average is then the one-process minibatch
    gradient. Every rank runs the same number of forward/backward passes (ZeRO-2/3 communicate inside
    each backward, ZeRO-3 inside each forward), so a rank short of one repeats the minibatch's last
    micro-batch with weight 0."""
    W = engine.world_size
    if W == 1:
        return [(c, len(c) / n, len(c) / n) for c in chunks]
    mine = [(c, W * len(c) / n, len(c) / n) for c in chunks[engine.rank::W]]
    return mine + [(chunks[-1], 0.0, 0.0)] * (-(-len(chunks) // W) - len(mine))


def _mean_metrics(items: list[tuple[float, dict[str, float]]], engine: Engine | None = None) -> dict[str, float]:
    """Weighted mean of the micro-batch metrics; with several ranks, of every rank's micro-batches."""
    keys = list(items[0][1])
    if engine is None or engine.world_size == 1:
        total = sum(w for w, _ in items) or 1.0
        return {key: sum(w * m[key] for w, m in items) / total for key in keys}
    sums = engine.all_reduce_sum([sum(w for w, _ in items)] + [sum(w * m[key] for w, m in items) for key in keys])
    return {key: s / (sums[0] or 1.0) for key, s in zip(keys, sums[1:])}


# ---------------------------------------------------------------------------------------------------
# the size of each update, in the weights the optimizer keeps

PROBE_ELEMENTS = 1 << 20
"""Kept-weight elements each rank reads per measurement: every s-th of its share, all of a small model."""
LOST_UPDATE_SHARE = 0.5
"""A round whose kept weights took less than this share of the update the optimizer computed warns."""
SIGNIFICAND_BITS = {torch.float32: 24, torch.bfloat16: 8, torch.float16: 11}


class UpdateProbe:
    """How far each optimizer step, and the round, moved the weights the optimizer keeps — the fp32 master,
    or a float32 model's own weights — and how much of the update it computed they took. Judged there, not
    in the bfloat16 copy that samples: at lr 1e-6 that copy legitimately changes only where the master has
    crossed half a bfloat16 step.

    * ``update_rel`` = ‖w_after − w_before‖ / ‖w_before‖ of one step; ``round_update_rel``: of the round;
    * ``update_applied_ratio`` = ⟨a, c⟩ / ⟨c, c⟩, a the change the kept weights took and c the AdamW update
      computed from the moments after the step, in float64: c = −lr·(wd·w + m̂ / (√v̂ + ε)), m̂ = m / (1 − β₁ᵗ),
      v̂ = v / (1 − β₂ᵗ). 1 when every update landed; near 0 when rounding swallowed them (in a dtype with p
      significand bits, an update smaller than half the spacing at w, 2^(⌊log₂|w|⌋ − p), is lost);
      ``round_update_applied_ratio``: the same over the round's steps.

    Measured on every s-th element of each rank's share (at most :data:`PROBE_ELEMENTS` per rank) and
    summed over the ranks: per step two small copies and an all-reduce of four numbers."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        shard = engine.optimizer_shard()
        kept = self._views(shard, checkpoints.MASTER_KEY)
        self.stride = max(1, -(-sum(v.numel() for v in kept) // PROBE_ELEMENTS))
        self.kept_dtype = kept[0].dtype if kept else torch.float32
        self.is_master = checkpoints.MASTER_KEY in shard.keys  # a copy of the model's weights, not them
        self.start = self._sample(kept)
        self.before: list[torch.Tensor] = []
        self.applied_computed = [0.0, 0.0]  # Σ⟨a, c⟩ and Σ⟨c, c⟩ over the round's steps

    @staticmethod
    def _views(shard: checkpoints.OptimizerShard, key: str) -> list[torch.Tensor]:
        return [views[key] for frags in shard.fragments for _, views in frags]

    def _sample(self, views: list[torch.Tensor]) -> list[torch.Tensor]:
        return [v.reshape(-1)[::self.stride].to(torch.float64, copy=True) for v in views]

    def _sums(self, terms: list[torch.Tensor]) -> list[float]:
        """Every rank's sums of ``terms`` (each a stack of per-fragment sums), scaled up to its whole share."""
        local = torch.stack(terms).sum(0).tolist() if terms else [0.0] * 4
        return self.engine.all_reduce_sum([x * self.stride for x in local])

    def before_step(self) -> None:
        self.before = self._sample(self._views(self.engine.optimizer_shard(), checkpoints.MASTER_KEY))

    def after_step(self, lr: float) -> dict[str, float]:
        shard = self.engine.optimizer_shard()
        keys = (checkpoints.MASTER_KEY, *checkpoints.STATE_KEYS)
        after, m, v = (self._sample(self._views(shard, key)) for key in keys)
        (beta1, beta2), eps, wd = shard.hyper["betas"], shard.hyper["eps"], shard.hyper.get("weight_decay", 0.0)
        t = float(shard.step or 1.0)
        bc1, bc2 = 1.0 - beta1 ** t, 1.0 - beta2 ** t
        terms = []
        for w0, w1, m_t, v_t in zip(self.before, after, m, v, strict=True):
            computed = -lr * (wd * w0 + (m_t / bc1) / ((v_t / bc2).sqrt() + eps))
            applied = w1 - w0
            terms.append(torch.stack([(applied * computed).sum(), (computed * computed).sum(),
                                      (applied * applied).sum(), (w0 * w0).sum()]))
        ac, cc, aa, ww = self._sums(terms)
        self.applied_computed[0] += ac
        self.applied_computed[1] += cc
        return {"update_rel": math.sqrt(aa / ww) if ww else 0.0, "update_applied_ratio": ac / cc if cc else 1.0}

    def finish(self) -> dict[str, float]:
        """The round's figures (a collective: every rank calls it after its last step)."""
        end = self._sample(self._views(self.engine.optimizer_shard(), checkpoints.MASTER_KEY))
        terms = [torch.stack([((w1 - w0) ** 2).sum(), (w0 * w0).sum(), w0.new_zeros(()), w0.new_zeros(())])
                 for w0, w1 in zip(self.start, end, strict=True)]
        dd, ww, _, _ = self._sums(terms)
        ac, cc = self.applied_computed
        return {"round_update_rel": math.sqrt(dd / ww) if ww else 0.0,
                "round_update_applied_ratio": ac / cc if cc else 1.0}

    def describe(self, k: int, rec: dict[str, Any], lr: float) -> list[str]:
        """The round's log line, and its warning when the kept weights lost most of the update."""
        name = str(self.kept_dtype).removeprefix("torch.")
        kept = "its fp32 master" if self.is_master else f"its {name} weights"
        ratio = rec["round_update_applied_ratio"]
        lines = [f"round {k} update of the weights the optimizer keeps ({kept}): ‖Δw‖/‖w‖ "
                 f"{rec['round_update_rel']:.2e}, {ratio:.1%} of the update it computed applied"]
        if ratio < LOST_UPDATE_SHARE:
            bits = SIGNIFICAND_BITS.get(self.kept_dtype, 24)
            lines.append(f"round {k}: WARNING: the weights the optimizer keeps ({name}) took only {ratio:.0%} of the "
                         f"update it computed: at lr {lr:.1e} most updates are below half the {name} spacing of the "
                         f"weights they should move (an update moves w only if it exceeds 2^(⌊log2|w|⌋−{bits})); "
                         + ("raise train.lr" if bits >= 24 else "keep an fp32 master of the weights"))
        return lines


def optimizer_steps(cfg: RunConfig, k: int, engine: Engine, items: list, micro_loss: Callable, global_step: int,
                    describe: Callable[[dict], str], *, log: Callable[[str], None] = print,
                    show_progress: bool = True, label: str = "training",
                    on_step: Callable[[dict], None] | None = None,
                    progress: Progress | None = None) -> tuple[list[dict], int]:
    """The optimizer steps of round k over ``items`` (scored prefixes, or SFT examples): each epoch
    reshuffles them with (seed, k), cuts minibatches of ``minibatch_prefixes``, accumulates the
    micro-batch losses ``micro_loss(chunk) -> (loss, metrics)`` of this rank's share, clips and steps.
    Returns the per-step records and the new global step. ``progress`` counts the steps (main rank only).
    Each record carries the step's update size (:class:`UpdateProbe`), the round's last one the round's."""
    tc = cfg.train
    order_rng = random.Random(f"{tc.seed}:{k}")
    records: list[dict] = []
    n_steps = tc.epochs_per_round * -(-len(items) // tc.minibatch_prefixes)
    probe = UpdateProbe(engine)
    progress = (progress or Progress.of(log, show_progress)) if engine.is_main else QUIET
    bar = progress.task(f"round {k} {label}", total=n_steps, unit="step")
    for epoch in range(tc.epochs_per_round):
        order = list(range(len(items)))
        order_rng.shuffle(order)
        for mb_start in range(0, len(order), tc.minibatch_prefixes):
            t_step = time.perf_counter()
            mb = [items[i] for i in order[mb_start:mb_start + tc.minibatch_prefixes]]
            chunks = micro_batches(mb, tc.micro_batch_prefixes)
            parts = []
            for chunk, weight, metric_weight in micro_batch_share(chunks, len(mb), engine):
                loss, metrics = micro_loss(chunk)
                engine.backward(loss * weight)  # weight: exact decomposition of the minibatch mean over prefixes
                parts.append((metric_weight, metrics))
            lr = learning_rate(cfg, k, global_step)
            probe.before_step()
            grad_norm = engine.step(lr)
            global_step += 1
            rec = {"round": k, "epoch": epoch, "step": global_step, "lr": lr, "grad_norm": grad_norm,
                   "prefixes": len(mb), **_mean_metrics(parts, engine), **probe.after_step(lr),
                   "step_seconds": time.perf_counter() - t_step}
            records.append(rec)
            if len(records) == n_steps:
                rec.update(probe.finish())
            bar.update()
            if on_step is not None and engine.is_main:
                on_step(rec)
            log(f"round {k} step {global_step}: {describe(rec)} |g| {grad_norm:.3f}")
    bar.close()
    if records:
        for line in probe.describe(k, records[-1], max(r["lr"] for r in records)):
            log(line)
    return records, global_step


def _trainer_state(engine: Engine, k: int, global_step: int) -> dict[str, Any]:
    """What checkpoint k+1 stores besides the weights and the (sharded) optimizer state: the step counter
    and RNG."""
    return {"global_step": global_step, "round": k + 1, "rng": _rng_state()}


def describe_step(rec: dict) -> str:
    """The log line of one optimizer step: the loss and its terms, and the signals a record has."""
    terms = [f"{key.removeprefix('loss_')} {rec[key]:.4f}" for key in rec if key.startswith("loss_")]
    line = f"loss {rec['loss']:.5f}" + (f" ({' '.join(terms)})" if terms else "")
    if "teacher_student_gap" in rec and rec["teacher_student_gap"] == rec["teacher_student_gap"]:  # not NaN
        line += f" gap {rec['teacher_student_gap']:.4f}"
    if "clip_fraction" in rec:
        line += f" clip {rec['clip_fraction']:.3f}"
    return line


def train_round(cfg: RunConfig, k: int, engine: Engine, tokenizer, prefixes: list[ScoredPrefix],
                state: dict[str, Any] | None, *, log: Callable[[str], None] = print, show_progress: bool = True,
                on_step: Callable[[dict], None] | None = None,
                progress: Progress | None = None, reference: Any = None) -> tuple[list[dict], dict]:
    """Run round k's optimizer steps on ``engine.model`` (at checkpoint k) with the config's objective:
    π_old (and the reference log-probs; ``reference``: checkpoint 0 already loaded) first when it takes
    them; a round sampled by an older checkpoint (``train.overlap: one_step``) is weighted by the sampler's
    log-probs. Returns the step records and the trainer state to store with checkpoint k+1."""
    model = engine.model
    pad = tokenizer.pad_token_id
    need = required_inputs(cfg.loss_cfg)
    stale = "old_logp_P_G_T" in need and sampler_checkpoint(cfg, k) != k
    _restore_rng(state)
    extra: dict[str, float] = {}
    if "old_logp_P_G_T" in need:
        t0 = time.perf_counter()
        model.eval()  # π_old: no dropout, same numerics as the sampler's weights
        extra["old_logp_forward_passes"] = recompute_old_logprobs(  # rank 0's: ⌈micro-batches / ranks⌉
            model, prefixes, pad, cfg.train.micro_batch_prefixes, engine=engine, shared_prompt=cfg.train.shared_prompt,
            train_engine=cfg.train.engine, zero_stage=cfg.train.zero_stage)
        extra["old_logp_seconds"] = time.perf_counter() - t0
    if "ref_logp_P_G_T" in need:
        extra["ref_logp_seconds"] = compute_reference_logprobs(cfg, prefixes, pad, engine, reference, log)
    model.train()
    if engine.world_size > 1:
        weighted, total = round_passes(len(prefixes), cfg, engine.world_size)
        log(f"round {k}: {engine.world_size} ranks, {weighted} of {total} forward/backward passes per epoch carry "
            f"weight ({weighted / total:.0%})")
    label = "sft" if objective_of(cfg.loss_cfg).data == "recorded" else "training"
    records, global_step = optimizer_steps(
        cfg, k, engine, prefixes, lambda chunk: _micro_loss(model, cfg, chunk, pad, stale),
        (state or {}).get("global_step", 0), describe_step, log=log, show_progress=show_progress, label=label,
        on_step=on_step, progress=progress)
    if records:
        records[0].update(extra)
    return records, _trainer_state(engine, k, global_step)


def recorded_prefixes(tokenizer, rows: list[dict]) -> list[ScoredPrefix]:
    """The round's prefixes with their recorded response (its text followed by EOS) as the one response of
    each (G = 1): what an objective that trains on the recorded responses (SFT) reads."""
    return [ScoredPrefix(r["prefix_id"], tokenizer(r["prompt"], add_special_tokens=False)["input_ids"],
                         [tokenizer(r["recorded_response"], add_special_tokens=False)["input_ids"]
                          + [tokenizer.eos_token_id]], [], [], [])
            for r in rows]


def sft_round(cfg: RunConfig, k: int, engine: Engine, tokenizer, rows: list[dict], state: dict[str, Any] | None,
              *, log: Callable[[str], None] = print, show_progress: bool = True,
              on_step: Callable[[dict], None] | None = None, progress: Progress | None = None,
              reference: Any = None) -> tuple[list[dict], dict]:
    """SFT baseline round: cross-entropy on the recorded response of each prefix (the response text
    followed by EOS), minibatches and micro-batches counted in prefixes exactly as SAPD's
    (:func:`train_round` over :func:`recorded_prefixes`)."""
    return train_round(cfg, k, engine, tokenizer, recorded_prefixes(tokenizer, rows), state, log=log,
                       show_progress=show_progress, on_step=on_step, progress=progress, reference=reference)


def write_round_log(root: str, k: int, records: list[dict], extra: dict[str, Any] | None = None) -> None:
    lines = [json.dumps({**rec, **(extra or {})}, sort_keys=True) for rec in records]
    storage.write_text(layout.round_log_uri(root, k), "\n".join(lines) + ("\n" if lines else ""))


@dataclass
class Trainer:
    """What a persistent trainer keeps from one round to the next: the engine (the model, its optimizer
    state, and the fp32 master where the engine keeps one), the tokenizer, the trainer state (step counter,
    RNG) that goes with the weights, and checkpoint 0 for a KL term — all at checkpoint ``checkpoint``."""

    checkpoint: int
    engine: Engine
    tokenizer: Any
    state: dict[str, Any] | None
    reference: Any = None
    prepared: bool = False  # loaded while its first round's scores were being made (:func:`prepare`)


def load_trainer(cfg: RunConfig, k: int, *, engine_factory: EngineFactory | None = None,
                 log: Callable[[str], None] = print, startup: Startup | None = None) -> Trainer:
    """Checkpoint k as training needs it: the student (ZeRO-3: each rank builds and loads only its
    partitions), the engine, the trainer state, each rank's share of the optimizer state."""
    root = cfg.run_root
    t0 = time.perf_counter()
    # this rank's own GPU (cuda:LOCAL_RANK) is its current device before any byte is allocated
    device = bind_rank_device(cfg.model.device)
    ckpt_path = checkpoints.checkpoint_model_path(root, k)
    tokenizer = load_tokenizer(str(ckpt_path))
    if cfg.train.engine == "deepspeed" and cfg.train.zero_stage == 3 and engine_factory is None:
        model = load_partitioned(str(ckpt_path), cfg)  # each rank builds and loads only its partitions
    else:
        model = checkpoints.load_checkpoint_model(root, k, cfg.model.dtype, device, trainable=True)
    log(f"model load: student checkpoint {k} for training ({time.perf_counter() - t0:.1f}s)")
    if startup is not None:
        startup.mark("models_loaded")
    if cfg.checkpointing_on():
        # transformers ≥ 5.x names it activation checkpointing (the old name warns, then goes in v6)
        (getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable)()
    engine = (engine_factory or engine_factory_for(cfg))(model, cfg)
    state = checkpoints.load_trainer_state(root, k)
    checkpoints.restore_optimizer(root, k, engine, state, log=log)  # each rank reads only its share
    if startup is not None:
        startup.mark("engines_ready")
    return Trainer(k, engine, tokenizer, state)


def run_train_stage(cfg: RunConfig, k: int, *, engine_factory: EngineFactory | None = None,
                    log: Callable[[str], None] = print, show_progress: bool = True,
                    on_step: Callable[[dict], None] | None = None,
                    progress: Progress | None = None, engines: Engines | None = None,
                    startup: Startup | None = None) -> dict[str, Any]:
    """Checkpoint k + round k's data → checkpoint k+1 (idempotent: a committed k+1 is left alone).
    ``on_step`` sees every optimizer-step record on the main rank (metrics). With ``engines.keep_trainer``
    the trainer of the previous round is reused when it holds checkpoint k (else checkpoint k is loaded),
    and kept at checkpoint k+1 for the next round. ``startup`` gets the process's start-up phases."""
    root = cfg.run_root
    if checkpoints.is_committed(root, k + 1):
        log(f"round {k}: checkpoint {k + 1} already committed")
        return checkpoints.read_marker(root, k + 1)
    if (problem := micro_batch_problem(cfg, int(os.environ.get("WORLD_SIZE", "1")))) is not None:
        raise ConfigError(problem, "train.micro_batch_prefixes")
    keep = engines is not None and engines.keep_trainer
    trainer: Trainer | None = engines.trainer if keep and engines is not None else None
    if trainer is not None and trainer.checkpoint == k and trainer.prepared:
        log(f"weights: checkpoint {k} loaded while round {k}'s scores were made")
        trainer.prepared = False
    elif trainer is not None and trainer.checkpoint == k:
        log(f"weights: checkpoint {k} kept in memory from round {k - 1} (model, optimizer state), not reloaded")
        if engines is not None and engines.release:  # back from host memory (sapd run on one GPU)
            engines.hand_off(k, "trainer to the device", trainer.engine.onload)
    else:
        if trainer is not None:
            log(f"the kept trainer holds checkpoint {trainer.checkpoint}, round {k} starts from checkpoint {k}: "
                "loading it")
            engines.trainer = trainer = None  # type: ignore[union-attr]  # keep is only true with engines
        trainer = load_trainer(cfg, k, engine_factory=engine_factory, log=log, startup=startup)
    engine, tokenizer = trainer.engine, trainer.tokenizer
    if keep and trainer.reference is None and cfg.loss_cfg.kl_coef > 0:
        trainer.reference = load_reference(cfg, log)  # once per run, like the student
    if startup is not None:
        startup.mark("first_work")
    if objective_of(cfg.loss_cfg).data == "recorded":
        rows = round_batch(cfg, k).to_pylist()
        records, new_state = sft_round(cfg, k, engine, tokenizer, rows, trainer.state, log=log,
                                       show_progress=show_progress, on_step=on_step, progress=progress,
                                       reference=trainer.reference)
    else:
        prefixes = scored_prefixes(read_scored(root, k))
        records, new_state = train_round(cfg, k, engine, tokenizer, prefixes, trainer.state, log=log,
                                         show_progress=show_progress, on_step=on_step, progress=progress,
                                         reference=trainer.reference)
    # several ranks: rank 0 writes the log and checkpoint k+1, once every rank is done reading round k
    engine.barrier()
    if engine.is_main:
        extra: dict[str, Any] = {"variant": cfg.variant}
        manifest = scored_manifest(root, k)
        if manifest is not None and manifest.get("responses"):  # the round's share cut at max_new_tokens
            extra["truncated_share"] = manifest["truncated_responses"] / manifest["responses"]
        write_round_log(root, k, records, extra)
    # every rank takes part (ZeRO-3 gathers one shard's parameters at a time) and writes its own share of
    # the optimizer state; rank 0 writes the rest and commits
    checkpoints.save_checkpoint(root, k + 1, engine.module, tokenizer, new_state, {"round": k, "steps": len(records)},
                                gather=engine.gather, is_main=engine.is_main,
                                max_shard_bytes=int(cfg.train.checkpoint_shard_mb * 2**20),
                                optimizer=engine.optimizer_shard())
    engine.barrier()
    trainer.checkpoint, trainer.state = k + 1, new_state
    if keep and engines is not None:
        engines.trainer = trainer
        if engines.release:  # the samplers take the device next (sapd run on one GPU): wait in host memory
            engines.hand_off(k, "trainer to host memory", engine.offload)
    return checkpoints.read_marker(root, k + 1)


@dataclass
class Options:
    """What the train door chose (``ctx.options["train"]``)."""

    engine_factory: EngineFactory | None = None  # the engine to train with (default: ``train.engine``'s; tests)


def prepare(ctx: StageContext, step: Step, wait_for_checkpoint: Callable[[int], None]) -> None:
    """A persistent trainer's start-up while its first round's scores are being made: checkpoint k is
    committed before them (by the prefix build, or by the trainer's previous round), so every rank waits
    for it (``wait_for_checkpoint``: the same condition on every rank, so that they build the engine
    together), loads it, builds the engine and restores the optimizer state, and keeps the trainer for the
    round (:func:`run_train_stage`). The round then starts with its scores: the model load, the engine's
    set-up and the optimizer state's read overlap the scoring instead of following it."""
    cfg, k, e = ctx.cfg, step.round, ctx.engines
    if k is None or k >= cfg.train.rounds or not e.keep_trainer or e.trainer is not None:
        return
    wait_for_checkpoint(k)
    opts: Options = ctx.options.get("train") or Options()
    log = ctx.log if ctx.main else (lambda line: None)
    trainer = load_trainer(cfg, k, engine_factory=opts.engine_factory, log=log, startup=ctx.startup)
    if cfg.loss_cfg.kl_coef > 0:
        trainer.reference = load_reference(cfg, log)
    trainer.prepared = True
    e.trainer = trainer


def run(ctx: StageContext, step: Step) -> Outcome:
    """The stage for round ``step.round`` (every door calls it through :func:`sapd.stages.context.run_stage`),
    on every process torchrun starts: rank 0 logs, counts progress and records each optimizer step's
    metrics; every rank trains. → checkpoint k+1's commit marker."""
    cfg, k = ctx.cfg, step.round
    assert k is not None, "train runs for a round"
    opts: Options = ctx.options.get("train") or Options()
    done_before = checkpoints.is_committed(cfg.run_root, k + 1)
    marker = run_train_stage(cfg, k, engine_factory=opts.engine_factory,
                             log=ctx.log if ctx.main else (lambda line: None),
                             progress=ctx.progress if ctx.main else QUIET,
                             on_step=lambda rec: ctx.metrics.record_step(rec, cfg.sampling.group_size),
                             engines=ctx.engines, startup=ctx.startup)
    return Outcome(f"round {k}: checkpoint {k + 1} committed ({marker['commit_id'][:12]})", done_before, marker)
