"""Loaders for the trajectory formats people have (docs/FORMATS.md), all producing :class:`Trajectory`.

- ``native``: JSONL (one trajectory dict per line) or Parquet of the normalised record;
- ``eto``: ETO / SPA-RL expert files, a JSON list (or JSONL) of ``{"id", "game_file"?, "conversations" |
  "messages"}`` with ``from``/``value`` or ``role``/``content`` messages and "Thought: …\\nAction: …"
  responses, converted to the benchmark's decision block (``<think>…</think>\\n<action>…</action>``);
- ``agentgym``: AgentGym's AgentTraj layout, ``{"item_id", "conversations": [{"from", "value", "loss"}]}``;
- ``fireact``: FireAct's fine-tuning JSONL ``{"messages": [...]}`` (no id: the line names it) and its
  recorded evaluation files, a dict of question id → ``{"traj", "reward", "gt", …}``;
- ``skillrl``: per-step ``{"instruction", "output"}`` records with fully rendered prompts, regrouped into
  trajectories by task string and step number parsed from the prompt;
- ``searchr1``: Search-R1 rows (question, golden answers, data_source) with the recorded multi-turn
  search output (``response`` string with injected ``<information>`` blocks, or a ``turns`` list);
- ``auto``: each file's format told from its first record (the choice and why is in ``LoadResult``).

Every problem raises :class:`InvalidRecordError` naming file, line/record (and id), field and what to
do. With ``skip_invalid`` the record is skipped and counted in an :class:`InvalidReport` instead; nothing
is dropped silently: the valid records plus the invalid ones always equal the records read. Every
recorded turn must fit the chosen benchmark (:mod:`sapd.data.fit`), so data recorded for another
benchmark is refused, not cut into prefixes.
"""

from __future__ import annotations

import ast
import io
import json
import re
from dataclasses import dataclass, field
from functools import partial
from itertools import chain
from pathlib import PurePosixPath
from typing import Any, Callable, Iterator, Literal

from sapd import storage
from sapd.data.errors import InvalidRecordError, InvalidReport
from sapd.data.fit import foreign_benchmark, text_problem, turn_problem
from sapd.data.react import ResponseProblem, decision_response, is_acknowledgement, is_tagged, parse_react
from sapd.data.schema import Trajectory, Turn
from sapd.method.benchmarks import (
    BenchmarkSpec,
    alfworld_category,
    exact_match,
    get_benchmark,
    parse_decision,
    parse_search_response,
)

Format = Literal["native", "eto", "agentgym", "fireact", "skillrl", "searchr1", "auto"]
FORMATS: tuple[str, ...] = ("native", "eto", "agentgym", "fireact", "skillrl", "searchr1", "auto")
ActionWording = Literal["recorded", "put", "move"]

_EXTENSIONS = {
    "native": (".jsonl", ".json", ".parquet"),
    "eto": (".json", ".jsonl"),
    "agentgym": (".json", ".jsonl"),
    "fireact": (".jsonl", ".json"),
    "skillrl": (".jsonl", ".json"),
    "searchr1": (".jsonl", ".json", ".parquet"),
    "auto": (".jsonl", ".json", ".parquet"),
}


@dataclass
class LoadOptions:
    benchmark: str
    skip_invalid: bool = False
    action_wording: ActionWording = "recorded"  # ALFWorld: rewrite "put X in/on Y" ↔ "move X to Y"
    check_admissible: bool = True  # flag recorded actions outside the recorded admissible list


