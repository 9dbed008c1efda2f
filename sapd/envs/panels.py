"""Evaluation panels: a fixed, seeded set of episodes of one benchmark (:class:`~sapd.envs.panels.PanelSpec` →
:func:`~sapd.envs.panels.episode_specs`). The same panel gives the same episodes, so the same checkpoint gives the same
numbers; evaluation, expert collection, teacher pools, the online baselines and the study all take
their episodes from here.

Each benchmark's panel is one row of ``PANELS`` (:class:`Panel`: how its adapter's episodes are built from a
:class:`PanelSpec`, which fields an evaluation records, its split aliases), keyed by the name of its
:class:`~sapd.method.benchmarks.BenchmarkSpec`; :func:`register_panel` adds one from outside
(docs/guides/new-benchmark.md).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

from sapd.envs.alfworld_env import SPLITS as ALFWORLD_SPLITS
from sapd.envs.alfworld_env import alfworld_specs
from sapd.envs.base import EpisodeSpec
from sapd.envs.scienceworld_env import scienceworld_specs
from sapd.envs.searchqa import searchqa_specs
from sapd.envs.textworld_env import DEFAULT_CACHE, default_panel, ensure_panel, make_env
from sapd.envs.webshop_env import DEFAULT_URL, webshop_specs
from sapd.method.benchmarks import BENCHMARKS


@dataclass
class PanelSpec:
    """Which episodes of ``benchmark`` to play. Each benchmark reads its own fields; the others are ignored.
    A new benchmark's panel reads the shared ones: ``seed``, ``split``, ``limit``, ``per_source``, ``data_dir``."""

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
        games, search QA's rows, WebShop's goals: their spec names no ``splits``)."""
        spec = BENCHMARKS.get(self.benchmark)
        if spec is None or not spec.splits:
            return None
        return _aliases(self.benchmark).get(self.split, self.split)

    def identity(self) -> dict[str, object]:
        """The fields an evaluation file records, to refuse a re-evaluation on another panel: the seed, the
        games per family and the panel's :attr:`Panel.identity` fields (a split as recorded, a tuple sorted,
        None left out)."""
        out: dict[str, object] = {"seed": self.seed, "games_per_family": self.games_per_family}
        panel = PANELS.get(self.benchmark)
        for key in panel.identity if panel is not None else ():
            value = self.recorded_split() if key == "split" else getattr(self, key)
            if value is not None:
                out[key] = sorted(value) if isinstance(value, tuple) else value
        return out

    def identity_of(self, record: dict[str, object]) -> dict[str, object]:
        """:meth:`identity`'s fields as an evaluation file recorded them; an ALFWorld split that an older
        file recorded by its alias (``test``) reads as the folder it named (``valid_unseen``)."""
        out = {key: record.get(key) for key in self.identity()}
        aliases = _aliases(self.benchmark)
        if aliases and isinstance(out.get("split"), str):
            out["split"] = aliases.get(str(out["split"]), out["split"])
        return out


@dataclass(frozen=True)
class Panel:
    """A benchmark's panel: ``build`` turns a :class:`PanelSpec` into its environment adapter's episodes (importing
    the simulator only then); ``identity`` names the :class:`PanelSpec` fields, besides the seed and the games
    per family, that an evaluation file records (``split`` as :meth:`PanelSpec.recorded_split` gives it);
    ``split_aliases`` maps a ``--split`` name to the split it reads and records (ALFWorld's ``test`` →
    ``valid_unseen``)."""

    build: Callable[[PanelSpec], list[EpisodeSpec]]
    identity: tuple[str, ...] = ()
    split_aliases: Mapping[str, str] = field(default_factory=dict)


def _aliases(benchmark: str) -> Mapping[str, str]:
    panel = PANELS.get(benchmark)
    return panel.split_aliases if panel is not None else {}


def textworld_specs(families: list[str] | tuple[str, ...] | None, games_per_family: int, seed: int,
                    cache_dir: str | Path | None = None) -> list[EpisodeSpec]:
    """The fixed TextWorld panel as episodes (games generated once into the cache)."""
    cache = Path(cache_dir or DEFAULT_CACHE)
    panel = default_panel(games_per_family, list(families) if families is not None else None, seed)
    ensure_panel(panel, cache)
    return [EpisodeSpec(f"textworld/{g.game_id}", partial(make_env, g, cache), category=g.family)
            for g in panel]


def _textworld(panel: PanelSpec) -> list[EpisodeSpec]:
    return textworld_specs(panel.families, panel.games_per_family, panel.seed, panel.cache_dir)


def _scienceworld(panel: PanelSpec) -> list[EpisodeSpec]:
    return scienceworld_specs(list(panel.tasks) if panel.tasks else None, panel.variations_per_task, panel.seed,
                              panel.split)  # type: ignore[arg-type]  # checked by scienceworld_panel


def _searchqa(panel: PanelSpec) -> list[EpisodeSpec]:
    if not (panel.rows and panel.retriever_url):
        raise ValueError("search QA needs --rows (Search-R1 rows) and --retriever-url "
                         "(e.g. sapd retriever --corpus corpus.jsonl --port 8000)")
    return searchqa_specs(panel.rows, panel.retriever_url, panel.limit, per_source=panel.per_source)


def _alfworld(panel: PanelSpec) -> list[EpisodeSpec]:
    # game files: data_dir, else $ALFWORLD_DATA (alfworld-download or sapd alfworld-games)
    return alfworld_specs(panel.data_dir, ALFWORLD_SPLITS.get(panel.split, panel.split), panel.limit,
                          per_category=panel.per_source, expert=panel.alfworld_expert,
                          expert_fix=panel.alfworld_expert_fix, seed=panel.seed,
                          engine_cache=panel.alfworld_engine_cache)


def _webshop(panel: PanelSpec) -> list[EpisodeSpec]:  # a running WebShop server
    return webshop_specs(panel.webshop_url or DEFAULT_URL, panel.limit, start=panel.seed)


# benchmark name (its BenchmarkSpec's) → its panel
PANELS: dict[str, Panel] = {
    "textworld": Panel(_textworld, identity=("families",)),
    "scienceworld": Panel(_scienceworld, identity=("variations_per_task", "split")),
    "searchqa": Panel(_searchqa),
    "alfworld": Panel(_alfworld, identity=("split",), split_aliases=ALFWORLD_SPLITS),
    "webshop": Panel(_webshop),
}


def register_panel(benchmark: str, panel: Panel) -> Panel:
    """Add ``panel`` as the panel of the registered benchmark ``benchmark``
    (:func:`sapd.method.benchmarks.register_benchmark` first): from then on ``sapd evaluate``,
    ``collect-expert``, ``teacher-pool``, ``online`` and the evaluation job play it."""
    if benchmark not in BENCHMARKS:
        raise ValueError(f"no benchmark {benchmark!r} is registered: register its spec first "
                         "(sapd.method.benchmarks.register_benchmark)")
    if benchmark in PANELS:
        raise ValueError(f"benchmark {benchmark!r} has a panel already")
    PANELS[benchmark] = panel
    return panel


def episode_specs(panel: PanelSpec) -> list[EpisodeSpec]:
    """The episodes of ``panel`` (the environments' packages are imported only for their benchmark)."""
    entry = PANELS.get(panel.benchmark)
    if entry is None:
        raise ValueError(f"no environment for benchmark '{panel.benchmark}': expected one of {', '.join(PANELS)}")
    return entry.build(panel)
