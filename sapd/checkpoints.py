"""Checkpoints: HF-format model folders plus trainer state, committed by a marker written last.

``checkpoints/NNNNNN/model/`` is what ``AutoModelForCausalLM.from_pretrained`` loads (config,
safetensors shards with their index, tokenizer with its chat template); ``state/`` holds the sharded
optimizer state and ``trainer.pt`` (below); ``state/_COMMITTED`` (JSON with a fresh commit id) is written
last (every file: docs/reference/run-root.md). An uncommitted checkpoint folder is leftover from a crash
and is cleared before being written again.

Weights are streamed shard by shard (at most ``max_shard_bytes`` each): under ZeRO-3 every rank gathers
one shard's parameters at a time and rank 0 writes it straight to storage, so no process ever holds the
whole model or stages it on local disk (the scratch it needs is one shard).

**Optimizer state is sharded** (``state/optimizer/``): every rank writes the part of the AdamW state it
holds (``exp_avg``, ``exp_avg_sq``) as its own file and reads back only what it holds after a restart,
so no rank ever gathers the whole state — for an 8B student with AdamW that is ~64 GB in fp32. The
format is torch's distributed checkpoint (DCP): a ``.metadata`` file (written by rank 0 once every rank
has written) and one ``__R_0.distcp`` file per rank, streamed through :mod:`sapd.storage` (a local
folder or S3, multipart as it is produced; ranged GETs on load). The coordinates are the engine's, not
the layout's: for parameter ``i`` (``model.parameters()`` order) and state key ``exp_avg``, one 1-D
tensor over the parameter's flattened elements, of which each rank declares the slices it holds
(:class:`OptimizerShard`). DCP's load planner then matches whatever slices the loading ranks hold
against what the saving ranks wrote — so a checkpoint moves between world sizes, ZeRO stages and the
single-process torch engine (resharding on load). Why DCP and not DeepSpeed's own
``zero_pp_rank_*_optim_states.pt``: DeepSpeed's files are tied to its flat-buffer layout and world size
(resharding needs the offline universal-checkpoint conversion) and the torch engine cannot read them;
DCP reshards on load for any layout that can name its slices, which ZeRO 1–3 and a plain optimizer can.
``state/trainer.pt`` keeps what is small (step counter, RNG, AdamW's hyper-parameters and step count, the
parameter sizes). Checkpoints written before (the whole optimizer inside ``trainer.pt``) still load:
every rank reads that file whole, as it did then.

**Every file is checked when it is loaded.** The commit marker records the size and SHA-256 of every file
of the checkpoint (``files``: the model folder's, ``trainer.pt``, the optimizer's index and data files),
computed as they were written; a loader compares what it reads and refuses a file that differs
(:class:`sapd.storage.CorruptObject`, naming it). The optimizer's data files are read in ranges, so for
them one SHA-256 per item DCP wrote is recorded too (cut where DCP asks the stream for its position, at
the start and end of each item), in ``state/optimizer/_ITEM_DIGESTS.json`` — a file of the checkpoint like
the others, so the marker every load reads stays small — and each ranged read is checked against the items
it covers. A checkpoint committed before digests existed still loads, with a line saying it is unverified.

**The fp32 master is optimizer state too.** With a half-precision ``model.dtype`` the optimizer updates an
fp32 copy of the weights (DeepSpeed's fp32 partitions, the torch engine's master tensors) and the model
folder holds their bfloat16 rounding, for sampling, evaluation and export. An lr-1e-6 AdamW step is far
below half a bfloat16 step of most weights, so a run that restarted each round from the bfloat16 folder
would keep almost none of its updates. The master is saved beside ``exp_avg``/``exp_avg_sq`` under the key
``master``, sharded and resharded the same way (format ``dcp-adamw/2``); checkpoint 0 holds the student's
original weights as the master (in fp32 where they exist), with no moments yet. A checkpoint without one
(written before, or a float32 run's, whose folder is the master) resumes with the master rebuilt from its
weights, and :func:`restore_optimizer` says so.
"""

from __future__ import annotations

import bisect
import contextlib
import dataclasses
import functools
import hashlib
import io
import json
import shutil
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ContextManager, Protocol

import torch

from sapd import layout, storage
from sapd.models.loading import checkpoint_files, load_causal_lm, model_folder, resolve_model_dir


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
                       max_shard_bytes: int = MAX_SHARD_BYTES) -> dict[str, dict[str, Any]]:
    """A self-contained HF model folder at ``uri`` (config, generation config, tokenizer with its chat
    template, safetensors shards and their index), written shard by shard. With several ranks every rank
    calls this (``gather`` is a collective); only ``is_main`` writes. → the :func:`sapd.storage.digest` of
    every file written, by its name in the folder (empty on the other ranks)."""
    written: dict[str, dict[str, Any]] = {}
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
                    name = f.relative_to(tmp).as_posix()
                    written[name] = storage.file_digest(f)
                    storage.write_file_from(f, storage.join(uri, name))
        for fname, shard in zip(names, shards, strict=True):
            with gather([e.tensor for e in shard]):
                tensors = {e.name: e.tensor.detach().to("cpu").contiguous().clone() for e in shard} if is_main else {}
            if is_main:
                written[fname] = _write_shard(tensors, Path(tmp, fname), storage.join(uri, fname))
            del tensors
    return written


