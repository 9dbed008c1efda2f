"""Job: student sampling + teacher scoring of one round, one worker's share (the teacher-scores stage).

Worker w of W (W = the config's ``workers``) samples G responses per prefix i of round K's batch with
i % W == w from checkpoint K, scores them with the frozen teacher and writes
``rounds/K/scored/part-w.parquet`` plus its done-marker; the worker that finds every part written
commits the round (``_MANIFEST.json``). First, when the run validates checkpoint K (``validation.*``), the
worker measures checkpoint K's distance to the teacher on its share of the held-out prefixes
(``validation/K/part-w.json``), merged into ``validation/K.json`` by the committing worker before the
manifest; ``--round R`` (R = ``train.rounds``) has no round to score and only validates the last checkpoint.
``--commit`` commits a round whose parts are all written (the pipeline driver does the same when a Job
completes). A rerun of a finished worker does nothing, so a retried pod redoes only uncommitted work.

With ``--rounds N`` the worker stays up for rounds K … K+N-1 (0: to the run's last round): it keeps the
teacher and the student sampler loaded, takes each round's checkpoint in place, and starts round k once
checkpoint k (``train.overlap: one_step``: k-1) is committed (sapd.run.job: the wait, its bound, the
skipping of committed rounds).

Local:   python -m sapd.jobs.teacher_scores --config run.yaml --round 0 --worker 0
         python -m sapd.jobs.teacher_scores --config run.yaml --round 0 --worker 1   (commits round 0 when last)
         python -m sapd.jobs.teacher_scores --config run.yaml --round 0 --rounds 0 --worker 0   (stays up)
Cluster: helm install sapd-alfworld charts/sapd -f charts/sapd/values/alfworld.yaml
         (teacherScores: an Indexed Job; each pod takes its worker index from JOB_COMPLETION_INDEX; with
         pipeline.stageJobs persistent, the default, one Job serves every round)
Backend: sampling.backend (hf: transformers on CPU or one GPU; vllm: the gpu image).
Exit codes (sapd.entry): 0 done (or already done), 2 bad config or missing input, 75 storage unreachable
(or, with --rounds, a round's input still uncommitted after --input-timeout-seconds).
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Sequence

from sapd.run.job import add_rounds_flags, job_parser, rounds_from_args, stage_main
from sapd.stages import teacher_scores
from sapd.stages.context import Step


def build_parser() -> argparse.ArgumentParser:
    p = job_parser("python -m sapd.jobs.teacher_scores", __doc__)
    add_rounds_flags(p)
    p.add_argument("--worker", type=int, default=None,
                   help="this worker's index (default: $JOB_COMPLETION_INDEX, set by an Indexed Job)")
    p.add_argument("--commit", action="store_true",
                   help="commit round K once every worker is done, instead of computing a part")
    return p


def worker_index(flag: int | None) -> int:
    """The worker index from ``--worker`` or the Indexed Job's JOB_COMPLETION_INDEX."""
    if flag is not None:
        return flag
    env = os.environ.get("JOB_COMPLETION_INDEX")
    if env is None:
        raise ValueError("no worker index: pass --worker or set JOB_COMPLETION_INDEX")
    return int(env)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return stage_main("teacher_scores", teacher_scores, args, Step("teacher-scores", args.round),
                      options=lambda cfg: {"teacher-scores": teacher_scores.Options(
                          worker=None if args.commit else worker_index(args.worker), commit_only=args.commit)},
                      checks="teacher-scores-commit" if args.commit else None,
                      rounds=None if args.commit else rounds_from_args(args))


if __name__ == "__main__":
    sys.exit(main())
