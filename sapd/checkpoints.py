"""Checkpoints: HF-format model folders plus trainer state, committed by a marker written last.

``checkpoints/NNNNNN/model/`` is what ``AutoModelForCausalLM.from_pretrained`` loads (config,
safetensors shards with their index, tokenizer with its chat template); ``state/trainer.pt`` holds
the optimizer, scheduler, RNG states and data cursor; ``state/_COMMITTED`` (JSON with a fresh commit
id) is written last. An uncommitted checkpoint folder is leftover from a crash and is cleared before
being written again.

Weights are streamed shard by shard (at most ``max_shard_bytes`` each): under ZeRO-3 every rank gathers
one shard's parameters at a time and rank 0 writes it straight to storage, so no process ever holds the
whole model or stages it on local disk (the scratch it needs is one shard).
"""

from __future__ import annotations

import contextlib
import io
import json
import shutil
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ContextManager

import torch

from sapd import layout, storage
from sapd.models.loading import load_causal_lm, model_folder, resolve_model_dir


def is_committed(root: str, k: int) -> bool:
    return storage.exists(layout.checkpoint_marker(root, k))


MAX_SHARD_BYTES = 2 * 1024**3
"""Largest safetensors shard written (HF's loader reads any number of shards through the index)."""

Gather = Callable[[list[torch.Tensor]], ContextManager[Any]]
"""Makes the given (possibly partitioned) parameters whole on every rank for the ``with`` block."""


@dataclass(frozen=True)
class _Entry:
    name: str
    tensor: torch.Tensor
    nbytes: int


def _weight_entries(model) -> list[_Entry]:
    """What ``save_pretrained`` would write: parameters (a tied weight once, under its first name) and the
    persistent buffers, with their full sizes (ZeRO-3 keeps the real shape in ``ds_shape``)."""
    persistent = set(model.state_dict().keys())
    out: list[_Entry] = []
    for name, p in model.named_parameters():  # named_parameters drops the second name of a tied weight
        numel = int(getattr(p, "ds_numel", p.numel()))
        out.append(_Entry(name, p, numel * p.element_size()))
    for name, b in model.named_buffers():
        if name in persistent:
            out.append(_Entry(name, b, b.numel() * b.element_size()))
    return out


def _plan_shards(entries: list[_Entry], max_shard_bytes: int) -> list[list[_Entry]]:
    shards: list[list[_Entry]] = [[]]
    size = 0
    for e in entries:
        if shards[-1] and size + e.nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(e)
        size += e.nbytes
    return shards


def _no_gather(params: list[torch.Tensor]) -> ContextManager[Any]:
    return contextlib.nullcontext()


def write_model_folder(uri: str, model, tokenizer, *, gather: Gather = _no_gather, is_main: bool = True,
                       max_shard_bytes: int = MAX_SHARD_BYTES) -> None:
    """A self-contained HF model folder at ``uri`` (config, generation config, tokenizer with its chat
    template, safetensors shards and their index), written shard by shard. With several ranks every rank
    calls this (``gather`` is a collective); only ``is_main`` writes."""
    entries = _weight_entries(model)
    shards = _plan_shards(entries, max_shard_bytes)
    names = ["model.safetensors"] if len(shards) == 1 else \
        [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    with tempfile.TemporaryDirectory(prefix="sapd-ckpt-") as tmp:
        if is_main:
            model.config.save_pretrained(tmp)
            if getattr(model, "generation_config", None) is not None and model.can_generate():
                model.generation_config.save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)
            if len(shards) > 1:
                index = {"metadata": {"total_size": sum(e.nbytes for e in entries)},
                         "weight_map": {e.name: names[i] for i, shard in enumerate(shards) for e in shard}}
                Path(tmp, "model.safetensors.index.json").write_text(json.dumps(index, indent=2), encoding="utf-8")
            for f in sorted(Path(tmp).rglob("*")):
                if f.is_file():
                    storage.write_file_from(f, storage.join(uri, f.relative_to(tmp).as_posix()))
        for fname, shard in zip(names, shards, strict=True):
            with gather([e.tensor for e in shard]):
                tensors = {e.name: e.tensor.detach().to("cpu").contiguous().clone() for e in shard} if is_main else {}
            if is_main:
                _write_shard(tensors, Path(tmp, fname), storage.join(uri, fname))
            del tensors


def _write_shard(tensors: dict[str, torch.Tensor], scratch: Path, uri: str) -> None:
    from safetensors.torch import save_file

    save_file(tensors, str(scratch), metadata={"format": "pt"})
    try:
        storage.write_file_from(scratch, uri)
    finally:
        scratch.unlink(missing_ok=True)


