"""What the prepared GPU proofs (bench/one_gpu.py, bench/gpu_ranks.py) share: their results folder and a fresh
work folder, or a refusal where the proof needs a GPU and none is there."""

from __future__ import annotations

import shutil
from pathlib import Path


def folders(out: str, work: str | None, name: str, *, dry: bool, cuda: bool) -> tuple[Path, Path] | None:
    """``(out, work)``: the results folder (made) and an empty work folder (``work`` or ``out/name``, emptied);
    None, with the line saying why, when the proof is not a dry run and there is no CUDA device."""
    if not dry and not cuda:
        print("no CUDA device: run with --dry-run for the CPU check", flush=True)
        return None
    results = Path(out)
    results.mkdir(parents=True, exist_ok=True)
    scratch = Path(work) if work else results / name
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir(parents=True)
    return results, scratch
