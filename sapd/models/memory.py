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
    max_positions: int = 0  # max_position_embeddings: vLLM's default model length (0: unknown)

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
                 head_only=cfg.get("model_type") in PLAIN_HEAD_TYPES,
                 max_positions=int(cfg.get("max_position_embeddings") or 0))


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
    zero = cfg.train.zero_stage if cfg.train.engine == "deepspeed" else 0
    # DeepSpeed with bf16 weights accumulates the reduced gradients in fp32 (sapd.engines.deepspeed_engine
    # "Gradients in fp32"): the whole model's on a ZeRO-1 rank, its partition's on a ZeRO-2/3 rank
    accumulate = 4.0 * n if zero >= 1 and b == 2 else 0.0
    if cfg.train.engine == "deepspeed" and train_processes > 1:
        optimizer /= train_processes if zero >= 1 else 1
        gradients /= train_processes if zero >= 2 else 1
        accumulate /= train_processes if zero >= 2 else 1
        weights /= train_processes if zero >= 3 else 1
    gradients += accumulate
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


# ---------------------------------------------------------------------------------------------------
# the GPU plan: what each GPU holds in each phase of a run (``sapd check``; ``--gpu-memory`` for a GPU that
# is not there)

CUDA_CONTEXT = 0.5 * GIB  #: a process's CUDA context and library workspaces (cuBLAS, NCCL), before any tensor
#: a vLLM engine asleep keeps what sleep does not free: its CUDA graphs and the memory outside sleep's tags
VLLM_ASLEEP = 1.0 * GIB
#: bytes per (token × vocabulary entry) while vLLM computes prompt log-probs: the logits in the model's dtype,
#: their float32 log-softmax and its float32 working copy. vLLM's memory profile does not run this path, so the
#: peak comes on top of the engine's gpu_memory_utilization share
PROMPT_LOGPROB_BYTES = 10
#: tokens one step of sapd's vLLM teacher scorer schedules (``max_num_batched_tokens``): it bounds the prompt
#: log-prob peak of one request's chunk (sapd.models.vllm_backend.VLLMScorer sets it)
SCORER_BATCHED_TOKENS = 8192
SCORER_MAX_SEQS = 256


def vllm_step_defaults(gpu_bytes: float) -> tuple[int, int]:
    """(max_num_batched_tokens, max_num_seqs) vLLM 0.32 chooses for an offline ``LLM`` on a GPU of this size
    (its EngineArgs defaults; an A100 of 80 GB takes the smaller pair, which the plan does not know)."""
    return (16384, 1024) if gpu_bytes >= 70 * GIB else (8192, 256)


def vllm_profile_bytes(shape: Shape, dtype_bytes: int, batched_tokens: int, max_seqs: int) -> float:
    """The activation peak of vLLM's memory profile (a forward of ``batched_tokens`` tokens, one layer's
    working set at a time, then the sampler's float32 logits of ``max_seqs`` rows): what the engine keeps free
    of its share besides the weights, before the KV cache takes the rest."""
    layer = batched_tokens * (4 * shape.hidden + 2 * shape.intermediate) * dtype_bytes
    return layer + max_seqs * shape.vocab * 4.0


@dataclass
class Holding:
    """One thing a GPU holds in a phase: ``bytes`` counted against the GPU (``inside``: the parts of a vLLM
    engine's share, shown under it and not counted again)."""

    what: str
    bytes: float
    note: str = ""
    inside: list[Holding] = field(default_factory=list)

    def line(self) -> str:
        return f"{self.what} {size(self.bytes)}" + (f" ({self.note})" if self.note else "")