def _write_shard(tensors: dict[str, torch.Tensor], scratch: Path, uri: str) -> dict[str, Any]:
    from safetensors.torch import save_file

    save_file(tensors, str(scratch), metadata={"format": "pt"})
    try:
        found = storage.file_digest(scratch)
        storage.write_file_from(scratch, uri)
    finally:
        scratch.unlink(missing_ok=True)
    return found


def save_checkpoint(root: str, k: int, model, tokenizer, state: dict[str, Any] | None,
                    meta: dict[str, Any] | None = None, *, gather: Gather = _no_gather, is_main: bool = True,
                    max_shard_bytes: int = MAX_SHARD_BYTES,
                    optimizer: OptimizerShard | None = None) -> dict[str, Any] | None:
    """Write checkpoint ``k`` (model folder, trainer state, the optimizer state sharded by rank) and commit
    it → the marker (``None`` on the ranks other than the main one, which take part in ``gather`` and
    write their own optimizer shard). ``optimizer``: this rank's :class:`OptimizerShard` (with several
    ranks a collective: every rank passes its own). The commit marker is written last, by the main rank,
    after every rank's shard is written."""
    if is_main:
        if is_committed(root, k):
            raise RuntimeError(f"{layout.checkpoint_dir(root, k)} is already committed")
        storage.delete_prefix(layout.checkpoint_dir(root, k))
    written = write_model_folder(layout.checkpoint_model_dir(root, k), model, tokenizer, gather=gather,
                                 is_main=is_main, max_shard_bytes=max_shard_bytes)
    files = {f"model/{name}": d for name, d in written.items()}
    optimizer_written = save_optimizer_shards(optimizer_dir(root, k), optimizer) if optimizer is not None else {}
    if not is_main:
        return None
    files.update(record_optimizer_files(root, k, optimizer_written))
    if optimizer is not None:
        state = {**(state or {}), SHARDED_KEY: optimizer.describe()}
    if state is not None:
        buf = io.BytesIO()
        torch.save(state, buf)
        files["state/trainer.pt"] = storage.digest(buf.getbuffer())
        storage.write_bytes(storage.join(layout.checkpoint_state_dir(root, k), "trainer.pt"), buf.getvalue())
    marker = {"checkpoint": k, "commit_id": uuid.uuid4().hex, "has_state": state is not None,
              "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), **(meta or {}),
              "files": dict(sorted(files.items()))}
    if optimizer is not None:
        marker["optimizer"] = OPTIMIZER_FORMAT
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
        return resolve_model_dir(uri, cache_key=marker["commit_id"], marker=marker)
    return resolve_model_dir(uri, marker=marker)


def load_checkpoint_model(root: str, k: int, dtype: str = "float32", device: str = "cpu", trainable: bool = False):
    return load_causal_lm(str(checkpoint_model_path(root, k)), dtype=dtype, device=device,  # type: ignore[arg-type]
                          trainable=trainable)


def load_trainer_state(root: str, k: int) -> dict[str, Any] | None:
    """Checkpoint ``k``'s ``trainer.pt`` (step counter, RNG; the optimizer's hyper-parameters under
    ``optimizer_shards``, or, in checkpoints written before sharding, the whole optimizer state under
    ``optimizer``); None when it has no trainer state."""
    marker = read_marker(root, k)
    if not marker.get("has_state"):
        return None
    uri = storage.join(layout.checkpoint_state_dir(root, k), "trainer.pt")
    data = storage.read_bytes(uri)
    files = checkpoint_files(root, k, marker)
    if files is not None:
        storage.check_digest(uri, storage.digest(data), files.get("state/trainer.pt"),
                             layout.checkpoint_marker(root, k))
    return torch.load(io.BytesIO(data), map_location="cpu", weights_only=False)


ITEM_DIGESTS = "_ITEM_DIGESTS.json"
"""Beside the optimizer's data files: the SHA-256 of every item DCP wrote into each (``[offset, sha256]``
lists by file name), itself recorded in the commit marker like every file of the checkpoint."""


