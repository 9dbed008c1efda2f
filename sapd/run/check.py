"""``sapd check CONFIG…``: everything about a run that can be known without training, checked before a
run spends GPUs — and again, each stage's share of it, at the start of ``sapd run`` and of every job.

Checks (each prints one line; every check runs even after one failed):

- **storage**: the run root is reachable with the given credentials and writable (a probe object is
  written and deleted);
- **run root**: it holds no *different* committed config (only ``workers`` may change, and
  ``train.rounds`` under a constant learning rate: the run continues from its newest checkpoint);
- **data**: the input exists and a sample of its records parses in the configured format;
- **student** / **teacher**: model folders with a config and a tokenizer with a chat template (no
  weights are read; from S3 only the small files are fetched);
- **tokenizers**: the student's and the teacher's are identical (the token signal needs one vocabulary);
- **memory**: on a GPU (visible, or planned with ``--gpu-memory GIB``), what each GPU holds in each phase
  (:func:`sapd.models.memory.gpu_plan`: the vLLM engines' shares and the teacher's prompt log-probs while
  sampling and scoring; the trainer's weights, gradients, fp32 master, Adam moments and activations while
  training; on one GPU the sleeping engines and the trainer waiting in host memory) from the models'
  shapes, the config's batch sizes and the longest prompt of the committed prefix build, against the GPU
  (a torchrun rank's own, its free memory); a phase that does not fit fails every door, a stage's job
  included (exit 2, before a model loads), with one line naming what to change. On a CPU, an estimate per
  stage against the machine's memory;
- **ranks**: the training ranks (``WORLD_SIZE``, or ``SAPD_TRAIN_PROCESSES`` that the chart sets) divide
  each minibatch's micro-batches evenly, so none runs weightless passes;
- **precision**: ``train.lr`` against the weights' floating-point spacing (:func:`check_precision`): a
  warning when even the fp32 weights the optimizer keeps would round most updates away; ``model.dtype:
  float16`` fails (training refuses it);
- **webshop** (benchmark webshop only): the WebShop server the evaluation talks to (``SAPD_WEBSHOP_URL``,
  else sapd's default ``http://127.0.0.1:3000``; the chart sets it from ``evaluate.webshop.url``) answers
  with WebShop's instruction page, within seconds: unreachable is exit 75, anything else that answers
  (an HTTP error, another server) or a malformed URL exit 2;
- **pushgateway**: answers, when ``SAPD_PUSHGATEWAY_URL`` is set.

A failure is one line naming what to fix. Exit codes (:mod:`sapd.entry`): 0 every check passed, 2 a
user error (fix the config, the input, the credentials), 75 a service was unreachable (retry later).
``sapd check`` (and ``helm test``) diagnose rather than wait: storage that stays unreachable is reported
after 10 s of retries, not after ``storage.retry_deadline_s``; a stage's own share of the checks
(:func:`preflight`) waits as the stage would.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import urllib.error
import urllib.request
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from sapd import layout, storage
from sapd.config import (
    FLOAT16_NOT_TRAINED,
    PLACEHOLDER,
    ConfigError,
    RunConfig,
    committed_config,
    committed_config_problem,
    locate,
    micro_batch_problem,
    resolved_for,
)
from sapd.data.loaders import LoadOptions, load_trajectories
from sapd.data.prefix_table import longest_prompt
from sapd.entry import EXIT_FAILED, EXIT_OK, EXIT_UNAVAILABLE, EXIT_USER_ERROR, exit_code
from sapd.method.objective import objective_of
from sapd.models.devices import rank_device
from sapd.models.loading import check_same_tokenizer, load_tokenizer, read_model_config
from sapd.models.memory import GIB, HEADROOM, Shape, StageEstimate, estimate, gpu_plan, shape_from_config
from sapd.platform import planned

# the checks each stage's job runs at its start (``None``: all of them — ``sapd check``, ``sapd run``, the driver)
STAGE_CHECKS: dict[str, tuple[str, ...]] = {
    "build-prefixes": ("storage", "run root", "data", "student", "teacher", "tokenizers"),
    "teacher-scores": ("storage", "run root", "student", "teacher", "tokenizers", "memory"),
    "teacher-scores-commit": ("storage", "run root"),  # it joins the workers' parts, no model
    "train": ("storage", "run root", "ranks", "student", "memory", "precision"),
    "evaluate": ("storage",),  # it loads the run's checkpoints, not model.student
    # the cluster's pipeline driver, before it creates any stage Job: everything but memory, which each
    # stage pod checks against its own device (the driver's pod has none of theirs)
    "driver": ("storage", "run root", "ranks", "data", "student", "teacher", "tokenizers", "precision"),
}
SAMPLE_RECORDS = 20


class CheckFailed(ValueError):
    """A check failed before a stage started; ``exit_code`` is the first failure's (2 or 75)."""

    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.exit_code = code


