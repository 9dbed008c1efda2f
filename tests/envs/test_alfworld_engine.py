"""ALFWorld on its own engine (alfworld 0.4.2, TextWorld's PDDL backend): games generated here with
``sapd alfworld-games`` and checked by ALFWorld's ``alfworld-generate``, the adapter's observations and
commands on them (checked by hand), both placement wordings, ALFWorld's two experts, and the one-line
errors for bad ``ALFWORLD_DATA``. The six quick games are generated once into ``.cache/alfworld-games/``
(tests/alfworld_util.py); the expert win rates are slow tests."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
from alfworld.agents.environment.alfred_tw_env import AlfredTWEnv

from sapd.cli import main
from sapd.envs import alfworld_cache
from sapd.envs.alfworld_env import AlfworldEnv, alfworld_specs, clean_observation, read_game
from sapd.envs.alfworld_games import SPLITS, TASK_TYPES, candidates, generate_split
from sapd.envs.base import EpisodeSpec
from sapd.envs.loop import LoopOptions, run_episodes, summarize
from sapd.models.generation import Sample
from sapd.progress import Progress
from tests.alfworld_util import generated_games, generated_type
from tests.tokenizer_util import build_test_tokenizer

PICK = "pick_and_place_simple-Box-None-DiningTable-203"
LOOK = "look_at_obj_in_light-Book-None-DeskLamp-305"
# the six games of seed 0 (one per task type) and their categories, read off by hand
SIX = {LOOK: "Look", PICK: "Pick", "pick_clean_then_place_in_recep-Bowl-None-DiningTable-4": "Clean",
       "pick_cool_then_place_in_recep-Cup-None-CounterTop-3": "Cool",
       "pick_heat_then_place_in_recep-Cup-None-Cabinet-1": "Heat",
       "pick_two_obj_and_place-KeyChain-None-SideTable-303": "Pick2"}


@pytest.fixture(scope="module")
def games() -> Path:
    return generated_games("valid_unseen", per_type=1, seed=0)


def _game(root: Path, folder: str) -> Path:
    (p,) = (root / "json_2.1.1" / "valid_unseen" / folder).glob("trial_*/game.tw-pddl")
    return p


# ---------------------------------------------------------------------------------------------------
# the generated games


def test_generated_split_is_alfworlds_layout_and_alfworld_itself_lists_it(games):
    sdir = games / "json_2.1.1" / "valid_unseen"
    files = sorted(sdir.glob("*/*/game.tw-pddl"))
    assert {p.parent.parent.name for p in files} == set(SIX)
    for p in files:
        game, traj = read_game(p), json.loads((p.parent / "traj_data.json").read_text())
        assert game["solvable"] is True and game["walkthrough"], p  # set by alfworld-generate
        assert "UNKNOWN GOAL" not in game["grammar"] and '"move {o} to {r}"' in game["grammar"]
        assert traj["task_type"] == p.parent.parent.name.split("-")[0]
        assert traj["pddl_params"]["object_target"] == p.parent.parent.name.split("-")[1]
        assert "NOT the official" in game["sapd_generated"]["notice"] == traj["sapd_generated"]["notice"]
        assert (p.parent / "initial_state.pddl").read_text().startswith("(define (problem plan_trial_T")
    manifest = json.loads((sdir / "sapd_games.json").read_text())
    assert (manifest["seed"], manifest["per_type"], len(manifest["games"])) == (0, 1, 6)
    assert "alfworld-download" in (games / "README.md").read_text()
    # ALFWorld's own environment class finds exactly these games (it skips any not marked solvable)
    config = {"env": {"goal_desc_human_anns_prob": 0, "task_types": [1, 2, 3, 4, 5, 6]},
              "dataset": {"eval_ood_data_path": str(sdir), "num_eval_games": -1}}
    assert sorted(AlfredTWEnv(config, "eval_out_of_distribution").game_files) == [str(p) for p in files]


def test_splits_are_disjoint_and_every_type_has_tasks():
    by_split = {s: [t for tt in TASK_TYPES for t in candidates(s, tt)] for s in SPLITS}
    for s, tasks in by_split.items():
        assert {t.task_type for t in tasks} == set(TASK_TYPES), s
    unseen_scenes = {t.scene for t in by_split["valid_unseen"]}
    assert unseen_scenes == {1, 2, 3, 4, 5, 6, 201, 202, 203, 204, 205, 206, 301, 302, 303, 304, 305, 306,
                             401, 402, 403, 404, 405, 406} & unseen_scenes  # ALFRED's test floor plans only
    assert unseen_scenes.isdisjoint(t.scene for t in by_split["train"] + by_split["valid_seen"])
    train_pairs = {(t.scene, t.obj) for t in by_split["train"]}
    assert train_pairs.isdisjoint((t.scene, t.obj) for t in by_split["valid_seen"])


def test_generation_is_deterministic_resumable_and_shows_progress(games, tmp_path):
    lines: list[str] = []
    # a log's lines at every update (every=0): what is printed follows the work, never the machine's pace (a
    # line every half second once missed the first game on a fast machine)
    generate_split(tmp_path, "valid_unseen", 1, 0, task_types=("pick_and_place_simple",), log=lines.append,
                   progress=Progress(lines.append, mode="lines", every=0))
    ours = _game(tmp_path, PICK)
    assert ours.read_bytes() == _game(games, PICK).read_bytes()  # same seed, same game, byte for byte
    assert (ours.parent / "initial_state.pddl").read_bytes() == (_game(games, PICK).parent / "initial_state.pddl").read_bytes()
    # in a log, progress comes as plain lines with counts, the time so far and, at the end, the total
    assert any(re.fullmatch(r"alfworld-games valid_unseen: 1/1 game \(100%\), \d+:\d\d elapsed(, ETA 0:00)?", s)
               for s in lines), lines
    assert any(re.fullmatch(r"alfworld-games valid_unseen: 1/1 game \(100%\), \d+:\d\d in all", s) for s in lines), lines
    assert not any("\r" in s for s in lines)
    before = ours.stat().st_mtime_ns
    lines.clear()
    generate_split(tmp_path, "valid_unseen", 1, 0, task_types=("pick_and_place_simple",), log=lines.append)
    assert "already generated" in lines[0] and ours.stat().st_mtime_ns == before
    with pytest.raises(ValueError, match=r"holds games generated with other settings \(seed 0.*--overwrite"):
        generate_split(tmp_path, "valid_unseen", 1, 7, log=lines.append)
    official = tmp_path / "official"
    (official / "json_2.1.1" / "valid_unseen" / "some-task").mkdir(parents=True)
    with pytest.raises(ValueError, match="files sapd did not generate"):
        generate_split(official, "valid_unseen", 1, 0, log=lines.append)


# ---------------------------------------------------------------------------------------------------
# the adapter on the real engine


def test_adapter_first_observation_commands_and_categories_by_hand(games):
    specs = alfworld_specs(games, "test")  # test = valid_unseen
    assert {s.id.split("/")[1]: s.category for s in specs} == SIX
    env = AlfworldEnv(_game(games, PICK))
    first = env.reset()
    assert first.observation == (
        "-= Welcome to TextWorld, ALFRED! =-\n\nYou are in the middle of a room. Looking quickly around you, you see "
        "a armchair 1, a coffeetable 1, a diningtable 1, a drawer 6, a drawer 5, a drawer 4, a drawer 3, a drawer 2, "
        "a drawer 1, a garbagecan 1, a ottoman 1, a sidetable 1, and a sofa 1.")
    assert first.task == "put some box on diningtable."
    assert first.category == "Pick" and first.info["engine_wording"] == "move"
    assert first.admissible_actions == [
        "go to armchair 1", "go to coffeetable 1", "go to diningtable 1", "go to drawer 1", "go to drawer 2",
        "go to drawer 3", "go to drawer 4", "go to drawer 5", "go to drawer 6", "go to garbagecan 1",
        "go to ottoman 1", "go to sidetable 1", "go to sofa 1", "help", "inventory", "look"]
    res = env.step("go to armchair 1")
    assert res.observation == ("You arrive at armchair 1. On the armchair 1, you see a box 1, a creditcard 2, and a "
                               "remotecontrol 1.")
    assert "take box 1 from armchair 1" in res.admissible_actions and not res.done
    assert env.step("take box 1 from armchair 1").observation == "You pick up the box 1 from the armchair 1."
    assert env.step("put box 1 in/on the moon").observation == "Nothing happens."
    env.step("go to diningtable 1")
    res = env.step("move box 1 to diningtable 1")
    assert (res.observation, res.done, res.won, res.reward) == ("You move the box 1 to the diningtable 1.", True, True, 1.0)
    env.close()
    look = AlfworldEnv(_game(games, LOOK))
    first = look.reset()
    assert first.task == "examine the book with the desklamp." and first.category == "Look"
    assert [look.step(a).observation for a in ("go to dresser 1", "use desklamp 1")] == [
        "You arrive at dresser 1. On the dresser 1, you see a book 2, a bowl 2, a desklamp 1, a keychain 2, "
        "a laptop 1, and a mug 2.", "You turn on the desklamp 1."]
    assert look.step("take book 2 from dresser 1").won
    look.close()


class _Scripted:
    """A generator that answers every step with the next of ``actions`` in sapd's response format."""

    def __init__(self, actions: list[str]) -> None:
        self.actions = actions
        self.k = 0

    def generate(self, prompts, params, progress=None):
        out = [[Sample(token_ids=[], logprobs=[], text=f"<think>next</think>\n<action>{self.actions[self.k]}</action>",
                       finish_reason="stop")] for _ in prompts]
        self.k += 1
        return out


