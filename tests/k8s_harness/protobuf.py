"""Kubernetes' protobuf request bodies, decoded to the JSON objects the API server would store.

kubectl's typed commands (``create job``, ``create job --from=cronjob/…``) send their object as
``application/vnd.kubernetes.protobuf``: the 4 magic bytes ``k8s\\x00``, then a ``runtime.Unknown``
message — ``typeMeta`` (apiVersion, kind), ``raw`` (the object's own message, e.g.
``k8s.io.api.batch.v1.Job``), ``contentEncoding``, ``contentType``.

The schema is the client's own: every Go program built with k8s.io/api registers its gzipped
``FileDescriptorProto``s (the ``generated.proto`` files, with the gogoproto options go-to-protobuf
writes), so they are read out of the kubectl binary that sent the request (:func:`schema`) — no
vendored ``.proto`` file, and the field numbers are exactly those kubectl encoded with. Both the
descriptors and the messages are read by the small wire-format reader below (varint, 64-bit, length-
delimited, 32-bit fields; packed or not).

From a message to the object's JSON, as the Go types marshal it:

* field names are the proto names (k8s.io/api names them after their JSON keys);
* a Go value field (gogoproto ``nullable=false``) is always encoded, its zero value included: a zero
  scalar (``""``, 0, false) is left out (the Go struct holds the same zero either way); a pointer
  field (no such option) is kept whatever its value (``backoffLimit: 0``, ``suspend: false``);
* an embedded Go struct with ``json:",inline"`` (``Volume.volumeSource``, ``Probe.handler``,
  ``ConfigMapKeySelector.localObjectReference``, …) has its fields inlined into its parent. The
  descriptors cannot tell it from a named field of the same type (``AdmissionRequest.userInfo``): a
  Go value field named after its type is inlined when the parent's definition in the Kubernetes
  OpenAPI schema of the same release (kubernetes-validate's ``_definitions.json``) has no property of
  that name;
* the apimachinery types with their own JSON form: Quantity (its string), Time (RFC 3339, seconds),
  MicroTime (microseconds; the zero time, an empty message, is left out), Duration (Go's form, ``1h0m0s``), IntOrString, RawExtension and FieldsV1
  (their JSON bytes); ``bytes`` as base64; maps as objects.

A field number the schema does not know, a wire type that does not match it, or a body that is not
this envelope raises :class:`ProtobufError` (the API server answers 400): nothing is dropped.
"""

from __future__ import annotations

import base64
import datetime as dt
import json
import os
import re
import struct
import zlib
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

MAGIC = b"k8s\x00"
MEDIA_TYPE = "application/vnd.kubernetes.protobuf"
# gogoproto's field options (github.com/gogo/protobuf/gogoproto/gogo.proto)
_NULLABLE, _CUSTOMNAME = 65001, 65004
# FieldDescriptorProto.Type values used below
_DOUBLE, _FLOAT, _INT64, _UINT64, _INT32, _FIXED64, _FIXED32, _BOOL, _STRING = 1, 2, 3, 4, 5, 6, 7, 8, 9
_MESSAGE, _BYTES, _UINT32, _ENUM, _SFIXED32, _SFIXED64, _SINT32, _SINT64 = 11, 12, 13, 14, 15, 16, 17, 18
_LENGTH_DELIMITED_TYPES = {_STRING, _MESSAGE, _BYTES}
_META = ".k8s.io.apimachinery.pkg.apis.meta.v1."


class ProtobufError(ValueError):
    """The body cannot be decoded with the client's schema."""


# ------------------------------------------------------------------------------------------ wire format


def _varint(buf: bytes, i: int) -> tuple[int, int]:
    shift = result = 0
    while True:
        if i >= len(buf):
            raise ProtobufError("truncated varint")
        b = buf[i]
        i += 1
        result |= (b & 0x7F) << shift
        if not b & 0x80:
            return result, i
        shift += 7
        if shift > 70:
            raise ProtobufError("varint longer than 10 bytes")


def fields(buf: bytes) -> list[tuple[int, int, Any]]:
    """A message's fields in order: (number, wire type, value) — an int for varint/fixed fields, the
    bytes of a length-delimited one."""
    out, i = [], 0
    while i < len(buf):
        key, i = _varint(buf, i)
        num, wt = key >> 3, key & 7
        if wt == 0:
            v, i = _varint(buf, i)
        elif wt == 1:
            v, i = int.from_bytes(buf[i:i + 8], "little"), i + 8
        elif wt == 2:
            n, i = _varint(buf, i)
            v, i = buf[i:i + n], i + n
            if len(v) != n:
                raise ProtobufError(f"field {num}: truncated (wanted {n} bytes)")
        elif wt == 5:
            v, i = int.from_bytes(buf[i:i + 4], "little"), i + 4
        else:
            raise ProtobufError(f"field {num}: unsupported wire type {wt}")
        out.append((num, wt, v))
    if i != len(buf):
        raise ProtobufError("truncated message")
    return out


