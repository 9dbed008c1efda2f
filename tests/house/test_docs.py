"""The repository carries its own docs: every reference from code, charts, tests and docs points at a file
that exists, every Markdown page's code fences close, every link between pages (and its #anchor) resolves
as GitHub renders the page, every doc section a comment or message cites by name exists, nothing points
outside the repository, every function the paper-to-code index names exists, the README opens with the two
commands CI runs and its repository map names real paths (and every folder), and tests/MAP.md maps
every test file.

(The docs site's own build, `make docs`, checks the links of docs/ again as MyST resolves them, and every
cross-reference of the docstrings; this file reads the pages as GitHub shows them: a link the site rewrites
or an anchor only MyST makes still fails here.)"""

from __future__ import annotations

import fnmatch
import html
import importlib
import os
import re
import unicodedata
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote

import pytest

REPO = Path(__file__).resolve().parents[2]
SOURCES = [*REPO.glob("sapd/**/*.py"), *REPO.glob("charts/**/*.yaml"),
           *REPO.glob("charts/**/*.tpl"), *REPO.glob("charts/**/*.txt"), *REPO.glob("charts/**/*.md"),
           *REPO.glob("charts/**/*.tmpl"), *REPO.glob("docs/**/*.md"), *REPO.glob("docs/*.py"),
           *REPO.glob("bench/*.py"), *REPO.glob("research/*.py"), *REPO.glob("experiments/*.py"),
           *REPO.glob("experiments/*.yaml"), *REPO.glob("tests/*.py"), *REPO.glob("tests/*.md"),
           *REPO.glob("scripts/*"), *REPO.glob("manifests/*.yaml"),
           REPO / "README.md", REPO / "Dockerfile", REPO / "Makefile", REPO / "pyproject.toml", REPO / ".ci/run"]


def _ignored(rel: str, patterns: list[str]) -> bool:
    """Whether one of .gitignore's patterns (names, globs, paths from the root) ignores this path."""
    for pattern in patterns:
        bare = pattern.rstrip("/")
        if "/" in bare:  # a path from the root
            if fnmatch.fnmatch(rel, bare.lstrip("/")):
                return True
        elif fnmatch.fnmatch(rel.rsplit("/", 1)[-1], bare):
            return True
    return False


def gitignore(root: Path = REPO) -> list[str]:
    path = root / ".gitignore"
    lines = path.read_text(encoding="utf-8").splitlines() if path.is_file() else []
    return [line.strip() for line in lines if line.strip() and not line.startswith(("#", "!"))]


def markdown_pages(root: Path = REPO) -> list[Path]:
    """Every Markdown page of the repository as a checkout has it: hidden folders, what .gitignore ignores
    (environments, build output, runs) and the docs site's generated pages left out."""
    patterns, out = gitignore(root), []
    for folder, dirs, files in os.walk(root):
        rel = Path(folder).relative_to(root)
        dirs[:] = sorted(d for d in dirs if not d.startswith(".") and d != "__pycache__"
                         and not _ignored((rel / d).as_posix(), patterns))
        out += [Path(folder) / f for f in sorted(files)
                if f.endswith(".md") and not _ignored((rel / f).as_posix(), patterns)]
    return out


PAGES = markdown_pages()


@dataclass(frozen=True)
class Fence:
    """A fenced code block: its opening line (0-based), its closing line (None: never closed), the fence
    (```` ``` ````, ``~~~~``, …) and the info string (``bash``, ``{include} path``)."""
    start: int
    end: int | None
    fence: str
    info: str


# a fence line: any indentation (a list item's fence is indented) and blockquote markers before the fence
FENCE_LINE = re.compile(r"^(?:[ \t]*>)*[ \t]*(?P<fence>`{3,}|~{3,})(?P<info>.*)$")


def fences(lines: list[str]) -> list[Fence]:
    """The fenced code blocks of a page, by CommonMark's rules: a run of three or more backticks (whose info
    string has no backtick) or tildes opens one; only a run of the same character, at least as long and
    followed by nothing but spaces, closes it; everything between is code, other fences included."""
    out: list[Fence] = []
    start, fence, info = -1, "", ""
    for i, line in enumerate(lines):
        m = FENCE_LINE.match(line)
        if not fence:
            if m and not (m["fence"][0] == "`" and "`" in m["info"]):
                start, fence, info = i, m["fence"], m["info"].strip()
        elif m and m["fence"][0] == fence[0] and len(m["fence"]) >= len(fence) and not m["info"].strip():
            out.append(Fence(start, i, fence, info))
            fence = ""
    if fence:
        out.append(Fence(start, None, fence, info))
    return out


def _outside_code(lines: list[str]) -> list[str]:
    """The page's lines with every fenced block's lines (fences included) blanked: line numbers stay."""
    lines = list(lines)
    for block in fences(lines):
        for i in range(block.start, len(lines) if block.end is None else block.end + 1):
            lines[i] = ""
    return lines


