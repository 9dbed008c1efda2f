"""The student's distance to the teacher on held-out prefixes, measured with engines that are already up
(not a stage: the teacher-scores stage runs it for checkpoint k with its round-k sampler and its teacher;
:func:`sapd.stages.evaluate.offline_eval` and the demo run it on models they load). What is measured and
how it is written and merged: :mod:`sapd.data.validation`.

The same on every backend: the student's log-probs are its sampler's own temperature-1 log-probs
(:class:`~sapd.models.generation.Sample`'s, HF or vLLM), the teacher's come from the teacher scorer the
stage scores rounds with (:class:`~sapd.models.scoring.HFScorer` or
:class:`~sapd.models.vllm_backend.VLLMScorer`), the recorded responses are scored by both models the same way,
and the teacher samples through its own engine (:func:`engine_sampler`). So each backend computes
Σ_k log π_S(y_k) − log π_T(y_k) from the numbers it already returns; tests/stages/test_validation.py checks them
against a direct full-softmax computation, and tests/vllm the vLLM path against HF.
"""

from __future__ import annotations

import hashlib
import time
from typing import Any, Callable, Sequence

from sapd.config import RunConfig
from sapd.data import validation
from sapd.method.action_mask import action_token_mask
from sapd.method.benchmarks import BenchmarkSpec, alfworld_action_key, get_benchmark, parse_decision
from sapd.method.rules import normalize_action
from sapd.metrics import Metrics
from sapd.models.generation import Generator, HFGenerator, Sample, SamplingParams, stops_for
from sapd.models.scoring import HFScorer
from sapd.models.vllm_backend import VLLMGenerator, VLLMScorer
from sapd.progress import Progress

# groups = [(prefix_id, prompt_ids, [response_ids × G])] → per group, log-probs of every response token
Scorer = Callable[..., list[list[list[float]]]]


def same_action(benchmark: BenchmarkSpec, a: str, b: str) -> bool:
    """Two actions are the same decision: normalised text, ALFWorld's placements wording-free."""
    key = alfworld_action_key if benchmark.name == "alfworld" else normalize_action
    return key(a) == key(b)


def engine_scorer(generator: Generator, pad_id: int) -> Scorer:
    """Log-probs of given tokens under a sampler's own weights (to score the recorded responses with the
    student): the HF model behind an :class:`~sapd.models.generation.HFGenerator`, or a
    :class:`~sapd.models.vllm_backend.VLLMScorer` on the same vLLM engine as a
    :class:`~sapd.models.vllm_backend.VLLMGenerator` (no second copy of the weights)."""
    if isinstance(generator, HFGenerator):
        return HFScorer(generator.model, pad_id)
    if isinstance(generator, VLLMGenerator):
        return VLLMScorer(generator.llm)
    raise TypeError(f"{type(generator).__name__}: the validation scores the recorded responses with the "
                    "sampler's own engine (an HFGenerator or a VLLMGenerator); this one has none "
                    "(validation.every_rounds: 0 turns the validation off)")


def engine_sampler(scorer: Any, tokenizer, *, prompts_per_batch: int = 4) -> Generator:
    """A sampler on a scorer's engine (the teacher samples through the engine it scores with)."""
    if isinstance(scorer, HFScorer):
        scorer.wake()  # a kept teacher released its device for the last training stage
        return HFGenerator(scorer.model, tokenizer, prompts_per_batch=prompts_per_batch, device=scorer.device)
    if isinstance(scorer, VLLMScorer):
        scorer.wake()
        return VLLMGenerator(scorer.llm, tokenizer=tokenizer)
    raise TypeError(f"{type(scorer).__name__}: the validation samples the teacher through the engine it scores "
                    "with (an HFScorer or a VLLMScorer); this scorer has none (validation.every_rounds: 0 "
                    "turns the validation off)")


