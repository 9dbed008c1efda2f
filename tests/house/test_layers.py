"""The house's layers (docs/DESIGN.md "Layers"), checked on the imports themselves with ``ast``.

Every import is read — module-level, function-local and ``if TYPE_CHECKING:`` ones, ``from pkg import
module`` resolved to the module, relative imports, ``importlib.import_module("…")`` — in every module of
``sapd/``, ``research/``, ``bench/`` and ``experiments/``. A failure names ``file:line`` and
the rule it breaks. The rules:

- every module has a floor (:data:`FLOORS`, the table docs/DESIGN.md shows: the two are compared), and
  imports only from lower floors, or from inside its own package where the package rules allow it:
  a stage never imports another stage; no environment adapter knows the loop or the panels;
- nothing under ``sapd/`` imports ``research/``; only the command line (and the scripts of
  ``research/`` and ``bench/``) imports ``sapd/demo``; no module imports ``tests/``;
- third-party packages per layer (:data:`THIRD_PARTY`): ``method`` is torch and the standard library,
  ``data`` never a model library; ``import yaml`` only in ``sapd/yamlio.py``; the heavy optional packages
  (:data:`LAZY`) only inside functions in ``sapd/``;
- ``sapd`` imports inside functions only in ``sapd/cli.py`` (per-command imports keep ``sapd --help``
  quick); an import the checker cannot read (``importlib.import_module(name)``) is refused there;
- no import cycle, and no import chain in ``sapd/`` longer than :data:`MAX_CHAIN` modules;
- what each front door imports (:data:`DOORS`): the train job and ``sapd train-round`` no environment, the
  train and teacher-scores stages no trajectory-format parser, the build-prefixes job no model code
  beyond tokenizer and weights loading.

``python tests/house/test_layers.py`` prints the figures of the import graph (modules, longest chains, each
door's closure) and the import time of ``python -m sapd.jobs.train --help``.
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
import textwrap
import time
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
ROOTS = ("sapd", "research", "bench", "experiments")
PRODUCTION = ("sapd",)

# Every module's floor, bottom up; an entry covers its submodules, except ``sapd`` itself (the package
# face: ``__version__`` only), so a new top-level ``sapd/x.py`` has no floor until it is given one here.
FLOORS: dict[str, int] = {
    "sapd": 0, "sapd.lazy": 0,
    "sapd.method": 1, "sapd.storage": 1, "sapd.metrics": 1, "sapd.yamlio": 1, "sapd.progress": 1,
    "sapd.layout": 2, "sapd.platform": 2,
    "sapd.config": 3, "sapd.lease": 3,
    "sapd.data": 4, "sapd.models": 4,
    "sapd.checkpoints": 5,
    "sapd.envs": 6, "sapd.engines": 6,
    "sapd.stages": 7, "sapd.entry": 7, "sapd.panel_flags": 7,
    "sapd.run": 8,
    "sapd.baselines": 9,
    "sapd.demo": 10,  # `sapd demo` and its kit (games, pools, models, parallel jobs); the research harness uses it
    "sapd.cli": 11, "sapd.jobs": 11,
    "research": 12, "bench": 12,
    "experiments": 13,
}
EXACT = {"sapd"}  # entries that cover only themselves

# inside a package its modules may import each other, except: a stage never imports another stage (the
# stage context and the held-out validation that teacher-scores and evaluate share are not stages; the
# training engines live below, in sapd.engines), and no environment knows the loop or the panels
STAGE_HELPERS = {"sapd.stages", "sapd.stages.context", "sapd.stages.validation"}
ENVS_NOBODY_IMPORTS = {"sapd.envs.loop", "sapd.envs.panels"}
# the longest import chain (module-level and function-local imports) allowed in sapd/: a longer one is a layer
# too many, or an import of a module for what belongs lower down
MAX_CHAIN = 10
LAZY_OK = {"sapd/cli.py"}  # the one production file whose sapd imports may sit inside functions
# who may import the demo and its kit: the command line, and the research harness and benchmarks above it
DEMO_USERS = ("sapd.demo", "sapd.cli", "research", "experiments", "bench")

ANY = None  # no allow-list: scripts (research, bench, experiments) may use what they install
THIRD_PARTY: dict[str, set[str] | None] = {
    "sapd": set(),
    "sapd.lazy": set(),
    "sapd.method": {"torch"},
    "sapd.storage": {"boto3", "botocore", "s3transfer"},
    "sapd.metrics": {"prometheus_client"},
    "sapd.yamlio": {"yaml"},
    "sapd.progress": set(),
    "sapd.layout": set(),
    "sapd.platform": {"torch"},
    "sapd.config": set(),
    "sapd.lease": set(),
    "sapd.data": {"pyarrow"},  # never a model library: data is contracts and transforms
    "sapd.models": {"torch", "transformers", "tokenizers", "safetensors", "vllm"},
    "sapd.checkpoints": {"torch", "safetensors"},
    "sapd.envs": {"textworld", "scienceworld", "alfworld", "fast_downward", "bm25s", "Stemmer", "numpy"},
    "sapd.engines": {"torch", "deepspeed", "transformers"},  # transformers: ZeRO-3's partitioned load
    "sapd.stages": {"torch", "pyarrow"},
    "sapd.entry": set(),
    "sapd.panel_flags": set(),
    "sapd.run": {"kubernetes", "urllib3", "matplotlib", "torch"},
    "sapd.baselines": {"torch", "tqdm"},
    "sapd.demo": {"torch", "transformers", "textworld", "tqdm", "matplotlib"},
    "sapd.cli": set(),
    "sapd.jobs": {"kubernetes"},
    "research": ANY, "bench": ANY, "experiments": ANY,
}
YAML_READER = "sapd.yamlio"  # the one module that imports yaml (YAML 1.2 numbers, key lines for errors)
# heavy or optional packages: only inside functions in sapd/, so every module is cheap to import
LAZY = {"vllm", "deepspeed", "textworld", "scienceworld", "alfworld", "fast_downward", "matplotlib", "bm25s",
        "Stemmer", "transformers", "tokenizers", "safetensors"}


# ---------------------------------------------------------------------------------------------------
# the import graph


@dataclass(frozen=True)
class Import:
    line: int
    target: str  # a module of the tree, or a third-party / standard top-level name
    kind: str  # "top" (module level), "local" (inside a function or class body), "type" (TYPE_CHECKING)
    local_tree: bool  # target is a module of the scanned tree
    dynamic: bool = False  # importlib.import_module / __import__ (a literal, or None when computed)


@dataclass
class Module:
    name: str
    path: Path
    imports: list[Import] = field(default_factory=list)

    @property
    def rel(self) -> str:
        return self.path.relative_to(REPO).as_posix()


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _files() -> list[Path]:
    out: list[Path] = []
    for root in ROOTS:
        if (REPO / root).is_dir():
            out.extend(p for p in (REPO / root).rglob("*.py") if "__pycache__" not in p.parts)
    return sorted(out)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _scopes(tree: ast.Module):
    """(node, kind) for every node: "top" at module level (also inside a top-level if/try), "type" under
    ``if TYPE_CHECKING:``, "local" inside a function or class."""
    def walk(node: ast.AST, kind: str):
        for child in ast.iter_child_nodes(node):
            k = kind
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
                k = "local"
            yield child, k
            if isinstance(child, ast.If) and kind == "top" and _is_type_checking(child.test):
                for sub in child.body:
                    yield sub, "type"
                    yield from walk(sub, "type")
                for sub in child.orelse:
                    yield sub, kind
                    yield from walk(sub, kind)
                continue
            yield from walk(child, k)
    yield from walk(tree, "top")


def _resolve(name: str, modules: set[str]) -> tuple[str, bool]:
    """(module, in the tree): the longest known module that ``name`` names or lies in."""
    parts = name.split(".")
    for n in range(len(parts), 0, -1):
        candidate = ".".join(parts[:n])
        if candidate in modules:
            return candidate, True
    return parts[0], False


def _parse(path: Path, modules: set[str]) -> Module:
    me = _module_name(path)
    mod = Module(me, path)
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]

    def add(line: int, name: str, kind: str, dynamic: bool = False) -> None:
        target, local = _resolve(name, modules)
        if not local and name.split(".")[0] in ROOTS:  # a module of the tree that does not exist
            target, local = name, True
        mod.imports.append(Import(line, target, kind, local, dynamic))

    for node, kind in _scopes(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                add(node.lineno, a.name, kind)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base_parts = package.split(".") if package else []
                base_parts = base_parts[:len(base_parts) - (node.level - 1)]
                base = ".".join(base_parts + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            if base == "__future__":
                continue
            for a in node.names:  # from pkg import module: the module; from module import name: the module
                full = f"{base}.{a.name}" if base else a.name
                add(node.lineno, full if full in modules else base, kind)
        elif isinstance(node, ast.Call):
            f = node.func
            fname = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
            if fname in ("import_module", "__import__") and node.args:
                arg = node.args[0]
                if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                    add(node.lineno, arg.value, kind, dynamic=True)
                else:
                    mod.imports.append(Import(node.lineno, "<computed>", kind, True, dynamic=True))
    return mod


@lru_cache(maxsize=None)
def _graph_at(repo: Path) -> dict[str, Module]:
    files = _files()
    modules = {_module_name(p) for p in files}
    return {m.name: m for m in (_parse(p, modules) for p in files)}


def graph() -> dict[str, Module]:
    return _graph_at(REPO)


def group(module: str) -> str | None:
    """The FLOORS entry that covers ``module`` (the longest), or None."""
    best = None
    for g in FLOORS:
        if module == g or (g not in EXACT and module.startswith(g + ".")):
            if best is None or len(g) > len(best):
                best = g
    return best


def _repo_folder(name: str) -> bool:
    """A top-level folder or module of the repository that is no part of the scanned tree (tests/, …)."""
    return name not in ROOTS and ((REPO / name).is_dir() or (REPO / f"{name}.py").is_file())


# ---------------------------------------------------------------------------------------------------
# the rules


def violations() -> list[str]:
    problems: list[str] = []
    g = graph()
    std = set(sys.stdlib_module_names)
    for mod in g.values():
        me, rel = mod.name, mod.rel
        mine = group(me)
        if mine is None:
            problems.append(f"{rel}:1: module {me} has no floor; give it one in tests/house/test_layers.py FLOORS and in "
                            "docs/DESIGN.md's layer table")
            continue
        production = me.split(".")[0] in PRODUCTION
        for imp in mod.imports:
            where, target = f"{rel}:{imp.line}", imp.target
            if target == "<computed>":
                if production:
                    problems.append(f"{where}: an import of a computed module name (the layer rules cannot read it; "
                                    "import the module by name)")
                continue
            if not imp.local_tree:
                problems.extend(_third_party(where, me, mine, rel, imp, std))
                continue
            if production and imp.kind == "local" and rel not in LAZY_OK:
                problems.append(f"{where}: function-local import of {target} (import it at the top of the module)")
            if target == me:
                continue
            theirs = group(target)
            if theirs is None:
                problems.append(f"{where}: {me} imports {target}, which has no floor")
                continue
            if theirs == "research" and production:
                problems.append(f"{where}: {me} imports {target}; nothing under sapd/ imports research/")
                continue
            if target == "sapd.cli" or (theirs == "sapd.demo" and not any(
                    mine == u or mine.startswith(u + ".") for u in DEMO_USERS)):
                problems.append(f"{where}: {me} imports {target}; only the command line may use it")
                continue
            if mine == theirs:
                if mine == "sapd.stages" and target not in STAGE_HELPERS:
                    problems.append(f"{where}: {me} imports its sibling {target} (stages never import each other)")
                if (mine == "sapd.envs" and target in ENVS_NOBODY_IMPORTS and me not in ENVS_NOBODY_IMPORTS
                        and me != "sapd.envs"):
                    problems.append(f"{where}: {me} imports {target} (an environment does not know its loop or "
                                    "panels)")
                continue
            if FLOORS[theirs] >= FLOORS[mine]:
                problems.append(f"{where}: {me} (floor {FLOORS[mine]}) imports {target} (floor {FLOORS[theirs]})")
    return problems


def _third_party(where: str, me: str, mine: str, rel: str, imp: Import, std: set[str]) -> list[str]:
    root = imp.target
    if root in std or root == "__future__":
        return []
    if _repo_folder(root):
        return [f"{where}: {me} imports {root}/, which is no part of the package (move what it needs into sapd/)"]
    if root == "yaml" and me != YAML_READER:
        return [f"{where}: {me} imports yaml; read YAML through sapd.yamlio (YAML 1.2 numbers: 1e-3 is a float)"]
    out = []
    allowed = THIRD_PARTY.get(mine, set())
    if allowed is not ANY and root not in allowed and root != "yaml":
        out.append(f"{where}: {me} imports {root}, which its layer does not use (allowed: "
                   f"{', '.join(sorted(allowed)) or 'the standard library only'})")
    if root in LAZY and imp.kind == "top" and me.split(".")[0] in PRODUCTION:
        out.append(f"{where}: {me} imports {root} at module level; import it inside the function that needs it")
    return out


def cycles() -> list[list[str]]:
    g = graph()
    edges = {m.name: sorted({i.target for i in m.imports if i.local_tree and i.kind != "type" and i.target != m.name
                             and i.target in g}) for m in g.values()}
    found, state = [], {}

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        for nxt in edges[node]:
            if state.get(nxt) == 1:
                found.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, stack + [nxt])
        state[node] = 2

    for n in sorted(edges):
        if n not in state:
            visit(n, [n])
    return found


# ---------------------------------------------------------------------------------------------------
# what each front door imports


def _packages_of(module: str) -> list[str]:
    parts = module.split(".")
    return [".".join(parts[:n]) for n in range(1, len(parts))]


def closure(roots: list[str], *, within: dict[str, set[str]] | None = None) -> set[str]:
    """Every module of the tree importing ``roots`` runs: module-level imports, transitively, with each
    module's enclosing packages (their ``__init__`` runs first). ``within``: extra imports of a root (the
    function-local ones of one command)."""
    g = graph()
    seen: set[str] = set()
    todo = list(roots)
    while todo:
        m = todo.pop()
        if m in seen or m not in g:
            continue
        seen.add(m)
        todo.extend(p for p in _packages_of(m) if p in g)
        todo.extend(i.target for i in g[m].imports if i.local_tree and i.kind == "top")
        todo.extend((within or {}).get(m, ()))
    return seen


def _function_imports(module: str, functions: tuple[str, ...]) -> set[str]:
    """The tree modules imported inside the named top-level functions of ``module``."""
    mod = graph()[module]
    tree = ast.parse(mod.path.read_text(encoding="utf-8"))
    lines: set[int] = set()
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name in functions:
            lines.update(range(node.lineno, (node.end_lineno or node.lineno) + 1))
    return {i.target for i in mod.imports if i.local_tree and i.kind == "local" and i.line in lines}


def cli_closure(command_function: str) -> set[str]:
    """What ``sapd <command>`` imports: the CLI's module, its parser and dispatch, and the command."""
    extra = _function_imports("sapd.cli", ("build_parser", "main", command_function))
    return closure(["sapd.cli"], within={"sapd.cli": extra})


