"""Host memory of a checkpoint's optimizer state: the peak memory each rank adds while the training stage
saves a checkpoint and while it loads one back, with 1 and with 2 ranks (DeepSpeed ZeRO, gloo, CPU),
as a multiple of the whole optimizer state (AdamW's ``exp_avg`` + ``exp_avg_sq`` in fp32, 8 bytes per
parameter). The model is a Qwen2 shape built from its config (random weights: no download), trained one
step so the optimizer has state; saving and loading go through the library exactly as
``sapd/stages/train.py`` calls it.

    python bench/checkpoint_memory.py --before bb6bd6f --out bench/results      # before vs after
    python bench/checkpoint_memory.py --shape tiny --out /tmp/cm                # the quick check

``--before REV`` runs the same measurement on the code at git revision REV (a ``git worktree`` of it, on
``PYTHONPATH``): that code gathers the whole optimizer state on every rank and serialises it on rank 0.
"Peak" is the largest resident set (Linux ``VmHWM``, reset through ``/proc/self/clear_refs`` just
before) minus the resident set just before the call: what saving or loading adds to what the rank holds
for training. Loading includes creating the rank's own share of the state (1/W of it: the training
needs it anyway). Weights are written in shards of ``--weight-shard-mb`` (the ``train.checkpoint_shard_mb``
setting; what rank 0 holds of the weights while saving). Timings and memory on a shared machine are
upper bounds. The last line: ``checkpoint memory: rank-0 peak / whole state = X (W ranks)``, X the larger
of rank 0's save and load peaks, W the most ranks measured, for the code under test (after).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]

# Qwen2-shaped models (hidden, layers, heads, kv heads, intermediate, vocabulary); tied embeddings
SHAPES: dict[str, dict[str, int]] = {
    "tiny": dict(hidden_size=64, layers=2, heads=4, kv_heads=2, intermediate_size=128, vocab_size=4096),
    "110m": dict(hidden_size=768, layers=12, heads=12, kv_heads=4, intermediate_size=3072, vocab_size=32000),
    "0.5b": dict(hidden_size=896, layers=24, heads=14, kv_heads=2, intermediate_size=4864, vocab_size=151936),
}


# --------------------------------------------------------------------------------------------------
# one rank (run under torchrun with the code under test on PYTHONPATH)


def _rss_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return int(re.search(rf"{field}:\s+(\d+)", f.read()).group(1))  # type: ignore[union-attr]


def _reset_peak() -> int:
    """Resets VmHWM to the current resident set; → that resident set in bytes."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _rss_kib("VmRSS") * 1024


def _peak_since(base: int) -> int:
    return max(0, _rss_kib("VmHWM") * 1024 - base)


