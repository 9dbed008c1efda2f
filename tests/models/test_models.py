"""Model loading, the tokenizer-identity check, HF generation and shared-prefix teacher scoring,
on tiny real Qwen2/Llama models built from a config."""

import math

import pytest
import torch

from sapd import storage
from sapd.models.generation import HFGenerator, SamplingParams, generate_one_by_one
from sapd.models.loading import TokenizerMismatch, check_same_tokenizer, load_causal_lm, load_tokenizer
from sapd.models.scoring import TeacherScoringError, score_group_shared_prefix, score_naive
from sapd.models.tiny import build_tiny_model
from tests.tokenizer_util import build_test_tokenizer


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    tok = build_test_tokenizer(root / "tok")
    build_tiny_model(tok, root / "qwen", arch="qwen2", seed=0)
    build_tiny_model(tok, root / "llama", arch="llama", seed=1)
    return root


def _prompt(tok, text):
    return tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True)


def test_tokenizer_identity_check(tiny, tmp_path):
    from sapd.models.byte_tokenizer import build_tokenizer
    a = load_tokenizer(str(tiny / "qwen"))
    check_same_tokenizer(a, load_tokenizer(str(tiny / "llama")))  # same tokenizer folder contents: fine
    other = build_tokenizer(["completely different text corpus " * 50], tmp_path / "other", vocab_size=300)
    with pytest.raises(TokenizerMismatch, match="vocabulary has"):
        check_same_tokenizer(a, other)
    same_vocab = load_tokenizer(str(tiny / "qwen"))
    same_vocab.eos_token = "<|endoftext|>"
    with pytest.raises(TokenizerMismatch, match="eos_token: student has '<\\|im_end\\|>', teacher has '<\\|endoftext\\|>'"):
        check_same_tokenizer(a, same_vocab)


def test_tokenizer_without_chat_template_is_refused(tiny, tmp_path):
    tok = load_tokenizer(str(tiny / "qwen"))
    tok.chat_template = None
    tok.save_pretrained(tmp_path / "plain")
    (tmp_path / "plain" / "chat_template.jinja").unlink(missing_ok=True)
    with pytest.raises(ValueError, match="no chat template"):
        load_tokenizer(str(tmp_path / "plain"))
    with pytest.raises(FileNotFoundError, match="model folder does not exist"):
        load_tokenizer(str(tmp_path / "nowhere"))


@pytest.mark.parametrize("arch", ["qwen", "llama"])
def test_batched_left_padded_greedy_equals_one_by_one(tiny, arch):
    tok = load_tokenizer(str(tiny / arch))
    model = load_causal_lm(str(tiny / arch))
    prompts = [_prompt(tok, "go to the kitchen"), _prompt(tok, "a much longer instruction " * 6), _prompt(tok, "x")]
    params = SamplingParams(n=2, temperature=0.0, max_new_tokens=10, stop=())
    batched = HFGenerator(model, tok, prompts_per_batch=3).generate(prompts, params)
    for p, group in zip(prompts, batched):
        single = HFGenerator(model, tok, prompts_per_batch=1).generate([p], SamplingParams(
            n=1, temperature=0.0, max_new_tokens=10, stop=()))[0][0]
        for s in group:  # greedy: every sample of the group is the single-sequence result
            assert s.token_ids == single.token_ids
            assert s.logprobs == pytest.approx(single.logprobs, abs=1e-4)
            assert s.finish_reason == "length" and len(s.token_ids) == 10