def test_the_eto_wording_is_played_translated_and_counted_not_invalid(games, tmp_path_factory):
    """A model trained on ETO-era records says "put X in/on Y"; the 0.4.x engine knows "move X to Y"."""
    game = _game(games, PICK)
    walkthrough = read_game(game)["walkthrough"]
    assert walkthrough[-1] == "move box 1 to diningtable 1"
    actions = [*walkthrough[:-1], "put box 1 in/on diningtable 1"]
    spec = EpisodeSpec("alfworld/pick", lambda: AlfworldEnv(game))
    tok = build_test_tokenizer(tmp_path_factory.mktemp("tok"))
    (traj,) = run_episodes([spec], _Scripted(actions), tok, "alfworld", opts=LoopOptions())
    assert traj.success and [t.action for t in traj.turns] == actions  # recorded as the model wrote it
    meta = traj.metadata
    assert (meta["reworded_steps"], meta["inadmissible_steps"], meta["invalid_steps"]) == (1, 0, 0)
    assert summarize([traj])["overall"]["reworded_steps"] == 1
    # and ETO's observation treatment of pre-0.4 games
    assert clean_observation("You arrive at loc 16. The cabinet 1 is closed.") == ("The cabinet 1 is closed.", None)


# ---------------------------------------------------------------------------------------------------
# the engine's start-up paid once (sapd.envs.alfworld_cache): the same episodes, cold, warm, forked


