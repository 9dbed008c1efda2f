"""ReOPD (issue 4, item 6): prefixes from *teacher-generated* trajectories, sampled with a step-decaying
schedule p(t) ∝ κ^t over the decision index t (κ configurable, default 0.6).

Two pieces:

* :func:`teacher_pool` — a teacher model (an HF folder, or checkpoint ``k`` of a run root) plays the
  environment panel with sampling (temperature 1 by default, seeded), and the episodes are written as
  native trajectories (JSONL) that the ordinary prefix builder reads (``data.format: native``).
* :func:`reopd_sample` — a pure, seeded draw of ``n`` prefixes *without replacement*, each prefix's
  weight κ^turn_index (Gumbel-top-k, i.e. successive sampling ∝ weight, computed in log space so long
  trajectories never underflow). Deterministic per seed and independent of the input row order.
  :func:`reopd_round_batch` uses it for round k's batch, in place of
  :func:`sapd.precompute.round_batch`'s whole-trajectory batches.

For a single draw (n = 1) the probability of prefix i is exactly κ^{t_i} / Σ_j κ^{t_j}
(:func:`reopd_probabilities`); κ = 1 is uniform over prefixes.

>>> rows = [{"prefix_id": f"a#{t}", "turn_index": t} for t in range(3)]
>>> [round(p, 4) for p in reopd_probabilities(rows, kappa=0.5)]
[0.5714, 0.2857, 0.1429]
>>> [r["prefix_id"] for r in reopd_sample(rows, 3, kappa=0.5, seed=0)] == ["a#0", "a#1", "a#2"]
True
"""

from __future__ import annotations

import hashlib
import math
import random
from pathlib import Path
from typing import Any, Callable, Sequence

import pyarrow as pa

DEFAULT_KAPPA = 0.6

Rows = list[dict[str, Any]]


def _check_kappa(kappa: float) -> None:
    if not (isinstance(kappa, (int, float)) and kappa > 0 and math.isfinite(kappa)):
        raise ValueError(f"kappa must be a positive number, not {kappa!r}")


def _as_rows(prefixes: pa.Table | Sequence[dict[str, Any]]) -> Rows:
    return prefixes.to_pylist() if isinstance(prefixes, pa.Table) else list(prefixes)


def reopd_probabilities(prefixes: pa.Table | Sequence[dict[str, Any]], kappa: float = DEFAULT_KAPPA) -> list[float]:
    """Single-draw probability of each prefix (input order): κ^t / Σ κ^t', computed stably."""
    _check_kappa(kappa)
    rows = _as_rows(prefixes)
    if not rows:
        return []
    logw = [r["turn_index"] * math.log(kappa) for r in rows]
    m = max(logw)
    w = [math.exp(x - m) for x in logw]
    s = sum(w)
    return [x / s for x in w]


def reopd_sample(prefixes: pa.Table | Sequence[dict[str, Any]], n: int, kappa: float = DEFAULT_KAPPA,
                 seed: int | str = 0) -> pa.Table | Rows:
    """Draw ``min(n, len)`` distinct prefixes, successively with probability ∝ κ^turn_index.

    Gumbel-top-k: each prefix gets the key ``t·log κ + G`` with G ~ Gumbel(0, 1) drawn from
    ``Random(seed)`` in sorted ``prefix_id`` order, and the n largest keys are kept — exactly sequential
    sampling without replacement ∝ weight. Returns the same kind as given (a Table or a list of rows),
    the chosen rows ordered by (trajectory_id, turn_index, prefix_id)."""
    _check_kappa(kappa)
    if n < 0:
        raise ValueError("n must be non-negative")
    is_table = isinstance(prefixes, pa.Table)
    rows = _as_rows(prefixes)
    order = sorted(range(len(rows)), key=lambda i: rows[i]["prefix_id"])
    if len({rows[i]["prefix_id"] for i in order}) != len(rows):
        raise ValueError("prefix_id values must be unique")
    rng = random.Random(f"reopd:{seed}")
    log_k = math.log(kappa)
    keys: dict[int, float] = {}
    for i in order:
        u = rng.random()
        while u <= 0.0:  # random() is in [0, 1); avoid log(0)
            u = rng.random()
        keys[i] = rows[i]["turn_index"] * log_k - math.log(-math.log(u))
    chosen = sorted(keys, key=lambda i: (-keys[i], rows[i]["prefix_id"]))[:n]
    chosen.sort(key=lambda i: (rows[i].get("trajectory_id", ""), rows[i]["turn_index"], rows[i]["prefix_id"]))
    if is_table:
        return prefixes.take(pa.array(chosen, type=pa.int64()))  # type: ignore[union-attr]
    return [rows[i] for i in chosen]


