"""The multi-turn agent loop: episodes in environments, recorded as native trajectories.

Every step's prompt is rendered by exactly the code the prefix builder uses: the episode so far is a
:class:`~sapd.data.schema.Trajectory` whose turns are the steps taken plus the current observation as
the next turn's observation, and the prompt of decision t is
``render_prompt(tokenizer, render_messages(traj, t, spec, history, style))`` with the history and style
of a :class:`~sapd.data.prompts.PrefixOptions`. So a recorded trajectory replayed through the loop
gives byte-identical prompts to its prefixes (tested), and a trajectory recorded here builds the
prefixes its prompts were.

:func:`run_episodes` batches all live episodes through a :class:`~sapd.models.generation.Generator`
(one ``generate`` call per step, one sample each), parses each response with
:func:`~sapd.method.benchmarks.parse_decision` and enforces the horizon. A malformed response is an invalid
step (counted, by reason; the environment gets ``invalid_action``, "look" by default), never a crash.
An environment that raises is rebuilt from its factory, reset and fast-forwarded through the actions
taken so far (checking it reproduces the recorded observations), at most ``max_env_retries`` times
per episode; past that the episode ends, recorded as failed with the reason. With
``LoopOptions.env_timeout_s`` each environment runs in a child process and a call that hangs past
the deadline is killed and handled the same way (:mod:`sapd.envs.isolated`).

:func:`collect_expert` runs the same loop with the environment's expert choosing each action and a
short templated thought: responses ``<think>…</think>\\n<action>…</action>``, the offline pools the rest
of the project trains on.

Every episode comes back as a Trajectory (``success`` = won, ``category``, ``final_observation``) with
``metadata``: ``policy``, ``end_reason`` (done | horizon | env_error | expert_stuck), ``steps``,
``score``, ``invalid_steps``, ``invalid_reasons``, ``invalid_turns``, ``inadmissible_steps``,
``env_restarts``, ``error`` and the environment's reset info (game, max score …); ``reworded_steps`` where
an ALFWorld environment translated actions from the other ALFWorld wording (``put X in/on Y`` ↔
``move X to Y``) into its engine's.
"""

from __future__ import annotations

import dataclasses
import random
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Literal, Sequence

from sapd.data.prompts import PrefixOptions, render_messages, render_prompt
from sapd.data.schema import Trajectory, Turn
from sapd.envs.base import Environment, EpisodeSpec, StepInfo, StepResult
from sapd.envs.isolated import IsolatedEnv
from sapd.method.benchmarks import BenchmarkSpec, get_benchmark, parse_decision
from sapd.models.generation import SamplingParams, stops_for


@dataclass
class LoopOptions:
    prompt: PrefixOptions = field(default_factory=PrefixOptions)  # history length and style, as for prefixes
    horizon: int | None = None  # max decisions per episode; None = the benchmark's
    invalid_action: str | None = "look"  # sent for an invalid response; None = the environment is not stepped
    max_env_retries: int = 2  # environment rebuilds per episode before it is recorded as failed
    # seconds any one environment call may take; set, each episode's environment runs in its own
    # process (sapd.envs.isolated), so a hanging one is killed and rebuilt like a crashed one
    env_timeout_s: float | None = None
    # episodes played at once (their environments alive, their prompts one generate batch); a finished
    # episode's place goes to the next. Bounds memory: each live environment (a process, a JVM …) costs
    # some. None = all at once.
    max_live_episodes: int | None = 32


class EpisodeFailed(RuntimeError):
    pass


def _jsonable(info: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in info.items() if isinstance(v, (str, int, float, bool, type(None)))}


def step_env(env: Environment, response: str, action: str) -> StepResult:
    """One decision: ``env.step_response(response, action)`` where the environment reads the raw response
    itself (search QA: a search or the answer), else ``env.step(action)``."""
    step_response = getattr(env, "step_response", None)
    return step_response(response, action) if step_response is not None else env.step(action)


