"""What differs between benchmarks: the action tags, the prompt wording, horizons and history lengths,
and how an executable decision is read out of a generated response (docs/FORMATS.md, verl-agent contract).

Two kinds of decision blocks exist:

- ``action``: ALFWorld / WebShop / TextWorld / ScienceWorld — one ``<action>…</action>`` block after a
  ``<think>…</think>`` block;
- ``search``: search QA — one ``<search>…</search>`` (a query) or one ``<answer>…</answer>`` block.
"""

from __future__ import annotations

import re
import string
from dataclasses import dataclass
from typing import Literal

DecisionKind = Literal["action", "search"]


@dataclass(frozen=True)
class BenchmarkSpec:
    name: str
    decision: DecisionKind
    horizon: int  # max turns per episode (docs/SAPD.md §5)
    history_length: int  # default number of recent (observation, action) pairs shown in a prompt
    intro: str  # first sentence of the step prompt
    action_hint: str  # how the closing instruction names the decision


_ACTION_HINT = ("Once you've finished your reasoning, you should choose an admissible action for current step "
                "and present it within <action> </action> tags.")

BENCHMARKS: dict[str, BenchmarkSpec] = {
    "alfworld": BenchmarkSpec("alfworld", "action", 50, 2,
                              "You are an expert agent operating in the ALFRED Embodied Environment.",
                              _ACTION_HINT),
    "webshop": BenchmarkSpec("webshop", "action", 15, 2,
                             "You are an expert autonomous agent operating in the WebShop e-commerce platform.",
                             _ACTION_HINT),
    "textworld": BenchmarkSpec("textworld", "action", 50, 2,
                               "You are an expert agent playing a text adventure game.", _ACTION_HINT),
    "scienceworld": BenchmarkSpec("scienceworld", "action", 50, 2,
                                  "You are an expert agent operating in the ScienceWorld simulator.",
                                  _ACTION_HINT),
    "searchqa": BenchmarkSpec("searchqa", "search", 4, 4,
                              "You are an expert agent answering questions with the help of a search engine.",
                              "If you lack knowledge, call the search engine with <search> query </search>; "
                              "results come back between <information> and </information>. When you know "
                              "the answer, give it inside <answer> </answer> tags without extra explanation."),
}


def get_benchmark(name: str) -> BenchmarkSpec:
    try:
        return BENCHMARKS[name]
    except KeyError:
        raise ValueError(f"unknown benchmark {name!r}; expected one of {sorted(BENCHMARKS)}") from None


def noop_action(benchmark: str) -> str:
    """What an environment is sent for a malformed response: a harmless look ("look" is ambiguous in
    ScienceWorld, whose no-op is "look around")."""
    return "look around" if benchmark == "scienceworld" else "look"


# ALFWorld task types as they appear in game file paths; pick_two must be tested before pick_and_place.
ALFWORLD_CATEGORIES: list[tuple[str, str]] = [
    ("pick_two_obj_and_place", "Pick2"),
    ("look_at_obj_in_light", "Look"),
    ("pick_clean_then_place_in_recep", "Clean"),
    ("pick_heat_then_place_in_recep", "Heat"),
    ("pick_cool_then_place_in_recep", "Cool"),
    ("pick_and_place", "Pick"),
]



def alfworld_category(game_file: str | None) -> str | None:
    """ALFWorld category from a game file path.

    >>> alfworld_category("json_2.1.1/train/pick_cool_then_place_in_recep-Apple-None-Fridge-1/trial_x/game.tw-pddl")
    'Cool'
    """
    if not game_file:
        return None
    for key, name in ALFWORLD_CATEGORIES:
        if key in game_file:
            return name
    return None


# ALFWorld's wording changed in 0.4.0: a placement was "put X in/on Y" (the ETO / SPA-RL era records, the
# original json_2.1.1 games) and is "move X to Y" now; arrivals read "You arrive at loc 16. …" before and
# "You arrive at cabinet 1. …" now, and ETO's environment strips the old "loc N" sentence.
AlfworldWording = Literal["put", "move"]
_PUT = re.compile(r"^put (.+?) (?:in/on|in|on) (.+)$")
_MOVE = re.compile(r"^move (.+?) to (.+)$")
_LEGACY_ARRIVAL = re.compile(r"^You arrive at loc \d+\.\s*")


def alfworld_wording(action: str) -> AlfworldWording | None:
    """Which placement wording an ALFWorld action uses (None: not a placement).

    >>> alfworld_wording("put apple 1 in/on fridge 1"), alfworld_wording("move apple 1 to fridge 1")
    ('put', 'move')
    >>> alfworld_wording("go to fridge 1") is None
    True
    """
    if _PUT.match(action):
        return "put"
    if _MOVE.match(action):
        return "move"
    return None


def other_alfworld_wording(wording: AlfworldWording) -> AlfworldWording:
    return "move" if wording == "put" else "put"


