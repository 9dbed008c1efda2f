"""ALFWorld (text, TextWorld backend) behind the :class:`~sapd.envs.base.Environment` protocol.

Needs, on the machine that runs it, the ``alfworld`` package (``pip install 'sapd[alfworld]'``: alfworld
0.4.2 with ``textworld[pddl]``) and game files in ALFWorld's layout under ``$ALFWORLD_DATA`` (default
``~/.cache/alfworld``) or a folder given explicitly: ``json_2.1.1/<split>/<task>/<trial>/game.tw-pddl``,
from ``alfworld-download`` or generated here (``sapd alfworld-games``, :mod:`sapd.envs.alfworld_games`).
Neither is needed to import this module: ``alfworld`` and ``textworld.gym`` are imported when the first
game starts, and the backend is injectable — any object with ``reset() -> (obs, infos)`` and
``step(cmd) -> (obs, score, done, infos)`` as ``textworld.gym`` returns them (the transcript tests replay
recorded episodes through such a fake).

The real backend is what ALFWorld's own ``AlfredTWEnv`` builds, for one game::

    request_infos = textworld.EnvInfos(won=True, admissible_commands=True, extras=["gamefile"])
    env_id = textworld.gym.register_games([game_file], request_infos, max_episode_steps=…,
                                          wrappers=[AlfredDemangler(shuffle=False), AlfredInfos])
    env = textworld.gym.make(env_id)          # batch_size=None: reset() -> (obs, infos), not lists

plus, for expert collection, ALFWorld's ``AlfredExpert`` wrapper (``extras=["expert_plan"]``) with one of
its two experts: ``planner`` (Fast Downward replans on the full state every step; wins every solvable
game) or ``handcoded`` (ALFWorld's heuristic explorer). The hand-coded expert of alfworld 0.4.x loops after
its own ``move X to Y`` (it still detects placements by the old word "put"); :func:`set_expert_fix` fixes
that at run time, on by default. It draws from Python's global ``random``: each environment keeps its own
seeded state and swaps it in around every engine call, so an episode is reproducible whatever runs
beside it.

Episode: the task is the text after "Your task is to: " in the first observation; observations are
cleaned as ETO's loader cleans them (the task line cut off, an ``Observation:`` prefix dropped, ALFWorld's
pre-0.4 "You arrive at loc N. " dropped as ETO's environment does). Admissible actions come from
``infos["admissible_commands"]``, won from ``infos["won"]``, the category (Pick, Look, Clean, Heat, Cool,
Pick2) from the game file's path. An action in the other ALFWorld wording (``put X in/on Y`` on a 0.4.x
game, ``move X to Y`` on an older one) is translated to the engine's when that makes it admissible, and
reported in the step's ``info["reworded"]`` (the agent loop counts them), never silently scored invalid.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import sys
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Callable, Iterator

from sapd.envs import alfworld_cache
from sapd.envs.base import EpisodeSpec, StepInfo, StepResult
from sapd.method.benchmarks import (
    alfworld_category,
    alfworld_observation,
    alfworld_wording,
    other_alfworld_wording,
    reword_alfworld_action,
)

_TASK_LINE = re.compile(r"Your task is to:\s*(.+)")  # the ETO loader's
DEFAULT_DATA = "~/.cache/alfworld"  # ALFWorld's own default for $ALFWORLD_DATA
# split aliases: the paper's ALFWorld test set is the out-of-distribution one (valid_unseen, 134 games)
SPLITS = {"train": "train", "valid_seen": "valid_seen", "valid_unseen": "valid_unseen",
          "dev": "valid_seen", "eval_in_distribution": "valid_seen",
          "test": "valid_unseen", "eval_out_of_distribution": "valid_unseen"}
EXPERTS = ("handcoded", "planner")
# what `sapd alfworld-games` writes beside the games of a split it generated (sapd.envs.alfworld_games)
GENERATED_MANIFEST = "sapd_games.json"
EXPERT_FIX_NOTE = ("ALFWorld's hand-coded expert runs with sapd's move/put fix: alfworld 0.4.x's "
                   "BasePolicy.update_state_tracking detects a placement by the word 'put', but 0.4.x places with "
                   "'move X to Y', so the unfixed expert keeps believing it holds the object and loops (every "
                   "two-object task fails); the fix hands it 'put X in/on Y' for each 'move X to Y'")
_GET_HELP = ("generate games with 'sapd alfworld-games --out DIR --split SPLIT' or fetch the official ones with "
             "'alfworld-download' (on a machine with internet), then set ALFWORLD_DATA=DIR or pass --alfworld-data DIR")


def data_root(data_dir: str | Path | None = None) -> Path:
    """The ALFWorld data folder: ``data_dir``, else ``$ALFWORLD_DATA`` (read now, not at import), else
    ALFWorld's default ``~/.cache/alfworld``."""
    return Path(data_dir or os.environ.get("ALFWORLD_DATA") or DEFAULT_DATA).expanduser()


