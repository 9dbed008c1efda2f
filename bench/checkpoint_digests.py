"""What checking a checkpoint's files costs: a Qwen2-shaped model built from its config (random weights: no
download), trained one step so AdamW has state, saved through ``sapd.checkpoints.save_checkpoint`` as the
train stage saves it (its commit records the size and SHA-256 of every file, and one SHA-256 per item of the
optimizer's data file). Then loaded as a stage loads it — the model folder's files checked
(``checkpoint_model_path``), ``trainer.pt`` (``load_trainer_state``), the optimizer state through DCP's
ranged reads, each checked against its items (``consolidated_optimizer_state``) — and, as the baseline in
the same process, the same loads of the same files with the checks off (the marker's ``files`` removed, as
a checkpoint committed before digests). Rounds alternate (checked, unchecked) and the medians are printed;
SHA-256's own rate on this CPU too, which bounds what a save adds (every byte written is hashed once).

    python bench/checkpoint_digests.py                    # ~110M parameters (0.44 GB weights, fp32)
    python bench/checkpoint_digests.py --shape tiny       # the quick check

Timings on a shared machine are upper bounds. The last line: ``checkpoint digests: load X s checked vs Y s
unchecked (+Z %) for N GB``.
"""

from __future__ import annotations

import argparse
import hashlib
import statistics
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SHAPES: dict[str, dict[str, int]] = {  # hidden, layers, heads, kv heads, intermediate, vocabulary
    "tiny": {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
             "intermediate_size": 128, "vocab_size": 1024},
    "small": {"hidden_size": 768, "num_hidden_layers": 12, "num_attention_heads": 12, "num_key_value_heads": 4,
              "intermediate_size": 2048, "vocab_size": 32000},
}


def _sha256_rate(mb: int = 256) -> float:
    data = bytes(mb * 1024 * 1024)
    t0 = time.perf_counter()
    hashlib.sha256(data).hexdigest()
    return mb / 1024 / (time.perf_counter() - t0)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="small")
    p.add_argument("--rounds", type=int, default=3, help="load rounds per setting (medians are printed)")
    args = p.parse_args(argv)

    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from sapd import checkpoints, layout, storage
    from sapd.models import loading
    from sapd.models.byte_tokenizer import build_tokenizer

    with tempfile.TemporaryDirectory(prefix="sapd-digests-") as tmp:
        samples = REPO / "sapd" / "sample_data"
        texts = [f.read_text(encoding="utf-8") for f in sorted(samples.iterdir()) if f.suffix in (".json", ".jsonl")]
        tokenizer = build_tokenizer(texts, Path(tmp) / "tok", vocab_size=min(4096, SHAPES[args.shape]["vocab_size"]))
        torch.manual_seed(0)
        model = Qwen2ForCausalLM(Qwen2Config(**SHAPES[args.shape], tie_word_embeddings=True))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        model(torch.randint(0, 100, (1, 16))).logits.float().square().mean().backward()
        opt.step()
        root = str(Path(tmp) / "run")
        t0 = time.perf_counter()
        marker = checkpoints.save_checkpoint(root, 1, model, tokenizer, {"round": 0},
                                             optimizer=checkpoints.torch_optimizer_shard(opt))
        save_s = time.perf_counter() - t0
        assert marker is not None
        total = sum(d["bytes"] for d in marker["files"].values())
        checked_marker = dict(marker)
        unchecked_marker = {k: v for k, v in marker.items() if k != "files"}

        def load() -> float:
            loading._verified.clear()  # a new process hashes again
            t = time.perf_counter()
            checkpoints.checkpoint_model_path(root, 1)
            checkpoints.load_trainer_state(root, 1)
            assert checkpoints.consolidated_optimizer_state(root, 1) is not None
            return time.perf_counter() - t

        times: dict[str, list[float]] = {"checked": [], "unchecked": []}
        for _ in range(args.rounds):
            for how, m in (("checked", checked_marker), ("unchecked", unchecked_marker)):
                storage.write_json(layout.checkpoint_marker(root, 1), m)
                times[how].append(load())
        rate = _sha256_rate()
    checked, unchecked = statistics.median(times["checked"]), statistics.median(times["unchecked"])
    params = sum(p.numel() for p in model.parameters())
    print(f"model: {args.shape}, {params / 1e6:.1f}M parameters; checkpoint files {total / 1e9:.2f} GB "
          f"(weights, trainer state, optimizer state)")
    print(f"save (hashing included): {save_s:.2f} s; SHA-256 on this CPU: {rate:.2f} GB/s, i.e. "
          f"{total / 1e9 / rate:.2f} s of a save's time is hashing")
    print(f"load rounds (s): checked {[round(t, 2) for t in times['checked']]}, "
          f"unchecked {[round(t, 2) for t in times['unchecked']]}")
    print(f"checkpoint digests: load {checked:.2f} s checked vs {unchecked:.2f} s unchecked "
          f"(+{100 * (checked - unchecked) / unchecked:.0f} %) for {total / 1e9:.2f} GB")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
