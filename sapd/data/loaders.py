"""Loading recorded trajectories (docs/FORMATS.md), whatever their format, as :class:`~sapd.data.schema.Trajectory`:
the registry of formats (:data:`~sapd.data.loaders.FORMATS`, one module each under :mod:`sapd.data.formats`), format
detection for ``--format auto``, the one loading loop, and the writers of the native format.

- ``native``: JSONL (one trajectory dict per line) or Parquet of the normalised record;
- ``eto``, ``agentgym``, ``fireact``: conversations with "Thought: …\\nAction: …" responses
  (:mod:`sapd.data.formats.conversation`);
- ``skillrl``: per-step ``{"instruction", "output"}`` records with fully rendered prompts, regrouped into
  trajectories by task string and step number parsed from the prompt;
- ``searchr1``: Search-R1 rows (question, golden answers, data_source) with the recorded multi-turn
  search output;
- ``auto``: each file's format told from its first record (the choice and why is in ``LoadResult``).

Every problem raises :class:`~sapd.data.errors.InvalidRecordError` naming file, line/record (and id), field and what
to do. With ``skip_invalid`` the record is skipped and counted in an :class:`~sapd.data.errors.InvalidReport`
instead; nothing is dropped silently: the valid records plus the invalid ones always equal the records read. Every
recorded turn must fit the chosen benchmark (:mod:`sapd.data.fit`), so data recorded for another benchmark is
refused, not cut into prefixes.
"""

from __future__ import annotations

import io
import json
from itertools import chain
from typing import Any, Callable, Iterator

from sapd import storage
from sapd.config import ConfigError
from sapd.data.errors import InvalidRecordError
from sapd.data.formats import conversation, native, searchr1, skillrl
from sapd.data.formats.base import (
    Collector,
    LoadOptions,
    LoadResult,
    TrajectoryFormat,
    keys_summary,
    one_per_record,
    record_location,
)
from sapd.data.formats.records import files_below, read_records
from sapd.data.schema import Trajectory
from sapd.method.benchmarks import get_benchmark

# the registry: every format sapd reads, in the order --format auto tries them (docs/FORMATS.md): the most
# specific layouts first (an AgentGym record would pass for ETO's)
REGISTRY: dict[str, TrajectoryFormat] = {f.name: f for f in (
    skillrl.FORMAT, native.FORMAT, conversation.AGENTGYM, conversation.ETO, conversation.FIREACT, searchr1.FORMAT)}
AUTO = "auto"  # each file's format told from its first record
FORMATS: tuple[str, ...] = (*REGISTRY, AUTO)  #: what --format and data.format accept

__all__ = ["AUTO", "FORMATS", "REGISTRY", "LoadOptions", "LoadResult", "detect_format", "input_files",
           "load_trajectories", "write_native_jsonl", "write_native_parquet"]


def check_format(fmt: str) -> None:
    """A :class:`~sapd.config.ConfigError` (about ``data.format``) naming the formats when ``fmt`` is none
    of them. The registry is the one list, so the run config does not spell it: ``sapd check`` and every
    stage that reads data check it here."""
    if fmt not in FORMATS:
        raise ConfigError(f"data.format: unknown format {fmt!r}; expected one of {', '.join(FORMATS)} "
                          "(docs/FORMATS.md)", "data.format")


def input_files(input_uri: str, fmt: str) -> list[str]:
    """A file, or every file of the format's extensions below a folder (local or ``s3://``), sorted."""
    check_format(fmt)
    exts = tuple(sorted({e for f in REGISTRY.values() for e in f.extensions})) if fmt == AUTO \
        else REGISTRY[fmt].extensions
    return files_below(input_uri, exts)


