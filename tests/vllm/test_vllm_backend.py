"""The vLLM backend against the HF reference, for real: a tiny random Qwen2 model served by vLLM
(the CPU build here), its samples and log-probs checked against an fp32 HF transformers forward
of the same weights.

Run in the vLLM environment only (see conftest.py): vLLM is imported at the top so that the
wrong environment fails loudly instead of skipping.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import vllm  # noqa: F401  — fail at collection, never skip, where vLLM is absent

from sapd.method.objective import token_logprobs
from sapd.models.generation import SamplingParams
from sapd.models.loading import load_causal_lm, load_tokenizer
from sapd.models.scoring import TeacherScoringError, score_groups, score_naive
from sapd.models.tiny import build_tiny_model
from sapd.models.vllm_backend import VLLMGenerator, VLLMScorer, make_llm
from tests.tokenizer_util import build_test_tokenizer

pytestmark = pytest.mark.vllm

MAX_MODEL_LEN = 256
TOLERANCE = 1e-3
STOP = "e"  # a letter in a large share of the vocabulary: the random model emits it within a few tokens
PROMPTS = [
    "You are in the middle of a room. Your task is to: put a clean apple in the fridge.",
    "Find me a pair of running shoes under 50 dollars.",
    "Question: who wrote the novel that the film was based on?",
]
EOS_BOOST = 15.0  # × the EOS embedding row (tied to the LM head): ~4 % of the mass per token on plain text


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Qwen2 model + ChatML tokenizer. vLLM's CPU attention has no kernel for head_dim 16 (the
    default tiny config), so hidden 128 / 4 heads (head_dim 32), 2 KV heads (grouped-query, as Qwen2).
    A random model puts ~1/V on EOS; its embedding row is scaled up so that samples do end on EOS
    within a few dozen tokens and the "eos" finish is exercised for real."""
    root = tmp_path_factory.mktemp("vllm-model")
    tok = build_test_tokenizer(root / "tokenizer")
    model = build_tiny_model(tok, root / "model", hidden_size=128, heads=4, kv_heads=2, intermediate_size=256,
                             layers=2)
    with torch.no_grad():
        model.get_input_embeddings().weight[tok.eos_token_id] *= EOS_BOOST
    model.save_pretrained(str(root / "model"))
    return root / "model"


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path):
    return load_tokenizer(str(model_dir))


@pytest.fixture(scope="module")
def hf_model(model_dir: Path):
    return load_causal_lm(str(model_dir), dtype="float32")


@pytest.fixture(scope="module")
def llm(model_dir: Path):
    """One engine for the module (starting one costs ~10 s on 2 cores); student and teacher alike."""
    engine = make_llm(model_dir, dtype="float32", seed=0, max_model_len=MAX_MODEL_LEN,
                      kv_cache_memory_bytes=256 * 2**20)
    yield engine
    del engine


@pytest.fixture(scope="module")
def generator(llm, tokenizer) -> VLLMGenerator:
    return VLLMGenerator(llm, tokenizer=tokenizer)


@pytest.fixture(scope="module")
def prompts(tokenizer) -> list[str]:
    return [tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                          add_generation_prompt=True) for p in PROMPTS]


@pytest.fixture(scope="module")
def stop_samples(generator, prompts):
    params = SamplingParams(n=4, temperature=1.0, top_p=1.0, max_new_tokens=24, stop=(STOP,), seed=3)
    return params, generator.generate(prompts, params)


def _hf_logprobs(model, prompt_ids: list[int], response: list[int]) -> list[float]:
    seq = torch.tensor([prompt_ids + response])
    with torch.no_grad():
        logits = model(input_ids=seq).logits[:, len(prompt_ids) - 1:-1, :]
    return token_logprobs(logits, seq[:, len(prompt_ids):])[0].tolist()


def _max_abs_diff(a: list[list[float]], b: list[list[float]]) -> float:
    assert [len(x) for x in a] == [len(x) for x in b]
    return max((abs(x - y) for xs, ys in zip(a, b) for x, y in zip(xs, ys)), default=0.0)