@dataclass
class LoadResult:
    trajectories: list[Trajectory]
    report: InvalidReport = field(default_factory=InvalidReport)
    files: list[str] = field(default_factory=list)
    records_read: int = 0  # lines / list entries / rows read (a SkillRL trajectory is several)
    valid_records: int = 0  # records that went into kept trajectories: valid_records + report.total == records_read
    formats: dict[str, str] = field(default_factory=dict)  # file → the format it was read as
    detected: dict[str, str] = field(default_factory=dict)  # file → why --format auto chose it

    def format_summary(self) -> str:
        """"eto", or for ``auto`` "auto → eto (records have 'id' and 'conversations')" (per format when
        files differ)."""
        if not self.detected:
            return ", ".join(sorted(set(self.formats.values()))) or "-"
        by_format: dict[str, list[str]] = {}
        for path, fmt in self.formats.items():
            by_format.setdefault(fmt, []).append(path)
        parts = [f"{fmt} ({self.detected[paths[0]]}" + (f"; {len(paths)} files)" if len(paths) > 1 else ")")
                 for fmt, paths in sorted(by_format.items())]
        return "auto → " + ", ".join(parts)


# ---------------------------------------------------------------------------------------------------
# helpers


_PUT = re.compile(r"^put (.+?) (?:in/on|in|on) (.+)$")
_MOVE = re.compile(r"^move (.+?) to (.+)$")


def reword_action(action: str, wording: ActionWording) -> str:
    """ALFWorld wording across versions: older data says "put X in/on Y", 0.4.x says "move X to Y".

    >>> reword_action("move apple 1 to fridge 1", "put")
    'put apple 1 in/on fridge 1'
    >>> reword_action("put apple 1 in/on fridge 1", "move")
    'move apple 1 to fridge 1'
    """
    if wording == "put" and (m := _MOVE.match(action)):
        return f"put {m.group(1)} in/on {m.group(2)}"
    if wording == "move" and (m := _PUT.match(action)):
        return f"move {m.group(1)} to {m.group(2)}"
    return action


def action_response(thought: str, action: str) -> str:
    return f"<think>{thought}</think>\n<action>{action}</action>"


def validate_trajectory(traj: Trajectory, path: str, location: str) -> None:
    """Checks every loader applies: a task, at least one turn, and a non-empty action in every turn."""
    if not traj.id:
        raise InvalidRecordError(path, location, "id", "missing_field", "trajectory has no id")
    if not traj.task.strip():
        raise InvalidRecordError(path, location, "task", "missing_task", "trajectory has no task instruction")
    if not traj.turns:
        raise InvalidRecordError(path, location, "turns", "missing_turns", "trajectory has no decision turns")
    for i, turn in enumerate(traj.turns):
        if not turn.action.strip():
            raise InvalidRecordError(path, location, f"turns[{i}].action", "empty_action",
                                     "recorded action is empty")
        if not turn.response.strip():
            raise InvalidRecordError(path, location, f"turns[{i}].response", "empty_response",
                                     "recorded response is empty")


def checked_turn(path: str, loc: str, spec: BenchmarkSpec, *, observation: str, obs_field: str, response: str,
                 action: str, resp_field: str, admissible: list[str] | None = None) -> Turn:
    """A :class:`Turn` once it fits the benchmark (:mod:`sapd.data.fit`); every loader builds turns here."""
    if (p := text_problem(observation)) is not None:
        raise InvalidRecordError(path, loc, obs_field, *p)
    if (p := turn_problem(response, action, spec)) is not None:
        raise InvalidRecordError(path, loc, resp_field, *p)
    return Turn(observation=observation, response=response, action=action, admissible_actions=admissible)


def input_files(input_uri: str, fmt: str) -> list[str]:
    """A file, or every file of the format's extensions below a folder (local or ``s3://``), sorted."""
    if storage.exists(input_uri):
        return [input_uri]
    exts = _EXTENSIONS[fmt]
    found = [u for u in storage.list_files(input_uri) if u.endswith(exts)]
    if not found:
        raise FileNotFoundError(f"{input_uri}: no such file, and no {'/'.join(exts)} files below it")
    return found


def _cut_short(text: str) -> bool:
    """True when JSON text ends inside a string or with brackets still open: a truncated file (an
    interrupted download or copy), not a syntax slip."""
    depth, in_string, escaped = 0, False, False
    for ch in text:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            depth += 1
        elif ch in "]}":
            depth -= 1
    return in_string or depth > 0


