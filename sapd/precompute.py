"""Teacher-score precompute stage (DESIGN.md, round k): checkpoint k + the round's prefix batch →
G student samples per prefix, teacher log-probs of the sampled tokens, action masks and rule scores,
written as one scored shard per worker (``rounds/k/scored/part-WWWWW.parquet``).

Worker w of W takes the batch's prefixes i with i % W == w, writes its part and a small done-marker;
the round is committed by ``_MANIFEST.json`` once every worker's part is there (:func:`commit_round`,
called by the local pipeline or the cluster driver). A rerun of a worker whose part is done is a
no-op, so a retried pod redoes only uncommitted work. Sampling is seeded by (seed, round, worker),
so a redone part is the same part.
"""

from __future__ import annotations

import hashlib
import io
import time
from dataclasses import dataclass
from typing import Any, Callable

import pyarrow as pa
import pyarrow.parquet as pq

from sapd import layout, storage
from sapd.action_mask import action_token_mask
from sapd.benchmarks import get_benchmark
from sapd.config import RunConfig
from sapd.data import shards
from sapd.data.prefixes import prefix_batches, read_prefixes
from sapd.models.generation import Generator, SamplingParams, stops_for
from sapd.rules import RuleWeights, format_score, repetition_score

SCORED_SCHEMA_VERSION = 1
SCORED_KIND = "scored"

SCORED_SCHEMA = pa.schema([
    pa.field("prefix_id", pa.string(), nullable=False),
    pa.field("trajectory_id", pa.string(), nullable=False),
    pa.field("turn_index", pa.int32(), nullable=False),
    pa.field("benchmark", pa.string(), nullable=False),
    pa.field("category", pa.string()),
    pa.field("previous_action", pa.string()),
    pa.field("recorded_action", pa.string(), nullable=False),
    pa.field("prompt_token_ids", pa.list_(pa.int32()), nullable=False),
    # one entry per response of the group (G), each a token list
    pa.field("response_token_ids", pa.list_(pa.list_(pa.int32())), nullable=False),
    pa.field("sampler_logprobs", pa.list_(pa.list_(pa.float32())), nullable=False),
    pa.field("teacher_logprobs", pa.list_(pa.list_(pa.float32())), nullable=False),
    pa.field("action_mask", pa.list_(pa.list_(pa.bool_())), nullable=False),
    pa.field("response_text", pa.list_(pa.string()), nullable=False),
    pa.field("finish_reason", pa.list_(pa.string()), nullable=False),
    pa.field("format_score", pa.list_(pa.float32()), nullable=False),
    pa.field("repetition_score", pa.list_(pa.float32()), nullable=False),
    pa.field("rule_score", pa.list_(pa.float32()), nullable=False),
])