class Skipped(Exception):
    """A check that cannot run because one it depends on failed (not a failure of its own)."""


class Warned(Exception):
    """A check that passes with a warning: the run can go on, but probably not as the user meant."""


@dataclass
class Outcome:
    name: str
    ok: bool
    detail: str
    code: int = EXIT_OK
    skipped: bool = False
    warned: bool = False

    def line(self) -> str:
        if self.skipped:
            return f"check {self.name}: skipped ({self.detail})"
        if self.warned:
            return f"check {self.name}: WARNING: {self.detail}"
        return f"check {self.name}: ok ({self.detail})" if self.ok else f"check {self.name}: FAILED: {self.detail}"


def _one_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def _code(e: BaseException) -> int:
    code = exit_code(e)
    if code is not None:
        return code
    if isinstance(e, (urllib.error.URLError, ConnectionError, TimeoutError)):
        return EXIT_UNAVAILABLE
    return EXIT_FAILED


# ---------------------------------------------------------------------------------------------------
# the checks


def check_storage(cfg: RunConfig) -> str:
    probe = storage.join(cfg.run_root, f".sapd-check-{uuid.uuid4().hex}")
    created: list[Path] = []
    if not storage.is_s3(cfg.run_root):  # folders the probe creates are removed with it
        p = Path(cfg.run_root.removeprefix("file://")).absolute()
        while not p.exists():
            created.append(p)
            p = p.parent
    storage.write_text(probe, "sapd check: this object is written and deleted at once\n")
    storage.delete(probe)
    for d in created:
        try:
            d.rmdir()
        except OSError:
            break
    where = f"S3 endpoint {storage.s3_endpoint()}" if storage.is_s3(cfg.run_root) else "local folder"
    return f"{cfg.run_root} is writable ({where})"


def check_run_root(cfg: RunConfig) -> str:
    problem = committed_config_problem(cfg)
    if problem:
        raise ConfigError(problem)
    stored = committed_config(cfg)
    if stored is None:
        return "a new run"
    done = layout.committed_checkpoints(cfg.run_root)
    rounds = (f"; train.rounds {stored.train.rounds} there, {cfg.train.rounds} here: the run now has "
              f"{cfg.train.rounds} rounds" if stored.train.rounds != cfg.train.rounds else "")
    return (f"the committed config is this one{rounds}; checkpoints {done[0]}..{done[-1]} committed, resuming"
            if done else f"the committed config is this one{rounds}")


def check_data(cfg: RunConfig, sample: int = SAMPLE_RECORDS) -> str:
    d = cfg.data
    if not d.input or d.input.startswith(PLACEHOLDER):
        raise ConfigError(f"data.input: {'empty' if not d.input else 'still the starter placeholder ' + d.input}; "
                          "set it to your trajectories (a file or folder, local or s3://)", "data.input")
    try:
        res = load_trajectories(d.input, d.format, LoadOptions(d.benchmark, skip_invalid=d.skip_invalid,
                                                               action_wording=d.action_wording), limit=sample)
    except ConfigError as e:
        raise locate(cfg, e) from None  # data.format is checked against the registry here: name its file:line
    if not res.trajectories:
        raise ValueError(f"{d.input}: the first {res.records_read} records hold no valid trajectory"
                         + (f" ({res.report.total} invalid, skipped)" if res.report.total else ""))
    files = len(res.files)
    return (f"{files} file{'s' if files != 1 else ''}; the first {res.records_read} records parse as "
            f"{res.format_summary()} ({len(res.trajectories)} trajectories, {d.benchmark})"
            + (f"; {res.report.total} invalid, skipped" if res.report.total else ""))


