"""The agent loop without a real environment: recorded trajectories replayed (ReplayEnv) give
byte-identical prompts to their prefixes; horizon, invalid responses and crashing environments."""

from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

import pytest

from sapd.data.loaders import LoadOptions, load_trajectories, write_native_jsonl
from sapd.data.prefixes import PrefixOptions, build_prefix_rows
from sapd.data.schema import Trajectory
from sapd.envs.base import ReplayEnv, StepInfo, StepResult
from sapd.envs.loop import EpisodeSpec, LoopOptions, collect_expert, expert_response, run_episodes, summarize
from sapd.method.benchmarks import get_benchmark, parse_decision
from sapd.models.generation import Sample, SamplingParams
from tests.tokenizer_util import SAMPLE_DATA, build_test_tokenizer


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return build_test_tokenizer(tmp_path_factory.mktemp("tok"))


class ScriptedGenerator:
    """A Generator that answers step k of every live episode with its recorded response k. The loop
    batches the live episodes in spec order, and a replayed episode lives exactly while k < its length,
    so the live list of step k is known; each prompt is kept under (trajectory id, k)."""

    def __init__(self, trajectories: Sequence[Trajectory],
                 override: Callable[[str, int], str | None] | None = None, by_task: bool = False) -> None:
        self.trajectories = list(trajectories)
        self.by_task = by_task
        self.override = override
        self.calls: list[int] = []  # prompts per generate call
        self.prompts: dict[tuple[str, int], str] = {}
        self.step = 0

    def generate(self, prompts, params, progress=None):
        assert params.n == 1
        live = [t for t in self.trajectories if len(t.turns) > self.step]
        if self.by_task:  # episodes may end early: find each prompt's trajectory by its task
            live = [next(t for t in self.trajectories if f"Your task is to: {t.task}\n" in p) for p in prompts]
        assert len(live) == len(prompts)
        self.calls.append(len(prompts))
        out = []
        for traj, prompt in zip(live, prompts):
            self.prompts[(traj.id, self.step)] = prompt
            text = traj.turns[self.step].response
            if self.override is not None and (o := self.override(traj.id, self.step)) is not None:
                text = o
            out.append([Sample(token_ids=[], logprobs=[], text=text, finish_reason="stop")])
        self.step += 1
        return out


def _load(name: str, benchmark: str) -> list[Trajectory]:
    return load_trajectories(str(SAMPLE_DATA / name), "eto", LoadOptions(benchmark=benchmark)).trajectories


def _replay_specs(trajs: Sequence[Trajectory]) -> list[EpisodeSpec]:
    return [EpisodeSpec(t.id, (lambda t=t: ReplayEnv(t))) for t in trajs]


def assert_replay_matches_prefixes(trajs: Sequence[Trajectory], make_specs, benchmark: str, tokenizer,
                                   popts: PrefixOptions) -> list[Trajectory]:
    """Replay ``trajs`` through the loop; every prompt equals its prefix's, byte for byte."""
    spec = get_benchmark(benchmark)
    gen = ScriptedGenerator(trajs)
    got = run_episodes(make_specs(trajs), gen, tokenizer, spec, opts=LoopOptions(prompt=popts))
    rows, _ = build_prefix_rows(trajs, spec, tokenizer, popts)
    expected = {(r["trajectory_id"], r["turn_index"]): r["prompt"] for r in rows}
    assert set(gen.prompts) == set(expected)
    for key, prompt in expected.items():
        assert gen.prompts[key] == prompt, key
    # one generate call per step over all live episodes
    assert gen.calls == [sum(len(t.turns) > k for t in trajs) for k in range(max(len(t.turns) for t in trajs))]
    for rec, ep in zip(trajs, got):
        assert [(u.observation, u.response, u.action, u.admissible_actions) for u in ep.turns] == \
               [(u.observation, u.response, u.action, u.admissible_actions) for u in rec.turns]
        assert ep.metadata["invalid_steps"] == 0 and ep.metadata["end_reason"] == "done"
    return got


@pytest.mark.parametrize("popts", [PrefixOptions(), PrefixOptions(full_history=True),
                                   PrefixOptions(prompt_style="chat", history_length=3)],
                         ids=["step", "step-full", "chat"])
@pytest.mark.parametrize("name,benchmark", [("alfworld_eto.json", "alfworld"), ("webshop_eto.json", "webshop")])
def test_replayed_trajectories_give_the_prefix_prompts(tokenizer, name, benchmark, popts):
    trajs = _load(name, benchmark)
    assert len(trajs) >= 3
    assert_replay_matches_prefixes(trajs, _replay_specs, benchmark, tokenizer, popts)


