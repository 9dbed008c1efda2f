"""The evaluate stage (``sapd.jobs.evaluate``, the chart's ``evaluate`` Job and CronJob): a committed
checkpoint × an environment panel (:mod:`sapd.envs.panels`) → task success per category and overall, as
``evals/NNNNNN/<benchmark>.json`` in the run root (the episodes themselves beside it as native JSONL).
Deterministic: greedy decoding over a fixed, seeded panel, so the same checkpoint and panel give the
same numbers; a checkpoint already evaluated is skipped (what a CronJob wants). ``temperature`` > 0
samples instead (SDAR validates at T = 0.4), seeded, into ``<benchmark>@T<temperature>.json``. The
checkpoint is loaded in the run's ``model.dtype`` and generates with its ``sampling.backend`` (HF or vLLM),
from the run config (the job's) or, for ``sapd evaluate``, the run root's resolved config; the result
records both.

:func:`offline_eval` is the environment-free check on held-out prefixes (the paper's 5 % split): format
validity, repeated actions and agreement with the recorded action, and, given the teacher, the student's
distance to it (the figures the teacher-scores stage records every round: :mod:`sapd.data.validation`).

Entry: :func:`run` (the stage interface of :mod:`sapd.stages.context`); ``sapd evaluate`` calls
:func:`evaluate_checkpoint` on a run root directly.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any, Callable

import pyarrow as pa

from sapd import checkpoints, layout, storage, yamlio
from sapd.config import RunConfig, config_from_dict
from sapd.data.prompts import PrefixOptions
from sapd.data.validation import summarize as summarize_validation
from sapd.envs.alfworld_env import split_source as alfworld_split_source
from sapd.envs.base import EpisodeSpec
from sapd.envs.loop import LoopOptions, run_episodes, summarize
from sapd.envs.panels import PanelSpec, episode_specs
from sapd.envs.searchqa import exact_match_by_source
from sapd.method.benchmarks import get_benchmark, noop_action, parse_decision
from sapd.metrics import Metrics
from sapd.models.generation import Generator, HFGenerator, SamplingParams, stops_for
from sapd.models.loading import load_tokenizer
from sapd.models.scoring import HFScorer
from sapd.models.vllm_backend import VLLMGenerator
from sapd.progress import Progress
from sapd.stages.context import Outcome, StageContext, Startup, Step
from sapd.stages.validation import distance_records, same_action, teacher_records


def latest_checkpoint(root: str) -> int:
    committed = layout.committed_checkpoints(root)
    if not committed:
        raise FileNotFoundError(f"{root}: no committed checkpoint to evaluate")
    return committed[-1]


def run_prompt_options(root: str) -> PrefixOptions:
    """The prompt layout the run trained on (its resolved config), so evaluation prompts match its prefixes."""
    uri = layout.config_uri(root)
    if not storage.exists(uri):
        return PrefixOptions()
    data = (yamlio.load(storage.read_text(uri)) or {}).get("data", {})
    return PrefixOptions(history_length=data.get("history_length"), full_history=bool(data.get("full_history")),
                         prompt_style=data.get("prompt_style", "step"))


def run_generation_options(root: str) -> dict[str, Any]:
    """How the run generates (its committed config, "auto" resolved for this process): ``dtype``, ``backend``
    and the vLLM engine settings; the defaults for a run root without a config."""
    uri = layout.config_uri(root)
    cfg = config_from_dict(yamlio.load(storage.read_text(uri)) or {}) if storage.exists(uri) else RunConfig()
    return {"dtype": cfg.precision(), "backend": cfg.sampling.backend,
            "gpu_memory_utilization": cfg.sampling.gpu_memory_utilization,
            "tensor_parallel_size": cfg.sampling.tensor_parallel_size}


def checkpoint_generator(root: str, k: int, tokenizer, *, backend: str, dtype: str, device: str = "cpu",
                         gpu_memory_utilization: float = 0.4, tensor_parallel_size: int = 1) -> Generator:
    """Committed checkpoint ``k`` behind ``backend`` ("hf" or "vllm"), its weights in ``dtype``."""
    if backend == "vllm":
        return VLLMGenerator.from_path(checkpoints.checkpoint_model_path(root, k), dtype=dtype,  # type: ignore[arg-type]
                                       gpu_memory_utilization=gpu_memory_utilization,
                                       tensor_parallel_size=tensor_parallel_size)
    if backend != "hf":
        raise ValueError(f"sampling.backend: {backend!r} is not one of 'hf', 'vllm'")
    return HFGenerator(checkpoints.load_checkpoint_model(root, k, dtype, device), tokenizer, device=device)


def run_checkpoint_episodes(root: str, k: int, specs: list[EpisodeSpec], benchmark: str, *,
                            horizon: int | None = None, max_new_tokens: int = 128, device: str = "cpu",
                            env_timeout_s: float | None = None, progress: Callable[[int], None] | None = None,
                            temperature: float = 0.0, sample_seed: int = 0, dtype: str | None = None,
                            backend: str | None = None, startup: Startup | None = None,
                            log: Callable[[str], None] | None = None):
    """Greedy (or, with ``temperature`` > 0, seeded sampled) episodes of committed checkpoint ``k`` on
    ``specs``, prompted as the run trained (its resolved config), the checkpoint loaded in ``dtype`` and
    generating with ``backend`` (default: the run's ``model.dtype`` and ``sampling.backend``).
    ``env_timeout_s``: each environment in its own process, a call that hangs longer is killed and
    retried (:mod:`sapd.envs.isolated`). ``startup`` gets the process's start-up phases; ``log`` the
    ``model load:`` line. Returns (trajectories, the horizon used)."""
    t0 = time.perf_counter()
    tokenizer = load_tokenizer(str(checkpoints.checkpoint_model_path(root, k)))
    gen_opts = run_generation_options(root)
    gen_opts.update({key: v for key, v in (("dtype", dtype), ("backend", backend)) if v is not None})
    generator = checkpoint_generator(root, k, tokenizer, device=device, **gen_opts)
    if log is not None:
        log(f"model load: checkpoint {k} for evaluation ({gen_opts.get('backend')}, {time.perf_counter() - t0:.1f}s)")
    if startup is not None:
        startup.mark("engines_ready")  # the model and its generation engine, built together
        startup.mark("first_work")
    spec = get_benchmark(benchmark)
    params = SamplingParams(n=1, temperature=temperature, max_new_tokens=max_new_tokens, stop=stops_for(spec.decision),
                            seed=sample_seed)
    # the no-op sent for a malformed response ("look" is ambiguous in ScienceWorld)
    opts = LoopOptions(prompt=run_prompt_options(root), horizon=horizon, invalid_action=noop_action(benchmark),
                       env_timeout_s=env_timeout_s)
    trajs = run_episodes(specs, generator, tokenizer, spec, params, opts, progress=progress)
    return trajs, opts.horizon or spec.horizon


def write_eval(root: str, k: int, name: str, result: dict[str, Any], trajectories) -> str:
    """``evals/NNNNNN/<name>.episodes.jsonl``, then ``<name>.json`` last: its presence means "evaluated"."""
    lines = [json.dumps(t.to_dict(), sort_keys=True) for t in trajectories]
    storage.write_text(storage.join(layout.evals_dir(root, k), f"{name}.episodes.jsonl"), "\n".join(lines) + "\n")
    dest = storage.join(layout.evals_dir(root, k), f"{name}.json")
    storage.write_json(dest, result)
    return dest


def eval_name(benchmark: str, temperature: float = 0.0) -> str:
    """The result's name in ``evals/NNNNNN/``: ``<benchmark>`` for greedy, ``<benchmark>@T0.4`` sampled."""
    if temperature < 0:
        raise ValueError(f"temperature must be ≥ 0 (0 = greedy), not {temperature}")
    return benchmark if temperature == 0 else f"{benchmark}@T{temperature:g}"


def evaluate_checkpoint(root: str, k: int | str, panel: PanelSpec, *, horizon: int | None = None,
                        max_new_tokens: int = 128, device: str = "cpu", env_timeout_s: float | None = None,
                        log: Callable[[str], None] = print, show_progress: bool = True,
                        metrics: Metrics | None = None, temperature: float = 0.0, dtype: str | None = None,
                        backend: str | None = None, progress: Progress | None = None,
                        startup: Startup | None = None) -> dict[str, Any]:
    """Evaluate checkpoint ``k`` ("latest" for the newest committed one) of the run at ``root`` on ``panel``,
    greedily, or sampled at ``temperature`` (seeded by the panel seed) as SDAR's validation does; the
    checkpoint in ``dtype`` behind ``backend`` (default: the run's ``model.dtype`` and ``sampling.backend``).
    ``metrics`` records the success rates; ``progress`` counts the episodes' steps."""
    progress = progress or Progress.of(log, show_progress)
    benchmark = panel.benchmark
    k = latest_checkpoint(root) if k == "latest" else int(k)
    name = eval_name(benchmark, temperature)
    dest = storage.join(layout.evals_dir(root, k), f"{name}.json")
    if storage.exists(dest):
        done = storage.read_json(dest)
        then = panel.identity_of(done)
        differs = {key: (then[key], v) for key, v in panel.identity().items() if then[key] != v}
        if differs:
            raise ValueError(f"{dest}: checkpoint {k} was evaluated on another panel ({differs}, as (then, now)); "
                             "delete that file to re-evaluate, or evaluate into another run root")
        log(f"checkpoint {k}: {benchmark} already evaluated ({dest})")
        # the push that follows replaces this job's Pushgateway group: it must still carry the success rates
        _record(metrics, benchmark, done)
        return done
    if not checkpoints.is_committed(root, k):
        raise FileNotFoundError(f"{root}: checkpoint {k} is not committed; nothing to evaluate there")
    t0 = time.perf_counter()
    specs = episode_specs(panel)
    gen_opts = run_generation_options(root)
    dtype, backend = dtype or gen_opts["dtype"], backend or gen_opts["backend"]
    log(f"checkpoint {k}: {len(specs)} {benchmark} episodes (seed {panel.seed}), {backend} in {dtype}")
    with progress.task(f"evaluating checkpoint {k} ({len(specs)} episodes)", unit="step") as bar:
        trajs, used_horizon = run_checkpoint_episodes(root, k, specs, benchmark, horizon=horizon,
                                                      max_new_tokens=max_new_tokens, device=device,
                                                      env_timeout_s=env_timeout_s, progress=bar,
                                                      temperature=temperature, sample_seed=panel.seed,
                                                      dtype=dtype, backend=backend, startup=startup, log=log)
    result = {"checkpoint": k, "benchmark": benchmark, "temperature": temperature, "seed": panel.seed,
              "dtype": dtype, "backend": backend,
              "games_per_family": panel.games_per_family,
              "variations_per_task": panel.variations_per_task,
              # the split under the benchmark's own name (ALFWorld: the folder played); where sapd generated
              # ALFWorld's games, how (they are not the official split)
              **({"split": split} if (split := panel.recorded_split()) is not None else {}),
              **({"games": source} if benchmark == "alfworld" and (source := alfworld_split_source(
                  panel.data_dir, panel.split)) is not None else {}),
              "families": sorted({s.category for s in specs if s.category}), "horizon": used_horizon,
              **summarize(trajs), "seconds": time.perf_counter() - t0}
    if benchmark == "searchqa":  # exact match per data source and their average (docs/SAPD.md §6)
        result["exact_match"] = exact_match_by_source(trajs)
    write_eval(root, k, name, result, trajs)
    log(f"checkpoint {k}: {benchmark} success {result['overall']['success']:.3f} "
        + " ".join(f"{c}={v['success']:.2f}" for c, v in result["by_category"].items()))
    log("95% intervals (Wilson): " + ", ".join(f"{c} {v['success_ci'][0]:.2f}–{v['success_ci'][1]:.2f} "
                                               f"(n={v['episodes']})" for c, v in
                                               [("overall", result["overall"]), *result["by_category"].items()]))
    if reworded := result["overall"].get("reworded_steps"):
        # the run's data spoke one ALFWorld wording and the engine another: translated, not scored invalid
        log(f"checkpoint {k}: {reworded} action(s) were in ALFWorld's other placement wording ('put X in/on Y' vs "
            "'move X to Y') than this engine's and were played translated (episodes' reworded_steps); the training "
            "data's wording differs from the engine's (data.action_wording rewrites it)")
    _record(metrics, benchmark, result)
    return result


def _record(metrics: Metrics | None, benchmark: str, result: dict[str, Any]) -> None:
    """The evaluation's success rates, overall and per category, into ``metrics`` (when given)."""
    if metrics is not None:
        metrics.record_eval(benchmark, result["overall"]["success"],
                            {c: v["success"] for c, v in result["by_category"].items()})


@dataclass
class Options:
    """What the evaluate door chose (``ctx.options["evaluate"]``); None fields take the run config's."""

    panel: PanelSpec | None = None  # default: the run's benchmark with the panel's defaults
    horizon: int | None = None  # max steps per episode (default: the benchmark's)
    env_timeout_s: float | None = None  # each environment in its own process, killed after this long
    device: str | None = None  # default: model.device
    max_new_tokens: int | None = None  # default: sampling.max_new_tokens
    temperature: float = 0.0  # 0 = greedy; > 0 sampled, seeded by the panel seed


def run(ctx: StageContext, step: Step) -> Outcome:
    """The stage (every door calls it through :func:`sapd.stages.context.run_stage`): checkpoint
    ``step.round`` (None: the newest committed) on the door's panel, with the device and generation length
    of the run config unless the options give them, and always its ``model.dtype`` and ``sampling.backend``.
    No committed checkpoint yet → nothing to evaluate (a CronJob started before the first round is no
    failure). → the evaluation summary, or None."""
    cfg = ctx.cfg
    opts: Options = ctx.options.get("evaluate") or Options()
    if step.round is None and not layout.committed_checkpoints(cfg.run_root):
        return Outcome(f"{cfg.run_root}: no committed checkpoint yet, nothing to evaluate", True)
    k = latest_checkpoint(cfg.run_root) if step.round is None else step.round
    panel = opts.panel or PanelSpec(benchmark=cfg.data.benchmark)
    done_before = storage.exists(storage.join(layout.evals_dir(cfg.run_root, k),
                                              f"{eval_name(panel.benchmark, opts.temperature)}.json"))
    result = evaluate_checkpoint(cfg.run_root, k, panel, horizon=opts.horizon,
                                 max_new_tokens=opts.max_new_tokens or cfg.sampling.max_new_tokens,
                                 device=opts.device or cfg.model.device, env_timeout_s=opts.env_timeout_s,
                                 log=ctx.log, progress=ctx.progress, metrics=ctx.metrics,
                                 temperature=opts.temperature, dtype=cfg.model.dtype, backend=cfg.sampling.backend,
                                 startup=ctx.startup)
    return Outcome(f"checkpoint {k}: {panel.benchmark} success {result['overall']['success']:.3f}"
                   + (" (evaluated before)" if done_before else ""), done_before, result)


# ---------------------------------------------------------------------------------------------------
# offline validation on held-out prefixes


def offline_eval(model, tokenizer, prefixes: pa.Table, benchmark: str, *, max_new_tokens: int = 64,
                 prompts_per_batch: int = 8, device: str = "cpu", temperature: float = 0.0,
                 seed: int = 0, teacher=None, group_size: int = 4) -> dict[str, Any]:
    """Greedy (``temperature`` 0) or seeded sampled decision per prefix → rates of valid format, repeated
    action and recorded-action match. With a ``teacher`` (a loaded model sharing the tokenizer), also the
    student's distance to it (``distance``: :func:`sapd.stages.validation.distance_records` with
    ``group_size`` samples per prefix at temperature 1, summarised by :func:`sapd.data.validation.summarize`,
    the teacher's own sampled action match included) — what the teacher-scores stage measures every round.
    No environment, so it measures only what the recorded history can check; task success needs
    :func:`evaluate_checkpoint`."""
    spec = get_benchmark(benchmark)
    rows = prefixes.to_pylist()
    if not rows:
        raise ValueError("no prefixes to evaluate")
    gen = HFGenerator(model, tokenizer, prompts_per_batch=prompts_per_batch, device=device)
    samples = gen.generate([r["prompt"] for r in rows], SamplingParams(
        n=1, temperature=temperature, max_new_tokens=max_new_tokens, stop=stops_for(spec.decision), seed=seed))
    valid = match = repeated = 0
    by_category: dict[str, list[int]] = {}
    for r, (s,) in zip(rows, samples):
        d = parse_decision(s.text, spec)
        ok = int(d.valid)
        # ALFWorld actions compare wording-free ("put X in/on Y" = "move X to Y")
        hit = int(d.valid and same_action(spec, d.content, r["recorded_action"]))
        rep = int(bool(d.content) and r["previous_action"] is not None
                  and same_action(spec, d.content, r["previous_action"]))
        valid, match, repeated = valid + ok, match + hit, repeated + rep
        by_category.setdefault(r["category"] or "-", []).append(hit)
    n = len(rows)
    out: dict[str, Any] = {
        "prefixes": n, "format_valid": valid / n, "action_match": match / n, "repeated_action": repeated / n,
        "action_match_by_category": {k: sum(v) / len(v) for k, v in sorted(by_category.items())}}
    if teacher is not None:
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        params = SamplingParams(n=group_size, temperature=1.0, top_p=1.0, max_new_tokens=max_new_tokens,
                                stop=stops_for(spec.decision), seed=seed)
        records, timings = distance_records(rows, gen, HFScorer(teacher, pad), HFScorer(model, pad), tokenizer,
                                            benchmark, params)
        theirs = teacher_records(rows, HFGenerator(teacher, tokenizer, prompts_per_batch=prompts_per_batch,
                                                   device=device), benchmark, params)
        out["distance"] = {**summarize_validation(records, theirs), "timings": timings, "records": records}
    return out