class _Episode:
    def __init__(self, spec: EpisodeSpec, benchmark: BenchmarkSpec, opts: LoopOptions, policy: str) -> None:
        self.spec, self.bench, self.opts = spec, benchmark, opts
        self.env: Environment | None = None
        self.task = ""
        self.category = spec.category
        self.turns: list[Turn] = []
        self.obs = ""
        self.admissible: list[str] | None = None
        self.executed: list[str] = []  # actions sent to the environment (for a restart's fast-forward)
        self.responses: list[str] = []  # the response of each of them
        self.seen: list[str] = []  # the observation each of them returned
        self.finished = False
        self.final_observation: str | None = None
        self.meta: dict[str, Any] = {"policy": policy, "end_reason": None, "steps": 0, "score": None,
                                     "invalid_steps": 0, "invalid_reasons": {}, "invalid_turns": [],
                                     "inadmissible_steps": 0, "env_restarts": 0, "error": None}
        self.won = False
        self._reset_info: StepInfo | None = None

    # -- environment handling -------------------------------------------------------------------------

    def _close(self) -> None:
        if self.env is not None:
            try:
                self.env.close()
            except Exception:  # noqa: BLE001 - a crashed environment may not close cleanly
                pass
            self.env = None

    def _fresh_env(self) -> StepInfo:
        self._close()
        if self.opts.env_timeout_s is not None:
            self.env = IsolatedEnv(self.spec.make_env, self.opts.env_timeout_s)
        else:
            self.env = self.spec.make_env()
        first = self.env.reset(self.spec.seed)
        for i, action in enumerate(self.executed):  # fast-forward a rebuilt environment
            res = step_env(self.env, self.responses[i], action)
            if res.observation != self.seen[i]:
                raise EpisodeFailed(f"restarted environment diverged at step {i + 1}: "
                                    f"{res.observation[:80]!r} != {self.seen[i][:80]!r}")
        return first

    def _attempt(self, what: str, op: Callable[[Environment], Any]) -> Any:
        """``op(env)``, rebuilding the environment (reset + fast-forward) after a failure, at most
        ``max_env_retries`` times; past that, or when a rebuild diverges, the episode fails (None)."""
        while True:
            try:
                if self.env is None:
                    self._reset_info = self._fresh_env()
                assert self.env is not None
                return op(self.env)
            except EpisodeFailed as e:
                self.fail("env_error", f"{what}: {e}")
                return None
            except Exception as e:  # noqa: BLE001 - any environment failure is recorded, never raised
                self._close()
                if self.meta["env_restarts"] >= self.opts.max_env_retries:
                    self.fail("env_error", f"{what}: {type(e).__name__}: {e} "
                                           f"(after {self.meta['env_restarts']} restart(s))")
                    return None
                self.meta["env_restarts"] += 1

    def start(self) -> None:
        info = self._attempt("reset", lambda env: self._reset_info)
        if info is None:
            return
        self.task = info.task
        self.category = self.spec.category if self.spec.category is not None else info.category
        self.obs, self.admissible = info.observation, info.admissible_actions
        self.meta.update(_jsonable(info.info))
        self._check_horizon()

    def fail(self, reason: str, error: str) -> None:
        self.meta["end_reason"], self.meta["error"] = reason, error
        self.won = False
        self.finish()

    def finish(self) -> None:
        self.finished = True
        self._close()

    def _check_horizon(self) -> None:
        horizon = self.opts.horizon if self.opts.horizon is not None else self.bench.horizon
        if not self.finished and len(self.turns) >= horizon:
            self.meta["end_reason"] = "horizon"
            self.finish()

    # -- decisions -----------------------------------------------------------------------------------

    def pending(self) -> Trajectory:
        """The episode so far with the current observation as the next turn's (its decision blank)."""
        return Trajectory(id=self.spec.id, benchmark=self.bench.name, task=self.task,
                          turns=[*self.turns, Turn(self.obs, "", "", self.admissible)], category=self.category)

    def messages(self) -> list[dict[str, str]]:
        p = self.opts.prompt
        return render_messages(self.pending(), len(self.turns), self.bench, p.effective_history(self.bench),
                               p.prompt_style)

    def act(self, response: str, action: str | None, invalid_reason: str | None = None) -> None:
        """Record the decision ``response`` (executing ``action``; None = invalid) and step."""
        t = len(self.turns)
        if action is None:
            self.meta["invalid_steps"] += 1
            reasons = self.meta["invalid_reasons"]
            reasons[invalid_reason or "invalid"] = reasons.get(invalid_reason or "invalid", 0) + 1
            self.meta["invalid_turns"].append(t)
            action = self.opts.invalid_action
            inadmissible = False
        else:
            inadmissible = self.admissible is not None and action not in self.admissible
        if action is None:  # invalid and no no-op configured: the environment is not stepped
            self.turns.append(Turn(self.obs, response, "<invalid>", self.admissible))
            self.meta["steps"] = len(self.turns)
            self._check_horizon()
            return
        self.turns.append(Turn(self.obs, response, action, self.admissible))
        self.meta["steps"] = len(self.turns)
        res: StepResult | None = self._attempt(f"step {t + 1} ({action!r})",
                                               lambda env: step_env(env, response, action))
        if res is not None and res.info.get("reworded"):
            # ALFWorld: the action was in the engine's other wording ("put X in/on Y" ↔ "move X to Y")
            # and the environment played its translation: counted, not an inadmissible step
            self.meta["reworded_steps"] = self.meta.get("reworded_steps", 0) + 1
        elif inadmissible:
            self.meta["inadmissible_steps"] += 1
        if res is None:
            return
        self.executed.append(action)
        self.responses.append(response)
        self.seen.append(res.observation)
        self.obs, self.admissible = res.observation, res.admissible_actions
        if res.score is not None:
            self.meta["score"] = res.score
        if res.done:
            self.won = bool(res.won)
            self.final_observation = res.observation
            self.meta["end_reason"] = "done"
            self.finish()
            return
        self._check_horizon()
        if self.finished:
            self.final_observation = self.obs

    def trajectory(self) -> Trajectory:
        return Trajectory(id=self.spec.id, benchmark=self.bench.name, task=self.task, turns=list(self.turns),
                          category=self.category, success=self.won, final_observation=self.final_observation,
                          metadata=dict(self.meta))


