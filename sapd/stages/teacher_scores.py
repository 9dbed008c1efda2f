"""The teacher-scores stage of round k (``sapd.jobs.teacher_scores``, the chart's ``teacherScores`` block):
checkpoint k + the round's prefix batch → G student samples per prefix, the frozen teacher's log-probs
of every sampled token, action masks and rule scores, one scored part per worker
(``rounds/k/scored/part-WWWWW.parquet``, format and commit in :mod:`sapd.data.scored`).

Worker w of W takes the batch's prefixes i with i % W == w, writes its part and a small done-marker;
the worker that finds every part written commits the round (``_MANIFEST.json``, idempotent, so two
workers finishing together both commit the same round). A rerun of a worker whose part is done is a
no-op, so a retried pod redoes only uncommitted work. Sampling is seeded by (seed, round, worker),
so a redone part is the same part.

Round k is sampled by checkpoint :func:`~sapd.config.sampler_checkpoint` (k; k−1 with
``train.overlap: one_step``).

Entry: :func:`run` (the stage interface of :mod:`sapd.stages.context`): one worker's share (the Job of an
Indexed Job's pod), every worker in turn (the local executor, which keeps the teacher and the student
sampler loaded across rounds in ``ctx.engines``, as a persistent worker does), or only the commit
(``--commit``), as :class:`Options` says. Every model load is one ``model load: …`` line (a persistent
worker logs each model once per run; later checkpoints are ``weights: … in place`` lines).
"""

from __future__ import annotations

import dataclasses
import hashlib
import shutil
import time
from dataclasses import dataclass
from typing import Any, Callable, Protocol, Sequence

from sapd import checkpoints, layout, storage
from sapd.config import RunConfig, sampler_checkpoint
from sapd.data import scored, validation
from sapd.data.batches import round_batch, worker_rows
from sapd.method.benchmarks import get_benchmark
from sapd.method.rules import RuleWeights
from sapd.metrics import Metrics
from sapd.models.devices import rank_device
from sapd.models.generation import Generator, HFGenerator, SamplingParams, stops_for
from sapd.models.loading import check_same_tokenizer, default_cache_dir, load_causal_lm, load_tokenizer, pin_model_path
from sapd.models.scoring import HFScorer, ScoringStats
from sapd.models.vllm_backend import VLLMGenerator, VLLMScorer
from sapd.progress import Progress
from sapd.stages.context import Engines, Outcome, StageContext, Step
from sapd.stages.validation import pending as validation_pending
from sapd.stages.validation import record_metrics as record_validation
from sapd.stages.validation import summary_line as validation_line
from sapd.stages.validation import validate_worker


class TeacherScorer(Protocol):
    """The frozen teacher: ``groups`` = [(prefix_id, prompt_ids, [response_ids × G])] → per group, the
    teacher's log-prob of every response token (``teacher_logp_G_T``). ``progress(n)`` after n groups."""

    def __call__(self, groups: Sequence[tuple[str, list[int], list[list[int]]]],
                 progress: Callable[[int], None] | None = None) -> list[list[list[float]]]: ...


def release_teacher(teacher: Any) -> bool:
    """Before a training stage in the same process (``sapd run``): the kept teacher gives back the device
    (vLLM sleeps, its weights offloaded to host memory, where it can; an HF model on an accelerator moves
    to host memory); it wakes at its next call. → whether anything moved."""
    release = getattr(teacher, "release", None)
    return bool(release()) if callable(release) else False


def student_generator(cfg: RunConfig, k: int, tokenizer, reuse: Generator | None = None) -> Generator:
    """The sampler of round k: checkpoint k behind ``sampling.backend``. With ``reuse`` (the engine of an
    earlier round, built by this function) the engine stays up and takes checkpoint k's weights in place
    — HF: copied into the live model; vLLM: its native weight-update session (``reload_weights`` where the
    installed vLLM lacks it), woken first if it slept through training, every call under
    ``sampling.weight_sync_timeout_s`` — instead of a model load (and, for vLLM, an engine start) per
    round. Samples after the update equal a fresh engine's on the same weights and seed (tests/models/test_models.py,
    tests/vllm)."""
    path = checkpoints.checkpoint_model_path(cfg.run_root, k)
    if isinstance(reuse, (HFGenerator, VLLMGenerator)):
        reuse.load_weights(path)
        return reuse
    if cfg.sampling.backend == "vllm":
        return VLLMGenerator.from_path(path, dtype=cfg.precision(),
                                       gpu_memory_utilization=cfg.sampling.gpu_memory_utilization,
                                       tensor_parallel_size=cfg.sampling.tensor_parallel_size,
                                       sync_timeout_s=cfg.sampling.weight_sync_timeout_s)
    device = rank_device(cfg.model.device)
    student = checkpoints.load_checkpoint_model(cfg.run_root, k, cfg.model.dtype, device)
    return HFGenerator(student, tokenizer, prompts_per_batch=cfg.sampling.prompts_per_batch, device=device)