def _json_lines(path: str, text: str) -> Iterator[tuple[str, Any]]:
    """(location, parsed object) per non-blank line; a malformed line yields its InvalidRecordError
    in place of the object, so that the caller may count it and read on."""
    lines = text.splitlines()
    last = max((n for n, line in enumerate(lines, start=1) if line.strip()), default=0)
    for n, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            yield f"line {n}", json.loads(line)
        except json.JSONDecodeError as e:
            hint = (" (the last line ends mid-record: the file looks cut short)" if n == last and _cut_short(line)
                    else "")
            yield f"line {n}", InvalidRecordError(path, f"line {n}", "", "malformed_json",
                                                  f"malformed JSON at column {e.colno}: {e.msg}{hint}")


def _json_records(path: str, text: str) -> Iterator[tuple[str, Any]]:
    """Records of a .json file holding a list (or one object), or of a .jsonl file."""
    if path.endswith(".jsonl"):
        yield from _json_lines(path, text)
        return
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        if _cut_short(text):
            raise InvalidRecordError(path, f"line {e.lineno} column {e.colno}", "", "malformed_json",
                                     f"the JSON ends mid-record after {len(text.encode())} bytes: the file looks "
                                     "cut short (an interrupted download or copy?); fetch it again") from None
        raise InvalidRecordError(path, f"line {e.lineno} column {e.colno}", "", "malformed_json",
                                 f"malformed JSON: {e.msg} (the whole file is unreadable)") from None
    if isinstance(data, dict):
        data = [data]
    if not isinstance(data, list):
        raise InvalidRecordError(path, "top level", "", "bad_type",
                                 f"expected a JSON list of records, found {type(data).__name__}")
    for n, rec in enumerate(data):
        yield f"record {n}", rec


def _parquet_records(path: str, data: bytes) -> Iterator[tuple[str, Any]]:
    import pyarrow.parquet as pq
    try:
        table = pq.read_table(io.BytesIO(data), use_threads=False)  # see sapd.data.shards._read_part
    except Exception as e:  # pyarrow raises several types for a damaged file
        raise InvalidRecordError(path, "file", "", "malformed_parquet", f"cannot read Parquet: {e}") from None
    for n, rec in enumerate(table.to_pylist()):
        yield f"row {n}", rec


_LFS_HEADER = b"version https://git-lfs.github.com/spec/"


def _whole_file_problem(path: str, data: bytes) -> InvalidRecordError | None:
    """A file that cannot hold records: a Git LFS pointer, or text that is not JSON. (An empty file holds
    none, which is no error: a build whose whole input is empty stops with "no valid trajectories".)"""
    if data.startswith(_LFS_HEADER):
        size = re.search(rb"^size (\d+)", data, re.M)
        what = f" for a {int(size.group(1)):,}-byte file" if size else ""
        return InvalidRecordError(path, "file", "", "lfs_pointer",
                                  f"this is a Git LFS pointer{what}, not the data: run `git lfs install && git lfs "
                                  "pull` in the repository you cloned it from (or download the file itself)")
    head = data.lstrip(b"\xef\xbb\xbf \t\r\n")[:80]
    if head and head[:1] not in (b"[", b"{"):
        return InvalidRecordError(path, "file", "", "not_json",
                                  f"not JSON, JSONL or Parquet: it starts with {head.decode('utf-8', 'replace')[:40]!r}"
                                  " (raw chat or log text?); convert it to one of the formats in docs/FORMATS.md")
    return None


def read_records(path: str) -> Iterator[tuple[str, Any]]:
    """(location, record) of every record of a JSON / JSONL / Parquet file, the location naming the line
    or record for error messages."""
    data = storage.read_bytes(path)
    if path.endswith(".parquet") and data[:4] == b"PAR1":
        yield from _parquet_records(path, data)
        return
    if (problem := _whole_file_problem(path, data)) is not None:
        raise problem
    if not data.strip(b"\xef\xbb\xbf \t\r\n"):
        return
    if path.endswith(".parquet"):
        yield from _parquet_records(path, data)
        return
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise InvalidRecordError(path, f"byte {e.start}", "", "bad_encoding", "file is not UTF-8") from None
    yield from _json_records(path, text)