def _run(specs: Sequence[EpisodeSpec], benchmark: BenchmarkSpec, opts: LoopOptions, policy: str,
         decide: Callable[[list[_Episode], int], list[tuple[str, str | None, str | None]]],
         progress: Callable[[int], None] | None) -> list[Trajectory]:
    for prepare in dict.fromkeys(s.prepare for s in specs if s.prepare is not None):
        prepare()  # once, here: every (forked) environment process starts with it
    episodes = [_Episode(s, benchmark, opts, policy) for s in specs]
    waiting = iter(episodes)
    window = opts.max_live_episodes or len(episodes)
    live: list[_Episode] = []

    def refill() -> None:
        # a finished episode's place goes to the next one in spec order (its environment starts now)
        while len(live) < window and (ep := next(waiting, None)) is not None:
            ep.start()
            if ep.finished:
                if progress:
                    progress(1)
            else:
                live.append(ep)

    refill()
    step = 0
    while live:
        decisions = decide(live, step)
        if len(decisions) != len(live):
            raise RuntimeError(f"policy returned {len(decisions)} decisions for {len(live)} live episodes")
        for ep, (response, action, reason) in zip(live, decisions):
            if not ep.finished:  # a policy may end an episode while deciding (the expert, when stuck)
                ep.act(response, action, reason)
            if ep.finished and progress:
                progress(1)
        live = [ep for ep in live if not ep.finished]
        refill()
        step += 1
    return [ep.trajectory() for ep in episodes]


