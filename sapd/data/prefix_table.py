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


def read_prefixes(out: str, split: str = "train", rank: int = 0, world_size: int = 1) -> pa.Table:
    """The committed prefixes of one split of a build."""
    if committed_build(out) is None:
        raise shards.ShardError(f"{out}: no committed prefix build here (no {shards.MANIFEST_NAME})")
    if split not in ("train", "val"):
        raise ValueError(f"split must be 'train' or 'val', not {split!r}")
    return shards.read_shards(storage.join(out, split), kind=PREFIX_KIND,
                              schema_version=PREFIX_SCHEMA_VERSION, rank=rank, world_size=world_size)
