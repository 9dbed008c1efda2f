"""What a user sees as a model is a plain Hugging Face folder: the checkpoint ``model/`` folders training
writes, and what ``sapd export`` (the demo's and the study's ``models/<name>``) copies out of a run root,
load with ``AutoModelForCausalLM`` / ``AutoTokenizer`` alone and give sapd's own loader's logits."""

from __future__ import annotations

import pytest
import torch
import yaml

from sapd import layout
from sapd.cli import main
from sapd.config import config_from_dict
from sapd.models.loading import load_causal_lm, load_tokenizer
from sapd.run.local import run_pipeline
from tests.pipeline_util import make_models, tiny_config


@pytest.fixture(scope="module")
def run_root(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("export")
    student, teacher = make_models(tmp / "models")
    root = tmp / "run"
    cfg = config_from_dict(tiny_config(str(root), student, teacher, train={"rounds": 1}))
    run_pipeline(cfg, log=lambda s: None, show_progress=False)
    assert layout.committed_checkpoints(str(root)) == [0, 1]
    return root


def _plain_equals_sapd(folder) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tok = AutoTokenizer.from_pretrained(folder)
    text = tok.apply_chat_template([{"role": "user", "content": "go north"}], tokenize=False, add_generation_prompt=True)
    assert "go north" in text
    ids = tok(text, return_tensors="pt").input_ids
    plain = AutoModelForCausalLM.from_pretrained(folder).eval()
    ours = load_causal_lm(str(folder)).eval()
    with torch.no_grad():
        a, b = plain(ids).logits, ours(ids).logits
    assert a.shape[-1] >= len(load_tokenizer(str(folder))) and torch.allclose(a, b, atol=1e-5)


def test_training_checkpoints_are_plain_hf_folders(run_root):
    for k in (0, 1):
        _plain_equals_sapd(layout.checkpoint_model_dir(str(run_root), k))


def test_export_copies_the_newest_or_a_given_checkpoint(run_root, tmp_path, capsys):
    out = tmp_path / "models" / "student"
    assert main(["export", str(run_root), str(out)]) == 0
    assert "checkpoint" in capsys.readouterr().out
    _plain_equals_sapd(out)
    from safetensors.torch import load_file

    def weights(folder) -> dict[str, torch.Tensor]:
        return {k: v for f in sorted(folder.glob("*.safetensors")) for k, v in load_file(f).items()}
    final = weights(type(out)(layout.checkpoint_model_dir(str(run_root), 1)))
    assert all(torch.equal(final[k], v) for k, v in weights(out).items()) and set(final) == set(weights(out))
    assert main(["export", str(run_root), str(out), "--checkpoint", "0"]) == 0  # replaces the earlier export
    first = weights(type(out)(layout.checkpoint_model_dir(str(run_root), 0)))
    assert set(weights(out)) == set(first) and all(torch.equal(first[k], v) for k, v in weights(out).items())
    assert [p.name for p in out.parent.iterdir()] == ["student"]  # no temp folders left behind
    assert main(["export", str(run_root), str(tmp_path / "x"), "--checkpoint", "7"]) == 2
    assert "checkpoint 7 is not committed" in capsys.readouterr().err


def test_an_exported_folder_and_its_run_root_both_serve_as_model_paths(run_root, tmp_path):
    out = tmp_path / "teacher"
    main(["export", str(run_root), str(out)])
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump(tiny_config(str(tmp_path / "r"), str(out), str(run_root))))
    assert main(["check", str(cfg)]) == 0


def test_a_run_root_as_a_model_path_is_pinned_and_logged(run_root, tmp_path):
    from sapd import checkpoints
    lines: list[str] = []
    cfg = config_from_dict(tiny_config(str(tmp_path / "r"), str(run_root), str(run_root), train={"rounds": 1}))
    run_pipeline(cfg, log=lines.append, show_progress=False)
    newest = layout.checkpoint_model_dir(str(run_root), 1)
    assert f"model.student: {run_root} → checkpoint 1 ({newest})" in lines, lines
    assert f"model.teacher: {run_root} → checkpoint 1 ({newest})" in lines, lines
    marker = checkpoints.read_marker(str(tmp_path / "r"), 0)
    assert marker["source"] == str(run_root) and marker["resolved"] == newest
    from sapd.data import shards
    manifest = shards.read_manifest(layout.scored_dir(str(tmp_path / "r"), 0))
    assert manifest is not None and manifest["teacher"] == newest  # the round records the teacher that scored it


@pytest.mark.integration
def test_export_to_and_from_s3_and_between_buckets(run_root, tmp_path, s3_storage):
    """On the real SeaweedFS: a local checkpoint exported to S3, that S3 folder exported to another S3
    prefix (streamed through a local file), and back to a local folder: the same files, byte for byte,
    and the result loads in plain transformers."""
    from sapd import storage
    src = layout.checkpoint_model_dir(str(run_root), 1)
    first, second = f"{s3_storage}/models/a", f"{s3_storage}/models/b"
    assert main(["export", str(run_root), first]) == 0
    assert main(["export", first, second]) == 0
    out = tmp_path / "back"
    assert main(["export", second, str(out)]) == 0
    local = {p.relative_to(src).as_posix(): p.read_bytes() for p in type(tmp_path)(src).rglob("*") if p.is_file()}
    on_s3 = {f[len(second) + 1:] for f in storage.list_files(second)}
    assert on_s3 == set(local) and "model.safetensors" in on_s3 and "config.json" in on_s3
    assert {p.relative_to(out).as_posix(): p.read_bytes() for p in out.rglob("*") if p.is_file()} == local
    _plain_equals_sapd(out)