def test_replay_with_admissible_actions_and_the_recorded_outcome(tokenizer):
    trajs = _load("alfworld_eto.json", "alfworld")[:3]
    trajs = [dataclasses.replace(t, success=i != 1, turns=[dataclasses.replace(u, admissible_actions=[u.action, "look"])
                                                           for u in t.turns]) for i, t in enumerate(trajs)]
    got = assert_replay_matches_prefixes(trajs, _replay_specs, "alfworld", tokenizer, PrefixOptions())
    assert [t.success for t in got] == [True, False, True]
    assert all(t.final_observation == r.final_observation for t, r in zip(got, trajs))


def test_loop_records_load_back_and_rebuild_the_same_prefixes(tokenizer, tmp_path):
    trajs = _load("alfworld_eto.json", "alfworld")
    gen = ScriptedGenerator(trajs)
    got = run_episodes(_replay_specs(trajs), gen, tokenizer, "alfworld")
    path = tmp_path / "pool.jsonl"
    write_native_jsonl(got, str(path))
    back = load_trajectories(str(path), "native", LoadOptions(benchmark="alfworld")).trajectories
    assert [t.to_dict() for t in back] == [t.to_dict() for t in got]
    rows, _ = build_prefix_rows(back, get_benchmark("alfworld"), tokenizer, PrefixOptions())
    assert {(r["trajectory_id"], r["turn_index"]): r["prompt"] for r in rows} == gen.prompts


def test_horizon_is_enforced(tokenizer):
    trajs = _load("alfworld_eto.json", "alfworld")
    long = [t for t in trajs if len(t.turns) >= 5]
    got = run_episodes(_replay_specs(long), ScriptedGenerator(long), tokenizer, "alfworld",
                       opts=LoopOptions(horizon=3))
    for t in got:
        assert len(t.turns) == 3 and t.success is False
        assert t.metadata["end_reason"] == "horizon"
        assert t.final_observation == long[got.index(t)].turns[3].observation


@pytest.mark.parametrize("bad", ["no tags at all", "<think>x</think><action></action>",
                                 "<action>go to desk 1</action>", ""])
def test_malformed_response_is_an_invalid_step_not_a_crash(tokenizer, bad):
    trajs = _load("alfworld_eto.json", "alfworld")[:2]
    envs: dict[str, ReplayEnv] = {}

    def specs(ts):
        def make(t):
            envs[t.id] = ReplayEnv(t)
            return envs[t.id]
        return [EpisodeSpec(t.id, (lambda t=t: make(t))) for t in ts]

    gen = ScriptedGenerator(trajs, override=lambda tid, k: bad if (tid == trajs[0].id and k == 1) else None)
    got = run_episodes(specs(trajs), gen, tokenizer, "alfworld")
    first = got[0]
    assert first.metadata["invalid_steps"] == 1 and first.metadata["invalid_turns"] == [1]
    reason = parse_decision(bad, "alfworld").reason
    assert first.metadata["invalid_reasons"] == {reason: 1}
    assert first.turns[1].response == bad and first.turns[1].action == "look"
    assert envs[trajs[0].id].actions[1] == "look"  # the environment got the no-op
    assert len(first.turns) == len(trajs[0].turns)  # the episode went on
    assert got[1].metadata["invalid_steps"] == 0
    assert summarize(got)["overall"]["invalid_step_rate"] == pytest.approx(1 / sum(len(t.turns) for t in trajs))


def test_invalid_without_noop_leaves_the_environment_alone(tokenizer):
    traj = _load("alfworld_eto.json", "alfworld")[0]
    gen = ScriptedGenerator([traj], override=lambda tid, k: "nonsense" if k == 0 else None)
    got = run_episodes(_replay_specs([traj]), gen, tokenizer, "alfworld",
                       opts=LoopOptions(invalid_action=None, horizon=2))[0]
    assert got.turns[0].action == "<invalid>"
    assert got.turns[1].observation == got.turns[0].observation  # nothing happened


class FlakyEnv:
    """A ReplayEnv that raises in ``step`` number ``fail_at`` (1-based) of its first ``fail_times`` instances."""

    instances = 0

    def __init__(self, traj: Trajectory, fail_at: int, fail_times: int, counter: list[int],
                 fail_reset: bool = False) -> None:
        self.inner = ReplayEnv(traj)
        self.benchmark = traj.benchmark
        counter[0] += 1
        self.broken = counter[0] <= fail_times
        self.fail_at, self.fail_reset, self.steps = fail_at, fail_reset, 0

    def reset(self, seed=None) -> StepInfo:
        if self.broken and self.fail_reset:
            raise ConnectionError("simulator did not start")
        self.steps = 0
        return self.inner.reset(seed)

    def step(self, action: str) -> StepResult:
        self.steps += 1
        if self.broken and self.steps == self.fail_at:
            raise RuntimeError("simulator crashed")
        return self.inner.step(action)

    def close(self) -> None:
        pass


