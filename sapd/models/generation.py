"""Generation backends behind one interface: G responses per prompt, with the token ids and the
sampler's log-probs, stopping after the decision block.

The HF backend is the embedded default (CPU or one GPU). Each prompt is prefilled **once** and its
key/value cache is repeated G times for the group, so a group costs one prompt forward instead of G.
Sampling is written out (temperature, top-p) so that the returned log-probs are exactly those of the
model's distribution at temperature 1 for the sampled tokens (what importance ratios use); the
training stage recomputes π_old with the training weights anyway.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Literal, Protocol, Sequence, cast

import torch

from sapd.models.loading import cache_kwarg, output_cache

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

FinishReason = Literal["stop", "eos", "length"]

# decision blocks end here: stop sampling once one is closed (ALFWorld/WebShop; search QA)
ACTION_STOPS = ("</action>",)
SEARCH_STOPS = ("</search>", "</answer>")


@dataclass(frozen=True)
class SamplingParams:
    n: int = 8  # G responses per prompt
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 256
    stop: tuple[str, ...] = ACTION_STOPS  # stop strings (kept in the output)
    seed: int = 0


@dataclass
class Sample:
    token_ids: list[int]  # generated tokens, including the EOS or the token that completed a stop string
    logprobs: list[float]  # log π(y_k | context) at temperature 1, one per token
    text: str
    finish_reason: FinishReason


class Generator(Protocol):
    def generate(self, prompts: Sequence[str], params: SamplingParams,
                 progress: Callable[[int], None] | None = None) -> list[list[Sample]]:
        """For each prompt, ``params.n`` samples."""
        ...


def stops_for(decision: str) -> tuple[str, ...]:
    return SEARCH_STOPS if decision == "search" else ACTION_STOPS


def _top_p_filter(logits_B_V: torch.Tensor, top_p: float) -> torch.Tensor:
    """Mask (to −inf) every token outside the smallest set whose probability reaches ``top_p``."""
    if top_p >= 1.0:
        return logits_B_V
    sorted_logits, order = torch.sort(logits_B_V, descending=True, dim=-1)
    cum = torch.softmax(sorted_logits, dim=-1).cumsum(-1)
    drop_sorted = cum - torch.softmax(sorted_logits, dim=-1) >= top_p  # keep the token that crosses top_p
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return logits_B_V.masked_fill(drop, float("-inf"))


@dataclass
class HFGenerator:
    """Batched sampling with HF transformers: left-padded prompts, one prefill per prompt, a KV cache
    repeated G times, one decode step for the whole batch per token."""

    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    prompts_per_batch: int = 4  # prompts prefilled together; each becomes G sequences in the decode batch
    device: str = "cpu"
    _stop_token_ids: set[int] = field(default_factory=set)
    _offloaded: bool = field(default=False, init=False, repr=False)

    def __post_init__(self) -> None:
        eos = self.tokenizer.eos_token_id
        self._stop_token_ids = {eos} if eos is not None else set()
        gen_eos = getattr(getattr(self.model, "generation_config", None), "eos_token_id", None)
        if isinstance(gen_eos, int):
            self._stop_token_ids.add(gen_eos)
        elif isinstance(gen_eos, list):
            self._stop_token_ids.update(gen_eos)

    @torch.no_grad()
    def load_weights(self, model_dir: str | Path) -> None:
        """Take new weights in place (the next round's checkpoint, same architecture): the live model's
        tensors are overwritten from ``model_dir``'s safetensors files, so the engine stays up across
        rounds instead of being rebuilt. Weights tied to a loaded tensor (a tied LM head) follow it; any
        other parameter the files miss, or a name or shape they add, is an error naming the folder."""
        from safetensors.torch import load_file

        files = sorted(Path(model_dir).glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"{model_dir}: no *.safetensors files to load weights from "
                                    "(checkpoints are saved with safe_serialization)")
        live = self.model.state_dict()
        loaded: set[int] = set()
        seen: set[str] = set()
        for f in files:
            for name, tensor in load_file(str(f)).items():
                if name not in live:
                    raise ValueError(f"{f}: tensor {name!r} is not a weight of the live model "
                                     "(a checkpoint of another architecture?)")
                if live[name].shape != tensor.shape:
                    raise ValueError(f"{f}: tensor {name!r} has shape {tuple(tensor.shape)}, the live model "
                                     f"{tuple(live[name].shape)}")
                live[name].copy_(tensor)
                loaded.add(live[name].data_ptr())
                seen.add(name)
        missing = [n for n in live if n not in seen and live[n].data_ptr() not in loaded]
        if missing:
            raise ValueError(f"{model_dir}: the checkpoint lacks {missing[:5]} (of {len(missing)} missing)")
        self._return_to_device()

    def release(self) -> bool:
        """Before training: on an accelerator the kept model moves to host memory, so the training stage
        has the device to itself (the weights are overwritten by the next :meth:`load_weights` anyway); on
        a CPU nothing moves. → whether it moved."""
        if torch.device(self.device).type == "cpu" or self._offloaded:
            return False
        cast(Any, self.model).to("cpu")  # transformers types .to() narrowly
        self._offloaded = True
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        return True

    def wake(self) -> bool:
        """The model back on its device after :meth:`release` (sampling does it too). → whether it moved."""
        return self._return_to_device()

    def _return_to_device(self) -> bool:
        if not self._offloaded:
            return False
        cast(Any, self.model).to(self.device)
        self._offloaded = False
        return True

    @torch.no_grad()
    def generate(self, prompts: Sequence[str], params: SamplingParams,
                 progress: Callable[[int], None] | None = None) -> list[list[Sample]]:
        self._return_to_device()
        gen = torch.Generator(device=self.device).manual_seed(params.seed)
        out: list[list[Sample]] = []
        for start in range(0, len(prompts), self.prompts_per_batch):
            chunk = list(prompts[start:start + self.prompts_per_batch])
            out.extend(self._generate_chunk(chunk, params, gen))
            if progress:
                progress(len(chunk))
        return out

    def _generate_chunk(self, prompts: list[str], params: SamplingParams, gen: torch.Generator) -> list[list[Sample]]:
        tok = self.tokenizer
        ids = [tok(p, add_special_tokens=False)["input_ids"] for p in prompts]
        B, G = len(ids), params.n
        width = max(len(x) for x in ids)
        pad = tok.pad_token_id if tok.pad_token_id is not None else 0
        input_ids = torch.full((B, width), pad, dtype=torch.long)
        attn = torch.zeros((B, width), dtype=torch.long)
        for i, x in enumerate(ids):  # left padding: every prompt ends at the last column
            input_ids[i, width - len(x):] = torch.tensor(x)
            attn[i, width - len(x):] = 1
        input_ids, attn = input_ids.to(self.device), attn.to(self.device)
        positions = (attn.cumsum(-1) - 1).clamp(min=0)
        res = self.model(input_ids=input_ids, attention_mask=attn, position_ids=positions, use_cache=True)
        cache = output_cache(res)
        cache.batch_repeat_interleave(G)  # one prefill per prompt, shared by its G samples
        logits = res.logits[:, -1, :].float().repeat_interleave(G, dim=0)  # (B·G, V)
        attn = attn.repeat_interleave(G, dim=0)
        next_pos = positions[:, -1:].repeat_interleave(G, dim=0) + 1

        N = B * G
        tokens: list[list[int]] = [[] for _ in range(N)]
        logps: list[list[float]] = [[] for _ in range(N)]
        finish: list[FinishReason | None] = [None] * N
        max_stop = max((len(s) for s in params.stop), default=0)
        cache_arg = cache_kwarg(self.model)
        for step in range(params.max_new_tokens):
            logp_full = torch.log_softmax(logits, dim=-1)
            if params.temperature <= 0:
                nxt = logits.argmax(-1)
            else:
                probs = torch.softmax(_top_p_filter(logits / params.temperature, params.top_p), dim=-1)
                nxt = torch.multinomial(probs, 1, generator=gen).squeeze(-1)
            picked = logp_full.gather(-1, nxt.unsqueeze(-1)).squeeze(-1)
            nxt_l, picked_l = nxt.tolist(), picked.tolist()
            for i in range(N):
                if finish[i] is not None:
                    continue
                tokens[i].append(nxt_l[i])
                logps[i].append(picked_l[i])
                if nxt_l[i] in self._stop_token_ids:
                    finish[i] = "eos"
                elif params.stop:
                    tail = tok.decode(tokens[i][-(max_stop + 2):], skip_special_tokens=False)
                    if any(s in tail for s in params.stop):
                        finish[i] = "stop"
            if all(f is not None for f in finish) or step == params.max_new_tokens - 1:
                break
            # finished rows keep decoding a pad token (cheaper than reshaping the cache); it is never read
            feed = torch.tensor([pad if finish[i] is not None else nxt_l[i] for i in range(N)],
                                device=self.device).unsqueeze(-1)
            attn = torch.cat([attn, torch.ones((N, 1), dtype=attn.dtype, device=self.device)], dim=-1)
            res = self.model(input_ids=feed, attention_mask=attn, position_ids=next_pos,
                             use_cache=True, **{cache_arg: cache})
            cache = output_cache(res)
            logits = res.logits[:, -1, :].float()
            next_pos = next_pos + 1
        samples = [Sample(token_ids=tokens[i], logprobs=logps[i],
                          text=str(tok.decode(tokens[i], skip_special_tokens=True)),
                          finish_reason=finish[i] or "length") for i in range(N)]
        return [samples[b * G:(b + 1) * G] for b in range(B)]


@torch.no_grad()
def generate_one_by_one(model, tokenizer, prompt: str, params: SamplingParams) -> list[Sample]:
    """The baseline the benchmark compares against: G independent single-sequence generations
    (a full prompt prefill each), same sampler."""
    return [HFGenerator(model, tokenizer, prompts_per_batch=1).generate(
        [prompt], SamplingParams(**{**params.__dict__, "n": 1, "seed": params.seed + i}))[0][0]
        for i in range(params.n)]
