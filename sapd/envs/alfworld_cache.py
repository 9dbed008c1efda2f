"""ALFWorld's start-up paid once: TextWorld's grammar parses and Fast Downward's PDDL→SAS translations,
memoised in the process (and so in every environment process forked from it) and the translations kept on
disk across processes and runs.

Where an ALFWorld episode's start-up goes (textworld 1.7.0's ``PddlEnv``, measured on one game): loading a
game parses its grammar with TatSu (the ``alfred.twl2`` document, then every production rule's right-hand
side again), ``load`` and ``reset`` each build a ``PddlState`` that runs Fast Downward's translator **twice**
(``pddl2sas``, plain and optimised: 0.1–1 s each, so 4 translations of the same problem per episode), and
every step re-parses the command templates, feedback rules and conditions it derives text from. None of that
depends on anything but its input text, and most of it is shared by every game (the rules of
``alfred.twl2``) or repeated within one (the same problem at load and reset, the same templates every
step). :func:`set_engine_cache` wraps the four functions that do it:

- ``textworld.envs.pddl.textgen._parse_and_convert`` (grammar rules and templates),
  ``textworld.logic._parse_and_convert`` (conjunctive queries) and
  ``textworld.envs.pddl.logic._parse_and_convert`` (the grammar document): the TatSu parse tree is kept per
  (text, rule) and **converted afresh on every call**, so each caller still gets its own objects (TextWorld
  mutates the symbols it derives);
- ``fast_downward.pddl2sas``: the SAS text is kept per (domain, problem, optimised) in memory and, gzipped,
  under ``cache_dir/<versions>/`` (one file per translation, written atomically, so concurrent processes can
  share the folder); the parsed task it returns beside the SAS text is rebuilt on every call by the same
  parse and normalisation the translator starts with (the translation does not change it: checked). Its
  ``sys.argv`` side effect (Fast Downward parses its options from it) is undone.

The folder is keyed by the installed textworld, fast-downward-textworld and alfworld versions and this
module's format, so an upgrade never reads an old translation; an unreadable or corrupt file is translated
again and rewritten; an unwritable folder leaves the cache in memory only, said once on stderr. The default
folder is ``$SAPD_CACHE_DIR/alfworld-engine`` (``~/.cache/sapd/alfworld-engine``; the chart points
``SAPD_CACHE_DIR`` at its cache volume), about 30 KB per game.

:func:`warm_engine` parses what every game shares (the grammar's rules, templates and conditions) in the
calling process, so environment processes forked afterwards (``--env-timeout``, :mod:`sapd.envs.isolated`)
start with it instead of importing ALFWorld and parsing it each. ``tests/envs/test_alfworld_engine.py`` checks
that episodes played through the caches (cold, warm, in forked workers) equal the stock engine's;
``bench/alfworld_startup.py`` measures what they save.
"""

from __future__ import annotations

import contextlib
import gzip
import hashlib
import os
import sys
import tempfile
from collections import OrderedDict
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable, Iterator

CACHE_FORMAT = 1
ENGINE_PACKAGES = ("textworld", "fast-downward-textworld", "alfworld")
PARSE_CACHE_SIZE = 8192  # rule/template/query trees: alfred.twl2 has ~100 rules, each game adds ~4 goal rules
GRAMMAR_CACHE_SIZE = 64  # whole grammar documents (~0.4 MB each as a tree): the games one process replays
SAS_MEMORY_SIZE = 64  # SAS texts kept in memory (0.1–1.3 MB each): load and reset of one game, and more


def default_cache_dir() -> Path:
    """``$SAPD_CACHE_DIR/alfworld-engine`` (default ``~/.cache/sapd``: the root sapd's model cache uses)."""
    return Path(os.environ.get("SAPD_CACHE_DIR") or Path.home() / ".cache" / "sapd") / "alfworld-engine"