def _model(uri: str, key: str) -> tuple[Shape, Any]:
    if not uri or uri.startswith(PLACEHOLDER):
        raise ConfigError(f"{key}: {'empty' if not uri else 'still the starter placeholder ' + uri}; set it to a "
                          "Hugging Face model folder or s3:// prefix", key)
    shape = shape_from_config(read_model_config(uri))
    return shape, load_tokenizer(uri, without_weights=True)


def _device_memory(device: str) -> tuple[float | None, str]:
    """(bytes, description) of this machine's memory, for a stage on the CPU; None when it is unknown."""
    total = available = None
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                key, value = line.split(":", 1)
                if key == "MemTotal":
                    total = float(value.split()[0]) * 1024
                elif key == "MemAvailable":
                    available = float(value.split()[0]) * 1024
    except OSError:
        return None, "cpu, memory size unknown"
    if not total:
        return None, "cpu, memory size unknown"
    return total, f"cpu RAM {total / GIB:.1f} GiB" + (f", {available / GIB:.1f} GiB available now" if available else "")


def train_processes() -> int:
    """The training processes ZeRO shards over: torchrun's WORLD_SIZE where set (inside the train job), else
    $SAPD_TRAIN_PROCESSES (the chart sets it from train.parallelism × train.procsPerPod), else 1."""
    for key in ("WORLD_SIZE", "SAPD_TRAIN_PROCESSES"):
        value = os.environ.get(key, "")
        if value.isdigit() and int(value) > 0:
            return int(value)
    return 1


class DoesNotFit(ConfigError):
    """A phase of the GPU plan exceeds the GPU it would run on: a failure in every door (a warning would let
    the stage load the model, run out of memory and be retried). ``lines``: the plan, to show."""

    def __init__(self, message: str, path: str | None = None, lines: list[str] | None = None) -> None:
        super().__init__(message, path)
        self.lines = lines or []


def _remedies(cfg: RunConfig, student: Shape, teacher: Shape | None, prompt: int | None, limit: float) -> str:
    """What to change so that the train stage fits ``limit`` bytes: the first of the usual knobs (one
    prefix per micro-batch, gradient checkpointing, both) whose estimate fits, else the general list."""
    tc = cfg.train
    tries: list[tuple[str, dict[str, Any]]] = []
    if tc.micro_batch_prefixes > 1:
        tries.append(("set train.micro_batch_prefixes: 1", {"micro_batch_prefixes": 1}))
    if not cfg.checkpointing_on():
        tries.append(("set train.gradient_checkpointing: true", {"gradient_checkpointing": True}))
        if tc.micro_batch_prefixes > 1:
            tries.append(("set train.micro_batch_prefixes: 1 and train.gradient_checkpointing: true",
                          {"micro_batch_prefixes": 1, "gradient_checkpointing": True}))
    for text, change in tries:
        alt = dataclasses.replace(cfg, train=dataclasses.replace(tc, **change))
        need = {e.stage: e for e in estimate(alt, student, teacher, train_processes(), prompt)}["train"].total
        if need * HEADROOM <= limit:
            return f"{text} (about {need / GIB:.1f} GiB)"
    steps = [f"lower train.micro_batch_prefixes (now {tc.micro_batch_prefixes})"] if tc.micro_batch_prefixes > 1 else []
    steps += [] if cfg.checkpointing_on() else ["set train.gradient_checkpointing: true"]
    return ", ".join(steps + [f"lower sampling.max_new_tokens (now {cfg.sampling.max_new_tokens}) or "
                              "data.max_prompt_tokens, shard over more training ranks (train.engine: deepspeed, a "
                              "higher train.zero_stage), or use a larger device"])


# the phases of the GPU plan a stage's own check covers (a stage pod on its own GPU)
STAGE_PHASES = {"teacher-scores": ("sample + score",), "train": ("train",)}


def _gpu_capacity(device: str) -> tuple[float | None, str]:
    """(bytes, description) of the GPU a stage on ``device`` gets, seen from here (this rank's own GPU): its
    free memory now; None where no GPU is visible."""
    device = rank_device(device)
    try:
        import torch
        if torch.cuda.is_available():
            index = int(device.split(":")[1]) if ":" in device else torch.cuda.current_device()
            props = torch.cuda.get_device_properties(index)
            free, total = torch.cuda.mem_get_info(index)
            return float(free), f"cuda:{index} ({props.name}) {free / GIB:.1f} GiB free of {total / GIB:.1f} GiB"
    except (ImportError, RuntimeError, AssertionError):
        pass
    return None, f"{device}, not visible from here"