def test_sampling_is_seeded_and_logprobs_are_the_models(tiny):
    tok = load_tokenizer(str(tiny / "qwen"))
    model = load_causal_lm(str(tiny / "qwen"))
    prompt = _prompt(tok, "find the mug")
    gen = HFGenerator(model, tok)
    params = SamplingParams(n=4, temperature=1.0, top_p=0.9, max_new_tokens=12, stop=(), seed=3)
    a = gen.generate([prompt], params)[0]
    b = gen.generate([prompt], params)[0]
    c = gen.generate([prompt], SamplingParams(**{**params.__dict__, "seed": 4}))[0]
    assert [s.token_ids for s in a] == [s.token_ids for s in b]
    assert [s.token_ids for s in a] != [s.token_ids for s in c]
    assert len({tuple(s.token_ids) for s in a}) > 1  # G distinct samples
    pids = tok(prompt, add_special_tokens=False)["input_ids"]
    ref = score_naive(model, pids, [s.token_ids for s in a])
    for s, r in zip(a, ref):
        assert s.text == tok.decode(s.token_ids, skip_special_tokens=True)
        assert max(abs(x - y) for x, y in zip(s.logprobs, r)) <= 1e-4


def test_stop_string_ends_the_sample(tiny):
    tok = load_tokenizer(str(tiny / "qwen"))
    model = load_causal_lm(str(tiny / "qwen"))
    prompt = _prompt(tok, "open the fridge")
    free = HFGenerator(model, tok).generate([prompt], SamplingParams(n=1, temperature=0, max_new_tokens=8, stop=()))[0][0]
    stop = tok.decode(free.token_ids[:3])  # a string that completes exactly at the third token
    assert len(stop) > len(tok.decode(free.token_ids[:2]))
    stopped = HFGenerator(model, tok).generate([prompt], SamplingParams(n=1, temperature=0, max_new_tokens=8,
                                                                        stop=(stop,)))[0][0]
    assert stopped.finish_reason == "stop" and stopped.token_ids == free.token_ids[:3]


def test_one_by_one_baseline_gives_g_samples(tiny):
    tok = load_tokenizer(str(tiny / "qwen"))
    model = load_causal_lm(str(tiny / "qwen"))
    out = generate_one_by_one(model, tok, _prompt(tok, "hi"), SamplingParams(n=3, max_new_tokens=4, stop=()))
    assert len(out) == 3 and all(len(s.token_ids) == 4 for s in out)


@pytest.mark.parametrize("arch", ["qwen", "llama"])
def test_shared_prefix_scoring_matches_the_full_forward(tiny, arch):
    tok = load_tokenizer(str(tiny / arch))
    model = load_causal_lm(str(tiny / arch))
    prompt_ids = tok(_prompt(tok, "You are in the middle of a room. " * 12), add_special_tokens=False)["input_ids"]
    g = torch.Generator().manual_seed(0)
    responses = [torch.randint(5, len(tok), (n,), generator=g).tolist() for n in (7, 1, 15, 11)]
    fast = score_group_shared_prefix(model, prompt_ids, responses, prefix_id="p#0", pad_id=tok.pad_token_id)
    slow = score_naive(model, prompt_ids, responses)
    assert [len(x) for x in fast] == [7, 1, 15, 11]
    diff = max(abs(a - b) for fa, sa in zip(fast, slow) for a, b in zip(fa, sa))
    assert diff <= 1e-4
    assert all(math.isfinite(v) and v < 0 for row in fast for v in row)


def test_scoring_failures_name_the_prefix(tiny):
    model = load_causal_lm(str(tiny / "qwen"))
    limit = model.config.max_position_embeddings
    with pytest.raises(TeacherScoringError, match=r"prefix traj-7#3: .* exceeds the teacher's context"):
        score_group_shared_prefix(model, [5] * (limit - 2), [[6, 7, 8]], prefix_id="traj-7#3")
    broken = load_causal_lm(str(tiny / "qwen"))
    with torch.no_grad():
        broken.model.norm.weight.fill_(float("nan"))
    with pytest.raises(TeacherScoringError, match=r"prefix traj-1#0: non-finite teacher log-prob at response 0"):
        score_group_shared_prefix(broken, [5, 6, 7], [[8, 9], [10]], prefix_id="traj-1#0")