@lru_cache(maxsize=1)
def engine_versions() -> str:
    """The installed engine's versions as a folder name, e.g. ``textworld-1.7.0_fast-downward-textworld-20.6.4_…``."""
    from importlib.metadata import PackageNotFoundError, version
    parts = []
    for name in ENGINE_PACKAGES:
        try:
            parts.append(f"{name}-{version(name)}")
        except PackageNotFoundError:
            parts.append(f"{name}-none")
    return "_".join(parts) + f"_format-{CACHE_FORMAT}"


@dataclass
class CacheStats:
    """What the caches did in this process (a forked worker counts its own)."""

    translations: int = 0  # pddl2sas run for real
    memory_hits: int = 0  # SAS text found in memory
    disk_hits: int = 0  # SAS text read from the folder
    disk_errors: list[str] = field(default_factory=list)  # unreadable files (translated again), unwritable folder

    def parses(self) -> dict[str, dict[str, int]]:
        """Parse-tree hits and misses per wrapped parser."""
        return {name: {"hits": fn.cache_info().hits, "misses": fn.cache_info().misses}
                for name, fn in _TREES.items()}


@dataclass
class _State:
    enabled: bool = False
    cache_dir: Path | None = None  # None: memory only
    originals: dict[str, Callable[..., Any]] = field(default_factory=dict)
    sas: OrderedDict[str, str] = field(default_factory=OrderedDict)
    stats: CacheStats = field(default_factory=CacheStats)
    unwritable_said: bool = False
    unavailable: bool = False  # this textworld's internals are not 1.7's: played as shipped


_STATE = _State()


def stats() -> CacheStats:
    return _STATE.stats


# ---------------------------------------------------------------------------------------------------
# the parse trees (TatSu): kept per (text, rule), converted afresh per call


def _textgen_tree(text: str, rule_name: str) -> Any:
    from textworld.envs.pddl import textgen
    return textgen._PARSER.parse(text, rule_name=rule_name)


def _logic_tree(text: str, rule_name: str) -> Any:
    import textworld.logic
    return textworld.logic._PARSER.parse(text, rule_name=rule_name)


def _pddl_logic_tree(text: str, rule_name: str) -> Any:
    from textworld.envs.pddl import logic
    return logic._PARSER.parse(text, rule_name=rule_name)


_TREES = {name: lru_cache(maxsize=size)(fn) for name, fn, size in
          (("textgen", _textgen_tree, PARSE_CACHE_SIZE), ("logic", _logic_tree, PARSE_CACHE_SIZE),
           ("pddl_logic", _pddl_logic_tree, GRAMMAR_CACHE_SIZE))}


def _cached_parse(name: str, converter: Callable[[], Any], text: str, **kwargs: Any) -> Any:
    rule_name = kwargs.pop("rule_name", None)
    if kwargs.pop("trace", False) or kwargs or not isinstance(text, str) or rule_name is None:
        return _STATE.originals[name](text, rule_name=rule_name, **kwargs)  # anything unusual: TextWorld's own
    return converter().walk(_TREES[name](text, rule_name))


def _textgen_parse(text: str, **kwargs: Any) -> Any:
    from textworld.envs.pddl import textgen
    return _cached_parse("textgen", textgen._Converter, text, **kwargs)


def _logic_parse(text: str, **kwargs: Any) -> Any:
    import textworld.logic
    if kwargs.get("rule_name") != "conjunctiveQuery":  # the only one the PDDL engine repeats; the rest as is
        return _STATE.originals["logic"](text, **kwargs)
    return _cached_parse("logic", textworld.logic._ModelConverter, text, **kwargs)


def _pddl_logic_parse(text: str, **kwargs: Any) -> Any:
    from textworld.envs.pddl import logic
    return _cached_parse("pddl_logic", logic._ModelConverter, text, **kwargs)


# ---------------------------------------------------------------------------------------------------
# Fast Downward's translation


