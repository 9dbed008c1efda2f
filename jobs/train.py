"""Job: train one round (checkpoint K + round K's scored shards → checkpoint K+1), on every process
torchrun starts; the engine is the config's ``train.engine`` (``deepspeed`` for more than one process).
The run root's config.yaml is written if absent and must otherwise equal the resolved config; a
committed checkpoint K+1 makes the job a no-op. Rank 0 logs, serves ``/metrics`` on
``$SAPD_METRICS_PORT`` while it trains and pushes its figures at the end.

Local:   python -m jobs.train --config run.yaml --round 0
         torchrun --nproc-per-node 2 -m jobs.train --config run.yaml --round 0   (train.engine: deepspeed)
Cluster: helm install sapd-alfworld charts/sapd -f charts/sapd/values/alfworld.yaml
         (train: an Indexed Job of torchrun pods; node rank = completion index, rendezvous at pod 0
         through the headless Service)
Exit codes (sapd.entry): 0 checkpoint K+1 committed, 2 bad config or missing input, 75 storage unreachable.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Sequence

from sapd.entry import add_config_flags, config_from_args, log_line, run_main
from sapd.run.check import preflight
from sapd.stages import train


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m jobs.train", description=__doc__.splitlines()[0])
    add_config_flags(p)
    p.add_argument("--round", type=int, required=True, metavar="K", help="the round to train")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))

    def body() -> None:
        cfg = config_from_args(args)
        if not args.no_check:
            preflight(cfg, "train", log=log_line)
        port = os.environ.get("SAPD_METRICS_PORT")
        train.run(cfg, args.round, log=log_line, show_progress=not args.no_progress,
                  metrics_port=int(port) if port else None)

    return run_main("train", body)


if __name__ == "__main__":
    sys.exit(main())