def _ids(tokenizer, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _decisions(rows: Sequence[dict[str, Any]], samples_P_G: Sequence[Sequence[Sample]],
               spec: BenchmarkSpec) -> list[dict[str, Any]]:
    """Per prefix: samples, well-formed ones, ones whose action is the recorded one, ones cut at the budget."""
    out = []
    for r, group in zip(rows, samples_P_G):
        parsed = [parse_decision(s.text, spec) for s in group]
        out.append({"prefix_id": r["prefix_id"], "category": r.get("category"), "samples": len(group),
                    "format_valid": sum(d.valid for d in parsed),
                    "action_match": sum(d.valid and same_action(spec, d.content, r["recorded_action"])
                                        for d in parsed),
                    "finish_length": sum(s.finish_reason == "length" for s in group)})
    return out


def distance_records(rows: Sequence[dict[str, Any]], sampler: Generator, teacher: Scorer, student: Scorer,
                     tokenizer, benchmark: str, params: SamplingParams,
                     progress: Progress | None = None) -> tuple[list[dict[str, Any]], dict[str, float]]:
    """The student's records of :mod:`sapd.data.validation` for ``rows``: ``params.n`` samples per prefix from
    ``sampler`` (temperature 1: the reverse KL is an expectation under the student), scored by ``teacher``;
    the recorded responses scored by ``teacher`` and by ``student`` (the sampler's own weights). →
    (records, timings in seconds)."""
    if params.temperature != 1.0 or params.top_p != 1.0:
        raise ValueError("the distance to the teacher samples the student's own distribution: temperature 1, top_p 1")
    spec = get_benchmark(benchmark)
    progress = progress or Progress(mode="off")
    timings: dict[str, float] = {}
    t0 = time.perf_counter()
    with progress.task("validation: sampling", total=len(rows), unit="prefix") as bar:
        samples_P_G = sampler.generate([r["prompt"] for r in rows], params, progress=bar) if rows else []
    timings["sample_seconds"] = time.perf_counter() - t0
    prompt_ids_P = [_ids(tokenizer, r["prompt"]) for r in rows]
    t0 = time.perf_counter()
    with progress.task("validation: teacher scoring", total=len(rows), unit="prefix") as bar:
        teacher_logp_P_G_T = teacher([(r["prefix_id"], p, [s.token_ids for s in g])
                                      for r, p, g in zip(rows, prompt_ids_P, samples_P_G)], progress=bar)
    timings["score_seconds"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    recorded = [(r["prefix_id"], p, [_ids(tokenizer, r["recorded_response"])]) for r, p in zip(rows, prompt_ids_P)]
    with progress.task("validation: recorded responses", total=2 * len(rows), unit="prefix") as bar:
        rec_teacher_P = teacher(recorded, progress=bar)
        rec_student_P = student(recorded, progress=bar)
    timings["recorded_seconds"] = time.perf_counter() - t0
    records = _decisions(rows, samples_P_G, spec)
    for rec, group, t_logp_G_T, (rt,), (rs,) in zip(records, samples_P_G, teacher_logp_P_G_T, rec_teacher_P,
                                                   rec_student_P):
        rec["tokens"] = sum(len(s.token_ids) for s in group)
        # Σ over the G samples' tokens of log π_S − log π_T: the sampler's own log-probs against the teacher's
        d_G_T = [[s_lp - t_lp for s_lp, t_lp in zip(s.logprobs, t)] for s, t in zip(group, t_logp_G_T)]
        rec["reverse_kl"] = sum(x for d in d_G_T for x in d)
        # the same over the action tokens only (the action mask SAPD's step score sums over, Eq. 6)
        masks_G_T = [action_token_mask(tokenizer, s.token_ids, spec) for s in group]
        rec["action_tokens"] = sum(sum(m) for m in masks_G_T)
        rec["reverse_kl_action"] = sum(x for d, m in zip(d_G_T, masks_G_T) for x, on in zip(d, m) if on)
        rec["recorded_tokens"] = len(rt)
        rec["recorded_teacher_logp"], rec["recorded_student_logp"] = sum(rt), sum(rs)
    return records, timings


def teacher_records(rows: Sequence[dict[str, Any]], teacher_sampler: Generator, benchmark: str,
                    params: SamplingParams, progress: Progress | None = None) -> list[dict[str, Any]]:
    """The teacher's own samples on ``rows`` (same parameters): how often its action is the recorded one."""
    progress = progress or Progress(mode="off")
    with progress.task("validation: the teacher's samples", total=len(rows), unit="prefix") as bar:
        samples_P_G = teacher_sampler.generate([r["prompt"] for r in rows], params, progress=bar) if rows else []
    return _decisions(rows, samples_P_G, get_benchmark(benchmark))


def sampling_params(cfg: RunConfig, worker: int) -> SamplingParams:
    """The validation's sampling: temperature 1, ``validation.group_size`` per prefix, seeded by
    (validation.seed, worker) alone, so every checkpoint is sampled with the same random numbers."""
    v = cfg.validation
    seed = int.from_bytes(hashlib.sha256(f"validation:{v.seed}:{worker}".encode()).digest()[:4], "little")
    return SamplingParams(n=v.group_size, temperature=1.0, top_p=1.0,
                          max_new_tokens=v.max_new_tokens or cfg.sampling.max_new_tokens,
                          stop=stops_for(get_benchmark(cfg.data.benchmark).decision), seed=seed)


def pending(cfg: RunConfig, k: int, worker: int, teacher: str | None = None) -> bool:
    """Worker ``worker`` has validation work for checkpoint ``k``: it is not committed, and this worker's part
    or the teacher's (by the folder ``teacher``, when given: the stage's pinned one) is not written."""
    if validation.is_committed(cfg.run_root, k):
        return False
    return validation.part(cfg, k, worker) is None or validation.teacher_part(cfg, worker, teacher) is None


def validate_worker(cfg: RunConfig, k: int, worker: int, sampler: Generator, teacher: Scorer, tokenizer, *,
                    log: Callable[[str], None] = print, progress: Progress | None = None) -> dict[str, Any] | None:
    """Worker ``worker``'s share of checkpoint ``k``'s validation (``sampler`` holds checkpoint k's weights):
    the teacher's part first if this run has none yet, then this checkpoint's part. → the part, or None
    when it was written already (or checkpoint k is committed): nothing redone."""
    if not pending(cfg, k, worker, cfg.model.teacher):
        return None
    rows = validation.worker_share(validation.validation_rows(cfg), worker, cfg.workers)
    params = sampling_params(cfg, worker)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    timings: dict[str, float] = {}
    if validation.teacher_part(cfg, worker, cfg.model.teacher) is None:
        t0 = time.perf_counter()
        sampler_T = engine_sampler(teacher, tokenizer, prompts_per_batch=cfg.sampling.prompts_per_batch)
        recs = teacher_records(rows, sampler_T, cfg.data.benchmark, params, progress)
        timings["teacher_sample_seconds"] = time.perf_counter() - t0
        validation.write_teacher_part(cfg, worker, recs, timings["teacher_sample_seconds"])
    if validation.part(cfg, k, worker) is not None:  # only the teacher's part was missing
        return None
    records, student_timings = distance_records(rows, sampler, teacher, engine_scorer(sampler, pad), tokenizer,
                                                cfg.data.benchmark, params, progress)
    timings.update(student_timings)
    done = validation.write_part(cfg, k, worker, records, timings)
    log(f"checkpoint {k} worker {worker}: validated {len(rows)} held-out prefixes × {params.n} samples "
        f"in {sum(timings.values()):.1f}s")
    return done


def record_metrics(metrics: Metrics, result: dict[str, Any]) -> None:
    """A committed validation's figures, overall and per category, into ``metrics``."""
    groups = {"all": result["overall"], **result.get("by_category", {})}
    metrics.record_validation(result["checkpoint"], {
        cat: {key: g[key]["value"] for key in ("reverse_kl_per_token", "recorded_logratio_per_token", "action_match",
                                               "teacher_action_match") if key in g}
        for cat, g in groups.items()})


def summary_line(result: dict[str, Any]) -> str:
    """One line for the log: the headline figures of a committed validation."""
    o = result["overall"]

    def fmt(f: dict[str, Any]) -> str:
        v, (lo, hi) = f["value"], f["ci"]
        if v is None:
            return "–"
        return f"{v:.3f}" + (f" [{lo:.3f}, {hi:.3f}]" if lo is not None else "")
    teacher = f", teacher's {fmt(o['teacher_action_match'])}" if "teacher_action_match" in o else ""
    return (f"checkpoint {result['checkpoint']}: reverse KL(student ‖ teacher) {fmt(o['reverse_kl_per_token'])} "
            f"per token on {result['prefixes']} held-out prefixes; sampled action match {fmt(o['action_match'])}"
            f"{teacher}")
