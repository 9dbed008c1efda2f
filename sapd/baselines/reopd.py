"""ReOPD's teacher-generated pools (docs/SAPD.md §4): a teacher model plays the environment panel with
sampling and the episodes become the offline pool that the ordinary prefix builder reads.

:func:`teacher_pool` — a teacher model (an HF folder, or checkpoint ``k`` of a run root) plays the panel
with sampling (temperature 1 by default, seeded); the episodes are written as native trajectories
(JSONL, ``data.format: native``). A run trains on such a pool with ``data.reopd_kappa`` set, which draws
each round's prefixes with p(t) ∝ κ^t over the decision index (:func:`sapd.data.batches.reopd_round_batch`).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Callable, Sequence

from sapd import checkpoints
from sapd.data.loaders import write_native_jsonl
from sapd.data.prompts import PrefixOptions
from sapd.data.schema import Trajectory
from sapd.envs.base import EpisodeSpec
from sapd.envs.loop import LoopOptions, run_episodes
from sapd.method.benchmarks import get_benchmark, noop_action
from sapd.models.generation import HFGenerator, SamplingParams, stops_for
from sapd.models.loading import load_causal_lm, load_tokenizer
from sapd.stages.evaluate import run_prompt_options


def teacher_pool(source: str, specs: Sequence[EpisodeSpec], out: str | None = None, *, k: int | None = None,
                 benchmark: str = "textworld", samples_per_spec: int = 1, temperature: float = 1.0,
                 top_p: float = 1.0, seed: int = 0, max_new_tokens: int = 128, horizon: int | None = None,
                 prompt=None, device: str = "cpu", dtype: str = "float32", env_timeout_s: float | None = None,
                 progress: Callable[[int], None] | None = None) -> list[Trajectory]:
    """Trajectories of a teacher model on ``specs`` (:class:`~sapd.envs.base.EpisodeSpec`), sampled.

    ``source`` is an HF model folder (or s3:// prefix), or — with ``k`` — a run root whose committed
    checkpoint k plays (prompted as that run trained, unless ``prompt`` is given). Each spec is played
    ``samples_per_spec`` times (ids ``<spec id>/sample-j`` when more than one). Sampling is seeded (the
    agent loop advances the seed by the step index), so the same source, specs and seed give the same pool.
    With ``out`` the pool is written as native JSONL."""
    if samples_per_spec < 1:
        raise ValueError("samples_per_spec must be at least 1")
    if k is not None:
        model_dir = str(checkpoints.checkpoint_model_path(source, k))
        if prompt is None:
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
