"""A complete tiny run: a real tokenizer, a tiny Qwen2 student and a different tiny teacher (same
tokenizer), the shipped ALFWorld sample as data, and a config small enough for seconds on a CPU."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tests.tokenizer_util import SAMPLE_DATA, build_test_tokenizer


def make_models(root: Path) -> tuple[str, str]:
    from sapd.models.tiny import build_tiny_model
    tok = build_test_tokenizer(root / "tokenizer")
    student, teacher = root / "student", root / "teacher"
    if not (student / "config.json").exists():
        build_tiny_model(tok, student, seed=0)
        build_tiny_model(tok, teacher, seed=1)
    return str(student), str(teacher)


def tiny_config(run_root: str, student: str, teacher: str, **over: Any) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "run_root": run_root,
        "variant": "sapd",
        "data": {"input": str(SAMPLE_DATA / "alfworld_eto.json"), "format": "eto", "benchmark": "alfworld",
                 "max_prompt_tokens": 2048},
        "model": {"student": student, "teacher": teacher},
        "sampling": {"group_size": 2, "max_new_tokens": 12, "prompts_per_batch": 4},
        "train": {"rounds": 2, "trajectories_per_round": 2, "minibatch_prefixes": 4, "micro_batch_prefixes": 2,
                  "lr": 1e-3, "seed": 0},
    }
    for k, v in over.items():
        if isinstance(v, dict):
            cfg.setdefault(k, {}).update(v)
        else:
            cfg[k] = v
    return cfg