def record_optimizer_files(root: str, k: int, written: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The commit marker's entries (by name below the checkpoint) for the optimizer files ``written``
    (:func:`save_optimizer_shards`' answer, every rank's), after writing their items' digests beside them
    (:data:`ITEM_DIGESTS`, itself one of the entries); nothing for nothing written."""
    files: dict[str, dict[str, Any]] = {}
    item_digests: dict[str, Any] = {}
    for name, d in written.items():
        d = dict(d)
        if "segments" in d:
            item_digests[name] = d.pop("segments")
        files[f"state/optimizer/{name}"] = d
    if item_digests:  # beside the data files, so the marker that every load reads stays small
        text = json.dumps(item_digests, sort_keys=True) + "\n"
        files[f"state/optimizer/{ITEM_DIGESTS}"] = storage.digest(text.encode())
        storage.write_text(storage.join(optimizer_dir(root, k), ITEM_DIGESTS), text)
    return files


def _optimizer_files(root: str, k: int) -> dict[str, dict[str, Any]] | None:
    """The digests checkpoint ``k``'s commit recorded of its optimizer files, by name in ``state/optimizer``,
    each data file's with its items' (``segments``; checked against the marker's digest of the items file
    first); None when it recorded none (an unverified checkpoint)."""
    files = checkpoint_files(root, k, read_marker(root, k))
    if files is None:
        return None
    prefix = "state/optimizer/"
    out = {name.removeprefix(prefix): dict(d) for name, d in files.items() if name.startswith(prefix)}
    if ITEM_DIGESTS in out:
        uri = storage.join(optimizer_dir(root, k), ITEM_DIGESTS)
        data = storage.read_bytes(uri)
        storage.check_digest(uri, storage.digest(data), out[ITEM_DIGESTS], layout.checkpoint_marker(root, k))
        for name, segments in json.loads(data).items():
            if name in out:
                out[name]["segments"] = segments
    return out


# ---------------------------------------------------------------------------------------------------
# sharded optimizer state

OPTIMIZER_FORMAT = "dcp-adamw/2"
# /1 (written before the master was kept): the moments only, no "keys" in its description
READABLE_FORMATS = ("dcp-adamw/1", OPTIMIZER_FORMAT)
SHARDED_KEY = "optimizer_shards"
STATE_KEYS = ("exp_avg", "exp_avg_sq")
MASTER_KEY = "master"
"""The fp32 weights the optimizer updates, saved where the model folder holds only their half-precision
rounding (a bfloat16 ``model.dtype``)."""
# AdamW settings carried from one engine to another (never lr: the schedule sets it every step; never an
# implementation flag such as foreach or fused, which belongs to the engine that loads)
HYPER_KEYS = ("betas", "eps", "weight_decay", "amsgrad", "maximize")


def optimizer_dir(root: str, k: int) -> str:
    return storage.join(layout.checkpoint_state_dir(root, k), "optimizer")


@dataclass
class OptimizerShard:
    """One rank's share of an AdamW state, in coordinates that do not depend on the engine: for parameter
    ``i`` (``model.parameters()`` order, ``numels[i]`` elements), ``fragments[i]`` lists the slices of its
    flattened state this rank holds as ``(start, {"exp_avg": view, "exp_avg_sq": view, "master": view})`` —
    views of the engine's own state, so saving reads and loading writes them in place. ``keys``: the
    entries saved and loaded (the moments once the optimizer has stepped, ``step`` not None; the master
    where it is a copy of its own, a half-precision model). A fragment also holds ``master`` where it is
    not saved (the float32 weights the optimizer updates in place): what the update probe of
    :mod:`sapd.stages.train` reads. ``replicated``: every rank holds every parameter's whole state (one
    process, or DeepSpeed without ZeRO), so one copy is saved and every rank loads all of it."""

    numels: list[int]
    fragments: list[list[tuple[int, dict[str, torch.Tensor]]]]
    hyper: dict[str, Any]
    step: float | None
    replicated: bool = False
    shapes: list[tuple[int, ...]] = field(default_factory=list)
    keys: tuple[str, ...] = STATE_KEYS

    def describe(self) -> dict[str, Any]:
        """What ``trainer.pt`` keeps of it: everything but the tensors."""
        return {"format": OPTIMIZER_FORMAT, "step": self.step, "numels": list(self.numels),
                "shapes": [list(s) for s in self.shapes], "keys": list(self.keys),
                "hyper": {k: v for k, v in self.hyper.items() if k in HYPER_KEYS}}

    def held_elements(self) -> int:
        return sum(next(iter(views.values())).numel() for frags in self.fragments for _, views in frags if views)

    def only(self, keys: tuple[str, ...]) -> OptimizerShard:
        """The same views, saving and loading only those of ``keys`` this shard has."""
        return dataclasses.replace(self, keys=tuple(k for k in self.keys if k in keys))


class ShardedOptimizer(Protocol):
    """What :func:`restore_optimizer` asks of a training engine."""

    @property
    def module(self) -> Any:
        """The HF model it trains (its ``named_parameters()`` in the optimizer's order)."""
        ...

    def optimizer_shard(self) -> OptimizerShard:
        """This rank's share of the current state (views)."""
        ...

    def prepare_optimizer_shard(self, step: float | None, hyper: dict[str, Any]) -> OptimizerShard:
        """Create the optimizer state (zeros, at ``step``, with ``hyper``'s settings; no moments for ``step``
        None) and return this rank's share of it, the master's views included, to be filled in place."""
        ...

    def load_optimizer_state(self, state: dict[str, Any]) -> None:
        """A whole ``torch.optim.AdamW`` state dict (checkpoints written before sharding)."""
        ...

    def weights_from_master(self) -> None:
        """Set the model's half-precision weights to the rounding of the fp32 master just loaded (every rank)."""
        ...


def torch_optimizer_shard(optimizer: torch.optim.Optimizer, master: bool = False) -> OptimizerShard:
    """The :class:`OptimizerShard` of a plain AdamW over a whole model (the torch engine: it holds it all).
    The tensors it updates are the master; ``master``: they are a copy of the model's (half-precision)
    weights, saved with the moments."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    hyper = {k: v for k, v in optimizer.param_groups[0].items() if k != "params"}
    shapes = [tuple(p.shape) for p in params]
    numels = [p.numel() for p in params]
    stepped = bool(optimizer.state)
    keys = (STATE_KEYS if stepped else ()) + ((MASTER_KEY,) if master else ())
    step = float(optimizer.state[params[0]]["step"]) if stepped else None
    frags = [[(0, {**({key: optimizer.state[p][key].view(-1) for key in STATE_KEYS} if stepped else {}),
                   MASTER_KEY: p.detach().view(-1)})] for p in params]
    return OptimizerShard(numels, frags, hyper, step, True, shapes, keys)


def prepare_torch_optimizer_shard(optimizer: torch.optim.Optimizer, step: float | None,
                                  hyper: dict[str, Any], master: bool = False) -> OptimizerShard:
    """AdamW's state created as its first step would (zeros, ``step``; none for ``step`` None: a master
    without moments, checkpoint 0's), hyper-parameters set; → its views."""
    for group in optimizer.param_groups:
        for key in HYPER_KEYS:
            if key in hyper and key in group:
                group[key] = tuple(hyper[key]) if key == "betas" else hyper[key]
        if step is None:
            continue
        for p in group["params"]:
            optimizer.state[p] = {"step": torch.tensor(float(step), dtype=torch.float32),
                                  "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                                  "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format)}
    return torch_optimizer_shard(optimizer, master)


