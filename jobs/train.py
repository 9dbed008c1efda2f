"""Job: train one round (checkpoint K + round K's scored shards → checkpoint K+1), on every process
torchrun starts; the engine is the config's ``train.engine`` (``deepspeed`` for more than one process).
It is ``sapd train-round``: the run root's config.yaml is written if absent and must otherwise equal
the resolved config; a committed checkpoint K+1 makes the job a no-op.

Local:   python -m jobs.train --config run.yaml --round 0
         torchrun --nproc-per-node 2 -m jobs.train --config run.yaml --round 0   (train.engine: deepspeed)
Cluster: helm install sapd-alfworld charts/sapd -f charts/sapd/values/alfworld.yaml
         (train: an Indexed Job of torchrun pods; node rank = completion index, rendezvous at pod 0
         through the headless Service)
Exit codes: 0 checkpoint K+1 committed, 2 bad config, missing input or storage error.
"""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

from sapd.cli import main as sapd_main


def main(argv: Sequence[str] | None = None) -> int:
    """``--config A.yaml [B.yaml …] --round K [--run-root URI] [--no-progress]`` → ``sapd train-round``."""
    p = argparse.ArgumentParser(prog="python -m jobs.train", description=__doc__.splitlines()[0])
    p.add_argument("--config", nargs="+", required=True, help="YAML overlays, applied in order over the defaults")
    args, rest = p.parse_known_args(list(sys.argv[1:] if argv is None else argv))
    return sapd_main(["train-round", *args.config, *rest])


if __name__ == "__main__":
    sys.exit(main())
