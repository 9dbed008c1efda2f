"""The conversation layouts — ETO / SPA-RL (``eto``), AgentGym's AgentTraj (``agentgym``) and FireAct
(``fireact``): one reader, three entries (docs/FORMATS.md).

- ``eto``: a JSON list (or JSONL) of ``{"id", "game_file"?, "conversations" | "messages"}`` with
  ``from``/``value`` or ``role``/``content`` messages and "Thought: …\\nAction: …" responses, converted to
  the benchmark's decision block (``<think>…</think>\\n<action>…</action>``);
- ``agentgym``: ``{"item_id", "conversations": [{"from", "value", "loss"}]}``;
- ``fireact``: FireAct's fine-tuning JSONL ``{"messages": [...]}`` (no id: the line names it) and its
  recorded evaluation files, a dict of question id → ``{"traj", "reward", "gt", …}``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import Any, Iterator

from sapd.data.errors import InvalidRecordError
from sapd.data.fit import foreign_benchmark, text_problem
from sapd.data.formats.base import (
    TASK_LINE,
    Collector,
    LoadOptions,
    Records,
    TrajectoryFormat,
    checked_turn,
    keys_summary,
    one_per_record,
    record_location,
    require,
    reword_action,
    reworded_response,
)
from sapd.data.react import ResponseProblem, decision_response, is_acknowledgement, is_tagged, parse_react
from sapd.data.schema import Trajectory
from sapd.method.benchmarks import BenchmarkSpec, alfworld_category, get_benchmark, parse_decision

_ROLES = {"human": "human", "user": "human", "gpt": "gpt", "assistant": "gpt", "system": "system"}
_TASK_SENTENCE = re.compile(r"Your task is to\b")
_WEBSHOP_INSTRUCTION = re.compile(r"Instruction:\s*\[SEP\]\s*(.+?)\s*(?:\[SEP\]|\n|$)")
_AVAILABLE_ACTIONS = re.compile(r"^AVAILABLE ACTIONS:[ \t]*(.*)$", re.M)
_EPISODE_END = re.compile(r"Episode finished, reward = (\S+)")


@dataclass
class _Message:
    role: str  # human | gpt | system
    text: str
    field: str  # where its text is, for error messages: "conversations[3].value"
    role_field: str  # where its role is: "conversations[3].from"
    loss: Any = None  # AgentGym: False marks a reply that is not a training target


def _one_of(msg: dict, keys: tuple[str, str], path: str, loc: str, where: str) -> tuple[str, str]:
    """(key, value) of the message field spelled either way (``from``/``role``, ``value``/``content``)."""
    found = [(k, msg[k]) for k in keys if k in msg]
    if not found:
        raise InvalidRecordError(path, loc, f"{where}.{keys[0]}", "missing_field",
                                 f"required field '{keys[0]}' (or '{keys[1]}') is missing; the message has "
                                 f"{keys_summary(msg)}")
    for k, v in found:
        if v is None:
            raise InvalidRecordError(path, loc, f"{where}.{k}", "missing_field",
                                     f"field '{k}' is null; give it text (\"\" when empty) or drop the record")
        if not isinstance(v, str):
            raise InvalidRecordError(path, loc, f"{where}.{k}", "bad_type", f"expected str, found {type(v).__name__}")
    if len(found) == 2 and found[0][1] != found[1][1] and not (
            keys[0] == "from" and _ROLES.get(found[0][1]) == _ROLES.get(found[1][1]) is not None):
        raise InvalidRecordError(path, loc, where, "conflicting_fields",
                                 f"'{keys[0]}' and '{keys[1]}' disagree ({found[0][1][:40]!r} vs "
                                 f"{found[1][1][:40]!r}); keep one of them")
    return found[0]


def _messages(rec: dict, key: str, path: str, loc: str) -> list[_Message]:
    raw = require(rec, key, path, loc, list)
    out = []
    for i, m in enumerate(raw):
        where = f"{key}[{i}]"
        if not isinstance(m, dict):
            raise InvalidRecordError(path, loc, where, "bad_type",
                                     f"expected a message object, found {type(m).__name__}")
        role_key, role = _one_of(m, ("from", "role"), path, loc, where)
        text_key, text = _one_of(m, ("value", "content"), path, loc, where)
        if role not in _ROLES:
            raise InvalidRecordError(path, loc, f"{where}.{role_key}", "unknown_role",
                                     f"unknown role '{role}' (expected human/user, gpt/assistant or system)")
        out.append(_Message(_ROLES[role], text, f"{where}.{text_key}", f"{where}.{role_key}", m.get("loss")))
    return out


def _strip_observation(text: str) -> str:
    text = text.strip()
    return text[len("Observation:"):].strip() if text.startswith("Observation:") else text


def _split_available(text: str) -> tuple[str, list[str] | None]:
    """AgentGym prints the admissible actions as an "AVAILABLE ACTIONS: a,b,c" line in the observation:
    (observation without it, the actions) — the step prompt shows them as its own admissible line."""
    m = _AVAILABLE_ACTIONS.search(text)
    if m is None:
        return text, None
    actions = [a.strip() for a in m.group(1).split(",") if a.strip()]
    return (text[:m.start()] + text[m.end():]).strip(), actions


def _missing_task(spec: BenchmarkSpec, text: str) -> str:
    expected = {"webshop": "'Instruction: [SEP] … [SEP]'", "scienceworld": "'Your task is to …'"}.get(
        spec.name, "'Your task is to: …'")
    hint = ""
    if spec.name != "scienceworld" and _TASK_SENTENCE.search(text) and not TASK_LINE.search(text):
        hint = (" It says 'Your task is to …' without a colon, as ScienceWorld does: is --benchmark scienceworld "
                "meant?")
    elif spec.name != "webshop" and _WEBSHOP_INSTRUCTION.search(text):
        hint = " It looks like a WebShop page: is --benchmark webshop meant?"
    elif spec.name == "webshop" and TASK_LINE.search(text):
        hint = " It says 'Your task is to: …', as ALFWorld does: is --benchmark alfworld meant?"
    start = " ".join(text.split())
    start = start if len(start) <= 100 else start[:100] + "…"
    return f"cannot find the task ({expected}) in the first observation, which starts {start!r}.{hint}"


def _task_and_first_observation(text: str, spec: BenchmarkSpec) -> tuple[str, str, list[str] | None]:
    """(task, first observation, admissible actions) from the episode's first human message; task "" when
    it cannot be found. Where each benchmark states its task (docs/FORMATS.md):

    - ALFWorld / TextWorld: the line after "Your task is to:" (the observation is the text around it);
    - WebShop: the text between "Instruction: [SEP]" and the next "[SEP]" (the page is the observation);
    - ScienceWorld: the paragraph starting "Your task is to" (no colon), whole, as the environment states it
      (sapd.envs.scienceworld_env keeps it so too); ETO shows no observation before the first action;
    - search QA: the question (after a "Question:" label when there is one); no observation yet.
    """
    body, admissible = _split_available(text)
    if spec.name == "webshop":
        m = _WEBSHOP_INSTRUCTION.search(body)
        return (m.group(1).strip() if m else ""), _strip_observation(body), admissible
    if spec.decision == "search":
        idx = body.rfind("Question:")
        return (body[idx + len("Question:"):] if idx >= 0 else body).strip(), "", admissible
    if spec.name == "scienceworld":
        m = _TASK_SENTENCE.search(body)
        if m is None:
            return "", _strip_observation(body), admissible
        end = body.find("\n\n", m.start())
        end = len(body) if end < 0 else end
        rest = (body[:m.start()].strip() + "\n\n" + body[end:].strip()).strip()
        return body[m.start():end].strip(), _strip_observation(rest), admissible
    m = TASK_LINE.search(body)
    if m is None:
        return "", _strip_observation(body), admissible
    before, after = body[:m.start()].strip(), body[m.end():].strip()
    return m.group(1).strip(), _strip_observation(before + ("\n\n" + after if after else "")), admissible



def _decision(text: str, spec: BenchmarkSpec, opts: LoadOptions) -> tuple[str, str, str]:
    """(response, action, recorded action) of one assistant message: a tagged response is kept as is,
    a ReAct "Thought/Action" one is read as ETO/FireAct read it and written as the benchmark's decision."""
    if is_tagged(text):
        response = text.strip()
        d = parse_decision(response, spec)  # an invalid one is refused with the projection's reason later
        action = reword_action(d.content, opts.action_wording) if spec.decision == "action" else d.content
        return reworded_response(response, d.span, action, d.content), action, d.content
    step = parse_react(text)
    action = reword_action(step.action, opts.action_wording) if spec.decision == "action" else step.action
    response, action = decision_response(step.thought, action, spec.decision)
    return response, action, step.action


