"""Tiny real models built from a config (random weights) for the demo and the tests: the same Qwen2 /
Llama architectures and code paths as the real checkpoints, small enough to train on a CPU in seconds."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from sapd.models.loading import quiet_progress_off_terminal


def build_tiny_model(tokenizer, out_dir: str | Path, *, arch: Literal["qwen2", "llama"] = "qwen2",
                     hidden_size: int = 64, layers: int = 2, heads: int = 4, kv_heads: int = 2,
                     intermediate_size: int = 128, max_positions: int = 4096, seed: int = 0,
                     vocab_size: int | None = None):
    """Save a randomly initialised causal LM whose vocabulary covers ``tokenizer`` (plus the tokenizer
    itself) into ``out_dir``, HF format. ``vocab_size`` may be larger than the tokenizer's, as with
    real checkpoints whose embedding matrix is padded. Returns the model."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    quiet_progress_off_terminal()

    cfg_cls, model_cls = (Qwen2Config, Qwen2ForCausalLM) if arch == "qwen2" else (LlamaConfig, LlamaForCausalLM)
    config = cfg_cls(vocab_size=vocab_size or len(tokenizer), hidden_size=hidden_size,
                     intermediate_size=intermediate_size,
                     num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                     max_position_embeddings=max_positions, tie_word_embeddings=True,
                     eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                     bos_token_id=tokenizer.bos_token_id)
    torch.manual_seed(seed)
    model = model_cls(config)
    out = Path(out_dir)
    model.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
    return model


#: The shapes of the paper's models (Table 5: a Qwen2.5-1.5B-Instruct student, a Qwen2.5-3B-Instruct teacher),
#: as their config.json states them: for memory plans (``sapd check --gpu-memory``) and for models of their
#: size built locally with random weights (``bench/gpu_check.py --only one-gpu``), never downloaded.
QWEN2_5: dict[str, dict[str, object]] = {
    name: {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_act": "silu",
           "hidden_size": hidden, "intermediate_size": inter, "num_hidden_layers": layers,
           "num_attention_heads": heads, "num_key_value_heads": 2, "max_position_embeddings": 32768,
           "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "tie_word_embeddings": True, "vocab_size": 151936,
           "bos_token_id": 151643, "eos_token_id": 151645, "torch_dtype": "bfloat16", "transformers_version": "4.43.1"}
    for name, hidden, inter, layers, heads in (("1.5b", 1536, 8960, 28, 12), ("3b", 2048, 11008, 36, 16))}


def write_shape_folder(tokenizer, out_dir: str | Path, config: dict[str, object]) -> Path:
    """A model folder holding ``config`` (a config.json mapping, e.g. :data:`QWEN2_5`'s) and ``tokenizer``, no
    weights: enough for ``sapd check`` to plan the memory of a model of that size."""
    import json

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    tokenizer.save_pretrained(str(out))
    return out