def clean_observation(text: str) -> tuple[str, str | None]:
    """(observation, task): the task line ("Your task is to: …") cut off and returned separately, an
    ``Observation:`` prefix dropped, pre-0.4 "You arrive at loc N. " dropped, the rest stripped — the ETO
    loader's and ETO environment's treatment."""
    text = text or ""
    m = _TASK_LINE.search(text)
    task = m.group(1).strip() if m else None
    obs = text[:m.start()] if m else text
    obs = obs.strip()
    if obs.startswith("Observation:"):
        obs = obs[len("Observation:"):].strip()
    return alfworld_observation(obs), task


# ---------------------------------------------------------------------------------------------------
# the hand-coded expert's move/put fix


def set_expert_fix(enabled: bool) -> None:
    """Install (or remove) the runtime fix of ALFWorld 0.4.x's hand-coded expert: its state tracker
    (``BasePolicy.update_state_tracking``) recognises a placement only by ``"put" in last_action``, while
    the 0.4.x grammar (and the expert itself) places with ``move X to Y``. The fix hands the tracker
    ``put X in/on Y`` for such a command; nothing on disk changes. Process-wide (the expert is a class)."""
    from alfworld.agents.expert import handcoded_expert as hc
    current = hc.BasePolicy.update_state_tracking
    original = getattr(current, "_sapd_original", current)
    if not enabled:
        hc.BasePolicy.update_state_tracking = original
        return
    if current is not original:
        return  # already installed

    def update_state_tracking(self: Any, game_state: Any, last_action: str) -> Any:
        if alfworld_wording(last_action or "") == "move":
            last_action = reword_alfworld_action(last_action, "put")
        return original(self, game_state, last_action)

    update_state_tracking._sapd_original = original  # type: ignore[attr-defined]
    hc.BasePolicy.update_state_tracking = update_state_tracking


# ---------------------------------------------------------------------------------------------------
# game files


def read_game(game_file: str | Path) -> dict[str, Any]:
    """A ``game.tw-pddl`` (JSON: pddl_domain, grammar, pddl_problem, solvable …) or one line saying what is
    wrong with it and what to do."""
    p = Path(game_file)
    try:
        data = json.loads(p.read_text(encoding="utf-8"))
    except OSError as e:
        raise FileNotFoundError(f"{p}: cannot read this ALFWorld game file ({e.strerror}); {_GET_HELP}") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"{p}: not an ALFWorld game file (not JSON: {e}); regenerate the split "
                         "('sapd alfworld-games … --overwrite') or download it again ('alfworld-download')") from None
    if not isinstance(data, dict):
        raise ValueError(f"{p}: not an ALFWorld game file (JSON {type(data).__name__}, expected an object with "
                         "pddl_domain, grammar, pddl_problem); regenerate or re-download the split")
    return data


def engine_wording(game: dict[str, Any]) -> str | None:
    """The placement wording a game's grammar speaks: ``move`` (ALFWorld 0.4.x: ``move X to Y``), ``put``
    (earlier: ``put X in/on Y``), or None when the grammar says neither."""
    grammar = str(game.get("grammar", ""))
    if '"move {o} to {r}"' in grammar:
        return "move"
    if '"put {o} in/on {r}"' in grammar:
        return "put"
    return None


@dataclass
class SplitGames:
    """The playable games of a split, and what was left out (ALFWorld's own rules) with the reason."""

    games: list[Path]
    skipped: dict[str, int] = field(default_factory=dict)  # reason → count

    def note(self) -> str | None:
        if not self.skipped:
            return None
        return "skipped " + ", ".join(f"{n} {why}" for why, n in sorted(self.skipped.items()))