def master_shard(model) -> OptimizerShard:
    """The weights of ``model`` (loaded in float32) as the master of a checkpoint with no optimizer state
    yet: checkpoint 0 of a half-precision run. Views of the float32 weights: cast the model to its
    half-precision dtype after taking this, and the master stays the float32 values."""
    params = list(model.parameters())
    frags = [[(0, {MASTER_KEY: p.detach().to(torch.float32).view(-1)})] for p in params]
    return OptimizerShard([p.numel() for p in params], frags, {}, None, True, [tuple(p.shape) for p in params],
                          (MASTER_KEY,))


def _distributed() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def _dcp_state_dict(shard: OptimizerShard) -> dict[str, Any]:
    """The DCP state dict of a shard: per parameter and key a 1-D tensor over its flattened elements — a
    plain tensor where this rank holds it whole (replicated), else a ``ShardedTensor`` of this rank's
    slices (the global layout, every rank's slices, is exchanged once: a few integers per parameter)."""
    out: dict[str, Any] = {}
    if not shard.keys:
        return out
    first = shard.keys[0]
    if shard.replicated or not _distributed():
        for i, frags in enumerate(shard.fragments):
            for start, views in frags:
                if start != 0 or views[first].numel() != shard.numels[i]:
                    raise ValueError(f"parameter {i}: a replicated optimizer shard must hold it whole")
                for key in shard.keys:
                    out[f"{i}.{key}"] = views[key]
        return out
    from torch.distributed._shard.metadata import ShardMetadata
    from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor
    from torch.distributed._shard.sharded_tensor.metadata import ShardedTensorMetadata, TensorProperties
    rank = torch.distributed.get_rank()
    mine = [(i, start, views[first].numel(), str(views[first].device))
            for i, frags in enumerate(shard.fragments) for start, views in frags if views[first].numel()]
    everyone: list[Any] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(everyone, mine)
    layout_of: dict[int, list[ShardMetadata]] = {}
    for r, entries in enumerate(everyone):
        for i, start, n, device in entries:
            layout_of.setdefault(i, []).append(ShardMetadata([start], [n], f"rank:{r}/{device}"))
    for i, frags in enumerate(shard.fragments):
        if i not in layout_of:
            raise RuntimeError(f"optimizer state of parameter {i} is held by no rank")
        for key in shard.keys:
            local = [Shard(views[key], ShardMetadata([start], [views[key].numel()],
                                                     f"rank:{rank}/{views[key].device}"))
                     for start, views in frags if views[key].numel()]
            dtype = local[0].tensor.dtype if local else torch.float32
            meta = ShardedTensorMetadata(layout_of[i], torch.Size([shard.numels[i]]), TensorProperties(dtype=dtype))
            out[f"{i}.{key}"] = ShardedTensor._init_from_local_shards_and_global_metadata(local, meta)
    return out


