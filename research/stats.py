"""Statistics of the powered study: the power calculation written in ``experiments/powered.yaml``,
paired-by-game bootstrap intervals (:func:`paired_bootstrap`, shared with the demo: it lives in
:mod:`sapd.demo.intervals`), and the within-group AUC of a step score. Pure Python (no numpy), so the
numbers a test recomputes are the numbers the study used.
"""

from __future__ import annotations

import math
import random
import statistics
from typing import Any, Sequence

from sapd.demo.intervals import paired_bootstrap, percentile_interval

__all__ = ["episodes_per_arm", "mde", "paired_bootstrap", "pearson", "percentile_interval", "units_for_mde",
           "within_group_auc", "z"]

_N = statistics.NormalDist()


def z(q: float) -> float:
    """The standard normal quantile."""
    return _N.inv_cdf(q)


def episodes_per_arm(p1: float, p2: float, alpha: float = 0.05, power: float = 0.8) -> int:
    """Episodes per arm to tell success rates p1 and p2 apart from binomial variance alone (two-sided α,
    unpaired): n = (z_{1−α/2} + z_power)² · [p1(1−p1) + p2(1−p2)] / (p1 − p2)²."""
    if p1 == p2:
        raise ValueError("p1 and p2 must differ")
    k = (z(1 - alpha / 2) + z(power)) ** 2
    return math.ceil(k * (p1 * (1 - p1) + p2 * (1 - p2)) / (p1 - p2) ** 2 - 1e-9)


def mde(p: float, n_units: int, seeds: int, sigma_seed: float, rho: float = 0.0, alpha: float = 0.05,
        power: float = 0.8) -> float:
    """Minimum detectable difference between two arms' means of a 0/1 outcome with ``n_units`` units
    (games or prefixes) shared by both arms, ``seeds`` seeds per arm, between-seed standard deviation
    ``sigma_seed`` and a share ``rho`` of the outcome variance due to the unit (cancels when paired):
    MDE = (z_{1−α/2} + z_power) · √(2 · [p(1−p)(1−ρ)/(n·S) + σ²_seed/S])."""
    var_arm = p * (1 - p) * (1 - rho) / (n_units * seeds) + sigma_seed ** 2 / seeds
    return (z(1 - alpha / 2) + z(power)) * math.sqrt(2 * var_arm)


def units_for_mde(target: float, p: float, seeds: int, sigma_seed: float, rho: float = 0.0, alpha: float = 0.05,
                  power: float = 0.8) -> int:
    """The smallest number of shared units whose :func:`mde` is at most ``target`` (the inverse of
    :func:`mde`); an error when the seed variance alone already exceeds the target."""
    budget = (target / (z(1 - alpha / 2) + z(power))) ** 2 / 2 - sigma_seed ** 2 / seeds
    if budget <= 0:
        raise ValueError(f"an MDE of {target} cannot be reached with {seeds} seeds at σ_seed = {sigma_seed}: "
                         "add seeds")
    return math.ceil(p * (1 - p) * (1 - rho) / (seeds * budget) - 1e-9)


def within_group_auc(groups: Sequence[Sequence[tuple[float, bool]]], *, n_boot: int = 4000, seed: int = 0,
                     level: float = 0.95) -> dict[str, Any]:
    """How well a score ranks correct responses above wrong ones *within* a group (SAPD compares
    responses only within their prefix's group): over every (correct, wrong) pair of the same group, the
    share where the correct one scores higher, ties counting 1/2. ``groups`` = [[(score, correct), …]].
    → {"auc", "pairs", "groups", "ci"}: groups with both kinds; ``ci`` the bootstrap interval over those
    groups (prefixes resampled with replacement, the pooled AUC recomputed; ANALYSIS_PLAN.md §6). auc is
    NaN and ci [NaN, NaN] when no group has both kinds."""
    per_group: list[tuple[float, float]] = []
    for g in groups:
        pos = [s for s, c in g if c]
        neg = [s for s, c in g if not c]
        if not pos or not neg:
            continue
        wins = sum(1.0 if p > n else 0.5 if p == n else 0.0 for p in pos for n in neg)
        per_group.append((wins, float(len(pos) * len(neg))))
    pairs = sum(n for _, n in per_group)
    if not pairs:
        return {"auc": float("nan"), "pairs": 0.0, "groups": 0, "ci": [float("nan"), float("nan")]}
    rng = random.Random(seed)
    reps = []
    for _ in range(n_boot):
        draw = [per_group[rng.randrange(len(per_group))] for _ in per_group]
        reps.append(sum(w for w, _ in draw) / sum(n for _, n in draw))
    ci = list(percentile_interval(reps, level))
    return {"auc": sum(w for w, _ in per_group) / pairs, "pairs": pairs, "groups": len(per_group), "ci": ci}


def pearson(xs: Sequence[float], ys: Sequence[float]) -> float:
    """Pearson correlation; NaN when either side is constant or there are fewer than 2 points."""
    if len(xs) < 2 or len(set(xs)) < 2 or len(set(ys)) < 2:
        return float("nan")
    return statistics.correlation(list(xs), list(ys))
