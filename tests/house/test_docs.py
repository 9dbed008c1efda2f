"""The repository carries its own docs: every reference from code, charts, tests and docs points at a file
that exists, every link between pages (and its #anchor) resolves, every doc section a comment or message
cites by name exists, nothing points outside the repository, every function the paper-to-code index names
exists, the README opens with the two commands CI runs, and tests/README.md maps every test file.

(The docs site's own build, `make docs`, checks the links of docs/ again, and every cross-reference of the
docstrings; this file checks what the site does not build: the README, the chart, code and tests.)"""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SOURCES = [*REPO.glob("sapd/**/*.py"), *REPO.glob("charts/**/*.yaml"),
           *REPO.glob("charts/**/*.tpl"), *REPO.glob("charts/**/*.txt"), *REPO.glob("charts/**/*.md"),
           *REPO.glob("charts/**/*.tmpl"), *REPO.glob("docs/**/*.md"), *REPO.glob("docs/*.py"),
           *REPO.glob("bench/*.py"), *REPO.glob("research/*.py"), *REPO.glob("experiments/*.py"),
           *REPO.glob("experiments/*.yaml"), *REPO.glob("tests/*.py"), *REPO.glob("tests/*.md"),
           *REPO.glob("scripts/*"), *REPO.glob("manifests/*.yaml"),
           REPO / "README.md", REPO / "Dockerfile", REPO / "Makefile", REPO / "pyproject.toml", REPO / ".ci/run"]
PAGES = [p for p in SOURCES if p.suffix == ".md" and "_build" not in p.parts and "_generated" not in p.parts]


def slug(heading: str) -> str:
    """A heading's anchor as GitHub and the docs site (MyST) make it: inline markup dropped, lower case,
    punctuation other than ``-`` and ``_`` removed, spaces to hyphens.

    >>> slug("Training and π_old: each prompt once"), slug("On a GPU: `bench/gpu_check.sh` (H200)")
    ('training-and-π_old-each-prompt-once', 'on-a-gpu-benchgpu_checksh-h200')
    """
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # [text](link) → text
    text = text.replace("`", "").replace("*", "").strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def headings(page: Path) -> list[str]:
    """The heading texts of a Markdown page (outside code blocks); a page that includes another (MyST's
    ``{include}``) has that page's headings too."""
    out, fenced = [], False
    for line in page.read_text(encoding="utf-8").splitlines():
        if line.startswith("```"):
            include = re.match(r"```\{include\}\s+(\S+)", line)
            if include:
                out += headings((page.parent / include.group(1)).resolve())
            fenced = not fenced if not include else fenced
            continue
        m = re.match(r"#{1,6} (.+)", line)
        if m and not fenced:
            out.append(m.group(1).strip())
    return out


def test_every_docs_reference_exists():
    missing = []
    for path in SOURCES:
        text = path.read_text(encoding="utf-8")
        for m in re.finditer(r"(?<![\w./])docs/([\w/.-]+\.(?:md|png|json))", text):
            if not (REPO / "docs" / m.group(1)).is_file():
                missing.append(f"{path.relative_to(REPO)}: docs/{m.group(1)}")
    assert not missing, "\n".join(missing)