def release_student(generator: Generator | None) -> bool:
    """Before a training stage: the kept student engine gives back the device (vLLM sleeps where it can,
    an HF model on an accelerator moves to host memory); the next :func:`student_generator` call wakes it
    with the new weights. → whether anything moved."""
    if isinstance(generator, (HFGenerator, VLLMGenerator)):
        return generator.release()
    return False


def teacher_scorer(cfg: RunConfig, tokenizer) -> TeacherScorer:
    """The frozen teacher behind ``sampling.backend``, loaded once: vLLM scoring each group's prompt once
    through its prefix cache (:class:`~sapd.models.vllm_backend.VLLMScorer`), or the HF shared-prefix scorer
    (:class:`~sapd.models.scoring.HFScorer`).
    Both can :func:`release_teacher` the device for training."""
    if cfg.sampling.backend == "vllm":
        return VLLMScorer.from_path(cfg.model.teacher, dtype=cfg.precision(),
                                    gpu_memory_utilization=cfg.sampling.gpu_memory_utilization,
                                    tensor_parallel_size=cfg.sampling.teacher_tensor_parallel_size)
    device = rank_device(cfg.model.device)
    # a scorer object (not a closure): the validation samples the teacher through the same engine
    return HFScorer(load_causal_lm(cfg.model.teacher, dtype=cfg.precision(), device=device),
                    pad_id=tokenizer.pad_token_id, device=device)


@dataclass
class WorkerResult:
    skipped: bool  # the part was already written (or the round committed): nothing redone
    rows: int
    timings: dict[str, float]
    generated_tokens: int = 0
    committed: bool = False  # this worker committed the round (it found every part written)
    validation_seconds: float = 0.0  # this worker validated checkpoint k now (its share), in this long
    responses: int = 0
    truncated: int = 0  # responses cut at sampling.max_new_tokens

    @property
    def truncated_share(self) -> float | None:
        return self.truncated / self.responses if self.responses else None


def record_metrics(metrics: Metrics, k: int, result: WorkerResult) -> None:
    """Stage timings (sample, score, masks_rules; validation) and tokens of a worker that did its work."""
    if not result.skipped:
        for key, seconds in result.timings.items():
            metrics.observe_stage(key.removesuffix("_seconds"), seconds)
        metrics.add_tokens("sample", result.generated_tokens)
        metrics.add_tokens("score", result.generated_tokens)
    if result.validation_seconds > 0:
        metrics.observe_stage("validation", result.validation_seconds)
    if result.truncated_share is not None:
        metrics.truncated.set(result.truncated_share)
    metrics.round.set(k)


