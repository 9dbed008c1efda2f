"""What every trajectory format shares: the options of a load, the :class:`~sapd.data.formats.base.TrajectoryFormat`
entry each format module declares (its ``FORMAT``), the :class:`~sapd.data.formats.base.Collector` a format hands
its trajectories and problems to, and the record and turn checks every parser applies. The registry of formats is
:data:`sapd.data.loaders.FORMATS`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Callable, Iterator, Literal

from sapd.data.errors import InvalidRecordError, InvalidReport
from sapd.data.fit import text_problem, turn_problem
from sapd.data.schema import Trajectory, Turn
from sapd.method.benchmarks import BenchmarkSpec, reword_alfworld_action

ActionWording = Literal["recorded", "put", "move"]
Records = Iterator[tuple[str, Any]]  # (location, record) pairs of one file (sapd.data.formats.records)


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


@dataclass(frozen=True)
class TrajectoryFormat:
    """One input layout (docs/FORMATS.md): its name, the file endings read below a folder, how ``--format
    auto`` tells it from a file's first record, and how a file's records become trajectories."""

    name: str
    extensions: tuple[str, ...]
    detect: Callable[[dict[str, Any]], str | None]  # why a record is in this layout ("records have …"), else None
    read: Callable[[Records, str, LoadOptions, Collector], None]  # a file's records → collector


class Collector:
    """Where a format's reader puts what it reads, one per load: every record is counted, every trajectory
    is checked (:func:`validate_trajectory`, unique ids) and kept, every problem raised — or, with
    ``skip_invalid``, counted in the report — so the valid records plus the invalid ones always equal the
    records read."""

    def __init__(self, result: LoadResult, opts: LoadOptions, limit: int | None = None,
                 progress: Callable[[int], None] | None = None) -> None:
        self.result, self.opts, self.limit, self.progress = result, opts, limit, progress
        self._seen: dict[str, str] = {}

    def full(self) -> bool:
        """The sample is read (``limit`` records): stop."""
        return self.limit is not None and self.result.records_read >= self.limit

    def records(self, records: Records, path: str) -> Records:
        """The readable records of a file, each counted as read; a malformed JSONL line raises, or with
        ``skip_invalid`` is counted and reading goes on. Stops once the sample is read. (A .json file that
        does not parse at all raises from the reader: there is nothing to skip to.)"""
        for loc, rec in records:
            self.result.records_read += 1
            if self.progress:
                self.progress(1)
            if isinstance(rec, InvalidRecordError):
                self.invalid(rec)
            else:
                yield loc, rec
            if self.full():
                return

    def invalid(self, error: InvalidRecordError, records: int = 1) -> None:
        if not self.opts.skip_invalid:
            raise error
        self.result.report.add(error, records)

    def keep(self, parse: Callable[[], Trajectory], path: str, loc: str, records: int = 1) -> None:
        """``parse()`` one trajectory (of ``records`` records) and keep it once it passes every check."""
        try:
            traj = parse()
            validate_trajectory(traj, path, loc)
            if traj.id in self._seen:
                raise InvalidRecordError(path, loc, "id", "duplicate_id",
                                         f"trajectory id '{traj.id}' already read at {self._seen[traj.id]}")
            self._seen[traj.id] = f"{path}: {loc}"
            self.result.trajectories.append(traj)
            self.result.valid_records += records
        except InvalidRecordError as e:
            self.invalid(e, records)


def one_per_record(parse: Callable[[Any, str, str, LoadOptions], Trajectory]
                   ) -> Callable[[Records, str, LoadOptions, Collector], None]:
    """The reader of a layout in which every record is one trajectory."""
    def read(records: Records, path: str, opts: LoadOptions, out: Collector) -> None:
        for loc, rec in out.records(records, path):
            out.keep(partial(parse, rec, path, loc, opts), path, record_location(loc, rec))
    return read


# ---------------------------------------------------------------------------------------------------
# checks and helpers every parser uses

TASK_LINE = re.compile(r"Your task is to:\s*(.+)")  # ALFWorld / TextWorld state their task on this line


def reword_action(action: str, wording: ActionWording) -> str:
    """An ALFWorld placement as ``wording`` says ("recorded": as it is); older data says "put X in/on Y",
    0.4.x says "move X to Y" (:func:`sapd.method.benchmarks.reword_alfworld_action`).

    >>> reword_action("move apple 1 to fridge 1", "put")
    'put apple 1 in/on fridge 1'
    >>> reword_action("move apple 1 to fridge 1", "recorded")
    'move apple 1 to fridge 1'
    """
    return action if wording == "recorded" else reword_alfworld_action(action, wording)


def reworded_response(response: str, span: tuple[int, int] | None, action: str, recorded: str) -> str:
    """The response with its action block rewritten when --action-wording changed the action."""
    if action == recorded or span is None:
        return response
    return response[:span[0]] + action + response[span[1]:]



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
    """A :class:`~sapd.data.schema.Turn` once it fits the benchmark (:mod:`sapd.data.fit`); every loader builds
    turns here."""
    if (p := text_problem(observation)) is not None:
        raise InvalidRecordError(path, loc, obs_field, *p)
    if (p := turn_problem(response, action, spec)) is not None:
        raise InvalidRecordError(path, loc, resp_field, *p)
    return Turn(observation=observation, response=response, action=action, admissible_actions=admissible)



def require(rec: Any, key: str, path: str, loc: str, kind: type | tuple[type, ...] = str,
             prefix: str = "") -> Any:
    if not isinstance(rec, dict):
        raise InvalidRecordError(path, loc, prefix.rstrip("."), "bad_type",
                                 f"expected an object, found {type(rec).__name__}")
    if key not in rec:
        hint = f"; the record has {keys_summary(rec)}" if not prefix else ""
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


def keys_summary(rec: dict) -> str:
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