def run_episodes(specs: Sequence[EpisodeSpec], generator: Any, tokenizer: Any, benchmark: str | BenchmarkSpec,
                 params: Any = None, opts: LoopOptions | None = None,
                 progress: Callable[[int], None] | None = None) -> list[Trajectory]:
    """Run every episode with the model behind ``generator`` (a :class:`~sapd.models.generation.Generator`),
    one batched ``generate`` call per step over the live episodes. ``params`` is a ``SamplingParams``
    (its ``n`` is forced to 1; its seed is advanced by the step index); by default greedy decoding
    with the benchmark's stop strings, so the same checkpoint gives the same episodes."""

    spec = benchmark if isinstance(benchmark, BenchmarkSpec) else get_benchmark(benchmark)
    opts = opts or LoopOptions()
    base = params or SamplingParams(n=1, temperature=0.0, stop=stops_for(spec.decision))

    def decide(live: list[_Episode], step: int) -> list[tuple[str, str | None, str | None]]:
        prompts = [render_prompt(tokenizer, ep.messages()) for ep in live]
        outs = generator.generate(prompts, dataclasses.replace(base, n=1, seed=base.seed + step))
        decisions: list[tuple[str, str | None, str | None]] = []
        for out in outs:
            text = out[0].text if out else ""
            d = parse_decision(text, spec)
            if d.valid and d.span is not None:  # the action as written (the parser lowercases its copy)
                decisions.append((text, text[d.span[0]:d.span[1]].strip(), None))
            else:
                decisions.append((text, None, d.reason))
        return decisions

    return _run(specs, spec, opts, "model", decide, progress)


# ---------------------------------------------------------------------------------------------------
# the expert


def expert_thought(action: str, task: str = "") -> str:
    """A short templated thought for an expert action."""
    a = action.strip()
    m = re.match(r"(\w+)\s*(.*)", a)
    verb, rest = (m.group(1).lower(), m.group(2)) if m else ("", a)
    obj = re.split(r"\s+(?:from|with|in|on|into|to)\s+", rest)[0] if rest else ""
    if verb == "go":
        return f"The next place I need to reach lies {rest}, so I should go {rest}."
    if verb in ("take", "pick"):
        return f"I need the {obj} for the task, so I should take it."
    if verb == "open":
        return f"The {obj} is closed and I need what is behind or inside it, so I should open it."
    if verb == "unlock":
        return f"The {obj} is locked; I have what unlocks it, so I should unlock it."
    if verb == "examine" and "cookbook" in rest:
        return "The cookbook holds the recipe I must follow, so I should read it first."
    if verb in ("examine", "look", "read"):
        return f"I should look closer at the {obj or 'surroundings'} to learn what to do next."
    if verb in ("put", "insert", "place", "move"):
        return f"The task asks for the {obj} to be placed there, so I should {a}."
    if verb in ("cook", "chop", "slice", "dice", "heat", "cool", "clean"):
        return f"The recipe needs the {obj} prepared this way, so I should {a}."
    if verb == "drop":
        return f"I no longer need the {obj}, so I should drop it."
    if verb in ("prepare", "eat"):
        return f"Everything the task needs is ready, so I should {a}."
    return f"The next step toward the goal is to {a}."


ThoughtStyle = Literal["announce", "observe"]
_ROOM = re.compile(r"-=\s*(.+?)\s*=-")


def observation_thought(observation: str) -> str:
    """A thought that describes the situation and never names the action (``thought="observe"``): the
    room from the observation's ``-= Room =-`` header. With it the decision lives in the action tokens
    alone, which is what SAPD's action-only step score assumes (the "announce" thought states the
    action, so a teacher scoring the action after it measures consistency, not correctness)."""
    m = _ROOM.search(observation or "")
    if m:
        return f"I am in the {m.group(1).strip().lower()}."
    return "I take stock of where I am."


def expert_response(action: str, task: str = "", thought: ThoughtStyle = "announce", observation: str = "") -> str:
    """The expert's recorded response: a templated thought, then the action. ``thought="announce"``
    (default) names the action in the thought (:func:`expert_thought`); ``"observe"`` does not
    (:func:`observation_thought` of the current ``observation``)."""
    if thought == "observe":
        text = observation_thought(observation)
    elif thought == "announce":
        text = expert_thought(action, task)
    else:
        raise ValueError(f"thought must be 'announce' or 'observe', not {thought!r}")
    return f"<think>{text}</think>\n<action>{action}</action>"


