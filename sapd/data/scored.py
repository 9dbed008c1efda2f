"""A scored round: what the teacher-scores stage (and the online baselines) hand to training.

``rounds/NNNNNN/scored/`` holds one Parquet part per worker (``part-WWWWW.parquet``, rows of
:data:`~sapd.data.schema.SCORED_SCHEMA`: one prefix with its G sampled responses, the teacher's
log-probs of every sampled token, action masks and rule scores), a done-marker per worker written after
its part, and ``_MANIFEST.json`` written last, once every worker is done (:func:`commit_round`). Readers
only read what the manifest lists (:func:`read_scored`). This module is the one writer and reader of
that format; the row is built by :func:`scored_row`, so the Eq. 12 rule score always comes from
:func:`sapd.method.rules.rule_score`. :func:`commit_teacher_scores` commits all the stage writes for a round
(checkpoint k's validation, :mod:`sapd.data.validation`, then the manifest).
"""

from __future__ import annotations

import hashlib
import io
import time
from dataclasses import dataclass
from typing import Any, Protocol, Sequence

import pyarrow as pa
import pyarrow.parquet as pq

from sapd import layout, storage
from sapd.config import RunConfig
from sapd.data import shards, validation
from sapd.data.schema import SCORED_KIND, SCORED_SCHEMA, SCORED_SCHEMA_VERSION
from sapd.method.action_mask import action_token_mask
from sapd.method.benchmarks import BenchmarkSpec
from sapd.method.rules import RuleWeights, format_score, repetition_score, rule_score


class SampledResponse(Protocol):
    """One generated response as a sampler returns it (:class:`sapd.models.generation.Sample`)."""

    @property
    def token_ids(self) -> list[int]: ...

    @property
    def logprobs(self) -> list[float]: ...

    @property
    def text(self) -> str: ...

    @property
    def finish_reason(self) -> str: ...


def part_name(worker: int) -> str:
    return f"part-{worker:05d}.parquet"


def worker_done_marker(k_dir: str, worker: int) -> str:
    return storage.join(k_dir, f"_worker-{worker:05d}.json")


def scored_row(prefix: dict[str, Any], prompt_ids: Sequence[int], responses_G: Sequence[SampledResponse],
               teacher_logp_G_T: Sequence[Sequence[float]], tokenizer, spec: BenchmarkSpec,
               weights: RuleWeights, advantage_G: Sequence[float] | None = None) -> dict[str, Any]:
    """One scored row: ``prefix`` carries the prefix columns (``prefix_id``, ``trajectory_id``,
    ``turn_index``, ``benchmark``, ``category``, ``previous_action``, ``recorded_action``); action masks
    and rule scores are computed here from the response texts."""
    previous = prefix["previous_action"]
    return {
        "prefix_id": prefix["prefix_id"], "trajectory_id": prefix["trajectory_id"],
        "turn_index": prefix["turn_index"], "benchmark": prefix["benchmark"], "category": prefix["category"],
        "previous_action": previous, "recorded_action": prefix["recorded_action"],
        "prompt_token_ids": list(prompt_ids),
        "response_token_ids": [s.token_ids for s in responses_G],
        "sampler_logprobs": [s.logprobs for s in responses_G],
        "teacher_logprobs": [list(t) for t in teacher_logp_G_T],
        "action_mask": [action_token_mask(tokenizer, s.token_ids, spec) for s in responses_G],
        "response_text": [s.text for s in responses_G],
        "finish_reason": [s.finish_reason for s in responses_G],
        "format_score": [format_score(s.text, spec) for s in responses_G],
        "repetition_score": [repetition_score(s.text, previous, spec) for s in responses_G],
        "rule_score": [rule_score(s.text, previous, spec, weights) for s in responses_G],
        "advantage": None if advantage_G is None else list(advantage_G),
    }


def truncated_share(rows: Sequence[dict[str, Any]]) -> tuple[int, int]:
    """(responses cut at the token limit — finish reason ``length`` —, responses) of scored rows."""
    reasons = [r for row in rows for r in row["finish_reason"]]
    return sum(r == "length" for r in reasons), len(reasons)


def write_worker_part(out_dir: str, worker: int, rows: list[dict[str, Any]], timings: dict[str, float],
                      generated_tokens: int, workers: int = 1, teacher: str | None = None) -> int:
    """Write worker ``worker``'s part (of ``workers``), then its done-marker (rows, bytes, sha256, timings,
    the number of workers the round was split into, the teacher folder that scored it — a teacher given
    as a run root resolved to one checkpoint —, and how many of its responses were cut at the token
    limit). → rows."""
    table = pa.Table.from_pylist(rows, schema=SCORED_SCHEMA)
    buf = io.BytesIO()
    pq.write_table(table, buf, compression="zstd")
    data = buf.getvalue()
    storage.write_bytes(storage.join(out_dir, part_name(worker)), data)
    truncated, responses = truncated_share(rows)
    storage.write_json(worker_done_marker(out_dir, worker),
                       {"worker": worker, "workers": workers, "rows": table.num_rows, "bytes": len(data),
                        "sha256": hashlib.sha256(data).hexdigest(), "timings": timings,
                        "generated_tokens": generated_tokens, "teacher": teacher,
                        "responses": responses, "truncated_responses": truncated})
    return table.num_rows


