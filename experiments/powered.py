"""The powered study of issue 15, step by step (sapd.study.powered; docs/results/ANALYSIS_PLAN.md).

    .venv/bin/python -m experiments.powered pilot             # games, pools, models, one timed round
    .venv/bin/python -m experiments.powered gate probe        # gates and the round-0 signal probe
    .venv/bin/python -m experiments.powered regate            # a rebuilt cache with other weights: gate it again
    .venv/bin/python -m experiments.powered smollm2           # the same probe with SmolLM2-135M (~25 min)
    .venv/bin/python -m experiments.powered sweep --max-units 3
    .venv/bin/python -m experiments.powered final             # refused until the plan is committed
    .venv/bin/python -m experiments.powered final --arms sapd,sapd_paper,opd_rule   # these arms first
    .venv/bin/python -m experiments.powered status

Each finished unit is a JSON under experiments/powered/ (commit it); a rerun skips recorded units.
Several processes of `sweep` (or `final`) on one machine split the units: each claims the next unit no
other live process holds, e.g. two processes of one thread each on two cores:

    for i in 1 2; do .venv/bin/python -m experiments.powered sweep --threads 1 & done
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from sapd.study.powered import PoweredStudy, load_powered_config

HERE = Path(__file__).resolve().parent


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m experiments.powered", description=__doc__.splitlines()[0])
    p.add_argument("steps", nargs="+", choices=["pilot", "gate", "regate", "probe", "smollm2", "sweep", "final",
                                                  "status", "report"])
    p.add_argument("--results", default=str(HERE.parent / "docs" / "results"), help="report: where POWERED.md goes")
    p.add_argument("--config", default=str(HERE / "powered.yaml"))
    p.add_argument("--ledger", default=str(HERE / "powered"))
    p.add_argument("--cache", default=".cache/powered")
    p.add_argument("--max-units", type=int, default=None, help="sweep/final: stop after this many new units")
    p.add_argument("--arms", default=None,
                   help="final: comma-separated arms (and 'student', 'teacher' for the reference rows) to run, "
                        "in this order (the order of work only; default: every arm, then the references)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads of this process")
    args = p.parse_args(argv)
    if args.threads:
        import torch
        torch.set_num_threads(args.threads)
    t0 = time.perf_counter()

    def log(line: str) -> None:
        print(f"[{time.perf_counter() - t0:7.0f} s] {line}", flush=True)

    study = PoweredStudy(load_powered_config(args.config), args.ledger, args.cache, log=log,
                         config_path=Path(args.config).resolve().relative_to(HERE.parent)
                         if Path(args.config).resolve().is_relative_to(HERE.parent) else None)
    for step in args.steps:
        log(f"step {step}")
        if step == "pilot":
            res = study.pilot()
            log(f"pilot: SAPD round {res['sapd_round_seconds']:.1f} s, models {res['models_seconds']:.0f} s")
        elif step in ("gate", "regate"):
            res = study.gate(recheck=step == "regate")
            log(f"gate: {json.dumps(res['passed'])}, well-formed at T=1 {res['student_well_formed_T1']:.3f}")
        elif step == "probe":
            res = study.probe()
            log("probe: " + ", ".join(f"{k} {res[k]:.3f}" for k in ("auc_action_sum", "auc_action_mean",
                                                                     "auc_thought_sum", "auc_full_sum", "len_corr")))
        elif step == "smollm2":
            res = study.smollm2_probe()
            log("SmolLM2 probe: " + ", ".join(f"{k} {res[k]:.3f}" for k in ("well_formed", "auc_action_sum",
                                                                             "auc_full_sum", "len_corr")))
        elif step == "sweep":
            log(f"sweep: finished {study.sweep(args.max_units)}")
        elif step == "final":
            arms = args.arms.split(",") if args.arms else None
            log(f"final: finished {study.final(args.max_units, arms=arms)}")
        elif step == "report":
            from sapd.study.powered_report import render_powered
            log(f"report: {render_powered(study, args.results)}")
        elif step == "status":
            print(json.dumps(study.status(), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