def _reward(rec: dict, path: str, loc: str) -> tuple[float | None, bool | None]:
    """(reward as a number, success) from ``reward`` / ``success``. Success is a perfect episode (reward
    ≥ 1, WebShop's success rate counts a purchase scored 1.0), one definition everywhere, the
    environments' too; a partial reward stays in metadata. A number written as a string ("1.0") is read
    as that number; anything else is refused."""
    success = rec.get("success")
    if success is not None and not isinstance(success, bool):
        raise InvalidRecordError(path, loc, "success", "bad_type", f"expected true/false, found {success!r}")
    reward = rec.get("reward")
    if reward is None:
        return None, success
    if isinstance(reward, str):
        try:
            reward = float(reward)
        except ValueError:
            raise InvalidRecordError(path, loc, "reward", "bad_type",
                                     f"expected a number, found the string {reward!r}") from None
    if not isinstance(reward, (int, float)):
        raise InvalidRecordError(path, loc, "reward", "bad_type", f"expected a number, found {type(reward).__name__}")
    return float(reward), success if success is not None else float(reward) >= 1.0


def parse_conversation(rec: Any, path: str, loc: str, opts: LoadOptions, fmt: str = "eto") -> Trajectory:
    """One ETO / AgentGym / FireAct record (docs/FORMATS.md): leading system messages and the instruction
    with its acknowledgement are set aside (kept in metadata), the first human message gives the task
    and first observation, then each assistant message is one decision and each human message after it
    the next observation; a trailing human message is the final observation."""
    loc = record_location(loc, rec)
    if isinstance(rec, list):
        raise InvalidRecordError(path, loc, "", "bad_type",
                                 f"the record is a bare list of {len(rec)} messages, not an object (an ICL example "
                                 "file?): wrap each conversation as {\"id\": …, \"conversations\": [...]}")
    if not isinstance(rec, dict):
        raise InvalidRecordError(path, loc, "", "bad_type", f"expected an object, found {type(rec).__name__}")
    spec = get_benchmark(opts.benchmark)
    keys = [k for k in ("conversations", "messages", "traj") if k in rec]
    if not keys:  # said first: a record without any message list is not this format at all
        raise InvalidRecordError(path, loc, "conversations", "missing_field",
                                 f"required field 'conversations' (or 'messages') is missing; the record has "
                                 f"{keys_summary(rec)} — is --format right?")
    if len(keys) > 1:
        raise InvalidRecordError(path, loc, keys[1], "conflicting_fields",
                                 f"the record has both '{keys[0]}' and '{keys[1]}'; keep the one that is the "
                                 "trajectory")
    if fmt == "agentgym":
        tid = require(rec, "item_id", path, loc, (str, int))
    elif fmt == "fireact" and rec.get("id") is None:
        tid = f"{PurePosixPath(path).stem}:{loc.replace('line ', 'L')}"  # FireAct's lines carry no id
    else:
        tid = require(rec, "id", path, loc, (str, int))
    msgs = _messages(rec, keys[0], path, loc)

    n_system = next((i for i, m in enumerate(msgs) if m.role != "system"), len(msgs))
    system, body = msgs[:n_system], msgs[n_system:]
    for i, m in enumerate(body):
        expected = "human" if i % 2 == 0 else "gpt"
        if m.role != expected:
            if m.role == "system":
                detail = "a system message after the conversation started"
            elif m.role == "human":
                detail = (f"two human messages in a row ({body[i - 1].field} and this one): each observation "
                          "needs one response after it; merge them or drop the record")
            else:
                detail = "expected a 'human' message here (turns must alternate, starting with human)"
            raise InvalidRecordError(path, loc, m.role_field, "bad_turn_order", detail)
    # the instruction and its acknowledgement ("OK", "OK.", AgentGym's "OK. I'll follow your instructions…")
    start = 2 if len(body) >= 2 and is_acknowledgement(body[1].text) else 0
    episode = body[start:]
    if len(episode) < 2:
        raise InvalidRecordError(path, loc, keys[0], "missing_turns",
                                 "no observation/response pair after the instruction")

    first = episode[0]
    if (p := foreign_benchmark(first.text, spec)) is not None:
        raise InvalidRecordError(path, loc, first.field, *p)
    task, first_obs, first_adm = _task_and_first_observation(first.text, spec)
    if not task:
        raise InvalidRecordError(path, loc, first.field, "missing_task", _missing_task(spec, first.text))
    if (p := text_problem(task)) is not None:
        raise InvalidRecordError(path, loc, first.field, *p)
    turns = []
    for k in range(0, len(episode) - 1, 2):
        obs_msg, resp_msg = episode[k], episode[k + 1]
        obs, adm = (first_obs, first_adm) if k == 0 else _split_available(obs_msg.text)
        obs = obs if k == 0 else _strip_observation(obs)
        if resp_msg.loss is False:
            raise InvalidRecordError(path, loc, resp_msg.field.rsplit(".", 1)[0] + ".loss", "untrained_turn",
                                     "this reply is marked loss: false (not a training target), but sapd builds a "
                                     "prefix for every decision; drop the record or mark the reply loss: true")
        try:
            response, action, recorded = _decision(resp_msg.text, spec, opts)
        except ResponseProblem as e:
            raise InvalidRecordError(path, loc, resp_msg.field, e.reason, e.detail) from None
        if opts.check_admissible and adm is not None and recorded not in adm:
            raise InvalidRecordError(path, loc, resp_msg.field, "action_not_admissible",
                                     f"action '{recorded}' is not among the recorded AVAILABLE ACTIONS")
        turns.append(checked_turn(path, loc, spec, observation=obs, obs_field=obs_msg.field, response=response,
                                  action=action, resp_field=resp_msg.field, admissible=adm))
    final = _strip_observation(_split_available(episode[-1].text)[0]) if len(episode) % 2 == 1 else None

    _, success = _reward(rec, path, loc)  # the reward itself stays in metadata as recorded
    if success is None and final and (end := _EPISODE_END.search(final)):  # FireAct's last observation
        success = end.group(1).lower() in ("true", "1", "1.0")
    meta: dict[str, Any] = {"source_format": fmt, "instruction": body[0].text if start == 2 else None}
    if start == 2:
        meta["acknowledgement"] = body[1].text
    if system:
        meta["system"] = "\n\n".join(m.text for m in system)
    # nothing of the record is dropped: its other fields (game_file, reward as recorded, FireAct's gt/pred/
    # em/f1, …) travel in metadata, which `sapd convert` writes out
    for key, value in rec.items():
        if key not in (keys[0], "id", "item_id", "success") and key not in meta:
            meta[key] = value
    if "gt" in rec:  # FireAct's recorded evaluations name the golden answer
        meta["golden_answers"] = [str(rec["gt"])]
    source = rec.get("game_file") or (rec.get("item_id") if fmt == "agentgym" else None) or str(tid)
    category = alfworld_category(source) if opts.benchmark == "alfworld" else rec.get("category")
    return Trajectory(id=str(tid), benchmark=opts.benchmark, task=task, turns=turns, category=category,
                      success=success, final_observation=final, metadata=meta)


