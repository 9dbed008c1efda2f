"""The ``sapd`` command line. Each subcommand parses its flags and calls one function of the library
(a stage, an executor, a baseline or the demo); errors and exit codes go through :mod:`sapd.entry`,
which the ``sapd/jobs/*`` entry points share. Library imports are per command, so ``sapd --help`` is quick."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Sequence

from sapd import __version__


def _history(value: str) -> int | str:
    if value == "all":
        return value
    n = int(value)
    if n < 0:
        raise argparse.ArgumentTypeError("history length must be ≥ 0 or 'all'")
    return n


def _add_prefix_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--history-length", type=_history, default=None, metavar="N|all",
                   help="recent (observation, action) pairs shown in a prompt (default: the benchmark's, "
                        "2 for ALFWorld/WebShop, 4 for search QA; 'all' for the full history)")
    p.add_argument("--prompt-style", choices=["step", "chat"], default="step",
                   help="'step': one verl-agent style prompt; 'chat': history as alternating messages")
    p.add_argument("--max-prompt-tokens", type=int, default=None, help="drop prefixes longer than this")
    p.add_argument("--val-fraction", type=float, default=0.05, help="trajectories held out (default 0.05)")
    p.add_argument("--seed", type=int, default=0, help="split seed (default 0)")
    p.add_argument("--skip-invalid", action="store_true",
                   help="skip invalid records (each is counted and reported) instead of stopping at the first")
    p.add_argument("--action-wording", choices=["recorded", "put", "move"], default="recorded",
                   help="ALFWorld: keep actions as recorded, or rewrite to 'put X in/on Y' / 'move X to Y'")
    p.add_argument("--rows-per-part", type=int, default=50_000, help="rows per Parquet part")
    p.add_argument("--overwrite", action="store_true", help="replace a different committed build at --out")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")


def _prefix_options(args: argparse.Namespace):
    from sapd.data.prefixes import PrefixOptions
    full = args.history_length == "all"
    return PrefixOptions(history_length=None if full else args.history_length, full_history=full,
                         prompt_style=args.prompt_style, max_prompt_tokens=args.max_prompt_tokens,
                         val_fraction=args.val_fraction, seed=args.seed)


def cmd_build_prefixes(args: argparse.Namespace) -> int:
    from sapd.data.prefixes import build_prefixes
    from sapd.models.loading import load_tokenizer
    from sapd.stages.build_prefixes import build_summary
    tokenizer = load_tokenizer(args.tokenizer)
    result = build_prefixes(args.input, args.format, args.benchmark, args.out, tokenizer,
                            opts=_prefix_options(args), skip_invalid=args.skip_invalid,
                            action_wording=args.action_wording, overwrite=args.overwrite,
                            rows_per_part=args.rows_per_part, log=lambda s: print(s, flush=True),
                            show_progress=not args.no_progress)
    for line in build_summary(result):
        print(line)
    return 0


def cmd_convert(args: argparse.Namespace) -> int:
    from sapd.data.loaders import LoadOptions, load_trajectories, write_native_jsonl, write_native_parquet
    res = load_trajectories(args.input, args.format, LoadOptions(args.benchmark, skip_invalid=args.skip_invalid,
                                                                 action_wording=args.action_wording))
    if args.out.endswith(".parquet"):
        write_native_parquet(res.trajectories, args.out)
    else:
        write_native_jsonl(res.trajectories, args.out)
    print(f"format: {res.format_summary()}")
    print(f"records read: {res.records_read} = {res.valid_records} valid + {res.report.total} invalid (skipped)")
    print(f"wrote {len(res.trajectories)} trajectories to {args.out}")
    for line in res.report.lines():
        print(line)
    return 0


def cmd_show_prefixes(args: argparse.Namespace) -> int:
    from sapd.data.prefix_table import read_prefixes
    table = read_prefixes(args.out, args.split)
    for row in table.slice(0, args.n).to_pylist():
        print(f"=== {row['prefix_id']}  ({row['category'] or '-'}, {row['prompt_tokens']} tokens; "
              f"recorded action: {row['recorded_action']!r})")
        print(row["prompt"])
    print(f"({table.num_rows} {args.split} prefixes in {args.out})")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    """The embedded default: TextWorld games, noisy logs, student and teacher, then SFT / OPD+Rule / SAPD from
    the student and a held-out evaluation, each model made by a `sapd run` config (sapd.demo.main)."""
    from sapd.demo.main import demo_config, run_demo
    cfg = demo_config(args.config)  # checked before anything runs
    if args.workers is not None:
        cfg.workers = args.workers
    run_demo(Path(args.out), cfg, log=lambda s: print(s, flush=True), show_progress=not args.no_progress)
    return 0


def cmd_check(args: argparse.Namespace) -> int:
    """Everything about a run that can be known without training (sapd.run.check)."""
    from sapd.entry import config_from_args
    from sapd.run.check import check_command
    cfg = config_from_args(args, announce=False)  # check_command says what "auto" resolved to (or is planned as)
    return check_command(cfg, sample_records=args.sample_records, device_memory_gib=args.device_memory_gib,
                         gpu_memory_gib=args.gpu_memory, gpus=args.gpus, log=lambda s: print(s, flush=True))


def cmd_init(args: argparse.Namespace) -> int:
    """A commented starter config for a benchmark (sapd.run.starter)."""
    from sapd.run.starter import starter_config
    text = starter_config(args.benchmark)
    if args.out == "-":
        print(text, end="")
        return 0
    out = Path(args.out or f"{args.benchmark}.yaml")
    if out.exists() and not args.force:
        raise ValueError(f"{out} exists; choose another --out, or pass --force to replace it")
    out.write_text(text, encoding="utf-8")
    print(f"wrote {out}: fill in data.input, model.student and model.teacher (the PATH/TO/… values), then\n"
          f"  sapd check {out}\n  sapd run {out}")
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    from sapd.entry import config_from_args
    from sapd.run.check import preflight
    from sapd.run.local import run_pipeline
    cfg = config_from_args(args)
    if not args.no_check:
        preflight(cfg, log=lambda s: print(s, flush=True))
    result = run_pipeline(cfg, log=lambda s: print(s, flush=True), show_progress=not args.no_progress,
                          force_takeover=args.force_takeover)
    print(f"done: {result['run_root']} holds checkpoints {result['checkpoints']}")
    return 0


def cmd_train_round(args: argparse.Namespace) -> int:
    """One training stage (checkpoint K + round K's scored shards → checkpoint K+1), on every process
    torchrun starts; the engine is ``train.engine``: what ``python -m sapd.jobs.train`` runs (checks, config,
    metrics, the stage), through the same :func:`sapd.run.job.stage_main`."""
    from sapd.run.job import stage_main
    from sapd.stages import train
    from sapd.stages.context import Step
    return stage_main("sapd train-round", train, args, Step("train", args.round), command="sapd train-round")


def cmd_evaluate(args: argparse.Namespace) -> int:
    from sapd.entry import log_line
    from sapd.envs.panels import PanelSpec
    from sapd.metrics import Metrics
    from sapd.panel_flags import env_timeout, panel_fields
    from sapd.stages.evaluate import evaluate_checkpoint
    metrics = Metrics.from_env("evaluate")
    result = evaluate_checkpoint(args.run, args.checkpoint, PanelSpec(**panel_fields(args)), horizon=args.horizon,
                                 max_new_tokens=args.max_new_tokens, device=args.device,
                                 env_timeout_s=env_timeout(args), log=log_line, show_progress=not args.no_progress,
                                 metrics=metrics, temperature=args.temperature)
    metrics.observe_stage("evaluate", result["seconds"])
    metrics.mark_success()
    metrics.push()
    print(json.dumps({"checkpoint": result["checkpoint"], "overall": result["overall"]["success"],
                      "by_category": {c: v["success"] for c, v in result["by_category"].items()},
                      "interval95": {c: v.get("success_ci") for c, v in
                                     [("overall", result["overall"]), *result["by_category"].items()]}}))
    return 0


def cmd_collect_expert(args: argparse.Namespace) -> int:
    import dataclasses

    from sapd.data.loaders import write_native_jsonl
    from sapd.envs.loop import LoopOptions, collect_expert, summarize
    from sapd.envs.panels import PanelSpec, episode_specs
    from sapd.method.benchmarks import noop_action
    from sapd.panel_flags import env_timeout, panel_fields
    from sapd.progress import Progress
    panel = PanelSpec(**panel_fields(args))
    if args.benchmark == "alfworld":  # ALFWorld's own expert plays (alfworld_env.make_backend)
        from sapd.envs.alfworld_env import EXPERT_FIX_NOTE
        panel = dataclasses.replace(panel, alfworld_expert=args.expert, alfworld_expert_fix=not args.no_expert_fix)
        if args.expert == "planner":
            print("ALFWorld expert: planner (Fast Downward replans on the full state every step)", flush=True)
        elif args.no_expert_fix:
            print("ALFWorld expert: hand-coded, WITHOUT sapd's move/put fix (--no-expert-fix): alfworld 0.4.x's "
                  "expert loops after its own 'move X to Y', failing two-object tasks", flush=True)
        else:
            print(f"ALFWorld expert: hand-coded (seeded by --seed {args.seed}). {EXPERT_FIX_NOTE}", flush=True)
    specs = episode_specs(panel)
    # a bar on a terminal, a line every 30 s elsewhere (kubectl logs): an ALFWorld expert takes seconds a game
    progress = Progress.of(lambda s: print(s, flush=True), not args.no_progress)
    with progress.task("expert episodes", total=len(specs), unit="episode") as bar:
        trajs = collect_expert(specs, args.benchmark, successful_only=args.successful_only,
                               opts=LoopOptions(invalid_action=noop_action(args.benchmark),
                                                env_timeout_s=env_timeout(args)), progress=bar)
    write_native_jsonl(trajs, args.out)
    s = summarize(trajs)
    print(f"wrote {len(trajs)} expert trajectories to {args.out}; expert success {s['overall']['success']:.2f}, "
          f"{s['overall']['mean_steps']:.1f} steps on average")
    for cat, v in s["by_category"].items():
        lo, hi = v["success_ci"]
        print(f"  {cat}: {v['episodes']} episodes, success {v['success']:.2f} (95% interval {lo:.2f}–{hi:.2f})")
    return 0


def cmd_alfworld_games(args: argparse.Namespace) -> int:
    """ALFWorld games in ALFWorld's own layout, checked solvable by alfworld-generate (sapd.envs.alfworld_games)."""
    from sapd.envs.alfworld_games import generate_split
    generate_split(args.out, args.split, args.per_type, args.seed, expert=args.check_expert,
                   log=lambda s: print(s, flush=True), show_progress=not args.no_progress, overwrite=args.overwrite)
    print(f"use them: ALFWORLD_DATA={args.out} sapd collect-expert --benchmark alfworld --split {args.split} "
          "--out FILE (or --alfworld-data DIR with any ALFWorld command)")
    return 0


def cmd_online(args: argparse.Namespace) -> int:
    """The online baselines (they need the environment, by design): rollouts of the current checkpoint
    in the TextWorld panel, then the same training stage as SAPD."""
    from sapd import lease
    from sapd.baselines.online import cycling_games, run_online
    from sapd.entry import config_from_args, log_line
    from sapd.envs.panels import textworld_specs
    from sapd.panel_flags import env_timeout
    cfg = config_from_args(args)
    families = [f.strip() for f in args.families.split(",") if f.strip()] if args.families else None
    panel = textworld_specs(families, args.games_per_family, args.seed, args.cache)
    claimant = lease.Claimant.this_process("sapd online")
    with lease.holding(cfg.run_root, claimant, ttl_s=cfg.storage.lease_ttl_s, log=log_line,
                       force=args.force_takeover, takeover_hint="run `sapd online` again with --force-takeover",
                       give_back="mine" if claimant.local else "no"):
        result = run_online(cfg, cycling_games(panel, args.games_per_round or len(panel)), args.method,
                            episodes_per_game=args.episodes_per_game, horizon=args.horizon, reward=args.reward,
                            env_timeout_s=env_timeout(args), log=log_line, show_progress=not args.no_progress)
    print(json.dumps({k: v for k, v in result.items() if k != "rounds"}, default=str))
    return 0


def cmd_teacher_pool(args: argparse.Namespace) -> int:
    """A teacher plays the panel with sampling: a teacher-generated pool (ReOPD's input)."""
    from sapd.baselines.reopd import teacher_pool
    from sapd.entry import log_line
    from sapd.envs.loop import summarize
    from sapd.envs.panels import PanelSpec, episode_specs
    from sapd.panel_flags import env_timeout, panel_fields
    from sapd.progress import Progress
    from sapd.stages.evaluate import latest_checkpoint
    if bool(args.model) == bool(args.run):
        raise ValueError("give exactly one of --model (an HF folder) or --run (a run root, with --checkpoint)")
    k = None
    if args.run:
        k = latest_checkpoint(args.run) if args.checkpoint == "latest" else int(args.checkpoint)
    specs = episode_specs(PanelSpec(**panel_fields(args)))
    progress = Progress.of(log_line, not args.no_progress)
    with progress.task("teacher episodes", total=len(specs) * args.samples_per_game, unit="episode") as bar:
        trajs = teacher_pool(args.run or args.model, specs, args.out, k=k, benchmark=args.benchmark,
                             samples_per_spec=args.samples_per_game, temperature=args.temperature, top_p=args.top_p,
                             seed=args.sampling_seed, max_new_tokens=args.max_new_tokens, horizon=args.horizon,
                             device=args.device, env_timeout_s=env_timeout(args), progress=bar)
    s = summarize(trajs)
    print(f"wrote {len(trajs)} teacher trajectories to {args.out}; success {s['overall']['success']:.2f}, "
          f"{s['overall']['mean_steps']:.1f} steps and {s['overall']['invalid_step_rate']:.2f} invalid steps "
          "on average")
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    from sapd.run.report import write_report
    paths = write_report(args.run, args.out)
    for p in paths:
        print(f"wrote {p}")
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from sapd.checkpoints import export_model
    from sapd.models.loading import model_folder
    src = model_folder(args.run) if args.checkpoint is None else args.run
    export_model(args.run, args.out, checkpoint=args.checkpoint)
    print(f"exported {src if args.checkpoint is None else f'{args.run} checkpoint {args.checkpoint}'} → {args.out} "
          "(a Hugging Face model folder: from_pretrained loads it)")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sapd", description="Step-Advantage Policy Distillation from recorded "
                                                               "agent trajectories")
    parser.add_argument("--version", action="version", version=f"sapd {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    from sapd.data.loaders import FORMATS
    from sapd.entry import add_takeover_flag
    from sapd.method.benchmarks import BENCHMARKS
    from sapd.panel_flags import add_panel_flags

    p = sub.add_parser("build-prefixes", help="cut recorded trajectories into decision prefixes (Parquet shards)")
    p.add_argument("--input", required=True, help="a file or folder (local or s3://) of trajectories")
    p.add_argument("--format", required=True, choices=FORMATS,
                   help="the input's layout (docs/FORMATS.md); 'auto' tells it per file and says what it chose")
    p.add_argument("--benchmark", required=True, choices=sorted(BENCHMARKS))
    p.add_argument("--out", required=True, help="output folder or s3:// URI")
    p.add_argument("--tokenizer", required=True, help="Hugging Face tokenizer folder (with a chat template)")
    _add_prefix_flags(p)
    p.set_defaults(func=cmd_build_prefixes)

    p = sub.add_parser("convert", help="convert trajectories to the native JSONL/Parquet format")
    p.add_argument("--input", required=True)
    p.add_argument("--format", required=True, choices=FORMATS,
                   help="the input's layout (docs/FORMATS.md); 'auto' tells it per file and says what it chose")
    p.add_argument("--benchmark", required=True, choices=sorted(BENCHMARKS))
    p.add_argument("--out", required=True, help="….jsonl or ….parquet (local or s3://)")
    p.add_argument("--skip-invalid", action="store_true")
    p.add_argument("--action-wording", choices=["recorded", "put", "move"], default="recorded")
    p.set_defaults(func=cmd_convert)

    p = sub.add_parser("show-prefixes", help="print a few prompts of a committed prefix build")
    p.add_argument("out")
    p.add_argument("--split", choices=["train", "val"], default="train")
    p.add_argument("-n", type=int, default=3)
    p.set_defaults(func=cmd_show_prefixes)

    p = sub.add_parser("run", help="the local pipeline: prefixes, then rounds of precompute → train (resumable)")
    p.add_argument("config", nargs="+", help="YAML overlays, applied in order over the paper's defaults")
    p.add_argument("--run-root", default=None, help="override run_root (a folder or s3:// URI)")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--no-check", action="store_true", help="skip the checks run first (see `sapd check`)")
    add_takeover_flag(p)
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("check", help="check a run config without training: inputs parse, tokenizers match, storage "
                                     "is writable, the run root holds no other config, memory per stage")
    p.add_argument("config", nargs="+", help="YAML overlays, applied in order over the paper's defaults")
    p.add_argument("--run-root", default=None, help="override run_root (a folder or s3:// URI)")
    p.add_argument("--sample-records", type=int, default=20, help="records of the data input to parse (default 20)")
    p.add_argument("--device-memory-gib", type=float, default=None,
                   help="memory of the device the stages will run on, when it is not this machine's")
    p.add_argument("--gpu-memory", type=float, default=None, metavar="GIB",
                   help="plan for GPUs of this many GiB that are not here (capacity planning before renting one): "
                        "'auto' resolved as on such a machine with vLLM installed, then what each GPU holds in "
                        "each phase, from the models' config.json alone")
    p.add_argument("--gpus", type=int, default=None, metavar="N",
                   help="GPUs to plan for (default: 1, `sapd run` on one GPU, every phase on it; N > 1: the "
                        "cluster, N training ranks sharding the trainer with ZeRO, each scoring pod on its own GPU)")
    p.set_defaults(func=cmd_check)

    p = sub.add_parser("init", help="write a commented starter run config for a benchmark (then fill in its paths)")
    p.add_argument("--benchmark", required=True, choices=sorted(BENCHMARKS))
    p.add_argument("--out", default=None, help="the file to write (default BENCHMARK.yaml; '-' for stdout)")
    p.add_argument("--force", action="store_true", help="replace an existing file")
    p.set_defaults(func=cmd_init)

    p = sub.add_parser("train-round", help="train one round (checkpoint K + round K's scored shards → K+1); "
                                           "under torchrun with train.engine: deepspeed")
    p.add_argument("config", nargs="+", help="YAML overlays, applied in order over the paper's defaults")
    p.add_argument("--round", type=int, required=True, metavar="K", help="the round to train")
    p.add_argument("--run-root", default=None, help="override run_root (a folder or s3:// URI)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar (plain log lines only)")
    p.add_argument("--no-check", action="store_true", help="skip the checks run first (see `sapd check`)")
    add_takeover_flag(p)
    p.set_defaults(func=cmd_train_round)

    p = sub.add_parser("evaluate", help="task success of a checkpoint on a fixed, seeded environment panel")
    p.add_argument("--run", required=True, help="the run root holding the checkpoints")
    p.add_argument("--checkpoint", default="latest", help="checkpoint index, or 'latest' (default)")
    add_panel_flags(p)
    p.add_argument("--horizon", type=int, default=None, help="max steps per episode (default: the benchmark's)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--device", default="cpu")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="0 = greedy (default); > 0 samples, seeded by --seed (SDAR validates at 0.4)")
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=cmd_evaluate)

    p = sub.add_parser("collect-expert", help="expert trajectories from an environment panel (native JSONL)")
    add_panel_flags(p)
    p.add_argument("--out", required=True, help="….jsonl (local or s3://)")
    p.add_argument("--successful-only", action="store_true", help="keep only the episodes the expert won")
    p.add_argument("--expert", choices=["handcoded", "planner"], default="handcoded",
                   help="ALFWorld: ALFWorld's hand-coded expert (default; seeded by --seed) or its planner (Fast "
                        "Downward: wins every solvable game, slower)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar or progress lines")
    p.add_argument("--no-expert-fix", action="store_true",
                   help="ALFWorld: run the hand-coded expert as alfworld 0.4.x ships it, without sapd's move/put fix "
                        "(it then loops after 'move X to Y' and fails two-object tasks)")
    p.set_defaults(func=cmd_collect_expert)

    p = sub.add_parser("alfworld-games", help="generate ALFWorld games in ALFWorld's own layout (json_2.1.1/<split>/"
                                              "…), checked solvable by ALFWorld's alfworld-generate; use as "
                                              "ALFWORLD_DATA")
    p.add_argument("--out", required=True, help="the data folder (ALFWORLD_DATA) to write json_2.1.1/<split>/ into")
    p.add_argument("--split", choices=["train", "valid_seen", "valid_unseen"], required=True,
                   help="valid_unseen: ALFRED's test floor plans only; train and valid_seen: its training floor plans, "
                        "never sharing a (floor plan, object) pair")
    p.add_argument("--per-type", type=int, required=True, metavar="N", help="games per task type (six types)")
    p.add_argument("--seed", type=int, default=0, help="the same seed, the same games (default 0)")
    p.add_argument("--check-expert", choices=["planner", "handcoded"], default="planner",
                   help="the expert alfworld-generate checks solvability with (default planner; handcoded runs "
                        "with sapd's move/put fix)")
    p.add_argument("--overwrite", action="store_true", help="replace games of this split generated with other settings")
    p.add_argument("--no-progress", action="store_true", help="no progress bar or progress lines")
    p.set_defaults(func=cmd_alfworld_games)

    p = sub.add_parser("online", help="online baselines in the environment: online OPD or GRPO (resumable)")
    p.add_argument("config", nargs="+", help="YAML overlays (model, sampling, train as for `sapd run`)")
    p.add_argument("--method", choices=["online_opd", "grpo"], required=True)
    add_panel_flags(p)
    p.add_argument("--games-per-round", type=int, default=None, help="games played per round (default: the panel)")
    p.add_argument("--episodes-per-game", type=int, default=None, help="GRPO group size (default sampling.group_size)")
    p.add_argument("--horizon", type=int, default=None)
    p.add_argument("--reward", choices=["won", "score"], default="won", help="GRPO reward: win, or score / max score")
    p.add_argument("--run-root", default=None)
    p.add_argument("--no-progress", action="store_true")
    add_takeover_flag(p)
    p.set_defaults(func=cmd_online)

    p = sub.add_parser("teacher-pool", help="a teacher model plays a panel with sampling: a teacher-generated "
                                            "trajectory pool (native JSONL; ReOPD's input)")
    p.add_argument("--model", default=None, help="the teacher: an HF model folder (or s3:// prefix)")
    p.add_argument("--run", default=None, help="… or a run root whose checkpoint plays")
    p.add_argument("--checkpoint", default="latest", help="with --run: checkpoint index or 'latest'")
    add_panel_flags(p)
    p.add_argument("--samples-per-game", type=int, default=1, help="sampled episodes per panel episode")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--sampling-seed", type=int, default=0, help="the same seed, the same pool")
    p.add_argument("--horizon", type=int, default=None)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--device", default="cpu")
    p.add_argument("--out", required=True, help="….jsonl (local or s3://)")
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=cmd_teacher_pool)

    # listed here for `sapd --help`; main() hands its arguments to sapd.envs.retriever unparsed
    sub.add_parser("retriever", help="serve a BM25 index over a JSONL corpus with the Search-R1 /retrieve API")

    p = sub.add_parser("report", help="render loss and timing curves of a run to PNG")
    p.add_argument("run", help="the run root")
    p.add_argument("--out", default=None, help="output folder (default: RUN/report)")
    p.set_defaults(func=cmd_report)

    p = sub.add_parser("export", help="copy a run root's newest committed (or a given) checkpoint's model to a "
                                      "self-contained Hugging Face model folder")
    p.add_argument("run", help="the run root (local or s3://)")
    p.add_argument("out", help="the model folder to write (local or s3://); an earlier export there is replaced")
    p.add_argument("--checkpoint", type=int, default=None, metavar="K", help="this checkpoint (default: the newest "
                                                                             "committed one)")
    p.set_defaults(func=cmd_export)

    p = sub.add_parser("demo", help="the embedded default: TextWorld games → noisy expert logs → student and teacher → "
                                    "SFT / OPD+Rule / SAPD → held-out evaluation, on this CPU in minutes")
    p.add_argument("--out", default="demo-out", help="output folder (default ./demo-out); a rerun reuses what is there")
    p.add_argument("--config", help="YAML of demo setting fields to change (fields of sapd.demo.main.DemoConfig), "
                                    "e.g. 'test_games: 30'; an unknown field is an error")
    p.add_argument("--workers", type=int, default=None,
                   help="jobs run at once, one thread each (default: one per core, at most 4)")
    p.add_argument("--no-progress", action="store_true", help="progress as plain lines, not bars")
    p.set_defaults(func=cmd_demo)
    return parser


def cmd_retriever(argv: list[str]) -> int:
    """``sapd retriever …``: the arguments go to :func:`sapd.envs.retriever.main` unparsed."""
    from sapd.envs.retriever import main as retriever_main
    return retriever_main(argv)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["retriever"]:
        return cmd_retriever(argv[1:])
    args = build_parser().parse_args(argv)
    from sapd.entry import run_main
    return run_main(f"sapd {args.command}", lambda: args.func(args))


if __name__ == "__main__":
    sys.exit(main())
