"""What training keeps in memory per token, measured on CPU (bytes are device-independent): the figures
behind the train stage's memory estimate (:mod:`sapd.models.memory`, ``sapd check``, the train pods'
own pre-check).

    OMP_NUM_THREADS=2 .venv/bin/python bench/activation_memory.py --out bench/results

Two measurements, both on Qwen2 decoders (SDPA attention, one row right-padded as
:func:`sapd.models.scoring.pad_sequences` makes them):

1. **Per token per decoder layer**, with autograd's saved-tensor hooks (every tensor a layer keeps for
   backward, counted once per storage, parameters excluded): the difference between a 2-layer and a
   1-layer model, divided by the tokens. At the widths of Qwen2.5-0.5B / 1.5B / 3B, in bfloat16 and
   float32; then a least-squares fit ``bytes = a·hidden + c·intermediate`` per dtype — the
   coefficients :data:`sapd.models.memory.SAVED_PER_TOKEN_LAYER` holds.
2. **One micro-batch of the real training step**, with PyTorch's ``MemTracker`` (every storage alive,
   by kind, at the peak): ``sapd.stages.train._micro_loss`` (the student's forward at the response
   positions, the SAPD loss) and its backward, on a small model with a real vocabulary size, with and
   without gradient checkpointing, against :func:`sapd.models.memory.estimate` for the same shapes.
   The estimate must not be below the measurement.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch

from sapd.models.memory import SAVED_PER_TOKEN_LAYER

# Qwen2.5 widths (config.json of the released models): hidden, intermediate, heads, KV heads
WIDTHS = {"0.5b": (896, 4864, 14, 2), "1.5b": (1536, 8960, 12, 2), "3b": (2048, 11008, 16, 2)}
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def _qwen2(hidden: int, inter: int, heads: int, kv_heads: int, layers: int, vocab: int, dtype: torch.dtype):
    from transformers import Qwen2Config, Qwen2ForCausalLM
    cfg = Qwen2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=8192,
                      tie_word_embeddings=True, attn_implementation="sdpa")
    torch.manual_seed(0)
    return Qwen2ForCausalLM(cfg).to(dtype)


def saved_per_token_layer(width: str, dtype: str, rows: int = 2, tokens: int = 512) -> float:
    """Bytes one decoder layer keeps for backward per token (saved-tensor hooks; 2 layers − 1 layer)."""
    hidden, inter, heads, kv_heads = WIDTHS[width]
    kept = {}
    for layers in (1, 2):
        model = _qwen2(hidden, inter, heads, kv_heads, layers, 1024, DTYPES[dtype])
        model.train()
        seen: dict[int, int] = {}

        def pack(t: torch.Tensor, seen: dict[int, int] = seen) -> torch.Tensor:
            st = t.untyped_storage()
            seen[st.data_ptr()] = max(seen.get(st.data_ptr(), 0), st.nbytes())
            return t

        ids = torch.randint(0, 1024, (rows, tokens))
        attn = torch.ones_like(ids)
        attn[0, -tokens // 8:] = 0  # right padding on one row
        params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = model.model(input_ids=ids, attention_mask=attn).last_hidden_state
        kept[layers] = sum(n for ptr, n in seen.items() if ptr not in params)
        del out, model
    return (kept[2] - kept[1]) / (rows * tokens)


def fit(points: list[tuple[int, int, float]]) -> tuple[float, float, float]:
    """Least squares ``bytes = a·hidden + c·intermediate`` → (a, c, largest relative residual)."""
    X = torch.tensor([[h, i] for h, i, _ in points], dtype=torch.float64)
    y = torch.tensor([b for _, _, b in points], dtype=torch.float64)
    a, c = torch.linalg.lstsq(X, y.unsqueeze(1)).solution.squeeze(1).tolist()
    worst = max(abs(a * h + c * i - b) / b for h, i, b in points)
    return a, c, worst


def train_step_peak(*, hidden: int, inter: int, heads: int, kv_heads: int, layers: int, vocab: int, dtype: str,
                    G: int, prompt: int, response: int, checkpointing: bool) -> dict[str, Any]:
    """Peak memory of one micro-batch (1 prefix × G responses) of sapd's training step — the real
    ``_micro_loss`` and its backward — by kind (MemTracker), next to :func:`sapd.models.memory.estimate`."""
    from torch.distributed._tools.mem_tracker import MemTracker

    from sapd.config import config_from_dict
    from sapd.data.scored import ScoredPrefix
    from sapd.models.memory import estimate, shape_from_config
    from sapd.stages.train import _micro_loss

    model = _qwen2(hidden, inter, heads, kv_heads, layers, vocab, DTYPES[dtype])
    if checkpointing:
        (getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable)()
    model.train()
    cfg = config_from_dict({"run_root": "unused", "model": {"student": "s", "teacher": "t", "dtype": dtype},
                            "sampling": {"group_size": G, "max_new_tokens": response},
                            "data": {"max_prompt_tokens": prompt},
                            "train": {"micro_batch_prefixes": 1, "minibatch_prefixes": 1,
                                      "gradient_checkpointing": checkpointing, "shared_prompt": "off"}})
    g = torch.Generator().manual_seed(0)
    responses = [torch.randint(3, vocab, (response,), generator=g).tolist() for _ in range(G)]
    chunk = [ScoredPrefix("p0", torch.randint(3, vocab, (prompt,), generator=g).tolist(), responses,
                          [[-1.0] * response for _ in range(G)], [[True] * response for _ in range(G)],
                          [0.0] * G, old_logp_G_T=[[-1.0] * response for _ in range(G)])]
    tracker = MemTracker()
    tracker.track_external(model)
    t0 = time.perf_counter()
    with tracker:
        loss, _ = _micro_loss(model, cfg, chunk, 0)
        loss.backward()
    seconds = time.perf_counter() - t0
    peak = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]
    by_kind = {str(k.value if hasattr(k, "value") else k): int(v) for k, v in peak.items()}
    params = by_kind.get("Parameter", 0) + by_kind.get("Buffer", 0)
    measured = by_kind["Total"] - params  # activations, logits, temporaries and the gradients alive at the peak
    shape = shape_from_config(model.config.to_dict())
    est = {e.stage: e for e in estimate(cfg, shape, None, prompt_tokens=prompt)}["train"]
    estimated = est.parts["activations"] + est.parts["gradients"]
    return {"hidden": hidden, "layers": layers, "vocab": vocab, "dtype": dtype, "G": G, "prompt": prompt,
            "response": response, "checkpointing": checkpointing, "peak_by_kind": by_kind,
            "measured_bytes": measured, "estimated_bytes": estimated, "estimate_over_measured": estimated / measured,
            "seconds": seconds}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="bench/results", help="where activation_memory.{json,txt} go")
    ap.add_argument("--widths", default="0.5b,1.5b,3b")
    ap.add_argument("--quick", action="store_true", help="the per-layer figure at 1.5B width in bf16 only, and "
                                                         "the train-step check at a small width (the test)")
    args = ap.parse_args(argv)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    lines: list[str] = []

    def say(s: str) -> None:
        print(s, flush=True)
        lines.append(s)

    results: dict[str, Any] = {"torch": torch.__version__, "per_token_layer": {}, "fit": {}, "train_step": []}
    widths = ["1.5b"] if args.quick else [w for w in args.widths.split(",") if w]
    for dtype in (["bfloat16"] if args.quick else list(DTYPES)):
        points = []
        for w in widths:
            b = saved_per_token_layer(w, dtype)
            hidden, inter, _, _ = WIDTHS[w]
            points.append((hidden, inter, b))
            results["per_token_layer"][f"{w}-{dtype}"] = b
            a, c = SAVED_PER_TOKEN_LAYER[dtype]
            say(f"{w} width ({hidden}/{inter}), {dtype}: one decoder layer keeps {b / 1024:.1f} KiB per token for "
                f"backward; sapd's figure {(a * hidden + c * inter) / 1024:.1f} KiB")
        if len(points) >= 2:
            a, c, worst = fit(points)
            results["fit"][dtype] = {"a_per_hidden": a, "c_per_intermediate": c, "worst_relative_residual": worst}
            say(f"fit {dtype}: bytes per token per layer = {a:.2f}·hidden + {c:.2f}·intermediate "
                f"(largest residual {worst:.1%})")
    shapes = ([dict(hidden=256, inter=704, heads=4, kv_heads=2, layers=2, vocab=8192, G=4, prompt=96, response=32)]
              if args.quick else
              [dict(hidden=896, inter=4864, heads=14, kv_heads=2, layers=2, vocab=151936, G=8, prompt=300,
                    response=128)])
    for s in shapes:
        for ckpt in (False, True):
            r = train_step_peak(dtype="bfloat16", checkpointing=ckpt, **s)
            results["train_step"].append(r)
            say(f"train step, {r['layers']} layers of width {r['hidden']}, vocab {r['vocab']}, G={r['G']}, prompt "
                f"{r['prompt']} + response {r['response']}, checkpointing {'on' if ckpt else 'off'}: peak beyond the "
                f"weights {r['measured_bytes'] / 2**20:.1f} MiB measured, {r['estimated_bytes'] / 2**20:.1f} MiB "
                f"estimated ({r['estimate_over_measured']:.2f}×)")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = "activation_memory-quick" if args.quick else "activation_memory"
    (out / f"{name}.json").write_text(json.dumps(results, indent=2) + "\n")
    (out / f"{name}.txt").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