ENVS = ("sapd.envs",)
FORMAT_PARSERS = ("sapd.data.loaders", "sapd.data.formats")
RESEARCH = ("research", "sapd.demo", "experiments", "bench")
MODEL_CODE = ("sapd.models.generation", "sapd.models.scoring", "sapd.models.vllm_backend", "sapd.models.tiny",
              "sapd.models.gguf_import", "sapd.method.objective")
# door → what its closure must not contain (a module, or a package and everything in it). The build-prefixes
# door loads and saves the initial student (sapd.models.loading) but runs no model: no generation, scoring
# or loss code (the config's LossConfig does not need the loss functions either).
DOORS: dict[str, tuple[list[str], set[str] | None, tuple[str, ...]]] = {
    # name: (roots, CLI command function or None, forbidden)
    "sapd.jobs.train": (["sapd.jobs.train"], None, ENVS + RESEARCH),
    "sapd train-round": (["sapd.cli"], {"cmd_train_round"}, ENVS + RESEARCH),
    "sapd.jobs.teacher_scores": (["sapd.jobs.teacher_scores"], None, ENVS + RESEARCH),
    "sapd.jobs.build_prefixes": (["sapd.jobs.build_prefixes"], None, ENVS + RESEARCH + MODEL_CODE[:-1]),
    "sapd.jobs.evaluate": (["sapd.jobs.evaluate"], None, RESEARCH),
    "sapd evaluate": (["sapd.cli"], {"cmd_evaluate"}, RESEARCH),
    "sapd.jobs.check": (["sapd.jobs.check"], None, ENVS + RESEARCH + MODEL_CODE[:-1]),
    "sapd check": (["sapd.cli"], {"cmd_check"}, ENVS + RESEARCH + MODEL_CODE[:-1]),
    "sapd.jobs.fetch": (["sapd.jobs.fetch"], None, ENVS + RESEARCH + MODEL_CODE + ("sapd.config",)),
    "stage train": (["sapd.stages.train"], None, ENVS + RESEARCH + FORMAT_PARSERS),
    "stage teacher-scores": (["sapd.stages.teacher_scores"], None, ENVS + RESEARCH + FORMAT_PARSERS),
    "data.batches": (["sapd.data.batches"], None, FORMAT_PARSERS + ("sapd.models",)),
}


