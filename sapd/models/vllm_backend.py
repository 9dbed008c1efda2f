"""vLLM backends: student generation (:class:`VLLMGenerator`) and teacher scoring (:class:`VLLMScorer`)
behind the same interfaces as the HF ones, for GPU pools (and, slowly, vLLM's CPU build).

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
  raw model distribution, in fp32). vLLM skips reading its prefix cache for such requests, so every
  position is really computed, and produces them chunk by chunk along with chunked prefill.
* ``kv_cache_memory_bytes`` — an explicit KV-cache size that both the GPU and the CPU workers honour
  (on CPU it replaces the integer-GiB ``VLLM_CPU_KVCACHE_SPACE`` variable).
* ``reload_weights`` (a worker call, through ``LLM.collective_rpc``) — the student engine stays up across
  rounds and takes each round's checkpoint in place (:meth:`VLLMGenerator.load_weights`). Two things
  derived from the old weights are redone by hand: the prefix cache is reset (its blocks hold the old
  keys/values), and on the CPU backend every linear layer whose weight stays materialised is re-packed —
  vLLM re-packs the layers it reloads, but a LM head **tied** to the embeddings is not reloaded itself
  and kept the oneDNN handle packed from the old embedding matrix (samples then differed from a fresh
  engine's). Where the platform has it (CUDA/ROCm), the engine sleeps during training
  (``sleep(level=2)``: weights and KV cache freed; :meth:`VLLMGenerator.release`) and wakes for the next
  round's weights.

vLLM is imported lazily, inside the functions that need it, so this module imports (and its types
can be named) where vLLM is not installed, e.g. in the main environment.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sapd.models.generation import FinishReason, Sample, SamplingParams
from sapd.models.loading import DType, load_tokenizer, resolve_model_dir
from sapd.models.scoring import TeacherScoringError

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
                              "gpu_memory_utilization": gpu_memory_utilization, "enforce_eager": enforce_eager}
    if max_model_len is not None:
        kwargs["max_model_len"] = max_model_len
    if kv_cache_memory_bytes is not None:
        kwargs["kv_cache_memory_bytes"] = kv_cache_memory_bytes
    kwargs.update(llm_kwargs)
    return LLM(**kwargs)


def _repack_cpu_gemms(worker: Any) -> int:
    """Run inside each vLLM worker after ``reload_weights`` on the CPU backend: rebuild the packed GEMM of
    every linear layer whose weight is still materialised (a tied LM head, the embeddings), so that none
    keeps a handle packed from the old weights. Layers whose weight vLLM removed after packing were
    re-packed by the reload itself. Returns how many layers were re-packed."""
    import torch
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

    model = worker.get_model() if hasattr(worker, "get_model") else worker.model_runner.get_model()
    n = 0
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if (not hasattr(module, "cpu_linear") or getattr(module, "_cpu_skip_gemm_dispatch", False)
                or not isinstance(weight, torch.Tensor) or weight.ndim != 2 or weight.numel() == 0):
            continue
        dispatch_cpu_unquantized_gemm(module, remove_weight=False)
        n += 1
    return n


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
    _eos_ids: set[int] = field(default_factory=set, init=False, repr=False)
    _asleep: bool = field(default=False, init=False, repr=False)

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
                  cache_dir: str | Path | None = None, **llm_kwargs: Any) -> VLLMGenerator:
        """Load the model into vLLM and the tokenizer with :func:`sapd.models.loading.load_tokenizer`
        (the same tokenizer object type, and so the same ids, as the HF path)."""

        from vllm.platforms import current_platform

        if current_platform.is_sleep_mode_available():  # so that release() can free the GPU for training
            llm_kwargs.setdefault("enable_sleep_mode", True)
        llm = make_llm(model_dir, dtype=dtype, seed=seed, gpu_memory_utilization=gpu_memory_utilization,
                       max_model_len=max_model_len, enforce_eager=enforce_eager,
                       kv_cache_memory_bytes=kv_cache_memory_bytes, cache_dir=cache_dir, **llm_kwargs)
        return cls(llm, tokenizer=load_tokenizer(str(model_dir), cache_dir), cache_dir=cache_dir)

    @property
    def sleeps(self) -> bool:
        """Whether :meth:`release` frees the engine's memory (sleep mode: CUDA/ROCm engines built by
        :meth:`from_path`)."""
        return bool(getattr(self.llm.llm_engine.vllm_config.model_config, "enable_sleep_mode", False))

    def release(self) -> None:
        """Before training: free the engine's weights and KV cache where vLLM's sleep mode is on
        (level 2: the weights are reloaded from the next checkpoint anyway). Elsewhere (the CPU backend)
        the engine stays resident. :meth:`load_weights` wakes it."""
        if self.sleeps and not self._asleep:
            self.llm.sleep(level=2)
            self._asleep = True

    def load_weights(self, model_dir: str | Path) -> None:
        """Take new weights in place (the next round's checkpoint, same architecture) through vLLM's
        ``reload_weights``: the engine, its KV cache and compiled graphs stay up. Then what was derived
        from the old weights is redone: the CPU backend's packed GEMMs of layers the reload leaves alone
        (a tied LM head), and the prefix cache. Samples afterwards equal a fresh engine's on the same
        weights and seed (tests/vllm)."""
        from vllm.platforms import current_platform

        path = resolve_model_dir(str(model_dir), self.cache_dir)
        if self._asleep:
            self.llm.wake_up()
            self._asleep = False
        self.llm.collective_rpc("reload_weights", kwargs={"weights_path": str(path)})
        if current_platform.is_cpu():
            self.llm.collective_rpc(_repack_cpu_gemms)
        self.llm.reset_prefix_cache()

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
    response token.

    One request per response (prompt + response as a single prompt, one dummy output token). vLLM
    needs room for that output token, so prompt + response must fit in ``max_model_len − 1``; longer
    ones raise :class:`TeacherScoringError` before anything is sent (vLLM would reject the whole batch,
    and a truncated sequence would be scored wrongly). ``groups_per_call`` bounds one ``LLM.generate``.
    """

    llm: LLM
    groups_per_call: int = 16

    @classmethod
    def from_path(cls, model_dir: str | Path, *, dtype: DType = "float32", seed: int = 0,
                  gpu_memory_utilization: float = 0.9, max_model_len: int | None = None,
                  enforce_eager: bool | None = None, kv_cache_memory_bytes: int | None = None,
                  cache_dir: str | Path | None = None, **llm_kwargs: Any) -> VLLMScorer:
        return cls(make_llm(model_dir, dtype=dtype, seed=seed, gpu_memory_utilization=gpu_memory_utilization,
                            max_model_len=max_model_len, enforce_eager=enforce_eager,
                            kv_cache_memory_bytes=kv_cache_memory_bytes, cache_dir=cache_dir, **llm_kwargs))

    @property
    def max_model_len(self) -> int:
        return _max_model_len(self.llm)

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

    def score_groups(self, groups: Sequence[Group],
                     progress: Callable[[int], None] | None = None) -> list[list[list[float]]]:
        """``groups`` = [(prefix_id, prompt_ids, [response_ids × G])] → teacher log-probs per response."""
        import vllm
        from vllm.inputs import TokensPrompt

        sampling = vllm.SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0, detokenize=False)
        out: list[list[list[float]]] = []
        for start in range(0, len(groups), self.groups_per_call):
            chunk = list(groups[start:start + self.groups_per_call])
            for prefix_id, prompt_ids, responses in chunk:  # every check before any work
                self._check(prefix_id, prompt_ids, responses)
            requests, where = [], []
            for g, (_, prompt_ids, responses) in enumerate(chunk):
                for i, r in enumerate(responses):
                    if r:
                        ids = [int(t) for t in prompt_ids] + [int(t) for t in r]
                        requests.append(TokensPrompt(prompt_token_ids=ids))
                        where.append((g, i))
            results = self.llm.generate(requests, sampling, use_tqdm=False) if requests else []
            scored: list[list[list[float]]] = [[[] for _ in responses] for _, _, responses in chunk]
            for (g, i), res in zip(where, results):
                prefix_id, prompt_ids, responses = chunk[g]
                scored[g][i] = self._read(prefix_id, i, len(prompt_ids), responses[i], res.prompt_logprobs)
            out.extend(scored)
            if progress:
                progress(len(chunk))
        return out

    @staticmethod
    def _read(prefix_id: str, i: int, prompt_len: int, response: Sequence[int], prompt_logprobs: Any) -> list[float]:
        """Entry k of ``prompt_logprobs`` is log π(token k | tokens < k); response token j sits at
        position ``prompt_len + j``."""
        if prompt_logprobs is None or len(prompt_logprobs) != prompt_len + len(response):
            raise TeacherScoringError(f"prefix {prefix_id}: vLLM returned "
                                      f"{None if prompt_logprobs is None else len(prompt_logprobs)} prompt log-probs "
                                      f"for a {prompt_len + len(response)}-token sequence (response {i})")
        logps = []
        for k, tok in enumerate(response):
            lp = _token_logprob(prompt_logprobs[prompt_len + k], int(tok))
            if lp is None:
                raise TeacherScoringError(f"prefix {prefix_id}: no teacher log-prob for response {i}, token {k}")
            if not math.isfinite(lp):
                raise TeacherScoringError(f"prefix {prefix_id}: non-finite teacher log-prob at response {i}, token {k}")
            logps.append(lp)
        return logps