def collect_expert(specs: Sequence[EpisodeSpec], benchmark: str | BenchmarkSpec = "textworld",
                   opts: LoopOptions | None = None, successful_only: bool = False,
                   progress: Callable[[int], None] | None = None, *, thought: ThoughtStyle = "announce",
                   noise: float = 0.0, noise_seed: int = 0) -> list[Trajectory]:
    """Expert trajectories: each environment's ``expert_action()`` chooses every action; the response is
    :func:`expert_response` (with ``thought``). With ``successful_only`` the episodes the expert did not
    win are dropped.

    ``noise`` = ε > 0 makes an ε-noisy expert: at each step, with probability ε, a uniformly random
    admissible action other than the expert's is taken instead (the environment's expert re-plans from
    the state that leads to). Such logs hold histories a clean-expert teacher never saw — the
    behaviour-prefix shift SAPD targets. The draw is seeded per episode by (``noise_seed``, episode id),
    so a collection is reproducible; the noisy turns are listed in the episode's ``meta["noisy_turns"]``."""
    if not 0.0 <= noise < 1.0:
        raise ValueError(f"noise must be in [0, 1), not {noise}")
    spec = benchmark if isinstance(benchmark, BenchmarkSpec) else get_benchmark(benchmark)
    opts = opts or LoopOptions()
    rngs: dict[str, random.Random] = {}

    def perturb(ep: _Episode, action: str) -> str:
        if noise <= 0 or not ep.admissible:
            return action
        rng = rngs.setdefault(ep.spec.id, random.Random(f"{noise_seed}:{ep.spec.id}"))
        if rng.random() >= noise:
            return action
        others = sorted(a for a in ep.admissible if a != action)
        if not others:
            return action
        ep.meta.setdefault("noisy_turns", []).append(len(ep.turns))
        return rng.choice(others)

    def decide(live: list[_Episode], step: int) -> list[tuple[str, str | None, str | None]]:
        out: list[tuple[str, str | None, str | None]] = []
        for ep in live:
            expert = getattr(ep.env, "expert_action", None)
            action = None
            if expert is not None:
                try:
                    action = expert()
                except Exception as e:  # noqa: BLE001
                    ep.meta["error"] = f"expert: {type(e).__name__}: {e}"
            if not action:
                ep.meta["end_reason"] = "expert_stuck"
                ep.finish()
                out.append(("", None, None))  # ignored: the episode is finished
                continue
            action = perturb(ep, action)
            out.append((expert_response(action, ep.task, thought, ep.obs), action, None))
        return out

    trajs = _run(specs, spec, opts, "expert", decide, progress)
    return [t for t in trajs if t.success] if successful_only else trajs


# ---------------------------------------------------------------------------------------------------
# results


def success_interval(successes: int, n: int, z: float = 1.959964) -> tuple[float, float]:
    """The 95 % Wilson score interval of a success rate (sound at 0 and 1 and for small n).

    >>> [round(x, 3) for x in success_interval(6, 6)]
    [0.61, 1.0]
    """
    if n == 0:
        return (0.0, 1.0)
    p = successes / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * ((p * (1 - p) / n + z * z / (4 * n * n)) ** 0.5) / denom
    return (max(0.0, centre - half), min(1.0, centre + half))


def summarize(trajectories: Sequence[Trajectory]) -> dict[str, Any]:
    """Success per category and overall (with its 95 % Wilson interval, ``success_ci``), mean steps, the
    invalid-step rate and, where any, the ALFWorld actions played in the engine's other wording."""
    by_cat: dict[str, list[Trajectory]] = {}
    for t in trajectories:
        by_cat.setdefault(t.category or "-", []).append(t)

    def stats(ts: Sequence[Trajectory]) -> dict[str, Any]:
        steps = sum(len(t.turns) for t in ts)
        invalid = sum(int(t.metadata.get("invalid_steps", 0)) for t in ts)
        won = sum(bool(t.success) for t in ts)
        out = {"episodes": len(ts), "success": won / len(ts) if ts else 0.0,
               "success_ci": list(success_interval(won, len(ts))),
               "mean_steps": steps / len(ts) if ts else 0.0,
               "invalid_step_rate": invalid / steps if steps else 0.0,
               "env_errors": sum(t.metadata.get("end_reason") == "env_error" for t in ts)}
        if reworded := sum(int(t.metadata.get("reworded_steps", 0)) for t in ts):
            out["reworded_steps"] = reworded
        return out

    return {"overall": stats(trajectories), "by_category": {c: stats(ts) for c, ts in sorted(by_cat.items())}}
