"""The one environment protocol the agent loop, evaluation and expert collection speak.

An environment is one episode source (one game, one task): ``reset`` starts an episode and returns
the first observation with the task instruction, ``step`` executes one action string. Environments are
used for evaluation and for producing offline trajectory pools only — training never touches one.

:class:`ReplayEnv` replays a recorded :class:`~sapd.data.schema.Trajectory` (its observations, in
order, whatever the actions): the agent loop's byte-identity test and transcript-based adapter tests
use it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, runtime_checkable

from sapd.data.schema import Trajectory


@dataclass
class StepInfo:
    """What ``reset`` returns: the first observation o₁ and the task x."""

    observation: str
    task: str
    admissible_actions: list[str] | None = None
    category: str | None = None
    info: dict[str, Any] = field(default_factory=dict)  # environment-specific extras (game file, max score…)


@dataclass
class StepResult:
    """What ``step`` returns: the next observation and the outcome so far."""

    observation: str
    reward: float = 0.0
    done: bool = False
    won: bool = False
    score: float | None = None  # cumulative score, where the environment keeps one
    admissible_actions: list[str] | None = None
    info: dict[str, Any] = field(default_factory=dict)


@runtime_checkable
class Environment(Protocol):
    benchmark: str  # the BenchmarkSpec name whose prompts this environment's episodes use

    def reset(self, seed: int | None = None) -> StepInfo: ...

    def step(self, action: str) -> StepResult: ...

    def close(self) -> None: ...


@runtime_checkable
class ExpertEnvironment(Environment, Protocol):
    def expert_action(self) -> str | None:
        """The expert's next action from the current state (None when it has none)."""
        ...


@dataclass
class EpisodeSpec:
    """One episode to run: ``make_env`` builds a fresh environment (called again after a crash)."""

    id: str
    make_env: Callable[[], Environment]
    seed: int | None = None
    category: str | None = None  # overrides the environment's
    # run once, before the first environment is built, in the process that runs the episodes: start-up
    # every episode shares (imports, parses), which environment processes forked afterwards inherit
    prepare: Callable[[], None] | None = None


class ReplayEnv:
    """Replays a recorded trajectory: ``reset`` gives turn 0's observation, the k-th ``step`` gives turn
    k's observation (then ``final_observation``) and ends the episode after the recorded number of
    turns with the recorded outcome. The action passed in is recorded in ``actions`` and otherwise
    ignored; its expert is the recorded action sequence."""

    def __init__(self, trajectory: Trajectory) -> None:
        self.trajectory = trajectory
        self.benchmark = trajectory.benchmark
        self.actions: list[str] = []
        self._t = 0

    def reset(self, seed: int | None = None) -> StepInfo:
        self._t = 0
        self.actions = []
        first = self.trajectory.turns[0]
        return StepInfo(observation=first.observation, task=self.trajectory.task,
                        admissible_actions=first.admissible_actions, category=self.trajectory.category,
                        info={"trajectory_id": self.trajectory.id})

    def step(self, action: str) -> StepResult:
        turns = self.trajectory.turns
        if self._t >= len(turns):
            raise RuntimeError(f"replay of {self.trajectory.id}: step after the recorded end")
        self.actions.append(action)
        self._t += 1
        if self._t < len(turns):
            nxt = turns[self._t]
            return StepResult(observation=nxt.observation, admissible_actions=nxt.admissible_actions)
        won = bool(self.trajectory.success)
        return StepResult(observation=self.trajectory.final_observation or "", reward=float(won), done=True,
                          won=won, score=float(won))

    def expert_action(self) -> str | None:
        turns = self.trajectory.turns
        return turns[self._t].action if self._t < len(turns) else None

    def close(self) -> None:
        pass