@contextlib.contextmanager
def _quiet_dcp(*io_objects: Any) -> Iterator[None]:
    """DCP warns about ShardedTensor's deprecation at every use; the slices here are not one of its
    tensor-parallel layouts, which DTensor would need (uneven, per-parameter ZeRO slices). And DCP wraps
    every rank's error into a ``CheckpointException`` (a BaseException with tracebacks in its text): a
    storage error — an outage past the deadline, a damaged file, a lost lease — comes out as itself, so the
    front door reports it in one line with its exit code (a storage error of a rank that cannot be helped
    by retrying wins over an outage). ``io_objects``: this rank's reader or writer, whose file system keeps
    the storage errors DCP turns into text (the index's: DCP then tries a per-rank index and asserts)."""
    import warnings

    from torch.distributed.checkpoint.api import CheckpointException
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=FutureWarning)
        warnings.filterwarnings("ignore", message=".*ShardedTensor.*")
        warnings.filterwarnings("ignore", message=".*_shard.*")
        warnings.filterwarnings("ignore", message=".*assuming the intent is to (save|load) in a single process")
        try:
            yield
        except CheckpointException as e:
            errors = [f[0] if isinstance(f, tuple) else f for f in e.failures.values()]
            errors = [x for x in errors if isinstance(x, storage.StorageError)]
            errors += [x for obj in io_objects for x in getattr(obj.fs, "failed", [])]
            if errors:
                raise sorted(errors, key=lambda x: isinstance(x, storage.StorageUnavailable))[0] from e
            raise


def save_optimizer_shards(uri: str, shard: OptimizerShard) -> dict[str, dict[str, Any]]:
    """Every rank writes its slices of the optimizer state below ``uri`` (its own file, streamed through
    storage), then rank 0 the index; a collective where torch.distributed is initialised. → the digest of
    every file written (by any rank), by its name below ``uri``: what the commit marker records."""
    import torch.distributed.checkpoint as dcp
    writer_cls, _ = _dcp_io()
    writer = writer_cls(uri)
    with _quiet_dcp(writer):
        dcp.save(_dcp_state_dict(shard), storage_writer=writer, no_dist=not _distributed())
    mine = {name.removeprefix(uri.rstrip("/") + "/"): d for name, d in writer.fs.digests.items()}
    if not _distributed():
        return mine
    everyone: list[Any] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(everyone, mine)
    return {name: d for theirs in everyone for name, d in theirs.items()}


def load_optimizer_shards(uri: str, shard: OptimizerShard, files: dict[str, dict[str, Any]] | None = None) -> None:
    """Fill this rank's slices (``shard``'s views, in place) from the optimizer state below ``uri``,
    whatever world size or engine wrote it: each rank reads only the byte ranges holding its slices,
    each checked against the digests ``files`` (by name below ``uri``; None: unverified)."""
    import torch.distributed.checkpoint as dcp
    _, reader_cls = _dcp_io()
    reader = reader_cls(uri, files, _committed_in(uri))
    with _quiet_dcp(reader):
        dcp.load(_dcp_state_dict(shard), storage_reader=reader, no_dist=not _distributed())


def _committed_in(optimizer_uri: str) -> str:
    """The marker that records the digests of the optimizer files below ``optimizer_uri`` (for messages)."""
    return storage.join(optimizer_uri.rstrip("/").rsplit("/", 1)[0], "_COMMITTED")


