"""Job: the build-prefixes stage of a run — the config's recorded trajectories cut into decision
prefixes under ``RUN_ROOT/prefixes``, then the initial student saved as checkpoint 0 (what every later
stage starts from). Re-running over a committed build does nothing. (To cut a file into prefixes
outside a run, use ``sapd build-prefixes``.)

Local:   python -m sapd.jobs.build_prefixes --config run.yaml
Cluster: helm install sapd-alfworld charts/sapd -f charts/sapd/values/alfworld.yaml
         (buildPrefixes: one pod, `--config /etc/sapd/config.yaml` from the chart's ConfigMap)
Exit codes (sapd.entry): 0 done (or already committed), 2 bad config or input, 75 storage unreachable.
"""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

from sapd.run.job import job_parser, stage_main
from sapd.stages import build_prefixes
from sapd.stages.context import Step


def build_parser() -> argparse.ArgumentParser:
    return job_parser("python -m sapd.jobs.build_prefixes", __doc__)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return stage_main("build_prefixes", build_prefixes, args, Step("build-prefixes"))


if __name__ == "__main__":
    sys.exit(main())
