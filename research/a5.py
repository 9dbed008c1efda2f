"""The paper's Appendix A.5 predictions, tested on real scored groups (``python -m research study``, item 7).

The groups are the SAPD run's scored rounds (teacher and sampler log-probs of the student's own
samples, action masks), so the step scores rᵢ = Σ_{k∈Mᵢ} d_{i,k} are the ones SAPD trained on:

1. **Offset invariance.** Add any per-group constant b(h) to every rᵢ (realised as teacher log-prob
   shifts of b/Nᵢ on each action token): Aᵢ^step and L_step do not change (float rounding only); a
   whole training round of the step branch (w/o OPD) from the same checkpoint ends at the same weights,
   while the token branch (full SAPD) does not.
2. **Token-level offsets.** A shared *per-token* error b_tok leaves b_tok·(Nᵢ − N̄) after summation;
   over the action mask Nᵢ varies little, over the whole response (full-token scoring) much more.
3. **Response-dependent noise.** rᵢ + eᵢ with |eᵢ| ≤ ε moves each advantage by at most 2ε (the
   bound holds on every group); how often the within-group order survives, against ε relative to the
   typical within-group spread.
4. **Swapped teacher ranking.** Exchanging the scores of a group's best and worst responses exchanges
   their centred advantages exactly: centring does not repair a wrong ranking.
5. **Std normalisation under weak differences.** For r = b·1 + α·v, ‖A^step‖ = α‖v‖ → 0 while the
   std-normalised advantage keeps ‖A‖ = √G for any α > 0; the share of real groups whose spread is
   weak is where the two differ most.
"""

from __future__ import annotations

import copy
import math
import random
from typing import Any

import torch

from sapd import checkpoints
from sapd.config import config_from_dict
from sapd.data.scored import read_scored, scored_prefixes
from sapd.engines.torch_engine import make_torch_engine
from sapd.method.objective import LossConfig, sapd_loss, step_advantages, step_scores, token_signal
from sapd.models.loading import load_tokenizer
from sapd.stages.train import train_round


def scored_groups(root: str, rounds: list[int]) -> dict[str, torch.Tensor]:
    """Stacked tensors of every scored group of ``rounds``: teacher/old log-probs and masks (P×G×T),
    rule scores (P×G). Groups are padded to the longest response."""
    rows = [r for k in rounds for r in read_scored(root, k).to_pylist()]
    if not rows:
        raise ValueError(f"{root}: no scored groups in rounds {rounds}")
    G = len(rows[0]["response_token_ids"])
    T = max(len(x) for r in rows for x in r["response_token_ids"]) or 1
    P = len(rows)
    out = {name: torch.zeros((P, G, T), dtype=torch.float64) for name in ("teacher", "old")}
    out["response"] = torch.zeros((P, G, T), dtype=torch.bool)
    out["action"] = torch.zeros((P, G, T), dtype=torch.bool)
    for p, r in enumerate(rows):
        for i in range(G):
            n = len(r["response_token_ids"][i])
            out["teacher"][p, i, :n] = torch.tensor(r["teacher_logprobs"][i], dtype=torch.float64)
            out["old"][p, i, :n] = torch.tensor(r["sampler_logprobs"][i], dtype=torch.float64)
            out["response"][p, i, :n] = True
            out["action"][p, i, :n] = torch.tensor(r["action_mask"][i], dtype=torch.bool)
    out["rule"] = torch.tensor([r["rule_score"] for r in rows], dtype=torch.float64)
    return out


def _max(t: torch.Tensor) -> float | None:
    """max of a possibly empty tensor (None when empty: a toy run may have no qualifying group)."""
    return float(t.max()) if t.numel() else None


def _mean(t: torch.Tensor) -> float | None:
    return float(t.float().mean()) if t.numel() else None


def _median(t: torch.Tensor) -> float | None:
    return float(t.median()) if t.numel() else None


def _scores(g: dict[str, torch.Tensor], teacher: torch.Tensor | None = None, full: bool = False) -> torch.Tensor:
    d = token_signal(g["teacher"] if teacher is None else teacher, g["old"], g["response"])
    return step_scores(d, g["response"] if full else g["action"] & g["response"])