def _check_sample(sample, tokenizer, params: SamplingParams) -> None:
    ids = sample.token_ids
    assert 1 <= len(ids) <= params.max_new_tokens
    assert len(sample.logprobs) == len(ids)
    assert all(math.isfinite(x) and x <= 0.0 for x in sample.logprobs)
    assert tokenizer.decode(ids, skip_special_tokens=True) == sample.text
    if sample.finish_reason == "eos":
        assert ids[-1] == tokenizer.eos_token_id
    else:
        assert tokenizer.eos_token_id not in ids
    if sample.finish_reason == "stop":  # stopped at the first stop string, and it is kept
        assert any(s in sample.text for s in params.stop)
        before = tokenizer.decode(ids[:-1], skip_special_tokens=True)
        assert not any(s in before for s in params.stop)
    if sample.finish_reason == "length":
        assert len(ids) == params.max_new_tokens
        assert not any(s in sample.text for s in params.stop)


def test_generate_with_stop_string(stop_samples, tokenizer, prompts) -> None:
    params, out = stop_samples
    assert len(out) == len(prompts)
    reasons = []
    for group in out:
        assert len(group) == params.n
        assert len({tuple(s.token_ids) for s in group}) > 1  # sampled, not n copies of one
        for s in group:
            _check_sample(s, tokenizer, params)
            reasons.append(s.finish_reason)
    print(f"\n[vllm] finish reasons with stop={STOP!r}: " + ", ".join(f"{r}={reasons.count(r)}" for r in
                                                                     ("stop", "eos", "length")))
    assert reasons.count("stop") >= len(reasons) // 2, reasons


def test_generate_until_eos_or_length(generator, tokenizer) -> None:
    """Plain-text prompts: after a chat template's <|im_end|>, the boosted EOS row pushes the hidden
    state away from EOS, and the random model then hardly ever ends."""
    params = SamplingParams(n=4, max_new_tokens=24, stop=(), seed=1)
    out = generator.generate(PROMPTS, params)
    reasons = [s.finish_reason for g in out for s in g]
    for g in out:
        assert len(g) == params.n
        for s in g:
            _check_sample(s, tokenizer, params)
    print("\n[vllm] finish reasons without stop strings: " + ", ".join(f"{r}={reasons.count(r)}" for r in
                                                                       ("stop", "eos", "length")))
    assert "eos" in reasons and "length" in reasons, reasons
    assert "stop" not in reasons


def test_generate_is_deterministic_per_seed(generator, stop_samples, prompts) -> None:
    params, first = stop_samples
    seen: list[int] = []
    again = generator.generate(prompts, params, progress=seen.append)
    assert sum(seen) == len(prompts)
    assert [[s.token_ids for s in g] for g in again] == [[s.token_ids for s in g] for g in first]
    assert _max_abs_diff([s.logprobs for g in again for s in g], [s.logprobs for g in first for s in g]) < 1e-6
    other = generator.generate(prompts, SamplingParams(**{**params.__dict__, "seed": params.seed + 1}))
    assert [[s.token_ids for s in g] for g in other] != [[s.token_ids for s in g] for g in first]
    # prompts get seeds of their own: identical prompts in one call do not draw identical samples
    twins = generator.generate([prompts[0], prompts[0]], params)
    assert [s.token_ids for s in twins[0]] != [s.token_ids for s in twins[1]]


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.7, 0.9)])
def test_sampled_logprobs_match_hf(generator, hf_model, tokenizer, prompts, temperature, top_p) -> None:
    """vLLM's sampled-token log-probs are the model's at temperature 1 (raw), whatever the sampler's
    temperature / top-p: the quantity the importance ratios need, and what HFGenerator returns."""
    params = SamplingParams(n=4, temperature=temperature, top_p=top_p, max_new_tokens=20, stop=(), seed=5)
    out = generator.generate(prompts, params)
    got, want = [], []
    for prompt, group in zip(prompts, out):
        prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        for s in group:
            got.append(s.logprobs)
            want.append(_hf_logprobs(hf_model, prompt_ids, s.token_ids))
    diff = _max_abs_diff(got, want)
    print(f"\n[vllm-vs-hf] sampled-token logprobs, T={temperature} top_p={top_p}: max |Δ| = {diff:.3e} "
          f"over {sum(map(len, got))} tokens")
    assert diff <= TOLERANCE


