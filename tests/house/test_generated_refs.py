"""The reference pages that are generated from the code (scripts/gen_refs.py, `make refs`) are current, and
hold what their sources hold; the one hand-written run-root listing (docs/reference/run-root.md) matches
sapd.layout and the files a real run writes.

A failure here after a change to sapd/config.py, the CLI, the metrics, the exit codes or the chart's
values means: run `make refs` and commit the pages it rewrites."""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from sapd import config, entry, layout
from sapd.data import scored
from sapd.method.objective import VARIANTS, LossConfig
from scripts import gen_refs

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("page", sorted(gen_refs.PAGES))
def test_each_generated_page_is_current(page):
    committed = (REPO / page).read_text(encoding="utf-8")
    assert committed == gen_refs.render(page), f"{page} is stale: run `make refs` and commit it"


def test_make_refs_check_is_the_command_and_catches_a_stale_page(tmp_path, monkeypatch, capsys):
    # the command the docs name, as a contributor runs it (one page here: every page is checked above)
    proc = subprocess.run([sys.executable, "scripts/gen_refs.py", "--check", "charts/sapd/README.md"], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "refs:" in (REPO / "Makefile").read_text() and "scripts/gen_refs.py" in (REPO / "Makefile").read_text()
    # in a copy with one page edited by hand: --check names it and writes nothing; a plain run rewrites it
    for page in gen_refs.PAGES:
        (tmp_path / page).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(REPO / page, tmp_path / page)
    shutil.copytree(REPO / "charts" / "sapd", tmp_path / "charts" / "sapd", dirs_exist_ok=True)
    (tmp_path / "docs/reference/metrics.md").write_text("hand-edited\n")
    monkeypatch.setattr(gen_refs, "REPO", tmp_path)
    pages = ["docs/reference/metrics.md", "docs/reference/exit-codes.md", "charts/sapd/README.md"]
    assert gen_refs.main(["--check", *pages]) == 1
    assert "stale (run `make refs`): docs/reference/metrics.md\n" == capsys.readouterr().err
    assert (tmp_path / "docs/reference/metrics.md").read_text() == "hand-edited\n"
    assert gen_refs.main(pages) == 0 and gen_refs.main(["--check", *pages]) == 0
    assert "sapd_loss" in (tmp_path / "docs/reference/metrics.md").read_text()


def test_the_config_reference_has_every_field_with_its_comment():
    text = (REPO / "docs/reference/config.md").read_text(encoding="utf-8")
    for block in dataclasses.fields(config.RunConfig):
        if not block.init or block.metadata.get("derived"):  # derived from other keys: no row
            continue
        default = block.default_factory() if block.default is dataclasses.MISSING else block.default  # type: ignore[misc]
        keys = ([f"{block.name}.{f.name}" for f in dataclasses.fields(default)]
                if dataclasses.is_dataclass(default) else [block.name])
        for key in keys:
            assert f"| `{key}` |" in text, key
    for f in dataclasses.fields(LossConfig):
        assert f"| `loss.{f.name}` |" in text, f.name
    assert "| `train.lr` | `float` | `1e-06` | paper: 1e-6 |" in text  # name, type, default, trailing comment
    assert "ReOPD: draw each round's prefixes" in text  # a comment above its field
    for name in VARIANTS:  # every variant, not a hand-kept subset
        assert f"| `{name}` |" in text, name


def test_the_cli_reference_has_every_command_and_flag():
    from sapd.cli import build_parser
    text = (REPO / "docs/reference/cli.md").read_text(encoding="utf-8")
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    for name, parser in sub.choices.items():
        assert f"### `sapd {name}`" in text, name
        for action in parser._actions:
            for flag in action.option_strings:
                if flag not in ("-h", "--help"):
                    assert f"`{flag}" in text or f", {flag}" in text, (name, flag)
    for door in ("sapd.jobs.build_prefixes", "sapd.jobs.teacher_scores", "sapd.jobs.train", "sapd.jobs.evaluate", "sapd.jobs.pipeline",
                 "sapd.jobs.check", "sapd.jobs.wait", "sapd.jobs.fetch"):
        assert f"### `python -m {door}`" in text, door


def test_the_metrics_and_exit_code_references_hold_every_one():
    from prometheus_client.metrics import MetricWrapperBase

    from sapd.metrics import Metrics
    metrics = (REPO / "docs/reference/metrics.md").read_text(encoding="utf-8")
    for m in vars(Metrics(job="t")).values():
        if isinstance(m, MetricWrapperBase):
            assert f"`{m._name}" in metrics, m._name
    codes = (REPO / "docs/reference/exit-codes.md").read_text(encoding="utf-8")
    for name in dir(entry):
        if name.startswith("EXIT_"):
            assert f"| {getattr(entry, name)} | `{name}` |" in codes, name


def test_an_exit_code_the_docstring_does_not_explain_is_refused(monkeypatch):
    monkeypatch.setattr(entry, "EXIT_NEW", 4, raising=False)
    with pytest.raises(ValueError, match=r"explains codes \[0, 1, 2, 3, 75\], the constants are \[0, 1, 2, 3, 4, 75\]"):
        gen_refs.exit_codes()


def test_the_chart_readme_has_a_row_per_documented_value():
    values = (REPO / "charts/sapd/values.yaml").read_text(encoding="utf-8")
    readme = (REPO / "charts/sapd/README.md").read_text(encoding="utf-8")
    documented = gen_refs.chart_values(REPO / "charts/sapd/values.yaml")
    assert len(documented) == len(re.findall(r"^ *# -- ", values, flags=re.M))
    for v in documented:  # a top-level block is a heading over its own table, every other key a row
        assert (f"### `{v.key}`" if "." not in v.key and v.has_children else f"| `{v.key}` |") in readme, v.key
    assert "| `train.parallelism` | int |" in readme and "kubectl create secret generic sapd-s3-credentials" in readme


def test_an_undocumented_value_is_refused(tmp_path):
    values = tmp_path / "values.yaml"
    values.write_text("# -- Documented.\na: 1\nb:\n  # -- Documented too.\n  c: [x]\n  d: 2\n")
    with pytest.raises(ValueError, match=r"values.yaml:6: b.d"):
        gen_refs.chart_values(values)
    values.write_text("# -- A block.\nb:\n  # -- Its key,\n  #    on two lines.\n  c: {k: v}\n")
    (block, key) = gen_refs.chart_values(values)
    assert (block.key, block.has_children, key.key, key.type, key.default, key.description) == \
        ("b", True, "b.c", "object", {"k": "v"}, "Its key, on two lines.")


# ---------------------------------------------------------------------------------------------------
# the run-root listing


def _listing() -> list[str]:
    text = (REPO / "docs/reference/run-root.md").read_text(encoding="utf-8")
    block = re.search(r"```\n(.*?)```", text, flags=re.S)
    assert block, "docs/reference/run-root.md: no listing"
    return [line.split()[0] for line in block.group(1).splitlines() if line.strip()]


def _regex(pattern: str) -> re.Pattern[str]:
    rx = re.escape(pattern)
    for token, part in (("NNNNNN", r"\d{6}"), ("NNNNN", r"\d{5}"), ("WWWWW", r"\d{5}"),
                        (re.escape("<benchmark>"), r"[\w@.]+"), (re.escape("<group>"), r"[\w.-]+"),
                        (re.escape("<step>"), r"[\w.-]+"), (re.escape("*"), r".+")):
        rx = rx.replace(token, part)
    return re.compile(rx + r"\Z")


def _listed(relative: str) -> str | None:
    """The listed pattern a file matches."""
    return next((pattern for pattern in _listing() if _regex(pattern).match(relative)), None)


def _listed_folder(relative: str) -> bool:
    """Whether something listed lives under folder ``relative``."""
    n = len(relative.split("/"))
    return any(len(p.split("/")) > n and _regex("/".join(p.split("/")[:n])).match(relative) for p in _listing())


def test_every_path_sapd_layout_builds_is_listed():
    root = "s3://bucket/run"
    paths = {}
    for name, fn in inspect.getmembers(layout, inspect.isfunction):
        sig = inspect.signature(fn)
        params = list(sig.parameters)
        if (fn.__module__ != layout.__name__ or sig.return_annotation not in (str, "str") or params[:1] != ["root"]
                or not set(params) <= {"root", "k"}):
            continue
        uri = fn(root, 7) if "k" in params else fn(root)
        if isinstance(uri, str):
            paths[name] = uri.removeprefix(root + "/")
    assert {"config_uri", "prefixes_dir", "scored_dir", "checkpoint_state_dir", "checkpoint_marker", "round_log_uri",
            "evals_dir"} <= set(paths), sorted(paths)
    paths["scored.worker_done_marker"] = scored.worker_done_marker(layout.scored_dir(root, 7), 3).removeprefix(
        root + "/")
    for name, relative in paths.items():
        assert _listed(relative) or _listed_folder(relative), (name, relative)
    assert _listed(paths["checkpoint_marker"]) == "checkpoints/NNNNNN/state/_COMMITTED"
    assert _listed(paths["round_log_uri"]) == "logs/round-NNNNNN.jsonl"
    assert _listed(paths["scored.worker_done_marker"]) == "rounds/NNNNNN/scored/_worker-WWWWW.json"
    pushed = layout.pushed_metrics_uri(root, "teacher_scores-1", "teacher-scores-r7").removeprefix(root + "/")
    assert _listed(pushed) == "metrics/<group>/<step>.prom"
    assert not _listed_folder("nothing/000007")


@pytest.mark.slow
def test_a_real_run_writes_only_listed_files_and_every_commit_marker_is_listed(tmp_path):
    from sapd.config import config_from_dict
    from sapd.run.local import run_pipeline
    from sapd.run.report import write_report
    from tests.pipeline_util import make_models, tiny_config
    root = tmp_path / "run"
    cfg = config_from_dict(tiny_config(str(root), *make_models(tmp_path / "models"), train={"rounds": 1}))
    run_pipeline(cfg, log=lambda s: None, show_progress=False)
    write_report(str(root))
    files = sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())
    unlisted = [f for f in files if _listed(f) is None]
    assert not unlisted, f"files a run writes that docs/reference/run-root.md does not list: {unlisted}"
    seen = {_listed(f) for f in files}
    for marker in ("prefixes/_MANIFEST.json", "rounds/NNNNNN/scored/_MANIFEST.json",
                   "checkpoints/NNNNNN/state/_COMMITTED", "checkpoints/NNNNNN/state/trainer.pt",
                   "checkpoints/NNNNNN/state/optimizer/*", "logs/round-NNNNNN.jsonl", "report/summary.json"):
        assert marker in seen, marker


