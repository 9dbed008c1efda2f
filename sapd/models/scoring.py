"""Log-probs of given tokens under a model: the teacher's scores of the student's samples (docs/SAPD.md §2,
Eq. 4) and the student's own response log-probs that training differentiates (:func:`response_logprobs`).

Teacher scoring: log π_T(y_{i,k} | h, y_{i,<k}) of the student's sampled tokens.

The HF scorer computes each group's shared prefix h **once** and scores the G continuations from its
cached keys/values (one prompt forward + one batched continuation forward per group), instead of G
full forward passes over prompt + response. :func:`score_naive` is the full-sequence reference it is
tested against. Failures are loud and name the prefix: a non-finite log-prob, a prompt + response
longer than the model's context, or running out of memory — never a silent zero.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from sapd.method.objective import token_entropy, token_logprobs
from sapd.models.loading import cache_kwarg, output_cache
from sapd.models.memory import PLAIN_HEAD_TYPES

# ---------------------------------------------------------------------------------------------------
# the student's response log-probs (training, π_old)


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




def decoder_and_head(model):
    """(decoder stack, LM head) of an HF causal LM whose head is a plain projection, else (None, None)."""
    config = getattr(model, "config", None)
    if getattr(config, "model_type", None) not in PLAIN_HEAD_TYPES:
        return None, None
    base = getattr(model, getattr(model, "base_model_prefix", "model"), None)
    head = model.get_output_embeddings()
    return (base, head) if base is not None and head is not None else (None, None)


class HeadOnlyLM(torch.nn.Module):
    """A causal LM whose forward projects to the vocabulary at the given positions only: ``forward(
    input_ids, attention_mask, pred_pos_B_T)`` → logits (B, T, V), never (B, S, V); or, with
    ``groups`` (see :func:`shared_prefix_logits`), each group's prompt run once. The module a training
    engine (DeepSpeed) wraps, so that the head-only path runs through the engine's own forward (ZeRO-3's
    parameter gathering hooks on every submodule, the root's end-of-forward hook included). Same
    parameters, same order, as the LM inside (``lm``)."""

    def __init__(self, lm):
        super().__init__()
        base, head = decoder_and_head(lm)
        if base is None:
            raise ValueError(f"{type(lm).__name__}: no plain LM head to apply at selected positions")
        self.lm = lm

    def forward(self, input_ids: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
                pred_pos_B_T: torch.Tensor | None = None, groups=None, pad_id: int = 0):
        base, head = decoder_and_head(self.lm)
        if groups is not None:
            return shared_prefix_logits(base, head, self.lm, groups, pad_id)
        assert input_ids is not None and attention_mask is not None and pred_pos_B_T is not None
        hidden = base(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state  # (B, S, H)
        return head(hidden.gather(1, pred_pos_B_T.unsqueeze(-1).expand(-1, -1, hidden.shape[-1])))


def shared_prefix_logits(base, head, lm, groups: Sequence[tuple[Sequence[int], Sequence[Sequence[int]]]],
                         pad_id: int) -> torch.Tensor:
    """Logits (ΣG, T, V) predicting each response token, for ``groups`` = [(prompt, [response × G])]
    (every group the same G): the unique tokens in two forward calls — all prompts once, left-padded in
    one batch, their keys/values repeated G times, then all responses as one batch over that cache —
    not G copies of each prompt. Differentiable: each prompt's activations receive the gradient of its G
    responses through the repeated cache, the sum the G separate sequences would give. Rows are
    group-major; responses right-padded to the longest (``_pad_right``)."""
    device = next(lm.parameters()).device
    P, G = len(groups), len(groups[0][1])
    lengths = [len(p) for p, _ in groups]
    L = max(lengths)
    ids_P_L = torch.full((P, L), pad_id, dtype=torch.long, device=device)
    attn_P_L = torch.zeros((P, L), dtype=torch.long, device=device)
    for i, (prompt, _) in enumerate(groups):
        ids_P_L[i, L - len(prompt):] = torch.tensor(list(prompt), dtype=torch.long, device=device)
        attn_P_L[i, L - len(prompt):] = 1
    pos_P_L = (attn_P_L.cumsum(-1) - 1).clamp(min=0)
    res = base(input_ids=ids_P_L, attention_mask=attn_P_L, position_ids=pos_P_L, use_cache=True)
    cache = output_cache(res)
    cache.batch_repeat_interleave(G)
    ids_B_T, _ = _pad_right([r for _, responses in groups for r in responses], pad_id, device)
    T = ids_B_T.shape[1]
    # right-padded responses: under the causal mask a real token never sees the pads after it
    attn_B_S = torch.cat([attn_P_L.repeat_interleave(G, 0), torch.ones((P * G, T), dtype=torch.long, device=device)], 1)
    pos_B_T = torch.tensor(lengths, device=device).repeat_interleave(G)[:, None] + torch.arange(T, device=device)
    cont = base(input_ids=ids_B_T, attention_mask=attn_B_S, position_ids=pos_B_T, use_cache=False,
                **{cache_kwarg(base): cache})
    last = res.last_hidden_state[:, -1:, :].repeat_interleave(G, 0)  # predicts each response's first token
    return head(torch.cat([last, cont.last_hidden_state[:, :-1, :]], dim=1))


def _groups(prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]], group_size: int | None):
    """[(prompt, responses)] when the rows come in runs of ``group_size`` sharing one prompt, else None."""
    G = group_size or 0
    if G < 2 or len(prompts) % G:
        return None
    groups = []
    for s in range(0, len(prompts), G):
        if any(prompts[s + i] != prompts[s] for i in range(1, G)):
            return None
        groups.append((prompts[s], responses[s:s + G]))
    return groups


def _checkpointing(lm) -> bool:
    """Gradient (activation) checkpointing is on: transformers then turns the KV cache off."""
    new = hasattr(type(lm), "is_activation_checkpointing")  # the old name warns in transformers ≥ 5
    return bool(getattr(lm, "is_activation_checkpointing" if new else "is_gradient_checkpointing", False))


def _head_only_module(model) -> bool:
    """``model`` is a :class:`HeadOnlyLM`, or an engine (DeepSpeed's) whose ``module`` is one."""
    return isinstance(model, HeadOnlyLM) or isinstance(getattr(model, "module", None), HeadOnlyLM)


def _response_logits(model, prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]],
                     pad_id: int, group_size: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(logits_B_T_V at response positions, target tokens_B_T, response_mask_B_T). Rows that come in
    groups of ``group_size`` sharing one prompt run each prompt once (:func:`shared_prefix_logits`)
    where the model has a plain LM head and gradient checkpointing is off (it turns the KV cache off)."""
    device = next(model.parameters()).device
    inner = getattr(model, "module", model)
    lm = inner.lm if isinstance(inner, HeadOnlyLM) else inner
    groups = None if _checkpointing(lm) else _groups(prompts, responses, group_size)
    if groups is not None and decoder_and_head(lm)[0] is not None:
        targets, mask = _pad_right(responses, pad_id, device)
        if _head_only_module(model):  # through the engine's forward
            return model(groups=groups, pad_id=pad_id), targets, mask
        base, head = decoder_and_head(lm)
        return shared_prefix_logits(base, head, lm, groups, pad_id), targets, mask
    ids, attn, pos, mask = pad_sequences(prompts, responses, pad_id, device)
    # the output at position s predicts token s+1: response token at position t is predicted from t−1
    pred_pos = (pos - 1).clamp(min=0)
    if _head_only_module(model):  # through the engine's forward
        return model(input_ids=ids, attention_mask=attn, pred_pos_B_T=pred_pos), ids.gather(1, pos), mask
    base, head = decoder_and_head(getattr(model, "module", model))
    if base is not None and getattr(model, "module", model) is model:
        # project to the vocabulary at response positions only: prompts are most of each sequence, and
        # the (B, S, V) logits would be the largest activation of the step
        hidden = base(input_ids=ids, attention_mask=attn).last_hidden_state  # (B, S, H)
        logits_B_T_V = head(hidden.gather(1, pred_pos.unsqueeze(-1).expand(-1, -1, hidden.shape[-1])))
    else:
        logits = model(input_ids=ids, attention_mask=attn).logits  # (B, S, V)
        logits_B_T_V = logits.gather(1, pred_pos.unsqueeze(-1).expand(-1, -1, logits.shape[-1]))
    return logits_B_T_V, ids.gather(1, pos), mask


def response_logprobs(model, prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]],
                      pad_id: int, group_size: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """log π(response token k | prompt, response<k) for every row → (logp_B_T, response_mask_B_T).
    Prompt positions are gathered out, so they can never receive gradient from a loss on these. Rows in
    runs of ``group_size`` with one prompt (a prefix's G responses) run that prompt once."""
    logits_B_T_V, targets, mask = _response_logits(model, prompts, responses, pad_id, group_size)
    logp = token_logprobs(logits_B_T_V, targets)
    return torch.where(mask, logp, torch.zeros_like(logp)), mask


def response_logprobs_and_entropy(model, prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]],
                                  pad_id: int, group_size: int | None = None
                                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`response_logprobs` plus the policy's entropy at every response position (differentiable;
    0 on padding) → (logp_B_T, response_mask_B_T, entropy_B_T). For the entropy bonus (``loss.entropy_coef``)."""
    logits_B_T_V, targets, mask = _response_logits(model, prompts, responses, pad_id, group_size)
    logp = token_logprobs(logits_B_T_V, targets)
    ent = token_entropy(logits_B_T_V)
    zero = torch.zeros_like(logp)
    return torch.where(mask, logp, zero), mask, torch.where(mask, ent, zero)


# ---------------------------------------------------------------------------------------------------
# the teacher's scores


class TeacherScoringError(RuntimeError):
    """The teacher cannot score a group (a sequence longer than its context): a user error."""

    exit_code = 2  # sapd.entry.EXIT_USER_ERROR: fix the config or the data; a retry cannot help


def _max_positions(model) -> int | None:
    return getattr(model.config, "max_position_embeddings", None)


def _check_fits(model, prefix_id: str, prompt_len: int, response_lens: Sequence[int]) -> None:
    limit = _max_positions(model)
    longest = prompt_len + max(response_lens, default=0)
    if limit is not None and longest > limit:
        raise TeacherScoringError(f"prefix {prefix_id}: prompt ({prompt_len} tokens) + response "
                                  f"({max(response_lens)} tokens) exceeds the teacher's context of {limit} tokens; "
                                  "it would be truncated — filter prefixes with --max-prompt-tokens")


def _checked(prefix_id: str, logp_G_T: torch.Tensor, mask_G_T: torch.Tensor) -> torch.Tensor:
    bad = ~torch.isfinite(logp_G_T) & mask_G_T
    if bool(bad.any()):
        i, k = (int(x) for x in bad.nonzero()[0])
        raise TeacherScoringError(f"prefix {prefix_id}: non-finite teacher log-prob at response {i}, token {k}")
    return logp_G_T


def _pad_right(responses: Sequence[Sequence[int]], pad: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    T = max(max((len(r) for r in responses), default=0), 1)
    ids = torch.full((len(responses), T), pad, dtype=torch.long, device=device)
    mask = torch.zeros((len(responses), T), dtype=torch.bool, device=device)
    for i, r in enumerate(responses):
        if r:
            ids[i, :len(r)] = torch.tensor(list(r), device=device)
            mask[i, :len(r)] = True
    return ids, mask


@torch.no_grad()
def score_group_shared_prefix(model, prompt_ids: Sequence[int], responses: Sequence[Sequence[int]],
                              prefix_id: str = "?", pad_id: int = 0) -> list[list[float]]:
    """Teacher log-probs of each response's tokens, prompt prefilled once, its cache repeated G times."""
    device = next(model.parameters()).device
    _check_fits(model, prefix_id, len(prompt_ids), [len(r) for r in responses])
    try:
        prompt = torch.tensor([list(prompt_ids)], dtype=torch.long, device=device)
        # only the last prompt position's logits are needed: it predicts every response's first token
        res = model(input_ids=prompt, use_cache=True, logits_to_keep=1)
        first_logits = res.logits[:, -1, :]
        cache = output_cache(res)
        G = len(responses)
        cache.batch_repeat_interleave(G)
        ids_G_T, mask_G_T = _pad_right(responses, pad_id, device)
        P = prompt.shape[1]
        T = ids_G_T.shape[1]
        positions = torch.arange(P, P + T, device=device).expand(G, T)
        # no attention mask: responses are right-padded, and under the causal mask a real token never
        # sees the pads after it, so the plain causal path (faster kernels) gives the same real-token logits
        cont = model(input_ids=ids_G_T, position_ids=positions, use_cache=False, **{cache_kwarg(model): cache})
        # logits for token k come from position k−1: the prompt's last for k = 0, the continuation's after
        logits_G_T_V = torch.cat([first_logits.expand(G, -1).unsqueeze(1), cont.logits[:, :-1, :]], dim=1)
        logp = _checked(prefix_id, token_logprobs(logits_G_T_V, ids_G_T), mask_G_T)
    except torch.OutOfMemoryError as e:
        raise TeacherScoringError(f"prefix {prefix_id}: out of memory while scoring {len(responses)} responses "
                                  f"over a {len(prompt_ids)}-token prompt") from e
    return [logp[i, :len(r)].tolist() for i, r in enumerate(responses)]