def _require(rec: Any, key: str, path: str, loc: str, kind: type | tuple[type, ...] = str,
             prefix: str = "") -> Any:
    if not isinstance(rec, dict):
        raise InvalidRecordError(path, loc, prefix.rstrip("."), "bad_type",
                                 f"expected an object, found {type(rec).__name__}")
    if key not in rec:
        hint = f"; the record has {_keys(rec)}" if not prefix else ""
        raise InvalidRecordError(path, loc, prefix + key, "missing_field", f"required field '{key}' is missing{hint}")
    value = rec[key]
    if value is None:
        raise InvalidRecordError(path, loc, prefix + key, "missing_field", f"required field '{key}' is null")
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):  # True is an int too
        names = kind.__name__ if isinstance(kind, type) else "/".join(k.__name__ for k in kind)
        raise InvalidRecordError(path, loc, prefix + key, "bad_type",
                                 f"expected {names}, found {type(value).__name__}")
    return value


def _keys(rec: dict) -> str:
    keys = sorted(str(k) for k in rec)
    if not keys:
        return "no keys"
    return "keys " + ", ".join(keys[:8]) + (f" … ({len(keys)} in all)" if len(keys) > 8 else "")


def record_location(loc: str, rec: Any) -> str:
    """The location with the record's id appended, when it has one."""
    if isinstance(rec, dict):
        for key in ("id", "item_id"):
            if rec.get(key) is not None:
                return f"{loc} ({key}={rec[key]})"
    return loc


# ---------------------------------------------------------------------------------------------------
# native


def parse_native(rec: Any, path: str, loc: str, opts: LoadOptions) -> Trajectory:
    loc = record_location(loc, rec)
    spec = get_benchmark(opts.benchmark)
    tid = _require(rec, "id", path, loc, (str, int))
    task = _require(rec, "task", path, loc)
    raw_turns = _require(rec, "turns", path, loc, list)
    benchmark = rec.get("benchmark") or opts.benchmark
    if benchmark != opts.benchmark:
        raise InvalidRecordError(path, loc, "benchmark", "benchmark_mismatch",
                                 f"record is for benchmark '{benchmark}', but --benchmark is '{opts.benchmark}'")
    if (p := text_problem(task)) is not None:
        raise InvalidRecordError(path, loc, "task", *p)
    meta = rec.get("metadata") or {}
    if isinstance(meta, str):
        try:
            meta = json.loads(meta)
        except json.JSONDecodeError:
            raise InvalidRecordError(path, loc, "metadata", "malformed_json", "metadata is not valid JSON") from None
    # sapd's agent loop (teacher pools, collected episodes) records a malformed response as the model wrote
    # it, with the no-op it executed as the action, and lists the turn here: flagged already, so kept as such
    flagged = set(meta.get("invalid_turns") or []) if isinstance(meta, dict) else set()
    turns = []
    for i, t in enumerate(raw_turns):
        pre = f"turns[{i}]."
        obs = _require(t, "observation", path, loc, str, pre)
        resp = _require(t, "response", path, loc, str, pre)
        act = _require(t, "action", path, loc, str, pre)
        adm = t.get("admissible_actions")
        if adm is not None and not (isinstance(adm, list) and all(isinstance(a, str) for a in adm)):
            raise InvalidRecordError(path, loc, pre + "admissible_actions", "bad_type", "expected a list of strings")
        if not act.strip():  # said plainly, before the response check would call it a mismatch
            raise InvalidRecordError(path, loc, pre + "action", "empty_action", "recorded action is empty")
        if i in flagged:
            if (q := text_problem(obs)) is not None:
                raise InvalidRecordError(path, loc, pre + "observation", *q)
            turns.append(Turn(observation=obs, response=resp, action=act, admissible_actions=adm))
            continue
        turns.append(checked_turn(path, loc, spec, observation=obs, obs_field=pre + "observation", response=resp,
                                  action=act, resp_field=pre + "response", admissible=adm))
    return Trajectory(id=str(tid), benchmark=benchmark, task=task, turns=turns, category=rec.get("category"),
                      success=rec.get("success"), final_observation=rec.get("final_observation"), metadata=meta)


