"""TextWorld for real: a small generated panel, its expert, and the agent loop on it (the expert
trajectory replayed through the loop gives byte-identical prompts to its prefixes)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from sapd.data.loaders import LoadOptions, load_trajectories, write_native_jsonl
from sapd.data.prefixes import PrefixOptions, build_prefix_rows
from sapd.envs.base import Environment
from sapd.envs.loop import EpisodeSpec, LoopOptions, collect_expert, run_episodes, summarize
from sapd.envs.textworld_env import (
    GameSpec,
    clean_observation,
    default_panel,
    ensure_game,
    ensure_panel,
    game_path,
    make_env,
)
from sapd.method.benchmarks import get_benchmark, parse_decision
from tests.envs.test_agent_loop import ScriptedGenerator
from tests.tokenizer_util import build_test_tokenizer

PANEL = [GameSpec("simple", 0), GameSpec("coin", 0), GameSpec("cook_open", 0)]


def test_clean_observation_drops_banner_objective_status_and_restart_prompt():
    raw = ("\n\n\n   ________  __\n  |        \\|  \\\n   \\$$$$$$$$| $$\n\nGet the key. Then win!\n\n"
           "-= Bedroom =-\nYou are in a bedroom.\n\n\n\nThere is a door.\n\n>      -= Bedroom =-0/1")
    assert clean_observation(raw, "Get the key. Then win!") == "-= Bedroom =-\nYou are in a bedroom.\n\nThere is a door."
    end = "You eat the meal.\n\n\n   *** The End ***\n\nYou scored 4 out of a possible 4, in 9 turns.\n\nWould you like to RESTART?"
    assert clean_observation(end) == "You eat the meal.\n\n*** The End ***"


def test_default_panel_is_fixed_and_checked():
    assert default_panel(2, ["coin", "simple"], seed=5) == [GameSpec("coin", 5), GameSpec("coin", 6),
                                                            GameSpec("simple", 5), GameSpec("simple", 6)]
    with pytest.raises(ValueError, match="unknown TextWorld family"):
        default_panel(1, ["nope"])


@pytest.fixture(scope="module")
def games(tmp_path_factory):
    import textworld  # noqa: F401  (a missing install must fail here, not skip: make setup installs it)
    cache = tmp_path_factory.mktemp("twcache")
    times: dict[str, float] = {}
    for spec in PANEL:
        t0 = time.monotonic()
        ensure_game(spec, cache)
        times[spec.game_id] = time.monotonic() - t0
    print("TextWorld generation times (s):", {k: round(v, 1) for k, v in times.items()})
    return cache


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return build_test_tokenizer(tmp_path_factory.mktemp("tok"))


def _specs(cache, panel=PANEL):
    return [EpisodeSpec(f"textworld/{g.game_id}", (lambda g=g: make_env(g, cache)), category=g.family) for g in panel]


@pytest.mark.slow
def test_games_are_cached_and_reused(games):
    before = {g: game_path(g, games).stat().st_mtime_ns for g in PANEL}
    t0 = time.monotonic()
    paths = ensure_panel(PANEL, games)
    assert time.monotonic() - t0 < 0.5  # nothing regenerated
    assert {g: p.stat().st_mtime_ns for g, p in paths.items()} == before
    assert all(p.with_suffix(".json").is_file() for p in paths.values())


@pytest.mark.slow
def test_textworld_env_protocol_and_clean_observations(games):
    env = make_env(PANEL[0], games)
    assert isinstance(env, Environment)
    first = env.reset()
    assert first.task and first.category == "simple"
    assert "$$" not in first.observation and first.task not in first.observation
    assert first.observation.startswith("-= ") and "0/1" not in first.observation
    assert first.admissible_actions and "look" in first.admissible_actions
    walk = env.walkthrough()
    assert walk and env.expert_action() == walk[0]
    res = env.step("xyzzy frobnicate")
    assert not res.done and res.reward == 0
    assert env.expert_action() == env._state["policy_commands"][0]  # off the walkthrough: re-planned
    env.close()


@pytest.mark.slow
def test_expert_wins_every_game_and_the_pool_loads_back(games, tmp_path):
    got = collect_expert(_specs(games), "textworld")
    assert [t.success for t in got] == [True] * len(PANEL)
    assert [t.category for t in got] == [g.family for g in PANEL]
    for t in got:
        assert t.metadata["end_reason"] == "done" and t.metadata["invalid_steps"] == 0
        assert t.final_observation and t.final_observation.endswith("*** The End ***")
        assert t.metadata["score"] == t.metadata["max_score"]
        for u in t.turns:
            d = parse_decision(u.response, "textworld")
            assert d.valid and d.content == u.action and u.admissible_actions
    path = tmp_path / "expert.jsonl"
    write_native_jsonl(got, str(path))
    back = load_trajectories(str(path), "native", LoadOptions(benchmark="textworld")).trajectories
    assert [t.to_dict() for t in back] == [t.to_dict() for t in got]
    assert summarize(got)["overall"]["success"] == 1.0


@pytest.mark.slow
@pytest.mark.parametrize("popts", [PrefixOptions(), PrefixOptions(prompt_style="chat", full_history=True)],
                         ids=["step", "chat"])
def test_expert_trajectory_replayed_through_the_loop_gives_its_prefix_prompts(games, tokenizer, popts):
    expert = collect_expert(_specs(games), "textworld", opts=LoopOptions(prompt=popts))
    gen = ScriptedGenerator(expert)
    got = run_episodes(_specs(games), gen, tokenizer, "textworld", opts=LoopOptions(prompt=popts))
    rows, _ = build_prefix_rows(expert, get_benchmark("textworld"), tokenizer, popts)
    expected = {(r["trajectory_id"], r["turn_index"]): r["prompt"] for r in rows}
    assert set(gen.prompts) == set(expected)
    for key, prompt in expected.items():
        assert gen.prompts[key] == prompt, key
    assert [t.success for t in got] == [True] * len(PANEL)
    assert [[(u.observation, u.action, u.response) for u in t.turns] for t in got] == \
           [[(u.observation, u.action, u.response) for u in t.turns] for t in expert]


@pytest.mark.slow
def test_horizon_and_malformed_responses_in_a_real_game(games, tokenizer):
    expert = collect_expert(_specs(games, PANEL[:1]), "textworld")
    n = len(expert[0].turns)
    # a malformed response at step 2: "look" is sent instead, then the expert's responses go on — one
    # action short of winning at the horizon n
    gen = ScriptedGenerator(expert, override=lambda tid, k: "I think I will go north" if k == 1 else None)
    got = run_episodes(_specs(games, PANEL[:1]), gen, tokenizer, "textworld", opts=LoopOptions(horizon=n))[0]
    assert got.metadata["invalid_steps"] == 1
    assert got.metadata["invalid_reasons"] == {"missing <action>…</action>": 1}
    assert got.turns[1].action == "look" and len(got.turns) == n
    assert got.success is False and got.metadata["end_reason"] == "horizon"


@pytest.mark.slow
def test_a_relative_cache_folder_works(tmp_path, monkeypatch):
    # tw-make runs inside the temporary generation folder: a relative path must not be resolved against it
    monkeypatch.chdir(tmp_path)
    path = ensure_game(GameSpec("simple", 3), Path("rel-cache"))
    assert path.resolve() == (tmp_path / "rel-cache" / path.name).resolve() and path.is_file()