CODE_SPAN = re.compile(r"(?<!`)(`+)(?!`)((?:(?!\n[ \t]*\n).)+?)(?<!`)\1(?!`)", re.S)  # within a paragraph


def prose(text: str) -> str:
    """What GitHub renders as text (where a link is a link): fenced blocks, inline code and HTML comments
    blanked, line numbers kept."""
    text = "\n".join(_outside_code(text.splitlines()))
    blank = lambda m: "\n" * m.group(0).count("\n")  # noqa: E731
    return CODE_SPAN.sub(blank, re.sub(r"<!--.*?-->", blank, text, flags=re.S))


def heading_text(heading: str) -> str:
    """A heading's text as GitHub shows it: code spans keep their content; links become their text, images
    and HTML tags nothing; emphasis marks (``*``, ``_`` at a word's edge, ``~~``) and escapes go."""
    out = []
    for i, piece in enumerate(re.split(r"(?<!`)(`+)(?!`)(.+?)(?<!`)\1(?!`)", heading)):
        if i % 3 == 1:  # the backtick run of a code span
            continue
        if i % 3 == 2:  # a code span's content
            out.append(piece[1:-1] if len(piece) > 2 and piece[0] == piece[-1] == " " else piece)
            continue
        piece = re.sub(r"!\[[^\]]*\]\([^)]*\)", "", piece)  # images
        piece = re.sub(r"\[([^\]]*)\](?:\([^)]*\)|\[[^\]]*\])", r"\1", piece)  # links
        piece = re.sub(r"<[^>]+>", "", piece).replace("*", "").replace("~~", "")
        piece = re.sub(r"(?<![\w\\])_+(?=\S)|(?<=[^\s\\])_+(?!\w)", "", piece)  # _emphasis_, __strong__
        out.append(html.unescape(re.sub(r"\\(.)", r"\1", piece)))
    return "".join(out).strip()


def slug(heading: str) -> str:
    """A heading's anchor as GitHub makes it (github-slugger; MyST's anchors follow it): the text as shown,
    lower case, every character but letters, digits, marks, ``_``, ``-`` and spaces removed, each space a
    hyphen. (:func:`anchors` numbers a page's repeated headings.)

    >>> slug("Training and π_old: each prompt once"), slug("On a GPU: `bench/gpu_check.sh` (H200)")
    ('training-and-π_old-each-prompt-once', 'on-a-gpu-benchgpu_checksh-h200')
    >>> slug("What's *new* in `__init__.py` — 2× faster [here](x.md)"), slug("__init__ and  Ünïcode ½")
    ('whats-new-in-__init__py--2-faster-here', 'init-and--ünïcode-½')
    """
    kept = (c for c in heading_text(heading).lower()
            if c in "-_ " or unicodedata.category(c)[0] in "LNM" or unicodedata.category(c) == "Pc")
    return "".join(kept).replace(" ", "-")


ATX = re.compile(r"^ {0,3}#{1,6}(?:[ \t]+(.*?))?(?:[ \t]+#+)?[ \t]*$")
SETEXT = re.compile(r"^ {0,3}(?:=+|-+)[ \t]*$")
NOT_PARAGRAPH = re.compile(r"^(?: {4}|\t| {0,3}(?:[-+*>|<]|\d+[.)]|#{1,6}(?:\s|$)))")


def headings(page: Path, follow_includes: bool = True) -> list[str]:
    """The heading texts of a Markdown page (ATX ``## …`` and setext ``…\\n---``, outside code blocks). A page
    that includes another (MyST's ``{include}``) has that page's headings too on the docs site, which
    ``follow_includes`` asks for; on GitHub the include is a code block and adds none."""
    lines = page.read_text(encoding="utf-8").splitlines()
    includes = {b.start: b.info.split()[1] for b in fences(lines)
                if re.match(r"\{include\}\s+\S", b.info) and follow_includes}
    text, out = _outside_code(lines), []
    for i, line in enumerate(text):
        if i in includes:
            out += headings((page.parent / includes[i]).resolve(), follow_includes)
        elif m := ATX.match(line):
            out.append((m.group(1) or "").strip())
        elif SETEXT.match(line) and i and text[i - 1].strip() and not NOT_PARAGRAPH.match(text[i - 1]) \
                and not SETEXT.match(text[i - 1]):
            first = i - 1
            while first and text[first - 1].strip() and not NOT_PARAGRAPH.match(text[first - 1]):
                first -= 1
            out.append(" ".join(t.strip() for t in text[first:i]))
    return out


