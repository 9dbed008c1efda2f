"""The plain-torch engine (``train.engine: torch``): one process, ``torch.optim.AdamW``, and in bfloat16 the
fp32 master the optimizer updates (the bf16 weights are its rounding), as DeepSpeed's bf16 mode keeps it.
It has the methods of :class:`sapd.engines.base.Engine`."""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, ContextManager

import torch

from sapd import checkpoints
from sapd.config import FLOAT16_NOT_TRAINED, ConfigError, RunConfig


@dataclass
class TorchEngine:
    """One process, plain ``torch.optim.AdamW``. A float32 model: the optimizer updates its weights. A
    bfloat16 model: the optimizer updates ``masters``, an fp32 copy of every parameter kept for the whole
    run (saved with the optimizer state); each micro-batch's forward and backward run on the bfloat16
    weights, its bfloat16 gradients are added into float32 sums beside the master (the step's micro-batches
    accumulate in fp32, the master's precision), and the bfloat16 weights are set to the master's rounding
    after the step. What DeepSpeed's bf16 mode with fp32 gradient accumulation does
    (sapd.engines.deepspeed_engine, "Gradients in fp32"), on one process."""

    model: Any
    optimizer: torch.optim.Optimizer
    max_grad_norm: float
    masters: list[torch.Tensor] | None = None  # fp32, in model.parameters() order; None: float32 model
    device: torch.device = torch.device("cpu")  # where it trains; offload() moves everything to host memory
    offloaded: bool = False

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()
        if self.masters is not None:  # this micro-batch's bf16 gradients into the fp32 sums, then freed
            with torch.no_grad():
                for p, m in zip(self.model.parameters(), self.masters, strict=True):
                    if p.grad is None:
                        continue
                    if m.grad is None:
                        m.grad = p.grad.to(torch.float32)
                    else:
                        m.grad.add_(p.grad)
                    p.grad = None

    def step(self, lr: float) -> float:
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        params = self.masters if self.masters is not None else list(self.model.parameters())
        norm = torch.nn.utils.clip_grad_norm_(params, self.max_grad_norm)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.masters is not None:
            self.weights_from_master()
        return float(norm)

    def weights_from_master(self) -> None:
        if self.masters is not None:
            with torch.no_grad():
                for p, m in zip(self.model.parameters(), self.masters, strict=True):
                    p.copy_(m)  # round to nearest even, as DeepSpeed's copy into its bf16 partitions

    def optimizer_shard(self) -> checkpoints.OptimizerShard:
        return checkpoints.torch_optimizer_shard(self.optimizer, master=self.masters is not None)

    def _move(self, device: torch.device) -> None:
        """Every tensor of the trainer onto ``device``, in place: the optimizer's parameter groups keep
        referring to the same tensor objects (their ``.data`` moves), so the state resumes exactly."""
        with torch.no_grad():
            self.model.to(device)
            for m in self.masters or ():
                m.data = m.data.to(device)
            for state in self.optimizer.state.values():
                for key, value in state.items():
                    if torch.is_tensor(value) and key != "step":  # AdamW keeps its step count on the CPU
                        state[key] = value.to(device)

    def offload(self) -> bool:
        if self.device.type == "cpu" or self.offloaded:
            return False
        self._move(torch.device("cpu"))
        self.offloaded = True
        if self.device.type == "cuda":
            torch.cuda.empty_cache()  # the freed blocks back to the driver: the vLLM engines wake into them
        return True

    def onload(self) -> bool:
        if not self.offloaded:
            return False
        self._move(self.device)
        self.offloaded = False
        return True

    def prepare_optimizer_shard(self, step: float | None, hyper: dict[str, Any]) -> checkpoints.OptimizerShard:
        return checkpoints.prepare_torch_optimizer_shard(self.optimizer, step, hyper, master=self.masters is not None)

    def load_optimizer_state(self, state: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state)

    @property
    def is_main(self) -> bool:
        return True

    @property
    def world_size(self) -> int:
        return 1

    @property
    def rank(self) -> int:
        return 0

    def barrier(self) -> None:
        pass

    def all_reduce_sum(self, values: list[float]) -> list[float]:
        return list(values)

    def all_gather_object(self, obj: Any) -> list[Any]:
        return [obj]

    @property
    def module(self) -> Any:
        return self.model

    def gather(self, params: list[torch.Tensor]) -> ContextManager[Any]:
        return nullcontext()


def make_torch_engine(model, cfg: RunConfig) -> TorchEngine:
    """AdamW over ``model``'s weights, or over an fp32 master of them when the model is in bfloat16."""
    tc = cfg.train
    params = list(model.parameters())
    if any(p.dtype == torch.float16 for p in params):
        raise ConfigError(FLOAT16_NOT_TRAINED, "model.dtype")
    masters = None
    if any(p.dtype == torch.bfloat16 for p in params):
        masters = [p.detach().to(torch.float32, copy=True) for p in params]
    opt = torch.optim.AdamW(masters or params, lr=tc.lr, betas=tc.betas, weight_decay=tc.weight_decay)
    return TorchEngine(model, opt, tc.max_grad_norm, masters, device=params[0].device)
