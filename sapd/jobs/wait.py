"""Job helper: wait until a stage's input is committed in the run root — for a script, or an init
container of your own. (The chart's `mode: manual` does not use it: its gate Jobs, `python -m
sapd.jobs.pipeline --stage …`, wait in a small pod of their own and only then create the stage Job, so no GPU
pod waits.) What "committed" means is the run's plan (sapd/run/plan.py), the one both executors follow.

  --for prefixes        the prefix build and checkpoint 0 (what teacher-scores of round 0 needs)
  --for checkpoint:K    checkpoint K (teacher-scores of round K; the evaluation of checkpoint K)
  --for scored:K        round K's scored manifest (train of round K); for the sft objective, which
                        scores nothing, checkpoint K instead

Local:   python -m sapd.jobs.wait --config run.yaml --for checkpoint:1 --poll-seconds 5
Cluster: an init container of your own, e.g. of a job that consumes a run's checkpoint K.
Exit codes (sapd.entry): 0 the input is committed, 2 bad config or --for, 75 storage unreachable or
the wait ran out (--timeout-seconds): transient, the pod is retried.
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from typing import Sequence

from sapd.config import RunConfig
from sapd.entry import EXIT_UNAVAILABLE, config_from_args, log_line, run_main
from sapd.method.objective import objective_of
from sapd.run.plan import Step, missing
from sapd.storage import StorageError, StorageUnavailable


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m sapd.jobs.wait", description=__doc__.splitlines()[0])
    p.add_argument("--config", nargs="+", required=True, help="YAML overlays, applied in order over the defaults")
    p.add_argument("--for", dest="target", required=True, help="prefixes | checkpoint:K | scored:K")
    p.add_argument("--poll-seconds", type=float, default=30.0, help="seconds between two checks (default 30)")
    p.add_argument("--log-every-seconds", type=float, default=600.0, help="seconds between 'still waiting' lines")
    p.add_argument("--timeout-seconds", type=float, default=0.0, help="give up after this long (default: never)")
    p.add_argument("--run-root", default=None, help="override run_root (a folder or s3:// URI)")
    return p


def step_for(target: str, cfg: RunConfig) -> Step:
    """The plan step whose output ``target`` names.

    >>> from sapd.config import RunConfig
    >>> str(step_for("checkpoint:3", RunConfig())), str(step_for("scored:2", RunConfig()))
    ('train-r2', 'teacher-scores-r2')
    """
    m = re.fullmatch(r"(prefixes)|(checkpoint|scored):(\d+)", target)
    if not m:
        raise ValueError(f"--for {target!r}: expected prefixes, checkpoint:K or scored:K")
    if m.group(1):
        return Step("build-prefixes")
    kind, k = m.group(2), int(m.group(3))
    if kind == "scored" and objective_of(cfg.loss_cfg).data == "recorded":
        kind = "checkpoint"  # sft trains on the recorded actions: nothing is scored, round K needs checkpoint K
    if kind == "checkpoint":
        return Step("build-prefixes") if k == 0 else Step("train", k - 1)
    return Step("teacher-scores", k)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))

    def body() -> int:
        cfg = config_from_args(args)
        step = step_for(args.target, cfg)
        what = {"build-prefixes": "the prefix build and checkpoint 0", "train": f"checkpoint {(step.round or 0) + 1}",
                "teacher-scores": f"round {step.round}'s scored manifest"}[step.stage]
        if args.target == "checkpoint:0":
            what = "checkpoint 0"  # committed by the build-prefixes stage, with the prefixes
        start = last = time.monotonic()
        log_line(f"wait: waiting for {what} in {cfg.run_root}")
        errors = 0
        while True:
            try:
                why = missing(cfg, step)
                if why is None:
                    log_line(f"wait: {what} is committed ({time.monotonic() - start:.0f}s)")
                    return 0
                errors = 0
            except StorageError as e:  # a storage hiccup is retried a few times before the pod gives up
                errors += 1
                if errors >= 5:
                    raise StorageUnavailable(str(e)) from e
            now = time.monotonic()
            if args.timeout_seconds and now - start > args.timeout_seconds:
                log_line(f"wait: error: {why} after {now - start:.0f}s")
                return EXIT_UNAVAILABLE
            if now - last >= args.log_every_seconds:
                log_line(f"wait: still waiting ({now - start:.0f}s): {why}")
                last = now
            time.sleep(args.poll_seconds)

    return run_main("wait", body)


if __name__ == "__main__":
    sys.exit(main())