def worker(model_dir: str, work: str, zero: int, shard_mb: float, out: str) -> None:
    import gc

    import torch

    from sapd import checkpoints
    from sapd.config import config_from_dict
    from sapd.engines.deepspeed_engine import make_deepspeed_engine
    from sapd.models.loading import load_causal_lm, load_tokenizer
    from sapd.models.scoring import response_logprobs

    cfg = config_from_dict({"run_root": work, "train": {"engine": "deepspeed", "zero_stage": zero, "lr": 1e-5,
                                                        "micro_batch_prefixes": 1, "minibatch_prefixes": 1}})
    engine = make_deepspeed_engine(load_causal_lm(model_dir, trainable=True), cfg)
    rank, world = engine.rank, engine.world_size
    tokenizer = load_tokenizer(model_dir)
    vocab = engine.module.config.vocab_size
    g = torch.Generator().manual_seed(rank)
    prompts = [torch.randint(5, vocab, (16,), generator=g).tolist()]
    responses = [torch.randint(5, vocab, (8,), generator=g).tolist()]
    engine.model.train()
    logp, mask = response_logprobs(engine.model, prompts, responses, 0)
    engine.backward(-(logp * mask).sum() / mask.sum())
    engine.step(1e-5)  # the optimizer now has state
    numel = sum(int(getattr(p, "ds_numel", p.numel())) for p in engine.module.parameters())
    whole = 2 * 4 * numel
    sharded = hasattr(engine, "optimizer_shard")  # the code under test: sharded, or the whole state gathered
    root = work
    trainer: dict[str, Any] = {"global_step": 1, "round": 1}
    engine.barrier()
    gc.collect()

    base = _reset_peak()
    t0 = time.perf_counter()
    if sharded:
        checkpoints.save_checkpoint(root, 1, engine.module, tokenizer, trainer, gather=engine.gather,
                                    is_main=engine.is_main, max_shard_bytes=int(shard_mb * 2**20),
                                    optimizer=engine.optimizer_shard())
    else:  # as sapd/stages/train.py called it before: the whole state in trainer.pt
        trainer["optimizer"] = engine.optimizer_state()
        checkpoints.save_checkpoint(root, 1, engine.module, tokenizer, trainer, gather=engine.gather,
                                    is_main=engine.is_main, max_shard_bytes=int(shard_mb * 2**20))
        del trainer["optimizer"]
    save_s = time.perf_counter() - t0
    save_peak = _peak_since(base)
    engine.barrier()

    # a fresh start of the next round: no optimizer state yet, then the checkpoint's loaded back
    inner = getattr(engine.model.optimizer, "optimizer", engine.model.optimizer)
    inner.state.clear()
    for p in engine.module.parameters():  # ZeRO-1/2 keep views of the state per parameter: drop them too
        if getattr(p, "_hp_mapping", None) is not None:
            p._hp_mapping.optim_fragment = {}
    gc.collect()
    engine.barrier()
    base = _reset_peak()
    t0 = time.perf_counter()
    state = checkpoints.load_trainer_state(root, 1)
    if sharded:
        checkpoints.restore_optimizer(root, 1, engine, state, log=lambda s: None)
    else:
        engine.load_optimizer_state(state["optimizer"])
    del state
    load_s = time.perf_counter() - t0
    load_peak = _peak_since(base)
    engine.barrier()
    with open(f"{out}.rank{rank}.json", "w") as f:
        json.dump({"rank": rank, "world": world, "parameters": numel, "whole_state_bytes": whole,
                   "save_peak_bytes": save_peak, "load_peak_bytes": load_peak,
                   "save_seconds": save_s, "load_seconds": load_s, "sharded": sharded}, f)