@torch.no_grad()
def score_naive(model, prompt_ids: Sequence[int], responses: Sequence[Sequence[int]], prefix_id: str = "?",
                pad_id: int = 0) -> list[list[float]]:
    """Reference: one full forward over prompt + response per response."""
    device = next(model.parameters()).device
    _check_fits(model, prefix_id, len(prompt_ids), [len(r) for r in responses])
    out: list[list[float]] = []
    P = len(prompt_ids)
    for r in responses:
        if not r:
            out.append([])
            continue
        seq = torch.tensor([list(prompt_ids) + list(r)], dtype=torch.long, device=device)
        logits = model(input_ids=seq).logits[:, P - 1:-1, :]
        logp = token_logprobs(logits, seq[:, P:])
        _checked(prefix_id, logp, torch.ones_like(logp, dtype=torch.bool))
        out.append(logp[0].tolist())
    return out


def score_groups(model, groups: Sequence[tuple[str, Sequence[int], Sequence[Sequence[int]]]], *,
                 pad_id: int = 0, progress: Callable[[int], None] | None = None) -> list[list[list[float]]]:
    """``groups`` = [(prefix_id, prompt_ids, [response_ids × G])] → teacher log-probs per response."""
    out = []
    for prefix_id, prompt_ids, responses in groups:
        out.append(score_group_shared_prefix(model, prompt_ids, responses, prefix_id=prefix_id, pad_id=pad_id))
        if progress:
            progress(1)
    return out


