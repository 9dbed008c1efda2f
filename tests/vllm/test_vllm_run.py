"""``sapd run`` with ``sampling.backend: vllm`` for 3 rounds, each vLLM engine in its own process (vLLM's
default, as ``sapd run`` and the pods run it; tests/vllm/conftest.py): the student engine stays up and takes
checkpoints 1 and 2 in place through sapd's worker extension (the weight sync that once failed at round 1 in
the engine's own process), and each round was sampled by its own checkpoint — the sampler's log-probs of
every response of rounds 1 and 2 equal an HF forward of that checkpoint's weights.

Run in the vLLM environment only (``.venv-vllm/bin/python -m pytest tests/vllm -p no:cacheprovider -q -o
addopts=""``): vLLM is imported at the top, so the wrong environment fails at collection."""

from __future__ import annotations

import os

import pytest
import torch
import vllm  # noqa: F401  — fail at collection, never skip, where vLLM is absent

from sapd import checkpoints
from sapd.config import config_from_dict
from sapd.data.scored import read_scored, scored_prefixes
from sapd.models.tiny import build_tiny_model
from sapd.run.local import run_pipeline
from tests.tokenizer_util import SAMPLE_DATA, build_test_tokenizer

pytestmark = pytest.mark.vllm

SHAPE = dict(hidden_size=128, heads=4, kv_heads=2, intermediate_size=256, layers=2)  # head_dim 32 (vLLM CPU)


def _hf_logp(model, prompt: list[int], response: list[int]) -> list[float]:
    seq = torch.tensor([prompt + response])
    with torch.no_grad():
        logits = model(input_ids=seq).logits[0, len(prompt) - 1:-1].double()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(response)[:, None])[:, 0].tolist()


def test_sapd_run_with_vllm_engines_in_their_own_processes_trains_three_rounds(tmp_path, monkeypatch):
    assert os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "1"  # the engines run as the pods run them
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB: the default is sized for a serving machine
    tok = build_test_tokenizer(tmp_path / "tokenizer")
    build_tiny_model(tok, tmp_path / "student", seed=0, **SHAPE)
    build_tiny_model(tok, tmp_path / "teacher", seed=1, **SHAPE)
    root = str(tmp_path / "run")
    cfg = config_from_dict({
        "run_root": root, "data": {"input": str(SAMPLE_DATA / "alfworld_eto.json"), "format": "eto",
                                   "benchmark": "alfworld", "max_prompt_tokens": 2048},
        "model": {"student": str(tmp_path / "student"), "teacher": str(tmp_path / "teacher")},
        "sampling": {"backend": "vllm", "group_size": 2, "max_new_tokens": 8},
        "train": {"rounds": 3, "trajectories_per_round": 1, "minibatch_prefixes": 4, "micro_batch_prefixes": 2,
                  "lr": 1e-2},
        "validation": {"every_rounds": 0}})
    lines: list[str] = []
    result = run_pipeline(cfg, log=lines.append, show_progress=False)
    assert result["checkpoints"] == [0, 1, 2, 3]
    # one engine start per model for the whole run; checkpoints 1 and 2 reached the student engine in place
    assert sum(line.startswith("model load: student checkpoint 0 for sampling") for line in lines) == 1, lines
    assert sum(line.startswith("model load: teacher") for line in lines) == 1, lines
    for k in (1, 2):
        assert any(line.startswith(f"weights: student checkpoint {k} in place") for line in lines), lines
    # the trainer was loaded once and kept (model, optimizer state) from round to round
    assert sum(line.startswith("model load: student checkpoint") and "for training" in line for line in lines) == 1
    # each round was sampled by its own checkpoint: the sampler's log-probs are that checkpoint's
    for k in (1, 2):
        model = checkpoints.load_checkpoint_model(root, k, "float32", "cpu")
        groups = scored_prefixes(read_scored(root, k))
        assert groups and all(sp.sampler_logp_G_T for sp in groups)
        for sp in groups:
            for response, sampled in zip(sp.responses_G_T, sp.sampler_logp_G_T or []):
                assert sampled == pytest.approx(_hf_logp(model, sp.prompt, response), abs=1e-3), (k, sp.prefix_id)
    # and the checkpoints that sampled differ (so a stale engine could not pass the check above)
    one, two = (checkpoints.load_checkpoint_model(root, k, "float32", "cpu").state_dict() for k in (1, 2))
    assert any(not torch.equal(one[name], two[name]) for name in one)