def parse_eto(rec: Any, path: str, loc: str, opts: LoadOptions) -> Trajectory:
    return parse_conversation(rec, path, loc, opts, "eto")


def parse_agentgym(rec: Any, path: str, loc: str, opts: LoadOptions) -> Trajectory:
    return parse_conversation(rec, path, loc, opts, "agentgym")


def parse_fireact(rec: Any, path: str, loc: str, opts: LoadOptions) -> Trajectory:
    return parse_conversation(rec, path, loc, opts, "fireact")


def _fireact_records(records: Iterator[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
    """FireAct's recorded evaluations are one dict of question id → {"traj", "reward", "gt", …}: one
    record per question, its id the key."""
    for loc, rec in records:
        if isinstance(rec, dict) and rec and all(isinstance(v, dict) and "traj" in v for v in rec.values()):
            for key, value in rec.items():
                yield f"key {key!r}", {"id": key, **value}
        else:
            yield loc, rec



def _read_fireact(records: Records, path: str, opts: LoadOptions, out: Collector) -> None:
    one_per_record(parse_fireact)(_fireact_records(records), path, opts, out)


def detect_eto(rec: dict[str, Any]) -> str | None:
    keys = set(rec)
    for key in ("conversations", "messages"):
        if key in keys and "id" in keys:
            return f"records have 'id' and '{key}'"
    return None


def detect_agentgym(rec: dict[str, Any]) -> str | None:
    return "records have 'item_id' and 'conversations'" if {"item_id", "conversations"} <= set(rec) else None


def detect_fireact(rec: dict[str, Any]) -> str | None:
    if "messages" in rec and "id" not in rec:
        return "records have 'messages' and no 'id'"
    if rec and all(isinstance(v, dict) and "traj" in v for v in rec.values()):
        return "a dict of question id → {'traj', …} (FireAct's recorded evaluations)"
    return None


ETO = TrajectoryFormat("eto", (".json", ".jsonl"), detect_eto, one_per_record(parse_eto))
AGENTGYM = TrajectoryFormat("agentgym", (".json", ".jsonl"), detect_agentgym, one_per_record(parse_agentgym))
FIREACT = TrajectoryFormat("fireact", (".jsonl", ".json"), detect_fireact, _read_fireact)