def anchors(page: Path) -> set[str]:
    """The anchors GitHub gives a page: each heading's slug, a repeated one numbered ``-1``, ``-2``, … in
    order (as github-slugger does), and the ``id``/``name`` of its HTML elements."""
    seen: dict[str, int] = {}
    for heading in headings(page, follow_includes=False):
        base = candidate = slug(heading)
        while candidate in seen:
            seen[base] += 1
            candidate = f"{base}-{seen[base]}"
        seen[candidate] = 0
    html_ids = re.findall(r"""<[a-z][^>]*?\b(?:id|name)\s*=\s*["']([^"']+)["']""", prose(page.read_text("utf-8")))
    return set(seen) | set(html_ids)


def fence_problems(page: Path, root: Path = REPO) -> list[str]:
    """Each code fence of a page that is never closed (GitHub then shows the rest of the page as code), and
    each section heading a code block swallowed: a ``## …`` line standing alone (blank lines around it) in a
    block that is not Markdown, where a missing fence above turned the page's next fence into a close."""
    lines, bad = page.read_text(encoding="utf-8").splitlines(), []
    for b in fences(lines):
        if b.end is None:
            bad.append(f"{page.relative_to(root)}:{b.start + 1}: {b.fence}{b.info} is never closed (a closing fence "
                       f"is {len(b.fence)} or more {'backticks' if b.fence[0] == '`' else 'tildes'} alone on a line)")
        elif b.info.split()[:1] not in (["md"], ["markdown"], ["myst"]):
            bad += [f"{page.relative_to(root)}:{i + 1}: the heading {lines[i].strip()!r} is code, inside the block "
                    f"{b.fence}{b.info} of line {b.start + 1} (a fence is missing or misplaced)"
                    for i in range(b.start + 1, b.end) if re.match(r" {0,3}#{2,6} \S", lines[i])
                    and not lines[i - 1].strip() and (i + 1 == b.end or not lines[i + 1].strip())]
    return bad


INLINE_LINK = re.compile(r"\]\(\s*(<[^>\n]*>|[^\s)]+)")  # [text](target "title"), ![alt](target)
LINK_DEFINITION = re.compile(r"^ {0,3}\[[^\]\n]+\]:[ \t]*(<[^>\n]*>|\S+)", re.M)  # [label]: target
HTML_LINK = re.compile(r"""<(?:a|img|source)\b[^>]*?\b(?:href|src|srcset)\s*=\s*["']([^"'\s]+)""", re.I)


def links(text: str) -> list[tuple[int, str]]:
    """The link targets of a page's text as GitHub renders it, with their line numbers."""
    text = prose(text)
    found = [m for pattern in (INLINE_LINK, LINK_DEFINITION, HTML_LINK) for m in pattern.finditer(text)]
    return sorted((text.count("\n", 0, m.start()) + 1, m.group(1).strip("<>")) for m in found)


def link_problems(page: Path, root: Path = REPO) -> list[str]:
    """Each relative link of a page that GitHub cannot follow: the file (from the page's folder, or from the
    repository's root for ``/…``) does not exist or lies outside the repository; a ``#anchor`` names no
    heading of a Markdown target (GitHub's slugs; the page itself for a bare ``#anchor``) or, in another
    file, is no ``#L<line>`` of it."""
    bad, root = [], root.resolve()
    for line, link in links(page.read_text(encoding="utf-8")):
        if re.match(r"[a-zA-Z][\w+.-]*:", link):  # https:, mailto:, …
            continue
        target, _, anchor = link.partition("#")
        target, anchor = unquote(target.split("?")[0]), unquote(anchor)
        dest = (page if not target else root / target.lstrip("/") if target.startswith("/")
                else page.parent / target).resolve()
        where = f"{page.relative_to(root)}:{line}: {link}"
        if not dest.is_relative_to(root):
            bad.append(f"{where} (outside the repository)")
        elif not dest.exists():
            bad.append(f"{where} (no such file)")
        elif not anchor:
            continue
        elif dest.suffix == ".md":
            if anchor not in anchors(dest):
                bad.append(f"{where} (no heading of {dest.relative_to(root)} has that anchor)")
        elif not (m := re.fullmatch(r"L(\d+)(?:-L(\d+))?", anchor)) or dest.is_dir() or \
                int(m.group(2) or m.group(1)) > len(dest.read_text(encoding="utf-8").splitlines()):
            bad.append(f"{where} (GitHub has no such anchor in {dest.relative_to(root)})")
    return bad


def test_every_docs_reference_exists():
    missing = []
    for path in SOURCES:
        text = path.read_text(encoding="utf-8")
        for m in re.finditer(r"(?<![\w./])docs/([\w/.-]+\.(?:md|png|json))", text):
            if not (REPO / "docs" / m.group(1)).is_file():
                missing.append(f"{path.relative_to(REPO)}: docs/{m.group(1)}")
    assert not missing, "\n".join(missing)


def test_every_code_fence_is_closed():
    """A fence left open turns the rest of the page into code (headings, links and all), and a missing one
    turns the next fence into a close that swallows a heading; neither GitHub nor the site's build warns."""
    assert len(PAGES) > 40 and REPO / "README.md" in PAGES and REPO / "charts/sapd/README.md" in PAGES
    bad = [problem for page in PAGES for problem in fence_problems(page)]
    assert not bad, "\n".join(bad)


