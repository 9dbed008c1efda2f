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


# ---------------------------------------------------------------------------------------------------
# every file of a checkpoint is checked against the digest its commit recorded


def _commit_with_optimizer(tmp_path: Path, root: str) -> tuple[torch.nn.Module, dict]:
    """Checkpoint 1 of ``root``: a tiny model in two safetensors shards, trainer state and AdamW's state
    after one step (DCP files)."""
    tok = build_test_tokenizer(tmp_path / "tok")
    model = build_tiny_model(tok, tmp_path / "src", seed=3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.tensor([[1, 2, 3, 4]])).logits.square().mean().backward()
    opt.step()
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    marker = checkpoints.save_checkpoint(root, 1, model, load_tokenizer(str(tmp_path / "src")), {"round": 0},
                                         {"round": 0}, max_shard_bytes=total // 2 + 1,
                                         optimizer=checkpoints.torch_optimizer_shard(opt))
    assert marker is not None
    return model, marker


@pytest.fixture(params=["local", "s3"])
def run_root(request, tmp_path) -> str:
    if request.param == "local":
        return str(tmp_path / "run")
    return request.getfixturevalue("s3_storage") + "/run"


def test_the_commit_records_every_file_and_loading_checks_them(tmp_path, run_root, monkeypatch):
    import hashlib

    from sapd import layout, storage
    monkeypatch.setenv("SAPD_CACHE_DIR", str(tmp_path / "cache"))
    model, marker = _commit_with_optimizer(tmp_path, run_root)
    ckpt = layout.checkpoint_dir(run_root, 1)
    on_disk = {u[len(ckpt) + 1:] for u in storage.list_files(ckpt)} - {"state/_COMMITTED"}
    assert set(marker["files"]) == on_disk
    assert {"model/config.json", "model/model.safetensors.index.json", "model/tokenizer.json", "state/trainer.pt",
            "state/optimizer/.metadata", "state/optimizer/__0_0.distcp", "state/optimizer/_ITEM_DIGESTS.json"} <= on_disk
    assert sum(name.endswith(".safetensors") for name in on_disk) >= 2
    for name, recorded in marker["files"].items():
        data = storage.read_bytes(storage.join(ckpt, name))
        assert (recorded["bytes"], recorded["sha256"]) == (len(data), hashlib.sha256(data).hexdigest()), name
    # the optimizer's data file: one digest per item DCP wrote (exp_avg and exp_avg_sq of every parameter),
    # each over exactly that item's bytes, in a file beside it (recorded in the marker like the others)
    data_file = marker["files"]["state/optimizer/__0_0.distcp"]
    items = json.loads(storage.read_bytes(storage.join(ckpt, "state/optimizer/_ITEM_DIGESTS.json")))
    assert set(items) == {"__0_0.distcp"} and "segments" not in data_file
    data = storage.read_bytes(storage.join(ckpt, "state/optimizer/__0_0.distcp"))
    starts = [s[0] for s in items["__0_0.distcp"]] + [data_file["bytes"]]
    assert len(items["__0_0.distcp"]) == 2 * len(list(model.parameters()))
    assert all(hashlib.sha256(data[a:b]).hexdigest() == s[1]
               for a, b, s in zip(starts, starts[1:], items["__0_0.distcp"]))
    # and what is loaded passes the checks
    loaded = checkpoints.load_checkpoint_model(run_root, 1)
    assert all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), model.state_dict().values()))
    assert checkpoints.load_trainer_state(run_root, 1)["round"] == 0
    state = checkpoints.consolidated_optimizer_state(run_root, 1)
    assert state is not None and len(state["state"]) == len(list(model.parameters()))


@pytest.mark.parametrize("victim", ["model/SHARD", "model/config.json", "state/trainer.pt",
                                    "state/optimizer/__0_0.distcp", "state/optimizer/.metadata",
                                    "state/optimizer/_ITEM_DIGESTS.json"])
