"""SAPD vs online OPD per round, on TextWorld, ScienceWorld and ALFWorld (issue 14 item 5, issue 34 item 5;
the paper's Figure 2).

Per environment, in one process: expert episodes played in the environment itself become the recorded
trajectories (each cut to its first ``--horizon`` decisions), one tiny student and one tiny teacher are
built from config (same tokenizer), and R rounds of each method run **alternately, round by round**
(SAPD round k, then online OPD round k), so the machine's load hits both alike:

- SAPD: the round's prefixes (every prefix of ``--games`` trajectories × ``--horizon`` turns = N) → G
  samples each (no environment) → teacher scores → masks/rules → train;
- online OPD: checkpoint k plays the same ``--games`` games for ``--horizon`` steps in the live
  environment (N decisions, one sampled response each) → teacher scores → masks/rules → train.

So both see **the same decisions per round** (N); SAPD samples G responses per decision (N·G sampled
responses), online OPD one (N). The "per sampled response" columns normalise that. Each method keeps
its engines (student sampler, teacher) across its rounds, as ``sapd run`` and ``sapd online`` do.

    .venv/bin/python bench/offline_vs_online.py [--rounds 3] [--games 2] [--horizon 6] [--group 4]
    .venv/bin/python bench/offline_vs_online.py --json out.json --png docs/results/figure2_offline_vs_online.png

**ALFWorld** (``--env alfworld``) runs the paper's setting instead of equal decisions: the same
``--games`` trajectories per round for both methods, each **up to** ``--horizon`` steps (default ALFWorld's
50). The games are generated with ``sapd alfworld-games`` (``--split train``, one per task type per
``--games`` 6; or ``--alfworld-data DIR``) and the recorded logs are the planner expert's
(``sapd collect-expert --benchmark alfworld --expert planner``), whole (3–10 steps each). SAPD's round: every
prefix of those trajectories × G samples; online OPD's: checkpoint k plays the same games in ALFWorld's
engine until it wins or reaches the horizon (a tiny student rarely wins: ~50 steps each). The bench prints
how far this is scaled down from the paper's ALFWorld setting (16 trajectories per round, G = 8, 1.5B
student / 3B teacher) and ends with ``figure 2 (alfworld): SAPD X.X× faster per round than online OPD``.

    .venv/bin/python bench/offline_vs_online.py --env alfworld [--games 6] [--group 4] [--rounds 3]

Stage times per round, which add up to the round's wall time: ``env`` (online: the environments'
own calls — building, resets, steps, closing — timed around each call), ``generation`` (the student's
sampling), ``score`` (teacher), ``masks_rules``, ``train`` (π_old, optimizer steps, checkpoint write) and
``other`` (the rest of the round: online, the agent loop's prompt rendering and parsing; both, the
commits). ``sample`` is the sampling stage's own clock (SAPD: generation; online: the rollouts).
The last lines are ``figure 2 (<env>): SAPD X.X× faster per round than online OPD``, one per
environment, from the medians over rounds.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from functools import partial
from pathlib import Path
from typing import Any, Callable

from sapd import layout
from sapd.baselines.online import online_config, online_round
from sapd.config import config_from_dict, write_run_config
from sapd.data import scored, shards
from sapd.data.loaders import LoadOptions, load_trajectories, write_native_jsonl
from sapd.data.schema import Trajectory
from sapd.envs.base import EpisodeSpec
from sapd.envs.loop import LoopOptions, collect_expert
from sapd.models.byte_tokenizer import build_tokenizer
from sapd.models.loading import load_tokenizer
from sapd.models.tiny import build_tiny_model
from sapd.stages import build_prefixes, teacher_scores
from sapd.stages.train import run_train_stage

ENVS = ("textworld", "scienceworld", "alfworld")
DEFAULT_ENVS = ("textworld", "scienceworld")
PARTS = ("env", "generation", "score", "masks_rules", "train", "other")  # they add up to the round
STAGES = ("sample", *PARTS)
# the paper's ALFWorld setting (Table 5, §B.2): trajectories per training batch, samples per prefix, horizon
PAPER_ALFWORLD = {"trajectories": 16, "group": 8, "horizon": 50, "student": "Qwen2.5-1.5B", "teacher": "Qwen2.5-3B"}
DEFAULT_HORIZON = {"textworld": 6, "scienceworld": 6, "alfworld": 50}
DEFAULT_GAMES = {"textworld": 2, "scienceworld": 2, "alfworld": 6}
REPO = Path(__file__).resolve().parents[1]


def env_specs(env: str, games: int, cache: Path) -> list[EpisodeSpec]:
    if env == "textworld":
        from sapd.envs.panels import textworld_specs
        return textworld_specs(["simple"], games, seed=0, cache_dir=cache / "textworld")
    if env == "scienceworld":
        from sapd.envs.scienceworld_env import TaskSpec, scienceworld_specs
        panel = [TaskSpec("find-plant", 241), TaskSpec("lifespan-longest-lived", 122), TaskSpec("find-plant", 242),
                 TaskSpec("lifespan-longest-lived", 123)]
        if games > len(panel):
            raise ValueError(f"--games {games}: this bench's ScienceWorld panel has {len(panel)} tasks")
        return scienceworld_specs(panel=panel[:games])
    raise ValueError(f"unknown env {env!r}; expected one of {ENVS}")


class TimedEnv:
    """An environment whose own calls are timed into ``clock[0]``: the online rollouts' environment time,
    measured around each call (the agent loop's prompt rendering and parsing stay outside)."""

    def __init__(self, inner: Any, clock: list[float]) -> None:
        self._inner, self._clock = inner, clock
        self.benchmark = getattr(inner, "benchmark", None)

    def _timed(self, fn: Callable[..., Any], *args: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*args)
        finally:
            self._clock[0] += time.perf_counter() - t0

    def reset(self, seed: int | None = None) -> Any:
        return self._timed(self._inner.reset, seed)

    def step(self, action: str) -> Any:
        return self._timed(self._inner.step, action)

    def close(self) -> Any:
        return self._timed(self._inner.close)

    def __getattr__(self, name: str) -> Any:  # step_response / expert_action exactly where the environment has them
        attr = getattr(self._inner, name)
        return partial(self._timed, attr) if callable(attr) else attr


def _timed_env(make_env: Callable[[], Any], clock: list[float]) -> TimedEnv:
    t0 = time.perf_counter()
    inner = make_env()
    clock[0] += time.perf_counter() - t0
    return TimedEnv(inner, clock)


def _timed_call(fn: Callable[[], None], clock: list[float]) -> None:
    t0 = time.perf_counter()
    try:
        fn()
    finally:
        clock[0] += time.perf_counter() - t0


def timed_specs(specs: list[EpisodeSpec], clock: list[float]) -> list[EpisodeSpec]:
    """``specs`` with their environments (and shared start-up, ``prepare``) timed into ``clock[0]``."""
    prepares = {s.prepare: partial(_timed_call, s.prepare, clock) for s in specs if s.prepare is not None}
    return [dataclasses.replace(s, make_env=partial(_timed_env, s.make_env, clock),
                                prepare=prepares[s.prepare] if s.prepare is not None else None) for s in specs]


def _round_stages(timings: dict[str, float], train_s: float, round_s: float, online: bool,
                  env_s: float = 0.0) -> dict[str, float]:
    sample, gen = timings.get("sample_seconds", 0.0), timings.get("generation_seconds", 0.0)
    out = {"sample": sample, "env": env_s if online else 0.0, "generation": gen if online else sample,
           "score": timings.get("score_seconds", 0.0), "masks_rules": timings.get("masks_rules_seconds", 0.0),
           "train": train_s}
    out["other"] = round_s - sum(out[p] for p in PARTS if p != "other")
    return out


def sapd_command(argv: list[str], log: Callable[[str], None]) -> None:
    """``sapd ARGV``, the user's command, in its own process; its output goes to ``log``."""
    run = subprocess.run([sys.executable, "-m", "sapd.cli", *argv], capture_output=True, text=True, cwd=REPO,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    for line in run.stdout.splitlines():
        log(line)
    if run.returncode != 0:
        raise RuntimeError(f"sapd {' '.join(argv)} failed ({run.returncode}):\n{run.stderr[-3000:]}")


def alfworld_inputs(args: argparse.Namespace, work: Path, log: Callable[[str], None]
                    ) -> tuple[list[EpisodeSpec], list[Trajectory]]:
    """ALFWorld's games (``sapd alfworld-games``, or ``--alfworld-data``) and the planner expert's recorded logs
    of the first ``--games`` of them (``sapd collect-expert``), both through the command line as a user runs them."""
    from sapd.envs.alfworld_env import alfworld_specs
    data = Path(args.alfworld_data) if args.alfworld_data else work / "alfworld-games"
    per_type = -(-args.games // 6)  # enough games of each of the six task types
    if not args.alfworld_data:
        sapd_command(["alfworld-games", "--out", str(data), "--split", args.alfworld_split, "--per-type",
                      str(per_type), "--no-progress"], log)
    recorded = work / "alfworld" / "planner_expert.jsonl"
    recorded.parent.mkdir(parents=True, exist_ok=True)
    sapd_command(["collect-expert", "--benchmark", "alfworld", "--expert", "planner", "--split", args.alfworld_split,
                  "--alfworld-data", str(data), "--limit", str(args.games), "--out", str(recorded), "--no-progress"],
                 log)
    expert = load_trajectories(str(recorded), "native", LoadOptions("alfworld")).trajectories
    specs = alfworld_specs(data, args.alfworld_split, limit=args.games, log=None)  # the same games, no expert
    if [s.id for s in specs] != [t.id for t in expert]:
        raise RuntimeError(f"recorded games {[t.id for t in expert]} differ from the online games "
                           f"{[s.id for s in specs]}")
    log(f"alfworld: {len(specs)} games from {data}; planner logs {recorded} "
        f"({sum(len(t.turns) for t in expert)} decisions, {sum(bool(t.success) for t in expert)} won)")
    return specs, expert


def run_env(env: str, args: argparse.Namespace, work: Path, log: Callable[[str], None]) -> dict[str, Any]:
    horizon = args.horizon or DEFAULT_HORIZON[env]
    games = args.games or DEFAULT_GAMES[env]
    args = argparse.Namespace(**{**vars(args), "games": games})
    t0 = time.perf_counter()
    if env == "alfworld":  # the paper's setting: the same trajectories per round, each up to the horizon
        specs, expert = alfworld_inputs(args, work, log)
    else:  # the same decisions per round: every trajectory cut to the horizon
        specs = env_specs(env, games, work / "games")
        expert = collect_expert(specs, env, LoopOptions(horizon=horizon))
        short = [t.id for t in expert if len(t.turns) < horizon]
        if short:
            raise RuntimeError(f"{env}: expert episodes {short} are shorter than --horizon {horizon}; lower it "
                               "so both methods see the same decisions")
    expert_s = time.perf_counter() - t0
    for t in expert:
        t.turns = t.turns[:horizon]
    data = work / env / "expert.jsonl"
    data.parent.mkdir(parents=True, exist_ok=True)
    write_native_jsonl(expert, str(data))
    tok = build_tokenizer([data.read_text()], work / env / "tok")
    student, teacher = work / env / "student", work / env / "teacher"
    build_tiny_model(tok, student, hidden_size=args.hidden, layers=args.layers, heads=4, kv_heads=2,
                     intermediate_size=4 * args.hidden, seed=0)
    build_tiny_model(tok, teacher, hidden_size=args.teacher_hidden, layers=args.teacher_layers, heads=4,
                     kv_heads=2, intermediate_size=4 * args.teacher_hidden, seed=1)
    n = sum(len(t.turns) for t in expert)  # SAPD's decisions (prefixes) per round: every trajectory each round

    def cfg_for(name: str, decisions: int):
        # one optimizer step per round over all of the round's decisions, for each method; at the same
        # decisions in micro-batches of all of them, on ALFWorld (up to 50 steps × games online) of 8 prefixes
        micro = min(decisions, 8) if env == "alfworld" else decisions
        return config_from_dict({
            "run_root": str(work / env / name), "variant": "sapd",
            "data": {"input": str(data), "format": "native", "benchmark": env, "max_prompt_tokens": None,
                     "val_fraction": 0.0},
            "model": {"student": str(student), "teacher": str(teacher)},
            "sampling": {"group_size": args.group, "max_new_tokens": args.new_tokens, "prompts_per_batch": 4},
            "train": {"rounds": args.rounds, "trajectories_per_round": games,
                      "minibatch_prefixes": -(-decisions // micro) * micro, "micro_batch_prefixes": micro,
                      "lr": 1e-4, "seed": 0}})

    sapd_cfg = cfg_for("sapd", n)
    opd_cfg = online_config(cfg_for("online_opd", games * horizon if env == "alfworld" else n), "online_opd")
    tokenizer = load_tokenizer(str(student))
    quiet = dict(log=log, show_progress=False)
    for cfg in (sapd_cfg, opd_cfg):
        write_run_config(cfg)
        build_prefixes.ensure_initial_checkpoint(cfg, log)
    build = build_prefixes.ensure_prefixes(sapd_cfg, tokenizer, log, False)
    log(f"{env}: prefixes {build.manifest['stats']}")
    sapd_teacher = teacher_scores.teacher_scorer(sapd_cfg, tokenizer)
    opd_teacher = teacher_scores.teacher_scorer(opd_cfg, tokenizer)
    sapd_gen = opd_gen = None
    env_clock = [0.0]
    online_specs = timed_specs(specs, env_clock)
    rounds: dict[str, list[dict[str, Any]]] = {"sapd": [], "online_opd": []}
    for k in range(args.rounds):
        # SAPD round k
        t0 = time.perf_counter()
        sapd_gen = teacher_scores.student_generator(sapd_cfg, k, tokenizer, reuse=sapd_gen)
        result = teacher_scores.run_worker(sapd_cfg, k, 0, sapd_gen, sapd_teacher, tokenizer, **quiet)
        scored.commit_round(sapd_cfg, k)
        t1 = time.perf_counter()
        run_train_stage(sapd_cfg, k, **quiet)
        t2 = time.perf_counter()
        manifest = shards.read_manifest(layout.scored_dir(sapd_cfg.run_root, k)) or {}
        rounds["sapd"].append({"round": k, "decisions": result.rows, "responses": result.rows * args.group,
                               "generated_tokens": manifest.get("generated_tokens", 0), "round_seconds": t2 - t0,
                               "stages": _round_stages(result.timings, t2 - t1, t2 - t0, online=False)})
        # online OPD round k
        t0, env_clock[0] = time.perf_counter(), 0.0
        opd_gen = teacher_scores.student_generator(opd_cfg, k, tokenizer, reuse=opd_gen)
        summary = online_round(opd_cfg, k, online_specs, "online_opd", tokenizer, generator=opd_gen,
                               teacher=opd_teacher, horizon=horizon, **quiet)
        t1 = time.perf_counter()
        run_train_stage(opd_cfg, k, **quiet)
        t2 = time.perf_counter()
        decisions = round(summary["mean_steps"] * summary["episodes"])
        rounds["online_opd"].append({"round": k, "decisions": decisions, "responses": decisions,
                                     "rows": summary["rows"], "generated_tokens": summary["generated_tokens"],
                                     "success": summary["success"], "round_seconds": t2 - t0,
                                     "stages": _round_stages(summary["timings"], t2 - t1, t2 - t0, online=True,
                                                             env_s=env_clock[0])})
        log(f"{env} round {k}: SAPD {rounds['sapd'][-1]['round_seconds']:.1f}s, "
            f"online OPD {rounds['online_opd'][-1]['round_seconds']:.1f}s")
    out: dict[str, Any] = {"env": env, "setting": "same trajectories" if env == "alfworld" else "same decisions",
                           "trajectories_per_round": games, "horizon": horizon, "decisions_per_round": n,
                           "group": args.group, "expert_collection_seconds": expert_s, "rounds": rounds, "median": {},
                           "models": {"student": f"{args.hidden} wide × {args.layers} layers",
                                      "teacher": f"{args.teacher_hidden} wide × {args.teacher_layers} layers"}}
    if env == "alfworld":
        paper, models = PAPER_ALFWORLD, out["models"]
        out["scaled_from_paper"] = {
            "trajectories_per_round": f"{games} trajectories per round of {paper['trajectories']} "
                                      f"(÷{paper['trajectories'] / games:.3g})",
            "group": f"G = {args.group} of {paper['group']} (÷{paper['group'] / args.group:.3g})",
            "horizon": f"up to {horizon} of {paper['horizon']} steps",
            "models": f"tiny models ({models['student']} student, {models['teacher']} teacher) for "
                      f"{paper['student']} / {paper['teacher']}"}
    for method, rs in rounds.items():
        # the median round (by wall time) and its own stages, so its breakdown adds up to its total
        mid = sorted(rs, key=lambda r: r["round_seconds"])[(len(rs) - 1) // 2]
        med = {"round": mid["round"], "round_seconds": mid["round_seconds"], **mid["stages"]}
        med["decisions"] = statistics.median(r["decisions"] for r in rs)
        med["responses"] = statistics.median(r["responses"] for r in rs)
        med["per_decision_seconds"] = med["round_seconds"] / max(mid["decisions"], 1)
        med["per_response_seconds"] = med["round_seconds"] / max(mid["responses"], 1)
        out["median"][method] = med
    m = out["median"]
    out["ratio_per_round"] = m["online_opd"]["round_seconds"] / m["sapd"]["round_seconds"]
    out["ratio_per_response"] = m["online_opd"]["per_response_seconds"] / m["sapd"]["per_response_seconds"]
    return out


def figure2_line(r: dict[str, Any]) -> str:
    return f"figure 2 ({r['env']}): SAPD {r['ratio_per_round']:.1f}× faster per round than online OPD"


def render(results: list[dict[str, Any]]) -> str:
    lines = []
    for r in results:
        lines.append(f"\n## {r['env']}: {r['trajectories_per_round']} trajectories/games per round, up to "
                     f"{r['horizon']} steps each ({r['setting']}), SAPD G={r['group']}; the median of "
                     f"{len(r['rounds']['sapd'])} rounds (seconds)")
        if "scaled_from_paper" in r:
            lines.append("scaled down from the paper's setting: " + "; ".join(r["scaled_from_paper"].values()))
        lines.append("| method | round | env | generation | teacher score | masks/rules | train | other "
                     "| decisions | responses | s per decision | s per response |")
        lines.append("|---|---|---|---|---|---|---|---|---|---|---|---|")
        for method in ("sapd", "online_opd"):
            m = r["median"][method]
            lines.append(f"| {method} | {m['round_seconds']:.2f} | {m['env']:.2f} | {m['generation']:.2f} | "
                         f"{m['score']:.2f} | {m['masks_rules']:.3f} | {m['train']:.2f} | {m['other']:.2f} | "
                         f"{m['decisions']:g} | {m['responses']:g} | {m['per_decision_seconds']:.3f} | "
                         f"{m['per_response_seconds']:.4f} |")
        o, s = r["median"]["online_opd"], r["median"]["sapd"]
        lines.append(f"ratio online/SAPD per round: {r['ratio_per_round']:.2f}×; per sampled response: "
                     f"{r['ratio_per_response']:.2f}×")
        lines.append(f"online round {o['round_seconds']:.2f} = env {o['env']:.2f} + generation {o['generation']:.2f} + "
                     f"teacher {o['score']:.2f} + masks/rules {o['masks_rules']:.3f} + train {o['train']:.2f} + other "
                     f"{o['other']:.2f}; SAPD round {s['round_seconds']:.2f} = generation {s['generation']:.2f} + "
                     f"teacher {s['score']:.2f} + masks/rules {s['masks_rules']:.3f} + train {s['train']:.2f} + other "
                     f"{s['other']:.2f}")
    lines.append("")
    lines += [figure2_line(r) for r in results]
    return "\n".join(lines)


def plot(results: list[dict[str, Any]], png: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, len(results), figsize=(5.5 * len(results), 4), squeeze=False)
    colors = {"env": "tab:brown", "generation": "tab:blue", "score": "tab:orange", "masks_rules": "tab:gray",
              "train": "tab:green", "other": "white"}
    for ax, r in zip(axes[0], results):
        n = len(r["rounds"]["sapd"])
        for j, method in enumerate(("sapd", "online_opd")):
            xs = [k + (j - 0.5) * 0.38 for k in range(n)]
            bottom = [0.0] * n
            for s in PARTS:
                vals = [rr["stages"][s] for rr in r["rounds"][method]]
                ax.bar(xs, vals, 0.36, bottom=bottom, color=colors[s], label=s if j == 1 else None,
                       hatch="//" if method == "online_opd" else None, edgecolor="black", linewidth=0.4)
                bottom = [b + v for b, v in zip(bottom, vals)]
            ax.plot(xs, [rr["round_seconds"] for rr in r["rounds"][method]], "k_", markersize=14)
        ax.set_xticks(range(n))
        ax.set_xlabel("round (left bar SAPD, right bar hatched online OPD; — wall time)")
        ax.set_ylabel("seconds")
        ax.set_title(f"{r['env']}: online/SAPD {r['ratio_per_round']:.2f}× per round "
                     f"({r['trajectories_per_round']} trajectories, ≤ {r['horizon']} steps)")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--envs", "--env", nargs="+", default=list(DEFAULT_ENVS), choices=ENVS)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--games", type=int, default=None,
                    help="trajectories (SAPD) = games (online) per round (default 2; ALFWorld 6, one per task type)")
    ap.add_argument("--horizon", type=int, default=None,
                    help="steps per trajectory / episode (default 6, every trajectory cut to it; ALFWorld: at most, "
                         "default 50)")
    ap.add_argument("--group", type=int, default=4, help="SAPD's G (samples per prefix)")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--teacher-hidden", type=int, default=256)
    ap.add_argument("--teacher-layers", type=int, default=4)
    ap.add_argument("--alfworld-data", default=None, metavar="DIR",
                    help="ALFWorld games (ALFWORLD_DATA layout; default: generated with sapd alfworld-games)")
    ap.add_argument("--alfworld-split", default="train", choices=["train", "valid_seen", "valid_unseen"])
    ap.add_argument("--work", default=None, help="working folder (default: a temporary one)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--png", default=None)
    ap.add_argument("--quiet", action="store_true")
    args = ap.parse_args(argv)
    log = (lambda s: None) if args.quiet else print
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(args.work or tmp)
        results = [run_env(env, args, work, log) for env in args.envs]
    print(render(results))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    if args.png:
        plot(results, args.png)
    return results


if __name__ == "__main__":
    main()
