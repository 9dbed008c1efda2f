"""vLLM backends: student generation (:class:`~sapd.models.vllm_backend.VLLMGenerator`) and teacher scoring
(:class:`~sapd.models.vllm_backend.VLLMScorer`) behind the same interfaces as the HF ones, for GPU pools (and,
slowly, vLLM's CPU build).

vLLM features used, and why:

* ``LLM.generate`` with :class:`vllm.inputs.TokensPrompt` — prompts go in as **token ids** made by the
  same HF tokenizer the HF path uses (``add_special_tokens=False``), so both backends see exactly the
  same ids; nothing depends on vLLM's own prompt tokenisation or chat rendering.
* ``SamplingParams(n=G, seed=…)`` — one request per prompt fans out into G samples that share the
  prompt's prefill (vLLM's parallel sampling), the analogue of the HF backend's repeated KV cache.
  vLLM seeds the k-th child with ``seed + k``, so every prompt gets its own seed derived from
  ``(params.seed, prompt index)``: otherwise all prompts of a call would draw the same random numbers.
* ``logprobs=0`` — the log-prob of each sampled token only (no top-k list). vLLM's default
  ``logprobs_mode="raw_logprobs"`` gives them from the model's distribution **before** temperature /
  top-p, i.e. log π(y_k | context) at temperature 1, the same quantity ``HFGenerator`` returns.
* ``stop=…, include_stop_str_in_output=True`` — decision blocks end at their closing tag, which is kept,
  as in the HF path. The returned ``text`` is re-decoded from the token ids with the HF tokenizer:
  vLLM cuts its text right after the stop string, which can drop the tail of the token that completed
  it, and a ``Sample``'s text must be what its token ids decode to.
* ``prompt_logprobs=0`` with ``max_tokens=1`` — teacher scoring is a prefill: prompt + response go in
  as one prompt and vLLM returns, at each position, the log-prob of the token actually there (the
  raw model distribution, in fp32), chunk by chunk along with chunked prefill. vLLM skips reading its
  prefix cache for such requests unless told (``skip_reading_prefix_cache=False``): sapd prefills each
  group's prompt once and lets its G requests read it, checking each request's reported cache hit
  (:class:`VLLMScorer`).
* ``kv_cache_memory_bytes`` — an explicit KV-cache size that both the GPU and the CPU workers honour
  (on CPU it replaces the integer-GiB ``VLLM_CPU_KVCACHE_SPACE`` variable).
* **Weight sync in place, with a deadline** (:meth:`VLLMGenerator.load_weights`) — the student engine
  stays up across rounds and takes each round's checkpoint through vLLM's native weight-update session
  where the installed vLLM has one (``vllm.distributed.weight_transfer``: the worker methods
  ``start_weight_update`` / ``update_weights`` / ``finish_weight_update`` that its NCCL and IPC
  backends and its RLHF routes drive), with a sapd transfer engine installed on each worker whose
  data plane is the checkpoint folder itself: one ``update_weights`` call per safetensors shard of
  the pod's local copy (:func:`sapd.models.loading.resolve_model_dir`, fetched once per pod), loaded
  layer by layer through vLLM's layerwise reload (weights processed per layer as its last tensor
  arrives). Training and sampling are separate stages that meet through checkpoints, so a trainer →
  engine NCCL transfer has nothing to connect to; the session is what the checkpoint path gains from
  the native API: chunked updates and the worker-side bookkeeping (LoRA, caches) vLLM does itself.
  Where it is missing (an older vLLM, or a worker already configured with another transfer engine)
  the fallback is the previous path, one ``reload_weights`` call. **Every call reaches the workers by
  name** (vLLM's methods, and sapd's :class:`~sapd.models.vllm_worker.SapdWorkerExtension` that every
  engine sapd starts carries as its ``worker_extension_cls``): the engine runs in its own process, as
  vLLM runs it by default and as the pods run it, and that process accepts no pickled code. **Every RPC
  of either path** (and the wake-up, the CPU re-pack, the prefix-cache reset) runs under ``sync_timeout_s``
  (``sampling.weight_sync_timeout_s``): passed to ``collective_rpc`` (the multi-process executors
  honour it) and enforced by sapd around the call as well (the in-process executor does not); past
  it :class:`WeightSyncTimeout` ends the stage with one line naming the call, and the engine refuses
  further use (its weights are in an unknown state). Two things derived from the old weights are
  redone by hand: the prefix cache is reset (its blocks hold the old keys/values), and on the CPU
  backend every linear layer whose weight stays materialised is re-packed — vLLM re-packs the layers
  it reloads, but a LM head **tied** to the embeddings is not reloaded itself and kept the oneDNN
  handle packed from the old embedding matrix (samples then differed from a fresh engine's). Where
  the platform has it (CUDA/ROCm), the engine sleeps during training (``sleep(level=2)``: weights and
  KV cache freed; :meth:`VLLMGenerator.release`) and wakes for the next round's weights.

vLLM is imported lazily, inside the functions that need it, so this module imports (and its types
can be named) where vLLM is not installed, e.g. in the main environment.
"""

