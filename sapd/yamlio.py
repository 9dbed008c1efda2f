"""The one YAML reader of the project: every file sapd reads (run configs and variants, study and
sequence files, a run root's config.yaml, the chart's rendered configs and the driver's templates) goes
through :func:`~sapd.yamlio.load`, whose numbers follow YAML 1.2 (the core schema) rather than PyYAML's YAML 1.1:

- ``1e-6``, ``5E-7``, ``.5``, ``5.``, ``+1.5e3`` are floats (YAML 1.1 wants a dot *and* a signed
  exponent, and reads ``1e-6`` as a string);
- ``017`` is the decimal 17, ``0o17`` octal, ``0x1F`` hex; ``1_000`` and ``1:30`` are strings (YAML 1.1
  reads them as 1000 and 90);
- ``.inf``, ``-.inf``, ``.nan`` as before.

Booleans and null are left as PyYAML resolves them. Every mapping it returns is a :class:`Mapping` (a
``dict``) that remembers the line of each key, so a config error can name ``file:line``
(:func:`line_of`).
"""

from __future__ import annotations

import re
from typing import Any

import yaml

INT_TAG = "tag:yaml.org,2002:int"
FLOAT_TAG = "tag:yaml.org,2002:float"

# YAML 1.2 core schema (https://yaml.org/spec/1.2.2/#1032-tag-resolution)
INT_RE = re.compile(r"^(?:[-+]?[0-9]+|0o[0-7]+|0x[0-9a-fA-F]+)$")
FLOAT_RE = re.compile(r"^(?:[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?"
                      r"|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$")


class Mapping(dict):
    """A YAML mapping; ``lines[key]`` is the 1-based line its key is on."""

    lines: dict[Any, int]


class Loader(yaml.SafeLoader):
    """PyYAML's safe loader with YAML 1.2 core-schema numbers."""


# a fresh resolver table without YAML 1.1's int/float rules (the class attribute is shared with SafeLoader)
Loader.yaml_implicit_resolvers = {
    first: [(tag, rx) for tag, rx in resolvers if tag not in (INT_TAG, FLOAT_TAG)]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()}
Loader.add_implicit_resolver(INT_TAG, INT_RE, list("-+0123456789"))
Loader.add_implicit_resolver(FLOAT_TAG, FLOAT_RE, list("-+.0123456789"))


def _int(loader: Loader, node: yaml.ScalarNode) -> int:
    text = str(loader.construct_scalar(node))
    if text.startswith("0o"):
        return int(text[2:], 8)
    if text.startswith("0x"):
        return int(text[2:], 16)
    return int(text, 10)


def _float(loader: Loader, node: yaml.ScalarNode) -> float:
    text = str(loader.construct_scalar(node))
    low = text.lower()
    if low.endswith(".inf"):
        return float("-inf") if low.startswith("-") else float("inf")
    if low == ".nan":
        return float("nan")
    return float(text)


def _mapping(loader: Loader, node: yaml.MappingNode) -> Mapping:
    loader.flatten_mapping(node)
    out = Mapping()
    out.lines = {}
    for key_node, value_node in node.value:
        key = loader.construct_object(key_node, deep=True)
        try:
            hash(key)
        except TypeError:
            raise yaml.constructor.ConstructorError("while constructing a mapping", node.start_mark,
                                                    "found an unhashable key", key_node.start_mark) from None
        out[key] = loader.construct_object(value_node, deep=True)
        out.lines[key] = key_node.start_mark.line + 1
    return out


Loader.add_constructor(INT_TAG, _int)
Loader.add_constructor(FLOAT_TAG, _float)
Loader.add_constructor("tag:yaml.org,2002:map", _mapping)


def load(text: str) -> Any:
    """One YAML document, YAML 1.2 numbers; mappings are :class:`Mapping`."""
    return yaml.load(text, Loader=Loader)  # noqa: S506 - Loader is a SafeLoader


def load_all(text: str) -> list[Any]:
    return list(yaml.load_all(text, Loader=Loader))  # noqa: S506 - Loader is a SafeLoader


class Dumper(yaml.SafeDumper):
    """PyYAML's safe dumper, quoting every string :class:`Loader` would read as something else (``"1e-6"``)."""


Dumper.yaml_implicit_resolvers = Loader.yaml_implicit_resolvers


def dump(data: Any) -> str:
    """Block-style YAML that :func:`load` (and YAML 1.1 readers) read back to the same values."""
    return yaml.dump(data, Dumper=Dumper, sort_keys=False, allow_unicode=False)


def line_of(data: Any, path: str) -> int | None:
    """The line of the deepest key of dotted ``path`` (``train.lr``, ``train.betas[0]``) that ``data`` (as
    :func:`load` returned it) records; None when even the first key is not there."""
    line = None
    node = data
    for part in re.sub(r"\[\d+\]", "", path).split("."):
        if not isinstance(node, Mapping) or part not in node:
            break
        line = node.lines.get(part, line)
        node = node[part]
    return line
