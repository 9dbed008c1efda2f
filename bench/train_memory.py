"""Peak memory of the training stage (one SAPD round: π_old recompute, then optimizer steps) for a tiny
model and a 135M-parameter model with SmolLM2-135M's architecture (random weights: no download).

    .venv/bin/python bench/train_memory.py [--models tiny,135m] [--before main]

Each training stage runs in a fresh subprocess over a prepared run root; the script prints that
process's peak RSS, the RSS of the same process right after loading the model (the baseline it
pays before training), and the difference. With ``--before REV`` the same stage also runs, over the
same run root (copied), on the code of git revision REV (extracted with ``git archive`` into a temporary
folder, first on ``PYTHONPATH``), in the same run: the table then has a before and an after row per
model and the ratio of the peaks.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SHAPES = {
    "tiny": dict(arch="qwen2", hidden_size=64, layers=2, heads=4, kv_heads=2, intermediate_size=128),
    # SmolLM2-135M: Llama, 30 layers, hidden 576, 9 heads / 3 KV heads, MLP 1536, vocab 49152, tied embeddings
    "135m": dict(arch="llama", hidden_size=576, layers=30, heads=9, kv_heads=3, intermediate_size=1536,
                 vocab_size=49152),
}

CHILD = r"""
import json, resource, sys
import sapd
assert sapd.__file__.startswith(sys.argv[2]), (sapd.__file__, sys.argv[2])  # the code under test
from sapd.config import config_from_dict
from sapd import checkpoints
cfg = config_from_dict(json.loads(sys.argv[1]))
checkpoints.load_checkpoint_model(cfg.run_root, 0, trainable=True)
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
from sapd.stages.train import run_train_stage
run_train_stage(cfg, 0, log=lambda s: None, show_progress=False)
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"baseline_kib": base, "peak_kib": peak}))
"""


def prepare(name: str, tmp: Path, checkpointing: bool) -> dict:
    from sapd import checkpoints
    from sapd.config import config_from_dict
    from sapd.data.scored import commit_round
    from sapd.models.byte_tokenizer import SAMPLE_DATA, build_sample_tokenizer
    from sapd.models.generation import HFGenerator
    from sapd.models.loading import load_causal_lm, load_tokenizer
    from sapd.models.scoring import score_groups
    from sapd.models.tiny import build_tiny_model
    from sapd.stages.build_prefixes import ensure_initial_checkpoint, ensure_prefixes
    from sapd.stages.teacher_scores import run_worker

    tok = build_sample_tokenizer(tmp / "tok")
    model_dir = tmp / name
    model = build_tiny_model(tok, model_dir, **SHAPES[name.removesuffix("+ckpt")])
    n_params = sum(p.numel() for p in model.parameters())
    del model
    raw = {"run_root": str(tmp / f"run-{name}"),
           "data": {"input": str(SAMPLE_DATA / "alfworld_eto.json"), "format": "eto", "benchmark": "alfworld"},
           "model": {"student": str(model_dir), "teacher": str(model_dir)},
           "sampling": {"group_size": 4, "max_new_tokens": 32},
           "train": {"rounds": 1, "trajectories_per_round": 1, "minibatch_prefixes": 4, "micro_batch_prefixes": 2,
                     "lr": 1e-5, "gradient_checkpointing": checkpointing}}
    cfg = config_from_dict(raw)
    tokenizer = load_tokenizer(str(model_dir))
    quiet = dict(log=lambda s: None, show_progress=False)
    ensure_prefixes(cfg, tokenizer, **quiet)
    ensure_initial_checkpoint(cfg, lambda s: None)
    teacher = load_causal_lm(str(model_dir))
    gen = HFGenerator(checkpoints.load_checkpoint_model(cfg.run_root, 0), tokenizer)
    run_worker(cfg, 0, 0, gen, lambda g, progress=None: score_groups(teacher, g, pad_id=tokenizer.pad_token_id),
                      tokenizer, **quiet)
    commit_round(cfg, 0)
    return {"raw": raw, "params": n_params}


def run_child(raw: dict, code: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": str(code)}
    out = subprocess.run([sys.executable, "-c", CHILD, json.dumps(raw), str(code)], capture_output=True,
                         text=True, cwd=code, env=env)
    if out.returncode != 0:
        raise SystemExit(f"training stage on {code} failed:\n{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def extract(rev: str, dest: Path) -> Path:
    dest.mkdir(parents=True)
    archive = subprocess.run(["git", "archive", rev], cwd=REPO, capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)
    return dest


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="tiny,135m,135m+ckpt",
                    help="comma-separated; '+ckpt' turns on gradient checkpointing")
    ap.add_argument("--before", default=None, help="git revision to measure too, in the same run (e.g. main)")
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        before_code = extract(args.before, Path(tmp) / "before") if args.before else None
        for name in args.models.split(","):
            print(f"{name}: preparing the run root (prefixes, one sampled and scored round)", flush=True)
            prep = prepare(name, Path(tmp), name.endswith("+ckpt"))
            runs = [("after", REPO, prep["raw"])]
            if before_code:  # the same committed inputs (prefixes, round 0's shards, checkpoint 0), copied
                root = prep["raw"]["run_root"] + "-before"
                shutil.copytree(prep["raw"]["run_root"], root)
                runs.insert(0, (f"before ({args.before})", before_code, {**prep["raw"], "run_root": root}))
            for label, code, raw in runs:
                print(f"{name}: training stage, {label} code", flush=True)
                res = run_child(raw, code)  # type: ignore[arg-type]
                rows.append((name, label, prep["params"], res["baseline_kib"] / 1024, res["peak_kib"] / 1024))
                print(f"{name} ({label}): RSS after load {rows[-1][3]:.0f} MB, peak {rows[-1][4]:.0f} MB", flush=True)
    print(f"{'model':>10} {'code':>14} {'params':>10} {'RSS after load':>15} {'peak RSS':>10} {'training adds':>14}")
    for name, label, n, base, peak in rows:
        print(f"{name:>10} {label:>14} {n / 1e6:9.1f}M {base:13.0f} MB {peak:8.0f} MB {peak - base:11.0f} MB")
    if args.before:
        for name in dict.fromkeys(r[0] for r in rows):
            after, before = [r[4] for r in rows if r[0] == name and r[1] == "after"], \
                [r[4] for r in rows if r[0] == name and r[1] != "after"]
            print(f"{name}: peak RSS after / before = {after[0] / before[0]:.3f}")


if __name__ == "__main__":
    main()
