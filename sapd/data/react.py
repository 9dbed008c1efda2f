"""ReAct responses ("Thought: …\\nAction: …") read the way the agents that recorded them read them, and
turned into the benchmark's decision block (docs/FORMATS.md, "Parsing rules").

What the reference parsers do (read in their repositories; none of their code is used here):

- ETO (``eval_agent/envs/{alfworld,webshop,sciworld}_env.py``) strips the output and takes everything
  after the **first** ``Action:`` (case-sensitive; one optional white-space character after the colon
  for ALFWorld, exactly one space for WebShop and ScienceWorld) up to the **end of the text**, as one
  string, and sends it to the environment. A second Action line, a made-up "Observation: …" or another
  Thought written after the action is therefore part of the action the environment receives (and
  rejects); a lower-case ``action:`` is not found at all ("Error Input").
- FireAct (``generation.py``) splits the output at ``"\\nAction: "`` and keeps the first piece after it,
  so again the first action wins and text after it (up to a further ``\\nAction: ``) stays in it; a
  bracket action ``verb[arg]`` is read as the text before the first ``[`` and the text after it minus
  its last character (assumed to be ``]``), so anything after the closing bracket corrupts the argument.

sapd reads the same first action and keeps a response only when the two agree on it and the environment
would have received exactly that action: text after the action line is refused (``text_after_action``,
naming what follows) rather than silently cut off or silently kept inside the action.
"""

from __future__ import annotations

import re
from dataclasses import dataclass


class ResponseProblem(ValueError):
    """A recorded response that cannot be read as one decision; ``reason`` is the report key
    (docs/FORMATS.md lists them), ``detail`` the sentence for people. Callers add file, record, field."""

    def __init__(self, reason: str, detail: str):
        super().__init__(detail)
        self.reason = reason
        self.detail = detail


@dataclass(frozen=True)
class ReactStep:
    thought: str  # the text before the Action line, without its "Thought:" label ("" when there is none)
    action: str  # the action, stripped


_ACTION_LINE = re.compile(r"^[ \t]*Action:", re.M)
_ACTION_ANY_CASE = re.compile(r"^[ \t]*action[ \t]*:", re.M | re.I)
_THOUGHT_LABEL = re.compile(r"^thought[ \t]*:[ \t]*", re.I)
# chat-template control tokens (ChatML <|im_end|>, Llama-3 <|eot_id|>, GPT <|endoftext|>, Llama-2 </s>): a
# recording artefact, never model text; the chat template adds its own, so one left in a target teaches the
# model to end its turn mid-response, and one left in a prompt breaks the turn structure
_SPECIAL_TOKEN = re.compile(r"<\|[A-Za-z0-9_]+\|>|</s>")
_TAGS = ("<think>", "</think>", "<action>", "</action>", "<search>", "</search>", "<answer>", "</answer>")
_ACK = re.compile(r"^\s*(?:ok(?:ay)?|sure|understood|got it|alright|i understand)\b", re.I)
_BRACKET = re.compile(r"^([A-Za-z_]+)\[(.*)\]$", re.S)


def _snippet(text: str, n: int = 60) -> str:
    text = " ".join(text.split())
    return repr(text if len(text) <= n else text[:n] + "…")


def special_token(text: str) -> str | None:
    """The first chat-template control token in ``text``, if any.

    >>> special_token("go to desk 1<|im_end|>")
    '<|im_end|>'
    >>> special_token("go to desk 1") is None
    True
    """
    m = _SPECIAL_TOKEN.search(text)
    return m.group() if m else None


def is_tagged(text: str) -> bool:
    """True when a response is already written with decision tags (``<think>``, ``<action>``,
    ``<search>``, ``<answer>``) rather than as "Thought: …\\nAction: …"."""
    return any(t in text for t in _TAGS)


def is_acknowledgement(text: str) -> bool:
    """True for the assistant's reply to an instruction message: "OK", "OK.", "Ok.", AgentGym's "OK. I'll
    follow your instructions and try my best to solve the task." — a short agreement holding no action.

    >>> replies = ["OK", "Ok.", "OK. I'll follow your instructions.", "Thought: ok\\nAction: look"]
    >>> [is_acknowledgement(t) for t in replies]
    [True, True, True, False]
    """
    return bool(_ACK.match(text)) and "Action:" not in text and not is_tagged(text)


def _after_action_problem(after: str) -> ResponseProblem:
    first = after.lstrip().split("\n", 1)[0].strip()
    if first.startswith("Action:"):
        what = f"a second 'Action:' line follows ({_snippet(first)})"
    elif first.startswith("Observation:"):
        what = f"an 'Observation:' the model wrote itself follows the action ({_snippet(first)})"
    elif first.lower().startswith("thought:"):
        what = f"another Thought/Action follows ({_snippet(after)})"
    else:
        what = f"more text follows the action line ({_snippet(after)})"
    return ResponseProblem(
        "text_after_action",
        f"{what}; ETO's and FireAct's parsers take everything after the first 'Action:' as the action, so the "
        "environment would have received it too: remove the extra text or drop the record")


