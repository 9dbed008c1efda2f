"""Evaluation panels: a fixed, seeded set of episodes of one benchmark (:class:`~sapd.envs.panels.PanelSpec` →
:func:`~sapd.envs.panels.episode_specs`). The same panel gives the same episodes, so the same checkpoint gives the same
numbers; evaluation, expert collection, teacher pools, the online baselines and the study all take
their episodes from here.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from pathlib import Path

from sapd.envs.alfworld_env import SPLITS as ALFWORLD_SPLITS
from sapd.envs.alfworld_env import alfworld_specs
from sapd.envs.base import EpisodeSpec
from sapd.envs.scienceworld_env import scienceworld_specs
from sapd.envs.searchqa import searchqa_specs
from sapd.envs.textworld_env import DEFAULT_CACHE, default_panel, ensure_panel, make_env
from sapd.envs.webshop_env import DEFAULT_URL, webshop_specs

PANEL_BENCHMARKS = ("textworld", "scienceworld", "searchqa", "alfworld", "webshop")


@dataclass
class PanelSpec:
    """Which episodes of ``benchmark`` to play. Each benchmark reads its own fields; the others are ignored."""

    benchmark: str
    # TextWorld: generated games, `games_per_family` of each family, seeded (cached under cache_dir)
    families: tuple[str, ...] | None = None  # None = the default families
    games_per_family: int = 2
    seed: int = 0  # TextWorld game seeds; WebShop: the first goal index
    cache_dir: str | None = None
    # ScienceWorld: (task, variation) pairs
    tasks: tuple[str, ...] | None = None  # None = every task
    variations_per_task: int = 2
    split: str = "test"  # ScienceWorld variations; ALFWorld: test = valid_unseen (recorded as valid_unseen)
    # search QA: Search-R1 question rows asked against a retriever speaking the /retrieve API
    rows: str | None = None
    retriever_url: str | None = None
    # ALFWorld game files ($ALFWORLD_DATA or this folder); WebShop server
    data_dir: str | None = None
    # ALFWorld: the expert the environments carry (collect-expert): planner | handcoded, None = none; the
    # hand-coded expert's move/put fix (sapd.envs.alfworld_env.set_expert_fix)
    alfworld_expert: str | None = None
    alfworld_expert_fix: bool = True
    # ALFWorld: the engine's start-up cached and paid once per process (sapd.envs.alfworld_cache); False =
    # TextWorld as shipped. Episodes are the same either way (tested), so it is not part of the identity
    alfworld_engine_cache: bool = True
    webshop_url: str | None = None
    limit: int | None = None  # search QA / ALFWorld / WebShop: at most this many episodes
    per_source: int | None = None  # search QA: per data source; ALFWorld: per category

    def recorded_split(self) -> str | None:
        """The split as the benchmark itself names it, which an evaluation file records: ScienceWorld's
        variation sets (train, dev, test), ALFWorld's folders (an alias such as ``test`` is recorded as the
        folder it reads, ``valid_unseen``); None for benchmarks without splits (TextWorld's generated
        games, search QA's rows, WebShop's goals)."""
        if self.benchmark == "scienceworld":
            return self.split
        if self.benchmark == "alfworld":
            return ALFWORLD_SPLITS.get(self.split, self.split)
        return None

    def identity(self) -> dict[str, object]:
        """The fields an evaluation file records, to refuse a re-evaluation on another panel."""
        out: dict[str, object] = {"seed": self.seed, "games_per_family": self.games_per_family}
        if self.benchmark == "textworld" and self.families is not None:
            out["families"] = sorted(self.families)
        if self.benchmark == "scienceworld":
            out.update(variations_per_task=self.variations_per_task, split=self.recorded_split())
        if self.benchmark == "alfworld":
            out.update(split=self.recorded_split())
        return out

    def identity_of(self, record: dict[str, object]) -> dict[str, object]:
        """:meth:`identity`'s fields as an evaluation file recorded them; an ALFWorld split that an older
        file recorded by its alias (``test``) reads as the folder it named (``valid_unseen``)."""
        out = {key: record.get(key) for key in self.identity()}
        if self.benchmark == "alfworld" and isinstance(out.get("split"), str):
            out["split"] = ALFWORLD_SPLITS.get(str(out["split"]), out["split"])
        return out


def textworld_specs(families: list[str] | tuple[str, ...] | None, games_per_family: int, seed: int,
                    cache_dir: str | Path | None = None) -> list[EpisodeSpec]:
    """The fixed TextWorld panel as episodes (games generated once into the cache)."""
    cache = Path(cache_dir or DEFAULT_CACHE)
    panel = default_panel(games_per_family, list(families) if families is not None else None, seed)
    ensure_panel(panel, cache)
    return [EpisodeSpec(f"textworld/{g.game_id}", partial(make_env, g, cache), category=g.family)
            for g in panel]


def episode_specs(panel: PanelSpec) -> list[EpisodeSpec]:
    """The episodes of ``panel`` (the environments' packages are imported only for their benchmark)."""
    b = panel.benchmark
    if b == "textworld":
        return textworld_specs(panel.families, panel.games_per_family, panel.seed, panel.cache_dir)
    if b == "scienceworld":
        return scienceworld_specs(list(panel.tasks) if panel.tasks else None, panel.variations_per_task, panel.seed,
                                  panel.split)  # type: ignore[arg-type]  # checked by scienceworld_panel
    if b == "searchqa":
        if not (panel.rows and panel.retriever_url):
            raise ValueError("search QA needs --rows (Search-R1 rows) and --retriever-url "
                             "(e.g. sapd retriever --corpus corpus.jsonl --port 8000)")
        return searchqa_specs(panel.rows, panel.retriever_url, panel.limit, per_source=panel.per_source)
    if b == "alfworld":  # game files: data_dir, else $ALFWORLD_DATA (alfworld-download or sapd alfworld-games)
        return alfworld_specs(panel.data_dir, ALFWORLD_SPLITS.get(panel.split, panel.split), panel.limit,
                              per_category=panel.per_source, expert=panel.alfworld_expert,
                              expert_fix=panel.alfworld_expert_fix, seed=panel.seed,
                              engine_cache=panel.alfworld_engine_cache)
    if b == "webshop":  # a running WebShop server
        return webshop_specs(panel.webshop_url or DEFAULT_URL, panel.limit, start=panel.seed)
    raise ValueError(f"no environment for benchmark '{b}': expected one of {', '.join(PANEL_BENCHMARKS)}")
