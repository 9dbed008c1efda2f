"""The repository carries its own docs: every reference from code, charts and docs points at a file that
exists, nothing points outside the repository, and every function the paper-to-code index names exists."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SOURCES = [*REPO.glob("sapd/**/*.py"), *REPO.glob("jobs/*.py"), *REPO.glob("charts/**/*.yaml"),
           *REPO.glob("charts/**/*.tpl"), *REPO.glob("charts/**/*.txt"), *REPO.glob("docs/*.md"),
           *REPO.glob("bench/*.py"), *REPO.glob("research/*.py"), *REPO.glob("experiments/*.py"), *REPO.glob("experiments/*.yaml"),
           REPO / "README.md", REPO / "Dockerfile", REPO / "Makefile", REPO / "pyproject.toml"]


def test_every_docs_reference_exists():
    missing = []
    for path in SOURCES:
        text = path.read_text(encoding="utf-8")
        for m in re.finditer(r"docs/([\w/.-]+\.(?:md|png|json))", text):
            if not (REPO / "docs" / m.group(1)).is_file():
                missing.append(f"{path.relative_to(REPO)}: docs/{m.group(1)}")
        if path.parent == REPO / "docs":  # relative links between the docs
            for m in re.finditer(r"\]\(([\w/.-]+\.md)\)", text):
                if not (path.parent / m.group(1)).is_file():
                    missing.append(f"{path.relative_to(REPO)}: {m.group(1)}")
    assert not missing, "\n".join(missing)


def test_nothing_points_outside_the_repository():
    bad = [f"{p.relative_to(REPO)}" for p in SOURCES if "../shared" in p.read_text(encoding="utf-8")]
    assert not bad, bad


def test_the_paper_to_code_index_names_real_functions():
    """Every `sapd.x.y.name` in docs/SAPD.md imports and has the attribute; bare names in its table rows
    are looked up in sapd.method.objective (the module the table is about)."""
    text = (REPO / "docs" / "SAPD.md").read_text(encoding="utf-8")
    dotted = set(re.findall(r"`(sapd(?:\.\w+)+)`", text))
    assert len(dotted) > 25
    for name in sorted(dotted):
        module, _, attr = name.rpartition(".")
        try:
            obj = importlib.import_module(name)
        except ModuleNotFoundError:
            obj = getattr(importlib.import_module(module), attr.split(".")[0], None)
        assert obj is not None, f"docs/SAPD.md names {name}, which does not exist"
    objective = importlib.import_module("sapd.method.objective")
    for bare in ("sapd_loss", "sft_loss", "grpo_advantages", "grpo_loss", "LossConfig"):
        assert hasattr(objective, bare)