def check_memory(cfg: RunConfig, student: Shape, teacher: Shape | None, stages: tuple[str, ...] | None,
                 device_memory_gib: float | None = None, prompt_tokens: int | None = None, *,
                 gpus: int | None = None) -> tuple[str, list[str]]:
    """(summary, the lines to show); raises when the run does not fit its device. ``prompt_tokens``: the longest
    prompt of the committed prefix build (default: read from the run root; none yet: ``data.max_prompt_tokens``).

    A GPU (``model.device`` cuda, visible here or of ``device_memory_gib``): the GPU plan
    (:func:`sapd.models.memory.gpu_plan`), phase by phase, for ``gpus`` GPUs (default: the training processes,
    :func:`train_processes`; 1 is ``sapd run`` on one GPU); a stage's own check covers its phase. A phase that
    does not fit raises :class:`DoesNotFit`, one line naming what to change. A CPU: each stage's estimate
    against the machine's memory (:class:`~sapd.config.ConfigError` when one does not fit)."""
    if prompt_tokens is None:
        prompt_tokens = longest_prompt(layout.prefixes_dir(cfg.run_root))
    if cfg.model.device.startswith("cuda"):
        if device_memory_gib:
            capacity: float | None = device_memory_gib * GIB
            where = f"GPUs of {device_memory_gib:g} GiB (as given)"
        else:
            capacity, where = _gpu_capacity(cfg.model.device)
        if capacity is None:
            return f"device {where}: not compared (give --gpu-memory GiB)", []
        phases = None if stages is None else tuple(p for st in stages for p in STAGE_PHASES.get(st, ()))
        plan = gpu_plan(cfg, student, teacher, capacity, gpus=gpus or train_processes(), prompt_tokens=prompt_tokens,
                        phases=phases)
        if plan.problems:
            raise DoesNotFit(f"{plan.problems[0]} ({where})", "memory", plan.lines())
        return f"every phase fits {where}: {plan.layout}", plan.lines()
    estimates = [e for e in estimate(cfg, student, teacher, train_processes(), prompt_tokens)
                 if stages is None or e.stage in stages]
    if device_memory_gib:
        total: float | None = device_memory_gib * GIB
        where = f"{cfg.model.device} {device_memory_gib:g} GiB (as given)"
    else:
        total, where = _device_memory(cfg.model.device)
    lines = [e.line() for e in estimates]
    if total is None:
        return f"device {where}: not compared (give --device-memory-gib)", lines
    # the train stage first: its remedies are the ones a user can act on most precisely
    too_big: list[StageEstimate] = sorted((e for e in estimates if e.total * HEADROOM > total),
                                          key=lambda e: e.stage != "train")
    if too_big:
        e = too_big[0]
        if e.stage == "train":
            raise ConfigError(f"train needs about {e.total / GIB:.1f} GiB (+{HEADROOM - 1:.0%} headroom) at "
                              f"{e.note.split(',')[0]} but the device has {total / GIB:.1f} GiB ({where}): "
                              f"{_remedies(cfg, student, teacher, prompt_tokens, total)}", "memory")
        raise ConfigError(f"{e.stage} needs about {e.total / GIB:.1f} GiB (+{HEADROOM - 1:.0%} headroom) but the "
                          f"device has {total / GIB:.1f} GiB ({where}): lower sampling.prompts_per_batch, "
                          "sampling.max_new_tokens or data.max_prompt_tokens, or use a larger device", "memory")
    return f"every stage fits {where}", lines


def check_ranks(cfg: RunConfig, ranks: int | None = None) -> str:
    """The training ranks (``ranks``, default :func:`train_processes`) share each minibatch's micro-batches
    evenly (:func:`sapd.config.micro_batch_problem`)."""
    W = ranks or train_processes()
    problem = micro_batch_problem(cfg, W)
    if problem:
        raise ConfigError(problem, "train.micro_batch_prefixes")
    per_rank = cfg.train.minibatch_prefixes // cfg.train.micro_batch_prefixes // W
    return (f"{W} training rank{'s' if W != 1 else ''}, {per_rank} micro-batch{'es' if per_rank != 1 else ''} of "
            f"{cfg.train.micro_batch_prefixes} prefix{'es' if cfg.train.micro_batch_prefixes != 1 else ''} each "
            "per full minibatch")


