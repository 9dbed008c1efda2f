"""The SAPD objective as pure tensor functions (docs/SAPD.md §2–§4).

Shapes are in the names: P prefixes, G responses per prefix, T response tokens (right-padded).
Every mask is passed explicitly (``response_mask_P_G_T``: 1 on generated response tokens, 0 on padding;
prefix tokens are never part of these tensors at all). Every loss goes through :func:`reduce_loss`,
the one reduction helper, so the per-response length normalisation 1/Lᵢ of Eq. 5/11 lives in one place.

All teacher/old log-probs are treated as constants (the signals of §2 are computed once per update from
fixed samples); only ``new_logp`` carries gradient.

The objectives (``sapd``, ``sft``, ``grpo``) are registered by name (:func:`register_objective`): a loss
function's tensor parameters, named as the fields of :class:`LossInputs`, say what the training stage
computes and passes it; :func:`loss_for` dispatches on ``LossConfig.objective``. A new objective is one
registered function: its ``loss_*`` metrics reach the step log, Prometheus (``sapd_loss{term}``) and
``sapd report`` as they are. One defined outside the package is named ``package.module:function`` (in
``loss.objective`` or as the variant) or registered under an entry point of the group ``sapd.objectives``
(:func:`objective_of` imports it); docs/guides/new-objective.md walks the whole path.
"""

from __future__ import annotations

import functools
import inspect
import math
from dataclasses import dataclass, fields, replace
from importlib.metadata import EntryPoint, entry_points
from typing import TYPE_CHECKING, Callable, Literal

from sapd.lazy import lazy_module

if TYPE_CHECKING:
    import torch
else:
    def _import_torch():
        import torch
        return torch
    torch = lazy_module(_import_torch)  # the config needs the registry below, not the tensors: torch at first use

Reduction = Literal["seq_mean_token_mean", "token_mean"]
NoActionStep = Literal["zero", "exclude", "penalty", "whole_response"]
NO_ACTION_STEPS = ("zero", "exclude", "penalty", "whole_response")
KlType = Literal["low_var_kl", "kl"]


# ---------------------------------------------------------------------------------------------------
# reduction


def reduce_loss(values_B_T: torch.Tensor, mask_B_T: torch.Tensor,
                reduction: Reduction = "seq_mean_token_mean") -> torch.Tensor:
    """Reduce per-token values to a scalar. Leading dims (``P, G`` or one batch dim) are all "responses".

    - ``seq_mean_token_mean`` (default, docs/SAPD.md §3): 1/Lᵢ Σ_k per response, then the mean over
      responses — i.e. E_h[1/G Σᵢ 1/Lᵢ Σ_k …] with a fixed G. A response with Lᵢ = 0 contributes 0
      (it still counts in the mean over G, which keeps every group's weight equal).
    - ``token_mean``: Σ over all valid tokens / number of valid tokens (long responses weigh more;
      offered as an option, not the paper's form).
    """
    mask = mask_B_T.to(values_B_T.dtype)
    masked = values_B_T * mask
    if reduction == "seq_mean_token_mean":
        lengths = mask.sum(-1).clamp(min=1.0)
        return (masked.sum(-1) / lengths).mean()
    if reduction == "token_mean":
        return masked.sum() / mask.sum().clamp(min=1.0)
    raise ValueError(f"unknown reduction {reduction!r}; expected 'seq_mean_token_mean' or 'token_mean'")


# ---------------------------------------------------------------------------------------------------
# signals and advantages


def token_signal(teacher_logp_P_G_T: torch.Tensor, old_logp_P_G_T: torch.Tensor,
                 response_mask_P_G_T: torch.Tensor) -> torch.Tensor:
    """Eq. 4: d_{i,k} = log π_T(y_{i,k}|c) − log π_old(y_{i,k}|c), zero outside the response. Detached."""
    d = (teacher_logp_P_G_T - old_logp_P_G_T).detach()
    return torch.where(response_mask_P_G_T.bool(), d, torch.zeros_like(d))


def step_scores(d_P_G_T: torch.Tensor, action_mask_P_G_T: torch.Tensor) -> torch.Tensor:
    """Eq. 6: rᵢ = Σ_{k∈Mᵢ} d_{i,k}, the token signal summed over the action mask. → r_P_G."""
    return torch.where(action_mask_P_G_T.bool(), d_P_G_T, torch.zeros_like(d_P_G_T)).sum(-1)


def step_advantages(r_P_G: torch.Tensor, std_normalize: bool = False, eps: float = 1e-6,
                    scored_P_G: torch.Tensor | None = None) -> torch.Tensor:
    """Eq. 9: Aᵢ = rᵢ − r̄ (group-centred, no std division). With ``std_normalize`` (the Appendix A.4
    variant) divide by the group's population std + eps. With ``scored_P_G`` (bool), only those responses
    form the group: r̄ (and the std) are taken over them and the others get Aᵢ = 0. → adv_P_G."""
    w = torch.ones_like(r_P_G) if scored_P_G is None else scored_P_G.to(r_P_G.dtype)
    n = w.sum(dim=-1, keepdim=True).clamp(min=1.0)
    adv = (r_P_G - (r_P_G * w).sum(dim=-1, keepdim=True) / n) * w
    if std_normalize:
        adv = adv / ((adv ** 2).sum(dim=-1, keepdim=True) / n).sqrt().add(eps)
    return adv


