"""Parquet shards committed by a manifest written last (docs/design/storage.md "Storage layout").

An output folder (local or ``s3://``) holds ``part-NNNNN.parquet`` files and ``_MANIFEST.json``. The
manifest lists every part with its row count and SHA-256 and is written only after all parts landed,
so a folder without a manifest (a crashed or still-running writer) is never read as complete, and a
reader can tell a damaged or replaced part from the one that was committed.
"""

from __future__ import annotations

import hashlib
import io
import time
from typing import Any, Iterator

import pyarrow as pa
import pyarrow.parquet as pq

from sapd import storage

MANIFEST_NAME = "_MANIFEST.json"


class ShardError(RuntimeError):
    """An output that is missing, not committed, or not what its manifest says."""


def manifest_uri(folder: str) -> str:
    return storage.join(folder, MANIFEST_NAME)


def read_manifest(folder: str) -> dict[str, Any] | None:
    """The committed manifest of ``folder``, or None when nothing is committed there."""
    uri = manifest_uri(folder)
    if not storage.exists(uri):
        return None
    return storage.read_json(uri)


def _part_entry(name: str, data: bytes, rows: int) -> dict[str, Any]:
    return {"name": name, "rows": rows, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def _encode_part(table: pa.Table, row_group_size: int) -> bytes:
    buf = io.BytesIO()
    pq.write_table(table, buf, row_group_size=row_group_size, compression="zstd")
    return buf.getvalue()


def _new_manifest(kind: str, schema_version: int, rows: int, parts: list[dict[str, Any]], columns: list[str],
                  extra: dict[str, Any] | None) -> dict[str, Any]:
    return {"kind": kind, "schema_version": schema_version, "rows": rows, "parts": parts, "columns": columns,
            "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), **(extra or {})}


def _clear_uncommitted(folder: str) -> None:
    if read_manifest(folder) is not None:
        raise ShardError(f"{folder} is already committed; refusing to overwrite it (delete it first)")
    storage.delete_prefix(folder)


def write_shards(folder: str, table: pa.Table, *, kind: str, schema_version: int,
                 rows_per_part: int = 50_000, row_group_size: int = 1_000,
                 extra: dict[str, Any] | None = None, commit: bool = True) -> dict[str, Any]:
    """Write ``table`` as parts under ``folder`` and (unless ``commit=False``) the manifest last.

    Leftover files of an earlier, uncommitted attempt are removed first so the folder ends up holding
    exactly what the manifest lists. Returns the manifest dict (also when not yet committed, so a caller
    that commits several folders at once can write it later with :func:`commit_manifest`).
    """
    _clear_uncommitted(folder)
    parts = []
    n_parts = max(1, -(-table.num_rows // rows_per_part))
    for i in range(n_parts):
        chunk = table.slice(i * rows_per_part, rows_per_part)
        data = _encode_part(chunk, row_group_size)
        name = f"part-{i:05d}.parquet"
        storage.write_bytes(storage.join(folder, name), data)
        parts.append(_part_entry(name, data, chunk.num_rows))
    manifest = _new_manifest(kind, schema_version, table.num_rows, parts, table.schema.names, extra)
    if commit:
        commit_manifest(folder, manifest)
    return manifest


class ShardWriter:
    """:func:`write_shards` for rows that arrive over time: rows are buffered and a part is written each
    time ``rows_per_part`` of them are waiting, so memory holds at most one part's rows. The parts and the
    manifest are exactly what :func:`write_shards` writes for the same rows in the same order."""

    def __init__(self, folder: str, schema: pa.Schema, *, kind: str, schema_version: int,
                 rows_per_part: int = 50_000, row_group_size: int = 1_000):
        if rows_per_part < 1:
            raise ValueError("rows_per_part must be at least 1")
        _clear_uncommitted(folder)
        self.folder, self.schema, self.kind, self.schema_version = folder, schema, kind, schema_version
        self.rows_per_part, self.row_group_size = rows_per_part, row_group_size
        self.parts: list[dict[str, Any]] = []
        self.rows = 0
        self._buffer: list[dict[str, Any]] = []

    def add(self, rows: list[dict[str, Any]]) -> None:
        self._buffer.extend(rows)
        while len(self._buffer) >= self.rows_per_part:
            self._write(self._buffer[:self.rows_per_part])
            del self._buffer[:self.rows_per_part]

    def _write(self, rows: list[dict[str, Any]]) -> None:
        data = _encode_part(pa.Table.from_pylist(rows, schema=self.schema), self.row_group_size)
        name = f"part-{len(self.parts):05d}.parquet"
        storage.write_bytes(storage.join(self.folder, name), data)
        self.parts.append(_part_entry(name, data, len(rows)))
        self.rows += len(rows)

    def close(self, *, extra: dict[str, Any] | None = None, commit: bool = True) -> dict[str, Any]:
        """Write what is buffered (an empty part when nothing was ever added, as write_shards does) and
        return the manifest, committed unless ``commit=False``."""
        if self._buffer or not self.parts:
            self._write(self._buffer)
            self._buffer = []
        manifest = _new_manifest(self.kind, self.schema_version, self.rows, self.parts, self.schema.names, extra)
        if commit:
            commit_manifest(self.folder, manifest)
        return manifest


def commit_manifest(folder: str, manifest: dict[str, Any]) -> None:
    storage.write_json(manifest_uri(folder), manifest)


def _committed(folder: str, kind: str | None, schema_version: int | None) -> dict[str, Any]:
    manifest = read_manifest(folder)
    if manifest is None:
        hint = " (a writer may have crashed or still be running)" if storage.list_files(folder) else ""
        raise ShardError(f"{folder}: no {MANIFEST_NAME}, so nothing is committed here{hint}")
    if kind is not None and manifest.get("kind") != kind:
        raise ShardError(f"{folder}: holds '{manifest.get('kind')}' shards, expected '{kind}'")
    if schema_version is not None and manifest.get("schema_version") != schema_version:
        raise ShardError(f"{folder}: schema version {manifest.get('schema_version')}, this sapd reads "
                         f"version {schema_version}; rebuild the output with this version")
    return manifest


def _read_part(folder: str, part: dict[str, Any]) -> pa.Table:
    uri = storage.join(folder, part["name"])
    try:
        data = storage.read_bytes(uri)
    except storage.StorageNotFound:
        raise ShardError(f"{uri}: listed in {MANIFEST_NAME} but missing") from None
    if hashlib.sha256(data).hexdigest() != part["sha256"]:
        raise ShardError(f"{uri}: content differs from the committed part (checksum mismatch)")
    # one part in memory: no reader threads (Arrow's parquet threads can abort the interpreter at exit,
    # apache/arrow#34314)
    table = pq.read_table(io.BytesIO(data), use_threads=False)
    if table.num_rows != part["rows"]:
        raise ShardError(f"{uri}: {table.num_rows} rows, manifest says {part['rows']}")
    return table


def read_shards(folder: str, *, kind: str | None = None, schema_version: int | None = None,
                rank: int = 0, world_size: int = 1) -> pa.Table:
    """Every committed row of ``folder`` (or, with ``world_size`` > 1, the parts striped to ``rank``)."""
    manifest = _committed(folder, kind, schema_version)
    tables = [_read_part(folder, p) for i, p in enumerate(manifest["parts"]) if i % world_size == rank]
    if not tables:  # more ranks than parts: an empty table with the committed schema
        return _read_part(folder, manifest["parts"][0]).slice(0, 0)
    return pa.concat_tables(tables)


def iter_parts(folder: str, *, kind: str | None = None, schema_version: int | None = None) -> Iterator[pa.Table]:
    """The committed parts one at a time (bounded memory for large outputs)."""
    manifest = _committed(folder, kind, schema_version)
    for p in manifest["parts"]:
        yield _read_part(folder, p)
