"""Job: train one round (checkpoint K + round K's scored shards → checkpoint K+1), on every process
torchrun starts; the engine is the config's ``train.engine`` (``deepspeed`` for more than one process).
The run root's config.yaml is written if absent and must otherwise equal the resolved config; a
committed checkpoint K+1 makes the job a no-op. Rank 0 logs, serves ``/metrics`` on
``$SAPD_METRICS_PORT`` while it trains and pushes its figures at the end.

With ``--rounds N`` the trainer stays up for rounds K … K+N-1 (0: to the run's last round): it keeps the
model, the optimizer state and the engine in memory from round to round, starts round k once its scored
manifest is committed, and still commits every checkpoint (a killed trainer restarts from the last one).

Local:   python -m sapd.jobs.train --config run.yaml --round 0
         python -m sapd.jobs.train --config run.yaml --round 0 --rounds 0       (stays up to the last round)
         torchrun --nproc-per-node 2 -m sapd.jobs.train --config run.yaml --round 0   (train.engine: deepspeed)
Cluster: helm install sapd-alfworld charts/sapd -f charts/sapd/values/alfworld.yaml
         (train: an Indexed Job of torchrun pods; node rank = completion index, rendezvous at pod 0
         through the headless Service; with pipeline.stageJobs persistent, the default, one Job for every round)
Exit codes (sapd.entry): 0 checkpoint K+1 committed, 2 bad config or missing input, 75 storage unreachable
(or, with --rounds, a round's input still uncommitted after --input-timeout-seconds).
"""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

from sapd.run.job import add_rounds_flags, job_parser, rounds_from_args, stage_main
from sapd.stages import train
from sapd.stages.context import Step


def build_parser() -> argparse.ArgumentParser:
    p = job_parser("python -m sapd.jobs.train", __doc__)
    add_rounds_flags(p)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return stage_main("train", train, args, Step("train", args.round), rounds=rounds_from_args(args))


if __name__ == "__main__":
    sys.exit(main())