from __future__ import annotations

import atexit
import hashlib
import logging
import math
import threading
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sapd.models.generation import FinishReason, Sample, SamplingParams
from sapd.models.loading import DType, load_tokenizer, resolve_model_dir
from sapd.models.memory import SCORER_BATCHED_TOKENS, SCORER_MAX_SEQS
from sapd.models.scoring import ScoringStats, TeacherScoringError
from sapd.models.vllm_worker import EXTENSION

if TYPE_CHECKING:  # only for annotations; never imported at run time here
    from vllm import LLM

Group = tuple[str, Sequence[int], Sequence[Sequence[int]]]


def make_llm(model_dir: str | Path, *, dtype: DType = "float32", seed: int = 0,
             gpu_memory_utilization: float = 0.9, max_model_len: int | None = None,
             enforce_eager: bool | None = None, kv_cache_memory_bytes: int | None = None,
             cache_dir: str | Path | None = None, **llm_kwargs: Any) -> LLM:
    """A ``vllm.LLM`` over an HF model folder (or an ``s3://`` prefix synced into the cache first).

    ``enforce_eager=None`` means eager on CPU (no torch.compile / graph capture: on a small CPU machine
    compiling costs far more than it saves) and vLLM's default elsewhere. ``gpu_memory_utilization`` is
    ignored by the CPU backend; size its KV cache with ``kv_cache_memory_bytes``.
    """
    from vllm import LLM
    from vllm.platforms import current_platform

    if enforce_eager is None:
        enforce_eager = bool(current_platform.is_cpu())
    path = resolve_model_dir(str(model_dir), cache_dir)
    kwargs: dict[str, Any] = {"model": str(path), "tokenizer": str(path), "dtype": dtype, "seed": seed,
                              "gpu_memory_utilization": gpu_memory_utilization, "enforce_eager": enforce_eager,
                              # sapd's worker methods, called by name (sapd.models.vllm_worker)
                              "worker_extension_cls": EXTENSION}
    if max_model_len is not None:
        kwargs["max_model_len"] = max_model_len
    if kv_cache_memory_bytes is not None:
        kwargs["kv_cache_memory_bytes"] = kv_cache_memory_bytes
    kwargs.update(llm_kwargs)
    llm = LLM(**kwargs)
    # Registered after multiprocessing's own exit hook, so it runs before it (atexit is last in, first out):
    # that hook joins the engine's process, which only ends once told to. An engine still referenced at exit
    # (a script's global, a cycle the collector has not reached) would otherwise hang the exit.
    atexit.register(_shut_down_at_exit, weakref.ref(llm))
    return llm


def shut_down(llm: LLM) -> None:
    """Stop ``llm``'s engine: its own process under vLLM's V1 multiprocessing (the default, as the pods run
    it), its background threads in-process. Idempotent; the engine is not usable afterwards."""
    core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
    if core is not None and hasattr(core, "shutdown"):
        core.shutdown()