def _signed(v: int, bits: int) -> int:
    return v - (1 << bits) if v >= 1 << (bits - 1) else v


# ------------------------------------------------------------------------------------------ the schema


@dataclass
class Field:
    name: str
    number: int
    repeated: bool
    type: int
    type_name: str = ""
    nullable: bool = True  # a Go pointer (or slice/map); False: a Go value field
    customname: str = ""


@dataclass
class Message:
    full_name: str  # ".k8s.io.api.batch.v1.Job"
    fields: dict[int, Field] = field(default_factory=dict)
    map_entry: bool = False


def _parse_field(buf: bytes) -> Field:
    f = Field("", 0, False, 0)
    for num, _wt, v in fields(buf):
        if num == 1:
            f.name = v.decode()
        elif num == 3:
            f.number = v
        elif num == 4:
            f.repeated = v == 3  # LABEL_REPEATED
        elif num == 5:
            f.type = v
        elif num == 6:
            f.type_name = v.decode()
        elif num == 8:  # FieldOptions
            for onum, _owt, ov in fields(v):
                if onum == _NULLABLE:
                    f.nullable = bool(ov)
                elif onum == _CUSTOMNAME:
                    f.customname = ov.decode()
    return f


def _parse_message(buf: bytes, scope: str, out: dict[str, Message]) -> None:
    parts = fields(buf)
    name = next(v.decode() for n, _, v in parts if n == 1)
    msg = Message(f"{scope}.{name}")
    for num, _wt, v in parts:
        if num == 2:
            f = _parse_field(v)
            msg.fields[f.number] = f
        elif num == 3:
            _parse_message(v, msg.full_name, out)
        elif num == 7:  # MessageOptions
            msg.map_entry = any(onum == 7 and ov for onum, _, ov in fields(v))
    out[msg.full_name] = msg


def parse_file_descriptor(buf: bytes, out: dict[str, Message]) -> str:
    """Add the messages of one serialized FileDescriptorProto to ``out``; its file name."""
    parts = fields(buf)
    name = next(v.decode() for n, _, v in parts if n == 1)
    package = next((v.decode() for n, _, v in parts if n == 2), "")
    for num, _wt, v in parts:
        if num == 4:
            _parse_message(v, f".{package}" if package else "", out)
    return name


_GZIP = b"\x1f\x8b\x08\x00\x00\x00\x00\x00"


@lru_cache(maxsize=4)
def _schema_of(path: str, _mtime: float) -> dict[str, Message]:
    data = Path(path).read_bytes()
    out: dict[str, Message] = {}
    i = data.find(_GZIP)
    while i >= 0:
        try:
            blob = zlib.decompressobj(16 + zlib.MAX_WBITS).decompress(data[i:i + (4 << 20)])
        except zlib.error:
            blob = b""
        # a FileDescriptorProto starts with its name (field 1): "k8s.io/…/generated.proto"
        if blob[:1] == b"\n" and blob[2:2 + blob[1]].endswith(b".proto") and blob[2:2 + blob[1]].startswith(b"k8s.io/"):
            try:
                parse_file_descriptor(blob, out)
            except (ProtobufError, StopIteration, UnicodeDecodeError):
                pass
        i = data.find(_GZIP, i + 1)
    return out


def schema(client_binary: str | os.PathLike | None = None) -> dict[str, Message]:
    """The Kubernetes message types registered in ``client_binary`` (default: $KUBECTL, else
    /usr/bin/kubectl), by full name; empty if it has none (or is not there)."""
    path = str(client_binary or os.environ.get("KUBECTL", "/usr/bin/kubectl"))
    try:
        mtime = os.stat(path).st_mtime
    except OSError:
        return {}
    return _schema_of(path, mtime)


def message_for(types: dict[str, Message], api_version: str, kind: str) -> Message:
    """The message of ``apiVersion``/``kind``: core v1 is k8s.io.api.core.v1; a group's package is named
    after the group's first label (batch → k8s.io.api.batch.v1, rbac.authorization.k8s.io → …rbac.v1)."""
    group, _, version = api_version.rpartition("/")
    pkg = f".k8s.io.api.{group.split('.')[0] if group else 'core'}.{version}"
    msg = types.get(f"{pkg}.{kind}")
    if msg is None:
        raise ProtobufError(f"no protobuf schema for {api_version} {kind} in the client's descriptors")
    return msg


# ------------------------------------------------------------------------------------------ to JSON


