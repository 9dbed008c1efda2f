"""Does a recorded turn fit the chosen benchmark? Every loader asks, for every turn, before a trajectory
is kept (docs/FORMATS.md, "What every turn must pass").

The recorded responses are the SFT targets and the recorded actions the history every later prompt
shows, so data recorded for another benchmark, or written in a form the benchmark's parser would
reject, must be refused rather than cut into prefixes. A turn fits when:

1. no chat-template control token (``<|im_end|>``, ``<|eot_id|>``, ``</s>`` …) is left in its text;
2. its response parses under the benchmark's projection (:func:`sapd.method.benchmarks.parse_decision`, the
   one the format rule and the agent loop use: verl-agent's for ``<think>``/``<action>``, Search-R1's for
   ``<search>``/``<answer>``) and names the turn's recorded action;
3. where the benchmark's command language is closed (its spec's ``commands``), the action is one of its
   commands: ALFWorld's verbs, WebShop's ``search[…]`` / ``click[…]``. (ScienceWorld's and TextWorld's
   command sets are open or game-specific, so only 1–2 apply to them.)

Data recorded for another benchmark is recognised by that benchmark's ``fingerprints`` (text only its
environment or prompt template writes), even where the command languages overlap (ALFWorld's and
ScienceWorld's "go to", "open", "look" …). Both are fields of :class:`sapd.method.benchmarks.BenchmarkSpec`.
"""

from __future__ import annotations

import re

from sapd.data.react import special_token
from sapd.method.benchmarks import BENCHMARKS, BenchmarkSpec, parse_decision


def foreign_benchmark(text: str, spec: BenchmarkSpec) -> tuple[str, str] | None:
    """(reason, detail) when ``text`` (a first observation or a rendered prompt) carries another
    registered benchmark's fingerprint (:attr:`~sapd.method.benchmarks.BenchmarkSpec.fingerprints`).

    >>> from sapd.method.benchmarks import get_benchmark
    >>> foreign_benchmark("You are in the middle of a room. Looking quickly around you, you see a desk 1.",
    ...                   get_benchmark("scienceworld"))[0]
    'benchmark_mismatch'
    """
    for other in BENCHMARKS.values():
        if other.name == spec.name:
            continue
        for mark in other.fingerprints:
            if mark in text:
                return "benchmark_mismatch", (f"the text reads like {other.name} data ({mark!r}), but --benchmark "
                                              f"is {spec.name}: is --benchmark {other.name} meant?")
    return None


def _norm(text: str) -> str:
    return " ".join(text.lower().split())


def _snippet(text: str, n: int = 60) -> str:
    text = " ".join(text.split())
    return repr(text if len(text) <= n else text[:n] + "…")


def text_problem(text: str) -> tuple[str, str] | None:
    """(reason, detail) when a prompt-side text (task, observation) carries a chat-template token."""
    tok = special_token(text)
    if tok is None:
        return None
    return "special_token", (f"holds the chat-template token {tok!r}, a leaked end-of-turn or role marker from "
                             "the recording; remove it from the data")


def turn_problem(response: str, action: str, spec: BenchmarkSpec) -> tuple[str, str] | None:
    """(reason, detail) when a recorded response/action pair does not fit ``spec``; None when it does.

    >>> from sapd.method.benchmarks import get_benchmark
    >>> turn_problem("<think>x</think>\\n<action>go to desk 1</action>", "go to desk 1", get_benchmark("alfworld"))
    >>> turn_problem("<think>x</think>\\n<action>go to desk 1</action>", "go to desk 1", get_benchmark("searchqa"))[0]
    'invalid_response'
    >>> turn_problem("<think>x</think>\\n<action>teleport to kitchen</action>", "teleport to kitchen",
    ...              get_benchmark("alfworld"))[0]
    'not_benchmark_action'
    """
    tok = special_token(response)
    if tok is not None:
        return "special_token", (f"holds the chat-template token {tok!r}, a leaked end-of-turn marker from the "
                                 "recording; the chat template adds its own, so a target that keeps it teaches the "
                                 "model to end its turn there: remove it from the data")
    d = parse_decision(response, spec)
    if not d.valid:
        return "invalid_response", (f"the response is not a valid {spec.name} decision ({d.reason}; the format "
                                    f"rule and the agent loop read it the same way): {_snippet(response)}; "
                                    "is --benchmark right?")
    if _norm(d.content) != _norm(action):
        return "action_mismatch", (f"the response's decision is {_snippet(d.content)} but the recorded action is "
                                   f"{_snippet(action)}")
    if spec.commands is not None and not re.match(spec.commands, d.content):
        return "not_benchmark_action", (f"action {_snippet(action)} is not {spec.commands_hint}; is --benchmark "
                                        f"{spec.name} right?")
    return None