def test_every_test_file_has_a_row_in_the_durations_table(monkeypatch, capsys):
    """tests/README.md's durations table is generated (`make test-durations`: scripts/test_durations.py) and has a
    row for every test file; a new file without one is named, with the command that adds it."""
    from scripts import test_durations
    assert "test-durations:" in (REPO / "Makefile").read_text()
    assert test_durations.main(["--check"]) == 0, capsys.readouterr().err
    files = test_durations.test_files()
    assert "tests/run/test_check.py" in files and all(f.startswith("tests/") for f in files)
    monkeypatch.setattr(test_durations, "test_files", lambda: [*files, "tests/run/test_new.py"])
    assert test_durations.main(["--check"]) == 1
    assert capsys.readouterr().err == ("tests/run/test_new.py: no row in tests/README.md's durations table "
                                       "(run `make test-durations`)\n")


def test_the_files_go_out_longest_first_by_the_durations_table():
    """The suite's files are handed to the test processes longest first (tests/conftest.py ``longest_first``, by
    the table's wall seconds; ``--no-loadscope-reorder`` in the Makefile keeps that order): a file's own tests keep
    their order, a file without a row goes first, the table's rows are read as numbers, and two cluster journeys
    are kept apart where the simulated run allows it."""
    from scripts.test_durations import recorded_walls
    from tests.conftest import file_order, longest_first
    walls = recorded_walls()
    assert walls["tests/cluster/test_journeys.py"] > walls["tests/run/test_check.py"] > 0
    assert "--no-loadscope-reorder" in (REPO / "Makefile").read_text()

    @dataclasses.dataclass
    class Item:
        nodeid: str
    items = [Item("tests/a.py::one"), Item("tests/b.py::one"), Item("tests/a.py::two"), Item("tests/new.py::x"),
             Item("tests/b.py::two")]
    order = [i.nodeid for i in longest_first(items, {"tests/a.py": 5.0, "tests/b.py": 50.0})]
    assert order == ["tests/new.py::x", "tests/b.py::one", "tests/b.py::two", "tests/a.py::one", "tests/a.py::two"]
    # two cluster journeys are not handed out to run side by side while another file can go first
    walls = {"tests/cluster/test_journeys_x.py": 100, "tests/cluster/test_journeys_y.py": 90, "tests/z.py": 80,
             "tests/w.py": 30}
    assert file_order(walls, sorted(walls)) == ["tests/cluster/test_journeys_x.py", "tests/z.py", "tests/w.py",
                                                "tests/cluster/test_journeys_y.py"]