def rule_advantages(rule_P_G: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Eq. 12: Aᵢ^rule = (rᵢ^rule − r̄^rule) / (std_G(r^rule) + η), population std. → adv_P_G.

    A group whose rule scores are all equal gets zero advantage (0 / (0 + η) = 0)."""
    centred = rule_P_G - rule_P_G.mean(dim=-1, keepdim=True)
    return centred / (rule_P_G.std(dim=-1, unbiased=False, keepdim=True) + eps)


def importance_ratio(new_logp_P_G_T: torch.Tensor, old_logp_P_G_T: torch.Tensor,
                     response_mask_P_G_T: torch.Tensor) -> torch.Tensor:
    """ρ = π_θ/π_old per token (§2); exactly 1 on masked positions so padding can never overflow."""
    log_ratio = torch.where(response_mask_P_G_T.bool(), new_logp_P_G_T - old_logp_P_G_T.detach(),
                            torch.zeros_like(new_logp_P_G_T))
    return torch.exp(log_ratio)


def clipped_surrogate(ratio_P_G_T: torch.Tensor, adv_P_G_T: torch.Tensor,
                      clip_eps: float = 0.2, dual_clip: float | None = None) -> torch.Tensor:
    """C_ε(ρ, A) = min(ρ·A, clip(ρ, 1−ε, 1+ε)·A) (§2). Broadcasts, so ``adv`` may be ``P_G_1``.

    ``dual_clip`` = c > 1 (SDAR/verl's dual-clip, c = 3; not in the paper): where A < 0 the objective is
    further bounded below by c·A, so a token whose ratio has grown far past 1 + ε cannot push an unbounded
    negative update."""
    obj = torch.minimum(ratio_P_G_T * adv_P_G_T, ratio_P_G_T.clamp(1.0 - clip_eps, 1.0 + clip_eps) * adv_P_G_T)
    if dual_clip is None:
        return obj
    adv = torch.broadcast_to(adv_P_G_T, obj.shape)
    return torch.where(adv < 0, torch.maximum(obj, dual_clip * adv), obj)


def behaviour_weights(old_logp_P_G_T: torch.Tensor, behaviour_logp_P_G_T: torch.Tensor,
                      response_mask_P_G_T: torch.Tensor, cap: float = 5.0) -> torch.Tensor:
    """w = min(π_old/μ, c) per token (detached): the importance weight of a token sampled by a behaviour
    policy μ other than π_old (``train.overlap: one_step``: μ is the previous checkpoint, π_old the
    training weights the round starts from). Every surrogate term of the round is weighted by it, so
    E_{y~μ}[w·C_ε(ρ, A)] = E_{y~π_old}[C_ε(ρ, A)] (exactly, where no weight reaches c): the objective of
    an on-policy round at π_old, with ρ = π_θ/π_old still 1 at the first step (decoupled PPO, Hilton et
    al. 2022). Exactly 1 on padding; 1 wherever μ = π_old. → w_P_G_T.

    >>> lp = torch.log(torch.tensor([[[0.5, 0.5]]]))
    >>> w = behaviour_weights(lp, torch.log(torch.tensor([[[0.25, 0.75]]])), torch.ones(1, 1, 2))
    >>> [round(x, 4) for x in w.flatten().tolist()]
    [2.0, 0.6667]
    """
    log_w = torch.where(response_mask_P_G_T.bool(), old_logp_P_G_T.detach() - behaviour_logp_P_G_T.detach(),
                        torch.zeros_like(old_logp_P_G_T))
    return torch.exp(log_w.clamp(max=math.log(cap)))


def kl_penalty(new_logp_P_G_T: torch.Tensor, ref_logp_P_G_T: torch.Tensor, kind: KlType = "low_var_kl"
               ) -> torch.Tensor:
    """Per-token estimate of KL(π_θ ‖ π_ref) from the sampled tokens (gradient through ``new_logp``).

    - ``low_var_kl`` (SDAR's setting; Schulman's k3): with x = log π_ref − log π_θ (clamped to ±20),
      k3 = eˣ − x − 1 ≥ 0, clamped to at most 10; unbiased for the KL under samples from π_θ.
    - ``kl`` (k1): log π_θ − log π_ref.
    """
    ref = ref_logp_P_G_T.detach()
    if kind == "kl":
        return new_logp_P_G_T - ref
    if kind == "low_var_kl":
        x = (ref - new_logp_P_G_T).clamp(-20.0, 20.0)
        return (torch.exp(x) - x - 1.0).clamp(max=10.0)
    raise ValueError(f"unknown kl_type {kind!r}; expected 'low_var_kl' or 'kl'")


def token_entropy(logits_B_T_V: torch.Tensor) -> torch.Tensor:
    """The entropy of π(·) given each position's context, from aligned logits (differentiable) → entropy_B_T."""
    logits = logits_B_T_V if logits_B_T_V.dtype == torch.float64 else logits_B_T_V.float()
    logp = torch.log_softmax(logits, dim=-1)
    return -(logp.exp() * logp).sum(-1)


def token_logprobs(logits_B_T_V: torch.Tensor, tokens_B_T: torch.Tensor) -> torch.Tensor:
    """log π(tokens | context) from logits already aligned with ``tokens`` (logits[:, k] predicts
    tokens[:, k]). Uses logsumexp rather than a full log_softmax copy to save a V-sized buffer."""
    logits = logits_B_T_V.float()
    picked = logits.gather(-1, tokens_B_T.unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(logits, dim=-1)


# ---------------------------------------------------------------------------------------------------
# configuration: the paper's variants (docs/SAPD.md §4) are named settings of one LossConfig


@dataclass(frozen=True)
class LossConfig:
    """Knobs of the joint objective; defaults are the paper's (docs/SAPD.md §3, §5)."""

    # a registered objective (OBJECTIVES): sapd | sft (cross-entropy on recorded responses) | grpo (online)
    objective: str = "sapd"
    lambda_tok: float = 0.1  # λ_tok, token-level OPD weight (Eq. 13)
    lambda_step: float = 0.5  # λ_step, step-advantage weight (Eq. 13)
    lambda_rule: float = 0.1  # λ_rule, rule-reward weight (Eq. 13, following SDAR)
    token_scale: float = 0.15  # β_tok, scale of the token feedback d inside L_tok
    clip_eps: float = 0.2  # ε of the clipped surrogate
    full_token_scoring: bool = False  # Table 7: sum d over all response tokens for rᵢ
    std_normalize_step: bool = False  # Appendix A.4: divide Aᵢ^step by the group std + η
    # a response with no action tokens (docs/SAPD.md §6): "zero" = rᵢ = 0 in the group (Eq. 6 as written;
    # under on-policy sampling well-formed responses score E[rᵢ] = −KL ≤ 0, so "no action" sits above the
    # group mean); "exclude" = no step advantage, not in the group mean; "penalty" = rᵢ = −no_action_penalty
    # inside the group (SDAR/verl-agent's invalid-action penalty, subtracted before the advantage);
    # "whole_response" = rᵢ sums d over the whole response (as full-token scoring would)
    no_action_step: NoActionStep = "zero"
    no_action_penalty: float = 1.0  # nats, for no_action_step "penalty" (SDAR's ALFWorld scripts use 0.1)
    eps: float = 1e-6  # η
    reduction: Reduction = "seq_mean_token_mean"  # "token_mean" is SDAR/verl's default (not the paper's 1/Lᵢ)
    # SDAR's regularisers, which the paper's "hyperparameters follow SDAR" inherits but never states
    # (all off by default; variant sapd_sdar turns them on at SDAR's values)
    # KL to the initial policy (checkpoint 0); the train stage computes its log-probs only when kl_coef > 0
    kl_coef: float = 0.0  # SDAR: 0.01
    kl_type: KlType = "low_var_kl"  # low_var_kl (k3) | kl (k1)
    entropy_coef: float = 0.0  # entropy bonus, subtracted from the loss; SDAR: 0.001
    dual_clip: float | None = None  # c of the dual-clip for A < 0; SDAR: 3.0
    # train.overlap: one_step only (a round sampled by the previous checkpoint): the truncation c of the
    # behaviour weight w = min(π_old/μ, c) on every surrogate term (docs/SAPD.md §6; AReaL's decoupled PPO
    # uses a cap of this size, there to drop tokens rather than truncate them)
    behaviour_weight_cap: float = 5.0

    def __post_init__(self) -> None:
        _check_no_action_step(self.no_action_step)
        if self.no_action_penalty < 0:
            raise ValueError(f"no_action_penalty must be ≥ 0 (it is subtracted), not {self.no_action_penalty!r}")
        if self.kl_coef < 0 or self.entropy_coef < 0:
            raise ValueError("kl_coef and entropy_coef must be ≥ 0")
        if self.kl_type not in ("low_var_kl", "kl"):
            raise ValueError(f"kl_type must be 'low_var_kl' or 'kl', not {self.kl_type!r}")
        if self.dual_clip is not None and self.dual_clip <= 1.0:
            raise ValueError(f"dual_clip must be > 1 (SDAR uses 3.0) or null, not {self.dual_clip!r}")
        if self.reduction not in ("seq_mean_token_mean", "token_mean"):
            raise ValueError(f"reduction must be 'seq_mean_token_mean' or 'token_mean', not {self.reduction!r}")
        if self.behaviour_weight_cap < 1.0:
            raise ValueError(f"behaviour_weight_cap must be ≥ 1 (a weight of 1 is on-policy), not "
                             f"{self.behaviour_weight_cap!r}")


def _check_no_action_step(value: object) -> None:
    if value not in NO_ACTION_STEPS:
        raise ValueError(f"no_action_step must be one of {list(NO_ACTION_STEPS)}, not {value!r}")


#: the paper's variants and sapd's own, by name: the LossConfig fields each sets over the defaults
VARIANTS: dict[str, dict[str, object]] = {
    "sapd": {},
    "opd": {"lambda_step": 0.0, "lambda_rule": 0.0},
    "opd_rule": {"lambda_step": 0.0},
    "wo_opd": {"lambda_tok": 0.0},
    "wo_rule": {"lambda_rule": 0.0},
    "full_token": {"full_token_scoring": True},
    "std_norm": {"std_normalize_step": True},
    "sapd_exclude": {"no_action_step": "exclude"},
    "sapd_penalty": {"no_action_step": "penalty"},
    "sapd_whole": {"no_action_step": "whole_response"},
    # SDAR's framework settings on top of Eq. 13: reference KL, entropy bonus, dual-clip, token-mean, and
    # its invalid-action penalty inside r (coefficient 0.1, as its ALFWorld/WebShop scripts)
    "sapd_sdar": {"no_action_step": "penalty", "no_action_penalty": 0.1, "kl_coef": 0.01,
                  "entropy_coef": 0.001, "dual_clip": 3.0, "reduction": "token_mean"},
    # the paper's literal form (Eq. 6 as written, 1/Lᵢ, no regularisers), pinned whatever the default becomes
    "sapd_paper": {"no_action_step": "zero", "kl_coef": 0.0, "entropy_coef": 0.0, "dual_clip": None,
                   "reduction": "seq_mean_token_mean"},
    "sft": {"objective": "sft"},
    "grpo": {"objective": "grpo"},  # online only: rows carry the episode's advantage (sapd.baselines.online)
}


def loss_config_for(variant: str, **overrides: object) -> LossConfig:
    """The LossConfig of a named variant of docs/SAPD.md §4, with optional field overrides. A name that is
    no variant but an objective (registered, ``package.module:function`` or an entry point of
    ``sapd.objectives``) is that objective with the default knobs: ``variant: my_objective`` is enough."""
    if variant in VARIANTS:
        settings = VARIANTS[variant]
    else:
        try:
            settings = {"objective": objective_of(LossConfig(objective=variant)).name}
        except ValueError as e:
            if ":" in variant:  # it names a function: its import error is the one to see
                raise
            raise ValueError(f"unknown variant {variant!r}; expected one of {sorted(VARIANTS)} or an objective "
                             f"({e})") from None
    known = {f.name for f in fields(LossConfig)}
    unknown = set(overrides) - known
    if unknown:
        raise ValueError(f"unknown loss option(s) {sorted(unknown)}; expected some of {sorted(known)}")
    cfg = replace(LossConfig(), **{**settings, **overrides})  # type: ignore[arg-type]
    objective_of(cfg)  # an unknown objective is refused here, with the list
    return cfg


# ---------------------------------------------------------------------------------------------------
# losses


def no_action_step_scores(d_P_G_T: torch.Tensor, action_mask_P_G_T: torch.Tensor,
                          response_mask_P_G_T: torch.Tensor, cfg: LossConfig
                          ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The step scores rᵢ of one batch with the configured treatment of responses without action tokens
    (docs/SAPD.md §6) → (r_P_G, scored_P_G or None). ``action_mask`` must already be inside the response.

    zero: Eq. 6 as written (rᵢ = 0). exclude: rᵢ = 0 but the response leaves the group (``scored``).
    penalty: rᵢ = −``no_action_penalty``. whole_response: rᵢ = Σ_k d_{i,k} over the whole response.
    With ``full_token_scoring`` every response is scored over its whole text and the treatment is moot."""
    response_mask = response_mask_P_G_T.bool()
    if cfg.full_token_scoring:
        return step_scores(d_P_G_T, response_mask), None
    r_P_G = step_scores(d_P_G_T, action_mask_P_G_T)
    has_action = action_mask_P_G_T.bool().any(dim=-1)
    if cfg.no_action_step == "exclude":
        return r_P_G, has_action
    if cfg.no_action_step == "penalty":
        return torch.where(has_action, r_P_G, torch.full_like(r_P_G, -cfg.no_action_penalty)), None
    if cfg.no_action_step == "whole_response":
        return torch.where(has_action, r_P_G, step_scores(d_P_G_T, response_mask)), None
    return r_P_G, None


def regulariser_terms(cfg: LossConfig, new_logp_P_G_T: torch.Tensor, response_mask_P_G_T: torch.Tensor,
                      ref_logp_P_G_T: torch.Tensor | None, entropy_P_G_T: torch.Tensor | None
                      ) -> dict[str, torch.Tensor]:
    """SDAR's regularisers, reduced like every other term: ``loss_kl`` (to the initial policy) when
    ``kl_coef`` > 0, ``loss_entropy`` when ``entropy_coef`` > 0. The loss adds kl_coef·kl − entropy_coef·entropy
    (the logged terms are unweighted, like ``loss_tok`` and the others)."""
    out: dict[str, torch.Tensor] = {}
    mask = response_mask_P_G_T.bool()
    if cfg.kl_coef > 0:
        if ref_logp_P_G_T is None:
            raise ValueError("loss.kl_coef > 0 needs the initial policy's log-probs (ref_logp_P_G_T)")
        out["loss_kl"] = reduce_loss(kl_penalty(new_logp_P_G_T, ref_logp_P_G_T, cfg.kl_type), mask, cfg.reduction)
    if cfg.entropy_coef > 0:
        if entropy_P_G_T is None:
            raise ValueError("loss.entropy_coef > 0 needs the student's per-token entropy (entropy_P_G_T)")
        out["loss_entropy"] = reduce_loss(entropy_P_G_T, mask, cfg.reduction)
    return out


def _add_regularisers(loss: torch.Tensor, cfg: LossConfig, regs: dict[str, torch.Tensor]) -> torch.Tensor:
    if "loss_kl" in regs:
        loss = loss + cfg.kl_coef * regs["loss_kl"]
    if "loss_entropy" in regs:
        loss = loss - cfg.entropy_coef * regs["loss_entropy"]
    return loss


def sapd_loss(new_logp_P_G_T: torch.Tensor, old_logp_P_G_T: torch.Tensor,
              teacher_logp_P_G_T: torch.Tensor, response_mask_P_G_T: torch.Tensor,
              action_mask_P_G_T: torch.Tensor, rule_scores_P_G: torch.Tensor,
              cfg: LossConfig = LossConfig(), *, ref_logp_P_G_T: torch.Tensor | None = None,
              entropy_P_G_T: torch.Tensor | None = None, behaviour_logp_P_G_T: torch.Tensor | None = None
              ) -> tuple[torch.Tensor, dict[str, float]]:
    """Eq. 13: L = λ_tok L_tok + λ_step L_step + λ_rule L_rule (+ kl_coef·KL − entropy_coef·H, SDAR's).

    L_tok  = −E_h[1/G Σᵢ 1/Lᵢ Σ_k C_ε(ρ_{i,k}, β_tok·d_{i,k})]                       (Eq. 5)
    L_step = −E_h[1/G Σᵢ 1/Lᵢ Σ_k C_ε(ρ_{i,k}, Aᵢ^step)],  Aᵢ^step = rᵢ − r̄         (Eq. 9, 11)
    L_rule = same form with Aᵢ^rule, the standardised rule advantage               (Eq. 12)

    The step score rᵢ sums d over the action mask (over the whole response with
    ``cfg.full_token_scoring``); its advantage is then applied to every response token. A response with
    no action tokens (malformed) is scored as ``cfg.no_action_step`` says (:func:`no_action_step_scores`;
    "zero" is Eq. 6 as written). The action mask is intersected with the response mask, so a stray action
    bit on padding can never count. ``cfg.dual_clip`` bounds every surrogate for A < 0; ``cfg.reduction``
    is the aggregation of every term. ``ref_logp_P_G_T`` (the initial policy's log-probs) is needed when
    ``cfg.kl_coef`` > 0, ``entropy_P_G_T`` (differentiable) when ``cfg.entropy_coef`` > 0.
    ``behaviour_logp_P_G_T`` (not the paper's; ``train.overlap: one_step``): the log-probs of the policy
    that sampled the round when it is not π_old; every surrogate term is then weighted per token by
    :func:`behaviour_weights` (d and ρ stay measured against π_old). None: the paper's on-policy round.

    Returns the scalar loss (gradient flows through ``new_logp`` and ``entropy`` only) and detached float
    metrics (:func:`loss_metrics`).
    """
    response_mask = response_mask_P_G_T.bool()
    action_mask = action_mask_P_G_T.bool() & response_mask
    d_P_G_T = token_signal(teacher_logp_P_G_T, old_logp_P_G_T, response_mask)
    r_P_G, scored = no_action_step_scores(d_P_G_T, action_mask, response_mask, cfg)
    has_action_P_G = action_mask.any(dim=-1)
    step_adv_P_G = step_advantages(r_P_G, std_normalize=cfg.std_normalize_step, eps=cfg.eps, scored_P_G=scored)
    rule_adv_P_G = rule_advantages(rule_scores_P_G.to(d_P_G_T.dtype), eps=cfg.eps)
    ratio_P_G_T = importance_ratio(new_logp_P_G_T, old_logp_P_G_T, response_mask)
    w_P_G_T = None if behaviour_logp_P_G_T is None else behaviour_weights(
        old_logp_P_G_T, behaviour_logp_P_G_T, response_mask, cfg.behaviour_weight_cap)

    def surrogate_loss(adv: torch.Tensor) -> torch.Tensor:
        values = clipped_surrogate(ratio_P_G_T, adv, cfg.clip_eps, cfg.dual_clip)
        return -reduce_loss(values if w_P_G_T is None else w_P_G_T * values, response_mask, cfg.reduction)

    loss_tok = surrogate_loss(cfg.token_scale * d_P_G_T)
    loss_step = surrogate_loss(step_adv_P_G.unsqueeze(-1))
    loss_rule = surrogate_loss(rule_adv_P_G.unsqueeze(-1))
    regs = regulariser_terms(cfg, new_logp_P_G_T, response_mask, ref_logp_P_G_T, entropy_P_G_T)
    loss = _add_regularisers(cfg.lambda_tok * loss_tok + cfg.lambda_step * loss_step + cfg.lambda_rule * loss_rule,
                             cfg, regs)
    terms = {"loss": loss, "loss_tok": loss_tok, "loss_step": loss_step, "loss_rule": loss_rule, **regs}
    return loss, loss_metrics(terms, ratio_P_G_T, response_mask, cfg.clip_eps, d_P_G_T=d_P_G_T, r_P_G=r_P_G,
                              has_action_P_G=has_action_P_G, action_mask_P_G_T=action_mask,
                              step_adv_P_G=step_adv_P_G, rule_adv_P_G=rule_adv_P_G,
                              rule_scores_P_G=rule_scores_P_G, token_scale=cfg.token_scale,
                              dual_clip=cfg.dual_clip, behaviour_weight_P_G_T=w_P_G_T,
                              behaviour_weight_cap=cfg.behaviour_weight_cap)


def _no_grad(fn: Callable) -> Callable:
    """``torch.no_grad()`` as a decorator that does not import torch until the function runs."""
    @functools.wraps(fn)
    def run(*args, **kwargs):
        with torch.no_grad():
            return fn(*args, **kwargs)
    return run


@_no_grad
def loss_metrics(terms: dict[str, torch.Tensor], ratio_P_G_T: torch.Tensor, response_mask_P_G_T: torch.Tensor,
                 clip_eps: float, *, d_P_G_T: torch.Tensor | None = None, r_P_G: torch.Tensor | None = None,
                 has_action_P_G: torch.Tensor | None = None, action_mask_P_G_T: torch.Tensor | None = None,
                 step_adv_P_G: torch.Tensor | None = None, rule_adv_P_G: torch.Tensor | None = None,
                 rule_scores_P_G: torch.Tensor | None = None, token_scale: float = 0.15,
                 dual_clip: float | None = None, behaviour_weight_P_G_T: torch.Tensor | None = None,
                 behaviour_weight_cap: float = 5.0) -> dict[str, float]:
    """The detached figures logged for every optimizer step: the loss terms, the ratio and clip
    statistics, and — for the SAPD family — the signals behind its advantages and the health figures of
    docs/SAPD.md §6 (action-less share, all-action-less groups, the magnitude of each term's advantage)."""
    mask_f = response_mask_P_G_T.to(ratio_P_G_T.dtype)
    n_tok = mask_f.sum().clamp(min=1.0)
    clipped = ((ratio_P_G_T - 1.0).abs() > clip_eps) & response_mask_P_G_T
    out = {name: float(value.detach()) for name, value in terms.items()}
    out.update({"ratio_mean": float((ratio_P_G_T * mask_f).sum() / n_tok),
                "clip_fraction": float(clipped.sum() / n_tok),
                "response_tokens_mean": float(mask_f.sum(-1).mean())})
    if dual_clip is not None:  # tokens the dual-clip bounds (ratio above c; only counted where it can bind)
        out["dual_clip_fraction"] = float(((ratio_P_G_T > dual_clip) & response_mask_P_G_T).sum() / n_tok)
    if behaviour_weight_P_G_T is not None:  # a stale round (train.overlap: one_step): its weights' size
        out["behaviour_weight_mean"] = float((behaviour_weight_P_G_T * mask_f).sum() / n_tok)
        out["behaviour_weight_capped_fraction"] = float(
            ((behaviour_weight_P_G_T >= behaviour_weight_cap * (1 - 1e-6)) & response_mask_P_G_T).sum() / n_tok)
    if d_P_G_T is not None:
        # teacher–student gap: mean log-ratio per response token (≥ 0 when the teacher likes the samples more)
        out["teacher_student_gap"] = float(d_P_G_T.sum() / n_tok)
        out["tok_adv_abs_mean"] = float(token_scale * d_P_G_T.abs().sum() / n_tok)  # |β·d| per token
    if r_P_G is not None:
        out["step_score_mean"] = float(r_P_G.mean())
    if has_action_P_G is not None:
        out["no_action_fraction"] = float((~has_action_P_G).float().mean())
        # groups in which no response has an action: with "zero" they carry no step or format signal
        out["all_no_action_groups"] = float((~has_action_P_G).all(dim=-1).float().mean())
    if step_adv_P_G is not None:
        out["step_adv_abs_mean"] = float(step_adv_P_G.abs().mean())
        out["step_adv_std"] = float(step_adv_P_G.std(dim=-1, unbiased=False).mean())
    if rule_scores_P_G is not None:
        out["rule_score_mean"] = float(rule_scores_P_G.float().mean())
    if rule_adv_P_G is not None:
        out["rule_adv_abs_mean"] = float(rule_adv_P_G.abs().mean())
    if action_mask_P_G_T is not None:
        out["action_tokens_mean"] = float(action_mask_P_G_T.sum(-1).float().mean())
    return out


def sft_loss(logp_B_T: torch.Tensor, target_mask_B_T: torch.Tensor,
             reduction: Reduction = "seq_mean_token_mean") -> tuple[torch.Tensor, dict[str, float]]:
    """SFT baseline: cross-entropy on the recorded response aₜ of each prefix (−mean log-likelihood),
    reduced exactly like the SAPD terms."""
    loss = -reduce_loss(logp_B_T, target_mask_B_T, reduction)
    return loss, {"loss": float(loss.detach()), "loss_sft": float(loss.detach())}


# ---------------------------------------------------------------------------------------------------
# GRPO baseline (docs/SAPD.md §4, needs the environment; rows written by sapd.baselines.online)


def grpo_advantages(returns_P_G: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Group-relative task-reward advantage: Aₑ = (Rₑ − R̄) / (std_G(R) + η) over the G episodes of one
    game (a row of ``returns_P_G``), population std as for the rule advantage; all-equal returns → 0.

    >>> grpo_advantages(torch.tensor([[1.0, 0.0, 0.0, 1.0], [2.0, 2.0, 2.0, 2.0]])).round(decimals=4).tolist()
    [[1.0, -1.0, -1.0, 1.0], [0.0, 0.0, 0.0, 0.0]]
    """
    returns = returns_P_G.to(torch.float32)
    centred = returns - returns.mean(dim=-1, keepdim=True)
    return centred / (returns.std(dim=-1, unbiased=False, keepdim=True) + eps)


def grpo_loss(new_logp_P_G_T: torch.Tensor, old_logp_P_G_T: torch.Tensor, response_mask_P_G_T: torch.Tensor,
              advantage_P_G: torch.Tensor, cfg: LossConfig = LossConfig(objective="grpo"), *,
              ref_logp_P_G_T: torch.Tensor | None = None, entropy_P_G_T: torch.Tensor | None = None
              ) -> tuple[torch.Tensor, dict[str, float]]:
    """L_GRPO = −E[1/Lᵢ Σ_k C_ε(ρ_{i,k}, Aᵢ)] with a fixed, precomputed per-response advantage Aᵢ (for
    the online baseline: the :func:`grpo_advantages` of the episode the response belongs to, applied to
    every token of every response of that episode). No teacher, no KL term. The SAPD terms are logged
    as 0 and the teacher gap as NaN, so the training loop logs it unchanged."""
    response_mask = response_mask_P_G_T.bool()
    adv = advantage_P_G.to(new_logp_P_G_T.dtype).detach()
    ratio = importance_ratio(new_logp_P_G_T, old_logp_P_G_T, response_mask)
    loss_grpo = -reduce_loss(clipped_surrogate(ratio, adv.unsqueeze(-1), cfg.clip_eps, cfg.dual_clip),
                             response_mask, cfg.reduction)
    regs = regulariser_terms(cfg, new_logp_P_G_T, response_mask, ref_logp_P_G_T, entropy_P_G_T)
    loss = _add_regularisers(loss_grpo, cfg, regs)
    zero = torch.zeros(())
    metrics = loss_metrics({"loss": loss, "loss_grpo": loss_grpo, "loss_tok": zero, "loss_step": zero,
                            "loss_rule": zero, **regs}, ratio, response_mask, cfg.clip_eps, dual_clip=cfg.dual_clip)
    metrics.update({"teacher_student_gap": float("nan"),  # GRPO has no teacher
                    "grpo_adv_mean": float(adv.mean()), "grpo_adv_abs_mean": float(adv.abs().mean())})
    return loss, metrics


# ---------------------------------------------------------------------------------------------------
# the objectives, by name


@dataclass(frozen=True)
class LossInputs:
    """One batch of what an objective may read (shapes in the names; masks explicit). ``new_logp`` (the
    only tensor with gradient, with ``entropy``) and the response mask are always given; the training
    stage computes the others only for an objective whose function takes them (:func:`required_inputs`)."""

    new_logp_P_G_T: torch.Tensor
    response_mask_P_G_T: torch.Tensor
    old_logp_P_G_T: torch.Tensor | None = None  # π_old, recomputed with the training weights
    teacher_logp_P_G_T: torch.Tensor | None = None  # the frozen teacher's, from the scored round
    action_mask_P_G_T: torch.Tensor | None = None
    rule_scores_P_G: torch.Tensor | None = None
    advantage_P_G: torch.Tensor | None = None  # precomputed per response (the online GRPO rows)
    ref_logp_P_G_T: torch.Tensor | None = None  # the initial policy's (checkpoint 0), for loss.kl_coef > 0
    entropy_P_G_T: torch.Tensor | None = None  # the student's per-token entropy, for loss.entropy_coef > 0
    # the log-probs of the policy that sampled the round (the sampler's own), for a round sampled by an
    # older checkpoint than π_old (train.overlap: one_step); the training stage passes it only then
    behaviour_logp_P_G_T: torch.Tensor | None = None


INPUT_NAMES = tuple(f.name for f in fields(LossInputs))
# taken only when the config turns the regulariser on (a loss that accepts them gets None otherwise)
REGULARISER_INPUTS = {"ref_logp_P_G_T": "kl_coef", "entropy_P_G_T": "entropy_coef"}
LossFn = Callable[..., "tuple[torch.Tensor, dict[str, float]]"]
ObjectiveData = Literal["scored", "recorded", "online"]


@dataclass(frozen=True)
class Objective:
    """A registered objective: its loss function and what that function takes."""

    name: str
    loss: LossFn
    needs: frozenset[str]  # LossInputs it cannot do without (parameters without a default)
    accepts: frozenset[str]  # every LossInputs it takes
    # what it trains on: "scored" groups (the teacher-scores stage writes them), the "recorded" responses of
    # the round's prefixes (G = 1; no teacher), or "online" rows only `sapd online` writes
    data: ObjectiveData = "scored"


OBJECTIVES: dict[str, Objective] = {}


def register_objective(name: str, *, data: ObjectiveData = "scored") -> Callable[[LossFn], LossFn]:
    """Register ``fn`` as objective ``name`` (``LossConfig.objective``; a variant in :data:`VARIANTS` selects
    it). ``fn(<LossInputs fields it uses>..., cfg) -> (loss, float metrics)``: its parameters named like
    :class:`LossInputs` fields are what it reads — without a default, required; with one (``None``),
    passed when the config asks for them (the regularisers' inputs) — and ``cfg`` is the :class:`LossConfig`.
    The metrics must hold ``loss``; ``loss_*`` keys are logged as its terms.

    >>> @register_objective("doc_example")
    ... def doc_example(new_logp_P_G_T, response_mask_P_G_T, teacher_logp_P_G_T, cfg):
    ...     loss = reduce_loss((new_logp_P_G_T - teacher_logp_P_G_T) ** 2, response_mask_P_G_T, cfg.reduction)
    ...     return loss, {"loss": float(loss)}
    >>> sorted(OBJECTIVES["doc_example"].needs)
    ['new_logp_P_G_T', 'response_mask_P_G_T', 'teacher_logp_P_G_T']
    >>> del OBJECTIVES["doc_example"]
    """
    def register(fn: LossFn) -> LossFn:
        if name in OBJECTIVES:
            raise ValueError(f"objective {name!r} is registered already ({OBJECTIVES[name].loss.__qualname__})")
        params = inspect.signature(fn).parameters
        unknown = [p for p in params if p not in INPUT_NAMES and p != "cfg"]
        if "cfg" not in params or unknown or not {"new_logp_P_G_T", "response_mask_P_G_T"} <= set(params):
            raise TypeError(f"objective {name!r}: {fn.__qualname__} must take new_logp_P_G_T, response_mask_P_G_T "
                            f"and cfg, and otherwise only LossInputs fields ({', '.join(INPUT_NAMES)})"
                            + (f"; not {unknown}" if unknown else ""))
        accepts = frozenset(p for p in params if p in INPUT_NAMES)
        needs = frozenset(p for p in accepts if params[p].default is inspect.Parameter.empty)
        OBJECTIVES[name] = Objective(name, fn, needs, accepts, data)
        return fn
    return register


register_objective("sapd")(sapd_loss)
register_objective("grpo", data="online")(grpo_loss)


@register_objective("sft", data="recorded")
def sft_objective(new_logp_P_G_T: torch.Tensor, response_mask_P_G_T: torch.Tensor,
                  cfg: LossConfig = LossConfig(objective="sft")) -> tuple[torch.Tensor, dict[str, float]]:
    """:func:`sft_loss` on the recorded responses (one per prefix: G = 1, the mask covering the response
    and its EOS)."""
    return sft_loss(new_logp_P_G_T, response_mask_P_G_T, cfg.reduction)


ENTRY_POINT_GROUP = "sapd.objectives"


def objective_of(cfg: LossConfig) -> Objective:
    """The objective ``cfg.objective`` names: a registered one; else ``package.module:function`` (the module
    is imported; a function it registered is that objective, any other is registered as a "scored" one
    under this name); else an entry point of the group ``sapd.objectives`` of that name (an installed
    package's ``[project.entry-points."sapd.objectives"]``), loaded the same way. A ValueError otherwise,
    naming the registered objectives."""
    name = cfg.objective
    if name in OBJECTIVES:
        return OBJECTIVES[name]
    # user code, outside sapd's layers: both forms are entry-point values, loaded as Python loads those
    if ":" in name:
        return _external(name, EntryPoint(name, name, ENTRY_POINT_GROUP), "")
    found = entry_points(group=ENTRY_POINT_GROUP, name=name)
    if found:
        return _external(name, next(iter(found)), f"entry point of group {ENTRY_POINT_GROUP!r} ")
    raise ValueError(f"objective must be one of {sorted(OBJECTIVES)}, a package.module:function, or an entry point "
                     f"of group {ENTRY_POINT_GROUP!r}; not {name!r}")


def _external(name: str, ep: EntryPoint, what: str) -> Objective:
    """The objective ``ep`` loads, under ``name``: the one its function was registered as (by the module's own
    :func:`register_objective`), or the function registered now (checked as :func:`register_objective`
    checks it)."""
    module, _, attr = ep.value.partition(":")
    try:
        fn = ep.load()
    except (ImportError, AttributeError) as e:
        raise ValueError(f"objective {name!r}: {what}cannot load {attr!r} from module {module!r} ({e}); is it on "
                         "PYTHONPATH, or installed in this environment?") from None
    for obj in OBJECTIVES.values():
        if obj.loss is fn:
            OBJECTIVES[name] = obj
            return obj
    if not callable(fn):
        raise ValueError(f"objective {name!r} is not a function: {fn!r}")
    try:
        register_objective(name)(fn)
    except TypeError as e:
        raise ValueError(str(e)) from None
    return OBJECTIVES[name]


def required_inputs(cfg: LossConfig) -> frozenset[str]:
    """The :class:`LossInputs` the training stage computes for ``cfg``: what its objective needs, and the
    regularisers' inputs it accepts when the config turns them on (``kl_coef``, ``entropy_coef`` > 0)."""
    obj = objective_of(cfg)
    on = {name for name, coef in REGULARISER_INPUTS.items() if name in obj.accepts and getattr(cfg, coef) > 0}
    return obj.needs | on


def loss_for(cfg: LossConfig, inputs: LossInputs) -> tuple[torch.Tensor, dict[str, float]]:
    """The loss of ``cfg.objective`` on one batch: its registered function with the inputs it takes."""
    obj = objective_of(cfg)
    missing = sorted(n for n in required_inputs(cfg) if getattr(inputs, n) is None)
    if missing:
        hint = (" (objective 'grpo' trains on rows with a precomputed advantage: sapd online --method grpo)"
                if "advantage_P_G" in missing else "")
        raise ValueError(f"objective {obj.name!r} needs {', '.join(missing)}, which this batch lacks{hint}")
    return obj.loss(**{n: getattr(inputs, n) for n in obj.accepts}, cfg=cfg)