def run_worker(cfg: RunConfig, k: int, worker: int, generator: Generator, teacher: TeacherScorer, tokenizer, *,
               log: Callable[[str], None] = print, show_progress: bool = True,
               progress: Progress | None = None) -> WorkerResult:
    """Sample, score and write worker ``worker``'s part of round ``k``; commit the round when every part
    is written. First, when the run validates checkpoint k (:func:`sapd.data.validation.wanted`), this
    worker's share of that validation with the same engines (:func:`sapd.stages.validation.validate_worker`),
    written before its scored part, so a worker whose scored part is there has validated. Round
    ``train.rounds`` (the last checkpoint) is only validated. ``progress`` counts the prefixes sampled and
    scored."""
    progress = progress or Progress.of(log, show_progress)
    validated = None
    if validation.wanted(cfg, k):
        validated = validate_worker(cfg, k, worker, generator, teacher, tokenizer, log=log, progress=progress)
    seconds = sum(validated["timings"].values()) if validated else 0.0
    if k >= cfg.train.rounds:  # the last checkpoint: nothing to score
        return WorkerResult(validated is None, 0, {}, 0, _commit_if_complete(cfg, k, log), seconds)
    done = _finished(cfg, k, worker, log)
    if done is not None:
        done.validation_seconds = seconds
        return done
    out_dir = layout.scored_dir(cfg.run_root, k)
    spec = get_benchmark(cfg.data.benchmark)
    rows = worker_rows(round_batch(cfg, k), worker, cfg.workers).to_pylist()
    prompts = [r["prompt"] for r in rows]
    params = SamplingParams(n=cfg.sampling.group_size, temperature=cfg.sampling.temperature,
                            top_p=cfg.sampling.top_p, max_new_tokens=cfg.sampling.max_new_tokens,
                            stop=stops_for(spec.decision), seed=_seed(cfg.train.seed, k, worker))
    timings: dict[str, float] = {}
    log(f"round {k} worker {worker}/{cfg.workers}: {len(rows)} prefixes × G={params.n}")
    t0 = time.perf_counter()
    with progress.task(f"round {k} sampling", total=len(prompts), unit="prefix") as bar:
        samples_P_G = generator.generate(prompts, params, progress=bar)
    timings["sample_seconds"] = time.perf_counter() - t0

    prompt_ids_P = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
    groups = [(r["prefix_id"], pids, [s.token_ids for s in group])
              for r, pids, group in zip(rows, prompt_ids_P, samples_P_G)]
    stats: ScoringStats | None = getattr(teacher, "stats", None)
    before = dataclasses.replace(stats) if stats is not None else None
    t0 = time.perf_counter()
    with progress.task(f"round {k} teacher scoring", total=len(groups), unit="prefix") as bar:
        teacher_logp_P_G_T = teacher(groups, progress=bar)
    timings["score_seconds"] = time.perf_counter() - t0
    if stats is not None and before is not None:  # how much of each group the teacher computed: each prompt once?
        log(f"round {k} worker {worker}: {stats.minus(before).line()}")

    t0 = time.perf_counter()
    weights = RuleWeights(cfg.rules.format_weight, cfg.rules.repetition_weight)
    out_rows: list[dict[str, Any]] = [
        scored.scored_row(r, pids, group, t_logp, tokenizer, spec, weights)
        for r, pids, group, t_logp in zip(rows, prompt_ids_P, samples_P_G, teacher_logp_P_G_T)]
    timings["masks_rules_seconds"] = time.perf_counter() - t0
    n_tokens = sum(len(s.token_ids) for g in samples_P_G for s in g)
    n_rows = scored.write_worker_part(out_dir, worker, out_rows, timings, n_tokens, cfg.workers,
                                      teacher=cfg.model.teacher)
    truncated, responses = scored.truncated_share(out_rows)
    log(f"round {k} worker {worker}: wrote {n_rows} groups, {n_tokens} generated tokens "
        f"(sample {timings['sample_seconds']:.1f}s, teacher {timings['score_seconds']:.1f}s); "
        f"{truncated} of {responses} responses ({truncated / max(responses, 1):.1%}) cut at "
        f"sampling.max_new_tokens={cfg.sampling.max_new_tokens}")
    return WorkerResult(False, n_rows, timings, n_tokens, _commit_if_complete(cfg, k, log), seconds, responses,
                        truncated)


def _finished(cfg: RunConfig, k: int, worker: int, log: Callable[[str], None]) -> WorkerResult | None:
    """The result of a worker whose part is already written (or whose round is committed), else None."""
    marker = scored.worker_marker(cfg, k, worker)
    if not (scored.is_committed(cfg.run_root, k) or marker is not None):
        return None
    log(f"round {k} worker {worker}: already done")
    done: dict[str, Any] = marker if marker is not None else {"rows": -1, "timings": {}}
    return WorkerResult(True, done["rows"], done.get("timings", {}), done.get("generated_tokens", 0),
                        _commit_if_complete(cfg, k, log), responses=done.get("responses", 0),
                        truncated=done.get("truncated_responses", 0))


def _commit_if_complete(cfg: RunConfig, k: int, log: Callable[[str], None]) -> bool:
    """The last worker to finish commits the round — checkpoint k's validation, then the scored manifest
    (:func:`sapd.data.scored.commit_teacher_scores`; idempotent); False while some part is missing."""
    scores, validates = k < cfg.train.rounds, validation.wanted(cfg, k)
    todo_scores = scores and not scored.is_committed(cfg.run_root, k)
    todo_validation = validates and not validation.is_committed(cfg.run_root, k)
    if not (todo_scores or todo_validation):
        return False
    done = min(len(scored.workers_done(cfg, k)) if todo_scores else cfg.workers,
               len(validation.workers_done(cfg, k)) if todo_validation else cfg.workers)
    if done < cfg.workers:
        log(f"round {k}: {done}/{cfg.workers} workers done; the last one to finish commits the round")
        return False
    result, manifest = scored.commit_teacher_scores(cfg, k)
    if result is not None and todo_validation:
        log(validation_line(result))
    if manifest is not None and todo_scores:
        log(f"round {k}: committed {manifest['rows']} scored groups from {manifest['workers']} workers")
    return True