def worker_marker(cfg: RunConfig, k: int, worker: int) -> dict[str, Any] | None:
    """Worker ``worker``'s done-marker of round k if it was written for the config's number of workers
    (a part written when the round was split another way covers other prefixes: it is redone)."""
    uri = worker_done_marker(layout.scored_dir(cfg.run_root, k), worker)
    if not storage.exists(uri):
        return None
    done: dict[str, Any] = storage.read_json(uri)
    return done if done.get("workers", cfg.workers) == cfg.workers else None


def workers_done(cfg: RunConfig, k: int) -> list[int]:
    """The workers of round k whose part is written (their done-marker exists, for ``cfg.workers``)."""
    return [w for w in range(cfg.workers) if worker_marker(cfg, k, w) is not None]


def commit_round(cfg: RunConfig, k: int) -> dict[str, Any]:
    """Write round k's manifest once every worker's part is done (idempotent: a committed round's
    manifest is returned as it is). Raises :class:`~sapd.data.shards.ShardError` naming the first
    worker that has not finished."""
    out_dir = layout.scored_dir(cfg.run_root, k)
    existing = shards.read_manifest(out_dir)
    if existing is not None:
        return existing
    parts: list[dict[str, Any]] = []
    timings: dict[str, float] = {}
    tokens = responses = truncated = 0
    teachers: list[str] = []
    for w in range(cfg.workers):
        done = worker_marker(cfg, k, w)
        if done is None:
            raise shards.ShardError(f"{out_dir}: worker {w} of {cfg.workers} has not finished; cannot commit round {k}")
        parts.append({"name": part_name(w), "rows": done["rows"], "bytes": done["bytes"], "sha256": done["sha256"]})
        for key, v in done.get("timings", {}).items():
            timings[key] = max(timings.get(key, 0.0), v)  # workers run in parallel: the slowest decides
        tokens += done.get("generated_tokens", 0)
        responses += done.get("responses", 0)
        truncated += done.get("truncated_responses", 0)
        if done.get("teacher") and done["teacher"] not in teachers:
            teachers.append(done["teacher"])
    manifest = {"kind": SCORED_KIND, "schema_version": SCORED_SCHEMA_VERSION, "round": k,
                "rows": sum(p["rows"] for p in parts), "parts": parts, "workers": cfg.workers,
                "timings": timings, "generated_tokens": tokens,
                # responses cut at sampling.max_new_tokens (finish reason "length"), of all sampled
                "responses": responses, "truncated_responses": truncated,
                # the teacher folder(s) that scored the round: more than one means a teacher run root
                # committed a new checkpoint while the round's workers ran
                "teacher": teachers[0] if len(teachers) == 1 else (teachers or None),
                "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    shards.commit_manifest(out_dir, manifest)
    return manifest


def commit_teacher_scores(cfg: RunConfig, k: int) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    """Everything the teacher-scores stage of round k commits, once every worker's share is written:
    checkpoint k's validation first (when :func:`sapd.data.validation.wanted`), then the round's scored
    manifest (a round to score: k < ``train.rounds``; checkpoint ``train.rounds`` is only validated), so a
    committed round has its validation committed too. Idempotent. → (validation result, manifest), each
    None where there is none; :class:`~sapd.data.shards.ShardError` names the first worker not done."""
    result = validation.commit(cfg, k) if validation.wanted(cfg, k) else None
    manifest = commit_round(cfg, k) if k < cfg.train.rounds else None
    return result, manifest


def is_committed(root: str, k: int) -> bool:
    return shards.read_manifest(layout.scored_dir(root, k)) is not None


def committed_manifest(root: str, k: int) -> dict[str, Any] | None:
    """Round k's manifest (rows, workers, timings, tokens, truncated responses), or None before its commit."""
    return shards.read_manifest(layout.scored_dir(root, k))


def read_scored(root: str, k: int) -> pa.Table:
    return shards.read_shards(layout.scored_dir(root, k), kind=SCORED_KIND, schema_version=SCORED_SCHEMA_VERSION)


@dataclass
class ScoredPrefix:
    """One scored prefix as training uses it: its prompt and G sampled responses with their fixed
    signals (ragged lists: ``_G_T`` per response and token). ``old_logp_G_T`` (π_old) is filled in by
    the training stage, which recomputes it with the training weights; ``ref_logp_G_T`` (checkpoint 0,
    the initial policy) too, when the loss has a KL term."""

    prefix_id: str
    prompt: list[int]
    responses_G_T: list[list[int]]
    teacher_logp_G_T: list[list[float]]
    action_mask_G_T: list[list[bool]]
    rule_scores_G: list[float]
    advantage_G: list[float] | None = None
    old_logp_G_T: list[list[float]] | None = None
    ref_logp_G_T: list[list[float]] | None = None  # the initial policy's, only with loss.kl_coef > 0
    # the sampler's own log-probs of its tokens (the behaviour policy's): read by the loss only when the round
    # was sampled by an older checkpoint than the one it trains from (train.overlap: one_step)
    sampler_logp_G_T: list[list[float]] | None = None


def scored_prefixes(table: pa.Table) -> list[ScoredPrefix]:
    return [ScoredPrefix(r["prefix_id"], r["prompt_token_ids"], r["response_token_ids"], r["teacher_logprobs"],
                         r["action_mask"], r["rule_score"], r["advantage"], sampler_logp_G_T=r["sampler_logprobs"])
            for r in table.to_pylist()]