def prefixes_per_round(table: pa.Table, trajectories_per_round: int) -> int:
    """The ReOPD batch size matching an ordinary round: trajectories_per_round × the mean number of
    kept prefixes per trajectory (rounded, at least 1, at most the table)."""
    n_traj = len(set(table.column("trajectory_id").to_pylist()))
    if n_traj == 0:
        return 0
    return max(1, min(table.num_rows, round(trajectories_per_round * table.num_rows / n_traj)))


def reopd_round_batch(cfg, k: int, kappa: float | None = None, n: int | None = None) -> pa.Table:
    """Round k's prefixes under ReOPD: ``n`` (default :func:`prefixes_per_round`) train prefixes drawn by
    :func:`reopd_sample`, seeded by (train.seed, k) — a rerun of round k draws the same batch. ``kappa``
    defaults to ``cfg.data.reopd_kappa`` when the config has it, else 0.6."""
    from sapd import layout
    from sapd.data.prefixes import read_prefixes
    if kappa is None:
        kappa = getattr(cfg.data, "reopd_kappa", None) or DEFAULT_KAPPA
    table = read_prefixes(layout.prefixes_dir(cfg.run_root), "train")
    if n is None:
        n = prefixes_per_round(table, cfg.train.trajectories_per_round)
    return reopd_sample(table, n, kappa, seed=_round_seed(cfg.train.seed, k))  # type: ignore[return-value]


def _round_seed(seed: int, k: int) -> int:
    return int.from_bytes(hashlib.sha256(f"reopd:{seed}:{k}".encode()).digest()[:4], "little")


# ---------------------------------------------------------------------------------------------------
# teacher-generated pools


def teacher_pool(source: str, specs: Sequence[Any], out: str | None = None, *, k: int | None = None,
                 benchmark: str = "textworld", samples_per_spec: int = 1, temperature: float = 1.0,
                 top_p: float = 1.0, seed: int = 0, max_new_tokens: int = 128, horizon: int | None = None,
                 prompt=None, device: str = "cpu", dtype: str = "float32", env_timeout_s: float | None = None,
                 progress: Callable[[int], None] | None = None) -> list:
    """Trajectories of a teacher model on ``specs`` (:class:`~sapd.agent_loop.EpisodeSpec`), sampled.

    ``source`` is an HF model folder (or s3:// prefix), or — with ``k`` — a run root whose committed
    checkpoint k plays (prompted as that run trained, unless ``prompt`` is given). Each spec is played ``samples_per_spec`` times (ids ``<spec id>/sample-j`` when
    more than one). Sampling is seeded (the agent loop advances the seed by the step index), so the
    same source, specs and seed give the same pool. With ``out`` the pool is written as native JSONL."""
    import dataclasses

    from sapd import checkpoints
    from sapd.agent_loop import LoopOptions, run_episodes
    from sapd.benchmarks import get_benchmark
    from sapd.data.loaders import write_native_jsonl
    from sapd.data.prefixes import PrefixOptions
    from sapd.evaluate import noop_action
    from sapd.models.generation import HFGenerator, SamplingParams, stops_for
    from sapd.models.loading import load_causal_lm, load_tokenizer

    if samples_per_spec < 1:
        raise ValueError("samples_per_spec must be at least 1")
    if k is not None:
        model_dir = str(checkpoints.checkpoint_model_path(source, k))
        if prompt is None:
            from sapd.evaluate import run_prompt_options
            prompt = run_prompt_options(source)
    else:
        model_dir = source
    tokenizer = load_tokenizer(model_dir)
    model = load_causal_lm(model_dir, dtype=dtype, device=device)  # type: ignore[arg-type]
    spec = get_benchmark(benchmark)
    if samples_per_spec > 1:
        specs = [dataclasses.replace(s, id=f"{s.id}/sample-{j}") for j in range(samples_per_spec) for s in specs]
    params = SamplingParams(n=1, temperature=temperature, top_p=top_p, max_new_tokens=max_new_tokens,
                            stop=stops_for(spec.decision), seed=seed)
    opts = LoopOptions(prompt=prompt or PrefixOptions(), horizon=horizon, invalid_action=noop_action(benchmark),
                       env_timeout_s=env_timeout_s)
    trajs = run_episodes(specs, HFGenerator(model, tokenizer, device=device), tokenizer, spec, params, opts,
                         progress=progress)
    for t in trajs:
        t.metadata["policy"] = "teacher"
        t.metadata["teacher"] = model_dir if k is None else f"{source}@{k}"
        t.metadata["sampling"] = {"temperature": temperature, "top_p": top_p, "seed": seed}
    if out is not None:
        if not str(out).startswith("s3://"):
            Path(out).parent.mkdir(parents=True, exist_ok=True)
        write_native_jsonl(trajs, str(out))
    return trajs
