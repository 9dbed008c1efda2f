"""Job: evaluate the newest (or a given) committed checkpoint on a fixed, seeded environment panel.

Local:   python -m jobs.evaluate --config runs/textworld/config.yaml            (run root + benchmark from it)
         python -m jobs.evaluate --run runs/textworld --benchmark textworld --checkpoint 3
Cluster: the chart's `evaluate` Job and CronJob run `python -m jobs.evaluate --config /etc/sapd/config.yaml`;
         a checkpoint already evaluated is skipped, so the CronJob only pays for new checkpoints.
Exit codes: 0 evaluated (or already evaluated), 2 bad input, storage error or no checkpoint yet.
"""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

from sapd.cli import main as sapd_main


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="jobs.evaluate", add_help=False)
    parser.add_argument("--config", action="append", default=[])
    known, rest = parser.parse_known_args(argv)
    if known.config:
        from sapd.config import ConfigError, load_config
        try:
            cfg = load_config(*known.config)
        except (ConfigError, OSError) as e:
            print(f"jobs.evaluate: error: {e}", file=sys.stderr)
            return 2
        if "--run" not in rest:
            rest = ["--run", cfg.run_root, *rest]
        if "--benchmark" not in rest:
            rest = ["--benchmark", cfg.data.benchmark, *rest]
    return sapd_main(["evaluate", *rest])


if __name__ == "__main__":
    sys.exit(main())
