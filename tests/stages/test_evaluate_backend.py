"""Evaluation generates as the run does: the checkpoint loaded in the run's ``model.dtype`` with its
``sampling.backend`` — for the evaluation Job (``python -m sapd.jobs.evaluate --config``) from the run config,
for ``sapd evaluate --run`` from the run root's resolved config — and the result records both. (The vLLM
backend's run is in tests/vllm/test_vllm_evaluate.py, in the vLLM environment.)"""

from __future__ import annotations

import json

import pytest
import torch
import yaml

from sapd import checkpoints, layout, storage
from sapd.config import config_from_dict, write_run_config
from sapd.stages.build_prefixes import ensure_initial_checkpoint
from tests.pipeline_util import make_models, tiny_config


@pytest.fixture
def bf16_run(tmp_path):
    student, teacher = make_models(tmp_path / "models")
    raw = tiny_config(str(tmp_path / "run"), student, teacher, model={"dtype": "bfloat16"},
                      data={"benchmark": "textworld"}, sampling={"max_new_tokens": 8})
    cfg = config_from_dict(raw)
    write_run_config(cfg)
    ensure_initial_checkpoint(cfg, lambda s: None)
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(raw))
    return cfg, path


@pytest.fixture
def loaded_dtypes(monkeypatch):
    """The dtype of every model the evaluation loads (the stage's own load, observed)."""
    seen: list[torch.dtype] = []
    real = checkpoints.load_checkpoint_model

    def observed(*args, **kwargs):
        model = real(*args, **kwargs)
        seen.append(next(model.parameters()).dtype)
        return model

    monkeypatch.setattr(checkpoints, "load_checkpoint_model", observed)
    return seen


PANEL = ["--benchmark", "textworld", "--families", "simple", "--games-per-family", "1", "--horizon", "2"]


def test_evaluate_job_loads_the_run_dtype_and_backend(bf16_run, loaded_dtypes, tmp_path):
    from sapd.jobs.evaluate import main
    cfg, path = bf16_run
    assert main(["--config", str(path), "--no-progress", "--no-check", "--cache", str(tmp_path / "games"),
                 *PANEL[2:]]) == 0
    result = storage.read_json(storage.join(layout.evals_dir(cfg.run_root, 0), "textworld.json"))
    assert (result["dtype"], result["backend"]) == ("bfloat16", "hf")
    assert loaded_dtypes == [torch.bfloat16] and result["overall"]["episodes"] == 1


def test_sapd_evaluate_takes_them_from_the_run_root(bf16_run, loaded_dtypes, tmp_path, capsys):
    from sapd.cli import main
    cfg, _ = bf16_run
    assert main(["evaluate", "--run", cfg.run_root, "--checkpoint", "0", "--no-progress", "--cache",
                 str(tmp_path / "games"), *PANEL]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["checkpoint"] == 0
    result = storage.read_json(storage.join(layout.evals_dir(cfg.run_root, 0), "textworld.json"))
    assert (result["dtype"], result["backend"]) == ("bfloat16", "hf") and loaded_dtypes == [torch.bfloat16]


def test_an_unknown_backend_is_refused(bf16_run):
    from sapd.stages.evaluate import checkpoint_generator
    cfg, _ = bf16_run
    with pytest.raises(ValueError, match="sampling.backend: 'tgi' is not one of"):
        checkpoint_generator(cfg.run_root, 0, None, backend="tgi", dtype="float32")
