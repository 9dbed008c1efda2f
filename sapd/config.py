"""Typed run configuration. Defaults are the paper's (docs/SAPD.md §5, Appendix B); experiment files are
YAML overlays listing only differences; an unknown key is an error naming its dotted path; the
resolved config is written into the run root (``config.yaml``).

Launch: ``sapd run my-run.yaml`` (overlays stack: ``sapd run my-run.yaml variants/opd_rule``; a
``variants/NAME`` argument is the named variant of :data:`sapd.method.objective.VARIANTS`).
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import types
import typing
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Callable, Literal

from sapd import layout, storage, yamlio
from sapd.method.benchmarks import BENCHMARKS
from sapd.method.objective import VARIANTS, LossConfig, loss_config_for, objective_of
from sapd.platform import Platform, detect


@dataclass
class DataConfig:
    input: str = ""  # trajectories: a file or folder, local or s3://
    format: str = "native"  # a name in sapd.data.loaders.FORMATS (docs/FORMATS.md), checked where data is read
    benchmark: str = "alfworld"  # alfworld | webshop | searchqa | textworld | scienceworld
    history_length: int | None = None  # recent (obs, action) pairs per prompt; None = the benchmark's default
    full_history: bool = False  # every earlier pair instead
    prompt_style: Literal["step", "chat"] = "step"  # one verl-agent style step prompt, or the history as chat turns
    max_prompt_tokens: int | None = 4096  # tokenizer-based length filter (docs/SAPD.md §5)
    val_fraction: float = 0.05  # offline validation split by trajectory (docs/SAPD.md §5)
    split_seed: int = 0  # seed of the train/val split
    skip_invalid: bool = False  # count and skip invalid records instead of stopping at the first
    action_wording: Literal["recorded", "put", "move"] = "recorded"  # ALFWorld: rewrite put X in/on Y ↔ move X to Y
    # ReOPD: draw each round's prefixes with p(t) ∝ κ^t (paper: 0.6); None = whole trajectories
    reopd_kappa: float | None = None


# how a value of `sapd init`'s starter config that is still to be filled in begins (`sapd check` names each)
PLACEHOLDER = "PATH/TO/"

FLOAT16_NOT_TRAINED = ("model.dtype: float16 is not trained: its gradients need dynamic loss scaling, which sapd "
                       "does not do; use bfloat16 (the same memory; an fp32 master of the weights is kept) or float32")


AUTO: typing.Final = "auto"
Precision = Literal["float32", "bfloat16", "float16"]
#: the keys whose value may be ``auto``: each process resolves it from what it runs on (resolve_auto)
AUTO_KEYS = ("model.device", "model.dtype", "sampling.backend")


@dataclass
class ModelConfig:
    student: str = ""  # HF folder or s3:// prefix: the initial student (checkpoint 0)
    teacher: str = ""  # HF folder or s3:// prefix: the frozen teacher (must share the student's tokenizer)
    # bfloat16: checkpoints, sampling and scoring in bf16, training on an fp32 master kept in the optimizer
    # state (docs/design/training.md); float16 is refused by training (FLOAT16_NOT_TRAINED). auto: bfloat16 on a GPU
    # that computes in it, float32 on a CPU
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = AUTO
    device: str = AUTO  # auto (cuda:LOCAL_RANK where torch sees CUDA, else cpu) | cpu | cuda | cuda:N


@dataclass
class SamplingConfig:
    # student sampling and teacher scoring: transformers, or vLLM (a GPU). auto: vLLM where it is installed and
    # model.device is a GPU, else hf
    backend: Literal["auto", "hf", "vllm"] = AUTO
    group_size: int = 8  # G responses per prefix (paper: 8)
    temperature: float = 1.0  # of the student samples (paper: 1.0)
    top_p: float = 1.0  # nucleus sampling of the student samples; 1.0 = off
    # response budget of each sample: 512 as in the verl-agent scripts SDAR builds on; each round logs the
    # share cut at it
    max_new_tokens: int = 512
    prompts_per_batch: int = 4  # HF: prompts prefilled together (each becomes G decode rows)
    gpu_memory_utilization: float = 0.4  # vLLM: share of GPU memory for each engine (student sampler, teacher)
    tensor_parallel_size: int = 1  # vLLM: GPUs the student sampler's engine spans
    teacher_tensor_parallel_size: int = 1  # vLLM: GPUs the teacher scoring engine spans
    # vLLM: deadline (s) of each call of the student engine's in-place weight sync; past it the stage stops
    weight_sync_timeout_s: float = 600.0


@dataclass
class RuleConfig:
    format_weight: float = 1.0  # α_format (Eq. 12)
    repetition_weight: float = 1.0  # α_repetition (Eq. 12)


@dataclass
class TrainConfig:
    rounds: int = 100  # rollout batches; each is followed by its optimizer steps
    trajectories_per_round: int = 16  # every prefix of this many trajectories per round (paper: 16; search QA 128)
    epochs_per_round: int = 1  # passes over a round's scored data
    minibatch_prefixes: int = 16  # prefixes (× G responses) per optimizer step
    # prefixes per forward/backward (× G rows; gradient accumulation inside a minibatch). One keeps a 1.5B
    # student's step within an 80 GB GPU at long prompts, and divides every minibatch evenly over the ranks
    # (docs/guides/scaling.md); several ranks need minibatch_prefixes a multiple of this × the ranks
    micro_batch_prefixes: int = 1
    lr: float = 1e-6  # paper: 1e-6
    weight_decay: float = 0.0  # AdamW
    betas: tuple[float, float] = (0.9, 0.999)  # AdamW
    lr_schedule: Literal["constant", "linear", "cosine"] = "constant"  # after warm-up; linear, cosine: over the rounds
    warmup_steps: int = 0  # linear warm-up, in optimizer steps
    max_grad_norm: float = 1.0  # gradient clipping
    # recompute activations in backward: less memory, ~30 % more time. "auto": on for a CUDA model.device
    # (as verl-agent's runs do), off on a CPU (it turns off train.shared_prompt's KV cache, the CPU's gain)
    gradient_checkpointing: bool | Literal["auto"] = "auto"
    # training and π_old run each prefix's prompt once over its repeated KV cache ("on"), or G full
    # prompt+response sequences in one batch ("off"). "auto": on for the torch engine on a CPU model —
    # measured (docs/results/STAGES.md): 0.22× the time on 2 CPU cores; no clear gain on an H200 at 0.5B
    shared_prompt: Literal["auto", "on", "off"] = "auto"
    engine: Literal["torch", "deepspeed"] = "torch"  # one process, or DeepSpeed ZeRO under torchrun
    zero_stage: int = 2  # DeepSpeed ZeRO stage (engine: deepspeed)
    # largest safetensors shard of a checkpoint; shards are gathered (ZeRO-3) and written one at a time
    checkpoint_shard_mb: float = 2048.0
    seed: int = 0  # seeds each round's sampling (per worker) and minibatch order
    # "one_step": round k+1 is sampled and scored with checkpoint k while round k trains (the cluster's
    # persistent workers then keep both pools busy). Not the paper's: π_old is one step stale, corrected by
    # a truncated behaviour weight in the loss (docs/SAPD.md §6). "off": every round samples its own checkpoint
    overlap: Literal["off", "one_step"] = "off"


@dataclass
class ValidationConfig:
    """The student's distance to the teacher on held-out prefixes (``prefixes/val``), measured inside the
    teacher-scores stage of round k on checkpoint k with the engines already up (docs/design/training.md
    "Validation"): the reverse KL(student ‖ teacher) per sampled token, the forward log-ratio on the
    recorded responses, the student's and the teacher's sampled action match."""

    every_rounds: int = 1  # checkpoint k is validated when k is a multiple of this, and the last one; 0 = never
    max_prefixes: int = 64  # a seeded sample of the validation pool, at most this many prefixes (0 = all)
    group_size: int = 4  # samples per prefix, at temperature 1 (the KL is an expectation under the student)
    max_new_tokens: int | None = None  # per sample; None = sampling.max_new_tokens
    seed: int = 0  # which prefixes the cap keeps, and the samples' seed (the same every round)


@dataclass
class StorageConfig:
    # every storage operation (local or S3) retries transient failures — connection refused, timeouts, 5xx,
    # SlowDown — with capped exponential backoff and full jitter for this long after its first failure,
    # then the stage exits 75 (sapd.storage.configure_retries; docs/FAULTS.md)
    retry_deadline_s: float = 300.0
    # the run root's lease (one writer per run root, sapd.lease) expires this long after its holder last
    # renewed it (every quarter of it); a run on the same root by anyone else waits for that or takes over
    lease_ttl_s: float = 120.0


@dataclass
class RunConfig:
    run_root: str = "runs/default"  # a local folder or s3://bucket/prefix; everything of the run lives here
    # a named setting of the objective (docs/SAPD.md §4): a key of sapd.method.objective.VARIANTS (listed in
    # docs/reference/config.md), or an objective's name (docs/guides/new-objective.md)
    variant: str = "sapd"
    loss: dict[str, Any] = field(default_factory=dict)  # overrides of the variant's LossConfig fields
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    rules: RuleConfig = field(default_factory=RuleConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    validation: ValidationConfig = field(default_factory=ValidationConfig)
    workers: int = 1  # teacher-scores workers that split one round (Indexed Job completions on Kubernetes)
    storage: StorageConfig = field(default_factory=StorageConfig)  # riding out outages; the run root's lease
    # the variant with its `loss` overrides, resolved (and typed) once: by construction and by validate()
    loss_cfg: LossConfig = field(init=False, repr=False, compare=False)
    # the AUTO_KEYS this process resolved from "auto": key → (the value, why); written back as "auto"
    # (to_dict), so the run root's config says what the user asked, and each process resolves it afresh
    resolved_auto: dict[str, tuple[str, str]] = field(default_factory=dict, repr=False, compare=False,
                                                      metadata={"derived": True})

    def __post_init__(self) -> None:
        self.loss_cfg = _resolve_loss(self.variant, self.loss)
        self.resolved_auto = dict(self.resolved_auto)  # a copy's own (dataclasses.replace passes the mapping on)
        resolve_auto(self)

    def checkpointing_on(self) -> bool:
        """``train.gradient_checkpointing`` resolved: "auto" is on for a CUDA ``model.device``."""
        ckpt = self.train.gradient_checkpointing
        return self.model.device.startswith("cuda") if ckpt == "auto" else bool(ckpt)

    def to_dict(self, as_written: bool = True) -> dict[str, Any]:
        """The config as a mapping; ``as_written``: each key resolved from "auto" (and not changed since) is
        "auto" again, as the user wrote it; else the values this process runs with."""
        d = asdict(self)
        del d["loss_cfg"]  # derived from variant + loss
        del d["resolved_auto"]
        if as_written:
            for key, (value, _) in self.resolved_auto.items():
                section, name = key.split(".")
                if d[section][name] == value:
                    d[section][name] = AUTO
        return d

    def precision(self) -> Precision:
        """``model.dtype`` as resolved (never "auto": every constructor resolves it)."""
        if self.model.dtype == AUTO:
            raise RuntimeError("model.dtype is still 'auto': the config was changed after it was resolved "
                               "(sapd.config.resolve_auto)")
        return typing.cast(Precision, self.model.dtype)

    def auto_lines(self) -> list[str]:
        """One line per key resolved from "auto": ``model.device: auto → cuda (1 CUDA device …)``."""
        return [f"{key}: auto → {value} ({why})" for key, (value, why) in self.resolved_auto.items()]


def resolved_for(cfg: RunConfig, platform: Platform) -> RunConfig:
    """A copy of ``cfg`` whose "auto" values are resolved for ``platform`` instead of this process (a GPU
    machine being planned for: ``sapd check --gpu-memory``)."""
    copy = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model), sampling=dataclasses.replace(cfg.sampling))
    _unresolve(copy)
    resolve_auto(copy, platform)
    return copy


def _unresolve(cfg: RunConfig) -> None:
    """Each key resolved from "auto" (and not changed since) set to "auto" again."""
    for key, (value, _) in cfg.resolved_auto.items():
        section, name = key.split(".")
        if getattr(getattr(cfg, section), name) == value:
            setattr(getattr(cfg, section), name, AUTO)
    cfg.resolved_auto = {}


def resolve_auto(cfg: RunConfig, platform: Platform | None = None) -> None:
    """Each of :data:`AUTO_KEYS` set to "auto" resolved for this process (or for ``platform``, a GPU machine
    being planned for), recorded in ``cfg.resolved_auto`` with the reason:

    - ``model.device``: ``cuda:LOCAL_RANK`` under torchrun (``cuda`` in a plain process) where torch sees a
      CUDA device, else ``cpu``;
    - ``model.dtype``: ``bfloat16`` (trained on an fp32 master) on a GPU that computes in it — a configured
      ``cuda`` device counts as one even where this process sees none (the cluster's driver) — else
      ``float32``;
    - ``sampling.backend``: ``vllm`` where vLLM is installed and the device is a GPU, else ``hf``.

    >>> from sapd.platform import Platform
    >>> c = RunConfig(); c.model.device = c.model.dtype = c.sampling.backend = "auto"
    >>> resolve_auto(c, Platform(cuda=True, gpus=1, bf16=True, vllm=True, local_rank=3))
    >>> c.model.device, c.model.dtype, c.sampling.backend
    ('cuda:3', 'bfloat16', 'vllm')
    """
    m, s = cfg.model, cfg.sampling
    if AUTO not in (m.device, m.dtype, s.backend):
        return
    p = platform or detect()
    planned = "" if p.where == "this machine" else f" ({p.where})"
    given = os.environ.get("SAPD_POD_GPUS", "") if platform is None else ""
    if m.device == AUTO and not p.cuda and given.isdigit() and int(given) > 0:
        raise ConfigError(f"model.device: auto: this pod was given {given} GPU{'s' if given != '1' else ''} "
                          "(SAPD_POD_GPUS, set by the chart from its nvidia.com/gpu limit) but torch sees no CUDA "
                          "device: check the node's NVIDIA driver and the pod's runtimeClassName, or set "
                          "model.device: cpu", "model.device")
    if m.device == AUTO:
        if p.cuda:
            m.device = "cuda" if p.local_rank is None else f"cuda:{p.local_rank}"
            why = p.describe_gpus() + (f"; this rank's LOCAL_RANK is {p.local_rank}" if p.local_rank is not None
                                       else "")
        else:
            m.device, why = "cpu", "torch sees no CUDA device"
        cfg.resolved_auto["model.device"] = (m.device, why + planned)
    gpu = m.device.startswith("cuda")
    if m.dtype == AUTO:
        if gpu and (p.bf16 or not p.cuda):
            m.dtype = "bfloat16"
            why = ("a GPU that computes in bfloat16" if p.cuda else f"model.device {m.device}: a GPU") + \
                "; training keeps an fp32 master of the weights"
        elif gpu:
            m.dtype = "float32"
            why = "the GPU does not compute in bfloat16 (compute capability below 8.0)"
        else:
            m.dtype, why = "float32", "a CPU"
        cfg.resolved_auto["model.dtype"] = (m.dtype, why + planned)
    if s.backend == AUTO:
        if gpu and p.vllm:
            s.backend = "vllm"
            why = "vLLM is installed and the device is a GPU"
        elif gpu:
            s.backend = "hf"
            why = "vLLM is not installed (pip install 'sapd[vllm]' to use it)"
        else:
            s.backend = "hf"
            why = "a CPU: vLLM is for GPUs"
        cfg.resolved_auto["sampling.backend"] = (s.backend, why + planned)


def _resolve_loss(variant: str, loss: dict[str, Any]) -> LossConfig:
    hints = typing.get_type_hints(LossConfig)
    typed = {k: _check_type(v, hints[k], f"loss.{k}") if k in hints else v for k, v in loss.items()}
    try:
        return loss_config_for(variant, **typed)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"variant/loss: {e}", "loss") from None


class ConfigError(ValueError):
    """A bad config value; ``path`` is the dotted key it is about (``train.lr``), when there is one."""

    def __init__(self, message: str, path: str | None = None) -> None:
        super().__init__(message)
        self.path = path


def _number_hint(value: Any) -> str:
    """A quoted number (``lr: "1e-6"``) reads as a string: say so."""
    if isinstance(value, str):
        try:
            float(value)
        except ValueError:
            return ""
        return " (a string: write the number without quotes)"
    return ""


def _check_type(value: Any, tp: Any, path: str) -> Any:
    origin = typing.get_origin(tp)
    if tp is Any:
        return value
    if origin is Literal:
        if value not in typing.get_args(tp):
            raise ConfigError(f"{path}: {value!r} is not one of {list(typing.get_args(tp))}", path)
        return value
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for a in args:
            if a is type(None):
                continue
            try:
                return _check_type(value, a, path)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(errors[0] if errors else f"{path}: bad value {value!r}", path)
    if origin is tuple and typing.get_args(tp)[-1:] == (Ellipsis,):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{path}: expected a list, got {value!r}", path)
        return tuple(_check_type(v, typing.get_args(tp)[0], f"{path}[{i}]") for i, v in enumerate(value))
    if origin is tuple:
        if not isinstance(value, (list, tuple)) or len(value) != len(typing.get_args(tp)):
            raise ConfigError(f"{path}: expected a list of {len(typing.get_args(tp))} values, got {value!r}", path)
        return tuple(_check_type(v, a, f"{path}[{i}]") for i, (v, a) in enumerate(zip(value, typing.get_args(tp))))
    if origin is list:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{path}: expected a list, got {value!r}", path)
        (arg,) = typing.get_args(tp) or (Any,)
        return [_check_type(v, arg, f"{path}[{i}]") for i, v in enumerate(value)]
    if origin is dict or tp is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{path}: expected a mapping, got {value!r}", path)
        return dict(value)
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{path}: expected a number, got {value!r}{_number_hint(value)}", path)
        return float(value)
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{path}: expected an integer, got {value!r}{_number_hint(value)}", path)
        return value
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{path}: expected true or false, got {value!r}", path)
        return value
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{path}: expected a string, got {value!r}", path)
        return value
    return value


def apply_overlay(obj: Any, overlay: dict[str, Any], path: str = "") -> None:
    """Set the fields of dataclass ``obj`` from ``overlay`` (nested dataclasses recursively), checking
    each value's type; an unknown key is a :class:`ConfigError` naming its dotted path."""
    hints = typing.get_type_hints(type(obj))
    names = [f.name for f in fields(obj) if f.init and not f.metadata.get("derived")]  # derived: not settable
    if isinstance(obj, RunConfig):  # "auto" is resolved again below, from the values the overlay leaves
        _unresolve(obj)
    for key, value in overlay.items():
        where = f"{path}{key}"
        if key not in names:
            close = difflib.get_close_matches(str(key), names, n=1)
            raise ConfigError(f"{where}: unknown key" + (f" (did you mean '{path}{close[0]}'?)" if close else
                                                         f"; known keys: {', '.join(names)}"), where)
        current = getattr(obj, key)
        if dataclasses.is_dataclass(current):
            if not isinstance(value, dict):
                raise ConfigError(f"{where}: expected a mapping of {type(current).__name__} keys, got {value!r}",
                                  where)
            apply_overlay(current, value, where + ".")
        elif key == "loss" and isinstance(obj, RunConfig):
            merged = {**current, **_check_type(value, dict, where)}
            setattr(obj, key, merged)
        else:
            setattr(obj, key, _check_type(value, hints[key], where))
    if isinstance(obj, RunConfig):
        resolve_auto(obj)


VARIANT_PREFIX = "variants/"


def read_yaml_mapping(path: str | Path) -> dict[str, Any]:
    """A YAML file whose top level is a mapping (YAML 1.2 numbers, :mod:`sapd.yamlio`); an empty file is {}."""
    p = Path(path)
    try:
        data = yamlio.load(p.read_text(encoding="utf-8"))
    except yamlio.yaml.YAMLError as e:
        raise ConfigError(f"{p}: not valid YAML: {e}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{p}: the top level must be a mapping")
    return data


def apply_file_overlay(obj: Any, where: str, data: dict[str, Any]) -> None:
    """:func:`apply_overlay` of a file's mapping; an error names ``file:line`` of the offending key."""
    try:
        apply_overlay(obj, data, "")
    except ConfigError as e:
        line = yamlio.line_of(data, e.path) if e.path else None
        raise ConfigError(f"{where}:{line}: {e}" if line else f"{where}: {e}", e.path) from None


def _overlay_source(name: str | Path) -> tuple[str, dict[str, Any]]:
    """(where, mapping) of one overlay argument: a YAML file, or ``variants/NAME`` — the named variant
    (a file of that name, if one exists, wins)."""
    p = Path(name)
    if p.is_file():
        return str(p), read_yaml_mapping(p)
    text = str(name).removesuffix(".yaml")
    if text.startswith(VARIANT_PREFIX):
        variant = text[len(VARIANT_PREFIX):]
        if variant not in VARIANTS:
            raise ConfigError(f"{name}: unknown variant; expected one of "
                              + ", ".join(VARIANT_PREFIX + v for v in VARIANTS))
        return str(name), {"variant": variant}
    raise ConfigError(f"{name}: no such config file (a variant is named variants/NAME, "
                      f"NAME one of {', '.join(VARIANTS)})")


def load_config(*paths: str | Path, overrides: dict[str, Any] | None = None) -> RunConfig:
    """Defaults, then each overlay in order (a YAML file, or ``variants/NAME``), then ``overrides``;
    validated."""
    cfg = RunConfig()
    sources = []
    for name in paths:
        where, data = _overlay_source(name)
        apply_file_overlay(cfg, where, data)
        sources.append((where, data))
    if overrides:
        apply_overlay(cfg, overrides, "")
    cfg._sources = sources  # type: ignore[attr-defined]  # for locate(): errors found later name file:line too
    try:
        validate(cfg)
    except ConfigError as e:
        raise locate(cfg, e) from None
    return cfg


def locate(cfg: RunConfig, e: ConfigError) -> ConfigError:
    """``e`` prefixed with ``file:line`` of the last overlay file that set the key it is about (``e.path``),
    when :func:`load_config` read ``cfg`` from files and one of them set it; else ``e`` itself. For values
    checked after loading, where the list they must be in lives above the config (``data.format``: the
    format registry of :mod:`sapd.data.loaders`)."""
    for where, data in reversed(getattr(cfg, "_sources", [])):
        if e.path and _sets(data, e.path):
            return ConfigError(f"{where}:{yamlio.line_of(data, e.path)}: {e}", e.path)
    return e


def _sets(data: Any, path: str) -> bool:
    for part in path.split("."):
        if not isinstance(data, dict) or part not in data:
            return False
        data = data[part]
    return True


def config_from_dict(data: dict[str, Any]) -> RunConfig:
    cfg = RunConfig()
    apply_overlay(cfg, data, "")
    validate(cfg)
    return cfg


def validate(cfg: RunConfig) -> None:
    cfg.loss_cfg = _resolve_loss(cfg.variant, cfg.loss)
    resolve_auto(cfg)
    if cfg.data.benchmark not in BENCHMARKS:
        raise ConfigError(f"data.benchmark: {cfg.data.benchmark!r} is not one of {sorted(BENCHMARKS)}",
                          "data.benchmark")
    if cfg.sampling.group_size < 2 and objective_of(cfg.loss_cfg).data != "recorded":
        raise ConfigError("sampling.group_size: a group needs at least 2 responses (advantages are group-relative)",
                          "sampling.group_size")
    tc = cfg.train
    for name in ("rounds", "trajectories_per_round", "epochs_per_round", "minibatch_prefixes", "micro_batch_prefixes"):
        if getattr(tc, name) < 1:
            raise ConfigError(f"train.{name}: must be at least 1", f"train.{name}")
    if tc.minibatch_prefixes % tc.micro_batch_prefixes:
        raise ConfigError("train.minibatch_prefixes must be a multiple of train.micro_batch_prefixes",
                          "train.minibatch_prefixes")
    if cfg.workers < 1:
        raise ConfigError("workers: must be at least 1", "workers")
    for key in ("tensor_parallel_size", "teacher_tensor_parallel_size"):
        if getattr(cfg.sampling, key) < 1:
            raise ConfigError(f"sampling.{key}: must be at least 1", f"sampling.{key}")
    if not cfg.sampling.weight_sync_timeout_s > 0:
        raise ConfigError("sampling.weight_sync_timeout_s: must be a positive number of seconds",
                          "sampling.weight_sync_timeout_s")
    v = cfg.validation
    for name, zero in (("every_rounds", "never"), ("max_prefixes", "all of prefixes/val")):
        if getattr(v, name) < 0:
            raise ConfigError(f"validation.{name}: must be at least 0 (0 = {zero})", f"validation.{name}")
    if v.group_size < 1:
        raise ConfigError("validation.group_size: must be at least 1", "validation.group_size")
    if v.max_new_tokens is not None and v.max_new_tokens < 1:
        raise ConfigError("validation.max_new_tokens: must be at least 1 (or null: sampling.max_new_tokens)",
                          "validation.max_new_tokens")
    if not cfg.storage.retry_deadline_s >= 0:
        raise ConfigError("storage.retry_deadline_s: must be ≥ 0 seconds (0: fail at the first error)",
                          "storage.retry_deadline_s")
    if not cfg.storage.lease_ttl_s >= 4:
        raise ConfigError("storage.lease_ttl_s: must be at least 4 seconds (the lease is renewed every quarter "
                          "of it)", "storage.lease_ttl_s")
    if cfg.data.reopd_kappa is not None and cfg.data.reopd_kappa <= 0:
        raise ConfigError("data.reopd_kappa: must be positive", "data.reopd_kappa")
    if tc.overlap == "one_step" and not ({"old_logp_P_G_T", "behaviour_logp_P_G_T"}
                                         <= objective_of(cfg.loss_cfg).accepts):
        raise ConfigError(f"train.overlap: one_step samples a round with the previous checkpoint, which the objective "
                          f"must correct for (it takes old_logp_P_G_T and behaviour_logp_P_G_T, as sapd does); "
                          f"variant {cfg.variant} (objective {cfg.loss_cfg.objective}) needs train.overlap: off",
                          "train.overlap")


def sampler_checkpoint(cfg: RunConfig, k: int) -> int:
    """The checkpoint that samples round ``k`` (its behaviour policy): checkpoint k, the paper's on-policy
    rounds; with ``train.overlap: one_step``, checkpoint k−1 from round 1 on, so round k is scored while
    round k−1 trains (round 0 and 1 both sample checkpoint 0).

    >>> c = RunConfig(); c.train.overlap = "one_step"
    >>> [sampler_checkpoint(RunConfig(), k) for k in range(3)], [sampler_checkpoint(c, k) for k in range(3)]
    ([0, 1, 2], [0, 0, 1])
    """
    return k - 1 if cfg.train.overlap == "one_step" and k > 0 else k


def apply_storage_settings(cfg: RunConfig, log: Callable[[str], None] | None = None) -> None:
    """This process's storage retries as the run config says (``storage.retry_deadline_s``); ``log``: where
    the "retrying until …" lines go (default: stderr)."""
    storage.configure_retries(cfg.storage.retry_deadline_s, log)


def micro_batch_problem(cfg: RunConfig, world_size: int) -> str | None:
    """Why ``world_size`` ranks would idle under the config's batch sizes, else None: a full minibatch
    of ``minibatch_prefixes`` is cut into micro-batches of ``micro_batch_prefixes`` shared round-robin by
    the ranks (:func:`sapd.stages.train.micro_batch_share`), so unless their count is a multiple of the
    ranks some ranks run a pass at weight 0 in every step (16 ranks, 16 / 4: 12 of 16). verl and DeepSpeed
    refuse such a batch too (train_batch_size = micro × accumulation × world size).

    >>> from sapd.config import config_from_dict
    >>> micro_batch_problem(config_from_dict({"train": {"minibatch_prefixes": 16, "micro_batch_prefixes": 1}}), 16)
    >>> print(micro_batch_problem(config_from_dict({"train": {"micro_batch_prefixes": 4}}), 16))
    train.minibatch_prefixes 16 / train.micro_batch_prefixes 4 = 4 micro-batches per optimizer step for 16 \
training ranks: 12 ranks would run a pass at weight 0 in every step; set train.micro_batch_prefixes to a divisor \
of 16 / 16 ranks (1), or train.minibatch_prefixes to a multiple of 4 × 16 = 64
    """
    tc, W = cfg.train, world_size
    micro_batches = tc.minibatch_prefixes // tc.micro_batch_prefixes
    if W <= 1 or micro_batches % W == 0:
        return None
    idle = W - micro_batches % W
    per_rank = tc.minibatch_prefixes // W if tc.minibatch_prefixes % W == 0 else 0
    divisors = [d for d in range(per_rank, 0, -1) if per_rank % d == 0]
    fix = (f"set train.micro_batch_prefixes to a divisor of {tc.minibatch_prefixes} / {W} ranks "
           f"({', '.join(map(str, divisors[:3]))}), or " if divisors else "")
    return (f"train.minibatch_prefixes {tc.minibatch_prefixes} / train.micro_batch_prefixes {tc.micro_batch_prefixes} "
            f"= {micro_batches} micro-batches per optimizer step for {W} training ranks: {idle} ranks would run a pass "
            f"at weight 0 in every step; {fix}train.minibatch_prefixes to a multiple of "
            f"{tc.micro_batch_prefixes} × {W} = {tc.micro_batch_prefixes * W}")


def dump_config(cfg: RunConfig, as_written: bool = True) -> str:
    """The config as YAML (:meth:`RunConfig.to_dict`: "auto" where the user wrote it, unless ``as_written`` is
    False: then the values this process runs with)."""
    def plain(x: Any) -> Any:
        if isinstance(x, tuple):
            return list(x)
        if isinstance(x, dict):
            return {k: plain(v) for k, v in x.items()}
        return x
    return yamlio.dump(plain(cfg.to_dict(as_written)))


#: may change between rounds of one run, or differ between the stages of one run (the scoring workers of a
#: round record their own count; the chart gives only the scoring stage its engines' tensor-parallel sizes)
MAY_CHANGE = ("workers", "sampling.tensor_parallel_size", "sampling.teacher_tensor_parallel_size",
              "sampling.weight_sync_timeout_s", "storage.retry_deadline_s", "storage.lease_ttl_s",
              # where a stage runs is not the experiment: the cluster's driver and prefix build run on a CPU, its
              # scoring and training pods on GPUs, each resolving model.device: auto for itself
              "model.device")
#: may change between two invocations of one run (a `helm upgrade --set config.train.rounds=40`, a `sapd run`
#: with more rounds): the run continues from its newest committed checkpoint. Only under a constant
#: lr_schedule: a linear or cosine decay spans train.rounds, so another count would change the learning rate
#: of every round left, and an extended run would no longer be the run it claims to be.
ROUNDS = "train.rounds"


def _flat(d: dict[str, Any], pre: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        out.update(_flat(v, f"{pre}{k}.") if isinstance(v, dict) and k != "loss" else {f"{pre}{k}": v})
    return out


def config_differences(a: RunConfig, b: RunConfig) -> list[str]:
    """Dotted keys whose values differ between two resolved configs (ignoring :data:`MAY_CHANGE`, and
    :data:`ROUNDS` when both run a constant learning rate). Compared as this process runs them: "auto"
    resolved, so a run root written with ``model.dtype: float32`` resumes under ``auto`` on a CPU, not on a
    GPU (where auto is bfloat16)."""
    fa, fb = (_flat(yamlio.load(dump_config(c, as_written=False))) for c in (a, b))
    ignored = set(MAY_CHANGE)
    if a.train.lr_schedule == b.train.lr_schedule == "constant":
        ignored.add(ROUNDS)
    return sorted(k for k in fa.keys() | fb.keys() if k not in ignored and fa.get(k) != fb.get(k))


def committed_config(cfg: RunConfig) -> RunConfig | None:
    """The resolved config committed in ``cfg``'s run root, or None before the run's first stage."""
    uri = layout.config_uri(cfg.run_root)
    if not storage.exists(uri):
        return None
    return config_from_dict(yamlio.load(storage.read_text(uri)) or {})


def committed_config_problem(cfg: RunConfig) -> str | None:
    """Why ``cfg`` may not run in its run root (one that holds a different resolved config), else None.
    Compared as resolved configs, so a key a newer sapd added (at its default) is no difference."""
    uri = layout.config_uri(cfg.run_root)
    if not storage.exists(uri):
        return None
    text = storage.read_text(uri)
    if text == dump_config(cfg):
        return None
    try:
        stored = config_from_dict(yamlio.load(text) or {})
    except ConfigError as e:
        return (f"{uri}: the committed config does not load ({e}); resume with the sapd that wrote it, or "
                "choose a new run_root")
    diffs = config_differences(stored, cfg)
    if not diffs:
        return None
    old, new = (_flat(yamlio.load(dump_config(c, as_written=False))) for c in (stored, cfg))
    shown = ", ".join(f"{k} ({old.get(k)!r} there, {new.get(k)!r} here)" for k in diffs[:4])
    shown += f" and {len(diffs) - 4} more" if len(diffs) > 4 else ""
    hint = (f" ({ROUNDS} may change only with train.lr_schedule constant: a {cfg.train.lr_schedule} decay spans "
            "the rounds)" if ROUNDS in diffs else "")
    return (f"{uri} holds a different resolved config: {shown}{hint}; resume with the same config, or choose a "
            "new run_root")


def write_run_config(cfg: RunConfig) -> None:
    """The resolved config goes into the run root (``config.yaml``); a run root already holding a
    *different* config is refused (resuming must not silently change the experiment; only
    :data:`MAY_CHANGE` keys may, and :data:`ROUNDS` under a constant learning rate). A new round count is
    written back, so the run root says how many rounds the run now has."""
    uri = layout.config_uri(cfg.run_root)
    if storage.exists(uri):
        problem = committed_config_problem(cfg)
        if problem:
            raise ConfigError(problem)
        stored = committed_config(cfg)
        if stored is not None and stored.train.rounds != cfg.train.rounds:
            storage.write_text(uri, dump_config(dataclasses.replace(
                stored, train=dataclasses.replace(stored.train, rounds=cfg.train.rounds))))
        return
    storage.write_text(uri, dump_config(cfg))