def save_checkpoint(root: str, k: int, model, tokenizer, state: dict[str, Any] | None,
                    meta: dict[str, Any] | None = None, *, gather: Gather = _no_gather, is_main: bool = True,
                    max_shard_bytes: int = MAX_SHARD_BYTES) -> dict[str, Any] | None:
    """Write checkpoint ``k`` (model folder, trainer state) and commit it → the marker (``None`` on the
    ranks other than the main one, which only take part in ``gather``)."""
    if is_main:
        if is_committed(root, k):
            raise RuntimeError(f"{layout.checkpoint_dir(root, k)} is already committed")
        storage.delete_prefix(layout.checkpoint_dir(root, k))
    write_model_folder(layout.checkpoint_model_dir(root, k), model, tokenizer, gather=gather, is_main=is_main,
                       max_shard_bytes=max_shard_bytes)
    if not is_main:
        return None
    if state is not None:
        buf = io.BytesIO()
        torch.save(state, buf)
        storage.write_bytes(storage.join(layout.checkpoint_state_dir(root, k), "trainer.pt"), buf.getvalue())
    marker = {"checkpoint": k, "commit_id": uuid.uuid4().hex, "has_state": state is not None,
              "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), **(meta or {})}
    storage.write_json(layout.checkpoint_marker(root, k), marker)
    return marker


def read_marker(root: str, k: int) -> dict[str, Any]:
    if not is_committed(root, k):
        raise FileNotFoundError(f"{layout.checkpoint_dir(root, k)}: not a committed checkpoint")
    return storage.read_json(layout.checkpoint_marker(root, k))


def checkpoint_model_path(root: str, k: int) -> Path:
    """A local folder holding checkpoint ``k``'s model (synced from S3 into the cache, keyed by the
    commit id so a re-created run never reuses a stale copy)."""
    marker = read_marker(root, k)
    uri = layout.checkpoint_model_dir(root, k)
    if storage.is_s3(uri):
        return resolve_model_dir(uri, cache_key=marker["commit_id"])
    return resolve_model_dir(uri)


def load_checkpoint_model(root: str, k: int, dtype: str = "float32", device: str = "cpu", trainable: bool = False):
    return load_causal_lm(str(checkpoint_model_path(root, k)), dtype=dtype, device=device,  # type: ignore[arg-type]
                          trainable=trainable)


def load_trainer_state(root: str, k: int) -> dict[str, Any] | None:
    if not read_marker(root, k).get("has_state"):
        return None
    data = storage.read_bytes(storage.join(layout.checkpoint_state_dir(root, k), "trainer.pt"))
    return torch.load(io.BytesIO(data), map_location="cpu", weights_only=False)


def export_model(source: str, out: str, *, checkpoint: int | None = None) -> str:
    """Copy a run root's model (checkpoint ``checkpoint``, default the newest committed one) — or a model
    folder — to ``out`` as a self-contained Hugging Face folder (weights, config, tokenizer, chat template)
    that ``AutoModelForCausalLM.from_pretrained`` loads. A local ``out`` is written beside itself and
    renamed into place, replacing an earlier export; returns ``out``."""
    if checkpoint is None:
        src = model_folder(source)
    elif not is_committed(source, checkpoint):
        raise FileNotFoundError(f"{source}: checkpoint {checkpoint} is not committed (committed: "
                                f"{layout.committed_checkpoints(source) or 'none'}); pick one of those")
    else:
        src = layout.checkpoint_model_dir(source, checkpoint)
    files = storage.list_files(src)
    if not any(f.endswith("/config.json") for f in files):
        raise FileNotFoundError(f"{src}: no config.json; not a model folder or a sapd run root")
    rel = [f[len(src.rstrip("/")) + 1:] for f in files]
    if storage.is_s3(out):
        for name, f in zip(rel, files):
            dest = storage.join(out, name)
            if storage.is_s3(f):  # streamed through a local file: weights can be larger than memory
                with tempfile.TemporaryDirectory(prefix="sapd-export-") as scratch:
                    storage.download_to(f, Path(scratch) / "file")
                    storage.write_file_from(str(Path(scratch) / "file"), dest)
            else:
                storage.write_file_from(str(Path(f.removeprefix("file://"))), dest)
        return out
    final = Path(out.removeprefix("file://"))
    if final.resolve() == Path(src.removeprefix("file://")).resolve():
        return out
    tmp = final.with_name(f".{final.name}.export-{uuid.uuid4().hex[:8]}")
    for name, f in zip(rel, files):
        (tmp / name).parent.mkdir(parents=True, exist_ok=True)
        storage.download_to(f, tmp / name)
    if final.exists():
        if not (final / "config.json").is_file():
            raise FileExistsError(f"{final}: exists and is not a model folder; choose another destination")
        old = final.with_name(f".{final.name}.old-{uuid.uuid4().hex[:8]}")
        final.rename(old)
        tmp.rename(final)
        shutil.rmtree(old)
    else:
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp.rename(final)
    return out
