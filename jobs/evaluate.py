"""Job: evaluate the newest (or a given) committed checkpoint of a run on a fixed, seeded environment
panel; the run root, the benchmark, the device and the generation length come from the run config.
A checkpoint already evaluated is skipped, so the CronJob only pays for new checkpoints; with no
committed checkpoint yet it exits 0 with "nothing to evaluate".

Local:   python -m jobs.evaluate --config runs/textworld/config.yaml
         python -m jobs.evaluate --config run.yaml --checkpoint 3 --games-per-family 8
Cluster: the chart's `evaluate` Job and CronJob run `python -m jobs.evaluate --config /etc/sapd/config.yaml`
         plus the panel flags of its values (search QA: --rows, --retriever-url; ALFWorld: --data-dir;
         WebShop: --webshop-url).
Exit codes (sapd.entry): 0 evaluated (or already evaluated, or nothing to evaluate), 2 bad config or
input, 75 storage or an environment server unreachable.
"""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

from sapd.entry import (
    add_config_flags,
    add_panel_flags,
    config_from_args,
    env_timeout,
    log_line,
    panel_from_args,
    run_main,
)
from sapd.metrics import Metrics
from sapd.run.check import preflight
from sapd.stages import evaluate


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m jobs.evaluate", description=__doc__.splitlines()[0])
    add_config_flags(p)
    p.add_argument("--checkpoint", default="latest", help="checkpoint index, or 'latest' (default)")
    add_panel_flags(p, benchmark_default=None)
    p.add_argument("--horizon", type=int, default=None, help="max steps per episode (default: the benchmark's)")
    p.add_argument("--device", default=None, help="torch device (default: the config's model.device)")
    p.add_argument("--max-new-tokens", type=int, default=None,
                   help="response budget (default: the config's sampling.max_new_tokens)")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="0 = greedy (default); > 0 samples, seeded by --seed (SDAR validates at 0.4)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))

    def body() -> None:
        cfg = config_from_args(args)
        if not args.no_check:
            preflight(cfg, "evaluate", log=log_line)
        metrics = Metrics.from_env("evaluate")
        panel = panel_from_args(args, benchmark=args.benchmark or cfg.data.benchmark)
        evaluate.run(cfg, args.checkpoint, panel, horizon=args.horizon, env_timeout_s=env_timeout(args),
                     device=args.device, max_new_tokens=args.max_new_tokens, log=log_line,
                     show_progress=not args.no_progress, metrics=metrics, temperature=args.temperature)
        metrics.mark_success()
        metrics.push()

    return run_main("evaluate", body)


if __name__ == "__main__":
    sys.exit(main())