# ---------------------------------------------------------------------------------------------------
# conversations: ETO / SPA-RL, AgentGym (AgentTraj), FireAct — one reader, three layouts

_ROLES = {"human": "human", "user": "human", "gpt": "gpt", "assistant": "gpt", "system": "system"}
_TASK_LINE = re.compile(r"Your task is to:\s*(.+)")
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
                                 f"{_keys(msg)}")
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
    raw = _require(rec, key, path, loc, list)
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
    if spec.name != "scienceworld" and _TASK_SENTENCE.search(text) and not _TASK_LINE.search(text):
        hint = (" It says 'Your task is to …' without a colon, as ScienceWorld does: is --benchmark scienceworld "
                "meant?")
    elif spec.name != "webshop" and _WEBSHOP_INSTRUCTION.search(text):
        hint = " It looks like a WebShop page: is --benchmark webshop meant?"
    elif spec.name == "webshop" and _TASK_LINE.search(text):
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
    m = _TASK_LINE.search(body)
    if m is None:
        return "", _strip_observation(body), admissible
    before, after = body[:m.start()].strip(), body[m.end():].strip()
    return m.group(1).strip(), _strip_observation(before + ("\n\n" + after if after else "")), admissible


def _reworded(response: str, span: tuple[int, int] | None, action: str, recorded: str) -> str:
    """The response with its action block rewritten when --action-wording changed the action."""
    if action == recorded or span is None:
        return response
    return response[:span[0]] + action + response[span[1]:]


def _decision(text: str, spec: BenchmarkSpec, opts: LoadOptions) -> tuple[str, str, str]:
    """(response, action, recorded action) of one assistant message: a tagged response is kept as is,
    a ReAct "Thought/Action" one is read as ETO/FireAct read it and written as the benchmark's decision."""
    if is_tagged(text):
        response = text.strip()
        d = parse_decision(response, spec)  # an invalid one is refused with the projection's reason later
        action = reword_action(d.content, opts.action_wording) if spec.decision == "action" else d.content
        return _reworded(response, d.span, action, d.content), action, d.content
    step = parse_react(text)
    action = reword_action(step.action, opts.action_wording) if spec.decision == "action" else step.action
    response, action = decision_response(step.thought, action, spec)
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
                                 f"{_keys(rec)} — is --format right?")
    if len(keys) > 1:
        raise InvalidRecordError(path, loc, keys[1], "conflicting_fields",
                                 f"the record has both '{keys[0]}' and '{keys[1]}'; keep the one that is the "
                                 "trajectory")
    if fmt == "agentgym":
        tid = _require(rec, "item_id", path, loc, (str, int))
    elif fmt == "fireact" and rec.get("id") is None:
        tid = f"{PurePosixPath(path).stem}:{loc.replace('line ', 'L')}"  # FireAct's lines carry no id
    else:
        tid = _require(rec, "id", path, loc, (str, int))
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


# ---------------------------------------------------------------------------------------------------
# SkillRL per-step records

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
    prompt = _require(rec, "instruction", path, loc)
    output = _require(rec, "output", path, loc)
    if (p := foreign_benchmark(prompt, spec)) is not None:
        raise InvalidRecordError(path, loc, "instruction", *p)
    m_task = _TASK_LINE.search(prompt)
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
        response = _reworded(s.output, decision.span, action, decision.content)
        turns.append(checked_turn(path, s.loc, spec, observation=s.observation, obs_field="instruction",
                                  response=response, action=action, resp_field="output", admissible=s.admissible))
    stem = PurePosixPath(path).stem
    tid = f"{stem}:{steps[0].loc.replace('line ', 'L')}"
    return Trajectory(id=tid, benchmark=opts.benchmark, task=steps[0].task, turns=turns,
                      metadata={"source_format": "skillrl", "source_lines": loc})


# ---------------------------------------------------------------------------------------------------
# Search-R1

