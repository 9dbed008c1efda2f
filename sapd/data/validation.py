"""Checkpoint k's distance to the teacher on held-out prefixes: which prefixes and which checkpoints are
validated, the per-prefix records the teacher-scores workers write (one part each), their merge into
``validation/NNNNNN.json`` with intervals, and reading it back. The measuring itself, with the engines
the stage already holds, is :mod:`sapd.stages.validation`; this module is the on-disk side (no model
code), so the plan and the cluster driver can ask what is committed.

Per prefix h of the validation sample (``validation.max_prefixes`` of ``prefixes/val``, seeded), G samples
y ~ π_S(· | h) at temperature 1 and, summed over their tokens:

- ``reverse_kl``: Σ_k log π_S(y_k | h, y_<k) − log π_T(y_k | h, y_<k), the sampled estimate of
  G · KL(π_S ‖ π_T)(h) over whole responses (its expectation is the sequence-level reverse KL; per token
  it is the ratio over all sampled tokens). π_S is the sampler's own temperature-1 log-prob, π_T the
  teacher's score of the same tokens: the two numbers the teacher-scores stage already produces.
- ``recorded_student_logp`` / ``recorded_teacher_logp``: both models' log-probs of the **recorded** response
  (teacher-forced), whose difference per token is the forward direction on the recorded responses
  (log π_T − log π_S where the logs, not the student, chose the tokens; it equals KL(π_T ‖ π_S) only where
  the recorded responses are the teacher's own samples).
- ``reverse_kl_action`` / ``action_tokens``: the same sum over the samples' action tokens only (the action
  mask of SAPD's step score, Eq. 6), to tell a distance in the actions from one in the thoughts.
- ``action_match`` / ``format_valid``: samples whose action is the recorded one (normalised as
  :func:`sapd.stages.evaluate.offline_eval` compares) / that are well-formed; the teacher's own samples on
  the same prefixes give ``teacher_action_match`` (written once per run: the teacher is frozen).

Intervals are over prefixes (a prefix's G samples are not independent): for a ratio Σa/Σb the delta
method's cluster-robust standard error, ±1.96 se; for a proportion the Wilson interval at the effective
number of samples that standard error implies.
"""

from __future__ import annotations

import hashlib
import math
from typing import Any, Iterable, Sequence

from sapd import layout, storage
from sapd.config import RunConfig
from sapd.data import shards
from sapd.data.prefix_table import committed_build, read_prefixes
from sapd.method.objective import objective_of

SCHEMA_VERSION = 1
Z95 = 1.959963984540054

# per-prefix record fields summed over samples (student) — the merge sums them per category
STUDENT_FIELDS = ("samples", "tokens", "reverse_kl", "action_tokens", "reverse_kl_action", "action_match",
                  "format_valid", "finish_length", "recorded_tokens", "recorded_student_logp", "recorded_teacher_logp")
TEACHER_FIELDS = ("samples", "action_match", "format_valid")


def wanted(cfg: RunConfig, k: int) -> bool:
    """Whether checkpoint ``k`` is validated: a run whose objective has a teacher (it scores rounds),
    ``validation.every_rounds`` > 0 and k a multiple of it, or k the run's last checkpoint — unless
    ``train.overlap`` is ``one_step`` (the scoring workers sample with checkpoint k−1), or the
    committed prefix build has no validation prefixes at all (``data.val_fraction`` 0, or one trajectory):
    then there is nothing to measure on, and nothing is validated."""
    every = cfg.validation.every_rounds
    if every <= 0 or objective_of(cfg.loss_cfg).data != "scored":
        return False
    if cfg.train.overlap == "one_step":  # round k's scoring workers hold checkpoint k-1, not k: nothing
        return False                    # validates checkpoint k with the engines that are up
    if not (k % every == 0 or k == cfg.train.rounds):
        return False
    build = committed_build(layout.prefixes_dir(cfg.run_root))
    return build is None or build.get("stats", {}).get("val", 1) > 0


def settings(cfg: RunConfig) -> dict[str, Any]:
    """What a validation's numbers depend on besides the two models (recorded in every part and result;
    a part written under other settings is redone)."""
    v = cfg.validation
    return {"max_prefixes": v.max_prefixes, "group_size": v.group_size, "seed": v.seed, "temperature": 1.0,
            "max_new_tokens": v.max_new_tokens or cfg.sampling.max_new_tokens, "benchmark": cfg.data.benchmark}


