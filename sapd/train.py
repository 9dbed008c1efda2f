"""Training stage of round k, top to bottom: checkpoint k + round k's scored shards → checkpoint k+1.

1. Load the student from checkpoint k (it sampled round k, so it *is* π_old) and its trainer state.
2. Recompute π_old log-probs of every sampled token with these training weights, once, before any
   update (sampler log-probs from another engine may differ numerically; ratios must start at 1).
3. For ``epochs_per_round`` passes, shuffle the round's groups and cut them into minibatches of
   ``minibatch_prefixes`` prefixes (× G responses); each minibatch is one optimizer step, accumulated
   over micro-batches of ``micro_batch_prefixes``; gradient clipping; learning-rate schedule.
   On W ranks (``train.engine: deepspeed`` under torchrun) rank r takes micro-batches r, r+W, … of
   each minibatch, weighted so that the rank-averaged gradient is the one-process minibatch gradient.
4. Write the per-step log, then checkpoint k+1 (HF model + optimizer/RNG/cursor), committed last
   (by rank 0).

The SFT baseline (:func:`train_sft_round`) uses the same data path, engine and checkpoint format with
cross-entropy on the recorded responses of the round's prefixes.

Simplifications, on purpose: full prompt + response sequences are run for the student (the
shared-prefix trick is used for the frozen teacher only, where no gradient is needed); the schedule
is a function of (round, optimizer step) so a resumed run reproduces it exactly without a scheduler
object.
"""

from __future__ import annotations

import json
import math
import random
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from sapd import checkpoints, layout, storage
from sapd.config import RunConfig
from sapd.objective import loss_for, sft_loss, token_logprobs


# ---------------------------------------------------------------------------------------------------
# sequences → response log-probs


def pad_sequences(prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]], pad_id: int,
                  device: str | torch.device = "cpu"):
    """Right-padded prompt+response batch and, per row, the index of each response token.

    Returns ``input_ids_B_S``, ``attention_B_S``, ``target_pos_B_T`` (position of response token k in
    the sequence) and ``response_mask_B_T``."""
    B = len(prompts)
    S = max(len(p) + len(r) for p, r in zip(prompts, responses))
    T = max(max((len(r) for r in responses), default=0), 1)
    ids = torch.full((B, S), pad_id, dtype=torch.long)
    attn = torch.zeros((B, S), dtype=torch.long)
    pos = torch.zeros((B, T), dtype=torch.long)
    mask = torch.zeros((B, T), dtype=torch.bool)
    for b, (p, r) in enumerate(zip(prompts, responses)):
        seq = list(p) + list(r)
        ids[b, :len(seq)] = torch.tensor(seq, dtype=torch.long)
        attn[b, :len(seq)] = 1
        pos[b, :len(r)] = torch.arange(len(p), len(p) + len(r))
        mask[b, :len(r)] = True
    return ids.to(device), attn.to(device), pos.to(device), mask.to(device)


# decoder-only families whose causal-LM head is a plain projection of the last hidden state (no logit
# soft-capping or scaling in between), so it may be applied to selected positions only
_PLAIN_HEAD_TYPES = {"llama", "qwen2", "qwen3", "mistral", "smollm3", "phi3", "olmo2"}


def _decoder_and_head(model):
    """(decoder stack, LM head) of an HF causal LM whose head is a plain projection, else (None, None)."""
    config = getattr(model, "config", None)
    if getattr(config, "model_type", None) not in _PLAIN_HEAD_TYPES:
        return None, None
    base = getattr(model, getattr(model, "base_model_prefix", "model"), None)
    head = model.get_output_embeddings()
    return (base, head) if base is not None and head is not None else (None, None)


def response_logprobs(model, prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]],
                      pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """log π(response token k | prompt, response<k) for every row → (logp_B_T, response_mask_B_T).
    Prompt positions are gathered out, so they can never receive gradient from a loss on these."""
    device = next(model.parameters()).device
    ids, attn, pos, mask = pad_sequences(prompts, responses, pad_id, device)
    # the output at position s predicts token s+1: response token at position t is predicted from t−1
    pred_pos = (pos - 1).clamp(min=0)
    base, head = _decoder_and_head(model)
    if base is not None:
        # project to the vocabulary at response positions only: prompts are most of each sequence, and
        # the (B, S, V) logits would be the largest activation of the step
        hidden = base(input_ids=ids, attention_mask=attn).last_hidden_state  # (B, S, H)
        logits_B_T_V = head(hidden.gather(1, pred_pos.unsqueeze(-1).expand(-1, -1, hidden.shape[-1])))
    else:
        logits = model(input_ids=ids, attention_mask=attn).logits  # (B, S, V)
        logits_B_T_V = logits.gather(1, pred_pos.unsqueeze(-1).expand(-1, -1, logits.shape[-1]))
    targets = ids.gather(1, pos)
    logp = token_logprobs(logits_B_T_V, targets)
    return torch.where(mask, logp, torch.zeros_like(logp)), mask


