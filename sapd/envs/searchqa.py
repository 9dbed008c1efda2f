"""Search QA (Search-R1): one question per episode, a retriever behind ``<search>``, exact match on
``<answer>``.

The task is the question; the first observation is empty. Each decision is a search or the answer:

- a search returns the retrieved passages as the next observation — the text Search-R1 injects
  between ``<information>`` tags (``Doc 1(Title: "X") text\\n…``, stripped, as the Search-R1 loader
  records it) — reward 0, not done;
- an answer ends the episode: reward = won = 1.0 when it exactly matches a golden answer after
  normalisation (:func:`~sapd.method.benchmarks.exact_match`), else 0;
- a malformed response (neither a search nor an answer) gets Search-R1's "My previous action is
  invalid…" message and the episode goes on.

The horizon (4 for search QA) is the agent loop's. The loop hands ``step`` the decision's *content*,
which does not say whether it was a search or an answer, so the environment also offers
``step_response(response, action)``: it re-reads the raw response with the same parser the loop uses
(:func:`~sapd.method.benchmarks.parse_search_response`) and dispatches. ``step(action)`` alone is a search
(what the loop's fast-forward of a rebuilt environment replays: an answer ends the episode, so every
replayed step was a search) and ``answer(text)`` answers.

A retriever failure raises :class:`~sapd.envs.retriever.RetrieverError`; the agent loop rebuilds and
replays the environment a bounded number of times, then records the episode as failed.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Sequence

from sapd.data.errors import InvalidRecordError
from sapd.data.formats import searchr1
from sapd.data.formats.base import record_location
from sapd.data.formats.records import files_below, read_records
from sapd.data.formats.searchr1 import searchr1_golden_answers, searchr1_question
from sapd.envs.base import EpisodeSpec, StepInfo, StepResult
from sapd.envs.retriever import DEFAULT_TOPK, RetrieverClient
from sapd.method.benchmarks import exact_match, parse_search_response

# Search-R1's observation for a response with neither a valid search nor an answer (generation.py)
INVALID_OBSERVATION = ("My previous action is invalid. If I want to search, I should put the query between "
                       "<search> and </search>. If I want to give the final answer, I should put the answer "
                       "between <answer> and </answer>. Let me try again.")


@dataclass
class SearchQAEnv:
    """One question behind the :class:`~sapd.envs.base.Environment` protocol."""

    question: str
    golden_answers: list[str]
    retriever: RetrieverClient
    category: str | None = None  # the data source: nq, triviaqa, popqa, hotpotqa, 2wikimultihopqa, …
    question_id: str | None = None
    topk: int | None = None  # passages per search; None = the client's
    benchmark: str = "searchqa"
    searches: list[str] = field(default_factory=list, repr=False)
    answer_text: str | None = field(default=None, repr=False)
    _done: bool = field(default=True, repr=False)

    def reset(self, seed: int | None = None) -> StepInfo:
        # retrieval is deterministic; the seed is accepted for the protocol and ignored
        self.searches, self.answer_text, self._done = [], None, False
        return StepInfo(observation="", task=self.question, admissible_actions=None, category=self.category,
                        info={"question_id": self.question_id, "golden_answers": json.dumps(self.golden_answers)})

    def _check_live(self) -> None:
        if self._done:
            raise RuntimeError(f"search QA {self.question_id}: step before reset or after the answer")

    def step(self, action: str) -> StepResult:
        """A search for ``action``: the retrieved passages are the next observation."""
        self._check_live()
        info = self.retriever.information(action, self.topk)
        self.searches.append(action)
        return StepResult(observation=info, info={"kind": "search"})

    def answer(self, text: str) -> StepResult:
        """The final answer: done, reward = won = exact match against the golden answers."""
        self._check_live()
        self.answer_text, self._done = text, True
        em = exact_match(text, self.golden_answers)
        return StepResult(observation="", reward=float(em), done=True, won=em, score=float(em),
                          info={"kind": "answer", "answer": text, "exact_match": em})

    def step_response(self, response: str, action: str | None = None) -> StepResult:
        """Execute the decision of the raw ``response`` (a search, the answer or an invalid response);
        ``action`` — the loop's copy of the decision content — is not needed and only kept for the
        signature ``(response, action)`` the agent loop calls."""
        self._check_live()
        d = parse_search_response(response)
        if not d.valid:
            return StepResult(observation=INVALID_OBSERVATION, info={"kind": "invalid", "reason": d.reason})
        return self.answer(d.content) if d.kind == "answer" else self.step(d.content)

    def close(self) -> None:
        pass


# ---------------------------------------------------------------------------------------------------
# episodes from Search-R1 rows


@dataclass(frozen=True)
class Question:
    id: str
    question: str
    golden_answers: list[str]
    data_source: str | None


def read_questions(rows_path: str | Path, limit: int | None = None, per_source: int | None = None) -> list[Question]:
    """The questions of Search-R1 rows (JSONL / JSON / Parquet, a file or a folder of them, local or
    ``s3://``): the fields :func:`~sapd.data.formats.searchr1.parse_searchr1` reads (``question`` or the user
    ``prompt``'s "Question: …", ``golden_answers`` or ``reward_model.ground_truth.target``,
    ``data_source``, ``id`` or ``{data_source}_{split}_{index}``), in file order; the first ``limit``
    overall and the first ``per_source`` of each data source. A bad row raises
    :class:`~sapd.data.errors.InvalidRecordError` naming file, row and field."""
    out: list[Question] = []
    per: dict[str | None, int] = {}
    seen: set[str] = set()
    for path in files_below(str(rows_path), searchr1.FORMAT.extensions):
        for loc, rec in read_records(path):
            if isinstance(rec, InvalidRecordError):
                raise rec
            loc = record_location(loc, rec)
            if not isinstance(rec, dict):
                raise InvalidRecordError(path, loc, "", "bad_type", f"expected an object, found {type(rec).__name__}")
            source = rec.get("data_source")
            if per_source is not None and per.get(source, 0) >= per_source:
                continue
            extra: dict[str, Any] = rec["extra_info"] if isinstance(rec.get("extra_info"), dict) else {}
            qid = rec.get("id")
            if qid is None:
                qid = f"{source}_{extra.get('split', 'x')}_{extra.get('index', loc.split()[1])}"
            qid = str(qid)
            if qid in seen:
                raise InvalidRecordError(path, loc, "id", "duplicate_id", f"question id '{qid}' appears twice")
            seen.add(qid)
            out.append(Question(qid, searchr1_question(rec, path, loc), searchr1_golden_answers(rec, path, loc),
                                None if source is None else str(source)))
            per[source] = per.get(source, 0) + 1
            if limit is not None and len(out) >= limit:
                return out
    return out


def searchqa_specs(rows_path: str | Path, retriever_url: str, limit: int | None = None, *,
                   per_source: int | None = None, topk: int = DEFAULT_TOPK, timeout: float = 30.0) -> list[Any]:
    """One :class:`~sapd.envs.base.EpisodeSpec` per question of the rows (see :func:`read_questions`),
    each a :class:`SearchQAEnv` over the retriever at ``retriever_url``; category = data source."""

    client = RetrieverClient(retriever_url, topk=topk, timeout=timeout)
    return [EpisodeSpec(q.id, partial(SearchQAEnv, q.question, q.golden_answers, client, q.data_source, q.id),
                        category=q.data_source)
            for q in read_questions(rows_path, limit, per_source)]


def exact_match_by_source(trajectories: Sequence[Any]) -> dict[str, Any]:
    """EM per data source (the trajectory's category), their unweighted average — the "Avg." column of
    docs/SAPD.md §6 — and the EM over all questions. A trajectory's ``success`` is its EM (an episode that
    never answered, or failed, scores 0); this equals ``summarize(...)["by_category"][src]["success"]``.

    >>> from sapd.data.schema import Trajectory
    >>> t = lambda c, s: Trajectory(id=c + str(s), benchmark="searchqa", task="q", turns=[], category=c, success=s)
    >>> em = exact_match_by_source([t("nq", True), t("nq", False), t("hotpotqa", True)])
    >>> em["by_source"], em["average"], round(em["overall"], 3), em["questions"]
    ({'hotpotqa': {'questions': 1, 'em': 1.0}, 'nq': {'questions': 2, 'em': 0.5}}, 0.75, 0.667, 3)
    """
    by: dict[str, list[bool]] = {}
    for t in trajectories:
        by.setdefault(t.category or "-", []).append(bool(t.success))
    per = {s: {"questions": len(v), "em": sum(v) / len(v)} for s, v in sorted(by.items())}
    n = sum(len(v) for v in by.values())
    return {"by_source": per, "average": sum(p["em"] for p in per.values()) / len(per) if per else 0.0,
            "overall": sum(sum(v) for v in by.values()) / n if n else 0.0, "questions": n}