def restore_optimizer(root: str, k: int, engine: ShardedOptimizer, state: dict[str, Any] | None,
                      log: Callable[[str], None] = print) -> str:
    """Checkpoint ``k``'s optimizer state into ``engine`` (every rank calls it; ``state`` is
    :func:`load_trainer_state`'s), the fp32 master included where the engine keeps one (then the model's
    half-precision weights are set from it). → "sharded", "whole" (a checkpoint written before sharding:
    every rank reads it whole) or "none" (no optimizer state: the optimizer starts fresh). An engine that
    keeps a master and finds none in the checkpoint (written before sapd kept one) keeps the master it
    built from the checkpoint's weights, and the log says so."""
    keeps_master = MASTER_KEY in engine.optimizer_shard().keys

    def rebuilt(why: str) -> None:
        if not keeps_master:
            return
        if master_from_float32_folder(root, k, engine):
            log(f"checkpoint {k}: its model folder holds float32 weights (written by a float32 process, e.g. the "
                "cluster's prefix build on a CPU): they are the fp32 master, exactly")
            return
        log(f"checkpoint {k}: {why}; the fp32 master is rebuilt from its half-precision weights (updates "
            "lost to their rounding stay lost); checkpoints from now on store it")

    if not state:
        rebuilt("no optimizer state and no fp32 master stored (written before sapd kept one)")
        return "none"
    if "optimizer" in state:
        engine.load_optimizer_state(state["optimizer"])
        log(f"checkpoint {k}: optimizer state stored whole (written by an earlier sapd), read whole by every "
            "rank; checkpoints from now on are sharded")
        rebuilt("no fp32 master stored")
        return "whole"
    desc = state.get(SHARDED_KEY)
    if not desc:
        rebuilt("no fp32 master stored (written before sapd kept one)")
        return "none"
    if desc.get("format") not in READABLE_FORMATS:
        raise ValueError(f"{layout.checkpoint_dir(root, k)}: optimizer state format {desc.get('format')!r} is not "
                         f"one this sapd reads ({', '.join(READABLE_FORMATS)}); resume it with the sapd that wrote it")
    saved = tuple(desc.get("keys", STATE_KEYS))
    if desc["step"] is None and MASTER_KEY not in saved:
        rebuilt("no fp32 master stored (written before sapd kept one)")
        return "none"
    dest = engine.prepare_optimizer_shard(desc["step"], desc["hyper"])
    if list(dest.numels) != list(desc["numels"]):
        diff = next((i for i, (a, b) in enumerate(zip(dest.numels, desc["numels"])) if a != b),
                    min(len(dest.numels), len(desc["numels"])))
        raise ValueError(f"{layout.checkpoint_dir(root, k)}: its optimizer state is for {len(desc['numels'])} "
                         f"parameters, the model has {len(dest.numels)} (first difference at parameter {diff}): "
                         "a checkpoint of another model")
    load_optimizer_shards(optimizer_dir(root, k), dest.only(saved), _optimizer_files(root, k))
    if keeps_master and MASTER_KEY in saved:
        engine.weights_from_master()
    elif keeps_master:
        rebuilt("no fp32 master stored (written before sapd kept one)")
    elif MASTER_KEY in saved:
        log(f"checkpoint {k}: it holds an fp32 master, which this float32 run does not keep: its weights come "
            "from the model folder (their half-precision rounding)")
    return "sharded"


def master_from_float32_folder(root: str, k: int, engine: ShardedOptimizer) -> bool:
    """A half-precision trainer on a checkpoint whose model folder stores float32 weights and no master
    (checkpoint 0 written where ``model.dtype: auto`` resolved to float32: the cluster's prefix build runs on a
    CPU): its fp32 master set to those weights, each rank its own slices, and the half-precision weights to
    their rounding — what the checkpoint's own master would have held. → False where the folder is not
    float32 (the master stays the rounding the engine built)."""
    from safetensors import safe_open

    files = sorted(checkpoint_model_path(root, k).glob("*.safetensors"))
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        with safe_open(str(f), framework="pt", device="cpu") as st:
            for name in st.keys():
                tensors[name] = st.get_tensor(name)
    if not tensors or any(t.dtype != torch.float32 for t in tensors.values()):
        return False
    dest = engine.prepare_optimizer_shard(None, {})
    names = [name for name, _ in engine.module.named_parameters()]  # model.parameters() order, tied ones once
    if len(names) != len(dest.fragments) or any(n not in tensors for n in names):
        return False
    for name, fragments in zip(names, dest.fragments):
        flat = tensors[name].reshape(-1)
        for start, views in fragments:
            view = views[MASTER_KEY]
            view.copy_(flat[start:start + view.numel()].to(view.device))
    engine.weights_from_master()
    return True


def consolidated_optimizer_state(root: str, k: int) -> dict[str, Any] | None:
    """Checkpoint ``k``'s whole optimizer state as a ``torch.optim.AdamW`` state dict, in this one process
    (for inspection, tests and tools: it holds everything, which training never does); each parameter's
    entry has its fp32 ``master`` too where the checkpoint stores one (checkpoint 0's has only that)."""
    state = load_trainer_state(root, k)
    if not state:
        return None
    if "optimizer" in state:
        return state["optimizer"]
    desc = state.get(SHARDED_KEY)
    saved = tuple(desc.get("keys", STATE_KEYS)) if desc else ()
    if not desc or (desc["step"] is None and MASTER_KEY not in saved):
        return None
    tensors = [{key: torch.zeros(n, dtype=torch.float32) for key in saved} for n in desc["numels"]]
    shard = OptimizerShard(desc["numels"], [[(0, t)] for t in tensors], desc["hyper"], desc["step"], True,
                           keys=saved)
    import torch.distributed.checkpoint as dcp
    _, reader_cls = _dcp_io()
    reader = reader_cls(optimizer_dir(root, k), _optimizer_files(root, k), layout.checkpoint_marker(root, k))
    with _quiet_dcp(reader):
        dcp.load(_dcp_state_dict(shard), storage_reader=reader, no_dist=True)
    shapes = desc.get("shapes") or [[n] for n in desc["numels"]]
    step = {} if desc["step"] is None else {"step": torch.tensor(float(desc["step"]))}
    return {"state": {i: {**step, **{key: t[key].reshape(shapes[i]) for key in saved}} for i, t in enumerate(tensors)},
            "param_groups": [{**desc["hyper"], "params": list(range(len(tensors)))}]}


