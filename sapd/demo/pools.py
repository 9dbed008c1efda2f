"""Expert pools of the embedded TextWorld setting: the demo's logs and held-out decisions, and the research
studies' (``research/``) pools.

- :func:`expert_pool` — the environment's expert (clean, or ε-noisy) plays a panel; its won episodes are
  written as native JSONL, a pool ``sapd run`` reads as ``data.input``.
- :func:`read_pool`, :func:`count_trajectories`, :func:`pool_texts` — a pool's trajectories, how many, and
  the text the models will see (to train a tokenizer on).
"""

from __future__ import annotations

import time
from functools import partial
from pathlib import Path
from typing import Any, Callable, Sequence

from sapd.data.loaders import LoadOptions, load_trajectories, write_native_jsonl
from sapd.data.prompts import render_messages
from sapd.data.schema import Trajectory
from sapd.envs.base import EpisodeSpec
from sapd.envs.loop import LoopOptions, ThoughtStyle, collect_expert
from sapd.envs.textworld_env import GameSpec, make_env
from sapd.method.benchmarks import get_benchmark

Progress = Callable[[int], None]  # called with the number of episodes just finished


def warm_textworld(game: GameSpec, cache_dir: str | Path) -> None:
    """Start one game in this process, so that TextWorld's knowledge base is parsed once here: every
    episode environment forked afterwards (``LoopOptions.env_timeout_s``) inherits it instead of parsing it
    again. Measured on 2 busy cores: 40 expert episodes in 149 s cold, 3.8 s warm."""
    env = make_env(game, cache_dir)
    try:
        env.reset()
    finally:
        env.close()


def expert_pool(games: Sequence[GameSpec], cache_dir: str | Path, dest: str | Path, *, noise: float = 0.0,
                noise_seed: int = 0, thought: ThoughtStyle = "announce", horizon: int | None = None,
                env_timeout_s: float | None = None, progress: Progress | None = None) -> dict[str, Any]:
    """The environment's expert plays ``games`` (``noise`` = ε: with probability ε a random other
    admissible action, then it re-plans; see :func:`sapd.envs.loop.collect_expert`); its won episodes go to
    ``dest`` as native JSONL. Returns ``{games, won, decisions, noisy_decisions, seconds}``."""
    t0 = time.perf_counter()
    specs = [EpisodeSpec(f"textworld/{g.game_id}", partial(make_env, g, cache_dir), category=g.family)
             for g in games]
    if env_timeout_s is not None and games:
        warm_textworld(games[0], cache_dir)
    episodes = collect_expert(specs, "textworld", LoopOptions(env_timeout_s=env_timeout_s, horizon=horizon),
                              progress=progress, thought=thought, noise=noise, noise_seed=noise_seed)
    won = [t for t in episodes if t.success]
    Path(dest).parent.mkdir(parents=True, exist_ok=True)
    write_native_jsonl(won, str(dest))
    return {"games": len(games), "won": len(won), "decisions": sum(len(t.turns) for t in won),
            "noisy_decisions": sum(len(t.metadata.get("noisy_turns", [])) for t in won),
            "seconds": time.perf_counter() - t0}


def read_pool(path: str | Path) -> list[Trajectory]:
    """A native JSONL pool's trajectories."""
    return load_trajectories(str(path), "native", LoadOptions("textworld")).trajectories


def count_trajectories(data_input: str | Path) -> int:
    """Trajectories in a pool file, or in every ``*.jsonl`` of a folder of pools."""
    p = Path(data_input)
    return sum(len(read_pool(f)) for f in (sorted(p.glob("*.jsonl")) if p.is_dir() else [p]))


def pool_texts(trajectories: Sequence[Trajectory], history_length: int | None = None) -> list[str]:
    """The text the models will see, to train their tokenizer on: every step prompt of the pool (as the
    prefix builder renders it) and every expert response."""
    spec = get_benchmark("textworld")
    texts: list[str] = []
    for traj in trajectories:
        for t, turn in enumerate(traj.turns):
            texts.extend(m["content"] for m in render_messages(traj, t, spec, history_length or spec.history_length))
            texts.append(turn.response)
    return texts