def sample_rows(rows: Sequence[dict[str, Any]], max_prefixes: int, seed: int) -> list[dict[str, Any]]:
    """A seeded sample of at most ``max_prefixes`` rows (0: all), in a fixed order that does not depend on
    the input order: rows sorted by sha256(seed:prefix_id), the first ``max_prefixes`` kept."""
    def key(r: dict[str, Any]) -> str:
        return hashlib.sha256(f"{seed}:{r['prefix_id']}".encode()).hexdigest()
    ordered = sorted(rows, key=key)
    return ordered[:max_prefixes] if max_prefixes > 0 else ordered


def validation_rows(cfg: RunConfig) -> list[dict[str, Any]]:
    """The run's validation sample: ``validation.max_prefixes`` prefixes of the committed ``prefixes/val``."""
    table = read_prefixes(layout.prefixes_dir(cfg.run_root), "val")
    return sample_rows(table.to_pylist(), cfg.validation.max_prefixes, cfg.validation.seed)


def worker_share(rows: Sequence[dict[str, Any]], worker: int, workers: int) -> list[dict[str, Any]]:
    """Worker w's share of the sample: rows i with i % W == w (as the round's prefixes are split)."""
    return [r for i, r in enumerate(rows) if i % workers == worker]


# ---------------------------------------------------------------------------------------------------
# the workers' parts


def part(cfg: RunConfig, k: int, worker: int) -> dict[str, Any] | None:
    """Worker ``worker``'s part of checkpoint k's validation if it was written for this run's settings and
    number of workers, else None."""
    uri = layout.validation_part_uri(cfg.run_root, k, worker)
    if not storage.exists(uri):
        return None
    done: dict[str, Any] = storage.read_json(uri)
    return done if done.get("workers") == cfg.workers and done.get("settings") == settings(cfg) else None


def write_part(cfg: RunConfig, k: int, worker: int, records: list[dict[str, Any]],
               timings: dict[str, float]) -> dict[str, Any]:
    data = {"schema_version": SCHEMA_VERSION, "checkpoint": k, "worker": worker, "workers": cfg.workers,
            "settings": settings(cfg), "records": records, "timings": timings}
    storage.write_json(layout.validation_part_uri(cfg.run_root, k, worker), data)
    return data


def teacher_part(cfg: RunConfig, worker: int, teacher: str | None = None) -> dict[str, Any] | None:
    """The teacher's own samples on worker ``worker``'s share, if written for these settings and this number
    of workers (the teacher is frozen: once per run) and, when ``teacher`` is given, by that teacher folder
    (a teacher run root pinned to another checkpoint makes it stale)."""
    uri = layout.teacher_validation_part_uri(cfg.run_root, worker)
    if not storage.exists(uri):
        return None
    done: dict[str, Any] = storage.read_json(uri)
    same = (done.get("workers"), done.get("settings")) == (cfg.workers, settings(cfg))
    return done if same and (teacher is None or done.get("teacher") == teacher) else None


def write_teacher_part(cfg: RunConfig, worker: int, records: list[dict[str, Any]], seconds: float) -> dict[str, Any]:
    data = {"schema_version": SCHEMA_VERSION, "worker": worker, "workers": cfg.workers, "settings": settings(cfg),
            "teacher": cfg.model.teacher, "records": records, "seconds": seconds}
    storage.write_json(layout.teacher_validation_part_uri(cfg.run_root, worker), data)
    return data


def workers_done(cfg: RunConfig, k: int) -> list[int]:
    """The workers whose part of checkpoint k's validation (and the teacher's part) is written."""
    return [w for w in range(cfg.workers) if part(cfg, k, w) is not None and teacher_part(cfg, w) is not None]


# ---------------------------------------------------------------------------------------------------
# the committed result


def is_committed(root: str, k: int) -> bool:
    return storage.exists(layout.validation_uri(root, k))


def read(root: str, k: int) -> dict[str, Any]:
    return storage.read_json(layout.validation_uri(root, k))