_INFO = re.compile(r"<information>(.*?)</information>", re.S)


def searchr1_question(rec: dict, path: str, loc: str) -> str:
    """The question of a Search-R1 row (``question``, or the user prompt); an error names path and field."""
    if isinstance(rec.get("question"), str):
        return rec["question"].strip()
    prompt = _require(rec, "prompt", path, loc, (list, str))
    content = prompt if isinstance(prompt, str) else next(
        (m.get("content", "") for m in prompt if isinstance(m, dict) and m.get("role") == "user"), "")
    idx = content.rfind("Question:")
    if idx < 0:
        raise InvalidRecordError(path, loc, "prompt", "missing_task", "no 'Question: …' in the prompt")
    return content[idx + len("Question:"):].strip()


def searchr1_golden_answers(rec: dict, path: str, loc: str) -> list[str]:
    """The golden answers of a Search-R1 row (``golden_answers`` or ``reward_model.ground_truth.target``)."""
    g = rec.get("golden_answers")
    if g is None:
        try:
            g = rec["reward_model"]["ground_truth"]["target"]
        except (KeyError, TypeError):
            raise InvalidRecordError(path, loc, "reward_model.ground_truth.target", "missing_field",
                                     "no golden answers (golden_answers or reward_model.ground_truth.target)") from None
    if isinstance(g, str):
        g = [g]
    return [str(x) for x in g]


def _search_turns(rec: dict, path: str, loc: str) -> tuple[list[tuple[str, str]], str]:
    """[(observation, response)] for each model turn, and the field name used."""
    if isinstance(rec.get("turns"), list):
        out, prev_info = [], ""
        for i, t in enumerate(rec["turns"]):
            resp = _require(t, "response", path, loc, str, f"turns[{i}].")
            out.append((prev_info, resp.strip()))
            prev_info = (t.get("observation") or "").strip()
        return out, "turns"
    text = _require(rec, "response", path, loc)
    out, prev_info, pos = [], "", 0
    for m in _INFO.finditer(text):
        out.append((prev_info, text[pos:m.start()].strip()))
        prev_info, pos = m.group(1).strip(), m.end()
    tail = text[pos:].strip()
    if tail:
        out.append((prev_info, tail))
    return out, "response"


def parse_searchr1(rec: Any, path: str, loc: str, opts: LoadOptions) -> Trajectory:
    loc = record_location(loc, rec)
    if not isinstance(rec, dict):
        raise InvalidRecordError(path, loc, "", "bad_type", f"expected an object, found {type(rec).__name__}")
    spec = get_benchmark(opts.benchmark)
    question = searchr1_question(rec, path, loc)
    golden = searchr1_golden_answers(rec, path, loc)
    raw, fld = _search_turns(rec, path, loc)
    if not raw:
        raise InvalidRecordError(path, loc, fld, "missing_turns", "no recorded model turns")
    if (p := text_problem(question)) is not None:
        raise InvalidRecordError(path, loc, "prompt", *p)
    turns, answer = [], None
    for i, (obs, resp) in enumerate(raw):
        d = parse_search_response(resp)
        where = f"turns[{i}].response" if fld == "turns" else f"response (model turn {i + 1})"
        obs_where = (f"turns[{i - 1}].observation" if fld == "turns"
                     else f"response (information before model turn {i + 1})")
        if not d.valid and spec.decision == "search":
            raise InvalidRecordError(path, loc, where, "empty_action", f"no usable decision: {d.reason}")
        if d.kind == "answer":
            if i != len(raw) - 1:
                raise InvalidRecordError(path, loc, where, "bad_turn_order", "an answer is followed by more turns")
            answer = d.content
        turns.append(checked_turn(path, loc, spec, observation=obs, obs_field=obs_where, response=resp,
                                  action=d.content, resp_field=where))
    extra: dict[str, Any] = rec["extra_info"] if isinstance(rec.get("extra_info"), dict) else {}
    source = rec.get("data_source")
    tid = rec.get("id")
    if tid is None:
        tid = f"{source}_{extra.get('split', 'x')}_{extra.get('index', loc.split()[-1])}"
    # no golden answers (a recorded rollout without its reference): the outcome is unknown, not a failure
    success = exact_match(answer, golden) if answer is not None and golden else (False if golden else None)
    return Trajectory(id=str(tid), benchmark=opts.benchmark, task=question, turns=turns, category=source,
                      success=success, metadata={"source_format": "searchr1", "golden_answers": golden,
                                                 "answer": answer})