def _site_conf():
    """docs/conf.py, the docs site's configuration, as a module."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("sapd_docs_conf", REPO / "docs" / "conf.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_link_between_pages_and_its_anchor_resolves():
    """Relative links of every Markdown page (the README, docs/, tests/README.md, the chart's README): the
    file exists, and a ``#anchor`` names a heading of it."""
    bad = []
    for page in PAGES:
        text = re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.S)
        docname = str(page.relative_to(REPO / "docs").with_suffix("")) if REPO / "docs" in page.parents else ""
        for old, new in _site_conf().LINK_REWRITES.get(docname, []):
            text = text.replace(old, new)
        for m in re.finditer(r"\]\(([^)\s]+)\)", text):
            link = m.group(1)
            if re.match(r"[a-z]+://|mailto:", link):
                continue
            target, _, anchor = link.partition("#")
            dest = (page.parent / target).resolve() if target else page
            where = f"{page.relative_to(REPO)}: {link}"
            if not dest.exists():
                bad.append(f"{where} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in {slug(h) for h in headings(dest)}:
                bad.append(f"{where} (no heading with that anchor)")
    assert not bad, "\n".join(bad)


# `docs/<page>.md "<Section>"`, `README "<Section>"` (also in '…', and "README ("…")"); `docs/<page>.md §4`
CITED_SECTION = re.compile(r"""(README|(?:docs/)?[\w/.-]+\.md)(?:'s)?\s*\(?["']([A-Z][^"'\n]{2,80})["']""")
CITED_NUMBER = re.compile(r"((?:docs/)?[\w/.-]+\.md) §(\d+)(?:[–-]§?(\d+))?")


def _doc(name: str, cited_from: Path) -> Path | None:
    """The page a citation names: README is the root one; a bare file name is looked up in docs/."""
    if name == "README":
        return REPO / "README.md"
    for candidate in (REPO / name, cited_from.parent / name, *REPO.glob(f"docs/**/{name}")):
        if candidate.is_file():
            return candidate
    return None


def test_every_cited_doc_section_exists():
    """Comments, messages, values and tests cite doc sections by name (`docs/kubernetes/operate.md
    "Evaluation"`) or number (`docs/SAPD.md §4`): each must be a heading of that page, so a moved or renamed
    section fails here rather than leaving a pointer to nowhere."""
    bad, seen = [], 0
    for path in SOURCES:
        text = path.read_text(encoding="utf-8")
        for m in CITED_SECTION.finditer(text):
            page = _doc(m.group(1), path)
            if page is None or page.suffix != ".md":
                continue
            seen += 1
            names = [re.sub(r"[`*]", "", h) for h in headings(page)]
            if not any(h.startswith(m.group(2)) or re.sub(r"^\d+\. ", "", h).startswith(m.group(2)) for h in names):
                bad.append(f'{path.relative_to(REPO)}: {m.group(1)} "{m.group(2)}": no such section')
        for m in CITED_NUMBER.finditer(text):
            page = _doc(m.group(1), path)
            if page is None:
                bad.append(f"{path.relative_to(REPO)}: {m.group(1)}: no such page")
                continue
            seen += 1
            first, last = int(m.group(2)), int(m.group(3) or m.group(2))
            numbers = {int(n.group(1)) for h in headings(page) if (n := re.match(r"(\d+)\. ", h))}
            bad += [f"{path.relative_to(REPO)}: {m.group(0)}: no section {n}" for n in range(first, last + 1)
                    if n not in numbers]
    assert seen > 40  # the checker reads the citations (it found them)
    assert not bad, "\n".join(bad)


def test_a_section_citation_that_names_nothing_is_caught(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# Title\n\n## Following a run\n\n## 4. Variants\n")
    assert [m.group(2) for m in CITED_SECTION.finditer('see page.md "Following a run" and page.md "Gone"')] == \
        ["Following a run", "Gone"]
    assert [h for h in headings(page)] == ["Title", "Following a run", "4. Variants"]
    assert CITED_NUMBER.search("docs/SAPD.md §2–§4").groups() == ("docs/SAPD.md", "2", "4")


def test_nothing_points_outside_the_repository():
    bad = [f"{p.relative_to(REPO)}" for p in SOURCES
           if "../shared" in p.read_text(encoding="utf-8") and p != Path(__file__).resolve()]
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


def test_the_readme_is_a_door_that_opens_with_the_two_commands_ci_runs():
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    assert len(readme.splitlines()) <= 300 and len(readme) <= 20_000, (len(readme.splitlines()), len(readme))
    first_block = re.search(r"```bash\n(.*?)```", readme, flags=re.S)
    assert first_block and [line.split()[:2] for line in first_block.group(1).splitlines()] == \
        [["make", "demo"], ["make", "test"]]
    ci = [line for line in (REPO / ".ci/run").read_text().splitlines() if line.strip() and not line.startswith("#")]
    assert ci[-1].strip() == "make test"  # CI runs the test command the README names
    makefile = (REPO / "Makefile").read_text()
    # the test rule (its prerequisites and its recipe, which may build some of them side by side) builds the docs
    rule = re.search(r"^test:.*\n(?:\t.*\n)*", makefile, flags=re.M)
    assert rule and re.search(r"\bdocs\b", rule.group(0)) and re.search(r"\blint\b", rule.group(0)), \
        "make test builds the docs site and runs the linters"
    for target in ("demo", "test", "test-fast", "docs", "refs", "lint"):
        assert re.search(rf"^{re.escape(target)}:", makefile, flags=re.M), target
    for page in ("README.md", "tests/README.md"):  # the contributors' command is named where they look
        assert "make test-fast" in (REPO / page).read_text(encoding="utf-8"), page


def map_sections() -> dict[str, str]:
    """tests/README.md's map: the text of each `### tests/<folder> ↔ …` section, by folder."""
    text = (REPO / "tests/README.md").read_text(encoding="utf-8")
    return {m.group(1): m.group(2) for m in re.finditer(r"^### tests/(\w+) .*?\n(.*?)(?=^##)", text, flags=re.M | re.S)}


@pytest.mark.parametrize("test_file", sorted(str(p.relative_to(REPO)) for p in REPO.glob("tests/**/test_*.py")))
def test_the_tests_map_names_every_test_file_in_its_folders_section(test_file):
    parts = Path(test_file).parts
    assert len(parts) == 3, f"{test_file}: a test file sits in the folder of its part of the package (tests/<folder>/)"
    sections = map_sections()
    assert parts[1] in sections, f"tests/README.md has no section for tests/{parts[1]}: add one"
    assert f"| `{parts[2]}` |" in sections[parts[1]], \
        f"tests/README.md does not map {test_file}: add its row to the tests/{parts[1]} section"


def test_every_test_folder_is_a_package_and_has_a_section():
    """tests/ is a package (`from tests.conftest import free_port`); each folder of tests is one too, so
    pytest names its modules tests.<folder>.test_x (vllm/ excepted: its own conftest, in .venv-vllm/)."""
    folders = {p.parent.name for p in REPO.glob("tests/*/test_*.py")}
    assert len(folders) >= 15 and set(map_sections()) == folders, sorted(set(map_sections()) ^ folders)
    missing = [f for f in sorted(folders - {"vllm"}) if not (REPO / "tests" / f / "__init__.py").is_file()]
    assert not missing, f"tests/<folder>/__init__.py missing for {missing}"
