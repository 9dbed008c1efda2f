"""The on-disk contracts: the normalised trajectory every loader produces, and the two Parquet schemas
the stages exchange through the run root (prefix rows, scored rows).

Trajectory: the one normalised record every loader produces.

τ = (x, o₁, a₁, …, o_T, a_T, o_{T+1}) (docs/SAPD.md §1): ``task`` is x, ``turns[t].observation`` is o_{t+1}
(what the agent saw before deciding), ``turns[t].response`` the full recorded response a_{t+1}
(``<think>…</think><action>…</action>``, or ``<search>``/``<answer>`` blocks for search QA), and
``turns[t].action`` the executable action extracted from it. ``final_observation`` is o_{T+1}, kept for
completeness; no prefix ever shows it.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

import pyarrow as pa


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


# ---------------------------------------------------------------------------------------------------
# decision prefixes (sapd.data.prefixes writes them)

PREFIX_SCHEMA_VERSION = 1
PREFIX_KIND = "prefixes"

PREFIX_SCHEMA = pa.schema([
    pa.field("prefix_id", pa.string(), nullable=False),  # "<trajectory_id>#<turn_index>"
    pa.field("trajectory_id", pa.string(), nullable=False),
    pa.field("turn_index", pa.int32(), nullable=False),  # 0-based decision index t
    pa.field("num_turns", pa.int32(), nullable=False),  # decisions in the trajectory
    pa.field("benchmark", pa.string(), nullable=False),
    pa.field("category", pa.string()),
    pa.field("task", pa.string(), nullable=False),
    pa.field("messages", pa.string(), nullable=False),  # JSON chat messages before the template
    pa.field("prompt", pa.string(), nullable=False),  # chat-template text, generation prompt appended
    pa.field("prompt_tokens", pa.int32(), nullable=False),
    pa.field("recorded_response", pa.string(), nullable=False),  # metadata only, never a target in SAPD
    pa.field("recorded_action", pa.string(), nullable=False),
    pa.field("previous_action", pa.string()),  # a_{t-1}, for the repetition rule; null at t = 0
    pa.field("success", pa.bool_()),  # the trajectory's outcome, when recorded
    pa.field("split", pa.string(), nullable=False),  # train | val
])


# ---------------------------------------------------------------------------------------------------
# scored rounds (sapd.data.scored writes and reads them): one row per prefix, G responses each

SCORED_SCHEMA_VERSION = 2  # 2: the per-response `advantage` column (GRPO)
SCORED_KIND = "scored"

#: one row per scored prefix: its G sampled responses with the teacher's log-probs, masks and rule scores
SCORED_SCHEMA = pa.schema([
    pa.field("prefix_id", pa.string(), nullable=False),
    pa.field("trajectory_id", pa.string(), nullable=False),
    pa.field("turn_index", pa.int32(), nullable=False),
    pa.field("benchmark", pa.string(), nullable=False),
    pa.field("category", pa.string()),
    pa.field("previous_action", pa.string()),
    pa.field("recorded_action", pa.string(), nullable=False),
    pa.field("prompt_token_ids", pa.list_(pa.int32()), nullable=False),
    # one entry per response of the group (G), each a token list
    pa.field("response_token_ids", pa.list_(pa.list_(pa.int32())), nullable=False),
    pa.field("sampler_logprobs", pa.list_(pa.list_(pa.float32())), nullable=False),
    pa.field("teacher_logprobs", pa.list_(pa.list_(pa.float32())), nullable=False),
    pa.field("action_mask", pa.list_(pa.list_(pa.bool_())), nullable=False),
    pa.field("response_text", pa.list_(pa.string()), nullable=False),
    pa.field("finish_reason", pa.list_(pa.string()), nullable=False),
    pa.field("format_score", pa.list_(pa.float32()), nullable=False),
    pa.field("repetition_score", pa.list_(pa.float32()), nullable=False),
    pa.field("rule_score", pa.list_(pa.float32()), nullable=False),  # Eq. 12: Σ_m α_m f_m
    # a precomputed per-response advantage (GRPO's group-relative task reward); null for the SAPD family
    pa.field("advantage", pa.list_(pa.float32())),
])
