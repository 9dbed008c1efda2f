"""Job: student sampling + teacher scoring of one round, one worker's share (the teacher-scores stage).

Worker w of W (W = the config's ``workers``) samples G responses per prefix i of round K's batch with
i % W == w from checkpoint K, scores them with the frozen teacher and writes
``rounds/K/scored/part-w.parquet`` plus its done-marker; the worker that finds every part written
commits the round (``_MANIFEST.json``). ``--commit`` commits a round whose parts are all written (the
pipeline driver does the same when a Job completes). A rerun of a finished worker does nothing, so a
retried pod redoes only uncommitted work.

Local:   python -m jobs.teacher_scores --config run.yaml --round 0 --worker 0
         python -m jobs.teacher_scores --config run.yaml --round 0 --worker 1   (commits round 0 when last)
Cluster: helm install sapd-alfworld charts/sapd -f charts/sapd/values/alfworld.yaml
         (teacherScores: an Indexed Job; each pod takes its worker index from JOB_COMPLETION_INDEX)
Backend: sampling.backend (hf: transformers on CPU or one GPU; vllm: the gpu image).
Exit codes (sapd.entry): 0 done (or already done), 2 bad config or missing input, 75 storage unreachable.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Sequence

from sapd.data.scored import commit_round
from sapd.entry import add_config_flags, config_from_args, log_line, run_main
from sapd.metrics import Metrics
from sapd.run.check import preflight
from sapd.stages import teacher_scores


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m jobs.teacher_scores", description=__doc__.splitlines()[0])
    add_config_flags(p)
    p.add_argument("--round", type=int, required=True, metavar="K", help="the round to score")
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
    args = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))

    def body() -> None:
        cfg = config_from_args(args)
        if not args.no_check:
            preflight(cfg, "teacher-scores-commit" if args.commit else "teacher-scores", log=log_line)
        k = args.round
        metrics = Metrics.from_env("teacher_scores")
        if args.commit:
            manifest = commit_round(cfg, k)
            log_line(f"round {k}: committed {manifest['rows']} scored groups from {manifest['workers']} workers")
            metrics.round.set(k)
        else:
            w = worker_index(args.worker)
            result = teacher_scores.run(cfg, k, w, log=log_line, show_progress=not args.no_progress, metrics=metrics)
            log_line(f"round {k} worker {w}/{cfg.workers}: {'already done' if result.skipped else 'done'}, "
                     f"{result.rows} groups")
        metrics.mark_success()
        metrics.push()

    return run_main("teacher_scores", body)


if __name__ == "__main__":
    sys.exit(main())