@contextlib.contextmanager
def _own_argv() -> Iterator[None]:
    """Fast Downward's translator parses ``sys.argv`` when its options module is first imported, and
    ``pddl2sas`` sets it to what that parser accepts: give it that, then put the process's own back."""
    saved = sys.argv
    sys.argv = ["translate.py", "domain", "task"]
    try:
        yield
    finally:
        sys.argv = saved


def _parsed_task(domain: str, problem: str) -> Any:
    """The task ``pddl2sas`` returns beside the SAS text: its own first steps (parse, normalise)."""
    with _own_argv():
        from fast_downward.translate import normalize
        from fast_downward.translate.pddl_parser import lisp_parser, parsing_functions
    task = parsing_functions.parse_task(lisp_parser.parse_nested_list(domain.split("\n")),
                                        lisp_parser.parse_nested_list(problem.split("\n")))
    normalize.normalize(task)
    return task


def translation_key(domain: str, problem: str, optimize: bool) -> str:
    h = hashlib.sha256()
    for part in (engine_versions(), "optimize" if optimize else "plain", domain, problem):
        h.update(part.encode("utf-8"))
        h.update(b"\0")
    return h.hexdigest()


def _sas_file(key: str) -> Path | None:
    d = _STATE.cache_dir
    return None if d is None else d / engine_versions() / key[:2] / f"{key}.sas.gz"


def _read_sas(key: str) -> str | None:
    path = _sas_file(key)
    if path is None or not path.is_file():
        return None
    try:
        with gzip.open(path, "rt", encoding="utf-8") as f:
            return f.read()
    except (OSError, EOFError, UnicodeDecodeError, ValueError) as e:
        _STATE.stats.disk_errors.append(f"{path}: {type(e).__name__}: {e}")
        return None  # translated again and rewritten


