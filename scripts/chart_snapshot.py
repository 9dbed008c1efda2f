"""The chart's rendered manifests, held fixed: a digest of every document Helm renders (by kind and name,
whichever template file it comes from), for the chart's own values and each overlay in ``values/``, in
both modes (pipeline and manual), and of NOTES.txt, kept in
``tests/assets/chart-snapshot.json``. A restructure of the templates (helpers moved, keys stated once) must
leave every digest as it was; a fix that changes what is rendered updates the file on purpose.

    python scripts/chart_snapshot.py --check        # exit 1 naming each rendered document that changed
    python scripts/chart_snapshot.py --diff HEAD    # the unified diff against the chart at a git revision
    python scripts/chart_snapshot.py --write        # record the current rendering (a change meant)

``tests/cluster/test_chart_snapshot.py`` runs the check."""
from __future__ import annotations

import argparse
import difflib
import hashlib
import json
import subprocess
import sys
import tarfile
import tempfile
from io import BytesIO
from pathlib import Path

import helm_python as helm
import yaml

REPO = Path(__file__).resolve().parents[1]
CHART = REPO / "charts" / "sapd"
SNAPSHOT = REPO / "tests" / "assets" / "chart-snapshot.json"
MODES = ("pipeline", "manual")
RELEASE, NAMESPACE = "sapd-test", "sapd"


def value_sets(chart: Path) -> dict[str, dict]:
    """The chart's defaults ("base") and each overlay under ``values/``, by name."""
    sets: dict[str, dict] = {"base": {}}
    for overlay in sorted((chart / "values").glob("*.yaml")):
        sets[overlay.stem] = helm.values_from_yaml(overlay.read_text(encoding="utf-8"))
    return sets


def render_all(chart: Path) -> dict[str, str]:
    """``"<values>-<mode>/<kind>/<name>"`` → the document Helm renders (a fresh install, revision 1), as
    sorted-key YAML: comments, key order and blank lines in the templates do not count, every value
    does (a ConfigMap's stage templates are strings, compared whole)."""
    out: dict[str, str] = {}
    with helm.Chart.load(chart) as loaded:
        for name, values in value_sets(chart).items():
            for mode in MODES:
                files = loaded.render(values={**values, "mode": mode}, name=RELEASE, namespace=NAMESPACE,
                                      revision=1, is_install=True, is_upgrade=False)
                for path, text in files.items():
                    if path.endswith("NOTES.txt"):
                        out[f"{name}-{mode}/NOTES.txt"] = text
                        continue
                    for doc in yaml.safe_load_all(text):
                        if doc:
                            key = f"{name}-{mode}/{doc['kind']}/{doc['metadata']['name']}"
                            if key in out:
                                raise ValueError(f"{path}: a second {key}")
                            out[key] = yaml.safe_dump(doc, sort_keys=True, width=120)
    return dict(sorted(out.items()))


def digests(rendered: dict[str, str]) -> dict[str, str]:
    return {key: hashlib.sha256(text.encode()).hexdigest()[:16] for key, text in rendered.items()}


def changes(recorded: dict[str, str], current: dict[str, str]) -> list[str]:
    """One line per rendered document that appeared, disappeared or changed."""
    lines = [f"changed: {k}" for k in sorted(recorded.keys() & current.keys()) if recorded[k] != current[k]]
    lines += [f"new: {k}" for k in sorted(current.keys() - recorded.keys())]
    lines += [f"gone: {k}" for k in sorted(recorded.keys() - current.keys())]
    return lines


def chart_at(revision: str, into: Path) -> Path:
    """The chart as committed at a git revision, unpacked under ``into``."""
    archive = subprocess.run(["git", "-C", str(REPO), "archive", revision, "charts/sapd"], check=True,
                             capture_output=True).stdout
    with tarfile.open(fileobj=BytesIO(archive)) as tar:
        tar.extractall(into, filter="data")
    return into / "charts" / "sapd"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    action = parser.add_mutually_exclusive_group(required=True)
    action.add_argument("--check", action="store_true", help="compare with tests/assets/chart-snapshot.json")
    action.add_argument("--write", action="store_true", help="record the current rendering")
    action.add_argument("--diff", metavar="REVISION", help="diff against the chart at a git revision")
    args = parser.parse_args(argv)
    current = render_all(CHART)
    if args.write:
        SNAPSHOT.write_text(json.dumps(digests(current), indent=1) + "\n", encoding="utf-8")
        print(f"recorded {len(current)} rendered documents in {SNAPSHOT.relative_to(REPO)}")
        return 0
    if args.check:
        found = changes(json.loads(SNAPSHOT.read_text(encoding="utf-8")), digests(current))
        for line in found:
            print(line)
        if found:
            print(f"{len(found)} rendered documents differ from {SNAPSHOT.relative_to(REPO)}: "
                  "`python scripts/chart_snapshot.py --diff HEAD` shows how; `--write` records a change meant")
        return 1 if found else 0
    with tempfile.TemporaryDirectory() as tmp:
        before = render_all(chart_at(args.diff, Path(tmp)))
    for key in sorted(before.keys() | current.keys()):
        old, new = before.get(key, ""), current.get(key, "")
        if old != new:
            sys.stdout.writelines(difflib.unified_diff(old.splitlines(True), new.splitlines(True),
                                                       f"{args.diff}:{key}", f"worktree:{key}"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
