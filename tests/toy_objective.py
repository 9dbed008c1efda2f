"""A toy objective defined outside the sapd package, as a user's own module would be: the squared gap
between the student's and the teacher's log-probs of the sampled tokens, with a second term it only logs.
Runs name it ``tests.toy_objective:squared_gap`` (``loss.objective`` or the variant), or the entry point
``toy_gap`` (tests/method/test_objective_plugin.py installs one); docs/guides/new-objective.md shows the same."""

from __future__ import annotations

import torch

from sapd.method.objective import LossConfig, reduce_loss


def squared_gap(new_logp_P_G_T: torch.Tensor, response_mask_P_G_T: torch.Tensor, teacher_logp_P_G_T: torch.Tensor,
                cfg: LossConfig) -> tuple[torch.Tensor, dict[str, float]]:
    """L = mean over responses of 1/Lᵢ Σ_k (log π_θ − log π_T)²; ``loss_abs_gap`` (|log π_θ − log π_T|,
    reduced alike) is logged beside it, not trained on."""
    diff_P_G_T = new_logp_P_G_T - teacher_logp_P_G_T
    gap = reduce_loss(diff_P_G_T ** 2, response_mask_P_G_T, cfg.reduction)
    abs_gap = reduce_loss(diff_P_G_T.detach().abs(), response_mask_P_G_T, cfg.reduction)
    return gap, {"loss": float(gap.detach()), "loss_gap": float(gap.detach()), "loss_abs_gap": float(abs_gap)}
