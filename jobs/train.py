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
import sys
from typing import Sequence

from sapd.run.job import job_parser, stage_main
from sapd.stages import train
from sapd.stages.context import Step


def build_parser() -> argparse.ArgumentParser:
    p = job_parser("python -m jobs.train", __doc__)
    p.add_argument("--round", type=int, required=True, metavar="K", help="the round to train")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return stage_main("train", train, args, Step("train", args.round))


if __name__ == "__main__":
    sys.exit(main())