def _shut_down_at_exit(ref: weakref.ref[LLM]) -> None:
    llm = ref()
    if llm is not None:
        # quietly: at exit the stream vLLM's log handler writes to may be closed already (pytest's capture)
        logging.getLogger("vllm").setLevel(logging.ERROR)
        shut_down(llm)


DEFAULT_SYNC_TIMEOUT_S = 600.0


class WeightSyncTimeout(RuntimeError):
    """A call of the engine's weight sync did not return within its deadline. The stage stops (its front
    door prints this one line and exits 75, a retried failure); the engine is not used again."""

    exit_code = 75


def _with_deadline(fn: Callable[[], Any], seconds: float, what: str) -> Any:
    """``fn()``, or :class:`WeightSyncTimeout` once ``seconds`` pass (the call is left running on a
    daemon thread: an in-process vLLM executor cannot be interrupted, and the stage ends anyway)."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
            box["error"] = e

    worker = threading.Thread(target=run, name=f"sapd-weight-sync: {what}", daemon=True)
    worker.start()
    worker.join(seconds)
    timed_out = worker.is_alive() or isinstance(box.get("error"), TimeoutError)  # sapd's deadline, or vLLM's own
    if timed_out:
        raise WeightSyncTimeout(f"vLLM weight sync: {what} did not finish within {seconds:g} s; the engine's weights "
                                "are in an unknown state, so this stage stops (sampling.weight_sync_timeout_s sets "
                                "the deadline)") from box.get("error")
    if "error" in box:
        raise box["error"]
    return box.get("value")


def native_weight_sync_available() -> bool:
    """Whether the installed vLLM has the native weight-transfer API this module drives."""
    import importlib.util
    try:
        return importlib.util.find_spec("vllm.distributed.weight_transfer.base") is not None
    except ModuleNotFoundError:
        return False


def _max_model_len(llm: LLM) -> int:
    return int(llm.llm_engine.model_config.max_model_len)


def _prompt_seed(seed: int, index: int) -> int:
    """A per-prompt seed, well spread so that ``seed' + k`` (vLLM's k-th child) ranges of different
    prompts and different base seeds practically never overlap."""
    digest = hashlib.blake2b(f"{seed}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % (2**31 - 2**16)


def _token_logprob(position: Any, token_id: int) -> float | None:
    """The log-prob of ``token_id`` in one position's ``{token_id: Logprob}`` entry (None if absent)."""
    if not position:
        return None
    entry = position.get(token_id)
    return None if entry is None else float(entry.logprob)