def detect_format(rec: Any) -> tuple[str, str] | None:
    """(format, why) from one record, or None when it is none of the layouts sapd reads.

    >>> detect_format({"id": "a", "conversations": []})
    ('eto', "records have 'id' and 'conversations'")
    >>> detect_format({"messages": []})
    ('fireact', "records have 'messages' and no 'id'")
    """
    if not isinstance(rec, dict):
        return None
    for fmt in REGISTRY.values():
        if (why := fmt.detect(rec)) is not None:
            return fmt.name, why
    return None


def _unknown_format(rec: Any, path: str, loc: str, opts: LoadOptions) -> Trajectory:
    """A file whose every record is unreadable has no format; its records are reported, never parsed."""
    raise InvalidRecordError(path, record_location(loc, rec), "", "unknown_format", "no readable record to tell "
                             "the format by")


_UNKNOWN = TrajectoryFormat("unknown", (), lambda rec: None, one_per_record(_unknown_format))


def _detect(path: str, records: Iterator[tuple[str, Any]]) -> tuple[str, str, Iterator[tuple[str, Any]]]:
    """The format of a file from its first readable record, and the records (that one included)."""
    seen: list[tuple[str, Any]] = []
    for loc, rec in records:
        seen.append((loc, rec))
        if isinstance(rec, InvalidRecordError):
            continue
        found = detect_format(rec)
        if found is None:
            what = (f"a bare list of {len(rec)} messages, not an object (an ICL example file? wrap each conversation "
                    "as {\"id\": …, \"conversations\": [...]})" if isinstance(rec, list)
                    else f"an object with {keys_summary(rec)}" if isinstance(rec, dict) else f"a {type(rec).__name__}")
            raise InvalidRecordError(path, record_location(loc, rec), "", "unknown_format",
                                     f"cannot tell the format: the first record is {what}, none of the layouts sapd "
                                     f"reads (docs/FORMATS.md); if it is one of them, say which with --format "
                                     f"({', '.join(REGISTRY)})")
        return found[0], found[1], chain(seen, records)
    return _UNKNOWN.name, "no readable record", iter(seen)


def load_trajectories(input_uri: str, fmt: str, opts: LoadOptions,
                      progress: Callable[[int], None] | None = None, limit: int | None = None) -> LoadResult:
    """Read every trajectory of ``input_uri`` (a file or a folder, local or ``s3://``) in format ``fmt``;
    with ``limit``, only the first ``limit`` records (a sample: ``sapd check``). ``progress(n)`` after n
    records."""
    check_format(fmt)
    get_benchmark(opts.benchmark)  # an unknown benchmark fails here, before any file is read
    result = LoadResult(trajectories=[], files=input_files(input_uri, fmt))
    out = Collector(result, opts, limit, progress)
    for path in result.files:
        if out.full():
            break
        records = read_records(path)
        file_fmt = fmt
        if fmt == AUTO:
            file_fmt, why, records = _detect(path, records)
            result.detected[path] = why
        result.formats[path] = file_fmt
        REGISTRY.get(file_fmt, _UNKNOWN).read(records, path, opts, out)
    # the report's promise (a bug if broken); a sample may end inside a SkillRL trajectory
    if limit is None and result.valid_records + result.report.total != result.records_read:
        raise RuntimeError(f"record count mismatch: {result.valid_records} valid + {result.report.total} invalid "
                           f"!= {result.records_read} read")
    return result


# ---------------------------------------------------------------------------------------------------
# writing the native format


def write_native_jsonl(trajectories: list[Trajectory], uri: str) -> None:
    lines = [json.dumps(t.to_dict(), ensure_ascii=False, sort_keys=True) for t in trajectories]
    storage.write_bytes(uri, ("\n".join(lines) + "\n").encode("utf-8"))


def write_native_parquet(trajectories: list[Trajectory], uri: str) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq
    rows = []
    for t in trajectories:
        d = t.to_dict()
        d["metadata"] = json.dumps(d["metadata"], ensure_ascii=False, sort_keys=True)
        rows.append(d)
    buf = io.BytesIO()
    pq.write_table(pa.Table.from_pylist(rows), buf)
    storage.write_bytes(uri, buf.getvalue())