@dataclass
class Phase:
    name: str  # "sample + score", "train"
    gpu: str  # which GPU: "the GPU", "each scoring GPU", "each of the 16 training GPUs"
    capacity: float  # bytes
    holds: list[Holding]
    margin: float = 1.0  # the sapd-sized parts (not vLLM's shares) need this × their estimate
    problems: list[str] = field(default_factory=list)  # what does not fit, each naming what to change
    sized: set[str] = field(default_factory=set)  # the holdings whose estimate takes the margin

    @property
    def total(self) -> float:
        return sum(h.bytes * (self.margin if h.what in self.sized else 1.0) for h in self.holds)

    def lines(self) -> list[str]:
        head = (f"{self.name} ({self.gpu}): {size(self.total)} of {size(self.capacity)}"
                + (f" (the trainer's estimate +{self.margin - 1:.0%} headroom)" if self.sized else "")
                + (" — DOES NOT FIT" if self.problems else ""))
        out = [head]
        for h in self.holds:
            out.append(f"  {h.line()}")
            out.extend(f"    {i.line()}" for i in h.inside)
        return out


@dataclass
class GpuPlan:
    """What each GPU holds in each phase of the run (:func:`gpu_plan`)."""

    layout: str
    phases: list[Phase]

    @property
    def problems(self) -> list[str]:
        return [f"{p.name}: {why}" for p in self.phases for why in p.problems]

    def lines(self) -> list[str]:
        return [self.layout] + [line for p in self.phases for line in p.lines()]


def _trainer_holdings(cfg: Any, student: Shape, ranks: int, prompt: int) -> tuple[list[Holding], str]:
    """The trainer's parts on one rank's GPU, ZeRO-sharded over ``ranks`` (``train.engine: deepspeed``), and
    the note of its activations."""
    est = {e.stage: e for e in estimate(cfg, student, None, ranks, prompt)}["train"]
    half = BYTES[cfg.model.dtype] == 2
    n = float(student.params)
    zero = cfg.train.zero_stage if cfg.train.engine == "deepspeed" and ranks > 1 else 0
    master = 4.0 * n if half else 0.0
    share = (lambda b, stage: b / ranks if zero >= stage else b)
    parts = [Holding("weights", est.parts["weights"], f"{cfg.model.dtype}" + (f", 1/{ranks}" if zero >= 3 else "")),
             Holding("gradients", est.parts["gradients"],
                     ("bf16 + the fp32 sums DeepSpeed accumulates" if zero >= 1 and half else "")
                     + (f", 1/{ranks}" if zero >= 2 else "")),
             Holding("Adam moments", share(8.0 * n, 1), "float32" + (f", 1/{ranks}" if zero >= 1 else ""))]
    if half:
        parts.append(Holding("fp32 master", share(master, 1), "1/%d" % ranks if zero >= 1 else ""))
    parts.append(Holding("activations", est.parts["activations"], est.note.split(", prompts at")[0]))
    return parts, est.note