def committed(root: str) -> list[dict[str, Any]]:
    """Every committed validation of the run at ``root``, by checkpoint."""
    out = []
    for uri in storage.list_files(storage.join(root, "validation")):
        name = uri.rsplit("/", 1)[-1]
        if name.endswith(".json") and name[:-5].isdigit() and uri.endswith(f"validation/{name}"):
            out.append(storage.read_json(uri))
    return sorted(out, key=lambda r: r["checkpoint"])


def commit(cfg: RunConfig, k: int) -> dict[str, Any]:
    """Merge the workers' parts of checkpoint k's validation into ``validation/NNNNNN.json`` (idempotent: a
    committed one is returned as it is). Raises :class:`~sapd.data.shards.ShardError` naming the first
    worker whose part is missing."""
    dest = layout.validation_uri(cfg.run_root, k)
    if storage.exists(dest):
        return storage.read_json(dest)
    records: list[dict[str, Any]] = []
    teacher: list[dict[str, Any]] = []
    teachers: list[str] = []
    timings: dict[str, float] = {}
    for w in range(cfg.workers):
        p, t = part(cfg, k, w), teacher_part(cfg, w)
        if p is None or t is None:
            which = "its part" if p is None else "the teacher's part"
            raise shards.ShardError(f"{layout.validation_uri(cfg.run_root, k)}: worker {w} of {cfg.workers} has not "
                                    f"written {which}; cannot commit checkpoint {k}'s validation")
        records += p["records"]
        teacher += t["records"]
        if t["teacher"] not in teachers:
            teachers.append(t["teacher"])
        for key, v in p["timings"].items():
            timings[key] = max(timings.get(key, 0.0), v)  # workers run in parallel: the slowest decides
    records.sort(key=lambda r: r["prefix_id"])
    teacher.sort(key=lambda r: r["prefix_id"])
    # the teacher folder(s) whose samples are in it (more than one: a teacher run root moved on meanwhile)
    result = {"schema_version": SCHEMA_VERSION, "checkpoint": k,
              "teacher": teachers[0] if len(teachers) == 1 else teachers, "settings": settings(cfg),
              "workers": cfg.workers, **summarize(records, teacher),
              "timings": timings, "seconds": sum(timings.values()), "records": records, "teacher_records": teacher}
    storage.write_json(dest, result)
    return result


# ---------------------------------------------------------------------------------------------------
# the figures


def ratio_interval(num: Sequence[float], den: Sequence[float]) -> tuple[float | None, float | None, float]:
    """(value, standard error, Σden) of Σnum / Σden over clusters (prefixes) i: the delta method's
    cluster-robust standard error √(n/(n−1) · Σ(aᵢ − R·bᵢ)²) / Σb. Value None when Σden = 0; the
    standard error None with fewer than two clusters.

    >>> ratio_interval([1.0, 3.0], [2.0, 2.0])[:2]
    (1.0, 0.5)
    """
    total = float(sum(den))
    if total <= 0:
        return None, None, total
    r = float(sum(num)) / total
    n = len(num)
    if n < 2:
        return r, None, total
    ss = sum((a - r * b) ** 2 for a, b in zip(num, den))
    return r, math.sqrt(n / (n - 1) * ss) / total, total


def paired_ratio_difference(num_a: Sequence[float], den_a: Sequence[float], num_b: Sequence[float],
                            den_b: Sequence[float]) -> dict[str, Any]:
    """Σa/Σb of one model minus the same of another, over the same clusters (prefixes): ``{diff, ci}`` with
    the delta method's paired standard error √(n/(n−1) · Σ dᵢ²), dᵢ = (aᵢ − R_a bᵢ)/B_a − (cᵢ − R_c eᵢ)/E_c.
    ``ci`` [None, None] with fewer than two clusters; ``diff`` None when either total is 0.

    >>> d = paired_ratio_difference([2.0, 4.0], [2.0, 2.0], [1.0, 2.0], [2.0, 2.0])
    >>> d["diff"], [round(x, 3) for x in d["ci"]]
    (0.75, [0.26, 1.24])
    """
    ra, _, ta = ratio_interval(num_a, den_a)
    rb, _, tb = ratio_interval(num_b, den_b)
    if ra is None or rb is None:
        return {"diff": None, "ci": [None, None]}
    n = len(num_a)
    if n < 2:
        return {"diff": ra - rb, "ci": [None, None]}
    d = [(a - ra * b) / ta - (c - rb * e) / tb for a, b, c, e in zip(num_a, den_a, num_b, den_b)]
    se = math.sqrt(n / (n - 1) * sum(x * x for x in d))
    return {"diff": ra - rb, "ci": [ra - rb - Z95 * se, ra - rb + Z95 * se]}


