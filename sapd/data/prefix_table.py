"""Reading a committed prefix build (the read side of :mod:`sapd.data.prefixes`): what every stage after
build-prefixes needs — whether a build is committed, and one split's prefix table — without the
trajectory-format parsers the build reads its input with.
"""

from __future__ import annotations

from typing import Any

import pyarrow as pa

from sapd import storage
from sapd.data import shards
from sapd.data.schema import PREFIX_KIND, PREFIX_SCHEMA_VERSION


def committed_build(out: str) -> dict[str, Any] | None:
    """The manifest of the prefix build committed at ``out`` (counts, options, input fingerprint), or None."""
    return shards.read_manifest(out)


def longest_prompt(out: str) -> int | None:
    """Tokens of the longest prompt the committed build at ``out`` kept, or None without a build. Builds
    committed before this figure was recorded give the longest prompt they saw, capped at their limit."""
    build = committed_build(out)
    if build is None:
        return None
    stats, limit = build.get("stats", {}), build.get("options", {}).get("max_prompt_tokens")
    if "max_prompt_tokens_kept" in stats:
        return int(stats["max_prompt_tokens_kept"])
    seen = int(stats.get("max_prompt_tokens_seen", 0)) or None
    return min(seen, limit) if seen and limit else seen


def read_prefixes(out: str, split: str = "train", rank: int = 0, world_size: int = 1) -> pa.Table:
    """The committed prefixes of one split of a build."""
    if committed_build(out) is None:
        raise shards.ShardError(f"{out}: no committed prefix build here (no {shards.MANIFEST_NAME})")
    if split not in ("train", "val"):
        raise ValueError(f"split must be 'train' or 'val', not {split!r}")
    return shards.read_shards(storage.join(out, split), kind=PREFIX_KIND,
                              schema_version=PREFIX_SCHEMA_VERSION, rank=rank, world_size=world_size)
