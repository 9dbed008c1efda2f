"""``searchr1``: Search-R1 rows (question, golden answers, data_source) with the recorded multi-turn search
output — a ``response`` string with injected ``<information>`` blocks, or a ``turns`` list
(docs/FORMATS.md, "Search-R1 rows"). The search-QA environment reads its questions with the same
functions (:mod:`sapd.envs.searchqa`).
"""

from __future__ import annotations

import re
from typing import Any

from sapd.data.errors import InvalidRecordError
from sapd.data.fit import text_problem
from sapd.data.formats.base import LoadOptions, TrajectoryFormat, checked_turn, one_per_record, record_location, require
from sapd.data.schema import Trajectory
from sapd.method.benchmarks import exact_match, get_benchmark, parse_search_response

_INFO = re.compile(r"<information>(.*?)</information>", re.S)


def searchr1_question(rec: dict, path: str, loc: str) -> str:
    """The question of a Search-R1 row (``question``, or the user prompt); an error names path and field."""
    if isinstance(rec.get("question"), str):
        return rec["question"].strip()
    prompt = require(rec, "prompt", path, loc, (list, str))
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
            resp = require(t, "response", path, loc, str, f"turns[{i}].")
            out.append((prev_info, resp.strip()))
            prev_info = (t.get("observation") or "").strip()
        return out, "turns"
    text = require(rec, "response", path, loc)
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



def detect(rec: dict[str, Any]) -> str | None:
    keys = set(rec)
    if keys & {"data_source", "golden_answers", "reward_model"} and keys & {"response", "turns"}:
        return "rows have golden answers / data_source and a recorded response"
    return None


FORMAT = TrajectoryFormat("searchr1", (".jsonl", ".json", ".parquet"), detect, one_per_record(parse_searchr1))
