"""How far a run's weights move at lr 1e-6 in float32 and in bf16: ``sapd run`` (its own sampling, scoring
and training, round after round) on the tests' tiny Qwen2 and the shipped ALFWorld sample, then the
share of the student's bf16 weights that differ from checkpoint 0 and the norm of that change. A bf16
checkpoint changes only where the weights the optimizer keeps have crossed half a bf16 step, so the
float32 run's weights are rounded to bf16 for the comparison (like with like).

It runs the code on ``PYTHONPATH``, through interfaces every sapd version has (``run_pipeline``,
``checkpoints.load_checkpoint_model``), so the same command measures an older checkout too::

    .venv/bin/python bench/bf16_updates.py --out /tmp/bf16-now
    git worktree add /tmp/before d2c6d15 && PYTHONPATH=/tmp/before .venv/bin/python bench/bf16_updates.py \\
        --out /tmp/bf16-before        # sapd before the fp32 master: a bf16 run keeps ~2 % of its updates

Arms (``--arms``): ``float32`` (torch engine), ``bf16`` (torch engine), ``bf16-zero1/2/3`` (DeepSpeed
in this one process, ``DS_ACCELERATOR=cpu`` on a CPU). Writes ``bf16_updates.json`` into ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="scratch and result folder")
    ap.add_argument("--rounds", type=int, default=4, help="rounds per run (4: 34 optimizer steps)")
    ap.add_argument("--arms", nargs="+", default=["float32", "bf16", "bf16-zero2"])
    args = ap.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")

    import torch

    import sapd
    from sapd import checkpoints
    from sapd.config import config_from_dict
    from sapd.models.byte_tokenizer import SAMPLE_DATA, build_sample_tokenizer
    from sapd.models.tiny import build_tiny_model
    from sapd.run.local import run_pipeline
    from sapd.run.report import read_step_log

    out = Path(args.out)
    models = out / "models"
    if not (models / "teacher" / "config.json").exists():
        tok = build_sample_tokenizer(models / "tokenizer")
        build_tiny_model(tok, models / "student", seed=0)
        build_tiny_model(tok, models / "teacher", seed=1)

    def bf16_weights(root: str, k: int) -> Any:
        model = checkpoints.load_checkpoint_model(root, k, "float32")
        return torch.cat([p.detach().to(torch.bfloat16).float().reshape(-1) for p in model.parameters()])

    rows: dict[str, Any] = {}
    for arm in args.arms:
        dtype = "float32" if arm == "float32" else "bfloat16"
        engine, stage = ("deepspeed", int(arm[-1])) if "zero" in arm else ("torch", 2)
        root = str(out / arm)
        cfg = config_from_dict({
            "run_root": root, "variant": "sapd",
            "data": {"input": str(SAMPLE_DATA / "alfworld_eto.json"), "format": "eto", "benchmark": "alfworld",
                     "max_prompt_tokens": 2048},
            "model": {"student": str(models / "student"), "teacher": str(models / "teacher"), "dtype": dtype},
            "sampling": {"group_size": 2, "max_new_tokens": 12, "prompts_per_batch": 4},
            "train": {"rounds": args.rounds, "trajectories_per_round": 3, "minibatch_prefixes": 2,
                      "micro_batch_prefixes": 2, "lr": 1e-6, "seed": 0, "engine": engine, "zero_stage": stage}})
        t0 = time.perf_counter()
        run_pipeline(cfg, log=lambda s: None, show_progress=False)
        w0, w = bf16_weights(root, 0), bf16_weights(root, args.rounds)
        rows[arm] = {"optimizer_steps": len(read_step_log(root)), "changed_share": float((w != w0).double().mean()),
                     "change_norm": float((w - w0).norm()), "seconds": time.perf_counter() - t0}
        print(f"{arm}: {rows[arm]['changed_share']:.2%} of the bf16 weights changed over "
              f"{rows[arm]['optimizer_steps']} steps, ‖Δ‖ {rows[arm]['change_norm']:.3e}", flush=True)
    result = {"code": str(Path(sapd.__file__).parent.parent), "rounds": args.rounds, "lr": 1e-6, "arms": rows}
    (out / "bf16_updates.json").write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
