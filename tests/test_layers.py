"""The house's layers (docs/DESIGN.md "Layers"), checked on the imports themselves with ``ast``: module-level
and function-local imports alike. A failure names ``file:line`` and the rule it breaks.

Floors, bottom up — a module imports only from lower floors, or from its own package where the rules
below allow it:

1 ``sapd.method`` (the pure method), ``sapd.storage``, ``sapd.metrics``, ``sapd.yamlio``
2 ``sapd.layout``       3 ``sapd.config``
4 ``sapd.data`` (contracts and transforms, no models), ``sapd.models``
5 ``sapd.checkpoints``  6 ``sapd.envs``
7 ``sapd.stages`` (one module per stage; stages never import each other), ``sapd.entry``
8 ``sapd.run`` (the plan and its executors)      9 ``sapd.baselines``
10 ``sapd.study`` (the research harness; nothing below imports it)   11 ``sapd.cli``, ``jobs``

``sapd`` imports inside functions are allowed only in ``sapd/cli.py`` (per-command imports keep
``sapd --help`` quick); optional heavy packages (vLLM, DeepSpeed, the environments' simulators …) are
imported lazily inside the ``sapd`` modules that wrap them, which are therefore cheap to import.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

FLOORS = {
    "sapd": 0,  # the package face: __version__ only
    "sapd.method": 1, "sapd.storage": 1, "sapd.metrics": 1, "sapd.yamlio": 1,
    "sapd.layout": 2, "sapd.config": 3,
    "sapd.data": 4, "sapd.models": 4,
    "sapd.checkpoints": 5, "sapd.envs": 6,
    "sapd.stages": 7, "sapd.entry": 7,
    "sapd.run": 8, "sapd.baselines": 9, "sapd.study": 10,
    "sapd.cli": 11, "jobs": 11,
}
# inside a package its modules may import each other, except: a stage never imports another stage (the
# DeepSpeed engine belongs to the train stage), and no environment knows the loop that drives it or the
# panels that list it
ALLOWED_BETWEEN_STAGES = {("sapd.stages.train", "sapd.stages.train_deepspeed")}
ENVS_NOBODY_IMPORTS = {"sapd.envs.loop", "sapd.envs.panels"}
LAZY_OK = {"sapd/cli.py"}


def _module_name(path: Path) -> str:
    rel = path.relative_to(REPO).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _group(module: str) -> str | None:
    best = None
    for g in FLOORS:
        if module == g or module.startswith(g + "."):
            if best is None or len(g) > len(best):
                best = g
    return best


def _imports(path: Path) -> list[tuple[int, str, bool]]:
    """(line, imported sapd module, at module level) for every sapd import of a file."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    top = {id(n) for n in tree.body}
    out = []
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module == "sapd":  # from sapd import storage, layout
                names = [f"sapd.{a.name}" for a in node.names]
            elif node.module.startswith("sapd.") or node.module.startswith("jobs"):
                names = [node.module]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names if a.name.startswith("sapd")]
        out.extend((node.lineno, n, id(node) in top) for n in names)
    return out


def _sources() -> list[Path]:
    return sorted(list((REPO / "sapd").rglob("*.py")) + list((REPO / "jobs").glob("*.py")))


def _violations() -> list[str]:
    problems = []
    for path in _sources():
        me = _module_name(path)
        mine = _group(me)
        assert mine is not None, f"{path}: no floor for module {me}; add it to FLOORS"
        rel = path.relative_to(REPO).as_posix()
        for line, target, top_level in _imports(path):
            where = f"{rel}:{line}"
            if not top_level and rel not in LAZY_OK:
                problems.append(f"{where}: function-local import of {target} (import it at the top of the module)")
            theirs = _group(target)
            if theirs is None or target == me:
                continue
            if target == "sapd.cli" or (target.startswith("sapd.study") and mine not in ("sapd.study", "sapd.cli")):
                problems.append(f"{where}: {me} imports {target}; only the command line may use it")
                continue
            if mine == theirs:
                if mine == "sapd.stages" and (me, target) not in ALLOWED_BETWEEN_STAGES:
                    problems.append(f"{where}: {me} imports its sibling {target} (stages never import each other)")
                if mine == "sapd.envs" and target in ENVS_NOBODY_IMPORTS:
                    problems.append(f"{where}: {me} imports {target} (an environment does not know its loop or "
                                    "panels)")
                continue
            if FLOORS[theirs] >= FLOORS[mine]:
                problems.append(f"{where}: {me} (floor {FLOORS[mine]}) imports {target} (floor {FLOORS[theirs]})")
    return problems


def _cycles() -> list[list[str]]:
    graph: dict[str, set[str]] = {}
    for path in _sources():
        me = _module_name(path)
        graph.setdefault(me, set()).update(t for _, t, _ in _imports(path) if t != me)
    cycles, state = [], {}

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if nxt not in graph:
                continue
            if state.get(nxt) == 1:
                cycles.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, stack + [nxt])
        state[node] = 2

    for n in sorted(graph):
        if n not in state:
            visit(n, [n])
    return cycles


def test_every_import_stays_on_or_below_its_floor():
    problems = _violations()
    assert not problems, "\n".join(problems)


def test_no_import_cycles():
    assert _cycles() == []


def test_the_checker_catches_a_violation(tmp_path, monkeypatch):
    """The rules bite: a stage importing another stage, and a data module importing a stage, are named."""
    fake = tmp_path / "sapd" / "stages"
    fake.mkdir(parents=True)
    (fake / "train.py").write_text("from sapd.stages.evaluate import run\n")
    (tmp_path / "sapd" / "data").mkdir()
    (tmp_path / "sapd" / "data" / "batches.py").write_text("def f():\n    from sapd.stages.train import run\n")
    monkeypatch.setattr(sys.modules[__name__], "REPO", tmp_path)
    problems = _violations()
    assert any(p.startswith("sapd/stages/train.py:1: sapd.stages.train imports its sibling sapd.stages.evaluate")
               for p in problems)
    assert any(p.startswith("sapd/data/batches.py:2: function-local import") for p in problems)
    assert any("sapd.data.batches (floor 4) imports sapd.stages.train (floor 7)" in p for p in problems)