SIGNIFICAND_BITS = {"float32": 24, "bfloat16": 8, "float16": 11}
NORM_SCALE = 4.0
"""Size up to which the weights the optimizer keeps should take an lr-sized update: RMSNorm / LayerNorm
scales sit around 1–3 in trained models (Qwen2.5-0.5B's median is 2.2), the largest weights most models
have that training must still move."""


def movable_below(lr: float, dtype: str) -> float:
    """The size below which an update of ``lr`` moves a weight stored in ``dtype``: a weight w changes only
    if the update exceeds half its spacing, 2^(⌊log₂|w|⌋ − p) for p significand bits (round to nearest)."""
    return 2.0 ** math.ceil(math.log2(lr) + SIGNIFICAND_BITS[dtype])


def check_precision(cfg: RunConfig) -> str:
    """``train.lr`` against the spacing of the weights the optimizer keeps. One AdamW step moves a weight by
    about lr. Kept in float32 (a float32 model's weights, or the fp32 master sapd keeps for a bfloat16
    one) it lands on every weight below :func:`movable_below`; a warning (:class:`Warned`) when that
    leaves out weights of :data:`NORM_SCALE`. bfloat16 itself keeps 8 significant bits: at lr 1e-6 only
    weights below 4.9e-4 would move, which is why the master exists; the line says what the served copy
    does. float16 fails: the engines refuse to train it (no loss scaling)."""
    lr, dtype = cfg.train.lr, cfg.model.dtype
    if dtype == "float16":
        raise ConfigError(FLOAT16_NOT_TRAINED, "model.dtype")
    if lr <= 0:
        return f"train.lr {lr:g}: the weights never move"
    kept = movable_below(lr, "float32")
    where = "the fp32 master sapd keeps of the bfloat16 weights" if dtype == "bfloat16" else "float32 weights"
    if kept < NORM_SCALE:
        raise Warned(f"train.lr {lr:g} moves {where} only below {kept:g} in size: updates to larger weights, such "
                     f"as norm scales (~1-3), are lost to rounding even in float32; raise train.lr")
    line = f"train.lr {lr:g} moves {where} below {kept:g} in size"
    if dtype == "bfloat16":
        line += (f"; bfloat16 weights alone would take it only below {movable_below(lr, 'bfloat16'):.2g}, so the "
                 "bfloat16 copy that samples and is evaluated changes where the master has crossed half a "
                 "bfloat16 step")
    return line


def check_pushgateway() -> str:
    url = os.environ.get("SAPD_PUSHGATEWAY_URL")
    if not url:
        return "not configured (nothing is pushed)"
    with urllib.request.urlopen(url.rstrip("/") + "/-/ready", timeout=10) as r:
        return f"{url} answers {r.status}"


WEBSHOP_PROBE_SECONDS = 5.0
WEBSHOP_DEFAULT_URL = "http://127.0.0.1:3000"
"""The WebShop adapter's default server (``sapd.envs.webshop_env.DEFAULT_URL``; a test keeps them equal). Not
imported from the adapter: the checks run in every stage pod, and no stage but evaluation loads an environment."""
_TAG = re.compile(r"<[^>]*>")


def check_webshop(url: str | None = None, timeout: float = WEBSHOP_PROBE_SECONDS) -> str:
    """WebShop is "bring your own server": its instruction page for goal 0 (``/fixed_0``, a session URL the
    evaluation plays) must answer. Unreachable → ConnectionError (exit 75); a malformed URL, an HTTP error or
    a page that is not WebShop's → ConfigError (exit 2)."""
    url = (url or os.environ.get("SAPD_WEBSHOP_URL") or WEBSHOP_DEFAULT_URL).rstrip("/")
    where = "SAPD_WEBSHOP_URL (the chart's evaluate.webshop.url)"
    if not url.startswith(("http://", "https://")) or not url.split("://", 1)[1]:
        raise ConfigError(f"{where}: {url!r} is not an http(s) URL", "evaluate.webshop.url")
    probe = f"{url}/fixed_0"
    try:
        with urllib.request.urlopen(probe, timeout=timeout) as r:  # noqa: S310 - the user's own server
            html = r.read(1_000_000).decode("utf-8", errors="replace")
    except urllib.error.HTTPError as e:
        raise ConfigError(f"{probe} answered HTTP {e.code}: not a WebShop server (run WebShop's own web_agent_site "
                          f"server there: docs/kubernetes/operate.md 'Evaluation'), or fix {where}",
                          "evaluate.webshop.url") from None
    except (urllib.error.URLError, OSError) as e:
        reason = getattr(e, "reason", None) or e
        raise ConnectionError(f"{url} is unreachable ({reason}) within {timeout:g}s: start your WebShop server "
                              f"(docs/kubernetes/operate.md 'Evaluation') or fix {where}") from None
    if "Instruction:" not in _TAG.sub(" ", html):
        raise ConfigError(f"{probe} answers, but not with WebShop's instruction page: is {where} another server's?",
                          "evaluate.webshop.url")
    return f"{url} answers with WebShop's instruction page"