@dataclass
class Options:
    """What the teacher-scores door chose (``ctx.options["teacher-scores"]``)."""

    worker: int | None = None  # this worker's share; None: every worker in turn (the local executor)
    # only commit the round, whose workers are all done (``sapd.jobs.teacher_scores --commit``)
    commit_only: bool = False


def _scoring_engines(ctx: StageContext, k: int) -> tuple[RunConfig, Generator, TeacherScorer, Any]:
    """(the config with the teacher pinned, round k's sampler, the teacher, the tokenizer), loaded once and
    kept in ``ctx.engines``: the teacher for the whole run, the sampler taking each round's weights (those of
    checkpoint :func:`~sapd.config.sampler_checkpoint`). Each model load is a ``model load:`` line; a weight
    update in place a ``weights:`` line."""
    cfg, e = ctx.cfg, ctx.engines
    scoring_cfg = _load_teacher(ctx)
    s = sampler_checkpoint(cfg, k)
    if e.released:  # the trainer had the device: the engines take it back (sapd run on one GPU)
        if isinstance(e.student, (HFGenerator, VLLMGenerator)):
            e.hand_off(k, "student engine wakes", e.student.wake)
        if callable(wake := getattr(e.teacher, "wake", None)):
            e.hand_off(k, "teacher engine wakes", wake)
        e.released = False
    if e.student is None or e.student_checkpoint != s:
        t0 = time.perf_counter()
        reused = e.student is not None
        e.student = student_generator(cfg, s, e.tokenizer, reuse=e.student)
        e.student_checkpoint = s
        what = "sampling round" + (f" {k}" if s == k else f" {k} (train.overlap: one_step)")
        ctx.log(f"{'weights' if reused else 'model load'}: student checkpoint {s}{' in place' if reused else ''} "
                f"for {what} ({time.perf_counter() - t0:.1f}s)")
        _forget_old_checkpoints(e, cfg, s, ctx.log)
    ctx.startup.mark("models_loaded")
    ctx.startup.mark("engines_ready")
    return scoring_cfg, e.student, e.teacher, e.tokenizer


def _load_teacher(ctx: StageContext) -> RunConfig:
    """The tokenizer and the frozen teacher, loaded once into ``ctx.engines`` → the config with the teacher
    pinned (a run root as teacher: one of its checkpoints, for the whole run)."""
    cfg, e = ctx.cfg, ctx.engines
    if e.tokenizer is None:
        e.tokenizer = load_tokenizer(cfg.model.student)
    if e.teacher is None or e.teacher_path is None:
        e.teacher_path = pin_model_path(cfg.model.teacher, "model.teacher", ctx.log)
        check_same_tokenizer(e.tokenizer, load_tokenizer(e.teacher_path))
    teacher_path: str = e.teacher_path
    scoring_cfg = cfg if teacher_path == cfg.model.teacher else dataclasses.replace(
        cfg, model=dataclasses.replace(cfg.model, teacher=teacher_path))
    if e.teacher is None:
        t0 = time.perf_counter()
        e.teacher = teacher_scorer(scoring_cfg, e.tokenizer)
        ctx.log(f"model load: teacher {teacher_path} ({cfg.sampling.backend}, {time.perf_counter() - t0:.1f}s)")
    return scoring_cfg


def prepare(ctx: StageContext, step: Step, wait_for_checkpoint: Callable[[int], None]) -> None:
    """A persistent scoring worker's start-up while its first round's input is still being made (the
    prefix build, or the trainer's checkpoint): the tokenizer and the teacher, which depend on nothing the
    run commits, so that loading them overlaps the wait (:func:`sapd.run.job.stage_main`). The student's
    sampler needs the round's checkpoint: it is loaded with the round. A door that only commits loads
    nothing."""
    opts: Options = ctx.options.get("teacher-scores") or Options()
    if not opts.commit_only and ctx.engines.keep:
        _load_teacher(ctx)


def _forget_old_checkpoints(e: Engines, cfg: RunConfig, s: int, log: Callable[[str], None]) -> None:
    """A worker that keeps its engines for the whole run downloads one checkpoint per round: the local
    copies (in the pod's scratch or the node's model cache) of checkpoints before s−1 are removed once
    checkpoint s is loaded — no stage of this run reads them again (with ``train.overlap: one_step`` a
    scoring worker may still read s−1, so it is kept) — so a run of many rounds does not fill the disk.
    Only copies under the model cache, never a local run root."""
    if not e.keep or not storage.is_s3(cfg.run_root):
        return
    e.fetched[s] = checkpoints.checkpoint_model_path(cfg.run_root, s)
    cache = default_cache_dir().resolve()
    for j in [j for j in e.fetched if j < s - 1]:
        folder = e.fetched.pop(j)
        if cache in folder.resolve().parents:
            (folder / ".sapd-sync-complete").unlink(missing_ok=True)  # no reader takes a half-removed copy
            shutil.rmtree(folder, ignore_errors=True)
            folder.with_name(folder.name + ".lock").unlink(missing_ok=True)
            log(f"removed the local copy of checkpoint {j} ({folder})")


