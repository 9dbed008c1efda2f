"""The one normalised trajectory record every loader produces.

τ = (x, o₁, a₁, …, o_T, a_T, o_{T+1}) (SAPD.md §1): ``task`` is x, ``turns[t].observation`` is o_{t+1}
(what the agent saw before deciding), ``turns[t].response`` the full recorded response a_{t+1}
(``<think>…</think><action>…</action>``, or ``<search>``/``<answer>`` blocks for search QA), and
``turns[t].action`` the executable action extracted from it. ``final_observation`` is o_{T+1}, kept for
completeness; no prefix ever shows it.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

TRAJECTORY_SCHEMA_VERSION = 1


@dataclass
class Turn:
    observation: str  # o_t: the observation the agent acted on
    response: str  # a_t: the full recorded response text
    action: str  # the executable action inside the response (never empty in a valid record)
    admissible_actions: list[str] | None = None  # when the source recorded them


@dataclass
class Trajectory:
    id: str
    benchmark: str  # alfworld | webshop | searchqa | textworld | scienceworld | …
    task: str  # the task instruction x
    turns: list[Turn]
    category: str | None = None  # Pick, Look, … ; nq, hotpotqa, …
    success: bool | None = None
    final_observation: str | None = None  # o_{T+1}
    metadata: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Trajectory":
        turns = [Turn(**t) for t in d["turns"]]
        meta = d.get("metadata") or {}
        if isinstance(meta, str):  # Parquet stores metadata as a JSON string
            meta = json.loads(meta)
        return cls(id=str(d["id"]), benchmark=d["benchmark"], task=d["task"], turns=turns,
                   category=d.get("category"), success=d.get("success"),
                   final_observation=d.get("final_observation"), metadata=meta)
