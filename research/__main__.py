"""The research harness's front door: ``python -m research <command>`` from the repository root.

    python -m research study experiments/study.yaml --out study-out --results docs/results   # reproduction study
    python -m research powered pilot                 # the powered study (docs/results/ANALYSIS_PLAN.md), step by step:
    python -m research powered gate probe            #   gates and the round-0 signal probe
    python -m research powered regate                #   a rebuilt cache with other weights: gate it again
    python -m research powered smollm2               #   the same probe with SmolLM2-135M (~25 min)
    python -m research powered sweep --max-units 3
    python -m research powered final                 #   refused until the plan is committed
    python -m research powered final --arms sapd,sapd_paper,opd_rule   # these arms first
    python -m research powered status
    python -m research powered report                #   docs/results/POWERED.md from the ledger
    python -m research distance setup run mismatch cost older-teacher report   # the distance to the teacher (issue 36)
    python -m research sequential seq.yaml           # train on A, then B, …: the forgetting matrix
    python -m research smollm2 --out smollm2-out --results docs/results   # SmolLM2-135M through the pipeline

The powered study records each finished unit as a JSON under experiments/powered/ (commit it); a rerun skips
recorded units. Several processes of `powered sweep` (or `final`) on one machine split the units: each claims
the next unit no other live process holds, e.g. two processes of one thread each on two cores:

    for i in 1 2; do python -m research powered sweep --threads 1 & done

``research/`` is not part of the installed package: it runs from a checkout, next to ``experiments/`` (its
configs and ledgers) and ``docs/results/`` (its reports). It builds on the product (``sapd``); nothing in
``sapd`` imports it.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from sapd.entry import run_main

REPO = Path(__file__).resolve().parents[1]
EXPERIMENTS = REPO / "experiments"
DISTANCE_STEPS = ["setup", "run", "mismatch", "cost", "older-teacher", "status", "report"]
POWERED_STEPS = ["pilot", "gate", "regate", "probe", "smollm2", "sweep", "final", "status", "report"]


def cmd_study(args: argparse.Namespace) -> int:
    """The reproduction study (research.reproduction): Tables 1–3, Figure 2 and Appendix A.5 on TextWorld."""
    from research.reproduction import load_study_config, run_study
    cfg = load_study_config(args.config)
    run_study(cfg, args.out, args.results, worker=args.worker, workers=args.workers, report_only=args.report_only,
              log=lambda s: print(s, flush=True), show_progress=not args.no_progress)
    return 0


def cmd_powered(args: argparse.Namespace) -> int:
    """The powered study (research.powered), the steps in the order given."""
    from research.powered import PoweredStudy, load_powered_config
    if args.threads:
        import torch
        torch.set_num_threads(args.threads)
    t0 = time.perf_counter()

    def log(line: str) -> None:
        print(f"[{time.perf_counter() - t0:7.0f} s] {line}", flush=True)

    config = Path(args.config).resolve()
    study = PoweredStudy(load_powered_config(config), args.ledger, args.cache, log=log,
                         config_path=config.relative_to(REPO) if config.is_relative_to(REPO) else None)
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
            from research.powered_report import render_powered
            log(f"report: {render_powered(study, args.results)}")
        elif step == "status":
            print(json.dumps(study.status(), indent=1))
    return 0


def cmd_distance(args: argparse.Namespace) -> int:
    """The distance study (research.distance), the steps in the order given."""
    from research.distance import DistanceStudy, load_distance_config
    if args.threads:
        import torch
        torch.set_num_threads(args.threads)
    t0 = time.perf_counter()

    def log(line: str) -> None:
        print(f"[{time.perf_counter() - t0:7.0f} s] {line}", flush=True)

    study = DistanceStudy(load_distance_config(args.config), args.ledger, args.cache, log=log)
    for step in args.steps:
        log(f"step {step}")
        if step == "setup":
            study.setup()
        elif step == "run":
            log(f"run: finished {study.run(args.max_units)}")
        elif step == "mismatch":
            study.mismatch()
        elif step == "cost":
            study.cost()
        elif step == "older-teacher":
            study.older_teacher()
        elif step == "status":
            print(json.dumps(study.status(), indent=1))
        elif step == "report":
            from research.distance_report import render_distance
            log(f"report: {render_distance(study, args.results)}")
    return 0


def cmd_sequential(args: argparse.Namespace) -> int:
    """Train stage after stage, evaluating every earlier task after each: the forgetting matrix."""
    from research.sequential import forgetting_markdown, load_sequence, run_sequential
    seq = load_sequence(args.spec)
    root = args.root or seq["root"]
    file_variant = seq["variant"] or seq["base"].get("variant", "sapd")
    if args.variant and args.variant != file_variant and args.root is None:
        raise ValueError(f"--variant {args.variant} differs from the file's variant {file_variant}: give --root too, "
                         "so the two sequences do not share run roots")
    res = run_sequential(seq["base"], seq["stages"], root, variant=args.variant or seq["variant"],
                         horizon=seq["horizon"], max_new_tokens=seq["max_new_tokens"], device=args.device,
                         env_timeout_s=seq["env_timeout_s"], log=lambda s: print(s, flush=True),
                         show_progress=not args.no_progress)
    print(forgetting_markdown(res), end="")
    print(f"wrote {root}/sequential.json and {root}/forgetting.md")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m research", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("study", help="the reproduction study on TextWorld: Tables 1-3, Figure 2, Appendix A.5 "
                                     "(hours on a CPU; resumable)")
    p.add_argument("config", nargs="?", default=None, help="study YAML (e.g. experiments/study.yaml; every key "
                                                            "is a field of research.reproduction.StudyConfig)")
    p.add_argument("--out", default="study-out", help="working folder: games, pools, models, runs (resumable)")
    p.add_argument("--results", default="study-out/results", help="where STUDY.md, study.json and the PNGs go")
    p.add_argument("--worker", type=int, default=0, help="with --workers N: this process's share of the runs")
    p.add_argument("--workers", type=int, default=1,
                   help="split the independent runs over N processes (then run once more with N = 1 to report)")
    p.add_argument("--report-only", action="store_true", help="train nothing: report what is finished so far")
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=cmd_study)

    p = sub.add_parser("powered", help="the powered study (docs/results/ANALYSIS_PLAN.md), step by step")
    p.add_argument("steps", nargs="+", choices=POWERED_STEPS)
    p.add_argument("--results", default=str(REPO / "docs" / "results"), help="report: where POWERED.md goes")
    p.add_argument("--config", default=str(EXPERIMENTS / "powered.yaml"))
    p.add_argument("--ledger", default=str(EXPERIMENTS / "powered"))
    p.add_argument("--cache", default=".cache/powered")
    p.add_argument("--max-units", type=int, default=None, help="sweep/final: stop after this many new units")
    p.add_argument("--arms", default=None,
                   help="final: comma-separated arms (and 'student', 'teacher' for the reference rows) to run, "
                        "in this order (the order of work only; default: every arm, then the references)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads of this process")
    p.set_defaults(func=cmd_powered)

    p = sub.add_parser("distance", help="why the student's distance to the teacher stalls in the demo's setting "
                                        "(issue 36; docs/results/DISTANCE.md)")
    p.add_argument("steps", nargs="+", choices=DISTANCE_STEPS)
    p.add_argument("--results", default=str(REPO / "docs" / "results"), help="report: where DISTANCE.md goes")
    p.add_argument("--config", default=str(EXPERIMENTS / "distance.yaml"))
    p.add_argument("--ledger", default=str(EXPERIMENTS / "distance"))
    p.add_argument("--cache", default="study-out/distance", help="the demo, panels and run roots (ignored by git)")
    p.add_argument("--max-units", type=int, default=None, help="run: stop after this many new runs")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads of this process")
    p.set_defaults(func=cmd_distance)

    p = sub.add_parser("sequential", help="train on task A, then B, then C …; evaluate every earlier task after "
                                          "each stage (the forgetting matrix)")
    p.add_argument("spec", help="the sequence file (YAML: root, base, stages; see research.sequential.load_sequence)")
    p.add_argument("--variant", default=None, help="override the file's variant (e.g. sft), with --root")
    p.add_argument("--root", default=None, help="override the file's root")
    p.add_argument("--device", default="cpu")
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=cmd_sequential)

    # listed here for --help; main() hands its arguments to research.smollm2 unparsed
    sub.add_parser("smollm2", help="SmolLM2-135M-Instruct through the whole pipeline (its flags: "
                                   "python -m research smollm2 --help)")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["smollm2"]:
        from research.smollm2 import main as smollm2_main
        return smollm2_main(argv[1:])
    args = build_parser().parse_args(argv)
    return run_main(f"python -m research {args.command}", lambda: args.func(args))


if __name__ == "__main__":
    sys.exit(main())
