"""Memory estimates per stage from a model's ``config.json`` shapes and the run's batch sizes, without
loading a weight (``sapd check``, and each train pod against its own GPU before it loads the model).
Parameters are counted from the shapes of a Llama/Qwen2-style decoder (embeddings, attention with
grouped KV heads, gated MLP, norms). The training activations use measured figures
(``bench/activation_memory.py``, results in ``bench/results/activation_memory.txt``): what one decoder
layer keeps per token for backward (``SAVED_PER_TOKEN_LAYER``), the layer inputs alone under gradient
checkpointing plus one layer recomputed at a time, and the logits at the response positions only (the
training forward projects to the vocabulary there: :class:`sapd.models.scoring.HeadOnlyLM`). Prompts are
taken at the longest one the prefix build kept, when a build is committed. The allocator's overhead and
fragmentation come on top (:data:`HEADROOM`). ``bench/train_memory.py`` measures the real peak of the train
stage's process.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from sapd.method.objective import objective_of

GIB = 1024 ** 3
BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
HEADROOM = 1.2  #: allocator, CUDA context, temporary buffers: an estimate needs this margin to say "fits"
# bytes one decoder layer keeps for backward per token = a·hidden + c·intermediate, fitted to saved-tensor
# measurements of Qwen2 layers (SDPA) at the 0.5B, 1.5B and 3B widths, residuals under 1 %
# (bench/activation_memory.py): 107 KiB per token at 1.5B width in bf16. float16 as bfloat16.
SAVED_PER_TOKEN_LAYER = {"bfloat16": (23.53, 8.21), "float16": (23.53, 8.21), "float32": (38.98, 16.42)}
# bytes per logit (response position × vocabulary entry) alive at the LM head's backward: the logits in
# the model's dtype, their float32 copy (log-probs are taken in float32), its gradient, logsumexp's
# exp buffer, the gradient cast back
LOGIT_BYTES = 16
# decoder-only families whose causal-LM head is a plain projection of the last hidden state (no logit
# soft-capping or scaling in between), so it may be applied to selected positions only
# (sapd.models.scoring.decoder_and_head)
PLAIN_HEAD_TYPES = {"llama", "qwen2", "qwen3", "mistral", "smollm3", "phi3", "olmo2"}


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
    head_only: bool = True  # training projects to the vocabulary at response positions only (plain-head families)

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
    return Shape(str(arch), params, layers, hidden, kv_heads, head_dim, vocab, inter,
                 head_only=cfg.get("model_type") in PLAIN_HEAD_TYPES)


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


def saved_per_token_layer(shape: Shape, dtype: str) -> float:
    """Bytes one decoder layer of ``shape`` keeps for backward per token (``SAVED_PER_TOKEN_LAYER``)."""
    a, c = SAVED_PER_TOKEN_LAYER[dtype]
    return a * shape.hidden + c * shape.intermediate


def train_activation_bytes(shape: Shape, dtype: str, rows: int, sequence: int, response: int,
                           checkpointing: bool) -> float:
    """Peak activation memory of one forward/backward over ``rows`` right-padded sequences of ``sequence``
    tokens, ``response`` of them predicted: every layer's saved tensors, or, with gradient checkpointing,
    every layer's input plus one layer's saved tensors at a time (recomputed in backward); then the logits
    (at the response positions only for a plain-head family, else at every position)."""
    tokens = rows * sequence
    per_layer = saved_per_token_layer(shape, dtype)
    if checkpointing:
        layers = tokens * (shape.layers * shape.hidden * BYTES[dtype] + per_layer)
    else:
        layers = tokens * shape.layers * per_layer
    logits = rows * (response if shape.head_only else sequence) * shape.vocab * LOGIT_BYTES
    return layers + logits


def estimate(cfg: Any, student: Shape, teacher: Shape | None, train_processes: int = 1,
             prompt_tokens: int | None = None) -> list[StageEstimate]:
    """Per-stage peak estimates (one process) for the run config ``cfg`` (a :class:`sapd.config.RunConfig`);
    with ``train.engine: deepspeed``, ZeRO splits the optimizer state (stage ≥ 1), the gradients (≥ 2) and
    the weights (3) over ``train_processes``. Prompts are ``prompt_tokens`` long (the longest the prefix
    build kept), else ``data.max_prompt_tokens`` (the worst case: no build yet); responses
    ``sampling.max_new_tokens``."""
    b = BYTES[cfg.model.dtype]
    G = cfg.sampling.group_size
    prompt = prompt_tokens or cfg.data.max_prompt_tokens or 4096
    where = ("the longest prompt the prefix build kept" if prompt_tokens
             else "data.max_prompt_tokens: no prefix build yet")
    new = cfg.sampling.max_new_tokens
    seq = prompt + new
    out = []
    # sampling: the student's weights and the KV cache of prompts_per_batch × G rows
    rows = cfg.sampling.prompts_per_batch * G
    ts = StageEstimate("teacher-scores", {
        "student weights": student.params * b,
        "KV cache": kv_cache_bytes(student, rows * seq, b)},
        note=f"KV cache for {cfg.sampling.prompts_per_batch} prompts × G={G} × ({prompt} + {new}) tokens")
    recorded = objective_of(cfg.loss_cfg).data == "recorded"  # one recorded response per prefix, no teacher
    if teacher is not None and not recorded:
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
    per_prefix = 1 if recorded else G
    micro_rows = cfg.train.micro_batch_prefixes * per_prefix
    checkpointing = cfg.checkpointing_on()
    out.append(StageEstimate("train", {
        "weights": weights, "gradients": gradients, "optimizer": optimizer,
        "activations": train_activation_bytes(student, cfg.model.dtype, micro_rows, seq, new, checkpointing)},
        note=f"{cfg.train.micro_batch_prefixes} prefixes × {'G=' + str(G) if per_prefix > 1 else '1'} "
             f"× ({prompt} + {new}) tokens per forward, prompts at {where}, gradient checkpointing "
             f"{'on' if checkpointing else 'off'}"
             + (f"; ZeRO-{cfg.train.zero_stage} over {train_processes} processes"
                if cfg.train.engine == "deepspeed" else "")))
    out.append(StageEstimate("evaluate", {"weights": n * b, "KV cache": kv_cache_bytes(student, seq * 4, b)},
                             note="one episode's context at a time"))
    return out