def test_scorer_matches_hf(llm, generator, hf_model, tokenizer, prompts) -> None:
    out = generator.generate(prompts, SamplingParams(n=3, max_new_tokens=20, stop=(), seed=9))
    groups = []
    for j, (prompt, group) in enumerate(zip(prompts, out)):
        prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        responses = [s.token_ids for s in group]
        if j == 1:
            responses = responses + [[]]  # an empty response scores as []
        groups.append((f"p{j}", prompt_ids, responses))
    scorer = VLLMScorer(llm, groups_per_call=2)  # two calls: the chunking is exercised too
    seen: list[int] = []
    got = scorer.score_groups(groups, progress=seen.append)
    assert sum(seen) == len(groups)
    assert [[len(r) for r in g] for g in got] == [[len(r) for r in rs] for _, _, rs in groups]
    worst = 0.0
    for (pid, prompt_ids, responses), scored in zip(groups, got):
        worst = max(worst, _max_abs_diff(scored, score_naive(hf_model, prompt_ids, responses, prefix_id=pid)))
    shared = score_groups(hf_model, groups, pad_id=tokenizer.pad_token_id)
    worst_shared = max(_max_abs_diff(g, s) for g, s in zip(got, shared))
    print(f"\n[vllm-vs-hf] teacher scoring: max |Δ| vs score_naive = {worst:.3e}, "
          f"vs score_groups (shared prefix) = {worst_shared:.3e}")
    assert worst <= TOLERANCE
    assert worst_shared <= TOLERANCE


@pytest.fixture(scope="module")
def long_scorer(model_dir: Path):
    """A teacher engine with a longer context than the module's (prompts past two KV blocks), built by
    :meth:`VLLMScorer.from_path` (prefix caching on). Kept until the module ends: tearing an in-process
    engine down takes vLLM's process-wide parallel groups with it, and the module's engine is still used."""
    scorer = VLLMScorer.from_path(model_dir, dtype="float32", max_model_len=640, kv_cache_memory_bytes=256 * 2**20)
    yield scorer
    del scorer


