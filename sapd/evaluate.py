"""Evaluation stage: a committed checkpoint × an environment panel → task success per category and
overall, as ``evals/NNNNNN/<benchmark>.json`` in the run root (the episodes themselves beside it as
native JSONL). Deterministic: greedy decoding over a fixed, seeded panel, so the same checkpoint and
seed give the same numbers; a checkpoint already evaluated is skipped (what a CronJob wants).

Environments available here: the embedded TextWorld panel. The paper's ALFWorld / WebShop / search-QA
adapters plug into the same loop (:mod:`sapd.agent_loop`) where those environments exist.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Callable

import yaml

from sapd import checkpoints, layout, storage
from sapd.agent_loop import EpisodeSpec, LoopOptions, run_episodes, summarize
from sapd.data.prefixes import PrefixOptions


def textworld_specs(families: list[str] | None, games_per_family: int, seed: int,
                    cache_dir: str | Path | None = None) -> list[EpisodeSpec]:
    """The fixed TextWorld panel as episodes (games generated once into the cache)."""
    from sapd.envs.textworld_env import DEFAULT_CACHE, default_panel, ensure_panel, make_env
    cache = Path(cache_dir or DEFAULT_CACHE)
    panel = default_panel(games_per_family, families, seed)
    ensure_panel(panel, cache)
    return [EpisodeSpec(f"textworld/{g.game_id}", (lambda g=g: make_env(g, cache)), category=g.family)
            for g in panel]


def episode_specs(benchmark: str, *, families: list[str] | None = None, games_per_family: int = 2,
                  seed: int = 0, cache_dir: str | Path | None = None, rows: str | None = None,
                  retriever_url: str | None = None, limit: int | None = None,
                  per_source: int | None = None, tasks: list[str] | None = None,
                  variations_per_task: int = 2, split: str = "test", data_dir: str | None = None,
                  webshop_url: str | None = None) -> list[EpisodeSpec]:
    """The fixed panel of one benchmark: TextWorld games, or search-QA questions (Search-R1 rows) asked
    against a retriever speaking the Search-R1 ``/retrieve`` API."""
    if benchmark == "textworld":
        return textworld_specs(families, games_per_family, seed, cache_dir)
    if benchmark == "scienceworld":
        from sapd.envs.scienceworld_env import scienceworld_specs
        return scienceworld_specs(tasks, variations_per_task, seed, split)
    if benchmark == "searchqa":
        from sapd.envs.searchqa import searchqa_specs
        if not (rows and retriever_url):
            raise ValueError("search QA needs --rows (Search-R1 rows) and --retriever-url "
                             "(e.g. python -m sapd.retriever --corpus corpus.jsonl --port 8000)")
        return searchqa_specs(rows, retriever_url, limit, per_source=per_source)
    if benchmark == "alfworld":  # ALFWorld's game files: $ALFWORLD_DATA (alfworld-download) or --data-dir
        from sapd.envs.alfworld_env import alfworld_specs
        return alfworld_specs(data_dir, "valid_unseen" if split == "test" else split, limit, per_category=per_source)
    if benchmark == "webshop":  # a running WebShop server
        from sapd.envs.webshop_env import DEFAULT_URL, webshop_specs
        return webshop_specs(webshop_url or DEFAULT_URL, limit, start=seed)
    raise ValueError(f"no environment for benchmark '{benchmark}': expected one of textworld, scienceworld, "
                     "searchqa, alfworld, webshop")


def noop_action(benchmark: str) -> str:
    """What is sent for a malformed response: a harmless look ("look" is ambiguous in ScienceWorld)."""
    return "look around" if benchmark == "scienceworld" else "look"


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
    data = (yaml.safe_load(storage.read_text(uri)) or {}).get("data", {})
    return PrefixOptions(history_length=data.get("history_length"), full_history=bool(data.get("full_history")),
                         prompt_style=data.get("prompt_style", "step"))


def run_checkpoint_episodes(root: str, k: int, specs: list[EpisodeSpec], benchmark: str, *,
                            horizon: int | None = None, max_new_tokens: int = 128, device: str = "cpu",
                            env_timeout_s: float | None = None, progress: Callable[[int], None] | None = None):
    """Greedy episodes of committed checkpoint ``k`` on ``specs``, prompted as the run trained
    (its resolved config). ``env_timeout_s``: each environment in its own process, a call that hangs
    longer is killed and retried (:mod:`sapd.envs.isolated`). Returns (trajectories, the horizon used)."""
    from sapd.benchmarks import get_benchmark
    from sapd.models.generation import HFGenerator, SamplingParams, stops_for
    from sapd.models.loading import load_tokenizer

    tokenizer = load_tokenizer(str(checkpoints.checkpoint_model_path(root, k)))
    model = checkpoints.load_checkpoint_model(root, k, device=device)
    spec = get_benchmark(benchmark)
    params = SamplingParams(n=1, temperature=0.0, max_new_tokens=max_new_tokens, stop=stops_for(spec.decision))
    # the no-op sent for a malformed response ("look" is ambiguous in ScienceWorld)
    opts = LoopOptions(prompt=run_prompt_options(root), horizon=horizon, invalid_action=noop_action(benchmark),
                       env_timeout_s=env_timeout_s)
    trajs = run_episodes(specs, HFGenerator(model, tokenizer, device=device), tokenizer, spec, params, opts,
                         progress=progress)
    return trajs, opts.horizon or spec.horizon


def write_eval(root: str, k: int, name: str, result: dict[str, Any], trajectories) -> str:
    """``evals/NNNNNN/<name>.episodes.jsonl``, then ``<name>.json`` last: its presence means "evaluated"."""
    lines = [json.dumps(t.to_dict(), sort_keys=True) for t in trajectories]
    storage.write_text(storage.join(layout.evals_dir(root, k), f"{name}.episodes.jsonl"), "\n".join(lines) + "\n")
    dest = storage.join(layout.evals_dir(root, k), f"{name}.json")
    storage.write_json(dest, result)
    return dest


def evaluate_checkpoint(root: str, k: int | str, benchmark: str, *, families: list[str] | None = None,
                        games_per_family: int = 2, seed: int = 0, horizon: int | None = None,
                        max_new_tokens: int = 128, device: str = "cpu", cache_dir: str | Path | None = None,
                        rows: str | None = None, retriever_url: str | None = None, limit: int | None = None,
                        tasks: list[str] | None = None, variations_per_task: int = 2, split: str = "test",
                        data_dir: str | None = None, webshop_url: str | None = None,
                        env_timeout_s: float | None = None, log: Callable[[str], None] = print,
                        show_progress: bool = True, metrics=None) -> dict[str, Any]:
    """Evaluate checkpoint ``k`` ("latest" for the newest committed one) of the run at ``root``."""
    from tqdm import tqdm

    k = latest_checkpoint(root) if k == "latest" else int(k)
    dest = storage.join(layout.evals_dir(root, k), f"{benchmark}.json")
    if storage.exists(dest):
        done = storage.read_json(dest)
        panel = {"seed": seed, "games_per_family": games_per_family}
        if benchmark == "textworld" and families is not None:
            panel["families"] = sorted(families)
        if benchmark == "scienceworld":
            panel.update(variations_per_task=variations_per_task, split=split)
        differs = {key: (done.get(key), v) for key, v in panel.items() if done.get(key) != v}
        if differs:
            raise ValueError(f"{dest}: checkpoint {k} was evaluated on another panel ({differs}, as (then, now)); "
                             "delete that file to re-evaluate, or evaluate into another run root")
        log(f"checkpoint {k}: {benchmark} already evaluated ({dest})")
        return done
    t0 = time.perf_counter()
    specs = episode_specs(benchmark, families=families, games_per_family=games_per_family, seed=seed,
                          cache_dir=cache_dir, rows=rows, retriever_url=retriever_url, limit=limit,
                          tasks=tasks, variations_per_task=variations_per_task, split=split, data_dir=data_dir,
                          webshop_url=webshop_url)
    log(f"checkpoint {k}: {len(specs)} {benchmark} episodes (seed {seed})")
    with tqdm(desc=f"evaluating checkpoint {k}", unit="step", disable=None if show_progress else True,
              leave=False) as bar:
        trajs, used_horizon = run_checkpoint_episodes(root, k, specs, benchmark, horizon=horizon,
                                                      max_new_tokens=max_new_tokens, device=device,
                                                      env_timeout_s=env_timeout_s, progress=bar.update)
    result = {"checkpoint": k, "benchmark": benchmark, "seed": seed, "games_per_family": games_per_family,
              "variations_per_task": variations_per_task, "split": split,
              "families": sorted({s.category for s in specs if s.category}), "horizon": used_horizon,
              **summarize(trajs), "seconds": time.perf_counter() - t0}
    if benchmark == "searchqa":  # exact match per data source and their average (SAPD.md §6)
        from sapd.envs.searchqa import exact_match_by_source
        result["exact_match"] = exact_match_by_source(trajs)
    write_eval(root, k, benchmark, result, trajs)
    log(f"checkpoint {k}: {benchmark} success {result['overall']['success']:.3f} "
        + " ".join(f"{c}={v['success']:.2f}" for c, v in result["by_category"].items()))
    if metrics is not None:
        metrics.record_eval(benchmark, result["overall"]["success"],
                            {c: v["success"] for c, v in result["by_category"].items()})
        metrics.observe_stage("evaluate", result["seconds"])
    return result