def test_every_link_between_pages_and_its_anchor_resolves():
    """Relative links of every Markdown page (the README, docs/, tests/, the chart's README, …) as GitHub
    follows them: the file exists, and a ``#anchor`` is a heading of it under GitHub's slug rules — read
    from the page as committed, without the docs site's rewrites."""
    bad = [problem for page in PAGES for problem in link_problems(page)]
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


def repository_map(readme: Path) -> list[tuple[str, list[str], list[str]]]:
    """The README's "Repository" section, its code block line by line: the line, the paths its first column
    names (an indented line's below the folder above it) and the paths its description names."""
    text = readme.read_text(encoding="utf-8")
    section = re.search(r"^## Repository[ \t]*\n(.*?)(?=^#{1,2} |\Z)", text, flags=re.M | re.S)
    assert section, f"{readme}: no '## Repository' section"
    lines = section.group(1).splitlines()
    blocks = [b for b in fences(lines) if b.end is not None]
    assert blocks, f"{readme}: the Repository section has no code block"
    out, folder = [], ""
    for line in lines[blocks[0].start + 1:blocks[0].end]:
        if not line.strip():
            continue
        parts = re.split(r"\s{2,}", line.strip(), maxsplit=1)
        names, description = parts[0].split(), parts[1] if len(parts) > 1 else ""
        if line.startswith(" "):
            names = [folder + name for name in names]
        elif names[0].endswith("/"):
            folder = names[0]
        mentioned = [m.group(0) for m in re.finditer(r"(?<![\w./<-])(?:[\w-][\w.-]*/)*[\w-][\w.-]*/?", description)
                     if m.group(0).endswith("/") or re.search(r"\.(?:py|md|ya?ml|json|sh|txt|toml|tpl)$", m.group(0))]
        out.append((line, names, mentioned))
    return out


def repository_map_problems(root: Path = REPO) -> list[str]:
    """Each path the README's repository map names that does not exist (a description's path may be the
    repository's, or one below the entry it describes), and each folder it leaves out: the top-level
    folders (those .gitignore does not ignore) and what sapd/ holds."""
    bad, named = [], set()
    for _, names, mentioned in repository_map(root / "README.md"):
        named |= {name.rstrip("/") for name in names}
        bad += [f"README.md Repository: {name} does not exist" for name in names if not (root / name).exists()]
        bases = [root, *(root / name for name in names if (root / name).is_dir())]
        bad += [f"README.md Repository: {path}, named by the line of {' '.join(names)}, does not exist"
                for path in mentioned if not any((base / path).exists() for base in bases)]
    patterns = gitignore(root)
    top = [p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith(".") and not _ignored(p.name, patterns)]
    package = [f"sapd/{p.name}" for p in (root / "sapd").iterdir()
               if not p.name.startswith((".", "__")) and not _ignored(f"sapd/{p.name}", patterns)
               and (p.is_dir() or p.suffix == ".py")] if (root / "sapd").is_dir() else []
    bad += [f"README.md Repository leaves out {name}{'/' if (root / name).is_dir() else ''}"
            for name in sorted(top + package) if not any(n == name or n.startswith(f"{name}/") for n in named)]
    return bad


def test_every_path_the_readme_repository_section_names_exists():
    """The README's map of the repository names only paths that exist, and every top-level folder and every
    folder and module of the package: a move or a new part of the package shows there."""
    entries = repository_map(REPO / "README.md")
    assert len(entries) > 15 and any("sapd/jobs/" in names for _, names, _ in entries)
    bad = repository_map_problems()
    assert not bad, "\n".join(bad)


# planted pages: each check finds its kind of defect (and passes what GitHub renders correctly)

def _page(root: Path, name: str, text: str) -> Path:
    page = root / name
    page.parent.mkdir(parents=True, exist_ok=True)
    page.write_text(text, encoding="utf-8")
    return page


@pytest.mark.parametrize(("text", "bad_at"), [
    ("# A\n\n```bash\nmake demo\n\n## B\n", [3]),  # never closed: B renders as code
    ("````md\n```bash\nx\n```\n", [1]),  # a shorter fence is content, not a close
    ("~~~\nx\n```\n", [1]),  # the other character does not close
    ("```\nx\n```bash\n", [1]),  # a fence with an info string does not close
    ("1. step\n\n   ```bash\n   make demo\n\n2. next\n", [3]),  # a list item's indented fence
    ("> ```\n> quoted\n", [1]),
    # environments.md's defect: the fence after the command is missing, so the next one closes the block
    ("```bash\nsapd evaluate\n\n## What an evaluation does\n\n```\n\nText.\n", [4]),
    ("```bash\nok  # ## not a heading\n# a comment\n```\n\n~~~~\n```\nstill code\n~~~~~\n\n"
     "```md\n## Markdown shown as code\n```\n\n```` ```x````\n", []),  # closed; an inline code span
], ids=["never-closed", "shorter-fence", "other-character", "info-string", "indented", "blockquote",
        "heading-swallowed", "all-closed"])