def door_closure(name: str) -> set[str]:
    roots, command, _ = DOORS[name]
    if command:
        (fn,) = command
        return cli_closure(fn)
    return closure(roots)


def _hits(mods: set[str], forbidden: tuple[str, ...]) -> list[str]:
    return sorted(m for m in mods if any(m == f or m.startswith(f + ".") for f in forbidden))


# ---------------------------------------------------------------------------------------------------
# docs/DESIGN.md's table


def design_floors(text: str) -> dict[str, int]:
    """module → floor from the "Layers" table of docs/DESIGN.md (one floor per row; its paths in backticks)."""
    section = text.split("## Layers", 1)[1].split("\n## ", 1)[0]
    out: dict[str, int] = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 2 or not cells[0].isdigit():
            continue
        for path in re.findall(r"`([\w/.]+)`", cells[1]):
            out[path.rstrip("/").removesuffix(".py").replace("/", ".")] = int(cells[0])
    return out


# ---------------------------------------------------------------------------------------------------
# tests


def test_every_import_stays_on_or_below_its_floor():
    problems = violations()
    assert not problems, "\n".join(problems)


def test_no_import_cycles():
    assert cycles() == []


def chain_problem() -> str | None:
    """Why the longest import chain in ``sapd/`` is too long, or None."""
    chain = longest_chain(within=PRODUCTION)
    if len(chain) <= MAX_CHAIN:
        return None
    return f"the longest import chain in sapd/ has {len(chain)} modules (at most {MAX_CHAIN}): {' → '.join(chain)}"