def offset_invariance(g: dict[str, torch.Tensor], seed: int = 0, scale: float = 10.0) -> dict[str, Any]:
    """Prediction 1 at the score and loss level: per-group offsets injected through the teacher's
    log-probs on action tokens; groups where some response has no action token are left out (their
    rᵢ = 0 cannot move)."""
    n_act = (g["action"] & g["response"]).sum(-1)  # P×G
    ok = (n_act > 0).all(-1)
    gen = torch.Generator().manual_seed(seed)
    b = torch.randn(g["rule"].shape[0], generator=gen, dtype=torch.float64) * scale
    shift = torch.where(g["action"] & g["response"], (b[:, None] / n_act.clamp(min=1))[..., None], torch.zeros(()))
    shift = shift * ok[:, None, None]
    t2 = g["teacher"] + shift
    r, r2 = _scores(g), _scores(g, t2)
    a, a2 = step_advantages(r), step_advantages(r2)
    # the loss away from θ_old: perturbed current log-probs, so ratios are not all 1
    new = g["old"] + 0.05 * torch.randn(g["old"].shape, generator=gen, dtype=torch.float64)
    step_only = LossConfig(lambda_tok=0.0, lambda_step=1.0, lambda_rule=0.0)
    l1, _ = sapd_loss(new, g["old"], g["teacher"], g["response"], g["action"], g["rule"], step_only)
    l2, _ = sapd_loss(new, g["old"], t2, g["response"], g["action"], g["rule"], step_only)
    token_only = LossConfig(lambda_tok=1.0, lambda_step=0.0, lambda_rule=0.0)
    t1, _ = sapd_loss(new, g["old"], g["teacher"], g["response"], g["action"], g["rule"], token_only)
    tt2, _ = sapd_loss(new, g["old"], t2, g["response"], g["action"], g["rule"], token_only)
    return {"groups": int(ok.sum()), "groups_left_out": int((~ok).sum()), "offset_scale": scale,
            "score_shift_max_error": _max(((r2 - r) - b[:, None])[ok].abs()),
            "advantage_max_abs_change": _max((a2 - a)[ok].abs()),
            "step_loss_change": float((l2 - l1).abs()), "token_loss_change": float((tt2 - t1).abs())}


def offset_training_round(study, models: dict[str, str], root: str, k: int = 0, scale: float = 10.0,
                          seed: int = 0) -> dict[str, Any]:
    """Prediction 1 through training: round k of ``root`` trained again from checkpoint k, once as
    scored and once with per-group offsets injected, for the step branch alone (w/o OPD: λ_tok = 0) and
    for the full SAPD loss. Returns the largest weight difference of each pair."""
    table = read_scored(root, k)
    tok = load_tokenizer(str(checkpoints.checkpoint_model_path(root, k)))
    gen = random.Random(seed)

    def inject(groups):
        out = copy.deepcopy(groups)
        for grp in out:
            n = [sum(m) for m in grp.action_mask_G_T]
            if min(n) == 0:
                continue
            b = gen.gauss(0.0, scale)
            grp.teacher_logp_G_T = [[lp + (b / n[i] if m else 0.0) for lp, m in zip(lps, grp.action_mask_G_T[i])]
                                    for i, lps in enumerate(grp.teacher_logp_G_T)]
        return out

    base = scored_prefixes(table)
    shifted = inject(base)
    out = {}
    for variant in ("wo_opd", "sapd"):
        cfg = config_from_dict(study.method_config("a5-offset", variant, "strong_teacher", seed, models))
        weights = []
        for groups in (copy.deepcopy(base), copy.deepcopy(shifted)):
            torch.manual_seed(0)
            model = checkpoints.load_checkpoint_model(root, k, trainable=True)
            engine = make_torch_engine(model, cfg)
            train_round(cfg, k, engine, tok, groups, None, log=lambda s: None, show_progress=False)
            weights.append({n: p.detach().clone() for n, p in model.named_parameters()})
        diff = max(float((weights[0][n] - weights[1][n]).abs().max()) for n in weights[0])
        moved = max(float((weights[0][n] - p.detach()).abs().max())
                    for n, p in checkpoints.load_checkpoint_model(root, k).named_parameters())
        out[variant] = {"max_weight_difference": diff, "max_weight_update": moved}
    return out


def token_offset_residual(g: dict[str, torch.Tensor], b_tok: float = 1.0) -> dict[str, Any]:
    """Prediction 2: a per-token offset b_tok on every scored token leaves b_tok·(Nᵢ − N̄) after
    summation; measured for the action mask and for full-token scoring."""
    out = {}
    for name, full in (("action_only", False), ("full_token", True)):
        mask = g["response"] if full else g["action"] & g["response"]
        r = _scores(g, full=full)
        r2 = _scores(g, g["teacher"] + b_tok * mask, full=full)
        dev = (step_advantages(r2) - step_advantages(r)).abs() / b_tok
        n = mask.sum(-1).to(torch.float64)
        spread = step_advantages(r).abs().mean()
        out[name] = {"mean_abs_residual_per_unit_offset": float(dev.mean()),
                     "max_abs_residual_per_unit_offset": float(dev.max()),
                     "groups_with_varying_length": float(((n.max(-1).values - n.min(-1).values) > 0).float().mean()),
                     "mean_scored_tokens": float(n.mean()),
                     "residual_relative_to_mean_abs_advantage": float(dev.mean() / spread) if spread > 0 else None}
    return out