def test_an_unclosed_fence_is_caught(tmp_path, text, bad_at):
    page = _page(tmp_path, "page.md", text)
    assert [int(p.split(":")[1]) for p in fence_problems(page, tmp_path)] == bad_at


def test_a_heading_in_a_code_block_is_no_heading_and_a_setext_one_is(tmp_path):
    page = _page(tmp_path, "page.md", "# A\n\n```bash\nx\n\n## B\n\n```\n\n## C ##\n\nD\n---\n\n- E\n---\n")
    assert headings(page) == ["A", "C", "D"]


def test_github_slugs_and_repeated_headings(tmp_path):
    page = _page(tmp_path, "page.md", "# Setup\n\n## Setup\n\n## Setup\n\n## Setup-1\n\n## `sapd run` (π, étape 2)\n\n"
                                      "## Q&A: *why* 100%?\n\n<a id=\"here\"></a>\n\n```{include} other.md\n```\n")
    _page(tmp_path, "other.md", "# Only on the site\n")
    assert anchors(page) == {"setup", "setup-1", "setup-2", "setup-1-1", "sapd-run-π-étape-2", "qa-why-100",
                             "here"}
    assert headings(page)[-1] == "Only on the site"  # the docs site includes it; GitHub shows a code block


def test_a_broken_link_or_anchor_is_caught(tmp_path):
    (tmp_path / "sapd").mkdir()
    _page(tmp_path, "docs/guide.md", "# Guide\n\n## Same name\n\n## Same name\n\n## Ünïcode *and* `code`\n")
    _page(tmp_path, "sapd/x.py", "a = 1\nb = 2\n")
    page = _page(tmp_path, "docs/page.md", "\n".join([
        "# Page",
        "[ok](guide.md) [ok](guide.md#same-name-1) [ok](guide.md#ünïcode-and-code) [ok](#page) [ok](../sapd/)",
        "[ok](/docs/guide.md#guide) [ok](../sapd/x.py#L2) [ok](https://example.com/x.md) `[code](gone.md)`",
        "```md", "[in a code block](gone.md)", "```",
        "[moved](../sapd/study/powered.py)",  # 7: the file is gone
        "[anchor](guide.md#same-name-2)",  # 8: only two of that name
        "[upper case](guide.md#Guide)",  # 9: slugs are lower case
        "[here](#nothing) and [out](../../elsewhere.md)",  # 10
        "[line](../sapd/x.py#L3) [ref][r] ![img](fig.png)",  # 11
        "",
        "[r]: guide.md#gone",  # 13
        '<a href="nowhere.md">html</a>',  # 14
    ]) + "\n")
    bad = link_problems(page, tmp_path)
    assert [b.split(": ", 1)[0].split(":")[1] for b in bad] == \
        ["7", "8", "9", "10", "10", "11", "11", "13", "14"], "\n".join(bad)
    assert "(no such file)" in bad[0] and "no heading of docs/guide.md" in bad[1] and "outside" in bad[4]


def test_a_repository_map_naming_a_missing_path_or_leaving_a_folder_out_is_caught(tmp_path):
    for folder in ("sapd/jobs", "sapd/engines", "docs", "runs"):
        (tmp_path / folder).mkdir(parents=True)
    (tmp_path / "sapd/cli.py").write_text("")
    (tmp_path / "sapd/__init__.py").write_text("")
    (tmp_path / ".gitignore").write_text("/runs/\n")
    _page(tmp_path, "README.md", "# X\n\n## Repository\n\n```\n"
                                 "sapd/                 the package (docs/DESIGN.md \"Layers\")\n"
                                 "  jobs/               the doors\n"
                                 "  cli.py gone.py      the command line, local/S3\n"
                                 "jobs/                 the stage doors (python -m sapd.jobs.<stage>)\n"
                                 "docs/                 the site; guides/ holds the guides\n"
                                 "```\n\n## Development\n\n```\nnot/ part of the map\n```\n")
    assert repository_map_problems(tmp_path) == [
        "README.md Repository: docs/DESIGN.md, named by the line of sapd/, does not exist",
        "README.md Repository: sapd/gone.py does not exist",
        "README.md Repository: jobs/ does not exist",
        "README.md Repository: guides/, named by the line of docs/, does not exist",
        "README.md Repository leaves out sapd/engines/",
    ]


TESTS_MAP = REPO / "tests" / "MAP.md"  # the map of every test file, folder by folder (tests/README.md links it)