def parse_react(text: str) -> ReactStep:
    """The thought and the action of a ReAct response, as ETO and FireAct read it; raises
    :class:`ResponseProblem` when they would not have sent exactly one clean action.

    >>> parse_react("Thought: find the mug.\\nAction: go to table 1")
    ReactStep(thought='find the mug.', action='go to table 1')
    >>> parse_react("Action: open fridge 1 ")
    ReactStep(thought='', action='open fridge 1')
    >>> parse_react("Thought: search it.\\nAction: search[marvel Action: figure 6 inch]").action
    'search[marvel Action: figure 6 inch]'
    >>> parse_react("Thought: x\\nAction: go to desk 1\\nObservation: On the desk 1, you see a pen 1.")
    ... # doctest: +ELLIPSIS
    Traceback (most recent call last):
    sapd.data.react.ResponseProblem: an 'Observation:' the model wrote itself follows the action ('Observ...
    """
    text = text.strip()
    m = _ACTION_LINE.search(text)
    if m is None:
        other = _ACTION_ANY_CASE.search(text)
        if other is not None:
            raise ResponseProblem("empty_action", f"no 'Action:' line, only {other.group().strip()!r}: ETO's and "
                                  "FireAct's parsers match 'Action:' exactly, so they reject this response too")
        if "Action:" in text:
            raise ResponseProblem("ambiguous_action", "'Action:' appears only inside a line, not at the start of "
                                  "one: ETO's parser would start the action there, FireAct's would not find it; put "
                                  "the action on its own 'Action:' line")
        raise ResponseProblem("empty_action", "response has no 'Action: …' line")
    head = text[:m.start()]
    if "Action:" in head:
        raise ResponseProblem("ambiguous_action", f"'Action:' already appears inside the thought "
                              f"({_snippet(head[head.index('Action:'):])}): ETO's parser would start the action "
                              "there, FireAct's at the 'Action:' line; remove the stray 'Action:' or drop the record")
    lines = text[m.end():].split("\n")
    # the action is the rest of the Action line; ETO's ALFWorld parser also accepts it on the next line
    # ("Action:\n go to …"), so a blank Action line takes the next non-blank one
    k = 0 if lines[0].strip() else next((i for i in range(1, len(lines)) if lines[i].strip()), None)
    if k is None:
        raise ResponseProblem("empty_action", "the 'Action:' line is empty")
    action = lines[k].strip()
    after = "\n".join(lines[k + 1:])
    if after.strip():
        raise _after_action_problem(after)
    thought = _THOUGHT_LABEL.sub("", head.strip(), count=1).strip()
    return ReactStep(thought=thought, action=action)


def bracket_action(action: str) -> tuple[str, str] | None:
    """``verb[argument]`` → (verb, argument); None when the action is not exactly one bracket call.

    >>> bracket_action("search[marvel Action: figure 6 inch]")
    ('search', 'marvel Action: figure 6 inch')
    >>> bracket_action("search[nba awards] Kevin Durant") is None
    True
    """
    m = _BRACKET.match(action)
    return (m.group(1), m.group(2)) if m else None


def decision_response(thought: str, action: str, decision: str) -> tuple[str, str]:
    """A ReAct step as the benchmark's response and executable action (docs/FORMATS.md); ``decision`` is the
    benchmark's kind of decision block (the ``decision`` of its :class:`sapd.method.benchmarks.BenchmarkSpec`):

    - "action" (ALFWorld, WebShop, ScienceWorld, TextWorld): ``<think>thought</think>\\n<action>action</action>``;
    - "search" (search QA): ``search[q]`` → ``<think>thought</think>\\n<search>q</search>`` (action ``q``),
      ``finish[a]`` → ``<answer>a</answer>`` (action ``a``), the two tools of ReAct-style QA agents (FireAct);
      any other action cannot be written as a search QA decision and is refused.

    >>> decision_response("look first", "go to desk 1", "action")
    ('<think>look first</think>\\n<action>go to desk 1</action>', 'go to desk 1')
    >>> decision_response("done", "finish[Badr Hari]", "search")
    ('<think>done</think>\\n<answer>Badr Hari</answer>', 'Badr Hari')
    """
    if decision != "search":
        return f"<think>{thought}</think>\n<action>{action}</action>", action
    call = bracket_action(action)
    if call is None:
        if "[" in action and "]" in action:
            raise ResponseProblem("not_benchmark_action", f"action {_snippet(action)} has text after its closing "
                                  "']' (FireAct's parser would cut the argument at the last character)")
        raise ResponseProblem("not_benchmark_action", f"action {_snippet(action)} is not a search QA decision "
                              "(search[query] or finish[answer]); is --benchmark right?")
    verb, arg = call[0].lower(), call[1].strip()
    tag = {"search": "search", "finish": "answer"}.get(verb)
    if tag is None:
        raise ResponseProblem("not_benchmark_action", f"action {_snippet(action)}: '{call[0]}' is not a search QA "
                              "tool; sapd's search QA decisions are search[query] (<search>) and finish[answer] "
                              "(<answer>)")
    if not arg:
        raise ResponseProblem("empty_action", f"action {_snippet(action)} has an empty argument")
    return f"<think>{thought}</think>\n<{tag}>{arg}</{tag}>", arg
