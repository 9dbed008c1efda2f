"""The local pipeline (``sapd run CONFIG``): build prefixes if needed, then rounds of precompute →
train until ``train.rounds``, in one process, with a local folder or ``s3://`` as the run root.

Every stage checks what is committed first, so killing the process at any point and starting it
again resumes from the last committed piece and — since every stage reloads its inputs from the run
root and is seeded by (seed, round, worker) — produces the same result as an uninterrupted run.
"""

from __future__ import annotations

import time
from typing import Callable

from sapd import checkpoints, layout, storage
from sapd.config import ConfigError, RunConfig, dump_config
from sapd.data import shards
from sapd.metrics import Metrics


def write_run_config(cfg: RunConfig) -> None:
    """The resolved config goes into the run root; a run root already holding a *different* config
    is refused (resuming must not silently change the experiment)."""
    uri = layout.config_uri(cfg.run_root)
    text = dump_config(cfg)
    if storage.exists(uri):
        if storage.read_text(uri) != text:
            raise ConfigError(f"{uri} holds a different resolved config; resume with the same config, or "
                              "choose a new run_root")
        return
    storage.write_text(uri, text)


def ensure_prefixes(cfg: RunConfig, tokenizer, log: Callable[[str], None], show_progress: bool):
    from sapd.data.prefixes import PrefixOptions, build_prefixes
    d = cfg.data
    opts = PrefixOptions(history_length=d.history_length, full_history=d.full_history, prompt_style=d.prompt_style,
                         max_prompt_tokens=d.max_prompt_tokens, val_fraction=d.val_fraction, seed=d.split_seed)
    return build_prefixes(d.input, d.format, d.benchmark, layout.prefixes_dir(cfg.run_root), tokenizer, opts=opts,
                          skip_invalid=d.skip_invalid, action_wording=d.action_wording, log=log,
                          show_progress=show_progress)


def ensure_initial_checkpoint(cfg: RunConfig, log: Callable[[str], None]) -> None:
    from sapd.models.loading import load_causal_lm, load_tokenizer
    if checkpoints.is_committed(cfg.run_root, 0):
        return
    log(f"checkpoint 0 ← initial student {cfg.model.student}")
    model = load_causal_lm(cfg.model.student, dtype=cfg.model.dtype)
    checkpoints.save_checkpoint(cfg.run_root, 0, model, load_tokenizer(cfg.model.student), None,
                                {"source": cfg.model.student})


def student_generator(cfg: RunConfig, k: int, tokenizer):
    """The sampler of round k: checkpoint k behind ``sampling.backend``. vLLM engines are (re)built from
    the committed checkpoint each round: simple and exact; a long-lived engine with in-place weight sync
    is the faster path for big pools."""
    if cfg.sampling.backend == "vllm":
        from sapd.models.vllm_backend import VLLMGenerator
        return VLLMGenerator.from_path(checkpoints.checkpoint_model_path(cfg.run_root, k), dtype=cfg.model.dtype,
                                       gpu_memory_utilization=cfg.sampling.gpu_memory_utilization)
    from sapd.models.generation import HFGenerator
    student = checkpoints.load_checkpoint_model(cfg.run_root, k, cfg.model.dtype, cfg.model.device)
    return HFGenerator(student, tokenizer, prompts_per_batch=cfg.sampling.prompts_per_batch, device=cfg.model.device)


def teacher_scorer(cfg: RunConfig, tokenizer):
    """``scorer(groups, progress=None)`` of the frozen teacher behind ``sampling.backend`` (load it once)."""
    if cfg.sampling.backend == "vllm":
        from sapd.models.vllm_backend import VLLMScorer
        return VLLMScorer.from_path(cfg.model.teacher, dtype=cfg.model.dtype,
                                    gpu_memory_utilization=cfg.sampling.gpu_memory_utilization).score_groups
    from sapd.models.loading import load_causal_lm
    from sapd.models.scoring import score_groups
    teacher = load_causal_lm(cfg.model.teacher, dtype=cfg.model.dtype, device=cfg.model.device)

    def scorer(groups, progress=None):
        return score_groups(teacher, groups, pad_id=tokenizer.pad_token_id, progress=progress)

    return scorer


def run_pipeline(cfg: RunConfig, *, log: Callable[[str], None] = print, show_progress: bool = True,
                 engine_factory: Callable | None = None, metrics: Metrics | None = None) -> dict:
    """Run (or resume) the whole local pipeline. ``metrics`` (default: from the environment) records stage
    timings, tokens and loss terms, and is pushed to the Pushgateway after every stage when one is set."""
    from sapd.models.loading import check_same_tokenizer, load_tokenizer
    from sapd.precompute import commit_round, precompute_worker
    from sapd.train import run_train_stage

    root = cfg.run_root
    if cfg.loss_config().objective == "grpo":
        raise ConfigError("variant grpo needs the environment: run it with `sapd online --method grpo`")
    metrics = metrics or Metrics.from_env("pipeline")
    write_run_config(cfg)
    tokenizer = load_tokenizer(cfg.model.student)
    sft = cfg.loss_config().objective == "sft"
    scorer = None
    if not sft:
        check_same_tokenizer(tokenizer, load_tokenizer(cfg.model.teacher))
    t0 = time.perf_counter()
    build = ensure_prefixes(cfg, tokenizer, log, show_progress)
    log(f"prefixes: {build.manifest['stats']['train']} train / {build.manifest['stats']['val']} val "
        f"({'already committed' if build.skipped else 'built'}, {time.perf_counter() - t0:.1f}s)")
    if not build.skipped:
        metrics.observe_stage("build_prefixes", time.perf_counter() - t0)
        metrics.push()
    ensure_initial_checkpoint(cfg, log)
    for k in range(cfg.train.rounds):
        if checkpoints.is_committed(root, k + 1):
            continue
        if not sft:
            if shards.read_manifest(layout.scored_dir(root, k)) is None:
                scorer = scorer or teacher_scorer(cfg, tokenizer)
                generator = student_generator(cfg, k, tokenizer)
                for w in range(cfg.workers):
                    res = precompute_worker(cfg, k, w, generator, scorer, tokenizer, log=log,
                                            show_progress=show_progress)
                    for key, seconds in res.timings.items():
                        metrics.observe_stage(key.removesuffix("_seconds"), seconds)
                    metrics.add_tokens("sample", res.generated_tokens)
                    metrics.add_tokens("score", res.generated_tokens)
                commit_round(cfg, k)
                metrics.round.set(k)
                metrics.push()
                del generator
        t0 = time.perf_counter()
        run_train_stage(cfg, k, engine_factory=engine_factory, log=log, show_progress=show_progress,
                        on_step=lambda rec: metrics.record_step(rec, cfg.sampling.group_size))
        metrics.observe_stage("train", time.perf_counter() - t0)
        metrics.push()
        log(f"round {k}: checkpoint {k + 1} committed")
    metrics.mark_success()
    metrics.push()
    return {"run_root": root, "checkpoints": layout.committed_checkpoints(root)}