class _RangeFile:
    """A data file DCP opened for reading: nothing is fetched until a slice is asked for; ``digest``: what
    the commit recorded of it (None: unverified)."""

    def __init__(self, uri: str, digest: dict[str, Any] | None = None, committed_in: str = "") -> None:
        self.uri, self.digest, self.committed_in = uri, digest, committed_in

    def read(self, offset: int, length: int) -> bytes:
        """``length`` bytes at ``offset``, read together with the rest of the recorded items they touch and
        checked against those items' digests (one reread before refusing: a bad transfer is not a bad
        file)."""
        if self.digest is None:
            return storage.read_range(self.uri, offset, length)
        size = int(self.digest["bytes"])
        segments = self.digest.get("segments") or [[0, self.digest["sha256"]]]
        starts = [int(s[0]) for s in segments]
        ends = starts[1:] + [size]
        if offset < 0 or offset + length > size:
            raise storage.CorruptObject(f"{self.uri}: bytes {offset}..{offset + length} asked for, but "
                                        f"{self.committed_in} recorded {size} bytes: the index does not match the "
                                        "committed file")
        first = bisect.bisect_right(starts, offset) - 1
        last = bisect.bisect_left(ends, offset + length)
        lo, hi = starts[first], ends[last]
        for _ in (1, 2):
            data = storage.read_range(self.uri, lo, hi - lo)
            bad = [i for i in range(first, last + 1)
                   if hashlib.sha256(memoryview(data)[starts[i] - lo:ends[i] - lo]).hexdigest() != segments[i][1]]
            if not bad:
                return data[offset - lo:offset - lo + length]
        i = bad[0]
        raise storage.CorruptObject(f"{self.uri}: bytes {starts[i]}..{ends[i]} differ from the digest "
                                    f"{self.committed_in} recorded: damaged or replaced since it was committed; "
                                    "refusing to use it")

    def __enter__(self) -> _RangeFile:
        return self

    def __exit__(self, *exc: Any) -> None:
        pass


@functools.cache
def _dcp_io() -> tuple[Any, Any]:
    """DCP's file-system writer and reader with :mod:`sapd.storage` underneath (classes made on first use:
    DCP is imported lazily). Files are streamed as written (``open_write``: temp + rename locally,
    multipart on S3); a reader fetches each saved item with one ranged read."""
    from torch.distributed.checkpoint.filesystem import FileSystemBase, FileSystemReader, FileSystemWriter

    class StorageFS(FileSystemBase):
        """DCP's file system on :mod:`sapd.storage`. Writing, it records the digest of every file it wrote
        (``digests``, by URI); reading, it checks what it reads against ``expected`` (by URI) when given."""

        def __init__(self, expected: dict[str, dict[str, Any]] | None = None, committed_in: str = "") -> None:
            self.digests: dict[str, dict[str, Any]] = {}
            self.expected, self.committed_in = expected, committed_in
            self.failed: list[storage.StorageError] = []  # what DCP may flatten into an assertion's text

        def _expected(self, uri: str) -> dict[str, Any] | None:
            if self.expected is None:
                return None
            if uri not in self.expected:
                raise storage.CorruptObject(f"{uri}: not one of the files {self.committed_in} records; refusing to "
                                            "use it")
            return self.expected[uri]

        @contextlib.contextmanager
        def create_stream(self, path: Any, mode: str) -> Iterator[Any]:
            uri = str(path)
            if mode == "wb":
                with storage.open_write(uri) as out:
                    yield out
                self.digests[uri] = out.digest()  # one SHA-256 per item too: DCP asks tell() around each
            elif mode == "rb":
                if not uri.endswith(".metadata"):
                    yield _RangeFile(uri, self._expected(uri), self.committed_in)
                    return
                try:
                    data = storage.read_bytes(uri)
                    if self.expected is not None:
                        storage.check_digest(uri, storage.digest(data), self._expected(uri), self.committed_in)
                except storage.StorageNotFound:
                    if self.expected is None or uri not in self.expected:
                        raise  # DCP looks for a per-rank index when there is no global one: not an error yet
                    missing = storage.CorruptObject(f"{uri}: recorded in {self.committed_in} but missing")
                    self.failed.append(missing)
                    raise missing from None
                except storage.StorageError as e:
                    self.failed.append(e)
                    raise
                yield io.BytesIO(data)
            else:
                raise ValueError(f"unsupported mode {mode!r}")

        def concat_path(self, path: Any, suffix: str) -> str:
            return storage.join(str(path), suffix)

        def rename(self, path: Any, new_path: Any) -> None:  # only DCP's small index goes through here
            data = storage.read_bytes(str(path))
            written = self.digests.pop(str(path), None)
            if written is not None:  # what came back is what was written
                storage.check_digest(str(path), storage.digest(data), {k: written[k] for k in ("bytes", "sha256")},
                                     "this process's write of it")
            storage.write_bytes(str(new_path), data)
            self.digests[str(new_path)] = storage.digest(data)
            storage.delete(str(path))

        def init_path(self, path: Any) -> str:
            return str(path)

        def mkdir(self, path: Any) -> None:
            pass  # storage creates folders as it writes

        @classmethod
        def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
            return True

        def exists(self, path: Any) -> bool:
            return storage.exists(str(path))

        def rm_file(self, path: Any) -> None:
            storage.delete(str(path))

        def ls(self, path: Any) -> list[str]:
            return storage.list_files(str(path))

    class Writer(FileSystemWriter):
        def __init__(self, uri: str) -> None:
            super().__init__(uri, single_file_per_rank=True, sync_files=False, thread_count=1, overwrite=True)
            self.fs = StorageFS()  # type: ignore[assignment]  # DCP's own fsspec writer does the same
            self.path = uri

    class Reader(FileSystemReader):
        def __init__(self, uri: str, files: dict[str, dict[str, Any]] | None = None, committed_in: str = "") -> None:
            super().__init__(uri)
            expected = None if files is None else {storage.join(uri, name): d for name, d in files.items()}
            self.fs = StorageFS(expected, committed_in)  # type: ignore[assignment]
            self.path = uri

        def _slice_file(self, file: Any, sinfo: Any) -> Any:
            return io.BytesIO(file.read(sinfo.offset, sinfo.length))

    return Writer, Reader


