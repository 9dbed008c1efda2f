"""Building decision prefixes (docs/SAPD.md §1, Eq. 3): one per recorded decision, rendered through the
tokenizer's chat template, length-filtered, split by trajectory, written as committed Parquet shards.
Reading a committed build is :mod:`sapd.data.prefix_table` (which needs none of the input parsers).

Output layout under ``out``: ``train/`` and ``val/`` shard folders and a top-level ``_MANIFEST.json``
written after both, which commits the whole build (counts, options, input fingerprint). Rows are
written to their split's shards as they are rendered, so memory holds the loaded trajectories and at
most one part of rows per split (``rows_per_part``), however large the input. Re-running the
same build over a committed output is a no-op; a different build over it is refused unless asked to
overwrite.
"""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Iterable, Sequence

from sapd import storage
from sapd.data import shards
from sapd.data.loaders import LoadOptions, input_files, load_trajectories
from sapd.data.prefix_table import committed_build, read_prefixes
from sapd.data.prompts import PrefixOptions, render_messages, render_prompt
from sapd.data.schema import PREFIX_KIND, PREFIX_SCHEMA, PREFIX_SCHEMA_VERSION, Trajectory
from sapd.method.benchmarks import BenchmarkSpec, get_benchmark
from sapd.progress import Progress

# read_prefixes: the build's callers read what they built from here too (sapd.data.prefix_table has it)
__all__ = ["BuildResult", "PrefixOptions", "PrefixRowBuilder", "PrefixStats", "build_prefix_rows", "build_prefixes",
           "committed_build", "fingerprint", "read_prefixes", "render_prompt", "tokenizer_fingerprint",
           "validation_ids"]


@dataclass
class PrefixStats:
    trajectories: int = 0
    prefixes_built: int = 0
    filtered_too_long: int = 0
    kept: int = 0
    train: int = 0
    val: int = 0
    train_trajectories: int = 0
    val_trajectories: int = 0
    max_prompt_tokens_seen: int = 0
    max_prompt_tokens_kept: int = 0  # the longest prompt training will see (the memory estimate's)
    by_category: dict[str, int] = field(default_factory=dict)


def validation_ids(trajectory_ids: Iterable[str], val_fraction: float = 0.05, seed: int = 0) -> set[str]:
    """Deterministic split by trajectory: shuffle the sorted ids with ``seed`` and hold out the first
    round(n·fraction) (at least one when n ≥ 2 and the fraction is positive). Input order never matters."""
    ids = sorted(set(trajectory_ids))
    if val_fraction <= 0 or len(ids) < 2:
        return set()
    n_val = min(len(ids) - 1, max(1, round(len(ids) * val_fraction)))
    random.Random(seed).shuffle(ids)
    return set(ids[:n_val])