def test_the_durations_table_is_made_from_the_recorded_files(tmp_path, monkeypatch):
    """What tests/conftest.py records per test process (wall and CPU seconds per file) merges into one row per
    file, longest first by CPU, with the totals above the table; a second run replaces the table in place."""
    from scripts import test_durations
    readme = tmp_path / "README.md"
    readme.write_text("# Tests\n\nintro\n")
    monkeypatch.setattr(test_durations, "README", readme)
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "gw0-1.json").write_text('{"tests/a/test_x.py": {"wall": 2.0, "cpu": 3.0, "tests": 2}}')
    (tmp_path / "d" / "gw1-2.json").write_text('{"tests/a/test_x.py": {"wall": 1.0, "cpu": 1.0, "tests": 1}, '
                                               '"tests/b/test_y.py": {"wall": 9.0, "cpu": 8.0, "tests": 4}}')
    assert test_durations.main([str(tmp_path / "d")]) == 0
    text = readme.read_text()
    rows = [line for line in text.splitlines() if line.startswith("| `")]
    assert rows == ["| `tests/b/test_y.py` | 4 | 9.0 | 8.0 |", "| `tests/a/test_x.py` | 3 | 3.0 | 4.0 |"]
    assert "7 tests, 12 s of wall time summed over the files and 12 CPU seconds" in text
    assert test_durations.main([str(tmp_path / "d")]) == 0 and readme.read_text() == text  # replaced, not appended


