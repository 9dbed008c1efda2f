"""Each stage's measured time against its floor on this machine, both measured in the same run
(issue 14 item 4; the 2-rank DeepSpeed comparison is not here yet).

- sampling: ``HFGenerator`` (one prefill per prompt, its KV cache repeated G times, one decode batch)
  in generated tokens/s vs one batched HF ``generate`` of the same number of tokens (the prompt
  repeated G times, every sequence forced to the same length);
- scoring: the shared-prefix teacher scorer on a group (prompt once, G responses) vs a single forward
  over the group's unique tokens (the prompt once followed by all G responses, one sequence);
- π_old: the training stage's recompute (``recompute_old_logprobs``, one micro-batch of P prefixes × G)
  vs one plain no-grad forward over the same P·G padded sequences;
- training: one optimizer step of the training stage's loss (``_micro_loss``: head-only logits, the SAPD
  terms) with backward and AdamW, vs one plain forward + token NLL + backward + AdamW step over the same
  P·G padded sequences.

    .venv/bin/python bench/stage_efficiency.py [--group 8] [--prompt-tokens 600] [--new-tokens 64]
    .venv/bin/python bench/stage_efficiency.py --dry-run     # tiny shape, seconds: the test suite's check

Prints each stage's time, its floor's and the ratio (goal: ≤ 1.25×). Each pair alternates over
``--repeats`` repetitions and keeps each side's best, so the machine's load affects both alike.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Callable

import torch

from sapd.config import config_from_dict
from sapd.data.scored import ScoredPrefix
from sapd.models.byte_tokenizer import build_tokenizer
from sapd.models.generation import HFGenerator, SamplingParams
from sapd.models.scoring import score_group_shared_prefix
from sapd.models.tiny import build_tiny_model
from sapd.stages.train import _micro_loss, recompute_old_logprobs

SAMPLES = Path(__file__).resolve().parents[1] / "sapd" / "sample_data"
GOAL = 1.25


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
    args = ap.parse_args(argv)
    if args.dry_run:
        args.group, args.prompt_tokens, args.new_tokens, args.hidden, args.layers, args.repeats = 2, 40, 6, 64, 2, 1
        args.prefixes = 2
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
        recompute_old_logprobs(model, prefixes, pad, P)

    def floor_old() -> None:
        with torch.no_grad():
            model(input_ids=seqs, attention_mask=mask)

    t_ours, t_floor = _best_pair(ours_old, floor_old, args.repeats)
    results["pi_old"] = {"tokens": seqs.numel(), "seconds": t_ours, "floor_seconds": t_floor, "ratio": t_ours / t_floor}

    recompute_old_logprobs(model, prefixes, pad, P)
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
    print("| stage | measured s | floor s | ratio to floor | goal |")
    print("|---|---|---|---|---|")
    for name, r in results.items():
        print(f"| {name} | {r['seconds']:.3f} | {r['floor_seconds']:.3f} | {r['ratio']:.2f}× | ≤ {GOAL}× |")
    print("not measured by this script yet: 2-rank DeepSpeed vs 1 rank")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
