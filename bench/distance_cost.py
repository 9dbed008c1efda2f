"""What the distance to the teacher costs the demo, against the evaluation it sits beside, in the same run:
CPU seconds (this process's, so a machine shared with other work inflates neither side) of one model's
held-out evaluation as the demo makes it — greedy episodes on the held-out games and the greedy decisions
(:func:`sapd.demo.evaluation.evaluate_model`) — and of its distance to the teacher on the same held-out
decisions (:func:`sapd.demo.evaluation.heldout_distance`) at G = 2 (the demo's) and G = 4, each into a fresh
copy of the model's run root, one thread.

    .venv/bin/python bench/distance_cost.py DEMO_OUT [--model models/student]

DEMO_OUT is a finished ``sapd demo --out`` folder. Prints one JSON line per measurement and the ratios.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path

import torch

from sapd import checkpoints, layout
from sapd.data.prefixes import read_prefixes
from sapd.demo.evaluation import evaluate_model, heldout_distance
from sapd.demo.main import DemoConfig, Paths
from sapd.envs.panels import PanelSpec


def _fresh_root(src: Path, dest: Path) -> str:
    """The model's run root without its evaluations (so nothing is reused)."""
    shutil.copytree(src, dest, ignore=shutil.ignore_patterns("evals"))
    return str(dest)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("demo_out")
    ap.add_argument("--model", default="models/student", help="a run root under DEMO_OUT")
    args = ap.parse_args()
    torch.set_num_threads(1)
    cfg, p = DemoConfig(), Paths(Path(args.demo_out))
    rows = read_prefixes(str(p.heldout), "train").to_pylist()
    teacher = str(p.models / "teacher")
    panel = PanelSpec("textworld", families=tuple(cfg.families), games_per_family=cfg.test_games, seed=cfg.test_seed,
                      cache_dir=str(p.games))
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for what in ("evaluation", "distance G=2", "distance G=4"):
            root = _fresh_root(p.out / args.model, Path(tmp) / what.replace(" ", "_").replace("=", ""))
            k = layout.committed_checkpoints(root)[-1]
            t_cpu, t_wall = time.process_time(), time.perf_counter()
            if what == "evaluation":
                evaluate_model(root, k, panel=panel, rows=rows, horizon=cfg.horizon, max_new_tokens=cfg.max_new_tokens,
                               env_timeout_s=None, report=lambda *a: None)
            else:
                heldout_distance(root, k, teacher, rows, max_new_tokens=cfg.max_new_tokens,
                                 group_size=int(what[-1]))
            out[what] = {"cpu_seconds": time.process_time() - t_cpu, "wall_seconds": time.perf_counter() - t_wall}
            print(json.dumps({"measure": what, "model": args.model, "checkpoint": k,
                              "decisions": len(rows), **out[what]}), flush=True)
    base = out["evaluation"]["cpu_seconds"]
    print(json.dumps({"ratio_to_evaluation": {w: v["cpu_seconds"] / base for w, v in out.items()},
                      "checkpoints": str(checkpoints.checkpoint_model_path(str(p.out / args.model), k))}))


if __name__ == "__main__":
    main()