def scan_split(data_dir: str | Path | None = None, split: str = "valid_unseen") -> SplitGames:
    """The game files of one split, sorted: ``<data>/json_2.1.1/<split>/<task>/<trial>/game.tw-pddl``,
    skipping what ALFWorld's ``AlfredTWEnv`` skips (movable-receptacle and sliced-object tasks, paths that
    are none of the six categories, games not marked solvable). A missing folder, an empty split or a game
    file that is not JSON is an error naming the path and what to do."""
    root = data_root(data_dir)
    if not root.is_dir():
        raise FileNotFoundError(f"ALFWorld data not found: {root} does not exist; {_GET_HELP}")
    split_dir = root / "json_2.1.1" / SPLITS.get(split, split)
    if not split_dir.is_dir():
        raise FileNotFoundError(f"ALFWorld data not found: {split_dir} does not exist (no {split!r} split in "
                                f"{root}); {_GET_HELP}")
    out = SplitGames([])
    for p in sorted(split_dir.glob("*/*/game.tw-pddl")):
        task_dir = p.parent.parent.name
        if "movable" in task_dir or "Sliced" in task_dir:
            reason = "movable-receptacle or sliced-object tasks (ALFWorld skips them)"
        elif alfworld_category(str(p)) is None:
            reason = "tasks of no ALFWorld category"
        elif not read_game(p).get("solvable"):
            reason = "games not marked solvable (ALFWorld skips them)"
        else:
            out.games.append(p)
            continue
        out.skipped[reason] = out.skipped.get(reason, 0) + 1
    if not out.games:
        raise FileNotFoundError(f"{split_dir}: no playable <task>/<trial>/game.tw-pddl game files"
                                + (f" ({out.note()})" if out.skipped else "") + f"; {_GET_HELP}")
    return out


def split_source(data_dir: str | Path | None = None, split: str = "valid_unseen") -> dict[str, Any] | None:
    """How the games of a split were made, when sapd generated them (``sapd alfworld-games``: its settings
    from the split's manifest, so an evaluation on generated games is never mistaken for one on ALFWorld's
    official split); None for any other folder (the official data)."""
    p = data_root(data_dir) / "json_2.1.1" / SPLITS.get(split, split) / GENERATED_MANIFEST
    if not p.is_file():
        return None
    m = json.loads(p.read_text())
    return {"generated_by": "sapd alfworld-games",
            **{k: m.get(k) for k in ("generator_version", "seed", "per_type", "check_expert")}}


def game_files(data_dir: str | Path | None = None, split: str = "valid_unseen") -> list[Path]:
    """The playable game files of one split (:func:`scan_split`)."""
    return scan_split(data_dir, split).games


# ---------------------------------------------------------------------------------------------------
# the environment


def _expert_type(expert: bool | str | None) -> str | None:
    if expert is True:
        return "handcoded"
    if not expert:
        return None
    if expert not in EXPERTS:
        raise ValueError(f"ALFWorld expert {expert!r}: expected one of {', '.join(EXPERTS)}")
    return str(expert)


def make_backend(game_file: str | Path, max_steps: int = 50, expert: bool | str | None = None,
                 expert_fix: bool = True, engine_cache: bool = True) -> Any:
    """ALFWorld's TextWorld environment for one ``game.tw-pddl`` (needs the ``alfworld`` package);
    ``expert``: ``planner`` | ``handcoded`` (True = handcoded) adds ALFWorld's expert wrapper;
    ``engine_cache``: TextWorld's parses and Fast Downward's translations cached (process-wide,
    :mod:`sapd.envs.alfworld_cache`), else the engine as shipped."""
    try:
        import textworld
        import textworld.gym
        from alfworld.agents.environment.alfred_tw_env import (
            AlfredDemangler,
            AlfredExpert,
            AlfredExpertType,
            AlfredInfos,
        )
    except ImportError as e:  # pragma: no cover - depends on the machine
        raise RuntimeError(f"ALFWorld is not installed ({e}): pip install 'sapd[alfworld]'") from e
    read_game(game_file)  # a one-line error for a bad file, before TextWorld's traceback
    if engine_cache != alfworld_cache.engine_cache_enabled():
        alfworld_cache.set_engine_cache(engine_cache)  # process-wide, as the expert fix; False if unavailable
    kind = _expert_type(expert)
    extras = ["gamefile"]
    wrappers: list[Any] = [AlfredDemangler(shuffle=False), AlfredInfos]
    if kind is not None:
        if kind == "handcoded":
            set_expert_fix(expert_fix)
        extras.append("expert_plan")
        # by keyword: AlfredExpert's first positional parameter is the wrapped env, so
        # AlfredExpert(AlfredExpertType.PLANNER) would silently give the hand-coded expert
        wrappers.append(AlfredExpert(expert_type=AlfredExpertType.PLANNER if kind == "planner"
                                     else AlfredExpertType.HANDCODED))
    infos = textworld.EnvInfos(won=True, admissible_commands=True, extras=extras)
    env_id = textworld.gym.register_games([str(game_file)], infos, max_episode_steps=max_steps,
                                          asynchronous=False, wrappers=wrappers)
    return textworld.gym.make(env_id)


