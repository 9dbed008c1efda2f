"""Tokenizer and models of the embedded TextWorld setting, from random weights: the pieces the demo and the
research studies (``research/``) share.

- :func:`ensure_tokenizer` — a byte-level BPE trained on the pools' text (:mod:`sapd.models.byte_tokenizer`,
  :func:`sapd.demo.pools.pool_texts`).
- :func:`ensure_init_model` — a small Qwen2 of a :class:`ModelShape`, random weights, seeded.
- :func:`sft_run_config` — the ``sapd run`` config (as a mapping: write it as YAML, or give it to
  :func:`sapd.config.config_from_dict`) that SFTs a model on a pool for a number of epochs. Students and
  teachers are made by running it: SFT is a variant of the same pipeline (``variant: sft``).
- :func:`data_section` — the ``data:`` block of a run config over a native TextWorld pool.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

from sapd.models.byte_tokenizer import build_tokenizer
from sapd.models.loading import load_tokenizer
from sapd.models.tiny import build_tiny_model


@dataclass
class ModelShape:
    """A small Qwen2 (tied embeddings; the vocabulary is the tokenizer's)."""

    hidden_size: int = 128
    layers: int = 4
    heads: int = 4
    kv_heads: int = 2
    intermediate_size: int = 256


def ensure_tokenizer(out_dir: str | Path, texts: Callable[[], Sequence[str]], vocab_size: int = 2048):
    """The tokenizer in ``out_dir``; trained first, on ``texts()``, when it is not there yet."""
    if (Path(out_dir) / "tokenizer.json").is_file():
        return load_tokenizer(str(out_dir))
    return build_tokenizer(texts(), out_dir, vocab_size=vocab_size)


def ensure_init_model(tokenizer, out_dir: str | Path, shape: ModelShape, seed: int) -> str:
    """A randomly initialised model of ``shape`` (seeded) in ``out_dir``, built when missing; its folder."""
    if not (Path(out_dir) / "config.json").is_file():
        build_tiny_model(tokenizer, out_dir, seed=seed, **asdict(shape))
    return str(out_dir)


def data_section(data_input: str | Path, history_length: int) -> dict[str, Any]:
    """A run config's ``data`` over a native TextWorld pool (a file or a folder of them): every trajectory
    trains (no validation split), prompts with ``history_length`` recent steps, none dropped for length."""
    return {"input": str(data_input), "format": "native", "benchmark": "textworld", "val_fraction": 0.0,
            "history_length": history_length, "max_prompt_tokens": None}


def sft_rounds(epochs: float, trajectories: int, trajectories_per_round: int) -> int:
    """Rounds of ``trajectories_per_round`` that make ``epochs`` passes over ``trajectories`` (at least one)."""
    return max(1, round(epochs * trajectories / trajectories_per_round))


def sft_run_config(run_root: str | Path, init: str | Path, data_input: str | Path, *, epochs: float,
                   trajectories: int, trajectories_per_round: int, lr: float, history_length: int,
                   minibatch_prefixes: int = 16, warmup_steps: int = 20, seed: int = 0) -> dict[str, Any]:
    """The run config that SFTs ``init`` on the pool ``data_input`` (``trajectories`` of them) for ``epochs``
    passes: :func:`sft_rounds` rounds, minibatches of ``minibatch_prefixes`` prefixes (one micro-batch),
    AdamW at ``lr`` with a cosine schedule.
    Its final checkpoint is the made model; the run root stands for it wherever a model path goes."""
    return {"run_root": str(run_root), "variant": "sft", "model": {"student": str(init)},
            "data": data_section(data_input, history_length),
            "train": {"rounds": sft_rounds(epochs, trajectories, trajectories_per_round),
                      "trajectories_per_round": trajectories_per_round, "minibatch_prefixes": minibatch_prefixes,
                      "micro_batch_prefixes": minibatch_prefixes, "lr": lr, "lr_schedule": "cosine",
                      "warmup_steps": warmup_steps, "seed": seed}}
