"""The student's distance to the teacher on the vLLM backend (vLLM's CPU build here), computed the way the HF
backend computes it — from the numbers the backend returns: the sampler's own log-probs, the teacher
``VLLMScorer``'s, and a ``VLLMScorer`` on the student's own engine for the recorded responses — and checked
against a direct fp32 HF full-softmax forward of both models over the same tokens. Then the teacher-scores
stage of a run whose config says vllm validates checkpoint 0 and commits it; its recorded-response figures
(no sampling in them) equal the HF backend's on the same run.

Run in the vLLM environment only (``.venv-vllm/bin/python -m pytest tests/vllm -p no:cacheprovider -q -o
addopts=""``): vLLM is imported at the top, so the wrong environment fails at collection.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import vllm  # noqa: F401  — fail at collection, never skip, where vLLM is absent

from sapd.config import config_from_dict
from sapd.data import validation
from sapd.models.generation import SamplingParams
from sapd.models.loading import load_causal_lm, load_tokenizer
from sapd.models.tiny import build_tiny_model
from sapd.models.vllm_backend import VLLMGenerator, VLLMScorer, make_llm
from sapd.stages.validation import distance_records, engine_sampler, engine_scorer, teacher_records
from tests.tokenizer_util import SAMPLE_DATA, build_test_tokenizer

pytestmark = pytest.mark.vllm

SHAPE = dict(hidden_size=128, heads=4, kv_heads=2, intermediate_size=256, layers=2)  # head_dim 32 (vLLM CPU)
TASKS = ["put a clean apple in the fridge", "find a pair of running shoes", "heat some egg and put it in the bin"]


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("vllm-distance")
    tok = build_test_tokenizer(root / "tokenizer")
    build_tiny_model(tok, root / "student", seed=0, **SHAPE)
    build_tiny_model(tok, root / "teacher", seed=1, **SHAPE)
    return root / "student", root / "teacher"


def _rows(tok) -> list[dict]:
    return [{"prefix_id": f"t{i}#0", "category": "pick" if i % 2 else "heat",
             "prompt": tok.apply_chat_template([{"role": "user", "content": f"Your task is to: {t}."}],
                                               tokenize=False, add_generation_prompt=True),
             "recorded_response": "<think>the desk first</think>\n<action>go to desk 1</action>",
             "recorded_action": "go to desk 1"} for i, t in enumerate(TASKS)]


def _hf_logp(model, prompt: list[int], response: list[int]) -> torch.Tensor:
    seq = torch.tensor([prompt + response])
    with torch.no_grad():
        logits = model(input_ids=seq).logits[0, len(prompt) - 1:-1].double()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(response)[:, None])[:, 0]


def test_the_vllm_distance_equals_a_direct_hf_computation(models):
    student_dir, teacher_dir = models
    tok = load_tokenizer(str(student_dir))
    kw = dict(dtype="float32", seed=0, max_model_len=512, kv_cache_memory_bytes=256 * 2**20)
    sampler = VLLMGenerator(make_llm(student_dir, **kw), tokenizer=tok)
    teacher = VLLMScorer(make_llm(teacher_dir, **kw))
    rows = _rows(tok)
    params = SamplingParams(n=4, temperature=1.0, top_p=1.0, max_new_tokens=12, stop=("</action>",), seed=7)
    student_scorer = engine_scorer(sampler, tok.pad_token_id)
    assert isinstance(student_scorer, VLLMScorer) and student_scorer.llm is sampler.llm  # no second engine
    records, _ = distance_records(rows, sampler, teacher, student_scorer, tok, "alfworld", params)
    samples = sampler.generate([r["prompt"] for r in rows], params)  # seeded per prompt: the same samples
    hf_s, hf_t = load_causal_lm(str(student_dir)), load_causal_lm(str(teacher_dir))
    for r, rec, group in zip(rows, records, samples):
        prompt = tok(r["prompt"], add_special_tokens=False)["input_ids"]
        direct = sum(float((_hf_logp(hf_s, prompt, s.token_ids) - _hf_logp(hf_t, prompt, s.token_ids)).sum())
                     for s in group)
        assert rec["tokens"] == sum(len(s.token_ids) for s in group) > 0
        assert rec["reverse_kl"] == pytest.approx(direct, abs=1e-3 * rec["tokens"]), r["prefix_id"]
        recorded = tok(r["recorded_response"], add_special_tokens=False)["input_ids"]
        assert rec["recorded_tokens"] == len(recorded)
        assert rec["recorded_student_logp"] == pytest.approx(float(_hf_logp(hf_s, prompt, recorded).sum()), abs=1e-3 * len(recorded))
        assert rec["recorded_teacher_logp"] == pytest.approx(float(_hf_logp(hf_t, prompt, recorded).sum()), abs=1e-3 * len(recorded))
    # the teacher samples through the engine it scores with
    teacher_sampler = engine_sampler(teacher, tok)
    assert isinstance(teacher_sampler, VLLMGenerator) and teacher_sampler.llm is teacher.llm
    theirs = teacher_records(rows, teacher_sampler, "alfworld", params)
    assert [t["samples"] for t in theirs] == [4, 4, 4]
    out = validation.summarize(records, theirs)
    assert out["overall"]["reverse_kl_per_token"]["value"] > 0 and set(out["by_category"]) == {"pick", "heat"}


def test_the_teacher_scores_stage_validates_with_the_runs_vllm_backend(models, tmp_path, monkeypatch):
    """A run config with ``sampling.backend: vllm``: teacher-scores round 0 validates checkpoint 0 through the
    stage's own vLLM engines and commits it; the recorded responses' figures equal the HF backend's."""
    from sapd.stages import build_prefixes, teacher_scores
    from sapd.stages.context import StageContext, Step, run_stage
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB: the default is sized for a serving machine
    student_dir, teacher_dir = models
    results = {}
    for backend in ("hf", "vllm"):
        root = str(tmp_path / backend)
        cfg = config_from_dict({
            "run_root": root, "data": {"input": str(SAMPLE_DATA / "alfworld_eto.json"), "format": "eto",
                                       "benchmark": "alfworld", "max_prompt_tokens": 2048},
            "model": {"student": str(student_dir), "teacher": str(teacher_dir)},
            "sampling": {"backend": backend, "group_size": 2, "max_new_tokens": 8},
            "train": {"rounds": 1, "trajectories_per_round": 1}, "validation": {"max_prefixes": 4, "group_size": 2}})
        ctx = StageContext(cfg, log=lambda s: None)
        run_stage(build_prefixes, ctx, Step("build-prefixes"))
        run_stage(teacher_scores, ctx, Step("teacher-scores", 0))
        results[backend] = validation.read(root, 0)
    hf, vl = results["hf"], results["vllm"]
    assert [r["prefix_id"] for r in vl["records"]] == [r["prefix_id"] for r in hf["records"]] and len(vl["records"]) == 4
    for a, b in zip(vl["records"], hf["records"]):
        assert a["recorded_tokens"] == b["recorded_tokens"]
        for key in ("recorded_student_logp", "recorded_teacher_logp"):
            assert a[key] == pytest.approx(b[key], abs=1e-3 * a["recorded_tokens"]), (a["prefix_id"], key)
        assert a["samples"] == 2 and a["tokens"] > 0
    assert vl["overall"]["teacher_action_match"]["value"] is not None and len(vl["teacher_records"]) == 4