@pytest.fixture
def engine_cache():
    """The caches off before and after (process-wide state: other tests start from the engine as shipped)."""
    alfworld_cache.set_engine_cache(False)
    yield alfworld_cache
    alfworld_cache.set_engine_cache(False)


def _episode(game: Path, engine_cache: bool) -> list[tuple]:
    """The planner's episode on ``game``, with a command the engine does not know first: every observation,
    admissible list, reward and outcome."""
    env = AlfworldEnv(game, expert="planner", engine_cache=engine_cache)
    first = env.reset()
    out: list[tuple] = [(first.observation, first.task, first.admissible_actions, env.expert_action())]
    action: str | None = "put box 1 in/on the moon"
    while action is not None and len(out) <= 50:
        res = env.step(action)
        out.append((action, res.observation, res.admissible_actions, res.reward, res.done, res.won,
                    env.expert_action()))
        action = None if res.done else env.expert_action()
    env.close()
    return out


def test_cached_engine_plays_the_same_episode_cold_and_warm_and_leaves_argv_alone(games, engine_cache, tmp_path,
                                                                                  monkeypatch):
    game = _game(games, PICK)
    monkeypatch.setattr(sys, "argv", ["pytest-argv"])  # TextWorld's translation, as shipped, overwrites it
    shipped = _episode(game, engine_cache=False)
    assert shipped[-1][5] is True and len(shipped) > 3  # won, after the unknown command ("Nothing happens.")
    assert shipped[1][1] == "Nothing happens."
    sys.argv = ["pytest-argv"]
    cache = tmp_path / "engine-cache"
    engine_cache.set_engine_cache(True, cache)
    cold = _episode(game, engine_cache=True)
    stats = engine_cache.stats()
    # load and reset each translate the problem plain and optimised: translated once, then from memory
    assert (stats.translations, stats.memory_hits, stats.disk_hits) == (2, 2, 0)
    assert stats.parses()["textgen"]["hits"] > stats.parses()["textgen"]["misses"] > 0  # templates parsed once
    files = sorted(cache.rglob("*.sas.gz"))
    assert len(files) == 2 and all(f.parent.parent.name == engine_cache.engine_versions() for f in files)
    assert "textworld-1.7.0" in engine_cache.engine_versions()
    engine_cache.set_engine_cache(False)  # a new process: nothing in memory, the folder warm
    engine_cache.set_engine_cache(True, cache)
    warm = _episode(game, engine_cache=True)
    assert (engine_cache.stats().translations, engine_cache.stats().disk_hits) == (0, 2)
    assert shipped == cold == warm
    assert sys.argv == ["pytest-argv"] and not engine_cache.stats().disk_errors


