"""Teacher scoring: the tokens computed per group, each prompt once against once per response, on groups
shaped like search QA's (or ALFWorld's, with ``--prompt-tokens 264 --response-tokens 77``).

    .venv/bin/python bench/teacher_scoring.py [--prompt-tokens 1500] [--group 8] [--response-tokens 100]
    .venv-vllm/bin/python bench/teacher_scoring.py --backend vllm [--model DIR --dtype bfloat16] [--json OUT]

``--backend hf`` (default): sapd's HF shared-prefix scorer against naive per-response scoring, in this
process on the same model and groups. ``--backend vllm``: :class:`sapd.models.vllm_backend.VLLMScorer`
(each group's prompt prefilled once, its G requests reading vLLM's prefix cache) against the same engine
with the prompt recomputed for every response (vLLM's default for prompt-logprob requests). Both print,
per group, the tokens computed — counted by the scorer (vLLM: from each request's reported prefix-cache
hit) — against G·(P + R) (every response with its own prompt) and P + G·R (the prompt once), the time
per group (best of ``--repeats``, the two paths alternated, the prefix cache reset before each pass) and
the largest log-prob difference between the paths. Without ``--model`` a small random Qwen2 is built
(hidden 512, 4 layers; head_dim 128, which vLLM's CPU attention takes).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

SAMPLES = Path(__file__).resolve().parents[1] / "sapd" / "sample_data"


def make_groups(n: int, prompt_tokens: int, group: int, response_tokens: int, vocab: int) -> list[tuple]:
    import torch
    g = torch.Generator().manual_seed(0)
    groups = []
    for i in range(n):
        prompt = torch.randint(10, vocab, (prompt_tokens,), generator=g).tolist()
        lens = torch.randint(max(1, response_tokens // 2), response_tokens * 3 // 2 + 1, (group,), generator=g)
        groups.append((f"g{i}", prompt, [torch.randint(10, vocab, (int(k),), generator=g).tolist() for k in lens]))
    return groups


def references(groups: list[tuple]) -> dict[str, float]:
    """Tokens per group of the two references: G·(P + R) and P + G·R (R the mean response length)."""
    n = len(groups)
    return {"per_response_tokens_per_group": sum(len(p) * len(rs) + sum(map(len, rs)) for _, p, rs in groups) / n,
            "shared_prompt_tokens_per_group": sum(len(p) + sum(map(len, rs)) for _, p, rs in groups) / n}


def max_diff(a: list, b: list) -> float:
    return max((abs(x - y) for ga, gb in zip(a, b) for ra, rb in zip(ga, gb) for x, y in zip(ra, rb)), default=0.0)


def run_hf(args: argparse.Namespace, model, tok) -> dict[str, Any]:
    import torch

    from sapd.models.scoring import score_group_shared_prefix, score_naive
    groups = make_groups(args.groups, args.prompt_tokens, args.group, args.response_tokens, len(tok))
    score_group_shared_prefix(model, *groups[0][1:], prefix_id="warmup")  # warm-up both paths
    score_naive(model, groups[0][1], groups[0][2][:1])
    t_fast = t_slow = float("inf")
    for _ in range(args.repeats):  # alternated, each one's best: a busy machine biases neither
        t0 = time.perf_counter()
        fast = [score_group_shared_prefix(model, p, r, prefix_id=i, pad_id=tok.pad_token_id) for i, p, r in groups]
        t_fast = min(t_fast, time.perf_counter() - t0)
        t0 = time.perf_counter()
        slow = [score_naive(model, p, r, prefix_id=i) for i, p, r in groups]
        t_slow = min(t_slow, time.perf_counter() - t0)
    ref = references(groups)
    return {"backend": "hf", "threads": torch.get_num_threads(), **ref,
            "shared_computed_tokens_per_group": ref["shared_prompt_tokens_per_group"],  # by construction
            "naive_computed_tokens_per_group": ref["per_response_tokens_per_group"],
            "shared_seconds_per_group": t_fast / len(groups), "naive_seconds_per_group": t_slow / len(groups),
            "max_abs_logprob_diff": max_diff(fast, slow)}


def run_vllm(args: argparse.Namespace, model_dir: str, vocab: int) -> dict[str, Any]:
    import torch
    from vllm.platforms import current_platform

    from sapd.models.vllm_backend import VLLMScorer, make_llm
    gpu = not current_platform.is_cpu()
    longest = args.prompt_tokens + args.response_tokens * 3 // 2 + 2
    kw: dict[str, Any] = ({"gpu_memory_utilization": args.gpu_memory_utilization} if gpu
                          else {"kv_cache_memory_bytes": 512 * 2**20})
    llm = make_llm(model_dir, dtype=args.dtype, max_model_len=max(256, longest), enable_prefix_caching=True, **kw)
    shared, whole = VLLMScorer(llm), VLLMScorer(llm, share_prompt=False)
    groups = make_groups(args.groups, args.prompt_tokens, args.group, args.response_tokens, vocab)
    VLLMScorer(llm).score_groups(groups[:1])  # warm-up (kernels, allocator)
    times: dict[str, float] = {}
    out: dict[str, list] = {}
    for _ in range(args.repeats):
        for name, scorer in (("shared", shared), ("naive", whole)):
            llm.reset_prefix_cache()
            scorer.stats = type(scorer.stats)()
            if gpu:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            out[name] = scorer.score_groups(groups)
            if gpu:
                torch.cuda.synchronize()
            times[name] = min(times.get(name, float("inf")), time.perf_counter() - t0)
    n = len(groups)
    return {"backend": "vllm", "device": "cuda" if gpu else "cpu", "dtype": args.dtype, **references(groups),
            "block_size": int(llm.llm_engine.vllm_config.cache_config.block_size),
            "shared_computed_tokens_per_group": shared.stats.computed_tokens / n,
            "naive_computed_tokens_per_group": whole.stats.computed_tokens / n,
            "rescored_responses": shared.stats.rescored,
            "shared_seconds_per_group": times["shared"] / n, "naive_seconds_per_group": times["naive"] / n,
            "max_abs_logprob_diff": max_diff(out["shared"], out["naive"])}


def report(r: dict[str, Any], args: argparse.Namespace) -> list[str]:
    lines = [f"{r['backend']}: {args.groups} groups × G={args.group}, prompt {args.prompt_tokens} tokens, responses "
             f"≈{args.response_tokens}" + (f", {r['device']} {r['dtype']}, KV block {r['block_size']}"
                                           if r["backend"] == "vllm" else f", {r['threads']} threads"),
             f"tokens per group, references : G·(P + R) = {r['per_response_tokens_per_group']:.0f}, "
             f"P + G·R = {r['shared_prompt_tokens_per_group']:.0f}",
             f"each prompt once             : {r['shared_computed_tokens_per_group']:8.0f} tokens computed, "
             f"{1e3 * r['shared_seconds_per_group']:8.2f} ms per group"
             + (f" ({r['rescored_responses']} responses rescored)" if r.get("rescored_responses") else ""),
             f"prompt per response          : {r['naive_computed_tokens_per_group']:8.0f} tokens computed, "
             f"{1e3 * r['naive_seconds_per_group']:8.2f} ms per group",
             f"speed-up                     : {r['naive_seconds_per_group'] / r['shared_seconds_per_group']:8.2f}x; "
             f"max |Δ log-prob| {r['max_abs_logprob_diff']:.2e}"]
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", choices=["hf", "vllm"], default="hf")
    ap.add_argument("--model", default=None, help="an HF model folder (default: a small random Qwen2 built here)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--prompt-tokens", type=int, default=1500,
                    help="P (ALFWorld: ~264 Qwen2.5 tokens; search QA ~1500)")
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--response-tokens", type=int, default=100, help="R (mean)")
    ap.add_argument("--groups", type=int, default=3)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.3)
    ap.add_argument("--json", default=None, help="write the figures here as JSON")
    args = ap.parse_args(argv)
    if args.backend == "vllm":
        for key, value in (("VLLM_NO_USAGE_STATS", "1"), ("HF_HUB_OFFLINE", "1")):
            os.environ.setdefault(key, value)
    with tempfile.TemporaryDirectory() as tmp:
        from sapd.models.loading import load_causal_lm, load_tokenizer
        model_dir = args.model
        if model_dir is None:
            from sapd.models.byte_tokenizer import build_tokenizer
            from sapd.models.tiny import build_tiny_model
            tok = build_tokenizer([p.read_text() for p in SAMPLES.glob("*.json*")], Path(tmp) / "tok")
            model_dir = str(Path(tmp) / "m")
            build_tiny_model(tok, model_dir, hidden_size=args.hidden, layers=args.layers, heads=4, kv_heads=2,
                             intermediate_size=4 * args.hidden, max_positions=8192)
        tok = load_tokenizer(model_dir)
        if args.backend == "vllm":
            result = run_vllm(args, model_dir, len(tok))
        else:
            model = load_causal_lm(model_dir, dtype=args.dtype)
            model.eval()
            result = run_hf(args, model, tok)
    print("\n".join(report(result, args)))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