class PrefixRowBuilder:
    """Rows (PREFIX_SCHEMA) one trajectory at a time, length-filtered, with the split assigned and the
    statistics kept as they go, so a build can write its shards while it renders (memory: one part)."""

    def __init__(self, trajectory_ids: Sequence[str], spec: BenchmarkSpec, tokenizer, opts: PrefixOptions):
        self.spec, self.tokenizer, self.opts = spec, tokenizer, opts
        self.val = validation_ids(trajectory_ids, opts.val_fraction, opts.seed)
        self.history = opts.effective_history(spec)
        self.stats = PrefixStats(trajectories=len(trajectory_ids))

    def rows(self, traj: Trajectory) -> list[dict[str, Any]]:
        spec, opts, stats = self.spec, self.opts, self.stats
        split = "val" if traj.id in self.val else "train"
        messages = [render_messages(traj, t, spec, self.history, opts.prompt_style) for t in range(len(traj.turns))]
        prompts = [render_prompt(self.tokenizer, m) for m in messages]
        lengths = [len(ids) for ids in self.tokenizer(prompts, add_special_tokens=False)["input_ids"]]
        rows = []
        for t, turn in enumerate(traj.turns):
            stats.prefixes_built += 1
            stats.max_prompt_tokens_seen = max(stats.max_prompt_tokens_seen, lengths[t])
            if opts.max_prompt_tokens is not None and lengths[t] > opts.max_prompt_tokens:
                stats.filtered_too_long += 1
                continue
            stats.max_prompt_tokens_kept = max(stats.max_prompt_tokens_kept, lengths[t])
            rows.append({
                "prefix_id": f"{traj.id}#{t}", "trajectory_id": traj.id, "turn_index": t,
                "num_turns": len(traj.turns), "benchmark": spec.name, "category": traj.category,
                "task": traj.task, "messages": json.dumps(messages[t], ensure_ascii=False),
                "prompt": prompts[t], "prompt_tokens": lengths[t], "recorded_response": turn.response,
                "recorded_action": turn.action,
                "previous_action": traj.turns[t - 1].action if t > 0 else None,
                "success": traj.success, "split": split,
            })
            cat = traj.category or "-"
            stats.by_category[cat] = stats.by_category.get(cat, 0) + 1
        stats.kept += len(rows)
        if rows:
            if split == "train":
                stats.train += len(rows)
                stats.train_trajectories += 1
            else:
                stats.val += len(rows)
                stats.val_trajectories += 1
        return rows


def build_prefix_rows(trajectories: Sequence[Trajectory], spec: BenchmarkSpec, tokenizer,
                      opts: PrefixOptions, progress: Callable[[int], None] | None = None,
                      ) -> tuple[list[dict[str, Any]], PrefixStats]:
    """One row per recorded decision (PREFIX_SCHEMA), length-filtered, with the split assigned."""
    builder = PrefixRowBuilder([t.id for t in trajectories], spec, tokenizer, opts)
    rows: list[dict[str, Any]] = []
    for traj in trajectories:
        rows.extend(builder.rows(traj))
        if progress:
            progress(1)
    return rows, builder.stats


# ---------------------------------------------------------------------------------------------------
# the build as one committed output


def fingerprint(input_files: Sequence[str], fmt: str, benchmark: str, opts: PrefixOptions,
                tokenizer_id: str, extra: dict[str, Any] | None = None) -> str:
    """Identity of a build: the input bytes, the format and every option that changes the rows."""
    h = hashlib.sha256()
    for f in sorted(input_files):
        h.update(f.encode())
        h.update(hashlib.sha256(storage.read_bytes(f)).digest())
    h.update(json.dumps({"format": fmt, "benchmark": benchmark, "options": asdict(opts),
                         "tokenizer": tokenizer_id, "extra": extra or {},
                         "schema_version": PREFIX_SCHEMA_VERSION}, sort_keys=True).encode())
    return h.hexdigest()


def tokenizer_fingerprint(tokenizer) -> str:
    """Vocabulary + special tokens + chat template: what decides the rendered prompt and its length."""
    h = hashlib.sha256()
    h.update(json.dumps(sorted(tokenizer.get_vocab().items()), ensure_ascii=False).encode())
    h.update(json.dumps(tokenizer.all_special_tokens).encode())
    h.update((tokenizer.chat_template or "").encode())
    return h.hexdigest()[:16]


@dataclass
class BuildResult:
    out: str
    skipped: bool  # True when the same build was already committed (a no-op re-run)
    manifest: dict[str, Any]
    invalid: dict[str, Any]
    files: list[str]