def test_cached_translation_equals_fast_downwards_own(games, engine_cache, tmp_path, monkeypatch):
    import pickle

    import fast_downward
    game = read_game(_game(games, LOOK))
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    shipped = {opt: fast_downward.pddl2sas(game["pddl_domain"], game["pddl_problem"], optimize=opt)
               for opt in (False, True)}
    engine_cache.set_engine_cache(True, tmp_path)
    for _ in range(2):  # translated, then from memory
        for opt in (False, True):
            task, sas = fast_downward.pddl2sas(game["pddl_domain"], game["pddl_problem"], optimize=opt)
            assert sas == shipped[opt][1] and pickle.dumps(task) == pickle.dumps(shipped[opt][0])
    engine_cache.set_engine_cache(False)
    engine_cache.set_engine_cache(True, tmp_path)
    task, sas = fast_downward.pddl2sas(game["pddl_domain"], game["pddl_problem"], optimize=True)  # from disk
    assert sas == shipped[True][1] and pickle.dumps(task) == pickle.dumps(shipped[True][0])
    assert engine_cache.stats().disk_hits == 1


def test_a_corrupt_cache_file_is_translated_again_and_an_unwritable_folder_says_so_once(games, engine_cache, tmp_path,
                                                                                        capsys):
    import fast_downward
    game = read_game(_game(games, LOOK))
    domain, problem = game["pddl_domain"], game["pddl_problem"]
    engine_cache.set_engine_cache(True, tmp_path / "cache")
    _, sas = fast_downward.pddl2sas(domain, problem)
    (path,) = (tmp_path / "cache").rglob("*.sas.gz")
    path.write_bytes(path.read_bytes()[:100])  # cut short (a full disk, a killed writer)
    engine_cache.set_engine_cache(False)
    engine_cache.set_engine_cache(True, tmp_path / "cache")
    assert fast_downward.pddl2sas(domain, problem)[1] == sas
    stats = engine_cache.stats()
    assert (stats.translations, stats.disk_hits) == (1, 0) and str(path) in stats.disk_errors[0]
    engine_cache.set_engine_cache(False)
    engine_cache.set_engine_cache(True, tmp_path / "cache")
    assert fast_downward.pddl2sas(domain, problem)[1] == sas and engine_cache.stats().disk_hits == 1  # rewritten
    # another engine version never reads this translation
    engine_cache.set_engine_cache(False)
    engine_cache.set_engine_cache(True, tmp_path / "cache")
    real = engine_cache.engine_versions()
    monkeypatch = pytest.MonkeyPatch()
    monkeypatch.setattr(engine_cache, "engine_versions", lambda: real.replace("textworld-1.7.0", "textworld-1.7.1"))
    try:
        assert fast_downward.pddl2sas(domain, problem)[1] == sas and engine_cache.stats().translations == 1
    finally:
        monkeypatch.undo()
    # a folder that cannot be written: the translation still comes back, one line says so, once
    (tmp_path / "a-file").write_text("")
    engine_cache.set_engine_cache(False)
    engine_cache.set_engine_cache(True, tmp_path / "a-file" / "cache")
    capsys.readouterr()
    assert fast_downward.pddl2sas(domain, problem)[1] == sas
    assert fast_downward.pddl2sas(domain, problem, optimize=True)[1]
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"ALFWorld engine cache: cannot write {tmp_path / 'a-file' / 'cache'}")
    assert engine_cache.stats().translations == 2