def test_no_import_chain_in_sapd_is_longer_than_ten():
    """The sapd/ figure `python tests/house/test_layers.py` prints (which covers the product's and the jobs')."""
    assert MAX_CHAIN == 10
    assert chain_problem() is None, chain_problem()


def test_the_chain_check_reports_a_planted_chain_of_eleven(tmp_path, monkeypatch):
    (tmp_path / "sapd").mkdir()
    (tmp_path / "sapd" / "__init__.py").write_text("")
    for i in range(MAX_CHAIN + 1):
        text = f"from sapd import m{i + 1}\n" if i < MAX_CHAIN else ""
        (tmp_path / "sapd" / f"m{i}.py").write_text(text, encoding="utf-8")
    monkeypatch.setattr(sys.modules[__name__], "REPO", tmp_path)
    assert chain_problem() == (f"the longest import chain in sapd/ has {MAX_CHAIN + 1} modules (at most {MAX_CHAIN}): "
                               + " → ".join(f"sapd.m{i}" for i in range(MAX_CHAIN + 1)))
    (tmp_path / "sapd" / f"m{MAX_CHAIN - 1}.py").write_text("", encoding="utf-8")  # cut the last link
    _graph_at.cache_clear()
    assert chain_problem() is None


def test_each_door_imports_only_what_its_job_needs():
    problems = []
    for name, (_, _, forbidden) in DOORS.items():
        if bad := _hits(door_closure(name), forbidden):
            problems.append(f"{name} imports {', '.join(bad)}")
    assert not problems, "\n".join(problems)


