"""Which prefixes a round works on: pure, seeded selections over the committed prefix table.

- :func:`round_batch` — round k's batch, as the paper draws it (docs/SAPD.md §5): every prefix of a sample of
  ``train.trajectories_per_round`` training trajectories, cycling through reshuffled epochs; or, with
  ``data.reopd_kappa`` set, ReOPD's step-decaying draw (:func:`reopd_round_batch`).
- :func:`worker_rows` — worker w's share of a round for the teacher-scores stage (rows i with i % W == w).
- ReOPD (docs/SAPD.md §4): :func:`reopd_sample` draws ``n`` prefixes *without replacement*, each prefix's
  weight κ^turn_index (Gumbel-top-k, i.e. successive sampling ∝ weight, computed in log space so long
  trajectories never underflow), deterministic per seed and independent of the input row order. For a
  single draw (n = 1) the probability of prefix i is exactly κ^{t_i} / Σ_j κ^{t_j}
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
from typing import Any, Sequence

import pyarrow as pa
import pyarrow.compute as pc

from sapd import layout
from sapd.config import RunConfig
from sapd.data.prefix_table import read_prefixes

DEFAULT_KAPPA = 0.6  # ReOPD's κ when a config does not set one

Rows = list[dict[str, Any]]


def trajectory_batches(trajectory_ids: Sequence[str], trajectories_per_batch: int, seed: int,
                       epoch: int = 0) -> list[list[str]]:
    """The paper's batches: each holds every prefix of a sample of ``trajectories_per_batch``
    trajectories. Returns trajectory-id groups for one epoch, reshuffled per (seed, epoch); the caller
    selects the prefixes of each group. The last batch may be smaller."""
    if trajectories_per_batch < 1:
        raise ValueError("trajectories_per_batch must be at least 1")
    ids = sorted(set(trajectory_ids))
    random.Random(f"{seed}:{epoch}").shuffle(ids)
    return [ids[i:i + trajectories_per_batch] for i in range(0, len(ids), trajectories_per_batch)]


def prefix_batches(table: pa.Table, trajectories_per_batch: int, seed: int, epoch: int = 0) -> list[pa.Table]:
    """:func:`trajectory_batches` applied to a prefix table: each batch's rows in (trajectory, turn) order."""
    out = []
    for group in trajectory_batches(table.column("trajectory_id").to_pylist(), trajectories_per_batch, seed, epoch):
        sel = table.filter(pc.is_in(table.column("trajectory_id"), value_set=pa.array(group)))
        order = {tid: i for i, tid in enumerate(group)}
        keys = sorted(range(sel.num_rows), key=lambda i: (order[sel.column("trajectory_id")[i].as_py()],
                                                           sel.column("turn_index")[i].as_py()))
        out.append(sel.take(pa.array(keys, type=pa.int64())))
    return out


def round_batch(cfg: RunConfig, k: int) -> pa.Table:
    """Round k's prefixes: every prefix of a sample of ``trajectories_per_round`` train trajectories,
    cycling through reshuffled epochs of the training split. With ``data.reopd_kappa`` set (ReOPD), a
    seeded draw of prefixes with p(t) ∝ κ^t instead (:func:`reopd_round_batch`)."""
    if cfg.data.reopd_kappa is not None:
        return reopd_round_batch(cfg, k)
    table = read_prefixes(layout.prefixes_dir(cfg.run_root), "train")
    n_traj = len(set(table.column("trajectory_id").to_pylist()))
    per_epoch = -(-n_traj // cfg.train.trajectories_per_round)
    epoch, index = divmod(k, per_epoch)
    return prefix_batches(table, cfg.train.trajectories_per_round, cfg.train.seed, epoch)[index]


def worker_rows(batch: pa.Table, worker: int, workers: int) -> pa.Table:
    idx = [i for i in range(batch.num_rows) if i % workers == worker]
    return batch.take(pa.array(idx, type=pa.int64()))


# ---------------------------------------------------------------------------------------------------
# ReOPD's step-decaying draw

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


def reopd_round_batch(cfg: RunConfig, k: int, kappa: float | None = None, n: int | None = None) -> pa.Table:
    """Round k's prefixes under ReOPD: ``n`` (default :func:`prefixes_per_round`) train prefixes drawn by
    :func:`reopd_sample`, seeded by (train.seed, k) — a rerun of round k draws the same batch. ``kappa``
    defaults to ``cfg.data.reopd_kappa`` when the config has it, else 0.6."""
    if kappa is None:
        kappa = cfg.data.reopd_kappa or DEFAULT_KAPPA
    table = read_prefixes(layout.prefixes_dir(cfg.run_root), "train")
    if n is None:
        n = prefixes_per_round(table, cfg.train.trajectories_per_round)
    return reopd_sample(table, n, kappa, seed=_round_seed(cfg.train.seed, k))


def _round_seed(seed: int, k: int) -> int:
    return int.from_bytes(hashlib.sha256(f"reopd:{seed}:{k}".encode()).digest()[:4], "little")