def test_scorer_computes_each_prompt_once(long_scorer, hf_model) -> None:
    """Each group's prompt is prefilled once and read from vLLM's prefix cache by its G scoring requests:
    the tokens computed (from vLLM's own count of cache hits) fall from G·(P + R) towards P + G·R, and the
    scores equal scoring every response whole (the HF reference). Two responses sharing their first 40
    tokens, scheduled in one step, can hit each other's blocks past the prompt: those rows were never
    computed, so they are scored again without the cache. The CPU build's KV blocks are 128 tokens."""
    scorer = long_scorer
    assert scorer.llm.llm_engine.vllm_config.cache_config.enable_prefix_caching and not scorer.sleeps
    scorer.release()  # the CPU backend has no sleep mode: the engine stays as it is
    g = torch.Generator().manual_seed(0)

    def ids(n: int) -> list[int]:
        return torch.randint(10, 900, (n,), generator=g).tolist()

    shared = ids(40)
    groups = [("alfworld-like", ids(300), [ids(n) for n in (12, 30, 7, 25)]),
              # prompt 240: the block of tokens 128-255 ends inside the responses, which share 40 tokens
              ("shared-start", ids(240), [shared + [5, 6], shared + [7, 8, 9], ids(20), []])]
    block = scorer.llm.llm_engine.vllm_config.cache_config.block_size
    (pid, prompt, responses) = groups[0]
    first = scorer.score_groups(groups[:1])
    # P − 1 prefilled once; each response then recomputes the prompt past its cached blocks, and itself
    cached = (len(prompt) - 1) // block * block
    assert scorer.stats.computed_tokens == len(prompt) - 1 + sum(len(prompt) - cached + len(r) for r in responses)
    assert scorer.stats.rescored == 0
    got = first + scorer.score_groups(groups[1:])
    worst = max(_max_abs_diff(scored, score_naive(hf_model, p, rs, prefix_id=pid))
                for (pid, p, rs), scored in zip(groups, got))
    stats = scorer.stats
    print(f"\n[vllm] teacher scoring, prompt once: max |Δ| vs score_naive = {worst:.3e}; {stats.line()}")
    assert worst <= TOLERANCE
    assert [[len(r) for r in s] for s in got] == [[len(r) for r in rs] for _, _, rs in groups]
    assert (stats.groups, stats.responses) == (2, 7) and stats.rescored >= 1
    assert stats.per_response_tokens == sum(len(p) + len(r) for _, p, rs in groups for r in rs if r)
    assert stats.shared_prompt_tokens == sum(len(p) + sum(map(len, rs)) for _, p, rs in groups)
    assert stats.shared_prompt_tokens < stats.computed_tokens < stats.per_response_tokens
    whole = VLLMScorer(scorer.llm, share_prompt=False)
    again = whole.score_groups(groups)
    assert max(_max_abs_diff(a, b) for a, b in zip(again, got)) <= TOLERANCE
    assert whole.stats.computed_tokens == whole.stats.per_response_tokens  # vLLM's default: no cache read


def test_scorer_reads_the_computed_rows_of_a_cache_hit() -> None:
    """vLLM's V2 model runner returns only the rows it computed after a prefix-cache hit of h tokens (a
    list shorter by h); the reader aligns on it, and refuses a hit that left a response row uncomputed."""
    from vllm.logprobs import Logprob

    # prompt 4 tokens + response [6, 7]; hit h = 2: entries for tokens 2..5, the first a None
    positions = [None, {9: Logprob(-0.5)}, {6: Logprob(-1.0)}, {7: Logprob(-2.0)}]
    assert VLLMScorer._read("x", 0, 4, [6, 7], positions) == [-1.0, -2.0]
    with pytest.raises(TeacherScoringError, match="returned 2 prompt log-probs for a 6-token sequence"):
        VLLMScorer._read("x", 0, 4, [6, 7], positions[2:])  # h = 4 > P − 1: row 3 was never computed


def test_scorer_refuses_too_long(llm, tokenizer) -> None:
    scorer = VLLMScorer(llm)
    fits = ("ok", list(range(10, 20)), [[30, 31]])
    limit = scorer.max_model_len - 1
    prompt = [(7 * i) % 900 + 10 for i in range(limit - 4)]
    with pytest.raises(TeacherScoringError, match=r"prefix too-long-7\b.*exceeds"):
        scorer.score_groups([fits, ("too-long-7", prompt, [[40, 41], list(range(50, 55))])])
    # exactly at the limit is scored, not refused
    (scored,) = scorer.score_groups([("at-limit", prompt, [[40, 41, 42, 43]])])
    assert len(scored[0]) == 4 and all(math.isfinite(x) for x in scored[0])


def test_scorer_refuses_non_finite() -> None:
    """vLLM does not produce a NaN on demand; the reader is fed one the way vLLM would return it."""
    from vllm.logprobs import Logprob

    positions = [None, {5: Logprob(-1.0)}, {6: Logprob(float("nan"))}]
    with pytest.raises(TeacherScoringError, match=r"prefix x9: non-finite teacher log-prob at response 2, token 0"):
        VLLMScorer._read("x9", 2, 2, [6], positions)


def test_generator_refuses_too_long_prompt(generator, tokenizer) -> None:
    long_prompt = "apple " * (MAX_MODEL_LEN * 2)
    with pytest.raises(ValueError, match="prompt 1 has"):
        generator.generate(["short", long_prompt], SamplingParams(n=1, max_new_tokens=2))


