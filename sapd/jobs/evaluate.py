"""Job: evaluate the newest (or a given) committed checkpoint of a run on a fixed, seeded environment
panel; the run root, the benchmark, the device and the generation length come from the run config.
A checkpoint already evaluated is skipped, so the CronJob only pays for new checkpoints; with no
committed checkpoint yet it exits 0 with "nothing to evaluate".

Local:   python -m sapd.jobs.evaluate --config runs/textworld/config.yaml
         python -m sapd.jobs.evaluate --config run.yaml --checkpoint 3 --games-per-family 8
Cluster: the chart's `evaluate` Job and CronJob run `python -m sapd.jobs.evaluate --config /etc/sapd/config.yaml`
         plus the panel flags of its values (search QA: --rows, --retriever-url; ALFWorld: --data-dir;
         WebShop: --webshop-url).
Exit codes (sapd.entry): 0 evaluated (or already evaluated, or nothing to evaluate), 2 bad config or
input, 75 storage or an environment server unreachable.
"""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

from sapd.config import RunConfig
from sapd.envs.panels import PanelSpec
from sapd.panel_flags import add_panel_flags, env_timeout, panel_fields
from sapd.run.job import job_parser, stage_main
from sapd.stages import evaluate
from sapd.stages.context import Step


def _checkpoint(value: str) -> int | None:
    if value == "latest":
        return None
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a checkpoint index or 'latest', not {value!r}") from None


def build_parser() -> argparse.ArgumentParser:
    p = job_parser("python -m sapd.jobs.evaluate", __doc__)
    p.add_argument("--checkpoint", type=_checkpoint, default=None, metavar="K|latest",
                   help="checkpoint index, or 'latest' (default)")
    add_panel_flags(p, benchmark_default=None)
    p.add_argument("--horizon", type=int, default=None, help="max steps per episode (default: the benchmark's)")
    p.add_argument("--device", default=None, help="torch device (default: the config's model.device)")
    p.add_argument("--max-new-tokens", type=int, default=None,
                   help="response budget (default: the config's sampling.max_new_tokens)")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="0 = greedy (default); > 0 samples, seeded by --seed (SDAR validates at 0.4)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)

    def options(cfg: RunConfig) -> dict[str, evaluate.Options]:
        panel = PanelSpec(**panel_fields(args, benchmark=args.benchmark or cfg.data.benchmark))
        return {"evaluate": evaluate.Options(panel, args.horizon, env_timeout(args), args.device, args.max_new_tokens,
                                             args.temperature)}

    return stage_main("evaluate", evaluate, args, Step("evaluate", args.checkpoint), options=options)


if __name__ == "__main__":
    sys.exit(main())