def run(ctx: StageContext, step: Step) -> Outcome:
    """The stage for round ``step.round`` (every door calls it through :func:`sapd.stages.context.run_stage`):
    check the inputs, then each of this door's workers (:class:`Options`) that is not done: build (or reuse)
    the round's sampler and the teacher, :func:`run_worker` (which first validates checkpoint k on its share
    of the held-out prefixes when the run validates it). The last worker to finish commits the round. Round
    ``train.rounds`` (the last checkpoint) has nothing to score: it is only validated. → the workers' results."""
    cfg, k = ctx.cfg, step.round
    assert k is not None, "teacher-scores runs for a round"
    opts: Options = ctx.options.get("teacher-scores") or Options()
    scores, validates = k < cfg.train.rounds, validation.wanted(cfg, k)
    if not (scores or validates):
        raise ValueError(f"round {k}: the run has {cfg.train.rounds} rounds (0..{cfg.train.rounds - 1}) and "
                         f"checkpoint {k} is not validated (validation.every_rounds: {cfg.validation.every_rounds}); "
                         "nothing to score or validate")
    if opts.commit_only:
        checked, manifest = scored.commit_teacher_scores(cfg, k)
        ctx.metrics.round.set(k)
        if checked is not None:
            record_validation(ctx.metrics, checked)
        lines = ([validation_line(checked)] if checked is not None else []) + (
            [f"round {k}: committed {manifest['rows']} scored groups from {manifest['workers']} workers"]
            if manifest is not None else [])
        return Outcome("; ".join(lines), value=manifest if manifest is not None else checked)
    workers = list(range(cfg.workers)) if opts.worker is None else [opts.worker]
    for w in workers:
        if not 0 <= w < cfg.workers:
            raise ValueError(f"worker index {w} is outside 0..{cfg.workers - 1} (config workers: {cfg.workers})")
    s = sampler_checkpoint(cfg, k)
    if not checkpoints.is_committed(cfg.run_root, s):
        raise FileNotFoundError(f"checkpoint {s} is not committed in {cfg.run_root} (it samples round {k}); "
                                f"train round {s - 1} first")
    results = []
    for w in workers:
        result = None
        if not (validates and validation_pending(cfg, k, w)):  # nothing to validate: maybe nothing to do
            result = _finished(cfg, k, w, ctx.log) if scores else WorkerResult(
                True, 0, {}, 0, _commit_if_complete(cfg, k, ctx.log))
        if result is None:
            scoring_cfg, generator, teacher, tokenizer = _scoring_engines(ctx, k)
            ctx.startup.mark("first_work")
            result = run_worker(scoring_cfg, k, w, generator, teacher, tokenizer, log=ctx.log,
                                progress=ctx.progress)
        record_metrics(ctx.metrics, k, result)
        results.append(result)
    if validates and validation.is_committed(cfg.run_root, k):
        record_validation(ctx.metrics, validation.read(cfg.run_root, k))  # restated when found committed too
    if not ctx.engines.keep:
        ctx.engines.student = ctx.engines.teacher = None
    elif ctx.engines.release:  # the engines stay up; training gets the device (sapd run)
        e = ctx.engines
        e.hand_off(k, "student engine releases the device", lambda: release_student(e.student))
        e.hand_off(k, "teacher engine releases the device", lambda: release_teacher(e.teacher))
        e.released = True
    round_manifest = scored.committed_manifest(cfg.run_root, k)
    if round_manifest is not None and round_manifest.get("responses"):  # the whole round's share, once committed
        ctx.metrics.truncated.set(round_manifest["truncated_responses"] / round_manifest["responses"])
    who = f"worker {workers[0]}/{cfg.workers}" if len(workers) == 1 else f"{len(workers)} workers"
    done = "already done" if all(r.skipped for r in results) else "done"
    committed = "" if not any(r.committed for r in results) else ", round committed" if scores else \
        ", validation committed"
    what = f"{sum(max(r.rows, 0) for r in results)} groups" if scores else "the last checkpoint validated"
    return Outcome(f"round {k} {who}: {done}, {what}{committed}", all(r.skipped for r in results), results)


def _seed(seed: int, k: int, worker: int) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}:{k}:{worker}".encode()).digest()[:4], "little")