def _flaky_specs(traj, **kw):
    counter = [0]
    return [EpisodeSpec(traj.id, lambda: FlakyEnv(traj, counter=counter, **kw))], counter


def test_a_crashing_environment_is_restarted_and_the_episode_continues(tokenizer):
    traj = _load("alfworld_eto.json", "alfworld")[2]
    traj = dataclasses.replace(traj, success=True)
    specs, counter = _flaky_specs(traj, fail_at=3, fail_times=1)
    got = run_episodes(specs, ScriptedGenerator([traj]), tokenizer, "alfworld")[0]
    assert counter[0] == 2 and got.metadata["env_restarts"] == 1
    assert got.success is True and got.metadata["end_reason"] == "done" and got.metadata["error"] is None
    assert [u.observation for u in got.turns] == [u.observation for u in traj.turns]


def test_an_environment_that_keeps_crashing_is_recorded_as_failed(tokenizer):
    traj = dataclasses.replace(_load("alfworld_eto.json", "alfworld")[2], success=True)
    specs, counter = _flaky_specs(traj, fail_at=2, fail_times=100)
    other = _load("alfworld_eto.json", "alfworld")[0]
    gen = ScriptedGenerator([traj, other], by_task=True)
    got = run_episodes(specs + _replay_specs([other]), gen, tokenizer, "alfworld",
                       opts=LoopOptions(max_env_retries=2))
    bad = got[0]
    assert counter[0] == 3  # the first build and two restarts
    assert bad.success is False and bad.metadata["end_reason"] == "env_error"
    assert "RuntimeError: simulator crashed" in bad.metadata["error"] and "step 2" in bad.metadata["error"]
    assert len(bad.turns) == 2 and bad.metadata["env_restarts"] == 2
    assert got[1].metadata["end_reason"] == "done"  # the other episode is unaffected
    assert summarize(got)["overall"]["env_errors"] == 1


def test_an_environment_that_never_starts_is_recorded_as_failed(tokenizer):
    traj = _load("alfworld_eto.json", "alfworld")[0]
    specs, counter = _flaky_specs(traj, fail_at=0, fail_times=100, fail_reset=True)
    got = run_episodes(specs, ScriptedGenerator([]), tokenizer, "alfworld", opts=LoopOptions(max_env_retries=1))[0]
    assert counter[0] == 2 and got.turns == [] and got.success is False
    assert got.metadata["end_reason"] == "env_error" and "ConnectionError" in got.metadata["error"]


def test_a_restart_that_diverges_fails_the_episode(tokenizer):
    traj = _load("alfworld_eto.json", "alfworld")[3]
    counter = [0]

    class Diverging(FlakyEnv):
        def step(self, action):
            res = super().step(action)
            if counter[0] > 1:
                res = dataclasses.replace(res, observation=res.observation + " (different)")
            return res

    specs = [EpisodeSpec(traj.id, lambda: Diverging(traj, fail_at=3, fail_times=1, counter=counter))]
    got = run_episodes(specs, ScriptedGenerator([traj]), tokenizer, "alfworld")[0]
    assert got.metadata["end_reason"] == "env_error" and "diverged at step 1" in got.metadata["error"]


def test_collect_expert_on_replayed_trajectories():
    trajs = _load("alfworld_eto.json", "alfworld")
    trajs = [dataclasses.replace(t, success=True) for t in trajs]
    got = collect_expert(_replay_specs(trajs), "alfworld")
    for rec, ep in zip(trajs, got):
        assert [u.action for u in ep.turns] == [u.action for u in rec.turns]
        assert [u.observation for u in ep.turns] == [u.observation for u in rec.turns]
        for u in ep.turns:
            d = parse_decision(u.response, "alfworld")
            assert d.valid and d.content == u.action.lower()
            assert u.response.startswith("<think>") and "</think>\n<action>" in u.response
        assert ep.success is True and ep.metadata["policy"] == "expert"
    s = summarize(got)
    assert s["overall"]["success"] == 1.0 and s["overall"]["episodes"] == len(trajs)


def test_expert_response_format():
    r = expert_response("take old key from antique trunk")
    assert r == "<think>I need the old key for the task, so I should take it.</think>\n<action>take old key from antique trunk</action>"
    assert parse_decision(expert_response("go north"), "textworld").content == "go north"


def test_sampling_params_are_one_sample_per_episode_with_the_step_seed(tokenizer):
    traj = _load("alfworld_eto.json", "alfworld")[0]
    seen = []

    class Gen(ScriptedGenerator):
        def generate(self, prompts, params, progress=None):
            seen.append((params.n, params.seed, params.temperature))
            return super().generate(prompts, params, progress)

    run_episodes(_replay_specs([traj]), Gen([traj]), tokenizer, "alfworld",
                 params=SamplingParams(n=8, seed=10, temperature=0.7))
    assert seen == [(1, 10 + k, 0.7) for k in range(len(traj.turns))]


