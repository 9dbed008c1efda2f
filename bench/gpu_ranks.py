"""What one GPU can prove of the multi-rank training path (``train.engine: deepspeed``, ZeRO-2, bfloat16 with
the fp32 master, NCCL): a world of one on the GPU, under torchrun, running the code every rank of a cluster
runs —

* the DeepSpeed engine's round on CUDA tensors, through the train job's own stage (``run_train_stage``);
* the exchange of the recomputed π_old (``all_gather_object``, a world of one included) and the float64
  all-reduce of each step's metrics, both through the process group's backend with CUDA tensors where the
  backend is NCCL;
* the sharded optimizer checkpoint: checkpoint 1's moments and fp32 master written as DCP ShardedTensors
  placed ``rank:r/cuda:N``, then resumed exactly — a second engine built from checkpoint 1 holds bit for bit
  the moments, master and bf16 weights the first one saved.

Two ranks cannot share one GPU under NCCL (it refuses a duplicate device), and gloo reduces CUDA tensors only
in broadcast and all-reduce, which ZeRO-2's reduce-scatter is not: several ranks on CUDA (ZeRO's partitions
split for real, ranks waiting in a collective while rank 0 uploads, the two-pod rendezvous) need a node of
several GPUs. The dry run proves the same code on 2 CPU ranks over gloo.

    bash bench/gpu_check.sh --only ranks           # one GPU, ≤ 5 min: bench/results/ranks.{md,json}
    python bench/gpu_ranks.py --dry-run --out X    # CPU: 2 ranks over gloo
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from proof_util import folders

REPO = Path(__file__).resolve().parents[1]
SAMPLES = REPO / "sapd" / "sample_data"
# a Qwen2.5-0.5B shape on the GPU (a 152k vocabulary); the dry run's is tiny, on the sample-trained tokenizer
GPU_SHAPE = dict(hidden_size=896, layers=24, heads=14, kv_heads=2, intermediate_size=4864, vocab_size=151936)
DRY_SHAPE = dict(hidden_size=64, layers=2, heads=4, kv_heads=2, intermediate_size=128)


def prepare(work: Path, dry: bool) -> Path:
    """Models, the prefix build, checkpoint 0 and round 0's scores (HF, this process), and the run config the
    ranks train with → its path."""
    from sapd.config import config_from_dict, dump_config
    from sapd.models.byte_tokenizer import build_sample_tokenizer
    from sapd.models.loading import load_tokenizer
    from sapd.models.tiny import build_tiny_model
    from sapd.stages import teacher_scores
    from sapd.stages.build_prefixes import ensure_initial_checkpoint, ensure_prefixes

    tok = build_sample_tokenizer(work / "tokenizer")
    shape = DRY_SHAPE if dry else GPU_SHAPE
    for name, seed in (("student", 0), ("teacher", 1)):
        build_tiny_model(tok, work / name, seed=seed, max_positions=4096, **shape)
    cfg = config_from_dict({
        "run_root": str(work / "run"),
        "data": {"input": str(SAMPLES / "alfworld_eto.json"), "format": "eto", "benchmark": "alfworld",
                 "val_fraction": 0.0},
        "model": {"student": str(work / "student"), "teacher": str(work / "teacher"), "dtype": "bfloat16",
                  "device": "cpu" if dry else "cuda"},
        "sampling": {"backend": "hf", "group_size": 2 if dry else 8, "max_new_tokens": 8 if dry else 64},
        "train": {"rounds": 1, "trajectories_per_round": 2, "minibatch_prefixes": 4, "micro_batch_prefixes": 2,
                  "engine": "deepspeed", "zero_stage": 2, "lr": 1e-5},
        "validation": {"every_rounds": 0}})
    quiet: dict[str, Any] = dict(log=lambda s: None, show_progress=False)
    tokenizer = load_tokenizer(cfg.model.student)
    ensure_prefixes(cfg, tokenizer, **quiet)
    ensure_initial_checkpoint(cfg, lambda s: None)
    teacher_scores.run_worker(cfg, 0, 0, teacher_scores.student_generator(cfg, 0, tokenizer),
                              teacher_scores.teacher_scorer(cfg, tokenizer), tokenizer, **quiet)
    path = work / "ranks.yaml"
    path.write_text(dump_config(cfg, as_written=False))  # the values this process resolved: every rank the same
    return path


def worker(config: str, out: str) -> int:
    """One rank: train round 0 through the train stage with the trainer kept, recording every collective of the
    path and the placements of the optimizer shards it saves; then build a second trainer from checkpoint 1
    and compare what it holds with the kept one, bit for bit."""
    import torch
    import torch.distributed as dist

    from sapd import checkpoints
    from sapd.config import load_config
    from sapd.stages import train
    from sapd.stages.context import Engines

    cfg = load_config(config)
    calls: list[dict[str, Any]] = []
    placements: set[str] = set()
    real_gather, real_reduce, real_state = dist.all_gather_object, dist.all_reduce, checkpoints._dcp_state_dict

    def gather(*a: Any, **k: Any) -> Any:
        callers = [sys._getframe(i).f_code.co_name for i in range(1, 4)]  # who asked: the π_old exchange, DCP, …
        calls.append({"op": "all_gather_object", "backend": str(dist.get_backend()), "callers": callers})
        return real_gather(*a, **k)

    def reduce(*a: Any, **k: Any) -> Any:
        tensor = a[0] if a else k["tensor"]
        calls.append({"op": "all_reduce", "dtype": str(tensor.dtype), "device": str(tensor.device),
                      "backend": str(dist.get_backend())})
        return real_reduce(*a, **k)

    def state_dict(shard: Any) -> Any:
        out_ = real_state(shard)
        for value in out_.values():
            meta = getattr(value, "metadata", None)
            if callable(meta):
                placements.update(str(s.placement) for s in meta().shards_metadata)
        return out_

    dist_patch = {"all_gather_object": gather, "all_reduce": reduce}
    for name, fn in dist_patch.items():
        setattr(dist, name, fn)
    checkpoints._dcp_state_dict = state_dict
    try:
        engines = Engines(keep=True, keep_trainer=True, release=False)
        t0 = time.perf_counter()
        train.run_train_stage(cfg, 0, log=lambda s: None, show_progress=False, engines=engines)
        round_seconds = time.perf_counter() - t0
    finally:
        for name, fn in (("all_gather_object", real_gather), ("all_reduce", real_reduce)):
            setattr(dist, name, fn)
        checkpoints._dcp_state_dict = real_state
    kept = engines.trainer.engine
    fresh = train.load_trainer(cfg, 1, log=lambda s: None).engine
    a, b = kept.optimizer_shard(), fresh.optimizer_shard()
    mismatched = [i for i, (fa, fb) in enumerate(zip(a.fragments, b.fragments))
                  if [s for s, _ in fa] != [s for s, _ in fb]
                  or any(not torch.equal(va[key], vb[key]) for (_, va), (_, vb) in zip(fa, fb) for key in a.keys)]
    weights_equal = all(torch.equal(p, q) for p, q in zip(kept.module.parameters(), fresh.module.parameters()))
    views = [v for frags in a.fragments for _, vs in frags for v in vs.values()]
    rank = dist.get_rank()
    result = {"rank": rank, "world_size": dist.get_world_size(), "backend": str(dist.get_backend()),
              "device": str(next(kept.module.parameters()).device), "state_keys": list(a.keys),
              "state_devices": sorted({str(v.device) for v in views}), "collectives": calls,
              "shard_placements": sorted(placements), "round_seconds": round_seconds,
              "resumed_state_equal": not mismatched and a.keys == b.keys, "mismatched_parameters": mismatched[:5],
              "resumed_weights_equal": weights_equal}
    Path(f"{out}.rank{rank}.json").write_text(json.dumps(result, indent=2))
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--dry-run", action="store_true", help="CPU: 2 ranks over gloo")
    ap.add_argument("--work", default=None)
    ap.add_argument("--keep", action="store_true")
    ap.add_argument("--worker", nargs=2, metavar=("CONFIG", "OUT"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        return worker(*args.worker)
    import torch

    t_all = time.perf_counter()
    dry = args.dry_run
    made = folders(args.out, args.work, "ranks-work", dry=dry, cuda=torch.cuda.is_available())
    if made is None:
        return 2
    out, work = made
    if dry:
        os.environ["DS_ACCELERATOR"] = "cpu"
    config = prepare(work, dry)
    world = 2 if dry else 1
    import socket
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = str(sock.getsockname()[1])
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE",
           "TORCH_EXTENSIONS_DIR": os.environ.get("TORCH_EXTENSIONS_DIR", str(REPO / ".cache" / "torch_extensions"))}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(world), "--master-addr",
           "127.0.0.1", "--master-port", port, str(Path(__file__).resolve()), "--worker", str(config),
           str(work / "rank")]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    torchrun_seconds = time.perf_counter() - t0
    if proc.returncode != 0:
        print((proc.stdout + proc.stderr)[-4000:], flush=True)
        return 1
    ranks = [json.loads(Path(f"{work / 'rank'}.rank{r}.json").read_text()) for r in range(world)]
    device = "cpu" if dry else "cuda"
    checks = {
        f"every rank trained on {device}": all(r["device"].startswith(device) for r in ranks),
        "the optimizer state (moments, fp32 master) lives on the device": all(
            set(r["state_keys"]) >= {"exp_avg", "exp_avg_sq", "master"} and
            all(d.startswith(device) for d in r["state_devices"]) for r in ranks),
        "π_old exchanged through the process group (all_gather_object)": all(
            any(c["op"] == "all_gather_object" and "recompute_old_logprobs" in c["callers"] for c in r["collectives"])
            for r in ranks),
        f"step metrics all-reduced in float64 on {device}": all(
            any(c["op"] == "all_reduce" and c["dtype"] == "torch.float64" and c["device"].startswith(device)
                for c in r["collectives"]) for r in ranks),
        f"optimizer shards saved as rank:r/{device}": bool(ranks[0]["shard_placements"]) and all(
            p.startswith("rank:") and p.split("/", 1)[1].startswith(device)
            for r in ranks for p in r["shard_placements"]),
        "resumed exactly: moments and master bit for bit": all(r["resumed_state_equal"] for r in ranks),
        "resumed exactly: bf16 weights bit for bit": all(r["resumed_weights_equal"] for r in ranks)}
    if not dry:
        checks["at most 5 minutes"] = time.perf_counter() - t_all <= 300
    results = {"mode": "dry-run (CPU, 2 ranks over gloo)" if dry else "GPU, a world of one over NCCL",
               "device": torch.cuda.get_device_name(0) if not dry else "cpu", "torch": torch.__version__,
               "world_size": world, "ranks": ranks, "torchrun_seconds": torchrun_seconds,
               "seconds": time.perf_counter() - t_all, "checks": checks,
               "needs_several_gpus": ["ZeRO's partitions split over ranks on CUDA (reduce-scatter over NCCL)",
                                      "ranks waiting in a collective while rank 0 uploads a checkpoint "
                                      "(NCCL's timeout)",
                                      "the two-pod torchrun rendezvous on GPUs"]}
    lines = [f"mode: {results['mode']}; device: {results['device']}; torch {results['torch']}; "
             f"{results['seconds']:.0f} s in all (torchrun {torchrun_seconds:.0f} s)", "",
             "| rank | backend | device | collectives | shard placements | round s |", "|---|---|---|---|---|---|"]
    for r in ranks:
        ops = sorted({f"{c['op']}" + (f" {c.get('dtype', '')} {c.get('device', '')}" if c["op"] == "all_reduce" else "")
                      for c in r["collectives"]})
        lines.append(f"| {r['rank']} | {r['backend']} | {r['device']} | {'; '.join(ops)} | "
                     f"{', '.join(r['shard_placements'])} | {r['round_seconds']:.1f} |")
    lines += ["", "checks:"] + [f"- {'ok' if ok else 'FAILED'}: {name}" for name, ok in checks.items()]
    lines += ["", "what only a node of several GPUs shows:"] + [f"- {x}" for x in results["needs_several_gpus"]]
    table = "\n".join(lines)
    print("\n" + table, flush=True)
    (out / "ranks.json").write_text(json.dumps(results, indent=2, default=str) + "\n")
    (out / "ranks.md").write_text(f"# The multi-rank path on one GPU ({results['mode']})\n\n{table}\n")
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
