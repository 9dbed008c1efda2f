"""95 % intervals for the demo's table and the research reports: the Wilson interval of one proportion, and a
paired bootstrap of the difference between two arms measured on the same units (games, decisions), with
training seeds as a second level when there are several. Pure Python, seeded: a test recomputes the same
numbers."""

from __future__ import annotations

import random
from typing import Mapping, Sequence

from sapd.data.validation import wilson


def wilson_interval(p: float, n: int, z: float = 1.959964) -> tuple[float, float]:
    """The 95 % Wilson score interval of a proportion ``p`` measured on ``n`` trials (the one
    :func:`sapd.data.validation.wilson` the run's validation uses)."""
    return wilson(p, n, z)


def percentile_interval(reps: list[float], level: float) -> tuple[float, float]:
    """The central ``level`` percentile interval of bootstrap replicates (sorts ``reps`` in place)."""
    reps.sort()
    n = len(reps)
    return reps[int((1 - level) / 2 * n)], reps[min(n - 1, int((1 + level) / 2 * n))]


def paired_bootstrap(a: Mapping[int, Mapping[str, float]], b: Mapping[int, Mapping[str, float]], *,
                     n_boot: int = 4000, seed: int = 0, level: float = 0.95) -> dict[str, float]:
    """Difference of means, arm a − arm b, with a two-level bootstrap interval: outcomes are
    ``{seed: {unit: value}}`` (unit = game or held-out prefix, the same units in both arms). Each
    replicate resamples each arm's seeds with replacement, then the units once for both arms (paired by
    unit). → {"diff", "lo", "hi", "units", "seeds_a", "seeds_b"}."""
    units = sorted(set.intersection(*(set(v) for v in [*a.values(), *b.values()])))
    if not units or not a or not b:
        raise ValueError("paired_bootstrap needs at least one seed per arm and shared units")
    sa, sb = sorted(a), sorted(b)

    def mean(arm: Mapping[int, Mapping[str, float]], seeds: Sequence[int], us: Sequence[str]) -> float:
        return sum(arm[s][u] for s in seeds for u in us) / (len(seeds) * len(us))

    diff = mean(a, sa, units) - mean(b, sb, units)
    rng = random.Random(seed)
    reps = []
    for _ in range(n_boot):
        us = [units[rng.randrange(len(units))] for _ in units]
        ra = [sa[rng.randrange(len(sa))] for _ in sa]
        rb = [sb[rng.randrange(len(sb))] for _ in sb]
        reps.append(mean(a, ra, us) - mean(b, rb, us))
    lo, hi = percentile_interval(reps, level)
    return {"diff": diff, "lo": lo, "hi": hi, "units": len(units), "seeds_a": len(sa), "seeds_b": len(sb)}