@dataclass
class VLLMGenerator:
    """The :class:`sapd.models.generation.Generator` protocol on ``vllm.LLM``.

    ``tokenizer`` is the HF tokenizer that makes the prompt ids and decodes the samples; by default the
    one vLLM loaded from the model folder. ``prompts_per_call`` bounds one ``LLM.generate`` call (vLLM
    schedules a call's requests together; ``progress`` is told after each call).
    """

    llm: LLM
    tokenizer: Any = None
    prompts_per_call: int = 256
    cache_dir: str | Path | None = None
    sync_timeout_s: float = DEFAULT_SYNC_TIMEOUT_S  # deadline of each call of the weight sync
    weight_sync: str = field(default="", init=False)  # how the last load_weights went: "native" / "reload_weights"
    _eos_ids: set[int] = field(default_factory=set, init=False, repr=False)
    _asleep: bool = field(default=False, init=False, repr=False)
    _native: bool | None = field(default=None, init=False, repr=False)
    _broken: str = field(default="", init=False, repr=False)

    def __post_init__(self) -> None:
        if self.tokenizer is None:
            self.tokenizer = self.llm.get_tokenizer()
        eos = getattr(self.tokenizer, "eos_token_id", None)
        self._eos_ids = {eos} if eos is not None else set()
        gen_eos = getattr(self.llm.llm_engine.model_config.hf_config, "eos_token_id", None)
        if isinstance(gen_eos, int):
            self._eos_ids.add(gen_eos)
        elif isinstance(gen_eos, list):
            self._eos_ids.update(gen_eos)

    @classmethod
    def from_path(cls, model_dir: str | Path, *, dtype: DType = "float32", seed: int = 0,
                  gpu_memory_utilization: float = 0.9, max_model_len: int | None = None,
                  enforce_eager: bool | None = None, kv_cache_memory_bytes: int | None = None,
                  cache_dir: str | Path | None = None, sync_timeout_s: float = DEFAULT_SYNC_TIMEOUT_S,
                  **llm_kwargs: Any) -> VLLMGenerator:
        """Load the model into vLLM and the tokenizer with :func:`sapd.models.loading.load_tokenizer`
        (the same tokenizer object type, and so the same ids, as the HF path)."""

        from vllm.platforms import current_platform

        if current_platform.is_sleep_mode_available():  # so that release() can free the GPU for training
            llm_kwargs.setdefault("enable_sleep_mode", True)
        llm = make_llm(model_dir, dtype=dtype, seed=seed, gpu_memory_utilization=gpu_memory_utilization,
                       max_model_len=max_model_len, enforce_eager=enforce_eager,
                       kv_cache_memory_bytes=kv_cache_memory_bytes, cache_dir=cache_dir, **llm_kwargs)
        return cls(llm, tokenizer=load_tokenizer(str(model_dir), cache_dir), cache_dir=cache_dir,
                   sync_timeout_s=sync_timeout_s)

    @property
    def sleeps(self) -> bool:
        """Whether :meth:`release` frees the engine's memory (sleep mode: CUDA/ROCm engines built by
        :meth:`from_path`)."""
        return bool(getattr(self.llm.llm_engine.vllm_config.model_config, "enable_sleep_mode", False))

    def release(self) -> bool:
        """Before training: free the engine's weights and KV cache where vLLM's sleep mode is on
        (level 2: the weights are reloaded from the next checkpoint anyway). Elsewhere (the CPU backend)
        the engine stays resident. :meth:`wake` (or :meth:`load_weights`) wakes it. → whether it slept."""
        if not self.sleeps or self._asleep:
            return False
        self.llm.sleep(level=2)
        self._asleep = True
        return True

    def wake(self) -> bool:
        """Awake after :meth:`release`, under ``sync_timeout_s`` (its weights are the freed ones' garbage until
        :meth:`load_weights` gives it the next checkpoint's). → whether it was asleep."""
        if not self._asleep:
            return False
        try:
            _with_deadline(self.llm.wake_up, self.sync_timeout_s, "wake_up (the engine slept through training)")
        except WeightSyncTimeout as e:
            self._broken = str(e)
            raise
        self._asleep = False
        return True

    def _rpc(self, what: str, method: str, *, args: tuple = (), kwargs: dict[str, Any] | None = None) -> list[Any]:
        """One ``collective_rpc`` of the weight sync under the deadline, calling a worker method by its name (vLLM's
        own, or :class:`sapd.models.vllm_worker.SapdWorkerExtension`'s); a timeout marks the engine broken."""
        seconds = self.sync_timeout_s
        try:
            return _with_deadline(lambda: self.llm.collective_rpc(method, timeout=seconds, args=args, kwargs=kwargs),
                                  seconds, what)
        except WeightSyncTimeout as e:
            self._broken = str(e)
            raise

    def _check_usable(self) -> None:
        if self._broken:
            raise RuntimeError(f"the vLLM student engine is unusable after a failed weight sync: {self._broken}")

    def load_weights(self, model_dir: str | Path) -> None:
        """Take new weights in place (the next round's checkpoint, same architecture): the engine, its KV
        cache and compiled graphs stay up. Through vLLM's native weight-update session where the
        installed vLLM has it (one ``update_weights`` per safetensors shard), else ``reload_weights``;
        every call under ``sync_timeout_s`` (:class:`WeightSyncTimeout` past it). Then what was derived
        from the old weights is redone: the CPU backend's packed GEMMs of layers the reload leaves alone
        (a tied LM head), and the prefix cache. Samples afterwards equal a fresh engine's on the same
        weights and seed (tests/vllm). :attr:`weight_sync` says which path ran."""
        from vllm.platforms import current_platform

        self._check_usable()
        path = resolve_model_dir(str(model_dir), self.cache_dir)
        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"{model_dir}: no *.safetensors files to load weights from")
        seconds = self.sync_timeout_s
        self.wake()
        if self._native is None:
            self._native = native_weight_sync_available() and all(
                self._rpc("installing sapd's weight-transfer engine", "sapd_install_checkpoint_engine"))
        if self._native:
            self._rpc("start_weight_update", "start_weight_update")
            try:
                for i, f in enumerate(files, start=1):
                    self._rpc(f"update_weights ({f.name}, {i} of {len(files)})", "update_weights",
                              args=({"files": [str(f)]},))
                self._rpc("finish_weight_update", "finish_weight_update")
            except Exception as e:  # half the weights updated: nothing this engine samples can be trusted
                self._broken = self._broken or f"the weight update from {path} failed: {e}"
                raise
            self.weight_sync = "native"
        else:
            self._rpc("reload_weights", "reload_weights", kwargs={"weights_path": str(path)})
            self.weight_sync = "reload_weights"
        if current_platform.is_cpu():
            self._rpc("re-packing the CPU GEMMs", "sapd_repack_cpu_gemms")
        try:
            _with_deadline(self.llm.reset_prefix_cache, seconds, "reset_prefix_cache")
        except WeightSyncTimeout as e:
            self._broken = str(e)
            raise

    def _sampling_params(self, params: SamplingParams, prompt_index: int):
        import vllm

        return vllm.SamplingParams(
            n=params.n, temperature=params.temperature, top_p=params.top_p,
            max_tokens=params.max_new_tokens, stop=list(params.stop), include_stop_str_in_output=True,
            logprobs=0, seed=_prompt_seed(params.seed, prompt_index))

    def generate(self, prompts: Sequence[str], params: SamplingParams,
                 progress: Callable[[int], None] | None = None) -> list[list[Sample]]:
        """For each prompt, ``params.n`` samples with their token ids and temperature-1 log-probs."""
        from vllm.inputs import TokensPrompt

        self._check_usable()
        if self._asleep:
            raise RuntimeError("the vLLM student engine was released for training: load_weights() wakes it")
        limit = _max_model_len(self.llm)
        out: list[list[Sample]] = []
        for start in range(0, len(prompts), self.prompts_per_call):
            chunk = list(prompts[start:start + self.prompts_per_call])
            requests, sampling = [], []
            for i, text in enumerate(chunk, start=start):
                ids = list(self.tokenizer(text, add_special_tokens=False)["input_ids"])
                if not ids:
                    raise ValueError(f"prompt {i} is empty after tokenisation")
                if len(ids) >= limit:  # vLLM would refuse the whole batch; say which prompt
                    raise ValueError(f"prompt {i} has {len(ids)} tokens, leaving no room to generate within "
                                     f"the model length of {limit}")
                requests.append(TokensPrompt(prompt_token_ids=ids))
                sampling.append(self._sampling_params(params, i))
            results = self.llm.generate(requests, sampling, use_tqdm=False)
            for i, res in enumerate(results, start=start):
                samples = [self._to_sample(i, c) for c in sorted(res.outputs, key=lambda c: c.index)]
                if len(samples) != params.n:
                    raise RuntimeError(f"prompt {i}: vLLM returned {len(samples)} samples, expected {params.n}")
                out.append(samples)
            if progress:
                progress(len(chunk))
        return out

    def _finish_reason(self, prompt_index: int, completion: Any) -> FinishReason:
        """vLLM says "stop" both for EOS and for a stop string; ``stop_reason`` (the string, or None
        for EOS) and the last token tell them apart."""
        reason = completion.finish_reason
        if reason == "length":
            return "length"
        if reason == "stop":
            ids = completion.token_ids
            if len(ids) and int(ids[-1]) in self._eos_ids:
                return "eos"
            if isinstance(completion.stop_reason, str):
                return "stop"
            if completion.stop_reason is None:  # EOS by an id only the generation config names
                return "eos"
        raise RuntimeError(f"prompt {prompt_index}: unexpected vLLM finish {reason!r} "
                           f"(stop_reason={completion.stop_reason!r})")

    def _to_sample(self, prompt_index: int, completion: Any) -> Sample:
        ids = [int(t) for t in completion.token_ids]
        lps = completion.logprobs
        if lps is None or len(lps) != len(ids):
            raise RuntimeError(f"prompt {prompt_index}: vLLM returned {0 if lps is None else len(lps)} "
                               f"log-probs for {len(ids)} tokens")
        logprobs = []
        for k, (tok, pos) in enumerate(zip(ids, lps)):
            lp = _token_logprob(pos, tok)
            if lp is None:
                raise RuntimeError(f"prompt {prompt_index}: no log-prob for sampled token {k} (id {tok})")
            logprobs.append(lp)
        return Sample(token_ids=ids, logprobs=logprobs,
                      text=self.tokenizer.decode(ids, skip_special_tokens=True),
                      finish_reason=self._finish_reason(prompt_index, completion))