def test_the_suite_names_ports_outside_the_ephemeral_range_one_slice_per_process(monkeypatch):
    """tests/conftest.py ``free_port``: a port a test names before anything listens there is below the kernel's
    ephemeral range (where gloo's ranks listen and outgoing connections take their source ports, so a released
    bind(0) port could be another process's by the time a pod binds it), free when handed out, never handed out
    twice by one process, and the two xdist processes draw from disjoint slices."""
    import socket

    from tests import conftest
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    seen: dict[str, list[int]] = {}
    for worker in ("gw0", "gw1"):
        monkeypatch.setenv("PYTEST_XDIST_WORKER", worker)
        monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "2")
        monkeypatch.setattr(conftest, "_port_cursor", [])
        ports = seen[worker] = [conftest.free_port() for _ in range(50)]
        assert len(set(ports)) == 50 and all(10000 <= p < low for p in ports), ports
        lo, hi = conftest._port_slice()
        assert all(lo <= p < hi for p in ports)
    assert not set(seen["gw0"]) & set(seen["gw1"])
    assert max(seen["gw0"]) < 12500 <= min(seen["gw1"])
    with socket.socket() as held:  # a port something listens on is passed over: a slice of it alone has none
        held.bind(("127.0.0.1", 0))
        held.listen()
        taken = held.getsockname()[1]
        monkeypatch.setattr(conftest, "_port_slice", lambda: (taken, taken + 1))
        monkeypatch.setattr(conftest, "_port_cursor", [])
        with pytest.raises(RuntimeError, match=f"no free port in {taken}"):
            conftest.free_port()


def test_a_failed_multi_rank_run_says_why_last():
    """tests/pipeline_util.py ``ranks_failed``: torchrun's own stack is left out (its Root Cause block stays), a
    rank's traceback stays, and the lines saying why (a C++ terminate, the exit signal) come again at the end."""
    import subprocess

    from tests.pipeline_util import ranks_failed
    rank = ("step 3\nTraceback (most recent call last):\n  File \"train.py\", line 9\nValueError: bad shape\n"
            "terminate called after throwing an instance of 'gloo::IoException'\n  what():  Connection reset\n")
    agent = ("Traceback (most recent call last):\n  File \"run.py\", line 1028, in main\n    raise ChildFailedError(\n"
             "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: \n=====\nsapd.jobs.train FAILED\n"
             "Root Cause (first observed failure):\n  exitcode  : -6 (pid: 7)  (SIGABRT)\n"
             "  traceback : Signal 6 (SIGABRT) received by PID 7\n=====\n")
    text = ranks_failed(subprocess.CompletedProcess([], 1, "x" * 50, rank + agent))
    assert "ValueError: bad shape" in text and "run.py" not in text and "raise ChildFailedError" not in text
    body, why = text.split("-- why, as the ranks and torchrun said it --\n")
    assert "Root Cause" in body and why.splitlines() == [
        "ValueError: bad shape", "terminate called after throwing an instance of 'gloo::IoException'",
        "what():  Connection reset", "exitcode  : -6 (pid: 7)  (SIGABRT)", "traceback : Signal 6 (SIGABRT) received by PID 7"]