@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_a_damaged_checkpoint_file_is_refused_naming_it(tmp_path, victim, damage):
    from sapd import layout
    from sapd.storage import CorruptObject
    root = str(tmp_path / "run")
    _commit_with_optimizer(tmp_path, root)
    if victim == "model/SHARD":
        victim = "model/" + next(Path(layout.checkpoint_model_dir(root, 1)).glob("model-00001-*.safetensors")).name
    path = Path(layout.checkpoint_dir(root, 1)) / victim
    data = bytearray(path.read_bytes())
    if damage == "flip":
        data[len(data) // 2] ^= 0x01
    else:
        del data[len(data) * 2 // 3:]
    path.write_bytes(bytes(data))
    load = {"model": lambda: checkpoints.checkpoint_model_path(root, 1),
            "state/trainer.pt": lambda: checkpoints.load_trainer_state(root, 1),
            "state/optimizer": lambda: checkpoints.consolidated_optimizer_state(root, 1)}
    with pytest.raises(CorruptObject) as info:
        load[next(key for key in load if victim.startswith(key))]()
    assert str(path) in str(info.value) and "\n" not in str(info.value)
    with pytest.raises(CorruptObject, match=victim.split("/")[-1]):  # export copies nothing it cannot vouch for
        checkpoints.export_model(root, str(tmp_path / "exported"), checkpoint=1) if victim.startswith("model/") \
            else checkpoints.load_trainer_state(root, 1) if victim == "state/trainer.pt" \
            else checkpoints.consolidated_optimizer_state(root, 1)
    assert not (tmp_path / "exported").exists()


def test_checkpoint_0s_fp32_master_is_recorded_and_checked_like_every_file(tmp_path):
    """A bf16 run's checkpoint 0 holds the student's fp32 weights as the optimizer's master (no moments):
    its files are in the marker, one item digest per parameter, and a damaged master is refused."""
    from sapd import layout, storage
    from sapd.storage import CorruptObject
    root = str(tmp_path / "run")
    tok = build_test_tokenizer(tmp_path / "tok")
    model = build_tiny_model(tok, tmp_path / "src", seed=5)
    master = checkpoints.master_shard(model)
    weights = [p.detach().to(torch.float32).clone() for p in model.parameters()]
    model.to(torch.bfloat16)
    marker = checkpoints.save_checkpoint(root, 0, model, load_tokenizer(str(tmp_path / "src")), None,
                                         optimizer=master)
    assert marker is not None and marker["optimizer"] == checkpoints.OPTIMIZER_FORMAT
    assert {"state/optimizer/.metadata", "state/optimizer/__0_0.distcp", "state/optimizer/_ITEM_DIGESTS.json",
            "state/trainer.pt"} <= set(marker["files"])
    items = json.loads(storage.read_bytes(storage.join(checkpoints.optimizer_dir(root, 0), checkpoints.ITEM_DIGESTS)))
    assert len(items["__0_0.distcp"]) == len(weights)  # the master of every parameter, nothing else
    state = checkpoints.consolidated_optimizer_state(root, 0)
    assert state is not None
    assert all(torch.equal(state["state"][i][checkpoints.MASTER_KEY].view(w.shape), w) for i, w in enumerate(weights))
    path = Path(checkpoints.optimizer_dir(root, 0)) / "__0_0.distcp"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptObject) as info:
        checkpoints.consolidated_optimizer_state(root, 0)
    assert str(path) in str(info.value) and layout.checkpoint_marker(root, 0) in str(info.value)


def test_a_file_the_commit_does_not_list_is_refused(tmp_path):
    from sapd import layout
    from sapd.storage import CorruptObject
    root = str(tmp_path / "run")
    _commit_with_optimizer(tmp_path, root)
    (Path(layout.checkpoint_model_dir(root, 1)) / "model.safetensors").write_bytes(b"what from_pretrained would pick")
    with pytest.raises(CorruptObject, match=r"model\.safetensors: not one of the files .*_COMMITTED records"):
        checkpoints.load_checkpoint_model(root, 1)


def test_a_checkpoint_committed_before_digests_loads_unverified(tmp_path, capsys):
    from sapd import layout, storage
    root = str(tmp_path / "run")
    model, marker = _commit_with_optimizer(tmp_path, root)
    del marker["files"]  # as an earlier sapd committed it
    storage.write_json(layout.checkpoint_marker(root, 1), marker)
    loaded = checkpoints.load_checkpoint_model(root, 1)
    assert all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), model.state_dict().values()))
    assert checkpoints.consolidated_optimizer_state(root, 1) is not None
    err = capsys.readouterr().err
    assert err.count(f"checkpoint 1 of {root} was committed without file digests (by an earlier sapd): its files "
                     "are loaded unverified") == 1


@pytest.mark.integration
def test_on_s3_a_damaged_copy_is_fetched_again_and_a_damaged_object_refused(tmp_path, s3_storage, monkeypatch):
    from sapd import layout, storage
    from sapd.models import loading
    from sapd.storage import CorruptObject
    monkeypatch.setenv("SAPD_CACHE_DIR", str(tmp_path / "cache"))
    root = s3_storage + "/run"
    _commit_with_optimizer(tmp_path, root)
    copy = checkpoints.checkpoint_model_path(root, 1)  # fetched into the cache, checked
    shard = next(copy.glob("model-00001-*.safetensors"))
    good = shard.read_bytes()
    shard.write_bytes(good[:100])  # the cache's copy damaged (a disk, a person)
    loading._verified.clear()  # as a new process
    assert checkpoints.checkpoint_model_path(root, 1) == copy and shard.read_bytes() == good  # fetched again
    uri = storage.join(layout.checkpoint_model_dir(root, 1), shard.name)
    storage.write_bytes(uri, good[:-1] + bytes([good[-1] ^ 1]))  # the object itself damaged
    shard.unlink()
    (copy / ".sapd-sync-complete").unlink()  # a cache without it: fetched from S3 again
    loading._verified.clear()
    with pytest.raises(CorruptObject, match=f"^{uri} \\(its copy {copy}\\): .* bytes with SHA-256"):
        checkpoints.checkpoint_model_path(root, 1)
