"""SAPD vs online OPD per round, on TextWorld and ScienceWorld (issue 14 item 5; the paper's Figure 2).

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

Stage times per round: ``sample`` (SAPD: generation only; online: the rollouts, i.e. environment
resets/steps + prompt building + ``generation`` inside), ``score`` (teacher), ``masks_rules``, ``train``
(π_old, optimizer steps, checkpoint write). ``env`` = online sample − generation. ``round`` is the
wall time of the whole round (≥ the stage sum).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

from sapd import layout
from sapd.baselines.online import online_config, online_round
from sapd.config import config_from_dict, write_run_config
from sapd.data import scored, shards
from sapd.data.loaders import write_native_jsonl
from sapd.envs.base import EpisodeSpec
from sapd.envs.loop import LoopOptions, collect_expert
from sapd.models.byte_tokenizer import build_tokenizer
from sapd.models.loading import load_tokenizer
from sapd.models.tiny import build_tiny_model
from sapd.stages import build_prefixes, teacher_scores
from sapd.stages.train import run_train_stage

ENVS = ("textworld", "scienceworld")
STAGES = ("sample", "generation", "env", "score", "masks_rules", "train")


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


def _round_stages(timings: dict[str, float], train_s: float, online: bool) -> dict[str, float]:
    sample, gen = timings.get("sample_seconds", 0.0), timings.get("generation_seconds", 0.0)
    return {"sample": sample, "generation": gen if online else sample, "env": max(sample - gen, 0.0) if online else 0.0,
            "score": timings.get("score_seconds", 0.0), "masks_rules": timings.get("masks_rules_seconds", 0.0),
            "train": train_s}


def run_env(env: str, args: argparse.Namespace, work: Path, log: Callable[[str], None]) -> dict[str, Any]:
    specs = env_specs(env, args.games, work / "games")
    t0 = time.perf_counter()
    expert = collect_expert(specs, env, LoopOptions(horizon=args.horizon))
    expert_s = time.perf_counter() - t0
    short = [t.id for t in expert if len(t.turns) < args.horizon]
    if short:
        raise RuntimeError(f"{env}: expert episodes {short} are shorter than --horizon {args.horizon}; lower it "
                           "so both methods see the same decisions")
    for t in expert:
        t.turns = t.turns[:args.horizon]
    data = work / env / "expert.jsonl"
    data.parent.mkdir(parents=True, exist_ok=True)
    write_native_jsonl(expert, str(data))
    tok = build_tokenizer([data.read_text()], work / env / "tok")
    student, teacher = work / env / "student", work / env / "teacher"
    build_tiny_model(tok, student, hidden_size=args.hidden, layers=args.layers, heads=4, kv_heads=2,
                     intermediate_size=4 * args.hidden, seed=0)
    build_tiny_model(tok, teacher, hidden_size=args.teacher_hidden, layers=args.teacher_layers, heads=4,
                     kv_heads=2, intermediate_size=4 * args.teacher_hidden, seed=1)
    n = args.games * args.horizon

    def cfg_for(name: str):
        return config_from_dict({
            "run_root": str(work / env / name), "variant": "sapd",
            "data": {"input": str(data), "format": "native", "benchmark": env, "max_prompt_tokens": None,
                     "val_fraction": 0.0},
            "model": {"student": str(student), "teacher": str(teacher)},
            "sampling": {"group_size": args.group, "max_new_tokens": args.new_tokens, "prompts_per_batch": 4},
            "train": {"rounds": args.rounds, "trajectories_per_round": args.games, "minibatch_prefixes": n,
                      "micro_batch_prefixes": n, "lr": 1e-4, "seed": 0}})

    sapd_cfg = cfg_for("sapd")
    opd_cfg = online_config(dataclasses.replace(cfg_for("online_opd")), "online_opd")
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
    rounds: dict[str, list[dict[str, Any]]] = {"sapd": [], "online_opd": []}
    for k in range(args.rounds):
        # SAPD round k
        t0 = time.perf_counter()
        sapd_gen = teacher_scores.student_generator(sapd_cfg, k, tokenizer, reuse=sapd_gen)
        result = teacher_scores.run_worker(sapd_cfg, k, 0, sapd_gen, sapd_teacher, tokenizer, **quiet)
        scored.commit_round(sapd_cfg, k)
        t1 = time.perf_counter()
        run_train_stage(sapd_cfg, k, **quiet)
        train_s = time.perf_counter() - t1
        manifest = shards.read_manifest(layout.scored_dir(sapd_cfg.run_root, k)) or {}
        rounds["sapd"].append({"round": k, "decisions": result.rows, "responses": result.rows * args.group,
                               "generated_tokens": manifest.get("generated_tokens", 0),
                               "round_seconds": time.perf_counter() - t0,
                               "stages": _round_stages(result.timings, train_s, online=False)})
        # online OPD round k
        t0 = time.perf_counter()
        opd_gen = teacher_scores.student_generator(opd_cfg, k, tokenizer, reuse=opd_gen)
        summary = online_round(opd_cfg, k, specs, "online_opd", tokenizer, generator=opd_gen, teacher=opd_teacher,
                               horizon=args.horizon, **quiet)
        t1 = time.perf_counter()
        run_train_stage(opd_cfg, k, **quiet)
        train_s = time.perf_counter() - t1
        decisions = round(summary["mean_steps"] * summary["episodes"])
        rounds["online_opd"].append({"round": k, "decisions": decisions, "responses": decisions,
                                     "rows": summary["rows"], "generated_tokens": summary["generated_tokens"],
                                     "round_seconds": time.perf_counter() - t0,
                                     "stages": _round_stages(summary["timings"], train_s, online=True)})
        log(f"{env} round {k}: SAPD {rounds['sapd'][-1]['round_seconds']:.1f}s, "
            f"online OPD {rounds['online_opd'][-1]['round_seconds']:.1f}s")
    out: dict[str, Any] = {"env": env, "decisions_per_round": n, "group": args.group,
                           "expert_collection_seconds": expert_s, "rounds": rounds, "median": {}}
    for method, rs in rounds.items():
        med = {"round_seconds": statistics.median(r["round_seconds"] for r in rs)}
        for s in STAGES:
            med[s] = statistics.median(r["stages"][s] for r in rs)
        med["per_decision_seconds"] = med["round_seconds"] / max(rs[0]["decisions"], 1)
        med["per_response_seconds"] = med["round_seconds"] / max(rs[0]["responses"], 1)
        out["median"][method] = med
    m = out["median"]
    out["ratio_same_decisions"] = m["online_opd"]["round_seconds"] / m["sapd"]["round_seconds"]
    out["ratio_same_responses"] = m["online_opd"]["per_response_seconds"] / m["sapd"]["per_response_seconds"]
    return out


def render(results: list[dict[str, Any]]) -> str:
    lines = []
    for r in results:
        lines.append(f"\n## {r['env']}: {r['decisions_per_round']} decisions per round, SAPD G={r['group']}; "
                     f"median over {len(r['rounds']['sapd'])} rounds (seconds)")
        lines.append("| method | round | sample | of it: env | of it: generation | teacher score | masks/rules "
                     "| train | other | responses/round | s per decision | s per response |")
        lines.append("|---|---|---|---|---|---|---|---|---|---|---|---|")
        for method in ("sapd", "online_opd"):
            m = r["median"][method]
            other = m["round_seconds"] - sum(m[s] for s in ("sample", "score", "masks_rules", "train"))
            lines.append(f"| {method} | {m['round_seconds']:.2f} | {m['sample']:.2f} | {m['env']:.2f} | "
                         f"{m['generation']:.2f} | {m['score']:.2f} | {m['masks_rules']:.3f} | {m['train']:.2f} | "
                         f"{other:.2f} | {r['rounds'][method][0]['responses']} | {m['per_decision_seconds']:.3f} | "
                         f"{m['per_response_seconds']:.4f} |")
        o, s = r["median"]["online_opd"], r["median"]["sapd"]
        lines.append(f"ratio online/SAPD per round at the same decisions: {r['ratio_same_decisions']:.2f}×; "
                     f"per sampled response: {r['ratio_same_responses']:.2f}×")
        lines.append(f"online round = env {o['env']:.2f} + generation {o['generation']:.2f} + teacher {o['score']:.2f} "
                     f"+ train {o['train']:.2f} (+ rest); SAPD round = generation {s['generation']:.2f} + teacher "
                     f"{s['score']:.2f} + train {s['train']:.2f} (+ rest)")
    return "\n".join(lines)


def plot(results: list[dict[str, Any]], png: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, len(results), figsize=(5.5 * len(results), 4), squeeze=False)
    colors = {"env": "tab:brown", "generation": "tab:blue", "score": "tab:orange", "masks_rules": "tab:gray",
              "train": "tab:green"}
    for ax, r in zip(axes[0], results):
        n = len(r["rounds"]["sapd"])
        for j, method in enumerate(("sapd", "online_opd")):
            xs = [k + (j - 0.5) * 0.38 for k in range(n)]
            bottom = [0.0] * n
            for s in ("env", "generation", "score", "masks_rules", "train"):
                vals = [rr["stages"][s] for rr in r["rounds"][method]]
                ax.bar(xs, vals, 0.36, bottom=bottom, color=colors[s], label=s if j == 1 else None,
                       hatch="//" if method == "online_opd" else None, edgecolor="black", linewidth=0.4)
                bottom = [b + v for b, v in zip(bottom, vals)]
            ax.plot(xs, [rr["round_seconds"] for rr in r["rounds"][method]], "k_", markersize=14)
        ax.set_xticks(range(n))
        ax.set_xlabel("round (left bar SAPD, right bar hatched online OPD; — wall time)")
        ax.set_ylabel("seconds")
        ax.set_title(f"{r['env']}: online/SAPD {r['ratio_same_decisions']:.2f}× "
                     f"({r['decisions_per_round']} decisions/round)")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--envs", nargs="+", default=list(ENVS), choices=ENVS)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--games", type=int, default=2, help="trajectories (SAPD) = games (online) per round")
    ap.add_argument("--horizon", type=int, default=6, help="decisions per trajectory / episode")
    ap.add_argument("--group", type=int, default=4, help="SAPD's G (samples per prefix)")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--teacher-hidden", type=int, default=256)
    ap.add_argument("--teacher-layers", type=int, default=4)
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