@dataclass
class VLLMScorer:
    """Teacher scoring with vLLM's prompt log-probs, the counterpart of
    :func:`sapd.models.scoring.score_groups`: for each group, log π_T(y_{i,k} | h, y_{i,<k}) of every
    response token, **each group's prompt computed once**.

    vLLM returns log-probs of given tokens only for a prompt (``prompt_logprobs``), so each response is
    one request, prompt + response as its prompt (one dummy output token). Such requests skip vLLM's
    prefix cache by default (a cache hit leaves the rows before it uncomputed), which would prefill the
    shared prompt G times. Here, per call: (1) every group's prompt but its last token is prefilled once
    (one short request each), so its full KV blocks are in the prefix cache; (2) the G scoring requests
    read that cache (``skip_reading_prefix_cache=False``) and compute only the rest; vLLM reports each
    request's hit (``num_cached_tokens``), and every response row is computed as long as the hit stays
    within the prompt (at most P − 1 tokens); (3) a request whose hit reached into its response (two
    responses sharing their first tokens, scheduled in one step) is scored again without the cache.
    :attr:`stats` counts the tokens computed against G·(P + R) and P + G·R. Where the installed vLLM has no
    ``skip_reading_prefix_cache`` (older than 0.32), every request is scored whole, as before.

    vLLM needs room for the dummy output token, so prompt + response must fit in ``max_model_len − 1``;
    longer ones raise :class:`~sapd.models.scoring.TeacherScoringError` before anything is sent (vLLM would
    reject the whole batch, and a truncated sequence would be scored wrongly). ``groups_per_call`` bounds one
    ``LLM.generate``. :meth:`release` puts the engine to sleep before training where sleep mode is on
    (level 1: the frozen weights go to host memory, the KV cache is dropped); the next call wakes it.
    """

    llm: LLM
    groups_per_call: int = 16
    share_prompt: bool = True  # False: every response recomputes its prompt (vLLM's default; the benchmark's reference)
    stats: ScoringStats = field(default_factory=ScoringStats)
    _asleep: bool = field(default=False, init=False, repr=False)

    @classmethod
    def from_path(cls, model_dir: str | Path, *, dtype: DType = "float32", seed: int = 0,
                  gpu_memory_utilization: float = 0.9, max_model_len: int | None = None,
                  enforce_eager: bool | None = None, kv_cache_memory_bytes: int | None = None,
                  cache_dir: str | Path | None = None, **llm_kwargs: Any) -> VLLMScorer:
        from vllm.platforms import current_platform

        llm_kwargs.setdefault("enable_prefix_caching", True)  # each group's prompt is read from it G times
        if current_platform.is_sleep_mode_available():  # so that release() can free the GPU for training
            llm_kwargs.setdefault("enable_sleep_mode", True)
        if not current_platform.is_cpu():
            # the prompt log-probs of one step's chunk (tokens × vocabulary, in float32) come on top of the
            # engine's memory share, outside vLLM's profile: a bounded chunk keeps that peak where sapd's GPU
            # plan counts it (sapd.models.memory.SCORER_BATCHED_TOKENS)
            llm_kwargs.setdefault("max_num_batched_tokens", SCORER_BATCHED_TOKENS)
            llm_kwargs.setdefault("max_num_seqs", SCORER_MAX_SEQS)
        return cls(make_llm(model_dir, dtype=dtype, seed=seed, gpu_memory_utilization=gpu_memory_utilization,
                            max_model_len=max_model_len, enforce_eager=enforce_eager,
                            kv_cache_memory_bytes=kv_cache_memory_bytes, cache_dir=cache_dir, **llm_kwargs))

    @property
    def max_model_len(self) -> int:
        return _max_model_len(self.llm)

    @property
    def sleeps(self) -> bool:
        """Whether :meth:`release` frees the engine's GPU memory (sleep mode on: CUDA/ROCm)."""
        return bool(getattr(self.llm.llm_engine.vllm_config.model_config, "enable_sleep_mode", False))

    def release(self) -> bool:
        """Before training in the same process: sleep (level 1: the frozen weights offloaded to host memory,
        the KV cache freed) where sleep mode is on; elsewhere (the CPU backend) the engine stays resident.
        → whether it slept."""
        if not self.sleeps or self._asleep:
            return False
        self.llm.sleep(level=1)
        self._asleep = True
        return True

    def wake(self) -> bool:
        """The engine awake after :meth:`release` (each scoring call does it; the validation, which samples
        the teacher through ``llm``, calls it first). → whether it was asleep."""
        if not self._asleep:
            return False
        self.llm.wake_up()
        self.llm.reset_prefix_cache()  # its blocks were dropped with the KV cache
        self._asleep = False
        return True

    def _check(self, prefix_id: str, prompt_ids: Sequence[int], responses: Sequence[Sequence[int]]) -> None:
        if not prompt_ids:
            raise TeacherScoringError(f"prefix {prefix_id}: empty prompt; the first response token has no context")
        limit = self.max_model_len - 1  # one slot for the dummy output token vLLM insists on
        longest = max((len(r) for r in responses), default=0)
        if len(prompt_ids) + longest > limit:
            raise TeacherScoringError(f"prefix {prefix_id}: prompt ({len(prompt_ids)} tokens) + response "
                                      f"({longest} tokens) exceeds the teacher's vLLM context of {limit} tokens "
                                      f"(max_model_len {self.max_model_len} − 1); it would be truncated — filter "
                                      "prefixes with --max-prompt-tokens")

    def __call__(self, groups: Sequence[Group],
                 progress: Callable[[int], None] | None = None) -> list[list[list[float]]]:
        return self.score_groups(groups, progress)

    @staticmethod
    def _scoring_params(*, read_cache: bool) -> Any:
        """One dummy output token, the log-prob of every prompt token; ``read_cache``: reading the prefix
        cache allowed (None where the installed vLLM cannot be told)."""
        import vllm

        kwargs: dict[str, Any] = dict(max_tokens=1, temperature=0.0, prompt_logprobs=0, detokenize=False)
        if read_cache:
            try:
                return vllm.SamplingParams(**kwargs, skip_reading_prefix_cache=False)
            except TypeError:  # a vLLM without the flag: its prompt-logprob requests never read the cache
                return None
        return vllm.SamplingParams(**kwargs)

    def score_groups(self, groups: Sequence[Group],
                     progress: Callable[[int], None] | None = None) -> list[list[list[float]]]:
        """``groups`` = [(prefix_id, prompt_ids, [response_ids × G])] → teacher log-probs per response."""
        import vllm
        from vllm.inputs import TokensPrompt

        self.wake()
        shared = self._scoring_params(read_cache=True) if self.share_prompt else None
        whole = self._scoring_params(read_cache=False)
        warm_params = vllm.SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)
        out: list[list[list[float]]] = []
        for start in range(0, len(groups), self.groups_per_call):
            chunk = list(groups[start:start + self.groups_per_call])
            for prefix_id, prompt_ids, responses in chunk:  # every check before any work
                self._check(prefix_id, prompt_ids, responses)
            if shared is not None:
                # (1) each prompt but its last token, once: its full KV blocks enter the prefix cache
                warm = [[int(t) for t in p[:-1]] for _, p, rs in chunk if len(p) > 1 and any(rs)]
                if warm:
                    for ids, res in zip(warm, self.llm.generate([TokensPrompt(prompt_token_ids=w) for w in warm],
                                                                warm_params, use_tqdm=False)):
                        self.stats.computed_tokens += len(ids) - int(res.num_cached_tokens or 0)
            requests, where = [], []
            for g, (_, prompt_ids, responses) in enumerate(chunk):
                self.stats.add_group(len(prompt_ids), [len(r) for r in responses])
                for i, r in enumerate(responses):
                    if r:
                        ids = [int(t) for t in prompt_ids] + [int(t) for t in r]
                        requests.append(TokensPrompt(prompt_token_ids=ids))
                        where.append((g, i))
            # (2) the responses, each prompt read from the cache
            results = self.llm.generate(requests, shared or whole, use_tqdm=False) if requests else []
            scored: list[list[list[float]]] = [[[] for _ in responses] for _, _, responses in chunk]
            again = []
            for n, ((g, i), res) in enumerate(zip(where, results)):
                prefix_id, prompt_ids, responses = chunk[g]
                cached = res.num_cached_tokens
                total = len(prompt_ids) + len(responses[i])
                if cached is None or cached > len(prompt_ids) - 1:  # a response row was never computed
                    self.stats.computed_tokens += total - int(cached or 0)
                    again.append(n)
                    continue
                self.stats.computed_tokens += total - cached
                scored[g][i] = self._read(prefix_id, i, len(prompt_ids), responses[i], res.prompt_logprobs)
            # (3) those whose cache hit reached into the response, scored whole
            if again:
                self.stats.rescored += len(again)
                redo = self.llm.generate([requests[n] for n in again], whole, use_tqdm=False)
                for n, res in zip(again, redo):
                    g, i = where[n]
                    prefix_id, prompt_ids, responses = chunk[g]
                    self.stats.computed_tokens += len(prompt_ids) + len(responses[i])
                    scored[g][i] = self._read(prefix_id, i, len(prompt_ids), responses[i], res.prompt_logprobs)
            out.extend(scored)
            if progress:
                progress(len(chunk))
        return out

    @staticmethod
    def _read(prefix_id: str, i: int, prompt_len: int, response: Sequence[int], prompt_logprobs: Any) -> list[float]:
        """Entry k of ``prompt_logprobs`` is log π(token k | tokens < k); response token j sits at
        position ``prompt_len + j``. A list shorter than the sequence by h (vLLM's V2 model runner after a
        prefix-cache hit of h tokens: it returns the computed rows only) starts at token h; the hit must
        leave the response's rows computed (h ≤ prompt_len − 1)."""
        total = prompt_len + len(response)
        offset = total - len(prompt_logprobs) if prompt_logprobs is not None else -1
        if prompt_logprobs is None or not 0 <= offset <= prompt_len - 1:
            raise TeacherScoringError(f"prefix {prefix_id}: vLLM returned "
                                      f"{None if prompt_logprobs is None else len(prompt_logprobs)} prompt log-probs "
                                      f"for a {total}-token sequence (response {i})")
        logps = []
        for k, tok in enumerate(response):
            lp = _token_logprob(prompt_logprobs[prompt_len + k - offset], int(tok))
            if lp is None:
                raise TeacherScoringError(f"prefix {prefix_id}: no teacher log-prob for response {i}, token {k}")
            if not math.isfinite(lp):
                raise TeacherScoringError(f"prefix {prefix_id}: non-finite teacher log-prob at response {i}, token {k}")
            logps.append(lp)
        return logps