# ---------------------------------------------------------------------------------------------------
# running them


def run_checks(cfg: RunConfig, *, stage: str | None = None, sample_records: int = SAMPLE_RECORDS,
               device_memory_gib: float | None = None, log: Callable[[str], None] = print,
               verbose: bool = True, memory_fails: bool = True, pushgateway: bool = True,
               gpus: int | None = None) -> list[Outcome]:
    """Every check of ``stage`` (all for None), each reported as it finishes (``verbose``: the ok lines
    and the memory table too; otherwise only failures). ``memory_fails`` False: a stage that may not
    fit is a warning line, not a failure (the estimate errs high; a running stage should not be stopped by
    it), except the GPU plan's refusal (:class:`DoesNotFit`). ``gpus``: the GPUs planned for (the training
    ranks; default :func:`train_processes`). Returns the outcomes."""
    wanted = STAGE_CHECKS.get(stage or "", None) if stage else None
    outcomes: list[Outcome] = []
    models: dict[str, tuple[Shape, Any] | None] = {}
    sft = objective_of(cfg.loss_cfg).data == "recorded"  # trains on the recorded responses: no teacher

    def run(name: str, fn: Callable[[], str]) -> None:
        if wanted is not None and name not in wanted:
            return
        try:
            o = Outcome(name, True, fn())
        except Skipped as e:
            o = Outcome(name, True, str(e), skipped=True)
        except Warned as e:
            o = Outcome(name, True, str(e), warned=True)
        except Exception as e:  # noqa: BLE001 - every check reports; none stops the others
            code = _code(e)
            if code == EXIT_FAILED and not isinstance(e, (OSError, ValueError, RuntimeError)):
                raise  # a bug in sapd, not a finding about the run
            o = Outcome(name, False, _one_line(e), code)
            if name == "memory" and not memory_fails and isinstance(e, ConfigError) and not isinstance(e, DoesNotFit):
                log(f"check memory: WARNING: {o.detail}")
                o = Outcome(name, True, "may not fit (warned)")
        outcomes.append(o)
        if verbose or not o.ok or o.warned:
            log(o.line())

    def model(who: str) -> str:
        uri = getattr(cfg.model, who)
        models[who] = None
        shape, tok = _model(uri, f"model.{who}")
        models[who] = (shape, tok)
        return f"{uri}: {shape.describe()}; tokenizer of {len(tok)} tokens with a chat template"

    def tokenizers() -> str:
        s, t = models.get("student"), models.get("teacher")
        if s is None or t is None:
            raise Skipped("a model above failed")
        check_same_tokenizer(s[1], t[1])
        return f"the student's and the teacher's are identical ({len(s[1])} tokens)"

    memory_lines: list[str] = []

    def memory() -> str:
        s, t = models.get("student"), models.get("teacher")
        if s is None:
            raise Skipped("the student model above failed")
        try:
            summary, lines = check_memory(cfg, s[0], t[0] if t else None,
                                          None if stage is None else (stage,), device_memory_gib, gpus=gpus)
        except DoesNotFit as e:
            memory_lines.extend(e.lines)  # the plan, shown under its FAILED line
            raise
        memory_lines.extend(lines)
        return summary

    run("storage", lambda: check_storage(cfg))
    run("run root", lambda: check_run_root(cfg))
    run("ranks", lambda: check_ranks(cfg, gpus))
    run("data", lambda: check_data(cfg, sample_records))
    run("student", lambda: model("student"))
    if sft:
        if wanted is None or "teacher" in wanted:
            outcomes.append(Outcome("teacher", True, "not used (variant sft)"))
            if verbose:
                log(outcomes[-1].line())
    else:
        run("teacher", lambda: model("teacher"))
        run("tokenizers", tokenizers)
    run("memory", memory)
    if verbose:
        for line in memory_lines:
            log(f"  {line}")
    run("precision", lambda: check_precision(cfg))
    if wanted is None and cfg.data.benchmark == "webshop":
        run("webshop", check_webshop)
    if wanted is None and pushgateway:
        run("pushgateway", check_pushgateway)
    return outcomes


