"""A real byte-level BPE tokenizer with a ChatML template, trained once per test session from the
shipped sample data (see sapd.models.byte_tokenizer.build_sample_tokenizer)."""

from __future__ import annotations

from pathlib import Path

from sapd.models.byte_tokenizer import SAMPLE_DATA, build_sample_tokenizer

__all__ = ["SAMPLE_DATA", "build_test_tokenizer"]


def build_test_tokenizer(out_dir: Path):
    return build_sample_tokenizer(out_dir)
