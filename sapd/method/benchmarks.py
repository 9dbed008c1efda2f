"""What differs between benchmarks, in one registered spec each (``BenchmarkSpec``, in ``BENCHMARKS``):
the decision format, the prompt wording, horizons and history lengths, how an executable decision is read
out of a generated response (docs/FORMATS.md, verl-agent contract), the text that tells its recorded data
from another benchmark's, the split names of its panel, the starter config ``sapd init`` writes for it and
the values its chart overlay sets. Everything here is plain data: the environment adapter and the panel
that plays it register against the spec's name in ``sapd.envs.panels`` (docs/guides/new-benchmark.md).

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
DECISION_KINDS: tuple[DecisionKind, ...] = ("action", "search")


@dataclass(frozen=True)
class Starter:
    """What ``sapd init --benchmark NAME`` writes for the benchmark (``sapd.run.starter``); its chart overlay,
    where it has one (``charts/sapd/values/NAME.yaml``), sets the same format and round size."""

    format: str  # data.format of the data usually recorded for it: a format of sapd.data.loaders, or auto
    example: str  # an example input file name, shown after the PATH/TO/ placeholder
    what: str  # what such data usually is, one phrase ("ETO style expert conversations")
    before: str = ""  # commented lines at the top of the starter: what to do before `sapd run`
    trajectories_per_round: int = 16  # train.trajectories_per_round (the paper: 16; search QA 128)


@dataclass(frozen=True)
class BenchmarkSpec:
    name: str
    decision: DecisionKind
    horizon: int  # max turns per episode (docs/SAPD.md §5)
    history_length: int  # default number of recent (observation, action) pairs shown in a prompt
    intro: str  # first sentence of the step prompt
    action_hint: str  # how the closing instruction names the decision
    starter: Starter  # the starter config `sapd init` writes
    noop: str = "look"  # what the environment is sent for a malformed response: a harmless action
    # text only this benchmark's environment or prompt writes: data read with another --benchmark is
    # refused when its first observation or prompt holds one of them (sapd.data.fit.foreign_benchmark)
    fingerprints: tuple[str, ...] = ()
    # its closed command language, a regular expression every recorded action must match (None: open or
    # game-specific), and how a refusal names it (sapd.data.fit.turn_problem)
    commands: str | None = None
    commands_hint: str = ""
    splits: tuple[str, ...] = ()  # the names its panel's --split takes (none: the panel has no splits)
    extra: str | None = None  # the pyproject extra that installs its environment's simulator (None: none)
    # what its chart overlay (charts/sapd/values/NAME.yaml) sets beyond the run root, the data, the models and
    # the starter's format and round size: (dotted key, value) pairs
    overlay: tuple[tuple[str, object], ...] = ()


BENCHMARKS: dict[str, BenchmarkSpec] = {}


def register_benchmark(spec: BenchmarkSpec) -> BenchmarkSpec:
    """Add ``spec`` to ``BENCHMARKS`` under its name: from then on every ``--benchmark`` flag,
    ``data.benchmark`` and ``sapd init`` accept it. A name already taken, an unknown decision kind or a
    command pattern that does not compile is refused (ValueError)."""
    if not re.fullmatch(r"[a-z][a-z0-9_]*", spec.name):
        raise ValueError(f"benchmark name {spec.name!r}: lowercase letters, digits and _ only, a letter first")
    if spec.name in BENCHMARKS:
        raise ValueError(f"benchmark {spec.name!r} is registered already")
    if spec.decision not in DECISION_KINDS:
        raise ValueError(f"benchmark {spec.name!r}: decision {spec.decision!r} is not one of "
                         f"{', '.join(DECISION_KINDS)}")
    if spec.horizon < 1 or spec.history_length < 0 or spec.starter.trajectories_per_round < 1:
        raise ValueError(f"benchmark {spec.name!r}: horizon and trajectories_per_round must be positive, "
                         "history_length not negative")
    if spec.commands is not None:
        try:
            re.compile(spec.commands)
        except re.error as e:
            raise ValueError(f"benchmark {spec.name!r}: commands {spec.commands!r} is not a regular expression: "
                             f"{e}") from None
    BENCHMARKS[spec.name] = spec
    return spec


def get_benchmark(name: str) -> BenchmarkSpec:
    try:
        return BENCHMARKS[name]
    except KeyError:
        raise ValueError(f"unknown benchmark {name!r}; expected one of {sorted(BENCHMARKS)}") from None


# the split names --split lists first (then each benchmark's own, in registration order)
COMMON_SPLITS = ("train", "dev", "test", "all")


def split_names() -> list[str]:
    """Every split name a registered benchmark's panel takes, as the ``--split`` flag offers them."""
    return list(dict.fromkeys([*COMMON_SPLITS, *(s for spec in BENCHMARKS.values() for s in spec.splits)]))


