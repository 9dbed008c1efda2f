"""A real byte-level BPE tokenizer with a ChatML template, trained once per test session from the
shipped sample data (see sapd.models.byte_tokenizer.build_sample_tokenizer)."""

from __future__ import annotations

from pathlib import Path

from sapd.models.byte_tokenizer import SAMPLE_DATA, build_sample_tokenizer

__all__ = ["SAMPLE_DATA", "build_test_tokenizer", "qwen_tokenizer"]


def build_test_tokenizer(out_dir: Path):
    return build_sample_tokenizer(out_dir)


QWEN_TOKENIZER = Path(__file__).resolve().parent / "assets" / "qwen2.5-tokenizer"


def qwen_tokenizer(out_dir: Path):
    """The real Qwen2.5 tokenizer and chat template (tests/assets/qwen2.5-tokenizer, Apache-2.0), unpacked
    into ``out_dir`` and loaded the way sapd loads a model folder's tokenizer."""
    import lzma
    import shutil

    from sapd.models.loading import load_tokenizer
    out_dir.mkdir(parents=True, exist_ok=True)
    if not (out_dir / "tokenizer.json").is_file():
        for name in ("tokenizer_config.json", "chat_template.jinja"):
            shutil.copy(QWEN_TOKENIZER / name, out_dir / name)
        (out_dir / "tokenizer.json").write_bytes(lzma.decompress((QWEN_TOKENIZER / "tokenizer.json.xz").read_bytes()))
    return load_tokenizer(str(out_dir))
