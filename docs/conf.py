"""Sphinx configuration of sapd's docs site: Markdown pages (MyST) and API pages from the docstrings.

    make docs      # = sphinx-build -n -W --keep-going -b html docs docs/_build/html

Built strictly: every warning is an error, and ``-n`` makes every cross-reference in a docstring
(``:func:``, ``:class:``, …) and every link between pages resolve, so a renamed function or a moved page
fails the build (``make test`` builds it too).
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # the checkout's sapd, installed or not

import sapd  # noqa: E402

project = "sapd"
author = "sapd maintainers"
copyright = "sapd maintainers"  # noqa: A001 - Sphinx's name
release = version = sapd.__version__

extensions = ["myst_parser", "sphinx.ext.autodoc", "sphinx.ext.autosummary", "sphinx.ext.viewcode"]
source_suffix = {".md": "markdown", ".rst": "restructuredtext"}
root_doc = "index"
exclude_patterns = ["_build", "**/_build"]

# Markdown: GitHub renders the same files, so only extensions GitHub shows sensibly
myst_enable_extensions = ["colon_fence", "deflist"]
myst_heading_anchors = 4  # `page.md#a-heading` links resolve (and are checked)

# API pages: one per module, generated at build time under reference/api/_generated (not committed)
autosummary_generate = True
autosummary_imported_members = False
# every public member, whatever a module's __all__ says (its page lists them all, as autosummary does)
autodoc_default_options = {"members": True, "undoc-members": True, "show-inheritance": True,
                           "ignore-module-all": True}
autodoc_member_order = "bysource"
autodoc_typehints = "signature"
autodoc_mock_imports = ["vllm", "deepspeed"]  # GPU-only packages; their modules import them lazily or guarded

# Third-party types in signatures and docstrings have no inventory here (no network at build time), and
# type aliases (DType) and pieces of type expressions in signatures are no documented objects: every
# other name, sapd's own in a docstring's role above all, must resolve.
nitpick_ignore_regex = [
    ("py:.*", r"(torch|transformers|tokenizers|pyarrow|numpy|np|boto3|botocore|yaml|prometheus_client|kubernetes|"
              r"urllib3|argparse|pathlib|typing|collections|concurrent|subprocess|threading|multiprocessing|"
              r"tqdm|matplotlib|jinja2|vllm|deepspeed|textworld|scienceworld|alfworld|bm25s|datetime|io|"
              r"http|socketserver|json|logging|dataclasses|enum|abc|contextlib|os|types|re)(\..*)?"),
    ("py:.*", r"(Any|Callable|Iterator|Iterable|Sequence|Mapping|Literal|TypeVar|Protocol|Path|Tensor|Generator|"
              r"int|float|str|bool|bytes|None|dict|list|tuple|set|frozenset|object|type|BaseException|Exception|"
              r"ValueError|RuntimeError|OSError|TextIO|BinaryIO|IO|Popen|Namespace|ArgumentParser|Action|"
              r"LLM|PreTrainedModel|PreTrainedTokenizerBase|Module|DType|CollectorRegistry|pa\..*|random\..*)"),
    ("py:class", r".*[\[\]'|,].*"),  # pieces of a type expression (dict[str, Any]) the parser splits
]


def _runbook_as_text(app, what, name, obj, options, lines):  # noqa: ANN001 - Sphinx's event signature
    """The stage doors' module docstrings are runbooks in plain text (the commands to type, aligned by
    hand): shown as they are written, below their first line."""
    if what == "module" and name.startswith("sapd.jobs.") and len(lines) > 1:
        lines[:] = [lines[0], "", "::", ""] + ["    " + line for line in lines[1:]] + [""]


def _place_new_pages(app, docname, source):  # noqa: ANN001 - Sphinx's event signature
    """Pages no toctree of the home page names yet (a page another branch added) are listed under "More
    pages" rather than failing the build as orphans: move each into its section of index.md."""
    if docname != root_doc:
        return
    import fnmatch
    import re
    entries = [line.strip() for block in re.findall(r"```\{toctree\}(.*?)```", source[0], flags=re.S)
               for line in block.splitlines() if line.strip() and not line.strip().startswith(":")]
    placed = {doc for doc in app.env.found_docs for entry in entries if fnmatch.fnmatch(doc, entry)}
    new = sorted(doc for doc in app.env.found_docs
                 if doc not in placed and doc != root_doc and not doc.startswith("reference/api/"))
    if new:
        source[0] += "\n```{toctree}\n:caption: More pages\n:maxdepth: 1\n\n" + "\n".join(new) + "\n```\n"


def _reread_home_when_pages_come_or_go(app, env, added, changed, removed):  # noqa: ANN001, ANN201
    """An incremental build re-reads the home page when a page was added or removed (its "More pages")."""
    return [root_doc] if added or removed else []


def setup(app):  # noqa: ANN001, ANN201
    app.connect("autodoc-process-docstring", _runbook_as_text)
    app.connect("source-read", _place_new_pages)
    app.connect("env-get-outdated", _reread_home_when_pages_come_or_go)

html_theme = "furo"
html_title = f"sapd {release}"
html_static_path: list[str] = []
