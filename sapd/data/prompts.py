"""Prompt rendering for a decision prefix hₜ = (x, o₁, a₁, …, a_{t−1}, oₜ) (docs/SAPD.md §1, Eq. 3).

One function renders the messages of step ``t`` of a trajectory; the prefix builder and the multi-turn
agent loop both call it (with the same :class:`PrefixOptions`), so offline prefixes and live prompts are
byte-identical.

Two styles:

- ``step`` (default; the verl-agent / SDAR contract of docs/FORMATS.md): a single user message holding the
  task, the most recent ``history_length`` (observation, action) pairs and the current observation;
- ``chat``: the history as alternating user (observation) / assistant (recorded response) messages, as
  ETO-style multi-turn SFT data is laid out.

Neither ever shows the target decision aₜ or anything after it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from sapd.data.schema import Trajectory
from sapd.method.benchmarks import BenchmarkSpec

PromptStyle = Literal["step", "chat"]


@dataclass
class PrefixOptions:
    """How a run's prefixes are rendered (history, style), filtered by length and split."""

    history_length: int | None = None  # recent (obs, action) pairs in a prompt; None = benchmark default
    full_history: bool = False  # show every earlier pair (overrides history_length)
    prompt_style: PromptStyle = "step"
    max_prompt_tokens: int | None = None  # drop prefixes whose rendered prompt is longer
    val_fraction: float = 0.05  # share of trajectories held out (docs/SAPD.md §5)
    seed: int = 0  # split seed (docs/SAPD.md §5)

    def effective_history(self, spec: BenchmarkSpec) -> int | None:
        if self.full_history:
            return None
        return spec.history_length if self.history_length is None else self.history_length

THINK_HINT = ("You should first reason step-by-step about the current situation. This reasoning process MUST "
              "be enclosed within <think> </think> tags.")


def _recent(t: int, history_length: int | None) -> range:
    """Indices j < t of the pairs to show: all of them, or the most recent ``history_length``."""
    start = 0 if history_length is None else max(0, t - history_length)
    return range(start, t)


def _admissible_line(actions: list[str] | None) -> str:
    if actions is None:
        return ""
    return "Your admissible actions of the current situation are: [" + ", ".join(f"'{a}'" for a in actions) + "].\n"


def action_step_prompt(spec: BenchmarkSpec, traj: Trajectory, t: int, history_length: int | None) -> str:
    """The ALFWorld-style step prompt of docs/FORMATS.md for turn ``t`` (0-based)."""
    turn = traj.turns[t]
    lines = [f"{spec.intro} Your task is to: {traj.task}\n"]
    shown = _recent(t, history_length)
    if t > 0:
        history = "\n".join(f"[Observation {j + 1}: '{traj.turns[j].observation}', "
                            f"Action {j + 1}: '{traj.turns[j].action}']" for j in shown)
        lines.append(f"Prior to this step, you have already taken {t} step(s). Below are the most recent "
                     f"{len(shown)} observations and the corresponding actions you took: {history}\n")
    lines.append(f"You are now at step {t + 1} and your current observation is: {turn.observation}\n")
    lines.append(_admissible_line(turn.admissible_actions))
    lines.append(f"\nNow it's your turn to take an action.\n{THINK_HINT}\n{spec.action_hint}")
    return "".join(lines)


def search_step_prompt(spec: BenchmarkSpec, traj: Trajectory, t: int, history_length: int | None) -> str:
    """Search-QA step prompt: the question and the recent (query, retrieved information) pairs. The
    observation of turn j+1 is what the search of turn j returned."""
    lines = [f"{spec.intro}\nQuestion: {traj.task}\n"]
    shown = _recent(t, history_length)
    if t > 0:
        history = "\n".join(f"[Search {j + 1}: '{traj.turns[j].action}', "
                            f"Information {j + 1}: {traj.turns[j + 1].observation}]" for j in shown)
        lines.append(f"Prior to this step, you have already searched {t} time(s). Below are the most recent "
                     f"{len(shown)} searches and the information they returned:\n{history}\n")
    lines.append(f"You are now at step {t + 1}.\n")
    lines.append(f"\n{THINK_HINT}\n{spec.action_hint}")
    return "".join(lines)


def render_messages(traj: Trajectory, t: int, spec: BenchmarkSpec, history_length: int | None,
                    style: PromptStyle = "step") -> list[dict[str, str]]:
    """Chat messages of the prefix before decision ``t`` (0-based)."""
    if not 0 <= t < len(traj.turns):
        raise IndexError(f"trajectory {traj.id} has {len(traj.turns)} turns; no decision {t}")
    if style == "step":
        render = search_step_prompt if spec.decision == "search" else action_step_prompt
        return [{"role": "user", "content": render(spec, traj, t, history_length)}]
    if style == "chat":
        task = f"Question: {traj.task}" if spec.decision == "search" else f"Your task is to: {traj.task}"
        first = [f"{spec.intro}", task, THINK_HINT, spec.action_hint]
        messages: list[dict[str, str]] = []
        shown = list(_recent(t, history_length)) + [t]
        for n, j in enumerate(shown):
            obs = traj.turns[j].observation
            content = "\n".join(first + ([obs] if obs else [])) if n == 0 else obs
            messages.append({"role": "user", "content": content})
            if j < t:
                messages.append({"role": "assistant", "content": traj.turns[j].response})
        return messages
    raise ValueError(f"unknown prompt style {style!r}; expected 'step' or 'chat'")


def render_prompt(tokenizer, messages: list[dict[str, str]]) -> str:
    """The prompt text of ``messages`` through the tokenizer's chat template, ending where the model answers."""
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