def test_the_design_table_is_the_floor_table():
    """docs/DESIGN.md's layer table lists exactly FLOORS (module and floor), so neither can drift."""
    documented = design_floors((REPO / "docs" / "DESIGN.md").read_text(encoding="utf-8"))
    expected = {m: f for m, f in FLOORS.items() if m not in EXACT}
    assert documented == expected, {"DESIGN.md only": {k: v for k, v in documented.items() if expected.get(k) != v},
                                    "FLOORS only": {k: v for k, v in expected.items() if documented.get(k) != v}}


def test_the_train_job_imports_what_the_static_graph_says(tmp_path):
    """The graph is the truth: the sapd modules `python -m sapd.jobs.train --help` really imports are the ones the
    static closure names (the import time is printed: `pytest -s`)."""
    code = ("import sys, time; t = time.perf_counter(); import sapd.jobs.train; "
            "print(round(time.perf_counter() - t, 3)); "
            "print(' '.join(sorted(m for m in sys.modules if m.split('.')[0] in ('sapd',))))")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=tmp_path,
                         check=True).stdout.splitlines()
    imported = set(out[1].split())
    print(f"\nimport sapd.jobs.train: {out[0]} s, {len(imported)} sapd/jobs modules")
    assert imported == door_closure("sapd.jobs.train")
    assert not _hits(imported, ENVS)