@pytest.mark.parametrize("path", ["native", "reload_weights"])
def test_load_weights_in_place_samples_like_a_fresh_engine(model_dir, generator, stop_samples, prompts,
                                                          tmp_path, path) -> None:
    """The student engine kept across rounds: an engine started on other weights, then given the model's
    weights in place — through vLLM's native weight-update session (start / update per shard / finish,
    sapd's transfer engine on the worker) or, the fallback, ``reload_weights`` — with the CPU backend's
    packed GEMMs rebuilt (the tied LM head among them) and the prefix cache reset, samples exactly what a
    freshly started engine samples on those weights with the same seed; and before the update it did
    not. The model is written in several safetensors shards, so the native path takes several updates."""
    from transformers import AutoModelForCausalLM

    tok = load_tokenizer(str(model_dir))
    other = tmp_path / "other"
    build_tiny_model(tok, other, hidden_size=128, heads=4, kv_heads=2, intermediate_size=256, layers=2, seed=5)
    sharded = tmp_path / "sharded"  # the model's own weights, in 3 shards (as checkpoints are written)
    AutoModelForCausalLM.from_pretrained(str(model_dir)).save_pretrained(str(sharded), max_shard_size="150KB")
    tok.save_pretrained(str(sharded))
    assert len(list(sharded.glob("*.safetensors"))) >= 3
    params, fresh = stop_samples
    kept = VLLMGenerator.from_path(other, dtype="float32", max_model_len=MAX_MODEL_LEN,
                                   kv_cache_memory_bytes=128 * 2**20, sync_timeout_s=120)
    if path == "reload_weights":
        kept._native = False  # what an installed vLLM without the weight-transfer API gets
    assert kept.llm.llm_engine.model_config.hf_config.tie_word_embeddings  # the case vLLM's reload missed
    before = kept.generate(prompts, params)  # also fills the prefix cache with the old weights' blocks
    assert [[s.token_ids for s in g] for g in before] != [[s.token_ids for s in g] for g in fresh]
    kept.release()  # no sleep mode on the CPU backend: stays resident, still usable after load_weights
    kept.load_weights(sharded)
    assert kept.weight_sync == path
    after = kept.generate(prompts, params)
    assert [[s.token_ids for s in g] for g in after] == [[s.token_ids for s in g] for g in fresh]
    assert _max_abs_diff([s.logprobs for g in after for s in g], [s.logprobs for g in fresh for s in g]) < 1e-5
    # and back: the update is not one-way
    kept.load_weights(other)
    assert [[s.token_ids for s in g] for g in kept.generate(prompts, params)] == \
        [[s.token_ids for s in g] for g in before]
    del kept


def test_a_weight_sync_past_its_deadline_ends_the_stage(model_dir, prompts) -> None:
    """A call of the weight sync that hangs (here a shard that takes 3 s to load, in the engine's own process:
    bench/slow_weight_sync.py) fails after the deadline with one line naming the call, and the engine refuses
    further work instead of sampling from weights in an unknown state."""
    import time

    from sapd.models.vllm_backend import WeightSyncTimeout

    kept = VLLMGenerator.from_path(model_dir, dtype="float32", max_model_len=MAX_MODEL_LEN,
                                   kv_cache_memory_bytes=64 * 2**20, sync_timeout_s=0.5,
                                   worker_extension_cls="bench.slow_weight_sync.SlowShardExtension")
    t0 = time.monotonic()
    with pytest.raises(WeightSyncTimeout, match=r"update_weights \(model\.safetensors, 1 of 1\) did not finish "
                                                r"within 0\.5 s; .*weight_sync_timeout_s") as e:
        kept.load_weights(model_dir)
    assert time.monotonic() - t0 < 2.5 and e.value.exit_code == 75
    with pytest.raises(RuntimeError, match="unusable after a failed weight sync"):
        kept.generate(prompts, SamplingParams(n=1, max_new_tokens=2))
    del kept
