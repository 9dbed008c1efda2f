"""ScienceWorld for real: a small fixed panel, its gold-path expert, and the agent loop on it (the
expert trajectory replayed through the loop gives byte-identical prompts to its prefixes)."""

from __future__ import annotations

import time

import pytest

from sapd.data.loaders import LoadOptions, load_trajectories, write_native_jsonl
from sapd.data.prefixes import PrefixOptions, build_prefix_rows
from sapd.envs.base import Environment, ExpertEnvironment
from sapd.envs.loop import EpisodeSpec, LoopOptions, collect_expert, run_episodes, summarize
from sapd.envs.scienceworld_env import (
    ScienceWorldEnv,
    TaskSpec,
    clean_task,
    make_env,
    scienceworld_panel,
    scienceworld_specs,
    task_names,
)
from sapd.method.benchmarks import get_benchmark, parse_decision
from tests.envs.test_agent_loop import ScriptedGenerator
from tests.tokenizer_util import build_test_tokenizer

# two short tasks of the default test-split panel (seed 0): 10 and 8 gold actions
PANEL = [TaskSpec("find-plant", 241), TaskSpec("lifespan-longest-lived", 122)]


def _specs(panel=PANEL):
    return scienceworld_specs(panel=panel)


def test_task_names_and_cleaning_need_no_jvm():
    names = task_names()
    assert len(names) == 30 and "find-plant" in names and "boil" in names
    assert clean_task("Task Description:\nYour task is to boil water.\n") == "Your task is to boil water."
    with pytest.raises(ValueError, match="unknown ScienceWorld task"):
        scienceworld_panel(["no-such-task"])
    specs = _specs()
    assert [s.id for s in specs] == ["scienceworld/find-plant-241", "scienceworld/lifespan-longest-lived-122"]
    assert [s.category for s in specs] == ["find-plant", "lifespan-longest-lived"]


@pytest.mark.slow
def test_panel_is_fixed_and_seeded():
    import scienceworld  # noqa: F401  (a missing install must fail here, not skip)
    tasks = ["find-plant", "lifespan-longest-lived"]
    a = scienceworld_panel(tasks, 2, seed=0)
    assert a == scienceworld_panel(tasks, 2, seed=0)
    assert [p.task for p in a] == ["find-plant"] * 2 + ["lifespan-longest-lived"] * 2
    assert all(a[i].variation < a[i + 1].variation for i in (0, 2))
    assert PANEL[0] in a and PANEL[1] in a  # the panel this file plays is the default one's


@pytest.mark.slow
def test_scienceworld_env_protocol_one_jvm_and_gold_expert():
    env = make_env(PANEL[0])
    assert isinstance(env, Environment) and isinstance(env, ExpertEnvironment)
    assert env.expert_action() is None
    with pytest.raises(RuntimeError, match="step before reset"):
        env.step("look around")
    try:
        first = env.reset()
        print(f"ScienceWorld JVM start: {env.jvm_start_s:.2f} s")
        jvm = env._sw
        assert first.task.startswith("Your task is to find a(n) plant") and first.category == "find-plant"
        assert first.observation.startswith("This room is called") and first.admissible_actions is None
        gold = env.gold_actions()
        assert gold and env.expert_action() == gold[0] and first.info["gold_length"] == len(gold)
        res = env.step("xyzzy frobnicate")  # not an action: the simulator says so, nothing breaks
        assert not res.done and res.reward == 0 and not res.won
        assert env.expert_action() == gold[0]  # off-path actions are skipped over
        res = env.step(gold[0])
        assert env.expert_action() == gold[1]
        again = env.reset()  # same JVM, gold path re-derived, back at the start
        assert env._sw is jvm and again.observation == first.observation and env.gold_actions() == gold
        assert env.expert_action() == gold[0]
    finally:
        env.close()
    assert env._sw is None
    env.close()  # idempotent


@pytest.fixture(scope="module")
def expert():
    t0 = time.monotonic()
    got = collect_expert(_specs(), "scienceworld")
    print(f"ScienceWorld expert collection: {time.monotonic() - t0:.1f} s for {len(got)} episodes")
    return got


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return build_test_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.mark.slow
def test_expert_wins_the_panel_tasks_and_the_pool_loads_back(expert, tmp_path):
    assert [t.success for t in expert] == [True] * len(PANEL)
    assert [t.category for t in expert] == [p.task for p in PANEL]
    for t in expert:
        assert t.metadata["end_reason"] == "done" and t.metadata["invalid_steps"] == 0
        assert t.metadata["score"] == 100 and t.metadata["max_score"] == 100
        assert t.final_observation and t.task.startswith("Your task is to")
        for u in t.turns:
            d = parse_decision(u.response, "scienceworld")
            assert d.valid and d.content == u.action.lower() and u.response.startswith("<think>")
    path = tmp_path / "expert.jsonl"
    write_native_jsonl(expert, str(path))
    back = load_trajectories(str(path), "native", LoadOptions(benchmark="scienceworld")).trajectories
    assert [t.to_dict() for t in back] == [t.to_dict() for t in expert]
    assert summarize(expert)["overall"]["success"] == 1.0


@pytest.mark.slow
@pytest.mark.parametrize("popts,n", [(PrefixOptions(), 2), (PrefixOptions(prompt_style="chat", full_history=True), 1)],
                         ids=["step", "chat"])
def test_expert_trajectory_replayed_through_the_loop_gives_its_prefix_prompts(expert, tokenizer, popts, n):
    expert = expert[:n]  # the chat layout on one episode: the panel's JVM time stays small
    gen = ScriptedGenerator(expert)
    got = run_episodes(_specs(PANEL[:n]), gen, tokenizer, "scienceworld", opts=LoopOptions(prompt=popts))
    rows, _ = build_prefix_rows(expert, get_benchmark("scienceworld"), tokenizer, popts)
    expected = {(r["trajectory_id"], r["turn_index"]): r["prompt"] for r in rows}
    assert set(gen.prompts) == set(expected)
    for key, prompt in expected.items():
        assert gen.prompts[key] == prompt, key
    assert [t.success for t in got] == [True] * n
    assert [[(u.observation, u.action, u.response) for u in t.turns] for t in got] == \
           [[(u.observation, u.action, u.response) for u in t.turns] for t in expert]


@pytest.mark.slow
def test_malformed_response_is_an_invalid_step_not_a_crash(expert, tokenizer):
    one = expert[:1]
    n = len(one[0].turns)
    # step 2 is malformed: the no-op "look around" is sent instead and the recorded responses go on, so
    # the gold action of step 2 is never taken — at the horizon n the task is not done
    gen = ScriptedGenerator(one, override=lambda tid, k: "I think I will open the door" if k == 1 else None)
    got = run_episodes(_specs(PANEL[:1]), gen, tokenizer, "scienceworld",
                       opts=LoopOptions(horizon=n, invalid_action="look around"))[0]
    assert got.metadata["invalid_steps"] == 1 and got.metadata["invalid_turns"] == [1]
    assert got.metadata["invalid_reasons"] == {"missing <action>…</action>": 1}
    assert got.turns[1].action == "look around" and len(got.turns) == n
    assert got.success is False and got.metadata["end_reason"] == "horizon"
    assert got.metadata["env_restarts"] == 0 and got.metadata["error"] is None


def test_specs_are_episode_specs():
    specs = _specs()
    assert all(isinstance(s, EpisodeSpec) for s in specs)
    env = specs[0].make_env()  # building the environment starts nothing: the JVM starts on reset
    assert isinstance(env, ScienceWorldEnv) and env._sw is None
