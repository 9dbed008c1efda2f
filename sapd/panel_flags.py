"""The command-line flags that pick an evaluation panel (:class:`sapd.envs.panels.PanelSpec`) and the
environment deadline. Only the front doors that play episodes use them (``sapd evaluate``,
``collect-expert``, ``online``, ``teacher-pool`` and ``python -m sapd.jobs.evaluate``), so the flags name the
panel's fields and leave building it to the caller — ``PanelSpec(**panel_fields(args))`` — and this module
imports no environment: a door that never plays an episode (the train job) never loads one. The
``--benchmark`` and ``--split`` choices are the registered benchmarks' (``sapd.method.benchmarks.BENCHMARKS``),
read when the flags are added.
"""

from __future__ import annotations

import argparse
from typing import Any

from sapd.method.benchmarks import BENCHMARKS, split_names


def _names(value: str | None) -> tuple[str, ...] | None:
    return tuple(f.strip() for f in value.split(",") if f.strip()) if value else None


def add_panel_flags(p: argparse.ArgumentParser, *, benchmark_default: str | None = "textworld") -> None:
    """The flags of :class:`~sapd.envs.panels.PanelSpec` (and the environment deadline)."""
    p.add_argument("--benchmark", default=benchmark_default, choices=sorted(BENCHMARKS))
    p.add_argument("--families", default=None, help="comma-separated TextWorld families (default: all)")
    p.add_argument("--games-per-family", type=int, default=2)
    p.add_argument("--seed", type=int, default=0, help="panel seed: the same seed, the same games")
    p.add_argument("--cache", default=None, help="game cache folder (default .cache/textworld)")
    p.add_argument("--tasks", default=None, help="ScienceWorld: comma-separated task names (default: all 30)")
    p.add_argument("--variations-per-task", type=int, default=2, help="ScienceWorld: variations per task")
    p.add_argument("--split", choices=split_names(), default="test",
                   help="ScienceWorld: which variations to draw from; ALFWorld: train | valid_seen (= dev) | "
                        "valid_unseen (= test, the default)")
    p.add_argument("--rows", default=None, help="search QA: Search-R1 rows (JSONL/Parquet) to ask")
    p.add_argument("--retriever-url", default=None, help="search QA: a Search-R1 /retrieve server")
    p.add_argument("--limit", type=int, default=None, help="search QA / ALFWorld / WebShop: at most this many episodes")
    p.add_argument("--alfworld-data", "--data-dir", dest="data_dir", default=None, metavar="DIR",
                   help="ALFWorld: the data folder holding json_2.1.1/<split>/ (default $ALFWORLD_DATA, else "
                        "~/.cache/alfworld)")
    p.add_argument("--no-engine-cache", dest="engine_cache", action="store_false",
                   help="ALFWorld: start every game as TextWorld ships it (no cached grammar parses or Fast Downward "
                        "translations, nothing parsed ahead of the environment processes); the episodes are the "
                        "same, only slower to start")
    p.add_argument("--webshop-url", default=None, help="WebShop: the server (default http://127.0.0.1:3000)")
    p.add_argument("--env-timeout", type=float, default=300.0, metavar="SECONDS",
                   help="each episode's environment runs in its own process; a call that takes longer is "
                        "killed and the environment rebuilt (default 300; 0 = in-process, no deadline)")


def panel_fields(args: argparse.Namespace, benchmark: str | None = None) -> dict[str, Any]:
    """The :class:`~sapd.envs.panels.PanelSpec` fields of :func:`add_panel_flags`' flags (``benchmark``
    overrides ``--benchmark``)."""
    return dict(benchmark=benchmark or args.benchmark, families=_names(args.families),
                games_per_family=args.games_per_family, seed=args.seed, cache_dir=args.cache,
                tasks=_names(args.tasks), variations_per_task=args.variations_per_task, split=args.split,
                rows=args.rows, retriever_url=args.retriever_url, limit=args.limit, data_dir=args.data_dir,
                alfworld_engine_cache=args.engine_cache, webshop_url=args.webshop_url)


def env_timeout(args: argparse.Namespace) -> float | None:
    return args.env_timeout if args.env_timeout and args.env_timeout > 0 else None