PLANTED = {
    # the seven kinds the architecture review planted (docs: review 2 §1.4), plus a bench → tests import
    "sapd/envs/textworld_env.py": ("from sapd.envs import loop\n", "an environment does not know its loop"),
    "sapd/stages/evaluate.py": ("\n\nfrom .train import run\n", "imports its sibling sapd.stages.train"),
    "sapd/run/local.py": ("from experiments.powered import ARMS\n", "imports experiments.powered (floor 13)"),
    "sapd/run/plan.py": ("import importlib\n\n\ndef f():\n    return importlib.import_module('sapd.demo.main')\n",
                         "imports sapd.demo.main; only the command line"),
    "sapd/demo/a.py": ("from sapd.demo import b\n", None),
    "sapd/demo/b.py": ("from sapd.demo import a\n", None),
    "sapd/method/objective.py": ("import torch\nimport transformers\n", "imports transformers, which its layer"),
    "sapd/helpers.py": ("X = 1\n", "module sapd.helpers has no floor"),
    "sapd/method/rules.py": ("from sapd import helpers\n", "imports sapd.helpers, which has no floor"),
    "bench/train_memory.py": ("from tests.tokenizer_util import build_test_tokenizer\n", "imports tests/"),
    "sapd/data/batches.py": ("import yaml\n", "read YAML through sapd.yamlio"),
    "sapd/envs/alfworld_env.py": ("import alfworld\n", "imports alfworld at module level"),
    "sapd/run/k8s.py": ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from sapd.cli import main\n",
                        "imports sapd.cli; only the command line"),
    "sapd/jobs/train.py": ("def main():\n    from sapd.stages import train\n", "function-local import of sapd.stages.train"),
    "sapd/stages/train.py": ("def f(name):\n    import importlib\n    return importlib.import_module(name)\n",
                             "an import of a computed module name"),
    "sapd/data/__init__.py": ("", None),
    "sapd/envs/__init__.py": ("", None),
    "sapd/stages/__init__.py": ("", None),
    "sapd/run/__init__.py": ("", None),
    "sapd/demo/__init__.py": ("", None),
    "sapd/method/__init__.py": ("", None),
    "sapd/__init__.py": ("", None),
    "experiments/powered.py": ("ARMS = ()\n", None),
    "sapd/cli.py": ("def main():\n    pass\n", None),
    "sapd/demo/main.py": ("", None),
    "sapd/envs/loop.py": ("", None),
}