@dataclass
class AlfworldEnv:
    """One ALFWorld game. ``backend``: an already-built textworld-gym-like env (default: built lazily
    from ``game_file`` with :func:`make_backend`). ``expert``: ``planner`` | ``handcoded`` (True =
    handcoded) makes :meth:`expert_action` ALFWorld's expert; ``expert_fix``: the hand-coded expert's
    move/put fix (:func:`set_expert_fix`); ``engine_cache``: the engine's start-up cached
    (:mod:`sapd.envs.alfworld_cache`)."""

    game_file: str | Path
    backend: Any = None
    max_steps: int = 50  # the backend's own limit; the agent loop enforces the benchmark horizon
    expert: bool | str = False
    expert_fix: bool = True
    engine_cache: bool = True
    benchmark: str = "alfworld"
    category: str | None = None  # default: from the game file path
    _task: str = field(default="", repr=False)
    _infos: dict[str, Any] = field(default_factory=dict, repr=False)
    _live: bool = field(default=False, repr=False)
    _random: Any = field(default=None, repr=False)  # this episode's state of the global `random`

    def __post_init__(self) -> None:
        if self.category is None:
            self.category = alfworld_category(str(self.game_file))
        _expert_type(self.expert)  # fail at construction on an unknown expert

    @staticmethod
    def _admissible(infos: dict[str, Any]) -> list[str] | None:
        adm = infos.get("admissible_commands")
        return [str(a) for a in adm] if adm is not None else None

    @contextlib.contextmanager
    def _own_random(self) -> Iterator[None]:
        """Swap this episode's state of the global ``random`` in (ALFWorld's hand-coded expert draws from
        it) and out again."""
        outer = random.getstate()
        random.setstate(self._random)
        try:
            yield
        finally:
            self._random = random.getstate()
            random.setstate(outer)

    def reset(self, seed: int | None = None) -> StepInfo:
        # the game itself is deterministic; the seed seeds the hand-coded expert's draws
        self._random = random.Random(f"{seed or 0}:{Path(self.game_file).parent.parent.name}/"
                                     f"{Path(self.game_file).parent.name}").getstate()
        info: dict[str, Any] = {"game_file": str(self.game_file)}
        if self.backend is None:
            self.backend = make_backend(self.game_file, self.max_steps, self.expert, self.expert_fix,
                                        self.engine_cache)
            info["engine_wording"] = engine_wording(read_game(self.game_file))
        with self._own_random():
            obs, infos = self.backend.reset()
        self._infos, self._live = dict(infos or {}), True
        observation, task = clean_observation(obs)
        if not task:
            raise RuntimeError(f"{self.game_file}: no 'Your task is to: …' in the first observation: {obs[:200]!r}")
        self._task = task
        kind = _expert_type(self.expert)
        if kind is not None:
            info["expert"] = kind + ("+fix" if kind == "handcoded" and self.expert_fix else "")
        return StepInfo(observation=observation, task=task, admissible_actions=self._admissible(self._infos),
                        category=self.category, info={k: v for k, v in info.items() if v is not None})

    def engine_action(self, action: str) -> str:
        """``action`` as the engine takes it: translated to the other ALFWorld wording when it is not
        admissible as written and its translation is."""
        adm = self._admissible(self._infos)
        wording = alfworld_wording(action)
        if adm is None or action in adm or wording is None:
            return action
        other = reword_alfworld_action(action, other_alfworld_wording(wording))
        return other if other in adm else action

    def step(self, action: str) -> StepResult:
        if not self._live:
            raise RuntimeError("step before reset or after the end of the episode")
        sent = self.engine_action(action)
        with self._own_random():
            obs, score, done, infos = self.backend.step(sent)
        self._infos = dict(infos or {})
        won = bool(self._infos.get("won"))
        done = bool(done) or won
        self._live = not done
        observation, _ = clean_observation(obs)
        return StepResult(observation=observation, reward=float(won) if done else 0.0, done=done, won=won,
                          score=float(score or 0), admissible_actions=self._admissible(self._infos),
                          info={"reworded": {"from": action, "to": sent}} if sent != action else {})

    def expert_action(self) -> str | None:
        plan = self._infos.get("extra.expert_plan") or self._infos.get("policy_commands")
        return str(plan[0]) if plan else None

    def close(self) -> None:
        if self.backend is not None:
            close = getattr(self.backend, "close", None)
            try:
                if close is not None:
                    close()
            finally:
                self.backend, self._live = None, False


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def prepare_engine(game_file: str | Path, log: Callable[[str], None] | None = _stderr) -> None:
    """ALFWorld's shared start-up paid once in this process, before environment processes are forked from
    it (``--env-timeout``, :mod:`sapd.envs.isolated`): the engine imported, its caches installed and what
    every game shares parsed (:func:`sapd.envs.alfworld_cache.warm_engine` on ``game_file``'s grammar).
    No game starts here, so nothing can hang outside an episode's deadline. Without ALFWorld installed it
    does nothing (each episode says so); a game whose grammar fails to parse is said in one ``log`` line and
    left to its episodes, which record the error."""
    try:
        import textworld.gym  # noqa: F401 - imported here so that forked environment processes inherit it
        from alfworld.agents.environment import alfred_tw_env  # noqa: F401
    except ImportError:
        return
    try:
        alfworld_cache.warm_engine(read_game(game_file))
    except Exception as e:  # noqa: BLE001 - a warm-up only; the episodes themselves report a broken game
        if log is not None:
            log(f"ALFWorld engine warm-up skipped ({game_file}: {type(e).__name__}: {e})")