def gpu_plan(cfg: Any, student: Shape, teacher: Shape | None, gpu_bytes: float, *, gpus: int = 1,
             prompt_tokens: int | None = None, phases: tuple[str, ...] | None = None) -> GpuPlan:
    """What each GPU holds, phase by phase, for a run config whose ``model.device`` is a GPU of ``gpu_bytes``:

    - ``gpus`` 1: ``sapd run`` on one GPU, every phase on it. While the student samples and the teacher
      scores, the trainer waits in host memory; while the trainer trains, the vLLM engines sleep (the student's
      weights and KV cache freed, the teacher's weights in host memory) or the HF models wait in host memory.
    - ``gpus`` N > 1: the cluster — each scoring pod's GPU holds both engines (or HF models); N training ranks
      shard the trainer with ZeRO (``train.engine: deepspeed``, ``train.zero_stage``).

    vLLM engines hold their ``sampling.gpu_memory_utilization`` share of the GPU (weights, the activation
    peak of vLLM's profile, the KV cache in the rest); the teacher's prompt log-probs come on top of it. The
    trainer's parts are :func:`estimate`'s, with :data:`HEADROOM`. Prompts are the longest the prefix build
    kept (``prompt_tokens``), else ``data.max_prompt_tokens``; responses ``sampling.max_new_tokens``.
    ``phases``: only those ("sample + score", "train"), e.g. a stage pod's own."""
    b = BYTES[cfg.model.dtype]
    P = prompt_tokens or cfg.data.max_prompt_tokens or 4096
    R = cfg.sampling.max_new_tokens
    G = cfg.sampling.group_size
    colocated = gpus == 1
    ranks = gpus if not colocated else 1
    vllm = cfg.sampling.backend == "vllm"
    recorded = objective_of(cfg.loss_cfg).data == "recorded"
    teacher = None if recorded else teacher
    out: list[Phase] = []
    if colocated:
        where = "one GPU, every phase on it (sapd run)"
    elif cfg.train.engine == "deepspeed":
        where = f"{gpus} training GPUs (ZeRO-{cfg.train.zero_stage} over {gpus} ranks), each scoring pod on its own GPU"
    else:
        where = (f"{gpus} GPUs, but train.engine {cfg.train.engine} trains on one process: the trainer is not sharded "
                 "(train.engine: deepspeed shards it)")
        ranks = 1
    if phases is None or "sample + score" in phases:
        sample = Phase("sample + score", "the GPU" if colocated else "each scoring pod's GPU", gpu_bytes, [])
        contexts = 1 + (2 if vllm else 0) if colocated else (2 if vllm else 1)
        if vllm:
            for who, shape, share_key, tp in (
                    ("student", student, "gpu_memory_utilization", cfg.sampling.tensor_parallel_size),
                    ("teacher", teacher, "gpu_memory_utilization", cfg.sampling.teacher_tensor_parallel_size)):
                if shape is None:
                    continue
                u = getattr(cfg.sampling, share_key)
                budget = u * gpu_bytes
                tokens, seqs = (SCORER_BATCHED_TOKENS, SCORER_MAX_SEQS) if who == "teacher" else \
                    vllm_step_defaults(gpu_bytes)
                weights = shape.params * b / tp
                profile = vllm_profile_bytes(shape, b, tokens, seqs)
                kv = budget - weights - profile
                per_token = kv_cache_bytes(shape, 1, b) / tp
                model_len = max(shape.max_positions or 0, P + R)
                inside = [Holding("weights", weights, f"{cfg.model.dtype}" + (f", 1/{tp} (tensor parallel)"
                                                                              if tp > 1 else "")),
                          Holding("activation peak", profile, f"vLLM's profile: {tokens} tokens, {seqs} sequences"),
                          Holding("KV cache", max(kv, 0.0), f"{max(kv, 0) / per_token:,.0f} tokens; one group is "
                                                            f"{P} + {G} × {R} = {P + G * R:,}")]
                sample.holds.append(Holding(f"{who} engine (vLLM)", budget,
                                            f"sampling.gpu_memory_utilization {u:g} of the GPU", inside))
                if kv < model_len * per_token:
                    sample.problems.append(
                        f"the {who} engine's KV cache ({max(kv, 0) / GIB:.1f} GiB) holds fewer tokens than one "
                        f"sequence of its model length {model_len} (vLLM refuses to start): raise "
                        f"sampling.gpu_memory_utilization (now {u:g}) or use a larger GPU")
            if teacher is not None:
                rows = min(SCORER_BATCHED_TOKENS, P + R)
                sample.holds.append(Holding("teacher prompt log-probs", rows * teacher.vocab * PROMPT_LOGPROB_BYTES,
                                            f"{rows} tokens × vocabulary {teacher.vocab:,}, outside the engines' "
                                            "shares"))
        else:
            hf = {e.stage: e for e in estimate(cfg, student, teacher, 1, P)}["teacher-scores"]
            for what, nbytes in hf.parts.items():
                sample.holds.append(Holding(what, nbytes))
                sample.sized.add(what)
            sample.margin = HEADROOM
        if colocated:
            trainer, _ = _trainer_holdings(cfg, student, 1, P)
            host = sum(h.bytes for h in trainer if h.what != "activations")
            sample.holds.append(Holding("trainer", 0.0, f"waits in host memory: {size(host)}"))
        sample.holds.append(Holding(f"CUDA contexts ({contexts} process{'es' if contexts > 1 else ''})",
                                    contexts * CUDA_CONTEXT))
        if sample.total > gpu_bytes:
            over = [h for h in sample.holds if h.what.endswith("(vLLM)")]
            shares = " + ".join(f"{h.bytes / gpu_bytes:.2g}" for h in over)
            sample.problems.append(
                f"{size(sample.total)} on a GPU of {size(gpu_bytes)}: "
                + (f"lower sampling.gpu_memory_utilization (the engines take {shares} of it; what they hold "
                   f"beyond their weights is KV cache)" if over else
                   f"lower sampling.prompts_per_batch (now {cfg.sampling.prompts_per_batch}), sampling.group_size "
                   f"or sampling.max_new_tokens, or use sampling.backend: vllm")
                + ", or use a larger GPU")
        out.append(sample)
    if phases is None or "train" in phases:
        train = _train_phase(cfg, student, teacher, gpu_bytes, ranks, P, colocated, vllm,
                             "the GPU" if colocated else f"each of the {gpus} training GPUs")
        if train.problems:
            train.problems = [f"{train.problems[0]}: {train_remedy(cfg, student, teacher, gpu_bytes, ranks, P)}"]
        out.append(train)
    return GpuPlan(where, out)