# ---------------------------------------------------------------------------------------------------
# format detection and dispatch

_PARSERS: dict[str, Callable[[Any, str, str, LoadOptions], Trajectory]] = {
    "native": parse_native, "eto": parse_eto, "agentgym": parse_agentgym, "fireact": parse_fireact,
    "searchr1": parse_searchr1}


def detect_format(rec: Any) -> tuple[str, str] | None:
    """(format, why) from one record, or None when it is none of the layouts sapd reads.

    >>> detect_format({"id": "a", "conversations": []})
    ('eto', "records have 'id' and 'conversations'")
    >>> detect_format({"messages": []})
    ('fireact', "records have 'messages' and no 'id'")
    """
    if not isinstance(rec, dict):
        return None
    keys = set(rec)
    if {"instruction", "output"} <= keys:
        return "skillrl", "records have 'instruction' and 'output'"
    if {"task", "turns"} <= keys:
        return "native", "records have 'task' and 'turns'"
    if {"item_id", "conversations"} <= keys:
        return "agentgym", "records have 'item_id' and 'conversations'"
    for key in ("conversations", "messages"):
        if key in keys and "id" in keys:
            return "eto", f"records have 'id' and '{key}'"
    if "messages" in keys:
        return "fireact", "records have 'messages' and no 'id'"
    if rec and all(isinstance(v, dict) and "traj" in v for v in rec.values()):
        return "fireact", "a dict of question id → {'traj', …} (FireAct's recorded evaluations)"
    if keys & {"data_source", "golden_answers", "reward_model"} and keys & {"response", "turns"}:
        return "searchr1", "rows have golden answers / data_source and a recorded response"
    return None


def _unknown_format(rec: Any, path: str, loc: str, opts: LoadOptions) -> Trajectory:
    """A file whose every record is unreadable has no format; its records are reported, never parsed."""
    raise InvalidRecordError(path, record_location(loc, rec), "", "unknown_format", "no readable record to tell "
                             "the format by")


def _detect(path: str, records: Iterator[tuple[str, Any]]) -> tuple[str, str, Iterator[tuple[str, Any]]]:
    """The format of a file from its first readable record, and the records (that one included)."""
    seen: list[tuple[str, Any]] = []
    for loc, rec in records:
        seen.append((loc, rec))
        if isinstance(rec, InvalidRecordError):
            continue
        found = detect_format(rec)
        if found is None:
            what = (f"a bare list of {len(rec)} messages, not an object (an ICL example file? wrap each conversation "
                    "as {\"id\": …, \"conversations\": [...]})" if isinstance(rec, list)
                    else f"an object with {_keys(rec)}" if isinstance(rec, dict) else f"a {type(rec).__name__}")
            raise InvalidRecordError(path, record_location(loc, rec), "", "unknown_format",
                                     f"cannot tell the format: the first record is {what}, none of the layouts sapd "
                                     f"reads (docs/FORMATS.md); if it is one of them, say which with --format "
                                     f"({', '.join(f for f in FORMATS if f != 'auto')})")
        return found[0], found[1], chain(seen, records)
    return "unknown", "no readable record", iter(seen)