@dataclass
class ScoringStats:
    """What a teacher scorer computed, summed over its calls: the tokens it ran through the model (a
    prompt once per group, or G times) against the two references, G·(P + R) per group (every response
    with its own copy of the prompt) and P + G·R (the prompt once)."""

    groups: int = 0
    responses: int = 0
    computed_tokens: int = 0  # positions the model computed (prefix-cache hits excluded)
    per_response_tokens: int = 0  # Σ over responses of (P + R): each response with its own prompt
    shared_prompt_tokens: int = 0  # Σ over groups of (P + Σ R): each prompt once
    rescored: int = 0  # vLLM: responses scored again without the prefix cache (a hit reached into them)

    def add_group(self, prompt: int, responses: Sequence[int]) -> None:
        scored = [r for r in responses if r]
        self.groups += 1
        self.responses += len(scored)
        self.per_response_tokens += sum(prompt + r for r in scored)
        self.shared_prompt_tokens += prompt + sum(scored) if scored else 0

    def minus(self, earlier: ScoringStats) -> ScoringStats:
        """What was computed since ``earlier`` (a copy of these stats taken then)."""
        return ScoringStats(*(getattr(self, f.name) - getattr(earlier, f.name) for f in dataclasses.fields(self)))

    def line(self) -> str:
        if not self.groups:
            return "no group scored"
        g = self.groups
        return (f"teacher computed {self.computed_tokens / g:.0f} tokens per group (each prompt once: "
                f"{self.shared_prompt_tokens / g:.0f}; each response with its own prompt: "
                f"{self.per_response_tokens / g:.0f})" + (f"; {self.rescored} responses rescored without the "
                                                          "prefix cache" if self.rescored else ""))


