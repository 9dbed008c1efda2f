"""``skillrl``: SkillRL / verl-agent per-step records ``{"instruction", "output"}`` whose prompt is the
fully rendered step prompt, regrouped into trajectories by task string and the step number parsed from
the prompt (docs/FORMATS.md).
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import Any

from sapd.data.errors import InvalidRecordError
from sapd.data.fit import foreign_benchmark, text_problem
from sapd.data.formats.base import (
    TASK_LINE,
    Collector,
    LoadOptions,
    Records,
    TrajectoryFormat,
    checked_turn,
    require,
    reword_action,
    reworded_response,
)
from sapd.data.schema import Trajectory
from sapd.method.benchmarks import BenchmarkSpec, get_benchmark, parse_decision

_STEP = re.compile(r"You are now at step (\d+)")
# verl-agent / SkillRL render step 1 (and every step when history_length is 0) with the no-history
# template: "Your current observation is: …", no step number, the task only inside the observation
_NO_HISTORY = re.compile(r"^\s*Your current observation is:", re.M)
_OBS = re.compile(r"current observation is:\s*(.*?)(?:\nYour admissible actions|\n\nNow it's your turn|\Z)", re.S)
_ADMISSIBLE = re.compile(r"Your admissible actions of the current situation are:\s*\[(.*?)\]\.?\s*(?:\n|\Z)", re.S)
_QUOTED = re.compile(r"'(?:[^'\\\n]|\\.)*'|\"(?:[^\"\\\n]|\\.)*\"")


def parse_action_list(text: str) -> list[str] | None:
    """The items of a printed action list: Python-quoted strings separated by commas and/or white space,
    or unquoted comma-separated items; None when it is neither. SkillRL joins the quoted actions with
    "\\n " and no comma, which Python's literal parser would glue into one string.

    >>> parse_action_list("'go to desk 1'\\n 'inventory'\\n 'look'")
    ['go to desk 1', 'inventory', 'look']
    >>> parse_action_list("'look', \\"take mug 1 from desk 1\\"")
    ['look', 'take mug 1 from desk 1']
    >>> parse_action_list("look, inventory")
    ['look', 'inventory']
    >>> parse_action_list("'look' x 'inventory'") is None
    True
    """
    text = text.strip()
    if not text:
        return []
    if text[0] not in "'\"":
        items = [a.strip() for a in text.split(",") if a.strip()]
        return None if any(c in a for a in items for c in "'\"") else items
    items, pos = [], 0
    for m in _QUOTED.finditer(text):
        if text[pos:m.start()].strip(" \t\r\n,"):
            return None
        items.append(ast.literal_eval(m.group()))
        pos = m.end()
    return items if not text[pos:].strip(" \t\r\n,") else None


@dataclass
class _Step:
    loc: str
    task: str
    step: int
    observation: str
    admissible: list[str] | None
    output: str


def _task_key(task: str) -> str:
    # SkillRL's step-1 prompt has the task as the environment wrote it ("… toiletpaperhanger."), later
    # steps as the template's header, which may drop the full stop
    return " ".join(task.split()).rstrip(".")


def _parse_skillrl_step(rec: Any, path: str, loc: str, spec: BenchmarkSpec) -> _Step:
    prompt = require(rec, "instruction", path, loc)
    output = require(rec, "output", path, loc)
    if (p := foreign_benchmark(prompt, spec)) is not None:
        raise InvalidRecordError(path, loc, "instruction", *p)
    m_task = TASK_LINE.search(prompt)
    if not m_task:
        raise InvalidRecordError(path, loc, "instruction", "missing_task", "no 'Your task is to: …' in the prompt")
    m_step = _STEP.search(prompt)
    if m_step:
        step = int(m_step.group(1))
    elif _NO_HISTORY.search(prompt) and "Prior to this step" not in prompt:
        step = 1
    else:
        raise InvalidRecordError(path, loc, "instruction", "missing_step",
                                 "no 'You are now at step N' in the prompt, and it is not the no-history (step 1) "
                                 "template ('Your current observation is: …')")
    m_obs = _OBS.search(prompt)
    if not m_obs:
        raise InvalidRecordError(path, loc, "instruction", "missing_observation",
                                 "no 'current observation is: …' in the prompt")
    m_adm = _ADMISSIBLE.search(prompt)
    admissible = None
    if m_adm:
        admissible = parse_action_list(m_adm.group(1))
        if admissible is None:
            raise InvalidRecordError(path, loc, "instruction", "bad_admissible_list",
                                     f"cannot read the admissible actions [{m_adm.group(1)[:60]}…]: expected quoted "
                                     "actions separated by commas or white space")
    return _Step(loc=loc, task=m_task.group(1).strip(), step=step, observation=m_obs.group(1).strip(),
                 admissible=admissible, output=output)


def _skillrl_trajectory(steps: list[_Step], path: str, opts: LoadOptions) -> Trajectory:
    spec = get_benchmark(opts.benchmark)
    loc = steps[0].loc if len(steps) == 1 else f"{steps[0].loc}–{steps[-1].loc.split()[-1]}"
    if steps[0].step != 1:
        raise InvalidRecordError(path, loc, "instruction", "incomplete_trajectory",
                                 f"trajectory starts at step {steps[0].step}, not step 1 (earlier steps missing)")
    if (p := text_problem(steps[0].task)) is not None:
        raise InvalidRecordError(path, steps[0].loc, "instruction", *p)
    turns = []
    for s in steps:
        decision = parse_decision(s.output, spec)
        if not decision.content:
            raise InvalidRecordError(path, s.loc, "output", "empty_action", f"no usable action: {decision.reason}")
        action = reword_action(decision.content, opts.action_wording) if spec.decision == "action" else decision.content
        if opts.check_admissible and s.admissible is not None and decision.content not in s.admissible:
            raise InvalidRecordError(path, s.loc, "output", "action_not_admissible",
                                     f"action '{decision.content}' is not among the prompt's admissible actions")
        response = reworded_response(s.output, decision.span, action, decision.content)
        turns.append(checked_turn(path, s.loc, spec, observation=s.observation, obs_field="instruction",
                                  response=response, action=action, resp_field="output", admissible=s.admissible))
    stem = PurePosixPath(path).stem
    tid = f"{stem}:{steps[0].loc.replace('line ', 'L')}"
    return Trajectory(id=tid, benchmark=opts.benchmark, task=steps[0].task, turns=turns,
                      metadata={"source_format": "skillrl", "source_lines": loc})



def read(records: Records, path: str, opts: LoadOptions, out: Collector) -> None:
    """Consecutive steps of one task (step numbers counting up by one) are one trajectory; each step record
    is checked as it is read, the trajectory once it is complete."""
    spec = get_benchmark(opts.benchmark)
    group: list[_Step] = []

    def flush() -> None:
        steps = list(group)
        out.keep(lambda: _skillrl_trajectory(steps, path, opts), path, steps[0].loc, len(steps))
        group.clear()

    for loc, rec in out.records(records, path):
        try:
            step = _parse_skillrl_step(rec, path, loc, spec)
        except InvalidRecordError as e:
            out.invalid(e)
            continue
        if group and (_task_key(step.task) != _task_key(group[-1].task) or step.step != group[-1].step + 1):
            flush()
        group.append(step)
    if group and not out.full():  # a sample that ends mid-trajectory: its steps are checked, not assembled
        flush()


def detect(rec: dict[str, Any]) -> str | None:
    return "records have 'instruction' and 'output'" if {"instruction", "output"} <= set(rec) else None


FORMAT = TrajectoryFormat("skillrl", (".jsonl", ".json"), detect, read)