def _train_phase(cfg: Any, student: Shape, teacher: Shape | None, gpu_bytes: float, ranks: int, prompt: int,
                 colocated: bool, vllm: bool, gpu: str) -> Phase:
    train = Phase("train", gpu, gpu_bytes, [], margin=HEADROOM)
    for h in _trainer_holdings(cfg, student, ranks, prompt)[0]:
        train.holds.append(h)
        train.sized.add(h.what)
    if colocated and vllm:
        train.holds.append(Holding("student engine asleep", VLLM_ASLEEP, "level 2: weights and KV cache freed"))
        if teacher is not None:
            train.holds.append(Holding("teacher engine asleep", VLLM_ASLEEP,
                                       "level 1: weights in host memory, KV cache freed"))
    elif colocated:
        train.holds.append(Holding("HF student and teacher", 0.0, "wait in host memory"))
    contexts = 3 if colocated and vllm and teacher is not None else 2 if colocated and vllm else 1
    train.holds.append(Holding(f"CUDA contexts ({contexts} process{'es' if contexts > 1 else ''})",
                               contexts * CUDA_CONTEXT))
    if train.total > gpu_bytes:
        train.problems.append(f"{size(train.total)} on a GPU of {size(gpu_bytes)}")
    return train


def train_remedy(cfg: Any, student: Shape, teacher: Shape | None, gpu_bytes: float, ranks: int, prompt: int) -> str:
    """What to change so that the train phase fits: the first of the usual knobs that fits on its own (one
    prefix per micro-batch, gradient checkpointing), else the largest ``sampling.max_new_tokens`` and the
    largest ``sampling.group_size`` that fit (halving), else more GPUs."""
    import dataclasses

    tc, sc = cfg.train, cfg.sampling

    def fits(train: Any = None, sampling: Any = None) -> bool:
        alt = dataclasses.replace(cfg, train=train or tc, sampling=sampling or sc)
        phase = _train_phase(alt, student, teacher, gpu_bytes, ranks, prompt, ranks == 1,
                             sc.backend == "vllm", "")
        return not phase.problems

    if tc.micro_batch_prefixes > 1 and fits(train=dataclasses.replace(tc, micro_batch_prefixes=1)):
        return "set train.micro_batch_prefixes: 1"
    if not cfg.checkpointing_on() and fits(train=dataclasses.replace(tc, gradient_checkpointing=True)):
        return "set train.gradient_checkpointing: true"
    options = []
    for key, now, floor in (("max_new_tokens", sc.max_new_tokens, 16), ("group_size", sc.group_size, 2)):
        value = now // 2
        while value >= floor and not fits(sampling=dataclasses.replace(sc, **{key: value})):
            value //= 2
        if value >= floor:
            options.append(f"sampling.{key} to {value} (now {now})")
    if options:
        return "lower " + " or ".join(options)
    return (f"lower sampling.group_size (now {sc.group_size}), sampling.max_new_tokens (now {sc.max_new_tokens}) "
            "or data.max_prompt_tokens, or use a larger GPU")
