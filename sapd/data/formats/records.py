"""Reading a trajectory file into ``(location, record)`` pairs: JSON (a list or one object), JSONL (one
record per line) or Parquet (one record per row), local or ``s3://``. The location names the line, record
or row, for error messages; a file that cannot hold records (a Git LFS pointer, raw text) and a file cut
short mid-record are said to be so in one :class:`~sapd.data.errors.InvalidRecordError`.
"""

from __future__ import annotations

import io
import json
import re
from typing import Any, Iterator

from sapd import storage
from sapd.data.errors import InvalidRecordError


def _cut_short(text: str) -> bool:
    """True when JSON text ends inside a string or with brackets still open: a truncated file (an
    interrupted download or copy), not a syntax slip."""
    depth, in_string, escaped = 0, False, False
    for ch in text:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            depth += 1
        elif ch in "]}":
            depth -= 1
    return in_string or depth > 0


def _json_lines(path: str, text: str) -> Iterator[tuple[str, Any]]:
    """(location, parsed object) per non-blank line; a malformed line yields its InvalidRecordError
    in place of the object, so that the caller may count it and read on."""
    lines = text.splitlines()
    last = max((n for n, line in enumerate(lines, start=1) if line.strip()), default=0)
    for n, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            yield f"line {n}", json.loads(line)
        except json.JSONDecodeError as e:
            hint = (" (the last line ends mid-record: the file looks cut short)" if n == last and _cut_short(line)
                    else "")
            yield f"line {n}", InvalidRecordError(path, f"line {n}", "", "malformed_json",
                                                  f"malformed JSON at column {e.colno}: {e.msg}{hint}")


def _json_records(path: str, text: str) -> Iterator[tuple[str, Any]]:
    """Records of a .json file holding a list (or one object), or of a .jsonl file."""
    if path.endswith(".jsonl"):
        yield from _json_lines(path, text)
        return
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        if _cut_short(text):
            raise InvalidRecordError(path, f"line {e.lineno} column {e.colno}", "", "malformed_json",
                                     f"the JSON ends mid-record after {len(text.encode())} bytes: the file looks "
                                     "cut short (an interrupted download or copy?); fetch it again") from None
        raise InvalidRecordError(path, f"line {e.lineno} column {e.colno}", "", "malformed_json",
                                 f"malformed JSON: {e.msg} (the whole file is unreadable)") from None
    if isinstance(data, dict):
        data = [data]
    if not isinstance(data, list):
        raise InvalidRecordError(path, "top level", "", "bad_type",
                                 f"expected a JSON list of records, found {type(data).__name__}")
    for n, rec in enumerate(data):
        yield f"record {n}", rec


def _parquet_records(path: str, data: bytes) -> Iterator[tuple[str, Any]]:
    import pyarrow.parquet as pq
    try:
        table = pq.read_table(io.BytesIO(data), use_threads=False)  # see sapd.data.shards._read_part
    except Exception as e:  # pyarrow raises several types for a damaged file
        raise InvalidRecordError(path, "file", "", "malformed_parquet", f"cannot read Parquet: {e}") from None
    for n, rec in enumerate(table.to_pylist()):
        yield f"row {n}", rec


_LFS_HEADER = b"version https://git-lfs.github.com/spec/"


def _whole_file_problem(path: str, data: bytes) -> InvalidRecordError | None:
    """A file that cannot hold records: a Git LFS pointer, or text that is not JSON. (An empty file holds
    none, which is no error: a build whose whole input is empty stops with "no valid trajectories".)"""
    if data.startswith(_LFS_HEADER):
        size = re.search(rb"^size (\d+)", data, re.M)
        what = f" for a {int(size.group(1)):,}-byte file" if size else ""
        return InvalidRecordError(path, "file", "", "lfs_pointer",
                                  f"this is a Git LFS pointer{what}, not the data: run `git lfs install && git lfs "
                                  "pull` in the repository you cloned it from (or download the file itself)")
    head = data.lstrip(b"\xef\xbb\xbf \t\r\n")[:80]
    if head and head[:1] not in (b"[", b"{"):
        return InvalidRecordError(path, "file", "", "not_json",
                                  f"not JSON, JSONL or Parquet: it starts with {head.decode('utf-8', 'replace')[:40]!r}"
                                  " (raw chat or log text?); convert it to one of the formats in docs/FORMATS.md")
    return None


def read_records(path: str) -> Iterator[tuple[str, Any]]:
    """(location, record) of every record of a JSON / JSONL / Parquet file, the location naming the line
    or record for error messages."""
    data = storage.read_bytes(path)
    if path.endswith(".parquet") and data[:4] == b"PAR1":
        yield from _parquet_records(path, data)
        return
    if (problem := _whole_file_problem(path, data)) is not None:
        raise problem
    if not data.strip(b"\xef\xbb\xbf \t\r\n"):
        return
    if path.endswith(".parquet"):
        yield from _parquet_records(path, data)
        return
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise InvalidRecordError(path, f"byte {e.start}", "", "bad_encoding", "file is not UTF-8") from None
    yield from _json_records(path, text)


def files_below(input_uri: str, extensions: tuple[str, ...]) -> list[str]:
    """A file, or every file ending in one of ``extensions`` below a folder (local or ``s3://``), sorted."""
    if storage.exists(input_uri):
        return [input_uri]
    found = [u for u in storage.list_files(input_uri) if u.endswith(extensions)]
    if not found:
        raise FileNotFoundError(f"{input_uri}: no such file, and no {'/'.join(extensions)} files below it")
    return found