def test_a_textworld_with_other_internals_is_played_as_shipped_and_said_once(games, engine_cache, monkeypatch,
                                                                            capsys):
    from textworld.envs.pddl import textgen
    monkeypatch.setattr(engine_cache, "_STATE", engine_cache._State())  # nothing said yet in this process
    monkeypatch.delattr(textgen, "_Converter")  # as if a later textworld had renamed it
    assert engine_cache.set_engine_cache(True) is False and not engine_cache.engine_cache_enabled()
    assert engine_cache.set_engine_cache(True) is False
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("ALFWorld engine cache: not available for this textworld (")
    monkeypatch.undo()
    assert engine_cache.set_engine_cache(True, disk=False) is True


def test_the_shared_start_up_is_parsed_once_before_workers_fork(games, engine_cache, tmp_path, monkeypatch):
    monkeypatch.setenv("SAPD_CACHE_DIR", str(tmp_path))
    specs = alfworld_specs(games, "valid_unseen", expert="planner", log=None)
    assert len({id(s.prepare) for s in specs}) == 1 and specs[0].prepare is not None  # one, run once by the loop
    specs[0].prepare()
    parsed = engine_cache.stats().parses()
    assert parsed["pddl_logic"]["misses"] == 1 and parsed["textgen"]["misses"] > 50  # the grammar's rules
    assert parsed["logic"]["misses"] > 0  # its conditions
    # another game's grammar differs only in its goal: a handful of new rules, the rest already parsed
    from textworld.envs.pddl.logic import GameLogic
    other = read_game(_game(games, PICK))
    GameLogic(domain=other["pddl_domain"], grammar=other["grammar"])
    new = engine_cache.stats().parses()["textgen"]["misses"] - parsed["textgen"]["misses"]
    assert 0 < new <= 5, new
    # nothing was translated or started, and the folder is the one SAPD_CACHE_DIR names
    assert engine_cache.stats().translations == 0 and engine_cache.default_cache_dir() == tmp_path / "alfworld-engine"
    shipped = alfworld_specs(games, "valid_unseen", expert="planner", engine_cache=False, log=None)
    assert all(s.prepare is None for s in shipped) and shipped[0].make_env().engine_cache is False


@pytest.mark.slow
def test_startup_bench_runs_collect_expert_three_ways_with_the_same_trajectories(games, tmp_path):
    """bench/alfworld_startup.py as its user runs it: ``sapd collect-expert`` in isolated workers, as shipped
    (``--no-engine-cache``), cached cold and warm; it fails by itself when the trajectories differ."""
    import subprocess
    repo = Path(__file__).resolve().parents[2]
    out, work = tmp_path / "startup.json", tmp_path / "work"
    run = subprocess.run([sys.executable, "bench/alfworld_startup.py", "--alfworld-data", str(games), "--split",
                          "valid_unseen", "--limit", "3", "--work", str(work), "--json", str(out)],
                         cwd=repo, capture_output=True, text=True, timeout=1200)
    assert run.returncode == 0, run.stderr[-3000:]
    last = run.stdout.strip().splitlines()[-1]
    m = re.fullmatch(r"alfworld start-up: cached (\d+\.\d)× faster cold, (\d+\.\d)× warm than as shipped; "
                     r"CPU \d+\.\d× and \d+\.\d× \(3 planner episodes, isolated workers\)", last)
    assert m, last
    result = json.loads(out.read_text())
    assert (float(m.group(1)), float(m.group(2))) == (round(result["speedup_cold"], 1), round(result["speedup_warm"], 1))
    assert "identical expert trajectories in all 3 runs" in run.stdout
    runs = result["runs"]
    assert [r["episodes"] for c in ("shipped", "cold", "warm") for r in runs[c]] == [3, 3, 3]
    assert all(r["cpu_seconds"] > 0 for rs in runs.values() for r in rs)
    # the cold run translated each game once (plain and optimised) into the folder the warm run read
    assert runs["cold"][0]["cache_files"] == runs["warm"][0]["cache_files"] == 6
    assert not list((work / "unused-0").rglob("*.sas.gz"))  # as shipped: nothing cached
    trajs = [json.loads(line) for line in (work / "expert-warm-0.jsonl").read_text().splitlines()]
    assert all(t["success"] for t in trajs)


# ---------------------------------------------------------------------------------------------------
# bad ALFWORLD_DATA: one line naming the path and what to do