def reword_alfworld_action(action: str, wording: AlfworldWording) -> str:
    """A placement rewritten into ``wording`` (anything else unchanged).

    >>> reword_alfworld_action("move apple 1 to fridge 1", "put")
    'put apple 1 in/on fridge 1'
    >>> reword_alfworld_action("put apple 1 in/on fridge 1", "move")
    'move apple 1 to fridge 1'
    >>> reword_alfworld_action("put apple 1 in fridge 1", "move")
    'move apple 1 to fridge 1'
    """
    if wording == "put" and (m := _MOVE.match(action)):
        return f"put {m.group(1)} in/on {m.group(2)}"
    if wording == "move" and (m := _PUT.match(action)):
        return f"move {m.group(1)} to {m.group(2)}"
    return action


def alfworld_action_key(action: str) -> str:
    """The wording-free form of an ALFWorld action, to compare actions across versions.

    >>> alfworld_action_key("Put Apple 1 in/on  Fridge 1") == alfworld_action_key("move apple 1 to fridge 1")
    True
    """
    return reword_alfworld_action(" ".join(action.lower().split()), "move")


def alfworld_observation(text: str) -> str:
    """An ALFWorld observation as ETO's environment gives it: pre-0.4 "You arrive at loc N. " dropped
    (0.4.x's "You arrive at cabinet 1. " names the receptacle and stays).

    >>> alfworld_observation("You arrive at loc 16. The cabinet 1 is closed.")
    'The cabinet 1 is closed.'
    """
    return _LEGACY_ARRIVAL.sub("", text)


# ---------------------------------------------------------------------------------------------------
# decisions read out of generated text


@dataclass(frozen=True)
class Decision:
    """The executable decision of one response: ``kind`` is "action", "search" or "answer";
    ``content`` the stripped inner text; ``span`` its (start, end) character range in the text;
    ``valid`` False when the response breaks the format (then ``reason`` says how)."""

    kind: str
    content: str
    span: tuple[int, int] | None
    valid: bool
    reason: str = ""


def _block(text: str, tag: str, start: int = 0) -> tuple[int, int] | None:
    """(start, end) of the inner text of the first complete ``<tag>…</tag>`` at or after ``start``."""
    open_tag, close_tag = f"<{tag}>", f"</{tag}>"
    i = text.find(open_tag, start)
    if i < 0:
        return None
    j = text.find(close_tag, i + len(open_tag))
    if j < 0:
        return None
    return i + len(open_tag), j


def parse_action_response(text: str) -> Decision:
    """ALFWorld-style: the text between the first ``<action>`` and the first ``</action>`` after it,
    lowercased; missing action or think tags make it invalid (verl-agent projection)."""
    span = _block(text, "action")
    if span is None:
        return Decision("action", "", None, False, "missing <action>…</action>")
    content = text[span[0]:span[1]].strip().lower()
    if not content:
        return Decision("action", "", span, False, "empty action")
    if _block(text, "think") is None:
        return Decision("action", content, span, False, "missing <think>…</think>")
    if text.count("<action>") > 1:
        return Decision("action", content, span, False, "more than one <action> block")
    return Decision("action", content, span, True)


def parse_search_response(text: str) -> Decision:
    """Search-R1 style: only the text up to the first ``</search>`` or ``</answer>`` counts; then the first
    ``<search>`` block is a search, otherwise the first ``<answer>`` block the answer; both kinds or one
    kind twice in the counted text is invalid."""
    ends = [i + len(t) for t in ("</search>", "</answer>") if (i := text.find(t)) >= 0]
    counted = text[:min(ends)] if ends else text
    n_search, n_answer = counted.count("<search>"), counted.count("<answer>")
    search = _block(counted, "search")
    answer = _block(counted, "answer")
    if search is None and answer is None:
        return Decision("search", "", None, False, "missing <search>…</search> or <answer>…</answer>")
    kind, span = ("search", search) if search is not None else ("answer", answer)
    assert span is not None
    content = counted[span[0]:span[1]].strip()
    if (n_search and n_answer) or n_search > 1 or n_answer > 1:
        return Decision(kind, content, span, False, "both <search> and <answer>, or one of them twice")
    if not content:
        return Decision(kind, "", span, False, f"empty <{kind}> block")
    return Decision(kind, content, span, True)


def parse_decision(text: str, benchmark: str | BenchmarkSpec) -> Decision:
    spec = benchmark if isinstance(benchmark, BenchmarkSpec) else get_benchmark(benchmark)
    return parse_search_response(text) if spec.decision == "search" else parse_action_response(text)


# ---------------------------------------------------------------------------------------------------
# search-QA answer scoring


def normalize_answer(s: str) -> str:
    """Lowercase, drop punctuation and the articles a/an/the, collapse white space (SQuAD-style EM).

    >>> normalize_answer("The  Eiffel-Tower!")
    'eiffeltower'
    """
    s = s.lower()
    s = "".join(ch for ch in s if ch not in set(string.punctuation))
    s = re.sub(r"\b(a|an|the)\b", " ", s)
    return " ".join(s.split())


def exact_match(prediction: str, golden_answers: list[str]) -> bool:
    """True when the normalised prediction equals any normalised golden answer.

    >>> exact_match("the Beatles", ["Beatles", "The Fab Four"])
    True
    """
    pred = normalize_answer(prediction)
    return any(pred == normalize_answer(g) for g in golden_answers)
