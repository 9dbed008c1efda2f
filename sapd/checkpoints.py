"""Checkpoints: HF-format model folders plus trainer state, committed by a marker written last.

``checkpoints/NNNNNN/model/`` is what ``AutoModelForCausalLM.from_pretrained`` loads (config,
safetensors, tokenizer); ``state/trainer.pt`` holds the optimizer, scheduler, RNG states and data
cursor; ``state/_COMMITTED`` (JSON with a fresh commit id) is written last. An uncommitted checkpoint
folder is leftover from a crash and is cleared before being written again.
"""

from __future__ import annotations

import io
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import torch

from sapd import layout, storage
from sapd.models.loading import load_causal_lm, resolve_model_dir


def is_committed(root: str, k: int) -> bool:
    return storage.exists(layout.checkpoint_marker(root, k))


def save_checkpoint(root: str, k: int, model, tokenizer, state: dict[str, Any] | None,
                    meta: dict[str, Any] | None = None) -> dict[str, Any]:
    """Write checkpoint ``k`` (model folder, trainer state) and commit it. Returns the marker."""
    if is_committed(root, k):
        raise RuntimeError(f"{layout.checkpoint_dir(root, k)} is already committed")
    storage.delete_prefix(layout.checkpoint_dir(root, k))
    with tempfile.TemporaryDirectory(prefix="sapd-ckpt-") as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        for f in sorted(Path(tmp).rglob("*")):
            if f.is_file():
                storage.write_file_from(f, storage.join(layout.checkpoint_model_dir(root, k),
                                                        f.relative_to(tmp).as_posix()))
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