def export_model(source: str, out: str, *, checkpoint: int | None = None) -> str:
    """Copy a run root's model (checkpoint ``checkpoint``, default the newest committed one) — or a model
    folder — to ``out`` as a self-contained Hugging Face folder (weights, config, tokenizer, chat template)
    that ``AutoModelForCausalLM.from_pretrained`` loads. A local ``out`` is written beside itself and
    renamed into place, replacing an earlier export; returns ``out``. A checkpoint's files are checked
    against the digests its commit recorded as they are copied (a damaged one is refused, nothing exported)."""
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
    check = _copy_check(src, rel)
    if storage.is_s3(out):
        for name, f in zip(rel, files):
            dest = storage.join(out, name)
            if storage.is_s3(f):  # streamed through a local file: weights can be larger than memory
                with tempfile.TemporaryDirectory(prefix="sapd-export-") as scratch:
                    storage.download_to(f, Path(scratch) / "file")
                    check(name, Path(scratch) / "file")
                    storage.write_file_from(str(Path(scratch) / "file"), dest)
            else:
                check(name, Path(f.removeprefix("file://")))
                storage.write_file_from(str(Path(f.removeprefix("file://"))), dest)
        return out
    final = Path(out.removeprefix("file://"))
    if final.resolve() == Path(src.removeprefix("file://")).resolve():
        return out
    tmp = final.with_name(f".{final.name}.export-{uuid.uuid4().hex[:8]}")
    try:
        for name, f in zip(rel, files):
            (tmp / name).parent.mkdir(parents=True, exist_ok=True)
            storage.download_to(f, tmp / name)
            check(name, tmp / name)
    except storage.CorruptObject:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
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


def _copy_check(src: str, names: list[str]) -> Callable[[str, Path], None]:
    """For :func:`export_model`: a check of each copied file of ``src`` — when ``src`` is a checkpoint's model
    folder, against the digests its commit recorded (every recorded file must be among ``names``, and no
    other); for a plain model folder, nothing."""
    checkpoint = layout.checkpoint_of_model_dir(src)
    files = checkpoint_files(*checkpoint, read_marker(*checkpoint)) if checkpoint is not None else None
    if checkpoint is None or files is None:
        return lambda name, path: None
    marker_uri = layout.checkpoint_marker(*checkpoint)
    expected = {n.removeprefix("model/"): d for n, d in files.items() if n.startswith("model/")}
    for name in sorted(set(names) ^ set(expected)):
        raise storage.CorruptObject(f"{storage.join(src, name)}: " + ("not one of the files" if name in names else
                                                                     "missing, but one of the files")
                                    + f" {marker_uri} records; refusing to export the checkpoint")

    def check(name: str, path: Path) -> None:
        storage.check_digest(storage.join(src, name), storage.file_digest(path), expected.get(name), marker_uri)

    return check