def noop_action(benchmark: str) -> str:
    """What an environment is sent for a malformed response: a harmless look ("look" is ambiguous in
    ScienceWorld, whose no-op is "look around")."""
    spec = BENCHMARKS.get(benchmark)
    return spec.noop if spec is not None else "look"


# ---------------------------------------------------------------------------------------------------
# the five benchmarks of the paper and the embedded environments

_ACTION_HINT = ("Once you've finished your reasoning, you should choose an admissible action for current step "
                "and present it within <action> </action> tags.")

# ALFWorld's text commands (both wordings of placing: "put X in/on Y" before 0.4, "move X to Y" after)
_ALFWORLD_COMMANDS = (r"(?s)^(?:(?:go to|open|close|take|put|move|use|toggle|heat|cool|clean|slice|examine) \S.*"
                      r"|look|inventory|help)$")

_ALFWORLD_BEFORE = """\

# ALFWorld in three commands (pip install 'sapd[alfworld]'; nothing is downloaded):
#   sapd alfworld-games --out alfworld-data --split train --per-type 20        # or alfworld-download's data
#   sapd alfworld-games --out alfworld-data --split valid_unseen --per-type 5
#   ALFWORLD_DATA=alfworld-data sapd collect-expert --benchmark alfworld --split train \\
#       --out alfworld_expert.jsonl                                            # ALFWorld's expert plays
# then fill in data.input below with alfworld_expert.jsonl, and after `sapd run`:
#   ALFWORLD_DATA=alfworld-data sapd evaluate --run runs/alfworld --benchmark alfworld --split valid_unseen
"""

for _spec in (
    BenchmarkSpec(
        "alfworld", "action", 50, 2, "You are an expert agent operating in the ALFRED Embodied Environment.",
        _ACTION_HINT,
        Starter("auto", "alfworld_expert.jsonl", "`sapd collect-expert` records (above) or ETO / SPA-RL conversations",
                before=_ALFWORLD_BEFORE),
        fingerprints=("ALFRED Embodied Environment", "Welcome to TextWorld, ALFRED!",
                      "Looking quickly around you, you see"),
        commands=_ALFWORLD_COMMANDS,
        commands_hint=("an ALFWorld command (go to, open, close, take … from, put … in/on, move … to, use, "
                       "heat/cool/clean/slice … with, examine, look, inventory)"),
        splits=("train", "valid_seen", "valid_unseen", "dev", "test"), extra="alfworld",
        # ALFWorld's engine is in the eval image only
        overlay=(("evaluate.image.flavor", "eval"),)),
    BenchmarkSpec(
        "webshop", "action", 15, 2, "You are an expert autonomous agent operating in the WebShop e-commerce platform.",
        _ACTION_HINT, Starter("eto", "webshop_sft.json", "ETO style expert conversations"),
        fingerprints=("WebShop e-commerce platform", "WebShop [SEP]"),
        commands=r"(?si)^(?:search|click)\[.+\]$", commands_hint="a WebShop action (search[…] or click[…])",
        # a WebShop server of your own (WebShop's web_agent_site), no extra
        overlay=(("evaluate.webshop.url", "http://webshop.sapd-system.svc.cluster.local:3000"),)),
    BenchmarkSpec(
        "textworld", "action", 50, 2, "You are an expert agent playing a text adventure game.", _ACTION_HINT,
        Starter("native", "trajectories.jsonl", "sapd's own records (`sapd collect-expert`, `sapd convert`)"),
        extra="textworld"),
    BenchmarkSpec(
        "scienceworld", "action", 50, 2, "You are an expert agent operating in the ScienceWorld simulator.",
        _ACTION_HINT, Starter("eto", "sciworld_sft.json", "ETO style expert conversations"),
        noop="look around", fingerprints=("ScienceWorld simulator", "This room is called the"),
        splits=("train", "dev", "test", "all"), extra="scienceworld"),
    BenchmarkSpec(
        "searchqa", "search", 4, 4, "You are an expert agent answering questions with the help of a search engine.",
        "If you lack knowledge, call the search engine with <search> query </search>; "
        "results come back between <information> and </information>. When you know "
        "the answer, give it inside <answer> </answer> tags without extra explanation.",
        Starter("searchr1", "searchqa_train.parquet", "Search-R1 rollouts (rows with golden answers)",
                trajectories_per_round=128),
        extra="searchqa",  # the local BM25 retriever (sapd retriever); any Search-R1 /retrieve server works
        overlay=(("teacherScores.parallelism", 8),)),
):
    register_benchmark(_spec)
del _spec


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