def test_model_synced_from_s3(tiny, s3_storage, tmp_path):
    uri = storage.join(s3_storage, "models", "student")
    for f in (tiny / "qwen").iterdir():
        storage.write_file_from(f, storage.join(uri, f.name))
    model = load_causal_lm(uri, cache_dir=tmp_path / "cache")
    local = load_causal_lm(str(tiny / "qwen"))
    for (n1, p1), (_, p2) in zip(model.named_parameters(), local.named_parameters()):
        assert torch.equal(p1, p2), n1
    assert load_tokenizer(uri, cache_dir=tmp_path / "cache").get_vocab() == load_tokenizer(str(tiny / "qwen")).get_vocab()
    with pytest.raises(FileNotFoundError, match="no files under this model prefix"):
        load_causal_lm(storage.join(s3_storage, "models", "missing"), cache_dir=tmp_path / "cache")


@pytest.mark.parametrize("arch", ["qwen", "llama"])
def test_response_logprobs_head_only_path_equals_the_full_forward(tiny, arch):
    from sapd.models.scoring import decoder_and_head, response_logprobs
    model = load_causal_lm(str(tiny / arch))
    assert decoder_and_head(model)[0] is not None
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(5, 500, (n,), generator=g).tolist() for n in (30, 12, 50)]
    responses = [torch.randint(5, 500, (n,), generator=g).tolist() for n in (5, 9, 1)]
    logp, mask = response_logprobs(model, prompts, responses, pad_id=0)
    for b, (p, r) in enumerate(zip(prompts, responses)):
        ref = score_naive(model, p, [r])[0]
        assert logp[b, :len(r)].tolist() == pytest.approx(ref, abs=1e-5)
        assert not mask[b, len(r):].any() and bool((logp[b, len(r):] == 0).all())


@pytest.mark.parametrize("arch", ["qwen", "llama"])
def test_shared_prefix_training_path_equals_g_full_sequences(tiny, arch, monkeypatch):
    """Training's forward with each prefix's prompt run once (its cache repeated G times) gives the
    log-probs, entropies **and gradients** of G separate prompt+response sequences — directly and
    through HeadOnlyLM (the module DeepSpeed wraps) — and with gradient checkpointing on (no KV cache)
    it takes the full-sequence path."""
    import sapd.models.scoring as scoring
    from sapd.models.scoring import HeadOnlyLM, response_logprobs_and_entropy
    model = load_causal_lm(str(tiny / arch))
    model.train()
    model.requires_grad_(True)
    g = torch.Generator().manual_seed(3)
    G, prompts, responses = 4, [], []
    for n in (30, 12, 50):
        prompt = torch.randint(5, 500, (n,), generator=g).tolist()
        for i in range(G):  # ragged responses, one empty
            prompts.append(prompt)
            responses.append(torch.randint(5, 500, ((n + 3 * i) % 11,), generator=g).tolist())
    calls: list[int] = []
    shared = scoring.shared_prefix_logits
    monkeypatch.setattr(scoring, "shared_prefix_logits", lambda *a, **k: calls.append(1) or shared(*a, **k))

    def run(m, group_size, backward=True):
        model.zero_grad(set_to_none=True)
        logp, mask, ent = response_logprobs_and_entropy(m, prompts, responses, 0, group_size=group_size)
        if not backward:
            return None
        (logp.sum() + 0.1 * ent.sum()).backward()
        return logp.detach(), mask, ent.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}
    ref = run(model, None)
    assert not calls
    for m in (model, HeadOnlyLM(model)):
        got = run(m, G)
        assert calls and torch.equal(got[1], ref[1])
        calls.clear()
        torch.testing.assert_close(got[0], ref[0], rtol=0, atol=1e-5)
        torch.testing.assert_close(got[2], ref[2], rtol=0, atol=1e-4)
        for name, grad in ref[3].items():
            torch.testing.assert_close(got[3][name], grad, rtol=1e-4, atol=1e-5, msg=name)
    model.gradient_checkpointing_enable()
    run(model, G, backward=False)
    assert not calls  # the cache is off under checkpointing: the full-sequence path
    prompts[1] = prompts[1][:-1]  # rows that do not share their group's prompt: the full-sequence path
    model.gradient_checkpointing_disable()
    run(model, G, backward=False)
    assert not calls