class HFScorer:
    """The frozen teacher on HF transformers: :func:`score_groups` (each group's prompt once) as a callable,
    and :meth:`HFScorer.release`, which moves the model to host memory before a training stage in the same process
    on an accelerator (it moves back at the next call)."""

    def __init__(self, model, pad_id: int, device: str = "cpu"):
        self.model, self.pad_id, self.device = model, pad_id, device
        self.offloaded = False
        self.stats = ScoringStats()

    def __call__(self, groups: Sequence[tuple[str, Sequence[int], Sequence[Sequence[int]]]],
                 progress: Callable[[int], None] | None = None) -> list[list[list[float]]]:
        self.wake()
        out = score_groups(self.model, groups, pad_id=self.pad_id, progress=progress)
        for _, prompt, responses in groups:
            self.stats.add_group(len(prompt), [len(r) for r in responses])
            self.stats.computed_tokens += len(prompt) + sum(len(r) for r in responses)
        return out

    def wake(self) -> bool:
        """The model back on its device after :meth:`release` (each call does it; the validation, which
        samples the teacher through ``model``, calls it first). → whether it moved."""
        if not self.offloaded:
            return False
        self.model.to(self.device)
        self.offloaded = False
        return True

    def release(self) -> bool:
        """Before training on the same device: the model to host memory, the allocator's cache emptied (on a
        CPU nothing moves). → whether it moved."""
        if torch.device(self.device).type == "cpu" or self.offloaded:
            return False
        self.model.to("cpu")
        self.offloaded = True
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        return True