def build_prefixes(input_uri: str, fmt: str, benchmark: str, out: str, tokenizer, *,
                   opts: PrefixOptions | None = None, skip_invalid: bool = False,
                   action_wording: str = "recorded", overwrite: bool = False, rows_per_part: int = 50_000,
                   log: Callable[[str], None] = print, show_progress: bool = True,
                   progress: Progress | None = None) -> BuildResult:
    """The whole ``build-prefixes`` stage: load → prefixes → shards → commit. Idempotent. ``progress``
    (default: a bar on a terminal, else log lines, or lines only without ``show_progress``) counts the
    records read and the trajectories rendered."""
    progress = progress or Progress.of(log, show_progress)
    opts = opts or PrefixOptions()
    spec = get_benchmark(benchmark)
    load_opts = LoadOptions(benchmark=benchmark, skip_invalid=skip_invalid,
                            action_wording=action_wording)  # type: ignore[arg-type]
    files = input_files(input_uri, fmt)
    build_id = fingerprint(files, fmt, benchmark, opts, tokenizer_fingerprint(tokenizer),
                           {"skip_invalid": skip_invalid, "action_wording": action_wording})
    existing = committed_build(out)
    if existing is not None:
        if existing.get("build_id") == build_id:
            log(f"{out}: already committed by an identical build ({build_id[:12]}); nothing to do")
            return BuildResult(out, True, existing, existing.get("invalid", {}), files)
        if not overwrite:
            raise shards.ShardError(
                f"{out}: already holds a different committed prefix build ({existing.get('build_id', '?')[:12]}); "
                "choose another --out or pass --overwrite")
        log(f"{out}: replacing the committed build {existing.get('build_id', '?')[:12]} (--overwrite)")
    # no committed build (or replacing one): clear what this stage owns, never anything else under out
    storage.delete(shards.manifest_uri(out))
    for split in ("train", "val"):
        storage.delete_prefix(storage.join(out, split))

    log(f"reading {len(files)} file(s) of format '{fmt}' for benchmark '{benchmark}'")
    with progress.task("reading trajectories", unit="record") as bar:
        loaded = load_trajectories(input_uri, fmt, load_opts, progress=bar)
    if fmt == "auto":
        log(f"format: {loaded.format_summary()}")
    if not loaded.trajectories:
        raise ValueError(f"{input_uri}: no valid trajectories ({loaded.records_read} records read, "
                         f"{loaded.report.total} invalid)"
                         + ("\n" + "\n".join(loaded.report.lines()) if loaded.report.total else ""))
    # rows go to their split's shard writer as they are rendered: memory holds one part of each split
    writers = {split: shards.ShardWriter(storage.join(out, split), PREFIX_SCHEMA, kind=PREFIX_KIND,
                                         schema_version=PREFIX_SCHEMA_VERSION, rows_per_part=rows_per_part)
               for split in ("train", "val")}
    builder = PrefixRowBuilder([t.id for t in loaded.trajectories], spec, tokenizer, opts)
    with progress.task("rendering prefixes", total=len(loaded.trajectories), unit="trajectory") as bar:
        for traj in loaded.trajectories:
            rows = builder.rows(traj)
            if rows:  # one trajectory, one split
                writers[rows[0]["split"]].add(rows)
            bar.update(1)
    stats = builder.stats
    if not stats.kept:
        for split in ("train", "val"):
            storage.delete_prefix(storage.join(out, split))
        raise ValueError(f"every prefix was filtered out: the longest prompt has {stats.max_prompt_tokens_seen} "
                         f"tokens, --max-prompt-tokens is {opts.max_prompt_tokens}")
    for w in writers.values():
        w.close()
    invalid = loaded.report.to_dict()
    manifest = {"kind": "prefix_build", "schema_version": PREFIX_SCHEMA_VERSION, "build_id": build_id,
                "splits": ["train", "val"], "stats": asdict(stats), "format": fmt,
                "format_read": loaded.format_summary(), "formats": loaded.formats, "benchmark": benchmark,
                "input": input_uri, "files": files, "records_read": loaded.records_read,
                "valid_records": loaded.valid_records, "invalid": invalid, "options": asdict(opts),
                "action_wording": action_wording}
    shards.commit_manifest(out, manifest)
    return BuildResult(out, False, manifest, invalid, files)
