"""Print what ``sapd[EXTRAS]`` requires, one requirement a line, read from pyproject.toml (no build of sapd).

    python scripts/sapd_requirements.py test,docs

The test environments install these first and then sapd alone, editable and ``--no-deps``, under a lock
(`make setup`, `docker/install.sh --editable`): they are built side by side, and every editable install of
the checkout writes its sapd.egg-info. Needs Python ≥ 3.11 (tomllib)."""

from __future__ import annotations

import sys
import tomllib
from pathlib import Path

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"


def requirements(extras: list[str], pyproject: Path = PYPROJECT) -> list[str]:
    with pyproject.open("rb") as f:
        project = tomllib.load(f)["project"]
    unknown = sorted(set(extras) - set(project["optional-dependencies"]))
    if unknown:
        raise SystemExit(f"{pyproject}: no extra {unknown} in [project.optional-dependencies]")
    return [*project["dependencies"], *(r for e in extras for r in project["optional-dependencies"][e])]


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit(__doc__)
    print("\n".join(requirements([e for e in sys.argv[1].split(",") if e])))