def test_at_most_max_live_episodes_environments_are_open_and_nothing_changes(tokenizer):
    trajs = [dataclasses.replace(t, success=True) for t in _load("alfworld_eto.json", "alfworld")]
    trajs = trajs + [dataclasses.replace(t, id=t.id + "-again") for t in trajs]
    open_now, most = [0], [0]

    class Counted(ReplayEnv):
        def __init__(self, traj):
            super().__init__(traj)
            open_now[0] += 1
            most[0] = max(most[0], open_now[0])

        def close(self):
            open_now[0] -= 1

    class ByPrompt:
        """Answers each prompt with its trajectory's recorded response at the prompt's own step (with a
        window, live episodes are at different steps)."""

        def generate(self, prompts, params, progress=None):
            import re
            out = []
            for p in prompts:
                traj = next(t for t in trajs if f"Your task is to: {t.task}\n" in p)
                k = int(re.search(r"You are now at step (\d+)", p).group(1)) - 1
                out.append([Sample(token_ids=[], logprobs=[], text=traj.turns[k].response, finish_reason="stop")])
            return out

    specs = [EpisodeSpec(t.id, (lambda t=t: Counted(t))) for t in trajs]
    done = []
    got = run_episodes(specs, ByPrompt(), tokenizer, "alfworld", opts=LoopOptions(max_live_episodes=2),
                       progress=done.append)
    assert most[0] == 2 and open_now[0] == 0 and len(done) == len(trajs)
    assert all(t.success and t.metadata["end_reason"] == "done" for t in got)
    every = run_episodes(specs, ByPrompt(), tokenizer, "alfworld", opts=LoopOptions(max_live_episodes=None))
    assert most[0] == len(trajs)
    assert [t.to_dict() for t in got] == [t.to_dict() for t in every]


class Corridor:
    """Rooms 0..n on a line; the goal is room n. The expert always re-plans ("go east" until there);
    admissible actions are both directions and "look"."""

    def __init__(self, n: int = 4) -> None:
        self.n, self.pos = n, 0

    def _obs(self) -> str:
        return f"-= Room {self.pos} =-\nA corridor."

    def _admissible(self) -> list[str]:
        return ["go east", "go west", "look"]

    def reset(self, seed=None):
        self.pos = 0
        return StepInfo(self._obs(), "reach the last room", self._admissible())

    def step(self, action: str):
        self.pos = max(0, self.pos + {"go east": 1, "go west": -1}.get(action, 0))
        done = self.pos == self.n
        return StepResult(self._obs(), done=done, won=done, admissible_actions=self._admissible())

    def expert_action(self) -> str:
        return "go east"

    def close(self) -> None:
        pass


def test_observe_thought_never_names_the_action():
    from sapd.envs.loop import observation_thought
    r = expert_response("go east", thought="observe", observation="-= Dark Kitchen =-\nYou see a door.")
    assert r == "<think>I am in the dark kitchen.</think>\n<action>go east</action>"
    assert observation_thought("no header here") == "I take stock of where I am."
    with pytest.raises(ValueError, match="thought"):
        expert_response("go east", thought="shout")  # type: ignore[arg-type]


def test_noisy_expert_takes_random_other_actions_at_rate_epsilon_and_is_reproducible():
    specs = [EpisodeSpec(f"c{i}", lambda: Corridor(4)) for i in range(40)]
    opts = LoopOptions(horizon=60)
    clean = collect_expert(specs, "textworld", opts, thought="observe")
    assert all(t.success and len(t.turns) == 4 and "noisy_turns" not in t.metadata for t in clean)
    assert all("go east" not in u.response.split("</think>")[0] for t in clean for u in t.turns)
    noisy = collect_expert(specs, "textworld", opts, thought="observe", noise=0.25, noise_seed=3)
    again = collect_expert(specs, "textworld", opts, thought="observe", noise=0.25, noise_seed=3)
    assert [[u.action for u in t.turns] for t in noisy] == [[u.action for u in t.turns] for t in again]
    turns = [u for t in noisy for u in t.turns]
    off = [u for u in turns if u.action != "go east"]
    noisy_turns = sum(len(t.metadata.get("noisy_turns", [])) for t in noisy)
    assert noisy_turns == len(off) and 0.15 < len(off) / len(turns) < 0.35  # ε = 0.25, about 200 draws
    assert {u.action for u in off} == {"go west", "look"}
    assert all(t.success for t in noisy)  # the expert re-plans after every detour
    with pytest.raises(ValueError, match="noise"):
        collect_expert(specs, "textworld", opts, noise=1.0)