def map_sections() -> dict[str, str]:
    """tests/MAP.md's map: the text of each `### tests/<folder> ↔ …` section, by folder (to the next heading or
    the page's end)."""
    text = TESTS_MAP.read_text(encoding="utf-8")
    return {m.group(1): m.group(2)
            for m in re.finditer(r"^### tests/(\w+) .*?\n(.*?)(?=^##|\Z)", text, flags=re.M | re.S)}


@pytest.mark.parametrize("test_file", sorted(str(p.relative_to(REPO)) for p in REPO.glob("tests/**/test_*.py")))
def test_the_tests_map_names_every_test_file_in_its_folders_section(test_file):
    parts = Path(test_file).parts
    assert len(parts) == 3, f"{test_file}: a test file sits in the folder of its part of the package (tests/<folder>/)"
    sections = map_sections()
    assert parts[1] in sections, f"tests/MAP.md has no section for tests/{parts[1]}: add one"
    assert f"| `{parts[2]}` |" in sections[parts[1]], \
        f"tests/MAP.md does not map {test_file}: add its row to the tests/{parts[1]} section"


def test_every_test_folder_is_a_package_and_has_a_section():
    """tests/ is a package (`from tests.conftest import free_port`); each folder of tests is one too, so
    pytest names its modules tests.<folder>.test_x (vllm/ excepted: its own conftest, in .venv-vllm/)."""
    folders = {p.parent.name for p in REPO.glob("tests/*/test_*.py")}
    assert len(folders) >= 15 and set(map_sections()) == folders, sorted(set(map_sections()) ^ folders)
    missing = [f for f in sorted(folders - {"vllm"}) if not (REPO / "tests" / f / "__init__.py").is_file()]
    assert not missing, f"tests/<folder>/__init__.py missing for {missing}"


# One home per figure: a measured figure lives on one results page (docs/results/), with its date, build and
# command; the README quotes one only beside a link to that page, and says it as the page does.

RESULTS = "docs/results"
# A measured figure: a decimal, a signed number, or a number with a unit (%, ×, seconds, minutes, hours); not
# part of a name or a size (Qwen2.5, bf16, 0.5B, A.5), a date, a version or a plain count ("4 seeds"). A range
# (0.54–0.67) gives both ends.
FIGURE = re.compile(r"(?<![\w.,^/·:#-])(?P<sign>[−+-]?)(?P<num>\d+(?:,\d{3})*(?:\.\d+)?)"
                    r"(?:\s?(?P<unit>%|×|min\b|minutes?\b|s\b|seconds?\b|h\b|hours?\b))?(?![\w.]\d|\w)")


VERSIONED = re.compile(r"\b(?:Python|Kubernetes|kubectl|Helm|TextWorld|torch|transformers|vLLM|DeepSpeed|Debian)"
                       r"\s+$")  # "Python 3.11" is a version, not a figure


def figures(text: str) -> list[tuple[str, tuple[bool, str, str]]]:
    """The measured figures of a text, each as written and as a key that ignores how it is written: (negative,
    the number without thousands separators, its unit: ``%`` and ``×`` kept, a time unit or none as "")."""
    out = []
    for m in FIGURE.finditer(text):
        unit = m["unit"] if m["unit"] in ("%", "×") else ""
        if VERSIONED.search(text[max(0, m.start() - 20):m.start()]) and not m["unit"]:
            continue
        if "." in m["num"] or m["unit"] or m["sign"]:
            out.append((m.group(0).strip(), (m["sign"] in "−-" and m["sign"] != "", m["num"].replace(",", ""), unit)))
    return out


def prose_blocks(text: str) -> list[str]:
    """A page's prose (code blanked) in blocks as a reader takes them: each paragraph, each list item (with its
    continuation lines), each heading; a table belongs to the block before it (its caption)."""
    blocks: list[list[str]] = []
    open_block = False
    for line in prose(text).splitlines():
        s = line.strip()
        if not s:
            open_block = False
        elif s.startswith("|") and blocks:
            blocks[-1].append(s)
            open_block = True
        elif not open_block or re.match(r"(?:[-*+]|\d+[.)])\s", s) or blocks[-1][-1].startswith("|") \
                or re.match(r"#{1,6}\s", s):
            blocks.append([s])
            open_block = not re.match(r"#{1,6}\s", s)
        else:
            blocks[-1].append(s)
    return [" ".join(b) for b in blocks]


