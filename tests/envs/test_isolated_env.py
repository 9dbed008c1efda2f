"""Environments in a child process (``LoopOptions.env_timeout_s``): a hanging environment is killed and
rebuilt like a crashed one, a dying one too, and a simulator's own subprocess dies with it."""

from __future__ import annotations

import dataclasses
import os
import time
from pathlib import Path

import pytest

from sapd.data.loaders import LoadOptions, load_trajectories
from sapd.envs.base import ReplayEnv
from sapd.envs.isolated import EnvCallError, EnvTimeout, IsolatedEnv
from sapd.envs.loop import EpisodeSpec, LoopOptions, collect_expert, run_episodes
from tests.envs.test_agent_loop import ScriptedGenerator
from tests.tokenizer_util import SAMPLE_DATA, build_test_tokenizer


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return build_test_tokenizer(tmp_path_factory.mktemp("tok"))


def _traj(i: int = 2):
    t = load_trajectories(str(SAMPLE_DATA / "alfworld_eto.json"), "eto", LoadOptions("alfworld")).trajectories[i]
    return dataclasses.replace(t, success=True)


class BadEnv(ReplayEnv):
    """A replay whose first ``bad_builds`` instances misbehave at step ``at`` (1-based): ``hang`` sleeps
    far past any deadline, ``die`` exits the process, ``raise`` raises, ``spawn`` starts a child
    process (its pid written to ``pid_file``) and then hangs. Builds are counted in a file, since every
    build happens in another process."""

    def __init__(self, traj, counter: Path, how: str, at: int, bad_builds: int, pid_file: Path | None = None):
        super().__init__(traj)
        n = int(counter.read_text()) + 1 if counter.exists() else 1
        counter.write_text(str(n))
        self.bad = n <= bad_builds
        self.how, self.at, self.pid_file, self.steps = how, at, pid_file, 0

    def step(self, action):
        self.steps += 1
        if self.bad and self.steps == self.at:
            if self.how == "hang":
                time.sleep(3600)
            if self.how == "die":
                os._exit(3)
            if self.how == "raise":
                raise RuntimeError("simulator crashed")
            if self.how == "spawn":
                import subprocess
                proc = subprocess.Popen(["sleep", "3600"])
                self.pid_file.write_text(str(proc.pid))
                time.sleep(3600)
        return super().step(action)


def _run(tokenizer, tmp_path, how, bad_builds, retries=2, timeout=1.0):
    traj = _traj()
    counter = tmp_path / "builds"
    specs = [EpisodeSpec(traj.id, lambda: BadEnv(traj, counter, how, at=2, bad_builds=bad_builds))]
    got = run_episodes(specs, ScriptedGenerator([traj]), tokenizer, "alfworld",
                       opts=LoopOptions(env_timeout_s=timeout, max_env_retries=retries))[0]
    return traj, got, int(counter.read_text())


def test_a_hanging_environment_is_killed_and_the_episode_continues(tokenizer, tmp_path):
    t0 = time.monotonic()
    traj, got, builds = _run(tokenizer, tmp_path, "hang", bad_builds=1)
    assert time.monotonic() - t0 < 30
    assert builds == 2 and got.metadata["env_restarts"] == 1
    assert got.success is True and got.metadata["end_reason"] == "done" and got.metadata["error"] is None
    assert [u.observation for u in got.turns] == [u.observation for u in traj.turns]


def test_an_environment_that_keeps_hanging_is_recorded_as_failed(tokenizer, tmp_path):
    _, got, builds = _run(tokenizer, tmp_path, "hang", bad_builds=100, retries=1, timeout=0.5)
    assert builds == 2  # the first build and one restart
    assert got.success is False and got.metadata["end_reason"] == "env_error"
    assert "EnvTimeout" in got.metadata["error"] and "no answer within 0.5 s" in got.metadata["error"]
    assert "step 2" in got.metadata["error"] and got.metadata["env_restarts"] == 1