def load_trajectories(input_uri: str, fmt: str, opts: LoadOptions,
                      progress: Callable[[int], None] | None = None, limit: int | None = None) -> LoadResult:
    """Read every trajectory of ``input_uri`` (a file or a folder, local or ``s3://``) in format ``fmt``;
    with ``limit``, only the first ``limit`` records (a sample: ``sapd check``)."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown format {fmt!r}; expected one of {', '.join(FORMATS)}")
    spec = get_benchmark(opts.benchmark)  # an unknown benchmark fails here, before any file is read
    result = LoadResult(trajectories=[], files=input_files(input_uri, fmt))
    seen: dict[str, str] = {}

    def keep(traj_fn: Callable[[], Trajectory], path: str, loc: str, records: int = 1) -> None:
        try:
            traj = traj_fn()
            validate_trajectory(traj, path, loc)
            if traj.id in seen:
                raise InvalidRecordError(path, loc, "id", "duplicate_id",
                                         f"trajectory id '{traj.id}' already read at {seen[traj.id]}")
            seen[traj.id] = f"{path}: {loc}"
            result.trajectories.append(traj)
            result.valid_records += records
        except InvalidRecordError as e:
            if not opts.skip_invalid:
                raise
            result.report.add(e, records)

    def full() -> bool:
        return limit is not None and result.records_read >= limit

    for path in result.files:
        if full():
            break
        records = read_records(path)
        file_fmt = fmt
        if fmt == "auto":
            file_fmt, why, records = _detect(path, records)
            result.detected[path] = why
        result.formats[path] = file_fmt
        if file_fmt == "fireact":
            records = _fireact_records(records)
        if file_fmt == "skillrl":
            group: list[_Step] = []
            for loc, rec in _safe(records, path, opts, result):
                result.records_read += 1
                try:
                    step = _parse_skillrl_step(rec, path, loc, spec)
                except InvalidRecordError as e:
                    if not opts.skip_invalid:
                        raise
                    result.report.add(e)
                    continue
                if group and (_task_key(step.task) != _task_key(group[-1].task) or step.step != group[-1].step + 1):
                    keep(partial(_skillrl_trajectory, group, path, opts), path, group[0].loc, len(group))
                    group = []
                group.append(step)
                if progress:
                    progress(1)
                if full():
                    group = []  # a sample ends mid-trajectory: its steps so far are checked, not assembled
                    break
            if group:
                keep(partial(_skillrl_trajectory, group, path, opts), path, group[0].loc, len(group))
        else:
            parser = _PARSERS.get(file_fmt, _unknown_format)
            for loc, rec in _safe(records, path, opts, result):
                result.records_read += 1
                keep(partial(parser, rec, path, loc, opts), path, record_location(loc, rec))
                if progress:
                    progress(1)
                if full():
                    break
    # the report's promise (a bug if broken); a sample may end inside a SkillRL trajectory
    if limit is None and result.valid_records + result.report.total != result.records_read:
        raise RuntimeError(f"record count mismatch: {result.valid_records} valid + {result.report.total} invalid "
                           f"!= {result.records_read} read")
    return result


def _safe(records: Iterator[tuple[str, Any]], path: str, opts: LoadOptions,
          result: LoadResult) -> Iterator[tuple[str, Any]]:
    """Pass records through; a malformed JSONL line raises, or with skip_invalid is counted and reading
    goes on. (A .json file that does not parse at all raises from the reader: there is nothing to skip to.)"""
    for loc, rec in records:
        if isinstance(rec, InvalidRecordError):
            if not opts.skip_invalid:
                raise rec
            result.report.add(rec)
            result.records_read += 1
            continue
        yield loc, rec


# ---------------------------------------------------------------------------------------------------
# writing the native format


def write_native_jsonl(trajectories: list[Trajectory], uri: str) -> None:
    lines = [json.dumps(t.to_dict(), ensure_ascii=False, sort_keys=True) for t in trajectories]
    storage.write_bytes(uri, ("\n".join(lines) + "\n").encode("utf-8"))


def write_native_parquet(trajectories: list[Trajectory], uri: str) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq
    rows = []
    for t in trajectories:
        d = t.to_dict()
        d["metadata"] = json.dumps(d["metadata"], ensure_ascii=False, sort_keys=True)
        rows.append(d)
    buf = io.BytesIO()
    pq.write_table(pa.Table.from_pylist(rows), buf)
    storage.write_bytes(uri, buf.getvalue())
