"""What the training loop asks of an engine (:class:`sapd.engines.base.Engine`), and the choice of one from
``train.engine`` (:func:`sapd.engines.base.engine_factory_for`): plain torch (:mod:`sapd.engines.torch_engine`)
or DeepSpeed ZeRO (:mod:`sapd.engines.deepspeed_engine`). Both keep the same checkpoint format, so a
checkpoint trained by either resumes on the other."""

from __future__ import annotations

import os
from typing import Any, Callable, ContextManager, Protocol

import torch

from sapd import checkpoints
from sapd.config import RunConfig
from sapd.engines.deepspeed_engine import make_deepspeed_engine
from sapd.engines.torch_engine import make_torch_engine


class Engine(Protocol):
    """What the training loop asks of an engine (one process, or one rank of several)."""

    model: Any

    def backward(self, loss: torch.Tensor) -> None: ...

    def step(self, lr: float) -> float:
        """Finish the accumulated gradient, clip, apply the update at ``lr``; → the pre-clip grad norm."""
        ...

    def optimizer_shard(self) -> checkpoints.OptimizerShard:
        """This rank's share of the optimizer state (checkpoint k+1 stores each rank's share)."""
        ...

    def prepare_optimizer_shard(self, step: float | None, hyper: dict[str, Any]) -> checkpoints.OptimizerShard:
        """The optimizer state created empty, to be filled from checkpoint k (resharded to this layout)."""
        ...

    def load_optimizer_state(self, state: dict[str, Any]) -> None:
        """A whole AdamW state dict (checkpoints written before the state was sharded)."""
        ...

    def weights_from_master(self) -> None:
        """The model's half-precision weights set to the rounding of the fp32 master (after it was loaded)."""
        ...

    def offload(self) -> bool:
        """Between rounds on a GPU shared with the samplers (``sapd run``): the weights, the optimizer state and
        the fp32 master move to host memory and the allocator's cached blocks go back to the driver, so the
        vLLM engines can wake. Exact (tensors are copied, not recomputed). → whether anything moved (nothing
        does on a CPU)."""
        ...

    def onload(self) -> bool:
        """Back onto the device after :meth:`offload`, before the round trains. → whether anything moved."""
        ...

    @property
    def is_main(self) -> bool: ...

    @property
    def world_size(self) -> int: ...

    @property
    def rank(self) -> int: ...

    def barrier(self) -> None: ...

    def all_reduce_sum(self, values: list[float]) -> list[float]: ...

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, in rank order, on every rank (a collective)."""
        ...

    @property
    def module(self) -> Any:
        """The HF model inside (what gets saved)."""
        ...

    def gather(self, params: list[torch.Tensor]) -> ContextManager[Any]:
        """Makes ``params`` whole on every rank for the block (ZeRO-3 gathers those partitions; a
        collective), so a checkpoint is written a shard at a time."""
        ...


EngineFactory = Callable[[Any, RunConfig], Engine]


def engine_factory_for(cfg: RunConfig) -> EngineFactory:
    """``train.engine``: plain torch (one process) or DeepSpeed ZeRO (one or more, under torchrun)."""
    if cfg.train.engine == "deepspeed":
        return make_deepspeed_engine
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise ValueError("train.engine: torch trains on one process; set train.engine: deepspeed to use torchrun")
    return make_torch_engine
