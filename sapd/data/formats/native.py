"""``native``: sapd's own normalised record (docs/FORMATS.md) — JSONL (one trajectory per line) or Parquet:
``{"id", "task", "turns": [{"observation", "response", "action", "admissible_actions"?}], …}``. What
``sapd convert`` and the agent loop write (:func:`sapd.data.loaders.write_native_jsonl`).
"""

from __future__ import annotations

import json
from typing import Any

from sapd.data.errors import InvalidRecordError
from sapd.data.fit import text_problem
from sapd.data.formats.base import LoadOptions, TrajectoryFormat, checked_turn, one_per_record, record_location, require
from sapd.data.schema import Trajectory, Turn
from sapd.method.benchmarks import get_benchmark


def parse_native(rec: Any, path: str, loc: str, opts: LoadOptions) -> Trajectory:
    loc = record_location(loc, rec)
    spec = get_benchmark(opts.benchmark)
    tid = require(rec, "id", path, loc, (str, int))
    task = require(rec, "task", path, loc)
    raw_turns = require(rec, "turns", path, loc, list)
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
        obs = require(t, "observation", path, loc, str, pre)
        resp = require(t, "response", path, loc, str, pre)
        act = require(t, "action", path, loc, str, pre)
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



def detect(rec: dict[str, Any]) -> str | None:
    return "records have 'task' and 'turns'" if {"task", "turns"} <= set(rec) else None


FORMAT = TrajectoryFormat("native", (".jsonl", ".json", ".parquet"), detect, one_per_record(parse_native))
