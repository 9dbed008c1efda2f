"""Job: the build-prefixes stage of a run — the config's recorded trajectories cut into decision
prefixes under ``RUN_ROOT/prefixes``, then the initial student saved as checkpoint 0 (what every later
stage starts from). Re-running over a committed build does nothing. (To cut a file into prefixes
outside a run, use ``sapd build-prefixes``.)

Local:   python -m jobs.build_prefixes --config run.yaml
Cluster: helm install sapd-alfworld charts/sapd -f charts/sapd/values/alfworld.yaml
         (buildPrefixes: one pod, `--config /etc/sapd/config.yaml` from the chart's ConfigMap)
Exit codes (sapd.entry): 0 done (or already committed), 2 bad config or input, 75 storage unreachable.
"""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

from sapd.entry import add_config_flags, config_from_args, log_line, run_main
from sapd.metrics import Metrics
from sapd.run.check import preflight
from sapd.stages import build_prefixes


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m jobs.build_prefixes", description=__doc__.splitlines()[0])
    add_config_flags(p)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))

    def body() -> None:
        cfg = config_from_args(args)
        if not args.no_check:
            preflight(cfg, "build-prefixes", log=log_line)
        metrics = Metrics.from_env("build_prefixes")
        build_prefixes.run(cfg, log=log_line, show_progress=not args.no_progress, metrics=metrics)
        metrics.mark_success()
        metrics.push()

    return run_main("build_prefixes", body)


if __name__ == "__main__":
    sys.exit(main())