def _go_duration(ns: int) -> str:
    """Go's time.Duration.String() for whole units as the API writes them (1h0m0s, 1m30s, 500ms)."""
    if ns == 0:
        return "0s"
    sign, ns = ("-", -ns) if ns < 0 else ("", ns)
    if ns < 1_000_000_000:
        for unit, size in (("ms", 1_000_000), ("µs", 1_000), ("ns", 1)):
            if ns >= size:
                return f"{sign}{ns / size:g}{unit}"
    h, rest = divmod(ns, 3600 * 10**9)
    m, rest = divmod(rest, 60 * 10**9)
    s = f"{rest / 1e9:.9f}".rstrip("0").rstrip(".")
    return sign + (f"{h}h{m}m{s}s" if h else f"{m}m{s}s" if m else f"{s}s")


def _special(name: str, raw: dict[str, Any]) -> tuple[bool, Any]:
    """The JSON form of an apimachinery type that marshals itself; (False, None) for any other type."""
    if name == ".k8s.io.apimachinery.pkg.api.resource.Quantity":
        return True, raw.get("string", "")
    if name in (_META + "Time", _META + "MicroTime"):
        if not raw:  # the zero time marshals to nothing, and unmarshals to null
            return True, None
        t = dt.datetime.fromtimestamp(raw.get("seconds", 0), dt.timezone.utc)
        if name.endswith("MicroTime"):
            return True, t.strftime("%Y-%m-%dT%H:%M:%S") + f".{raw.get('nanos', 0) // 1000:06d}Z"
        return True, t.strftime("%Y-%m-%dT%H:%M:%SZ")
    if name == _META + "Duration":
        return True, _go_duration(raw.get("duration", 0))
    if name == ".k8s.io.apimachinery.pkg.util.intstr.IntOrString":
        return True, raw.get("strVal", "") if raw.get("type", 0) == 1 else raw.get("intVal", 0)
    if name in (".k8s.io.apimachinery.pkg.runtime.RawExtension", _META + "FieldsV1"):
        data = base64.b64decode(raw.get("raw") or raw.get("Raw") or "")
        return True, json.loads(data) if data else None
    return False, None


def _scalar(f: Field, wt: int, v: Any) -> Any:
    t = f.type
    if t == _STRING:
        return v.decode()
    if t == _BYTES:
        return base64.b64encode(v).decode()
    if t == _BOOL:
        return bool(v)
    if t in (_INT64, _INT32, _ENUM):
        return _signed(v, 64)
    if t in (_UINT64, _UINT32, _FIXED64, _FIXED32):
        return v
    if t == _SFIXED64:
        return _signed(v, 64)
    if t == _SFIXED32:
        return _signed(v, 32)
    if t in (_SINT32, _SINT64):
        return (v >> 1) ^ -(v & 1)
    if t == _DOUBLE:
        return struct.unpack("<d", v.to_bytes(8, "little"))[0]
    if t == _FLOAT:
        return struct.unpack("<f", v.to_bytes(4, "little"))[0]
    raise ProtobufError(f"field {f.name}: unsupported type {t}")


def _packed(f: Field, buf: bytes) -> list[Any]:
    out, i = [], 0
    while i < len(buf):
        if f.type in (_DOUBLE, _FIXED64, _SFIXED64):
            out.append(_scalar(f, 1, int.from_bytes(buf[i:i + 8], "little")))
            i += 8
        elif f.type in (_FLOAT, _FIXED32, _SFIXED32):
            out.append(_scalar(f, 5, int.from_bytes(buf[i:i + 4], "little")))
            i += 4
        else:
            v, i = _varint(buf, i)
            out.append(_scalar(f, 0, v))
    return out


def _zero(v: Any) -> bool:
    return v == "" or v is False or (isinstance(v, (int, float)) and not isinstance(v, bool) and v == 0)


@lru_cache(maxsize=4)
def openapi_properties(kube_version: str) -> dict[str, frozenset[str]]:
    """Definition name (``io.k8s.api.core.v1.Volume``) → its JSON property names, from the OpenAPI
    schema of ``kube_version`` (the newest kubernetes-validate holds that is not newer)."""
    from kubernetes_validate import utils
    want = utils.major_minor(kube_version.lstrip("v"))
    version = [v for v in utils.all_versions() if utils.major_minor(v) <= want][-1]
    defs = utils.schema_contents(f"kubernetes-json-schema/v{version}-local/_definitions.json", kube_version)
    return {name: frozenset((d.get("properties") or {})) for name, d in defs["$defs"].items()}