def alfworld_specs(data_dir: str | Path | None = None, split: str = "valid_unseen", limit: int | None = None,
                   *, per_category: int | None = None, max_steps: int = 50, expert: bool | str | None = None,
                   expert_fix: bool = True, seed: int = 0, engine_cache: bool = True,
                   log: Callable[[str], None] | None = _stderr) -> list[EpisodeSpec]:
    """One :class:`~sapd.envs.base.EpisodeSpec` per playable game of the split (sorted, so a fixed panel):
    the first ``limit`` overall and the first ``per_category`` of each category; id
    ``alfworld/<task>/<trial>``, category from the path. ``expert`` (``planner`` | ``handcoded``) builds
    environments that can play ALFWorld's expert (what ``sapd collect-expert`` needs); ``seed`` seeds the
    hand-coded expert's draws. ``engine_cache``: the engine's start-up cached and its shared part paid once
    in the process that runs the episodes (:func:`prepare_engine`, each spec's ``prepare``); False plays the
    engine as shipped. Games ALFWorld itself would skip are counted in a ``log`` line."""
    _expert_type(expert)
    scan = scan_split(data_dir, split)
    if log is not None and (note := scan.note()):
        log(f"ALFWorld {split}: {len(scan.games)} playable games; {note}")
    specs: list[EpisodeSpec] = []
    per: dict[str | None, int] = {}
    prepare: Callable[[], None] | None = None  # one for all: the loop runs each distinct one once
    for p in scan.games:
        cat = alfworld_category(str(p))
        if per_category is not None and per.get(cat, 0) >= per_category:
            continue
        per[cat] = per.get(cat, 0) + 1
        if engine_cache and prepare is None:
            prepare = partial(prepare_engine, p, log)
        specs.append(EpisodeSpec(f"alfworld/{p.parent.parent.name}/{p.parent.name}",
                                 partial(AlfworldEnv, p, max_steps=max_steps, expert=expert or False,
                                         expert_fix=expert_fix, engine_cache=engine_cache),
                                 seed=seed, category=cat, prepare=prepare))
        if limit is not None and len(specs) >= limit:
            break
    return specs