def quoted_figure_problems(page: Path, root: Path = REPO, must_link: bool = False) -> list[str]:
    """Each figure a block of the page quotes that is not on the results page(s) the block links (the same
    number, sign and %/× unit; a time's number alone, since tables give the unit in their header); with
    ``must_link``, also each block that quotes a figure and links no results page."""
    bad, results = [], (root / RESULTS).resolve()
    for block in prose_blocks(page.read_text(encoding="utf-8")):
        linked = []
        for m in INLINE_LINK.finditer(block):
            target = unquote(m.group(1).strip("<>").split("#")[0])
            dest = (page.parent / target).resolve() if target and not re.match(r"[a-zA-Z][\w+.-]*:", target) else None
            if dest and dest.suffix == ".md" and dest.parent == results and dest.is_file():
                linked.append(dest)
        quoted = figures(re.sub(r"\]\([^)]*\)", "]", block))  # link targets (anchors, paths) are no figures
        where = f"{page.relative_to(root)}: “{block[:70]}…”"
        if not linked:
            if must_link and quoted:
                bad.append(f"{where} quotes {', '.join(f for f, _ in quoted)} without linking the results page "
                           f"({RESULTS}/…) it comes from")
            continue
        on_pages = set()
        for dest in linked:
            for _, (neg, num, unit) in figures(dest.read_text(encoding="utf-8")):
                on_pages |= {(neg, num, unit), (neg, num, "*")}
        names = ", ".join(str(d.relative_to(root.resolve())) for d in dict.fromkeys(linked))
        bad += [f"{where} quotes {shown}, which {names} does not give" for shown, (neg, num, unit) in quoted
                if (neg, num, unit or "*") not in on_pages]
    return bad


def test_each_figure_the_readme_quotes_is_on_the_results_page_it_links():
    """The README quotes a measured figure only beside a link to its results page, and as that page gives it:
    a figure changed on one page and not on the other, or quoted with no page to check it against, fails."""
    assert len(prose_blocks((REPO / "README.md").read_text(encoding="utf-8"))) > 30
    bad = quoted_figure_problems(REPO / "README.md", must_link=True)
    assert not bad, "\n".join(bad)


def test_a_figure_quoted_unlike_its_results_page_is_caught(tmp_path):
    _page(tmp_path, "docs/results/X.md", "# X\n\n| arm | s |\n|---|---|\n| a | 61.9 |\n\nSAPD 5.8× faster; AUC 0.896 "
                                         "[0.687, 1.000]; −2.7 points [-7.4, +1.4]; 14.9 % of the weights; 47 min 16 s.\n")
    readme = _page(tmp_path, "README.md", "\n".join([
        "# R", "",
        "- SAPD 5.8× faster, AUC 0.896 [0.687, 1.000] ([x](docs/results/X.md)).",  # all on the page
        "- Rounds took 61.9 s, −2.7 points [−7.4, +1.4], 14.9 % moved, 47 minutes ([x](docs/results/X.md#x)).",
        "- AUC 0.869 and 5.9× ([x](docs/results/X.md)); `0.123` in code, Qwen2.5-0.5B and Python 3.11 are no "
        "figures.",  # 2 wrong
        "- +2.7 points and 14.9× ([x](docs/results/X.md))",  # a sign and a unit differ
        "", "The demo ([x](docs/results/X.md)):", "", "| model | success |", "|---|---|", "| SFT | 0.13 |",  # a table
        "", "Takes 8.5 minutes on 2 cores and 4 seeds.",  # a figure with no results page
        "", "See [the guide](docs/guide.md): 3.3 s.",  # links only another page
    ]) + "\n")
    _page(tmp_path, "docs/guide.md", "# G\n")
    bad = quoted_figure_problems(readme, tmp_path, must_link=True)
    assert [b.split("quotes ")[1].split(",")[0].split(" without")[0] for b in bad] == \
        ["0.869", "5.9×", "+2.7", "14.9×", "0.13", "8.5 minutes", "3.3 s"], "\n".join(bad)
    assert quoted_figure_problems(readme, tmp_path)[-1].startswith("README.md: “The demo")  # without must_link


# How-to and reference pages say what is true now: no issue numbers (the tracker's history is no guide) and no
# dated measurements (a measurement lives on its results page, with its date, build and command; a guide
# quotes it with a link).

HOW_TO_AND_REFERENCE = ["docs/getting-started/**/*.md", "docs/guides/**/*.md", "docs/kubernetes/**/*.md",
                        "docs/reference/**/*.md", "docs/design/**/*.md", "docs/DESIGN.md", "docs/FAULTS.md",
                        "docs/CLUSTER_FAULTS.md", "docs/SAPD.md", "docs/FORMATS.md", "docs/ALFWORLD.md"]
ISSUE_NUMBER = re.compile(r"\b(?:issues?|PRs?|pull requests?)\s+#?\d+|(?<![\w&/#])#\d+\b", re.I)
MONTH = r"(?:Jan|Feb|Mar|Apr|May|Jun|Jul|Aug|Sep|Oct|Nov|Dec)[a-z]*\.?"
DATE = re.compile(rf"\b20\d\d-[01]\d(?:-[0-3]\d)?\b|\b{MONTH}\s+\d{{1,2}},?\s+20\d\d\b|\b\d{{1,2}}\s+{MONTH}\s+20\d\d\b"
                  r"|\bmeasured\b[^\n]{0,40}?\bon\s+20\d\d\b", re.I)