def test_the_checker_catches_each_planted_violation(tmp_path, monkeypatch):
    """A fake tree with one file per kind of violation: each is reported with its file:line, and the cycle
    written as `from pkg import module` is found."""
    for rel, (text, _) in PLANTED.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(textwrap.dedent(text), encoding="utf-8")
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "tokenizer_util.py").write_text("")
    monkeypatch.setattr(sys.modules[__name__], "REPO", tmp_path)
    problems = violations()
    lines = {rel: text.count("\n") for rel, (text, _) in PLANTED.items()}
    for rel, (_, expected) in PLANTED.items():
        if expected is None:
            continue
        mine = [p for p in problems if p.startswith(f"{rel}:") and expected in p]
        assert mine, f"{rel}: nothing reported containing {expected!r}; got:\n" + "\n".join(problems)
        line = int(mine[0].split(":")[1])
        assert 1 <= line <= max(lines[rel], 1), mine[0]
    assert any(p.startswith("sapd/stages/evaluate.py:3:") for p in problems)  # the line itself
    assert ["sapd.demo.a", "sapd.demo.b", "sapd.demo.a"] in cycles()


# ---------------------------------------------------------------------------------------------------
# the figures (python tests/house/test_layers.py)


def longest_chain(start: list[str] | None = None, *, within: tuple[str, ...] = ROOTS,
                  without: tuple[str, ...] = ()) -> list[str]:
    """The longest import chain (module-level and function-local imports) among modules under ``within``,
    leaving out those under ``without``."""
    g = graph()
    keep = {m for m in g if m.split(".")[0] in within and not _hits({m}, without)}
    edges = {m: {i.target for i in g[m].imports if i.local_tree and i.kind != "type" and i.target in keep
                 and i.target != m} for m in keep}
    best: dict[str, list[str]] = {}

    def chain(m: str) -> list[str]:
        if m not in best:
            tails = [chain(n) for n in sorted(edges[m])]
            best[m] = [m] + max(tails, key=len, default=[])
        return best[m]

    return max((chain(m) for m in sorted(start or keep)), key=len)


def report() -> None:
    g = graph()
    sapd = [m for m in g.values() if m.name.split(".")[0] == "sapd"]
    inits = sum(1 for m in sapd if m.path.name == "__init__.py")
    print(f"modules: sapd/ {len(sapd) - inits} + {inits} __init__; whole tree {len(g)}")
    for label, start, within, without in (
            ("all imports, whole tree", None, ROOTS, ()),
            ("sapd/", None, PRODUCTION, ()),
            ("the product: sapd/ without sapd/demo", None, PRODUCTION, ("sapd.demo",)),
            ("from sapd/jobs/", [m for m in g if m.startswith("sapd.jobs.")], PRODUCTION, ())):
        c = longest_chain(start, within=within, without=without)
        print(f"longest chain ({label}): {len(c)}: {' → '.join(c)}")
    for name in DOORS:
        mods = door_closure(name)
        envs = _hits(mods, ENVS)
        print(f"{name}: {len(mods)} modules, {len(envs)} env modules")
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-m", "sapd.jobs.train", "--help"], capture_output=True, check=True, cwd=REPO,
                       env={**os.environ, "PYTHONPATH": str(REPO)})
        times.append(time.perf_counter() - t0)
    print(f"python -m sapd.jobs.train --help: {min(times):.2f} s (best of 3)")


if __name__ == "__main__":
    report()
    problems = violations()
    print(f"{len(problems)} layer problems" + ("".join(f"\n  {p}" for p in problems) if problems else ""))


def test_the_config_loads_without_torch():
    """`import sapd.config` (every door, every pod, `sapd.jobs.wait`) does not import torch: the objectives'
    module takes it at first use (sapd/lazy.py), ≈ 3 s of CPU per process that never computes a tensor."""
    code = "import sys, sapd.config, sapd.method.objective as o; assert 'torch' not in sys.modules; o.torch.zeros(1)"
    proc = subprocess.run([sys.executable, "-c", code + "; assert 'torch' in sys.modules"], capture_output=True,
                          text=True, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-2000:]
