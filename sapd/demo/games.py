"""Games of the embedded TextWorld setting, built from nothing: the demo's first step, and the research
studies' (``research/``) too.

- :func:`panels` — seeded panels of :class:`~sapd.envs.textworld_env.GameSpec`, refused when two share a game.
- :func:`generate_games` — every missing game of a panel generated in ``workers`` processes with TextWorld's
  own generator, called in process the way ``tw-make`` calls it: the same challenge, arguments and seed
  give the same ``.z8`` file as :func:`sapd.envs.textworld_env.ensure_game` (tested), several times faster,
  since one ``tw-make`` process per game spends most of its 3.4 s starting Python and TextWorld.

This module imports no model code (no torch): the worker processes that import it start in a second.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from functools import partial
from multiprocessing import get_context
from pathlib import Path
from typing import Callable, Sequence

from sapd.envs.textworld_env import FAMILIES, GameSpec, default_panel, game_path

Progress = Callable[[int], None]  # called with the number of items just finished


def panels(spec: dict[str, tuple[int, Sequence[str], int]]) -> dict[str, list[GameSpec]]:
    """``{name: (games per family, families, first seed)}`` → ``{name: panel}``; a game in two panels is an
    error (move a seed)."""
    out = {name: default_panel(n, list(families), seed) for name, (n, families, seed) in spec.items()}
    seen: dict[str, str] = {}
    for name, games in out.items():
        for g in games:
            if g.game_id in seen:
                raise ValueError(f"panels '{seen[g.game_id]}' and '{name}' share game {g.game_id}: move a seed")
            seen[g.game_id] = name
    return out


def missing_games(games: Sequence[GameSpec], cache_dir: str | Path) -> list[GameSpec]:
    """The games of ``games`` not yet generated into ``cache_dir`` (each once, in order)."""
    def generated(spec: GameSpec) -> bool:
        path = game_path(spec, cache_dir)
        return path.is_file() and path.with_suffix(".json").is_file()
    return [g for g in dict.fromkeys(games) if not generated(g)]


def _generate_one(spec: GameSpec, cache_dir: str) -> float:
    """One game, generated in this process as ``tw-make <challenge> <args> --seed S`` generates it (the
    arguments are :data:`~sapd.envs.textworld_env.FAMILIES`'s); written to a temporary folder, then the
    ``.json`` and the ``.z8`` moved into place, so a present ``.z8`` always has its description."""
    import textworld
    import textworld.challenges

    t0 = time.perf_counter()
    challenge, *args = FAMILIES[spec.family]
    if challenge not in textworld.challenges.CHALLENGES:
        raise ValueError(f"{spec.family}: {challenge} is not a TextWorld challenge")
    _, make_game, add_arguments = textworld.challenges.CHALLENGES[challenge]
    parser = argparse.ArgumentParser(prog=challenge)
    add_arguments(parser)
    if challenge == "tw-cooking":
        args += ["--recipe-seed", str(spec.seed)]
    out = game_path(spec, cache_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=".gen-") as tmp:
        target = Path(tmp).resolve() / "game.z8"
        # the settings tw-make passes (some challenges record them in the game): its flags, then the challenge's
        settings = {"third_party": None, "subcommand": challenge, **vars(parser.parse_args(args)),
                    "output": str(target), "seed": spec.seed, "format": "z8", "overview": False,
                    "save_overview": False, "force": True, "silent": True, "verbose": False}
        options = textworld.GameOptions()
        options.seeds = spec.seed
        options.path = str(target)
        options.file_ext = ".z8"
        options.force_recompile = True
        game = make_game(settings=settings, options=options)
        textworld.generator.compile_game(game, options)
        os.replace(target.with_suffix(".json"), out.with_suffix(".json"))
        os.replace(target, out)
    return time.perf_counter() - t0


def _single_threaded() -> None:
    os.environ["OMP_NUM_THREADS"] = "1"


def generate_games(games: Sequence[GameSpec], cache_dir: str | Path, *, workers: int = 2,
                   progress: Progress | None = None) -> int:
    """Generate every game of ``games`` not yet in ``cache_dir``, in ``workers`` processes; returns how many
    were generated. ``progress(n)`` is called as games finish."""
    todo = missing_games(games, cache_dir)
    if not todo:
        return 0
    cache = str(Path(cache_dir).resolve())
    if workers <= 1:
        for g in todo:
            _generate_one(g, cache)
            if progress:
                progress(1)
        return len(todo)
    with ProcessPoolExecutor(workers, mp_context=get_context("spawn"), initializer=_single_threaded) as pool:
        for _ in pool.map(partial(_generate_one, cache_dir=cache), todo):
            if progress:
                progress(1)
    return len(todo)