def round_batch(cfg: RunConfig, k: int) -> pa.Table:
    """Round k's prefixes: every prefix of a sample of ``trajectories_per_round`` train trajectories,
    cycling through reshuffled epochs of the training split. With ``data.reopd_kappa`` set (ReOPD), a
    seeded draw of prefixes with p(t) ∝ κ^t instead (sapd.reopd)."""
    if cfg.data.reopd_kappa is not None:
        from sapd.reopd import reopd_round_batch
        return reopd_round_batch(cfg, k)
    table = read_prefixes(layout.prefixes_dir(cfg.run_root), "train")
    n_traj = len(set(table.column("trajectory_id").to_pylist()))
    per_epoch = -(-n_traj // cfg.train.trajectories_per_round)
    epoch, index = divmod(k, per_epoch)
    return prefix_batches(table, cfg.train.trajectories_per_round, cfg.train.seed, epoch)[index]


def worker_rows(batch: pa.Table, worker: int, workers: int) -> pa.Table:
    idx = [i for i in range(batch.num_rows) if i % workers == worker]
    return batch.take(pa.array(idx, type=pa.int64()))


def part_name(worker: int) -> str:
    return f"part-{worker:05d}.parquet"


def worker_done_marker(k_dir: str, worker: int) -> str:
    return storage.join(k_dir, f"_worker-{worker:05d}.json")


@dataclass
class PrecomputeResult:
    skipped: bool
    rows: int
    timings: dict[str, float]
    generated_tokens: int = 0


def precompute_worker(cfg: RunConfig, k: int, worker: int, generator: Generator, teacher_scorer: Callable,
                      tokenizer, *, log: Callable[[str], None] = print, show_progress: bool = True,
                      ) -> PrecomputeResult:
    """Sample, score and write worker ``worker``'s part of round ``k``.

    ``teacher_scorer(groups, progress=None)`` takes [(prefix_id, prompt_ids, [response_ids])] and
    returns teacher log-probs per response (the HF shared-prefix scorer or the vLLM one)."""
    from tqdm import tqdm

    out_dir = layout.scored_dir(cfg.run_root, k)
    marker = worker_done_marker(out_dir, worker)
    if shards.read_manifest(out_dir) is not None or storage.exists(marker):
        log(f"round {k} worker {worker}: already done")
        done = storage.read_json(marker) if storage.exists(marker) else {"rows": -1, "timings": {}}
        return PrecomputeResult(True, done["rows"], done.get("timings", {}), done.get("generated_tokens", 0))
    spec = get_benchmark(cfg.data.benchmark)
    rows = worker_rows(round_batch(cfg, k), worker, cfg.workers).to_pylist()
    prompts = [r["prompt"] for r in rows]
    params = SamplingParams(n=cfg.sampling.group_size, temperature=cfg.sampling.temperature,
                            top_p=cfg.sampling.top_p, max_new_tokens=cfg.sampling.max_new_tokens,
                            stop=stops_for(spec.decision), seed=_seed(cfg.train.seed, k, worker))
    timings: dict[str, float] = {}
    log(f"round {k} worker {worker}/{cfg.workers}: {len(rows)} prefixes × G={params.n}")
    t0 = time.perf_counter()
    with tqdm(total=len(prompts), desc=f"round {k} sampling", unit="prefix",
              disable=None if show_progress else True, leave=False) as bar:
        samples = generator.generate(prompts, params, progress=bar.update)
    timings["sample_seconds"] = time.perf_counter() - t0

    prompt_ids = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
    groups = [(r["prefix_id"], pids, [s.token_ids for s in group])
              for r, pids, group in zip(rows, prompt_ids, samples)]
    t0 = time.perf_counter()
    with tqdm(total=len(groups), desc=f"round {k} teacher", unit="prefix",
              disable=None if show_progress else True, leave=False) as bar:
        teacher = teacher_scorer(groups, progress=bar.update)
    timings["score_seconds"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    weights = RuleWeights(cfg.rules.format_weight, cfg.rules.repetition_weight)
    out_rows: list[dict[str, Any]] = []
    for r, pids, group, t_logp in zip(rows, prompt_ids, samples, teacher):
        fmt = [format_score(s.text, spec) for s in group]
        rep = [repetition_score(s.text, r["previous_action"], spec) for s in group]
        out_rows.append({
            "prefix_id": r["prefix_id"], "trajectory_id": r["trajectory_id"], "turn_index": r["turn_index"],
            "benchmark": r["benchmark"], "category": r["category"], "previous_action": r["previous_action"],
            "recorded_action": r["recorded_action"], "prompt_token_ids": pids,
            "response_token_ids": [s.token_ids for s in group], "sampler_logprobs": [s.logprobs for s in group],
            "teacher_logprobs": t_logp,
            "action_mask": [action_token_mask(tokenizer, s.token_ids, spec) for s in group],
            "response_text": [s.text for s in group], "finish_reason": [s.finish_reason for s in group],
            "format_score": fmt, "repetition_score": rep,
            "rule_score": [weights.format * f + weights.repetition * p for f, p in zip(fmt, rep)],
        })
    timings["masks_rules_seconds"] = time.perf_counter() - t0
    table = pa.Table.from_pylist(out_rows, schema=SCORED_SCHEMA)
    buf = io.BytesIO()
    pq.write_table(table, buf, compression="zstd")
    data = buf.getvalue()
    storage.write_bytes(storage.join(out_dir, part_name(worker)), data)
    n_tokens = sum(len(s.token_ids) for g in samples for s in g)
    storage.write_json(marker, {"worker": worker, "rows": table.num_rows, "bytes": len(data),
                                "sha256": hashlib.sha256(data).hexdigest(), "timings": timings,
                                "generated_tokens": n_tokens})
    log(f"round {k} worker {worker}: wrote {table.num_rows} groups, {n_tokens} generated tokens "
        f"(sample {timings['sample_seconds']:.1f}s, teacher {timings['score_seconds']:.1f}s)")
    return PrecomputeResult(False, table.num_rows, timings, n_tokens)


def commit_round(cfg: RunConfig, k: int) -> dict[str, Any]:
    """Write round k's manifest once every worker's part is done (idempotent)."""
    out_dir = layout.scored_dir(cfg.run_root, k)
    existing = shards.read_manifest(out_dir)
    if existing is not None:
        return existing
    parts, timings, tokens = [], {}, 0
    for w in range(cfg.workers):
        marker = worker_done_marker(out_dir, w)
        if not storage.exists(marker):
            raise shards.ShardError(f"{out_dir}: worker {w} has not finished; cannot commit round {k}")
        done = storage.read_json(marker)
        parts.append({"name": part_name(w), "rows": done["rows"], "bytes": done["bytes"], "sha256": done["sha256"]})
        for key, v in done.get("timings", {}).items():
            timings[key] = max(timings.get(key, 0.0), v)  # workers run in parallel: the slowest decides
        tokens += done.get("generated_tokens", 0)
    manifest = {"kind": SCORED_KIND, "schema_version": SCORED_SCHEMA_VERSION, "round": k,
                "rows": sum(p["rows"] for p in parts), "parts": parts, "workers": cfg.workers,
                "timings": timings, "generated_tokens": tokens,
                "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    shards.commit_manifest(out_dir, manifest)
    return manifest


def read_scored(root: str, k: int) -> pa.Table:
    return shards.read_shards(layout.scored_dir(root, k), kind=SCORED_KIND, schema_version=SCORED_SCHEMA_VERSION)


def _seed(seed: int, k: int, worker: int) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}:{k}:{worker}".encode()).digest()[:4], "little")