def summary_code(outcomes: list[Outcome]) -> int:
    """2 if any user error, else 75 if a service was unreachable, else 1 for any other failure, else 0."""
    codes = {o.code for o in outcomes if not o.ok}
    for code in (EXIT_USER_ERROR, EXIT_UNAVAILABLE, EXIT_FAILED):
        if code in codes:
            return code
    return EXIT_OK


CHECK_RETRY_S = 10.0  # how long `sapd check` (and `helm test`) lets a storage operation retry


def check_command(cfg: RunConfig, *, sample_records: int = SAMPLE_RECORDS, device_memory_gib: float | None = None,
                  gpu_memory_gib: float | None = None, gpus: int | None = None,
                  log: Callable[[str], None] = print) -> int:
    """``sapd check``: every check, every line; the exit code of :func:`summary_code`. ``gpu_memory_gib``:
    plan for GPUs of that size that are not here (the "auto" values resolved as on such a machine, with
    vLLM installed), ``gpus`` of them (1: ``sapd run``; more: the cluster's training ranks)."""
    log(f"check config: ok (run root {cfg.run_root}, variant {cfg.variant}, benchmark {cfg.data.benchmark})")
    if gpu_memory_gib is not None:
        if not gpu_memory_gib > 0:
            raise ConfigError(f"--gpu-memory: {gpu_memory_gib:g} is not a positive number of GiB")
        cfg = resolved_for(cfg, planned(gpus or 1))
        if not cfg.model.device.startswith("cuda"):
            raise ConfigError(f"model.device: {cfg.model.device} runs nothing on a GPU; --gpu-memory plans a GPU run "
                              "(set model.device: auto or cuda)", "model.device")
        device_memory_gib = gpu_memory_gib
    for line in cfg.auto_lines():
        log(f"check config: {line}")
    # a diagnosis, not a run: storage that stays unreachable is reported within seconds, not after the
    # minutes a stage waits for it (storage.retry_deadline_s)
    with storage.retry_deadline(min(cfg.storage.retry_deadline_s, CHECK_RETRY_S)):
        outcomes = run_checks(cfg, sample_records=sample_records, device_memory_gib=device_memory_gib, log=log,
                              gpus=gpus)
    failed = [o for o in outcomes if not o.ok]
    skipped = sum(o.skipped for o in outcomes)
    log(f"check: {len(outcomes) - len(failed) - skipped}/{len(outcomes)} passed"
        + (f", {skipped} skipped" if skipped else "")
        + ("" if not failed else f"; fix the {len(failed)} FAILED line{'s' if len(failed) > 1 else ''} above"))
    return summary_code(outcomes)


def preflight(cfg: RunConfig, stage: str | None = None, *, log: Callable[[str], None] = print,
              verbose: bool = False) -> None:
    """The checks at the start of ``sapd run`` and the pipeline driver (``stage`` None) or of a stage's job:
    one line when they pass (``verbose``: every line), every failure a line, then :class:`CheckFailed` with
    the exit code. A memory estimate above the device is a warning here (``sapd check`` fails on it), except
    the train stage's above a visible GPU: that one stops the door, before any model is loaded."""
    outcomes = run_checks(cfg, stage=stage, log=log, verbose=verbose, memory_fails=False, pushgateway=False)
    failed = [o for o in outcomes if not o.ok]
    if failed:
        more = f" (and {len(failed) - 1} more above)" if len(failed) > 1 else ""
        raise CheckFailed(f"{failed[0].line()}{more} — nothing of {stage or 'the run'} was started; fix it and "
                          "run again (`sapd check CONFIG` shows every check; --no-check skips them)",
                          summary_code(outcomes))
    plural = "s" if len(outcomes) != 1 else ""
    log(f"preflight: {len(outcomes)} check{plural} passed ({', '.join(o.name for o in outcomes)})")