# --------------------------------------------------------------------------------------------------
# the driver


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def build_model(work: Path, shape: dict[str, int]) -> str:
    """A tokenizer from the shipped samples and a Qwen2 model of ``shape`` saved as an HF folder."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from sapd.models.byte_tokenizer import build_tokenizer
    out = work / "model"
    samples = REPO / "sapd" / "sample_data"
    texts = [p.read_text(encoding="utf-8") for p in sorted(samples.iterdir()) if p.suffix in (".json", ".jsonl")]
    tok = build_tokenizer(texts, out, vocab_size=min(4096, shape["vocab_size"]))
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=shape["vocab_size"], hidden_size=shape["hidden_size"],
                         num_hidden_layers=shape["layers"], num_attention_heads=shape["heads"],
                         num_key_value_heads=shape["kv_heads"], intermediate_size=shape["intermediate_size"],
                         max_position_embeddings=512, tie_word_embeddings=True,
                         bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    Qwen2ForCausalLM(config).save_pretrained(str(out))
    return str(out)


def run_variant(src: Path, model: str, work: Path, ranks: int, zero: int, shard_mb: float) -> list[dict[str, Any]]:
    work.mkdir(parents=True, exist_ok=True)
    port = str(_free_port())
    env = {**os.environ, "PYTHONPATH": str(src), "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1",
           "OMP_WAIT_POLICY": "PASSIVE", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
    out = work / "result"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks), "--master_addr",
           "127.0.0.1", "--master_port", port, str(Path(__file__).resolve()), "--worker", model, str(work / "run"),
           str(zero), str(shard_mb), str(out)]
    proc = subprocess.run(cmd, cwd=src, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{(proc.stdout + proc.stderr)[-5000:]}")
    return [json.loads(Path(f"{out}.rank{r}.json").read_text()) for r in range(ranks)]


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--worker"]:
        worker(argv[1], argv[2], int(argv[3]), float(argv[4]), argv[5])
        return 0
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="110m",
                    help="model shape (default 110m: the largest whose before-run fits the shared 2-core, "
                         "23 GiB test machine beside other work; 0.5b needs ~20 GiB for the before-run)")
    ap.add_argument("--ranks", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--zero", type=int, choices=[1, 2, 3], default=2)
    ap.add_argument("--weight-shard-mb", type=float, default=64.0)
    ap.add_argument("--before", metavar="REV", default=None,
                    help="also measure the code at this git revision (a temporary worktree)")
    ap.add_argument("--out", default=None, help="folder for checkpoint_memory.json / .txt")
    args = ap.parse_args(argv)

    lines: list[str] = []

    def say(s: str) -> None:
        print(s, flush=True)
        lines.append(s)

    with tempfile.TemporaryDirectory(prefix="sapd-ckpt-mem-") as tmp_s:
        tmp = Path(tmp_s)
        model = build_model(tmp, SHAPES[args.shape])
        variants: list[tuple[str, Path]] = []
        if args.before:
            before_src = tmp / "before-src"
            subprocess.run(["git", "worktree", "add", "--detach", str(before_src), args.before], cwd=REPO,
                           check=True, capture_output=True)
            variants.append((f"before ({args.before})", before_src))
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                               capture_output=True, text=True).stdout.strip()
        variants.append((f"after ({head.stdout.strip() or 'working tree'}{'+changes' if dirty else ''})", REPO))
        results: dict[str, dict[int, list[dict[str, Any]]]] = {}
        try:
            for name, src in variants:
                for w in args.ranks:
                    t0 = time.perf_counter()
                    rows = run_variant(src, model, tmp / f"{len(results)}-{w}", w, args.zero, args.weight_shard_mb)
                    results.setdefault(name, {})[w] = rows
                    shutil.rmtree(tmp / f"{len(results) - 1}-{w}", ignore_errors=True)
                    print(f"[{name}, {w} rank(s)] measured in {time.perf_counter() - t0:.0f} s", flush=True)
        finally:
            if args.before:
                subprocess.run(["git", "worktree", "remove", "--force", str(tmp / "before-src")], cwd=REPO,
                               capture_output=True)
    first = next(iter(next(iter(results.values())).values()))[0]
    whole = first["whole_state_bytes"]
    say(f"model: Qwen2 shape {args.shape}, {first['parameters']:,} parameters (fp32); DeepSpeed ZeRO-{args.zero} on "
        f"CPU/gloo; whole optimizer state (exp_avg + exp_avg_sq, fp32) {whole / 2**20:,.0f} MiB; weights written "
        f"in {args.weight_shard_mb:g} MiB shards")
    say("peak memory a rank adds while saving / loading a checkpoint, as a multiple of the whole optimizer state:")
    say("")
    say("| code | ranks | rank | save peak | load peak | save s | load s |")
    say("|---|---|---|---|---|---|---|")
    for name, by_w in results.items():
        for w, rows in by_w.items():
            for r in rows:
                say(f"| {name} | {w} | {r['rank']} | {r['save_peak_bytes'] / whole:.2f} | "
                    f"{r['load_peak_bytes'] / whole:.2f} | {r['save_seconds']:.1f} | {r['load_seconds']:.1f} |")
    say("")
    after_name = list(results)[-1]
    w_max = max(results[after_name])
    r0 = results[after_name][w_max][0]
    x = max(r0["save_peak_bytes"], r0["load_peak_bytes"]) / whole
    if args.before:
        b0 = results[list(results)[0]][w_max][0]
        say(f"before: rank-0 peak / whole state = {max(b0['save_peak_bytes'], b0['load_peak_bytes']) / whole:.2f} "
            f"({w_max} ranks)")
    say(f"checkpoint memory: rank-0 peak / whole state = {x:.2f} ({w_max} ranks)")
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "checkpoint_memory.json").write_text(json.dumps(
            {"shape": args.shape, "zero": args.zero, "weight_shard_mb": args.weight_shard_mb,
             "results": {n: {str(w): rows for w, rows in by_w.items()} for n, by_w in results.items()}},
            indent=2) + "\n")
        (out / "checkpoint_memory.txt").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