# ---------------------------------------------------------------------------------------------------
# engine: plain torch here; DeepSpeed in sapd.deepspeed_engine with the same methods


@dataclass
class TorchEngine:
    model: Any
    optimizer: torch.optim.Optimizer
    max_grad_norm: float

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def step(self, lr: float) -> float:
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.max_grad_norm)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(norm)

    def optimizer_state(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_optimizer_state(self, state: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state)

    @property
    def is_main(self) -> bool:
        return True

    @property
    def world_size(self) -> int:
        return 1

    @property
    def rank(self) -> int:
        return 0

    def barrier(self) -> None:
        pass

    @contextmanager
    def gathered_model(self):
        """The model with full weights, to save (DeepSpeed ZeRO-3 gathers its partitions here)."""
        yield self.model


def make_torch_engine(model, cfg: RunConfig) -> TorchEngine:
    t = cfg.train
    opt = torch.optim.AdamW(model.parameters(), lr=t.lr, betas=t.betas, weight_decay=t.weight_decay)
    return TorchEngine(model, opt, t.max_grad_norm)


def engine_factory_for(cfg: RunConfig) -> Callable:
    """``train.engine``: plain torch (one process) or DeepSpeed ZeRO (one or more, under torchrun)."""
    import os
    if cfg.train.engine == "deepspeed":
        from sapd.deepspeed_engine import make_deepspeed_engine
        return make_deepspeed_engine
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise ValueError("train.engine: torch trains on one process; set train.engine: deepspeed to use torchrun")
    return make_torch_engine


def learning_rate(cfg: RunConfig, k: int, global_step: int) -> float:
    """Warmup over optimizer steps, then constant / linear / cosine decay over rounds."""
    t = cfg.train
    warm = min(1.0, (global_step + 1) / t.warmup_steps) if t.warmup_steps > 0 else 1.0
    progress = k / max(t.rounds, 1)
    if t.lr_schedule == "linear":
        decay = 1.0 - progress
    elif t.lr_schedule == "cosine":
        decay = 0.5 * (1.0 + math.cos(math.pi * progress))
    else:
        decay = 1.0
    return t.lr * warm * decay


# ---------------------------------------------------------------------------------------------------
# the round


@dataclass
class Group:
    """One scored prefix: its prompt and G sampled responses with their fixed signals."""

    prefix_id: str
    prompt: list[int]
    responses: list[list[int]]
    teacher_logp: list[list[float]]
    action_mask: list[list[bool]]
    rule_scores: list[float]
    old_logp: list[list[float]] | None = None


def _groups_from_table(table) -> list[Group]:
    return [Group(r["prefix_id"], r["prompt_token_ids"], r["response_token_ids"], r["teacher_logprobs"],
                  r["action_mask"], r["rule_score"]) for r in table.to_pylist()]


def _stack(groups: Sequence[Group], field: str, T: int, dtype) -> torch.Tensor:
    """P×G×T tensor of a per-token field, zero-padded to T."""
    P, G = len(groups), len(groups[0].responses)
    out = torch.zeros((P, G, T), dtype=dtype)
    for p, g in enumerate(groups):
        for i, values in enumerate(getattr(g, field)):
            if values:
                out[p, i, :len(values)] = torch.tensor(values, dtype=dtype)
    return out


def _flat(groups: Sequence[Group]) -> tuple[list[list[int]], list[list[int]]]:
    prompts = [g.prompt for g in groups for _ in g.responses]
    responses = [r for g in groups for r in g.responses]
    return prompts, responses


@torch.no_grad()
def recompute_old_logprobs(model, groups: list[Group], pad_id: int, micro: int) -> None:
    for start in range(0, len(groups), micro):
        chunk = groups[start:start + micro]
        prompts, responses = _flat(chunk)
        logp, _ = response_logprobs(model, prompts, responses, pad_id)
        G = len(chunk[0].responses)
        for j, g in enumerate(chunk):
            g.old_logp = [logp[j * G + i, :len(r)].tolist() for i, r in enumerate(g.responses)]


def _micro_loss(model, cfg: RunConfig, chunk: list[Group], pad_id: int) -> tuple[torch.Tensor, dict[str, float]]:
    prompts, responses = _flat(chunk)
    new_flat, mask_flat = response_logprobs(model, prompts, responses, pad_id)
    P, G = len(chunk), len(chunk[0].responses)
    T = new_flat.shape[-1]
    new = new_flat.view(P, G, T)
    response_mask = mask_flat.view(P, G, T)
    old = _stack(chunk, "old_logp", T, torch.float32).to(new.device)
    teacher = _stack(chunk, "teacher_logp", T, torch.float32).to(new.device)
    action = _stack(chunk, "action_mask", T, torch.bool).to(new.device)
    rules = torch.tensor([g.rule_scores for g in chunk], dtype=torch.float32, device=new.device)
    # loss_for dispatches the SAPD family and GRPO (whose per-response advantage rides in rule_scores)
    return loss_for(cfg.loss_config(), new, old, teacher, response_mask, action, rules)


def _restore_rng(state: dict[str, Any] | None) -> None:
    if state and "rng" in state:
        random.setstate(state["rng"]["python"])
        torch.set_rng_state(state["rng"]["torch"])


def _rng_state() -> dict[str, Any]:
    return {"python": random.getstate(), "torch": torch.get_rng_state()}


def micro_batch_share(chunks: list, n: int, engine) -> list[tuple[Any, float, float]]:
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


def _mean_metrics(items: list[tuple[float, dict[str, float]]], engine=None) -> dict[str, float]:
    """Weighted mean of the micro-batch metrics; with several ranks, of every rank's micro-batches."""
    keys = list(items[0][1])
    if engine is None or engine.world_size == 1:
        total = sum(w for w, _ in items) or 1.0
        return {key: sum(w * m[key] for w, m in items) / total for key in keys}
    sums = engine.all_reduce_sum([sum(w for w, _ in items)] + [sum(w * m[key] for w, m in items) for key in keys])
    return {key: s / (sums[0] or 1.0) for key, s in zip(keys, sums[1:])}


def optimizer_steps(cfg: RunConfig, k: int, engine, items: list, micro_loss: Callable, global_step: int,
                    describe: Callable[[dict], str], *, log: Callable[[str], None] = print,
                    show_progress: bool = True, label: str = "training",
                    on_step: Callable[[dict], None] | None = None) -> tuple[list[dict], int]:
    """The optimizer steps of round k over ``items`` (scored groups, or SFT examples): each epoch
    reshuffles them with (seed, k), cuts minibatches of ``minibatch_prefixes``, accumulates the
    micro-batch losses ``micro_loss(chunk) -> (loss, metrics)`` of this rank's share, clips and steps.
    Returns the per-step records and the new global step."""
    from tqdm import tqdm

    t = cfg.train
    order_rng = random.Random(f"{t.seed}:{k}")
    records: list[dict] = []
    n_steps = t.epochs_per_round * -(-len(items) // t.minibatch_prefixes)
    bar = tqdm(total=n_steps, desc=f"round {k} {label}", unit="step",
               disable=None if show_progress and engine.is_main else True, leave=False)
    for epoch in range(t.epochs_per_round):
        order = list(range(len(items)))
        order_rng.shuffle(order)
        for mb_start in range(0, len(order), t.minibatch_prefixes):
            t_step = time.perf_counter()
            mb = [items[i] for i in order[mb_start:mb_start + t.minibatch_prefixes]]
            chunks = [mb[s:s + t.micro_batch_prefixes] for s in range(0, len(mb), t.micro_batch_prefixes)]
            parts = []
            for chunk, weight, metric_weight in micro_batch_share(chunks, len(mb), engine):
                loss, metrics = micro_loss(chunk)
                engine.backward(loss * weight)  # weight: exact decomposition of the minibatch mean over prefixes
                parts.append((metric_weight, metrics))
            lr = learning_rate(cfg, k, global_step)
            grad_norm = engine.step(lr)
            global_step += 1
            rec = {"round": k, "epoch": epoch, "step": global_step, "lr": lr, "grad_norm": grad_norm,
                   "prefixes": len(mb), **_mean_metrics(parts, engine),
                   "step_seconds": time.perf_counter() - t_step}
            records.append(rec)
            bar.update(1)
            if on_step is not None and engine.is_main:
                on_step(rec)
            log(f"round {k} step {global_step}: {describe(rec)} |g| {grad_norm:.3f}")
    bar.close()
    return records, global_step


def train_round(cfg: RunConfig, k: int, engine, tokenizer, groups: list[Group], state: dict[str, Any] | None,
                *, log: Callable[[str], None] = print, show_progress: bool = True,
                on_step: Callable[[dict], None] | None = None) -> tuple[list[dict], dict]:
    """Run round k's optimizer steps on ``engine.model`` (loaded from checkpoint k). Returns the step
    records and the trainer state to store with checkpoint k+1."""
    model = engine.model
    pad = tokenizer.pad_token_id
    _restore_rng(state)
    t0 = time.perf_counter()
    model.eval()  # π_old: no dropout, same numerics as the sampler's weights
    recompute_old_logprobs(model, groups, pad, cfg.train.micro_batch_prefixes)
    old_seconds = time.perf_counter() - t0
    model.train()
    records, global_step = optimizer_steps(
        cfg, k, engine, groups, lambda chunk: _micro_loss(model, cfg, chunk, pad), (state or {}).get("global_step", 0),
        lambda r: (f"loss {r['loss']:.5f} (tok {r['loss_tok']:.4f} step {r['loss_step']:.4f} rule "
                   f"{r['loss_rule']:.4f}) gap {r['teacher_student_gap']:.4f} clip {r['clip_fraction']:.3f}"),
        log=log, show_progress=show_progress, on_step=on_step)
    if records:
        records[0]["old_logp_seconds"] = old_seconds
    return records, {"global_step": global_step, "round": k + 1, "rng": _rng_state(),
                     "optimizer": engine.optimizer_state()}


def sft_round(cfg: RunConfig, k: int, engine, tokenizer, rows: list[dict], state: dict[str, Any] | None,
              *, log: Callable[[str], None] = print, show_progress: bool = True,
              on_step: Callable[[dict], None] | None = None) -> tuple[list[dict], dict]:
    """SFT baseline round: cross-entropy on the recorded response of each prefix (the response text
    followed by EOS), minibatches and micro-batches counted in prefixes exactly as SAPD's."""
    model = engine.model
    pad = tokenizer.pad_token_id
    _restore_rng(state)
    model.train()
    data = [(tokenizer(r["prompt"], add_special_tokens=False)["input_ids"],
             tokenizer(r["recorded_response"], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id])
            for r in rows]
    reduction = cfg.loss_config().reduction

    def micro_loss(chunk):
        logp, mask = response_logprobs(model, [c[0] for c in chunk], [c[1] for c in chunk], pad)
        return sft_loss(logp, mask, reduction)

    records, global_step = optimizer_steps(cfg, k, engine, data, micro_loss, (state or {}).get("global_step", 0),
                                           lambda r: f"sft loss {r['loss']:.5f}", log=log,
                                           show_progress=show_progress, label="sft", on_step=on_step)
    return records, {"global_step": global_step, "round": k + 1, "rng": _rng_state(),
                     "optimizer": engine.optimizer_state()}


def write_round_log(root: str, k: int, records: list[dict], extra: dict[str, Any] | None = None) -> None:
    lines = [json.dumps({**rec, **(extra or {})}, sort_keys=True) for rec in records]
    storage.write_text(layout.round_log_uri(root, k), "\n".join(lines) + ("\n" if lines else ""))


def run_train_stage(cfg: RunConfig, k: int, *, engine_factory: Callable | None = None,
                    log: Callable[[str], None] = print, show_progress: bool = True,
                    on_step: Callable[[dict], None] | None = None) -> dict[str, Any]:
    """Checkpoint k + round k's data → checkpoint k+1 (idempotent: a committed k+1 is left alone).
    ``on_step`` sees every optimizer-step record on the main rank (metrics)."""
    from sapd.models.loading import load_tokenizer
    from sapd.precompute import read_scored, round_batch

    root = cfg.run_root
    if checkpoints.is_committed(root, k + 1):
        log(f"round {k}: checkpoint {k + 1} already committed")
        return checkpoints.read_marker(root, k + 1)
    ckpt_path = checkpoints.checkpoint_model_path(root, k)
    tokenizer = load_tokenizer(str(ckpt_path))
    model = checkpoints.load_checkpoint_model(root, k, cfg.model.dtype, cfg.model.device, trainable=True)
    if cfg.train.gradient_checkpointing:
        # transformers ≥ 5.x names it activation checkpointing (the old name warns, then goes in v6)
        (getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable)()
    engine = (engine_factory or engine_factory_for(cfg))(model, cfg)
    state = checkpoints.load_trainer_state(root, k)
    if state and "optimizer" in state:
        engine.load_optimizer_state(state["optimizer"])
    if cfg.loss_config().objective == "sft":
        rows = round_batch(cfg, k).to_pylist()
        records, new_state = sft_round(cfg, k, engine, tokenizer, rows, state, log=log, show_progress=show_progress,
                                       on_step=on_step)
    else:
        groups = _groups_from_table(read_scored(root, k))
        records, new_state = train_round(cfg, k, engine, tokenizer, groups, state, log=log,
                                         show_progress=show_progress, on_step=on_step)
    # several ranks: rank 0 writes the log and checkpoint k+1, once every rank is done reading round k
    engine.barrier()
    with engine.gathered_model() as full_model:
        if engine.is_main:
            write_round_log(root, k, records, {"variant": cfg.variant})
            checkpoints.save_checkpoint(root, k + 1, full_model, tokenizer, new_state,
                                        {"round": k, "steps": len(records)})
    engine.barrier()
    return checkpoints.read_marker(root, k + 1)