@pytest.mark.parametrize("case", ["missing", "no_split", "empty_split", "not_json"])
def test_bad_alfworld_data_gets_one_line_naming_the_path(tmp_path, capsys, monkeypatch, case):
    data = tmp_path / "alfdata"
    split = data / "json_2.1.1" / "valid_unseen"
    bad = split / "pick_and_place_simple-Apple-None-Fridge-1" / "trial_T1" / "game.tw-pddl"
    if case != "missing":
        data.mkdir()
    if case in ("empty_split", "not_json"):
        split.mkdir(parents=True)
    if case == "not_json":
        bad.parent.mkdir(parents=True)
        bad.write_bytes(b"PK\x03\x04 a zip, not the game")
    named = {"missing": data, "no_split": split, "empty_split": split, "not_json": bad}[case]
    monkeypatch.setenv("ALFWORLD_DATA", str(data))  # read when the command runs, not at import
    code = main(["collect-expert", "--benchmark", "alfworld", "--split", "valid_unseen", "--env-timeout", "0",
                 "--out", str(tmp_path / "expert.jsonl")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith("sapd collect-expert: error: ") and str(named) in err[0]
    assert ("not JSON" in err[0] and "alfworld-games" in err[0]) if case == "not_json" else \
        ("sapd alfworld-games --out DIR --split" in err[0] and "alfworld-download" in err[0])
    # the flag says the same (--data-dir, the chart's spelling, is the same flag) and wins over the variable
    monkeypatch.setenv("ALFWORLD_DATA", str(tmp_path / "elsewhere"))
    for flag in ("--alfworld-data", "--data-dir"):
        assert main(["collect-expert", "--benchmark", "alfworld", flag, str(data), "--env-timeout", "0",
                     "--out", str(tmp_path / "expert.jsonl")]) == 2
        assert capsys.readouterr().err.strip().splitlines() == err


# ---------------------------------------------------------------------------------------------------
# ALFWorld's experts (slow: every game is planned or explored on the real engine)


@pytest.mark.slow
def test_planner_expert_wins_generated_games_of_every_type(tmp_path, capsys):
    data = generated_games("valid_unseen", per_type=4, seed=1)
    out = tmp_path / "planner.jsonl"
    assert main(["collect-expert", "--benchmark", "alfworld", "--alfworld-data", str(data), "--split", "valid_unseen",
                 "--expert", "planner", "--out", str(out)]) == 0
    assert "ALFWorld expert: planner" in capsys.readouterr().out
    trajs = [json.loads(line) for line in out.read_text().splitlines()]
    per: dict[str, list[bool]] = {}
    for t in trajs:
        per.setdefault(t["category"], []).append(bool(t["success"]))
        assert t["metadata"]["expert"] == "planner" and t["turns"]
    assert set(per) == set(SIX.values()) and all(len(v) == 4 for v in per.values())
    assert all(sum(v) / len(v) >= 0.95 for v in per.values()), per


@pytest.mark.slow
def test_handcoded_expert_wins_pick2_games_only_with_the_move_fix(tmp_path, capsys):
    data = generated_type("pick_two_obj_and_place", per_type=4, seed=1)

    def collect(*flags: str) -> list[dict]:
        out = tmp_path / f"hc{len(flags)}.jsonl"
        assert main(["collect-expert", "--benchmark", "alfworld", "--alfworld-data", str(data), "--split",
                     "valid_unseen", "--out", str(out), *flags]) == 0
        return [json.loads(line) for line in out.read_text().splitlines()]

    fixed = collect()
    log = capsys.readouterr().out
    assert "move/put fix" in log and "update_state_tracking" in log  # the fix is named in the log
    unfixed = collect("--no-expert-fix")
    assert "WITHOUT sapd's move/put fix" in capsys.readouterr().out
    won_fixed = {t["id"] for t in fixed if t["success"]}
    won_unfixed = {t["id"] for t in unfixed if t["success"]}
    assert len(fixed) == len(unfixed) == 4 and {t["category"] for t in fixed} == {"Pick2"}
    # 50 steps: the fixed expert may still run out exploring a big kitchen; the unfixed one never finishes
    assert not won_unfixed and len(won_fixed) >= 3, (won_fixed, won_unfixed)
    # the unfixed expert loses by looping after its own "move" until the 50 steps are up: the second object
    # never reaches the receptacle
    for t in unfixed:
        obj, parent = (w.lower() for w in t["id"].split("/")[1].split("-")[1:5:3])
        actions = [u["action"] for u in t["turns"]]
        placed = [a for a in actions if re.fullmatch(rf"move {obj} \d+ to {parent} \d+", a)]
        assert len(actions) == 50 and len(placed) <= 1, actions
