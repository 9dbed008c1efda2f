"""One rank (under ``torchrun``, gloo, CPU) of the gradient-reduction check in
tests/engines/test_bf16_reduction.py. For every job in the JSON list ``argv[1]``,
``{"do": "train", "config": {...}, "drop": [KEY, ...]}``, it runs the train stage of round 0
(:func:`sapd.stages.train.run_train_stage`, what ``sapd train-round`` runs) on a run root the test seeded
with a scored round and checkpoint 0, the top-level keys ``drop`` taken out of the DeepSpeed config that
:func:`sapd.engines.deepspeed_engine.deepspeed_config` builds (so DeepSpeed's own defaults apply to them).

While the engine's ``backward`` or ``step`` runs, every reducing collective of ``torch.distributed``
(``all_reduce``, ``all_reduce_coalesced``, ``reduce``, ``reduce_scatter``, ``reduce_scatter_tensor``,
``_reduce_scatter_base``) is recorded: the phase, the collective, the dtype and size of the tensor it is
handed. The wrappers are put in place before DeepSpeed binds its communication backend, which looks
``reduce_scatter_tensor`` up once. At each ``step`` it also records where DeepSpeed accumulated this
rank's gradients since the last one (the buffers its optimizer reads them from), by dtype.

Writes ``{out}.rank{r}.json``: per job the DeepSpeed config it was given, the records, per step the optimizer
DeepSpeed built and the accumulation buffers, and how often ``backward`` and ``step`` ran."""

from __future__ import annotations

import functools
import gc
import json
import sys
from typing import Any

import torch
import torch.distributed as dist

REDUCING = ("all_reduce", "all_reduce_coalesced", "reduce", "reduce_scatter", "reduce_scatter_tensor",
            "_reduce_scatter_base")
_phase: list[str] = []  # the engine method running now (empty: outside backward and step)
_records: list[dict[str, Any]] = []
_buffers: list[dict[str, Any]] = []
_calls: dict[str, int] = {}  # backward and step calls of the job


# where each collective takes the tensors it reduces (not the output it writes): position, keyword
_HANDED = {"reduce_scatter_tensor": (1, "input"), "_reduce_scatter_base": (1, "input"),
           "reduce_scatter": (1, "input_list"), "all_reduce_coalesced": (0, "tensors")}


def _tensors(args: tuple, kwargs: dict, op: str) -> list[torch.Tensor]:
    """The tensors a reducing collective is handed to reduce."""
    index, key = _HANDED.get(op, (0, "tensor"))  # all_reduce, reduce: (tensor, ...)
    given: Any = kwargs[key] if key in kwargs else args[index]
    return list(given) if isinstance(given, (list, tuple)) else [given]


def _wrap(op: str):
    original = getattr(dist, op)

    @functools.wraps(original)
    def recorded(*args, **kwargs):
        if _phase:
            for t in _tensors(args, kwargs, op):
                _records.append({"phase": _phase[-1], "op": op, "dtype": str(t.dtype).removeprefix("torch."),
                                 "numel": t.numel()})
        return original(*args, **kwargs)
    return recorded


def install() -> None:
    for op in REDUCING:
        if hasattr(dist, op):
            setattr(dist, op, _wrap(op))


def _accumulation_buffers(ds_optimizer, module) -> list[dict[str, Any]]:
    """The tensors this rank's gradients were accumulated in before ``step``: the module parameters'
    ``.grad`` (where DeepSpeed left them), and by DeepSpeed optimizer: ZeRO-1/2 — the flat partition of
    averaged gradients, or the per-parameter ones accumulated between steps
    (``all_grad_tensors``, ``grad_accum``, ``grads_in_partition``); DeepSpeed's bf16
    optimizer — its flat high-precision gradients; ZeRO-3 — the flat buffer of gradient partitions."""
    found: list[tuple[str, torch.Tensor]] = [("param.grad", p.grad) for p in module.parameters() if p.grad is not None]
    for i, group in (getattr(ds_optimizer, "averaged_gradients", None) or {}).items():
        flat = getattr(group, "flat_partition", None)
        if flat is not None:
            found.append((f"averaged_gradients[{i}].flat_partition", flat))
        elif isinstance(group, (list, tuple)):
            found += [(f"averaged_gradients[{i}]", t) for t in group if torch.is_tensor(t)]
    for i, tensors in (getattr(ds_optimizer, "all_grad_tensors", None) or {}).items():
        found += [(f"all_grad_tensors[{i}]", t) for t in tensors or [] if torch.is_tensor(t)]
    if torch.is_tensor(getattr(ds_optimizer, "grads_in_partition", None)):
        found.append(("grads_in_partition", ds_optimizer.grads_in_partition))
    for group in getattr(ds_optimizer, "bit16_groups", []):
        found += [("param.grad_accum", p.grad_accum) for p in group if torch.is_tensor(getattr(p, "grad_accum", None))]
    found += [(f"fp32_groups_gradients_flat[{i}]", t)
              for i, t in enumerate(getattr(ds_optimizer, "fp32_groups_gradients_flat", []))]
    stage3 = getattr(ds_optimizer, "grad_partitions_flat_buffer", None)
    if torch.is_tensor(stage3):
        found.append(("grad_partitions_flat_buffer", stage3))
    return [{"where": where, "dtype": str(t.dtype).removeprefix("torch."), "numel": t.numel()} for where, t in found]


_originals: dict[str, Any] = {}  # the engine's methods and the config builder, before _instrument


def _traced(name: str, method):
    def run(self, *args, **kwargs):
        if name == "step":
            _buffers.append({"optimizer": type(self.model.optimizer).__name__,
                             "buffers": _accumulation_buffers(self.model.optimizer, self.module)})
        _calls[name] = _calls.get(name, 0) + 1
        _phase.append(name)
        try:
            return method(self, *args, **kwargs)
        finally:
            _phase.pop()
    return run


def _instrument(drop: list[str]) -> None:
    """Record while the engine's ``backward`` and ``step`` run; build DeepSpeed configs without ``drop``."""
    from sapd.engines import deepspeed_engine
    engine = deepspeed_engine.DeepSpeedEngine
    if not _originals:
        _originals.update(backward=engine.backward, step=engine.step, config=deepspeed_engine.deepspeed_config)
        for name in ("backward", "step"):
            setattr(engine, name, _traced(name, _originals[name]))

    def config(cfg, world_size: int) -> dict[str, Any]:
        return {k: v for k, v in _originals["config"](cfg, world_size).items() if k not in drop}
    deepspeed_engine.deepspeed_config = config


def main(jobs_json: str, out: str) -> None:
    install()  # before DeepSpeed (or anything) initializes the process group
    from sapd.config import config_from_dict
    from sapd.engines import deepspeed_engine
    from sapd.stages.train import run_train_stage

    results = []
    for job in json.loads(jobs_json):
        _instrument(job.get("drop", []))
        _records.clear()
        _buffers.clear()
        _calls.clear()
        torch.manual_seed(0)
        cfg = config_from_dict(job["config"])
        lines: list[str] = []
        run_train_stage(cfg, 0, log=lines.append, show_progress=False)
        results.append({"ds_config": deepspeed_engine.deepspeed_config(cfg, dist.get_world_size()),
                        "records": list(_records), "steps": list(_buffers), "calls": dict(_calls),
                        "log": lines})
        gc.collect()
    with open(f"{out}.rank{dist.get_rank()}.json", "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
