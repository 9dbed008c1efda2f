"""Memory estimates per stage from a model's ``config.json`` shapes and the run's batch sizes, without
loading a weight (``sapd check``). Estimates, not measurements: parameters are counted from the shapes
of a Llama/Qwen2-style decoder (embeddings, attention with grouped KV heads, gated MLP, norms), and
activations with a simple per-token model; the allocator's overhead and fragmentation come on top
(:data:`HEADROOM`). ``bench/train_memory.py`` measures the real peak of the train stage.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

GIB = 1024 ** 3
BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
HEADROOM = 1.2  # allocator, CUDA context, temporary buffers: an estimate needs this margin to say "fits"


@dataclass(frozen=True)
class Shape:
    """What the estimate needs of a model config."""

    architecture: str
    params: int
    layers: int
    hidden: int
    kv_heads: int
    head_dim: int
    vocab: int
    intermediate: int

    def describe(self) -> str:
        return (f"{self.architecture}, {self.params / 1e9:.3g} B parameters, {self.layers} layers, "
                f"hidden {self.hidden}, vocabulary {self.vocab}")


def shape_from_config(cfg: dict[str, Any]) -> Shape:
    """The shape of a decoder-only HF model config (``config.json``); nested ``text_config`` is followed."""
    if "text_config" in cfg and "hidden_size" not in cfg:
        cfg = {**cfg, **cfg["text_config"]}
    try:
        hidden = int(cfg["hidden_size"])
        layers = int(cfg["num_hidden_layers"])
        heads = int(cfg["num_attention_heads"])
        vocab = int(cfg["vocab_size"])
    except KeyError as e:
        raise ValueError(f"config.json has no {e.args[0]!r}: not a decoder model config sapd can size") from None
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    head_dim = int(cfg.get("head_dim") or hidden // heads)
    inter = int(cfg.get("intermediate_size") or 4 * hidden)
    attn = hidden * heads * head_dim + 2 * hidden * kv_heads * head_dim + heads * head_dim * hidden
    if cfg.get("attention_bias") or cfg.get("model_type") == "qwen2":  # q/k/v biases
        attn += heads * head_dim + 2 * kv_heads * head_dim
    per_layer = attn + 3 * hidden * inter + 2 * hidden
    embed = vocab * hidden
    params = embed + layers * per_layer + hidden + (0 if cfg.get("tie_word_embeddings", True) else embed)
    arch = (cfg.get("architectures") or [cfg.get("model_type", "model")])[0]
    return Shape(str(arch), params, layers, hidden, kv_heads, head_dim, vocab, inter)


@dataclass
class StageEstimate:
    stage: str
    parts: dict[str, float] = field(default_factory=dict)  # what → bytes
    note: str = ""

    @property
    def total(self) -> float:
        return sum(self.parts.values())

    def line(self) -> str:
        parts = " + ".join(f"{k} {size(v)}" for k, v in self.parts.items() if v > 0)
        return f"{self.stage}: {size(self.total)} = {parts}" + (f" ({self.note})" if self.note else "")


def size(n: float) -> str:
    return f"{n / GIB:.2f} GiB" if n >= GIB / 10 else f"{n / 1024 ** 2:.1f} MiB"


def kv_cache_bytes(shape: Shape, tokens: int, dtype_bytes: int) -> float:
    return 2.0 * shape.layers * shape.kv_heads * shape.head_dim * tokens * dtype_bytes


def estimate(cfg: Any, student: Shape, teacher: Shape | None, train_processes: int = 1) -> list[StageEstimate]:
    """Per-stage peak estimates (one process) for the run config ``cfg`` (a :class:`sapd.config.RunConfig`);
    with ``train.engine: deepspeed``, ZeRO splits the optimizer state (stage ≥ 1), the gradients (≥ 2) and
    the weights (3) over ``train_processes``. Prompts are taken at ``data.max_prompt_tokens`` (the worst case)."""
    b = BYTES[cfg.model.dtype]
    G = cfg.sampling.group_size
    prompt = cfg.data.max_prompt_tokens or 4096
    new = cfg.sampling.max_new_tokens
    seq = prompt + new
    out = []
    # sampling: the student's weights and the KV cache of prompts_per_batch × G rows
    rows = cfg.sampling.prompts_per_batch * G
    ts = StageEstimate("teacher-scores", {
        "student weights": student.params * b,
        "KV cache": kv_cache_bytes(student, rows * seq, b)},
        note=f"KV cache for {cfg.sampling.prompts_per_batch} prompts × G={G} × {seq} tokens")
    if teacher is not None and cfg.loss_cfg.objective != "sft":
        # scoring: the prompt once (its KV cache), then the G responses' logits in float32
        ts.parts["teacher weights"] = teacher.params * b
        ts.parts["teacher KV + logits"] = (kv_cache_bytes(teacher, prompt + G * new, b)
                                           + 2.0 * G * new * teacher.vocab * 4)
    if cfg.sampling.backend == "vllm":
        ts.note += f"; vLLM reserves sampling.gpu_memory_utilization={cfg.sampling.gpu_memory_utilization} per engine"
    out.append(ts)
    # training: weights, gradients, AdamW's two float32 moments (plus the float32 master weights every engine
    # keeps with half precision), activations of micro_batch_prefixes × G sequences
    n = student.params
    optimizer = 8.0 * n + (4.0 * n if b == 2 else 0.0)
    weights, gradients = float(n * b), float(n * b)
    if cfg.train.engine == "deepspeed" and train_processes > 1:
        zero = cfg.train.zero_stage
        optimizer /= train_processes if zero >= 1 else 1
        gradients /= train_processes if zero >= 2 else 1
        weights /= train_processes if zero >= 3 else 1
    tokens = cfg.train.micro_batch_prefixes * (G if cfg.loss_cfg.objective != "sft" else 1) * seq
    per_token_layer = (2 if cfg.train.gradient_checkpointing else 16) * student.hidden * b \
        + (0 if cfg.train.gradient_checkpointing else 2 * student.intermediate * b)
    out.append(StageEstimate("train", {
        "weights": weights, "gradients": gradients, "optimizer": optimizer,
        "activations": tokens * (student.layers * per_token_layer) + 3.0 * tokens * student.vocab * 4},
        note=f"{cfg.train.micro_batch_prefixes} prefixes × {'G=' + str(G) if cfg.loss_cfg.objective != 'sft' else '1'} "
             f"× {seq} tokens per forward" + (f"; ZeRO-{cfg.train.zero_stage} over {train_processes} processes"
                                             if cfg.train.engine == "deepspeed" else "")))
    out.append(StageEstimate("evaluate", {"weights": n * b, "KV cache": kv_cache_bytes(student, seq * 4, b)},
                             note="one episode's context at a time"))
    return out