def test_in_place_weight_update_samples_like_a_fresh_engine(tiny):
    """Engine reuse across rounds: an engine built on one checkpoint that takes another's weights in
    place samples exactly the tokens (and log-probs) of an engine freshly built on that checkpoint."""
    tok = load_tokenizer(str(tiny / "qwen"))
    build_tiny_model(tok, tiny / "qwen_next", arch="qwen2", seed=7)  # "the next round's checkpoint"
    prompts = [_prompt(tok, "find the mug"), _prompt(tok, "open the drawer")]
    params = SamplingParams(n=3, temperature=1.0, top_p=0.95, max_new_tokens=10, stop=(), seed=5)
    live = HFGenerator(load_causal_lm(str(tiny / "qwen")), tok, prompts_per_batch=2)
    before = live.generate(prompts, params)
    live.load_weights(tiny / "qwen_next")
    after = live.generate(prompts, params)
    fresh = HFGenerator(load_causal_lm(str(tiny / "qwen_next")), tok, prompts_per_batch=2).generate(prompts, params)
    assert [[s.token_ids for s in g] for g in after] == [[s.token_ids for s in g] for g in fresh]
    assert [[s.logprobs for s in g] for g in after] == [[s.logprobs for s in g] for g in fresh]
    assert [[s.token_ids for s in g] for g in after] != [[s.token_ids for s in g] for g in before]  # it changed


def test_in_place_weight_update_refuses_another_architecture(tiny):
    tok = load_tokenizer(str(tiny / "qwen"))
    live = HFGenerator(load_causal_lm(str(tiny / "qwen")), tok)
    with pytest.raises(ValueError, match="llama.*(not a weight|shape)|lacks"):
        live.load_weights(tiny / "llama")


def test_loading_a_model_prints_no_deepspeed_accelerator_warning(tmp_path):
    """DeepSpeed's "Setting accelerator to CPU" line (printed when transformers imports it to load any
    model) is nothing a user can act on: silenced at the source by naming the accelerator."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from sapd.models.tiny import build_tiny_model
    from tests.tokenizer_util import build_test_tokenizer
    build_tiny_model(build_test_tokenizer(tmp_path / "tok"), tmp_path / "m", seed=0)
    env = {k: v for k, v in os.environ.items() if k != "DS_ACCELERATOR"}
    code = ("import deepspeed.accelerator as a; from sapd.models.loading import load_causal_lm; "
            f"load_causal_lm({str(tmp_path / 'm')!r}); print(a.get_accelerator()._name)")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300,
                         cwd=Path(__file__).resolve().parents[2])
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().endswith("cpu")  # DeepSpeed still runs on the CPU here
    assert "Setting accelerator" not in out.stderr


def test_shared_prompt_mode_auto_is_on_for_cpu_models_only():
    """train.shared_prompt: "auto" runs each prompt once on a CPU model and G full sequences on an
    accelerator (where one prefix at a time measured slower); "on" / "off" force it."""
    from sapd.stages.train import shared_prompt_group
    cpu, elsewhere = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2, device="meta")
    assert shared_prompt_group("auto", cpu, 8) == 8 and shared_prompt_group("auto", elsewhere, 8) is None
    assert shared_prompt_group("on", elsewhere, 8) == 8 and shared_prompt_group("off", cpu, 8) is None
    assert shared_prompt_group("on", cpu, 1) is None  # one response: nothing to share
    assert shared_prompt_group("auto", cpu, 8, "deepspeed", 2) is None  # auto: the torch engine only
    assert shared_prompt_group("on", cpu, 8, "deepspeed", 3) == 8
