"""Checkpoints are written shard by shard: every shard's parameters are gathered on their own (what
ZeRO-3 needs to never hold the whole model), the folder is what ``save_pretrained`` would write (same
tensor names and values, the tokenizer with its chat template), and plain transformers loads it."""

import json
from contextlib import nullcontext
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from sapd import checkpoints
from sapd.models.loading import load_tokenizer
from sapd.models.tiny import build_tiny_model
from tests.tokenizer_util import build_test_tokenizer


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            for key in st.keys():
                out[key] = st.get_tensor(key)
    return out


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_sharded_checkpoint_matches_save_pretrained_and_loads(tmp_path, arch):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tok = build_test_tokenizer(tmp_path / "tok")
    model = build_tiny_model(tok, tmp_path / "src", arch=arch, seed=3)
    tokenizer = load_tokenizer(str(tmp_path / "src"))
    sizes = [p.numel() * p.element_size() for p in model.parameters()]
    max_shard = max(sizes)  # several shards, none forced over the limit by a single tensor
    gathered: list[int] = []

    def gather(params):
        gathered.append(sum(p.numel() * p.element_size() for p in params))
        return nullcontext()

    root = str(tmp_path / "run")
    marker = checkpoints.save_checkpoint(root, 1, model, tokenizer, {"round": 0}, {"round": 0},
                                         gather=gather, max_shard_bytes=max_shard)
    assert marker is not None and checkpoints.is_committed(root, 1)
    folder = checkpoints.checkpoint_model_path(root, 1)
    shards = sorted(f.name for f in folder.glob("*.safetensors"))
    assert len(shards) == len(gathered) >= 3, (shards, gathered)
    assert all(b <= max_shard for b in gathered), gathered
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    assert sorted(set(index["weight_map"].values())) == shards
    assert index["metadata"]["total_size"] == sum(gathered)

    # the same tensors as save_pretrained writes (the tied head once, under the embedding's name)
    model.save_pretrained(str(tmp_path / "reference"))
    ref, ours = _tensors(tmp_path / "reference"), _tensors(folder)
    assert ours.keys() == ref.keys() and set(index["weight_map"]) == set(ref)
    for name in ref:
        torch.testing.assert_close(ours[name], ref[name], rtol=0, atol=0, msg=name)

    # self-contained: plain transformers loads model and tokenizer (chat template included) from it
    loaded = AutoModelForCausalLM.from_pretrained(str(folder))
    ids = torch.tensor([tokenizer.encode("look around")])
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits, rtol=0, atol=0)
    assert AutoTokenizer.from_pretrained(str(folder)).chat_template == tokenizer.chat_template
    assert checkpoints.load_trainer_state(root, 1) == {"round": 0}


def test_other_ranks_only_take_part_in_the_gathers(tmp_path):
    tok = build_test_tokenizer(tmp_path / "tok")
    model = build_tiny_model(tok, tmp_path / "src")
    calls: list[int] = []

    def gather(params):
        calls.append(len(params))
        return nullcontext()

    root = str(tmp_path / "run")
    assert checkpoints.save_checkpoint(root, 1, model, load_tokenizer(str(tmp_path / "src")), None,
                                       gather=gather, is_main=False, max_shard_bytes=10_000) is None
    assert len(calls) > 1 and sum(calls) == len(list(model.parameters()))  # same collectives as rank 0
    assert not Path(root).exists()  # and nothing written


def test_run_root_config_compared_as_resolved_config(tmp_path):
    """A committed config written before a key existed (the key at its default) resumes; a changed
    worker count resumes; a changed learning rate is refused, naming the key."""
    import yaml

    from sapd import layout
    from sapd.config import ConfigError, config_from_dict, dump_config, write_run_config
    root = str(tmp_path / "run")
    cfg = config_from_dict({"run_root": root, "train": {"lr": 1e-4}})
    old = yaml.safe_load(dump_config(cfg))
    del old["train"]["checkpoint_shard_mb"]  # as an older sapd wrote it
    Path(layout.config_uri(root)).parent.mkdir(parents=True)
    Path(layout.config_uri(root)).write_text(yaml.safe_dump(old))
    write_run_config(cfg)
    write_run_config(config_from_dict({"run_root": root, "train": {"lr": 1e-4}, "workers": 4}))
    with pytest.raises(ConfigError, match=r"different resolved config: train\.lr"):
        write_run_config(config_from_dict({"run_root": root, "train": {"lr": 3e-4}}))


def test_a_run_root_stands_for_its_newest_committed_model(tmp_path):
    """What one command writes is what the next takes: a run root (e.g. the demo's ``models/teacher``)
    given where a model folder is expected is its newest committed checkpoint's self-contained model."""
    from sapd import layout, storage
    from sapd.models.loading import load_causal_lm, model_folder
    tok = build_test_tokenizer(tmp_path / "tok")
    root = str(tmp_path / "run")
    storage.write_text(layout.config_uri(root), "run_root: run\n")
    with pytest.raises(FileNotFoundError, match="run root without a committed checkpoint"):
        load_tokenizer(root)
    tokenizer = load_tokenizer(str(tmp_path / "tok"))
    for k, seed in ((0, 1), (1, 2)):
        model = build_tiny_model(tok, tmp_path / f"m{k}", seed=seed)
        checkpoints.save_checkpoint(root, k, model, tokenizer, None)
    # a half-written checkpoint 2 (no commit marker) is not taken
    storage.write_text(storage.join(layout.checkpoint_model_dir(root, 2), "config.json"), "{}")
    assert model_folder(root) == layout.checkpoint_model_dir(root, 1)
    assert model_folder(str(tmp_path / "m0")) == str(tmp_path / "m0")  # a model folder is itself
    loaded = load_causal_lm(root)
    want = _tensors(Path(layout.checkpoint_model_dir(root, 1)))
    got = dict(loaded.state_dict())
    assert all(torch.equal(got[k], v) for k, v in want.items() if k in got)
    assert not torch.equal(got["model.embed_tokens.weight"], _tensors(tmp_path / "m0")["model.embed_tokens.weight"])
    assert load_tokenizer(root).chat_template == tokenizer.chat_template