def noise_sensitivity(g: dict[str, torch.Tensor], eps_fractions=(0.1, 0.25, 0.5, 1.0, 2.0),
                      seed: int = 0) -> dict[str, Any]:
    """Prediction 3: uniform per-response noise |eᵢ| ≤ ε (ε a fraction of the median within-group std
    of r): the 2ε bound on every advantage, pairwise order agreement and best-response agreement."""
    r = _scores(g)
    std = r.std(-1, unbiased=False)
    base_scale = float(std[std > 0].median()) if (std > 0).any() else 1.0
    a = step_advantages(r)
    gen = torch.Generator().manual_seed(seed)
    G = r.shape[-1]
    iu = torch.triu_indices(G, G, 1)
    rows = []
    for frac in eps_fractions:
        eps = frac * base_scale
        e = (torch.rand(r.shape, generator=gen, dtype=torch.float64) * 2 - 1) * eps
        a2 = step_advantages(r + e)
        worst = float((a2 - a).abs().max())
        d1 = (r[:, iu[0]] - r[:, iu[1]])
        d2 = (r + e)[:, iu[0]] - (r + e)[:, iu[1]]
        keep = d1 != 0
        rows.append({"eps_over_median_std": frac, "eps": eps, "max_abs_advantage_change": worst,
                     "bound_2eps_holds": worst <= 2 * eps + 1e-12,
                     "pairwise_order_kept": _mean(((d1 > 0) == (d2 > 0))[keep]),
                     "best_response_kept": float((r.argmax(-1) == (r + e).argmax(-1)).float().mean())})
    return {"median_within_group_std": base_scale, "rows": rows}


def swapped_ranking(g: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Prediction 4: swap the best and the worst score of each group; their advantages swap exactly."""
    r = _scores(g)
    a = step_advantages(r)
    best, worst = r.argmax(-1), r.argmin(-1)
    idx = torch.arange(r.shape[0])
    r2 = r.clone()
    r2[idx, best], r2[idx, worst] = r[idx, worst], r[idx, best]
    a2 = step_advantages(r2)
    real = best != worst
    others = (torch.arange(r.shape[1])[None] != best[:, None]) & (torch.arange(r.shape[1])[None] != worst[:, None])
    return {"groups": int(real.sum()),
            "swap_error": _max(torch.maximum((a2[idx, best] - a[idx, worst]).abs(),
                                             (a2[idx, worst] - a[idx, best]).abs())[real]),
            "others_unchanged_error": _max(torch.where(others, (a2 - a).abs(), torch.zeros(()))[real]),
            "best_gets_negative_advantage": _mean((a2[idx, best] < 0)[real])}


def std_normalisation(g: dict[str, torch.Tensor], alphas=(1.0, 0.1, 0.01, 0.001)) -> dict[str, Any]:
    """Prediction 5: r = b·1 + α·v on the real groups' deviations v; the norms of both advantages."""
    r = _scores(g)
    G = r.shape[-1]
    v = r - r.mean(-1, keepdim=True)
    live = v.abs().sum(-1) > 0
    b = torch.full((r.shape[0], 1), -3.0, dtype=torch.float64)
    rows = []
    for alpha in alphas:
        rr = b + alpha * v
        plain = step_advantages(rr).norm(dim=-1)[live]
        normed = step_advantages(rr, std_normalize=True).norm(dim=-1)[live]
        rows.append({"alpha": alpha, "step_adv_norm_median": _median(plain),
                     "std_norm_adv_norm_median": _median(normed)})
    std = r.std(-1, unbiased=False)
    return {"sqrt_G": math.sqrt(G), "rows": rows,
            "within_group_std_quantiles": {q: float(std.quantile(q)) for q in (0.1, 0.25, 0.5, 0.75, 0.9)},
            "share_of_groups_with_std_below_0.1": float((std < 0.1).float().mean()),
            "share_of_groups_all_equal": float((~live).float().mean())}


def a5_experiments(study, models: dict[str, str]) -> dict[str, Any]:
    """All five predictions on the Table 1 SAPD run (strong teacher, first seed)."""
    root = str(study.runs / f"sapd-strong_teacher-s{study.cfg.seeds[0]}")
    rounds = list(range(study.cfg.rounds))
    g = scored_groups(root, rounds)
    study.log(f"A.5: {g['rule'].shape[0]} scored groups of G={g['rule'].shape[1]} from {root}")
    return {"run_root": root, "groups": int(g["rule"].shape[0]), "group_size": int(g["rule"].shape[1]),
            "offset_invariance": offset_invariance(g),
            "offset_training_round": offset_training_round(study, models, root, 0),
            "token_offset_residual": token_offset_residual(g),
            "noise_sensitivity": noise_sensitivity(g),
            "swapped_ranking": swapped_ranking(g),
            "std_normalisation": std_normalisation(g)}