def test_a_dying_environment_process_is_restarted_then_reported(tokenizer, tmp_path):
    (tmp_path / "a").mkdir()
    _, got, builds = _run(tokenizer, tmp_path / "a", "die", bad_builds=1)
    assert builds == 2 and got.success is True and got.metadata["env_restarts"] == 1
    (tmp_path / "b").mkdir()
    _, bad, _ = _run(tokenizer, tmp_path / "b", "die", bad_builds=100, retries=1)
    assert bad.metadata["end_reason"] == "env_error" and "exit code 3" in bad.metadata["error"]


def test_an_exception_inside_the_environment_keeps_its_type_and_message(tokenizer, tmp_path):
    _, got, _ = _run(tokenizer, tmp_path, "raise", bad_builds=100, retries=0)
    assert got.metadata["end_reason"] == "env_error"
    assert "RuntimeError: simulator crashed" in got.metadata["error"]


def _gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return True
    return any(line.startswith("State:") and ("Z" in line or "X" in line) for line in state.splitlines())


def test_a_timeout_kills_the_simulators_own_subprocess(tmp_path):
    traj = _traj()
    pid_file = tmp_path / "pid"
    env = IsolatedEnv(lambda: BadEnv(traj, tmp_path / "n", "spawn", at=1, bad_builds=1, pid_file=pid_file), 1.0)
    env.reset()
    with pytest.raises(EnvTimeout):
        env.step("look")
    pid = int(pid_file.read_text())
    deadline = time.monotonic() + 10
    while not _gone(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _gone(pid)


def test_the_proxy_passes_the_expert_and_the_start_error_through(tmp_path):
    trajs = [_traj(i) for i in range(3)]
    direct = collect_expert([EpisodeSpec(t.id, lambda t=t: ReplayEnv(t)) for t in trajs], "alfworld")
    isolated = collect_expert([EpisodeSpec(t.id, lambda t=t: ReplayEnv(t)) for t in trajs], "alfworld",
                              opts=LoopOptions(env_timeout_s=10))
    assert [[u.action for u in t.turns] for t in isolated] == [[u.action for u in t.turns] for t in direct]
    assert all(t.success for t in isolated)

    def broken():
        raise ConnectionError("no simulator")
    with pytest.raises(EnvCallError, match="ConnectionError: no simulator"):
        IsolatedEnv(broken, 5)
    env = IsolatedEnv(lambda: ReplayEnv(trajs[0]), 5)
    assert env.benchmark == "alfworld" and not hasattr(env, "step_response")
    env.close()
    env.close()  # idempotent


_PREPARED: dict[str, int] = {}  # what a spec's prepare did in the parent, read by the forked environments


class PreparedEnv(ReplayEnv):
    """A replay whose first observation says which process prepared the shared start-up and which builds it."""

    def reset(self, seed=None):
        first = super().reset(seed)
        return dataclasses.replace(first, info={"prepared_by": _PREPARED.get("pid"), "built_by": os.getpid()})


def test_prepare_runs_once_in_the_parent_and_the_forked_environments_inherit_it():
    trajs = [_traj(i) for i in range(3)]
    calls: list[int] = []

    def prepare():
        calls.append(os.getpid())
        _PREPARED["pid"] = os.getpid()

    _PREPARED.clear()
    specs = [EpisodeSpec(t.id, lambda t=t: PreparedEnv(t), prepare=prepare) for t in trajs]
    got = collect_expert(specs, "alfworld", opts=LoopOptions(env_timeout_s=10))
    assert calls == [os.getpid()]  # once for the three episodes, here, before any environment started
    assert all(t.success for t in got)
    assert {t.metadata["prepared_by"] for t in got} == {os.getpid()}  # the children saw the parent's work …
    assert os.getpid() not in {t.metadata["built_by"] for t in got}  # … from their own processes
    # distinct prepares run once each; in-process episodes get them too
    other: list[int] = []
    specs[2] = dataclasses.replace(specs[2], prepare=lambda: other.append(1))
    collect_expert(specs, "alfworld")
    assert len(calls) == 2 and other == [1]