def _figure(num: Sequence[float], den: Sequence[float], proportion: bool = False) -> dict[str, Any]:
    """``{value, ci}`` of Σnum/Σden: ±1.96 se for a ratio; for a proportion the Wilson interval at the
    effective sample size p(1 − p)/se² (Σden when se = 0: every prefix agreed)."""
    r, se, total = ratio_interval(num, den)
    if r is None:
        return {"value": None, "ci": [None, None]}
    if se is None:
        return {"value": r, "ci": [None, None]}
    if not proportion:
        return {"value": r, "ci": [r - Z95 * se, r + Z95 * se]}
    n = r * (1 - r) / se ** 2 if se > 0 else total
    return {"value": r, "ci": list(wilson(r, n))}


def wilson(p: float, n: float, z: float = Z95) -> tuple[float, float]:
    """The Wilson score interval of a proportion ``p`` over ``n`` (possibly effective, non-integer) trials.

    >>> [round(x, 3) for x in wilson(0.5, 100)]
    [0.404, 0.596]
    """
    if n <= 0:
        return 0.0, 1.0
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    # at p = 0 (or 1) the bound is 0 (or 1) exactly; the formula leaves a rounding error there
    return (0.0 if p <= 0 else max(0.0, centre - half)), (1.0 if p >= 1 else min(1.0, centre + half))


def _group(records: Iterable[dict[str, Any]], teacher: Iterable[dict[str, Any]]) -> dict[str, Any]:
    recs, teach = list(records), list(teacher)
    col = {f: [float(r[f]) for r in recs] for f in STUDENT_FIELDS}
    forward = [t - s for t, s in zip(col["recorded_teacher_logp"], col["recorded_student_logp"])]
    out: dict[str, Any] = {
        "prefixes": len(recs), "samples": int(sum(col["samples"])),
        "tokens_per_sample": sum(col["tokens"]) / max(sum(col["samples"]), 1),
        # the headline: reverse KL(student ‖ teacher) per sampled token, and per whole response
        "reverse_kl_per_token": _figure(col["reverse_kl"], col["tokens"]),
        "reverse_kl_per_sample": _figure(col["reverse_kl"], col["samples"]),
        # … over the action tokens only (inside the first complete action block; none in a malformed sample)
        "reverse_kl_per_action_token": _figure(col["reverse_kl_action"], col["action_tokens"]),
        # the forward direction on the recorded responses: log π_T − log π_S per recorded token
        "recorded_logratio_per_token": _figure(forward, col["recorded_tokens"]),
        "recorded_student_nll_per_token": _figure([-x for x in col["recorded_student_logp"]], col["recorded_tokens"]),
        "recorded_teacher_nll_per_token": _figure([-x for x in col["recorded_teacher_logp"]], col["recorded_tokens"]),
        "action_match": _figure(col["action_match"], col["samples"], proportion=True),
        "format_valid": _figure(col["format_valid"], col["samples"], proportion=True),
        "finish_length": _figure(col["finish_length"], col["samples"], proportion=True),
    }
    if teach:
        out["teacher_action_match"] = _figure([float(t["action_match"]) for t in teach],
                                              [float(t["samples"]) for t in teach], proportion=True)
        out["teacher_format_valid"] = _figure([float(t["format_valid"]) for t in teach],
                                              [float(t["samples"]) for t in teach], proportion=True)
    return out


def summarize(records: Sequence[dict[str, Any]], teacher: Sequence[dict[str, Any]] = ()) -> dict[str, Any]:
    """``{prefixes, overall, by_category}`` from per-prefix records (and the teacher's, matched by
    category); each group's figures with their 95 % intervals (module docstring)."""
    cats = sorted({r.get("category") or "-" for r in records})
    by_category = {c: _group([r for r in records if (r.get("category") or "-") == c],
                             [t for t in teacher if (t.get("category") or "-") == c]) for c in cats}
    return {"prefixes": len(records), "overall": _group(records, teacher),
            "by_category": by_category if len(cats) > 1 or cats != ["-"] else {}}