def _write_sas(key: str, sas: str) -> None:
    path = _sas_file(key)
    if path is None:
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".", suffix=".tmp", dir=path.parent)
        try:
            with os.fdopen(fd, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", mtime=0) as f:
                f.write(sas.encode("utf-8"))
            os.replace(tmp, path)  # atomic: a concurrent reader sees the whole file or none
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
    except OSError as e:
        _STATE.stats.disk_errors.append(f"{path.parent}: {type(e).__name__}: {e}")
        if not _STATE.unwritable_said:
            _STATE.unwritable_said = True
            print(f"ALFWorld engine cache: cannot write {_STATE.cache_dir} ({e.strerror or e}); translations are "
                  "kept in this process only", file=sys.stderr, flush=True)


def _pddl2sas(domain: str, problem: str, verbose: bool = False, optimize: bool = False) -> tuple[Any, str]:
    if verbose:  # TW_PDDL_DEBUG: the translator's own output is wanted
        with _own_argv():
            return _STATE.originals["pddl2sas"](domain, problem, verbose=verbose, optimize=optimize)
    key = translation_key(domain, problem, bool(optimize))
    sas = _STATE.sas.get(key)
    if sas is not None:
        _STATE.stats.memory_hits += 1
        _STATE.sas.move_to_end(key)
    else:
        sas = _read_sas(key)
        if sas is not None:
            _STATE.stats.disk_hits += 1
        else:
            with _own_argv():
                task, sas = _STATE.originals["pddl2sas"](domain, problem, verbose=False, optimize=optimize)
            _STATE.stats.translations += 1
            _write_sas(key, sas)
            _remember(key, sas)
            return task, sas
        _remember(key, sas)
    return _parsed_task(domain, problem), sas


def _remember(key: str, sas: str) -> None:
    _STATE.sas[key] = sas
    while len(_STATE.sas) > SAS_MEMORY_SIZE:
        _STATE.sas.popitem(last=False)


# ---------------------------------------------------------------------------------------------------
# switching it on and off


# what the wrappers rely on, besides the wrapped functions themselves (textworld 1.7's internals)
_NEEDED = {"textworld.envs.pddl.textgen": ("_PARSER", "_Converter", "ConditionalSymbol", "ListSymbol"),
           "textworld.logic": ("_PARSER", "_ModelConverter"),
           "textworld.envs.pddl.logic": ("_PARSER", "_ModelConverter")}


def _targets() -> dict[str, tuple[Any, str, Callable[..., Any]]]:
    """name → (module, attribute, replacement); AttributeError when this textworld lacks what they rely on."""
    import fast_downward
    import textworld.logic
    from textworld.envs.pddl import logic, textgen
    for module in (textgen, textworld.logic, logic):
        for attr in ("_parse_and_convert", *_NEEDED[module.__name__]):
            getattr(module, attr)
    return {"textgen": (textgen, "_parse_and_convert", _textgen_parse),
            "logic": (textworld.logic, "_parse_and_convert", _logic_parse),
            "pddl_logic": (logic, "_parse_and_convert", _pddl_logic_parse),
            "pddl2sas": (fast_downward, "pddl2sas", _pddl2sas)}


def set_engine_cache(enabled: bool, cache_dir: str | Path | None = None, *, disk: bool = True) -> bool:
    """Install (or remove) the caches process-wide (needs textworld with its PDDL backend). ``cache_dir``:
    the translations' folder (default :func:`default_cache_dir`); ``disk=False`` keeps them in memory only.
    Removing them also empties them. Returns whether they are installed: a textworld whose internals differ
    from 1.7's is played as shipped, said once on stderr."""
    try:
        targets = _targets()
    except AttributeError as e:
        if enabled and not _STATE.unavailable:
            _STATE.unavailable = True
            print(f"ALFWorld engine cache: not available for this textworld ({e}); games start as TextWorld ships "
                  "them", file=sys.stderr, flush=True)
        return False
    if not enabled:
        for name, (module, attr, _) in targets.items():
            if name in _STATE.originals:
                setattr(module, attr, _STATE.originals[name])
        _STATE.originals.clear()
        _STATE.sas.clear()
        for fn in _TREES.values():
            fn.cache_clear()
        _STATE.enabled, _STATE.stats, _STATE.unwritable_said = False, CacheStats(), False
        return False
    _STATE.cache_dir = (None if not disk else Path(cache_dir).expanduser() if cache_dir is not None
                        else default_cache_dir())
    if not _STATE.enabled:
        for name, (module, attr, replacement) in targets.items():
            _STATE.originals[name] = getattr(module, attr)
            setattr(module, attr, replacement)
        _STATE.enabled = True
    return True


def engine_cache_enabled() -> bool:
    return _STATE.enabled


def warm_engine(game: dict[str, Any]) -> None:
    """Parse, in this process, what every ALFWorld game shares: ``game``'s grammar (its rules), its action
    templates, feedback rules and conditions, and the intro rule — so environment processes forked
    afterwards find them parsed. Pure parsing: no game starts, nothing is translated or planned."""
    from textworld.envs.pddl import logic, textgen
    from textworld.logic import Rule
    if not _STATE.enabled and not set_engine_cache(True):
        return
    game_logic = logic.GameLogic(domain=game["pddl_domain"], grammar=game["grammar"])
    textgen._parse_and_convert("#intro#", rule_name="symbols")
    for action in game_logic.actions.values():
        textgen._parse_and_convert(action.template, rule_name="symbols")
        textgen._parse_and_convert(action.feedback_rule, rule_name="symbols")

    def queries(symbols: list[Any]) -> Iterator[str]:
        for s in symbols:
            if isinstance(s, textgen.ConditionalSymbol):
                if s.given:
                    yield s.given
                yield from queries(s.expression if isinstance(s.expression, list) else [s.expression])
            elif isinstance(s, textgen.ListSymbol):
                yield from queries([s.symbol])

    for rules in game_logic.grammar._rules.values():
        for rule in rules:
            for expr in ([rule.condition] if rule.condition else []) + list(queries(rule.rhs)):
                Rule.parse_conjunctive_query(expr)
