"""Each stage's measured time against its floor on this machine, both measured in the same run
(issue 14 item 4).

- sampling: ``HFGenerator`` (one prefill per prompt, its KV cache repeated G times, one decode batch)
  in generated tokens/s vs one batched HF ``generate`` of the same number of tokens (the prompt
  repeated G times, every sequence forced to the same length);
- scoring: the shared-prefix teacher scorer on a group (prompt once, G responses) vs a single forward
  over the group's unique tokens (the prompt once followed by all G responses, one sequence);
- π_old: the training stage's recompute (``recompute_old_logprobs``, one micro-batch of P prefixes × G;
  each prompt run once, its cache repeated G times) vs one plain no-grad forward over the same P·G
  padded prompt+response sequences — the path before the shared prefix, so a ratio well below 1 is
  expected (the unique tokens are the real floor);
- training: one optimizer step of the training stage's loss (``_micro_loss``: shared prompt, head-only
  logits, the SAPD terms) with backward and AdamW, vs one plain forward + token NLL + backward + AdamW
  step over the same P·G padded sequences (likewise);
- DeepSpeed ranks: one whole training round (``sapd.cli train-round``, the cluster's training Job) of the
  same committed inputs (prefixes, round 0's scored shard, checkpoint 0) by the single-process torch
  engine, by DeepSpeed ZeRO on 1 rank with every CPU thread, and on 2 ranks (gloo) with half the threads
  each: wall time of the process (start-up and checkpoint included) and the time of its training loop
  (π_old + the optimizer steps, from the step log). The machine is the same in all three, so 2 ranks can
  only win by parallelising better than one process's threads do. DeepSpeed runs with
  ``OMP_WAIT_POLICY=PASSIVE``, as the chart's training pods set it; one more run shows the 1-rank round
  with OpenMP's default (spinning) wait policy, whose threads starve DeepSpeed's and gloo's own threads
  when a rank's OpenMP threads take every core.

    .venv/bin/python bench/stage_efficiency.py [--group 8] [--prompt-tokens 600] [--new-tokens 64]
    .venv/bin/python bench/stage_efficiency.py --dry-run     # tiny shape, seconds: the test suite's check
    .venv/bin/python bench/stage_efficiency.py --stages deepspeed [--zero-stage 2]

Prints each stage's time, its floor's and the ratio (goal: ≤ 1.25×). Each pair alternates over
``--repeats`` repetitions and keeps each side's best, so the machine's load affects both alike.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import torch

from sapd.config import config_from_dict
from sapd.data.scored import ScoredPrefix
from sapd.models.byte_tokenizer import build_tokenizer
from sapd.models.generation import HFGenerator, SamplingParams
from sapd.models.scoring import score_group_shared_prefix
from sapd.models.tiny import build_tiny_model
from sapd.stages.train import _micro_loss, recompute_old_logprobs

REPO = Path(__file__).resolve().parents[1]
SAMPLES = REPO / "sapd" / "sample_data"
GOAL = 1.25
STAGES = ("sampling", "scoring", "pi_old", "training", "deepspeed")


def _best_pair(a: Callable[[], object], b: Callable[[], object], repeats: int) -> tuple[float, float]:
    ta = tb = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        a()
        ta = min(ta, time.perf_counter() - t0)
        t0 = time.perf_counter()
        b()
        tb = min(tb, time.perf_counter() - t0)
    return ta, tb


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--prompt-tokens", type=int, default=600)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--prefixes", type=int, default=2, help="P: prefixes in a π_old / training micro-batch")
    ap.add_argument("--dry-run", action="store_true", help="tiny shape and lengths: checks the script")
    ap.add_argument("--json", default=None, help="also write the results here")
    ap.add_argument("--stages", default=",".join(STAGES), help=f"comma-separated subset of {','.join(STAGES)}")
    ap.add_argument("--zero-stage", type=int, default=2, choices=(1, 2, 3), help="deepspeed: the ZeRO stage")
    ap.add_argument("--round-trajectories", type=int, default=2, help="deepspeed: trajectories in the round")
    args = ap.parse_args(argv)
    stages = [x.strip() for x in args.stages.split(",") if x.strip()]
    if unknown := sorted(set(stages) - set(STAGES)):
        ap.error(f"--stages: unknown {unknown}; choose from {', '.join(STAGES)}")
    if args.dry_run:
        args.group, args.prompt_tokens, args.new_tokens, args.hidden, args.layers, args.repeats = 2, 40, 6, 64, 2, 1
        args.prefixes, args.round_trajectories = 2, 1
    results: dict[str, dict[str, float]] = {}
    if any(x != "deepspeed" for x in stages):
        results.update(single_process_stages(args, stages))
    if "deepspeed" in stages:
        results.update(deepspeed_ranks(args))
    print("| stage | measured s | floor s | ratio to floor | goal |")
    print("|---|---|---|---|---|")
    for name, r in results.items():
        if "floor_seconds" in r:
            print(f"| {name} | {r['seconds']:.3f} | {r['floor_seconds']:.3f} | {r['ratio']:.2f}× | ≤ {GOAL}× |")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    return 0


def single_process_stages(args: argparse.Namespace, stages: list[str]) -> dict[str, dict[str, float]]:
    with tempfile.TemporaryDirectory() as tmp:
        tok = build_tokenizer([p.read_text() for p in SAMPLES.glob("*.json*")], Path(tmp) / "tok")
        model = build_tiny_model(tok, Path(tmp) / "m", hidden_size=args.hidden, layers=args.layers, heads=8,
                                 kv_heads=2, intermediate_size=4 * args.hidden)
    model.eval()
    G, N = args.group, args.new_tokens
    g = torch.Generator().manual_seed(0)
    pids = torch.randint(10, len(tok), (args.prompt_tokens,), generator=g).tolist()
    prompt = tok.decode(pids)
    pids = tok(prompt, add_special_tokens=False)["input_ids"]
    results: dict[str, dict[str, float]] = {}

    # sampling: our sampler vs one batched generate of G×N tokens
    gen = HFGenerator(model, tok, prompts_per_batch=1)
    params = SamplingParams(n=G, max_new_tokens=N, stop=(), seed=0)
    gen.generate([prompt], SamplingParams(n=2, max_new_tokens=2, stop=()))  # warm-up
    produced: list[int] = []
    batch = torch.tensor([pids] * G)

    def ours_sample() -> None:
        produced[:] = [sum(len(s.token_ids) for s in gen.generate([prompt], params)[0])]

    def floor_sample() -> None:
        with torch.no_grad():
            model.generate(input_ids=batch, attention_mask=torch.ones_like(batch), do_sample=True,
                           max_new_tokens=N, min_new_tokens=N, pad_token_id=tok.pad_token_id or 0)

    t_ours, t_floor = _best_pair(ours_sample, floor_sample, args.repeats)
    results["sampling"] = {"tokens": produced[0], "seconds": t_ours, "tokens_per_s": produced[0] / t_ours,
                           "floor_seconds": t_floor, "floor_tokens_per_s": G * N / t_floor,
                           "ratio": (G * N / t_floor) / (produced[0] / t_ours)}

    # scoring: shared-prefix scorer vs one forward over the unique tokens
    responses = [torch.randint(10, len(tok), (N,), generator=g).tolist() for _ in range(G)]
    unique = torch.tensor([pids + [t for r in responses for t in r]])

    def ours_score() -> None:
        score_group_shared_prefix(model, pids, responses)

    def floor_score() -> None:
        with torch.no_grad():
            model(input_ids=unique)

    t_ours, t_floor = _best_pair(ours_score, floor_score, args.repeats)
    results["scoring"] = {"tokens": unique.shape[1], "seconds": t_ours, "floor_seconds": t_floor,
                          "ratio": t_ours / t_floor}

    # π_old and training: P prefixes × G responses, one micro-batch
    P = args.prefixes
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    prefixes = [ScoredPrefix(f"p{i}", pids, [torch.randint(10, len(tok), (N,), generator=g).tolist() for _ in range(G)],
                             [[-1.0] * N for _ in range(G)], [[k >= N - 4 for k in range(N)] for _ in range(G)],
                             [0.0] * G) for i in range(P)]
    seqs = torch.tensor([pids + r for sp in prefixes for r in sp.responses_G_T])  # equal lengths: no padding
    mask = torch.ones_like(seqs)

    def ours_old() -> None:
        recompute_old_logprobs(model, prefixes, pad, P, shared_prompt="auto")

    def floor_old() -> None:
        with torch.no_grad():
            model(input_ids=seqs, attention_mask=mask)

    t_ours, t_floor = _best_pair(ours_old, floor_old, args.repeats)
    results["pi_old"] = {"tokens": seqs.numel(), "seconds": t_ours, "floor_seconds": t_floor, "ratio": t_ours / t_floor}

    recompute_old_logprobs(model, prefixes, pad, P, shared_prompt="auto")
    cfg = config_from_dict({"variant": "sapd"})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6)
    model.train()

    def ours_train() -> None:
        opt.zero_grad(set_to_none=True)
        loss, _ = _micro_loss(model, cfg, prefixes, pad)
        loss.backward()
        opt.step()

    def floor_train() -> None:
        opt.zero_grad(set_to_none=True)
        logits = model(input_ids=seqs, attention_mask=mask).logits[:, len(pids) - 1:-1]
        nll = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(),
                                                seqs[:, len(pids):].reshape(-1))
        nll.backward()
        opt.step()

    t_ours, t_floor = _best_pair(ours_train, floor_train, args.repeats)
    results["training"] = {"tokens": seqs.numel(), "seconds": t_ours, "floor_seconds": t_floor,
                           "ratio": t_ours / t_floor}
    model.eval()

    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: qwen2 {n_params / 1e6:.1f}M params, {torch.get_num_threads()} threads; G={G}, "
          f"prompt {len(pids)} tokens, {N} new tokens each; π_old/training: {P} prefixes × G; "
          f"best of {args.repeats}")
    return {k: v for k, v in results.items() if k in stages}


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _train_round(cfg_path: Path, ranks: int | None, threads: int, extra_env: dict[str, str]) -> float:
    """Wall seconds of ``sapd train-round 0`` (ranks None: a plain process; else torchrun)."""
    env = {**{k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}, **extra_env,
           "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": str(threads),
           "TORCH_EXTENSIONS_DIR": os.environ.get("TORCH_EXTENSIONS_DIR", str(REPO / ".cache" / "torch_extensions"))}
    cli = ["-m", "sapd.cli", "train-round", str(cfg_path), "--round", "0", "--no-progress", "--no-check"]
    if ranks is None:
        cmd = [sys.executable, *cli]
    else:
        port = str(_free_port())
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks),
               "--master_addr", "127.0.0.1", "--master_port", port, *cli]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise SystemExit(f"train-round failed ({' '.join(cmd)}):\n{(proc.stdout + proc.stderr)[-4000:]}")
    return time.perf_counter() - t0


def deepspeed_ranks(args: argparse.Namespace) -> dict[str, dict[str, float]]:
    """One training round by the torch engine, DeepSpeed on 1 rank and DeepSpeed on 2 ranks."""
    from sapd import layout, yamlio
    from sapd.run.local import run_pipeline
    from sapd.run.report import read_step_log
    threads = os.cpu_count() or 2
    with tempfile.TemporaryDirectory() as tmp_s:
        tmp = Path(tmp_s)
        tok = build_tokenizer([p.read_text() for p in SAMPLES.glob("*.json*")], tmp / "tok")
        shape = dict(hidden_size=args.hidden, layers=args.layers, heads=8, kv_heads=2,
                     intermediate_size=4 * args.hidden)
        build_tiny_model(tok, tmp / "student", seed=0, **shape)
        build_tiny_model(tok, tmp / "teacher", seed=1, **shape)
        micro = max(1, args.prefixes)
        models = {"student": str(tmp / "student"), "teacher": str(tmp / "teacher")}
        base: dict[str, Any] = {"variant": "sapd", "model": models,
                "data": {"input": str(SAMPLES / "alfworld_eto.json"), "format": "eto", "benchmark": "alfworld",
                         "max_prompt_tokens": 2048},
                "sampling": {"group_size": args.group, "max_new_tokens": args.new_tokens, "prompts_per_batch": 8},
                "train": {"rounds": 1, "trajectories_per_round": args.round_trajectories,
                          "minibatch_prefixes": 2 * micro, "micro_batch_prefixes": micro, "lr": 1e-5, "seed": 0}}
        source = tmp / "inputs"
        run_pipeline(config_from_dict({**base, "run_root": str(source)}), log=lambda s: None, show_progress=False)
        out: dict[str, dict[str, float]] = {}
        ds = {"engine": "deepspeed", "zero_stage": args.zero_stage}
        passive = {"OMP_WAIT_POLICY": "PASSIVE"}  # as the chart's training pods set it
        runs: dict[str, tuple[int | None, int, dict[str, Any], dict[str, str]]] = {
            "torch_1_process": (None, threads, {}, {}),
            "deepspeed_1_rank": (1, threads, ds, passive),
            "deepspeed_2_ranks": (2, max(1, threads // 2), ds, passive),
            "deepspeed_1_rank_spinning": (1, threads, ds, {})}  # OpenMP's default wait policy
        best: dict[str, tuple[float, float]] = {}
        for rep in range(args.repeats):
            for name, (ranks, n_threads, train, extra_env) in runs.items():
                root = tmp / f"{name}-{rep}"
                for uri in (layout.prefixes_dir(str(source)), layout.round_dir(str(source), 0),
                            layout.checkpoint_dir(str(source), 0)):
                    rel = os.path.relpath(uri, source)
                    shutil.copytree(source / rel, root / rel)
                cfg = {**base, "run_root": str(root), "train": {**base["train"], **train}}
                cfg_path = tmp / f"{name}-{rep}.yaml"
                cfg_path.write_text(yamlio.dump(cfg))
                wall = _train_round(cfg_path, ranks, n_threads, extra_env)
                steps = read_step_log(str(root))
                loop = sum(s.get("step_seconds", 0.0) + s.get("old_logp_seconds", 0.0) for s in steps)
                prev = best.get(name, (float("inf"), float("inf")))
                best[name] = (min(prev[0], wall), min(prev[1], loop))
                print(f"{name} (repeat {rep + 1}): wall {wall:.2f} s, π_old "
                      f"{sum(s.get('old_logp_seconds', 0.0) for s in steps):.2f} s, steps "
                      f"{[round(s.get('step_seconds', 0.0), 2) for s in steps]} s", flush=True)
                out.setdefault(name, {"optimizer_steps": float(len(steps)),
                                      "prefixes": float(sum(s.get("prefixes", 0) for s in steps))})
                shutil.rmtree(root)
        for name, (wall, loop) in best.items():
            out[name].update(wall_seconds=wall, loop_seconds=loop, threads_per_rank=float(runs[name][1]))
        one, two = out["deepspeed_1_rank"], out["deepspeed_2_ranks"]
        torch_loop, spin_loop = out["torch_1_process"]["loop_seconds"], out["deepspeed_1_rank_spinning"]["loop_seconds"]
        out["deepspeed_ranks"] = {"wall_ratio_2_vs_1": two["wall_seconds"] / one["wall_seconds"],
                                  "loop_ratio_2_vs_1": two["loop_seconds"] / one["loop_seconds"],
                                  "loop_ratio_1_rank_vs_torch": one["loop_seconds"] / torch_loop,
                                  "loop_ratio_spinning_vs_passive": spin_loop / one["loop_seconds"],
                                  "zero_stage": float(args.zero_stage)}
    print(f"training round: {int(out['torch_1_process']['prefixes'])} prefixes × G={args.group}, "
          f"{int(out['torch_1_process']['optimizer_steps'])} optimizer steps, ZeRO-{args.zero_stage}, "
          f"{threads} CPU threads in all; best of {args.repeats}")
    print("| training round | ranks × threads | OMP_WAIT_POLICY | wall s (process) | training loop s |")
    print("|---|---|---|---|---|")
    for name in runs:
        r = out[name]
        ranks = runs[name][0] or 1
        policy = runs[name][3].get("OMP_WAIT_POLICY", "(default)")
        print(f"| {name} | {ranks} × {int(r['threads_per_rank'])} | {policy} | {r['wall_seconds']:.2f} | "
              f"{r['loop_seconds']:.2f} |")
    d = out["deepspeed_ranks"]
    print(f"2 ranks vs 1 rank (DeepSpeed): wall {d['wall_ratio_2_vs_1']:.2f}×, "
          f"training loop {d['loop_ratio_2_vs_1']:.2f}×; "
          f"DeepSpeed 1 rank vs torch engine, training loop {d['loop_ratio_1_rank_vs_torch']:.2f}×; "
          f"1 rank with OpenMP spinning vs passive, training loop {d['loop_ratio_spinning_vs_passive']:.2f}×")
    return out


if __name__ == "__main__":
    raise SystemExit(main())