def history_problems(page: Path, root: Path = REPO) -> list[str]:
    """Each issue number (`issue 36`, `issues 14`, `#37`) and each date (2026-12-04, Dec 4 2026, "measured …
    on 2026…") in a page's prose — its code (log lines, commands) and link targets aside."""
    text = re.sub(r"\]\([^)]*\)", "]", prose(page.read_text(encoding="utf-8")))
    bad = []
    for pattern, what in ((ISSUE_NUMBER, "an issue number: say what is true now, without the tracker's history"),
                          (DATE, "a date: a dated measurement belongs on its results page (docs/results/), "
                                 "which the page links")):
        bad += [f"{page.relative_to(root)}:{text.count(chr(10), 0, m.start()) + 1}: {m.group(0)!r} is {what}"
                for m in pattern.finditer(text)]
    return bad


def test_how_to_and_reference_pages_carry_no_issue_numbers_and_no_dated_measurements():
    pages = sorted({p for pattern in HOW_TO_AND_REFERENCE for p in REPO.glob(pattern)})
    assert len(pages) > 25 and REPO / "docs/guides/scaling.md" in pages
    bad = [problem for page in pages for problem in history_problems(page)]
    assert not bad, "\n".join(bad)


def test_an_issue_number_or_a_dated_measurement_is_caught(tmp_path):
    page = _page(tmp_path, "docs/guides/g.md", "\n".join([
        "# Guide",
        "The defaults follow the audit (issue #37) and issue 36's study; see #12.",  # 2: three
        "Measured here on 2026-12-06: 385 s. On a GPU (2026-12-04) it took 170 s.",  # 3: two dates
        "A run of December 6, 2026 and one of 6 Dec 2026.",  # 4: two
        "Log lines look like `retrying until 2026-05-06T13:58:40Z`, [a link](../x.md#issue-36-2026-12-04).",  # none
        "```", "measured on 2026-12-06, issue 36", "```",  # code: none
        "Kubernetes 1.33, 20 GPUs, step 3 of #-less text, ZeRO-3, H200, a 2-core machine.",  # none
        "We measured 0.22× the time on 2026 hardware.",  # 10: "measured … on 2026"
    ]) + "\n")
    assert [p.split(": ", 1)[0].split(":")[1] for p in history_problems(page, tmp_path)] == \
        ["2", "2", "2", "3", "3", "4", "4", "10"], "\n".join(history_problems(page, tmp_path))


# Pages a newcomer finishes: no hand-written page is longer than 20,000 characters. Generated references, the
# results pages and the benches' own output are lookups, not reads; tests/README.md's generated durations
# table is not counted.

PAGE_LIMIT = 20_000
GENERATED_OR_RESULTS = ["docs/reference/cli.md", "docs/reference/config.md", "docs/reference/metrics.md",
                        "docs/reference/exit-codes.md", "charts/sapd/README.md", "docs/results/*.md",
                        "bench/results/*.md"]
GENERATED_BLOCK = re.compile(r"<!-- durations: generated.*?<!-- /durations -->", re.S)


def long_pages(pages: list[Path], root: Path = REPO) -> list[str]:
    """Each hand-written page (the generated and results pages aside) over PAGE_LIMIT characters, a generated
    block inside it not counted."""
    bad = []
    for page in pages:
        rel = page.relative_to(root).as_posix()
        if any(fnmatch.fnmatch(rel, pattern) for pattern in GENERATED_OR_RESULTS):
            continue
        size = len(GENERATED_BLOCK.sub("", page.read_text(encoding="utf-8")))
        if size > PAGE_LIMIT:
            bad.append(f"{rel}: {size:,} characters (at most {PAGE_LIMIT:,}): split it by question, each part a page "
                       "linked from where the reader comes")
    return bad


def test_no_hand_written_page_is_longer_than_a_newcomer_reads():
    assert REPO / "docs/DESIGN.md" in PAGES and REPO / "tests/MAP.md" in PAGES
    bad = long_pages(PAGES)
    assert not bad, "\n".join(bad)


def test_a_long_page_is_caught_and_the_generated_ones_are_not(tmp_path):
    long = "x" * (PAGE_LIMIT + 1)
    pages = [_page(tmp_path, name, text) for name, text in [
        ("docs/DESIGN.md", long), ("docs/guides/ok.md", "x" * PAGE_LIMIT), ("docs/results/STUDY.md", long),
        ("docs/reference/cli.md", long), ("charts/sapd/README.md", long), ("docs/reference/run-root.md", long),
        ("tests/README.md", "# Tests\n" + "x" * 100 + "\n<!-- durations: generated by `make test-durations` -->\n"
                            + long + "\n<!-- /durations -->\n")]]
    assert [b.split(":")[0] for b in long_pages(pages, tmp_path)] == ["docs/DESIGN.md", "docs/reference/run-root.md"]