def _inlined(msg: Message, f: Field, properties: dict[str, frozenset[str]]) -> bool:
    """Is ``f`` a Go struct embedded with ``json:",inline"`` (see the module docstring)?"""
    if f.nullable or f.repeated or f.customname != f.type_name.rsplit(".", 1)[-1]:
        return False
    known = properties.get(msg.full_name.replace(".k8s.io.", "io.k8s.", 1))
    if known is None:
        raise ProtobufError(f"{msg.full_name[1:]}.{f.name}: an embedded struct, and the OpenAPI schema has no "
                            f"definition of {msg.full_name[1:]} to tell whether it is inlined")
    return f.name not in known


def to_json(types: dict[str, Message], msg: Message, buf: bytes,
            properties: dict[str, frozenset[str]] | None = None) -> Any:
    """One message as its Go type marshals to JSON (the rules in the module docstring)."""
    raw: dict[str, Any] = {}
    inline: list[dict] = []
    for num, wt, v in fields(buf):
        f = msg.fields.get(num)
        if f is None:
            raise ProtobufError(f"{msg.full_name[1:]}: field number {num} is not in the client's schema")
        expected = 2 if f.type in _LENGTH_DELIMITED_TYPES else {_DOUBLE: 1, _FIXED64: 1, _SFIXED64: 1, _FLOAT: 5,
                                                                  _FIXED32: 5, _SFIXED32: 5}.get(f.type, 0)
        if f.type == _MESSAGE:
            if wt != 2:
                raise ProtobufError(f"{msg.full_name[1:]}.{f.name}: wire type {wt}, expected 2")
            sub = types.get(f.type_name)
            if sub is None:
                raise ProtobufError(f"{msg.full_name[1:]}.{f.name}: type {f.type_name} is not in the client's schema")
            if sub.map_entry:
                entry = to_json(types, sub, v, properties)
                raw.setdefault(f.name, {})[entry.get("key", "")] = entry.get("value", _empty_value(types, sub))
                continue
            value = to_json(types, sub, v, properties)
            if _inlined(msg, f, properties or {}):
                inline.append(value)
                continue
            if value is None and not f.repeated:  # a zero Time, an empty RawExtension
                continue
        elif f.repeated and wt == 2 and f.type not in _LENGTH_DELIMITED_TYPES:
            raw.setdefault(f.name, []).extend(_packed(f, v))
            continue
        else:
            if wt != expected:
                raise ProtobufError(f"{msg.full_name[1:]}.{f.name}: wire type {wt}, expected {expected}")
            value = _scalar(f, wt, v)
            if not f.repeated and not f.nullable and _zero(value):
                continue
        if f.repeated:
            raw.setdefault(f.name, []).append(value)
        else:
            raw[f.name] = value
    for part in inline:
        raw.update(part)
    if msg.map_entry:
        return raw
    special, value = _special(msg.full_name, raw)
    return value if special else raw


def _empty_value(types: dict[str, Message], entry: Message) -> Any:
    """A map entry without a value field: the value type's zero (an empty string, a zero Quantity…)."""
    f = next((f for f in entry.fields.values() if f.name == "value"), None)
    if f is None or f.type != _MESSAGE:
        return "" if f is not None and f.type == _STRING else 0
    return to_json(types, types[f.type_name], b"", {})


def decode_object(body: bytes, kube_version: str, client_binary: str | os.PathLike | None = None) -> dict:
    """A ``k8s\\x00`` + runtime.Unknown request body as the object's JSON (apiVersion and kind first);
    ``kube_version``: the API server's, whose OpenAPI schema tells inlined fields."""
    if not body.startswith(MAGIC):
        raise ProtobufError("not a Kubernetes protobuf body: it does not start with the 'k8s\\x00' magic")
    types = schema(client_binary)
    if not types:
        raise ProtobufError(f"no Kubernetes protobuf descriptors found in {client_binary or 'the kubectl binary'}")
    type_meta: dict[str, str] = {}
    raw, encoding = b"", ""
    for num, _wt, v in fields(body[len(MAGIC):]):
        if num == 1:
            type_meta = {("apiVersion", "kind")[n - 1]: tv.decode() for n, _, tv in fields(v) if n in (1, 2)}
        elif num == 2:
            raw = v
        elif num == 3:
            encoding = v.decode()
    if encoding:
        raise ProtobufError(f"runtime.Unknown contentEncoding {encoding!r} is not supported")
    if not re.fullmatch(r"([a-z0-9.-]+/)?v\w+", type_meta.get("apiVersion", "")) or not type_meta.get("kind"):
        raise ProtobufError(f"runtime.Unknown without a usable typeMeta: {type_meta}")
    obj = to_json(types, message_for(types, type_meta["apiVersion"], type_meta["kind"]), raw,
                  openapi_properties(kube_version))
    return {"apiVersion": type_meta["apiVersion"], "kind": type_meta["kind"], **obj}
