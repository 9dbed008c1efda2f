"""Job: cut recorded trajectories into decision prefixes.

Local:   python -m jobs.build_prefixes --input data/alfworld.json --format eto --benchmark alfworld \
             --tokenizer models/student --out runs/alfworld/prefixes
Cluster: the same flags from the chart's job config (issue: Kubernetes job suite).
Exit codes: 0 done (or already committed), 2 bad input or storage error.
"""

from __future__ import annotations

import sys
from typing import Sequence

from sapd.cli import main as sapd_main


def main(argv: Sequence[str] | None = None) -> int:
    return sapd_main(["build-prefixes", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
