"""DeepSpeed engine (``train.engine: deepspeed``): ZeRO 1/2/3 data-parallel training behind the same
methods as :class:`sapd.engines.torch_engine.TorchEngine`. The only module that imports ``deepspeed``.

Launch one round on N processes (the round's scored shards and checkpoint K committed already)::

    DS_ACCELERATOR=cpu OMP_WAIT_POLICY=PASSIVE torchrun --nproc_per_node N -m sapd.cli train-round CONFIG... --round K

(on CPU, OpenMP threads that spin while waiting starve DeepSpeed's and gloo's threads when a rank's
threads take every core; the chart's training pods set ``OMP_WAIT_POLICY=PASSIVE``).

How it matches the single-process engine, step for step:

* **Gradient accumulation is ours.** ``managed_gradient_accumulation: false``: ``backward`` only
  accumulates (ZeRO-2/3 reduce-scatter inside each backward, ZeRO-1 keeps the local grads) and
  ``step`` is the boundary: it finishes the reduction, clips and applies the update. No loss is
  divided by DeepSpeed's ``gradient_accumulation_steps`` (1, and ``scale_wrt_gas=False``); the
  training loop weights each micro-batch itself (see :func:`sapd.stages.train.micro_batch_share`).
* **Gradients are averaged over ranks** by DeepSpeed, so the loop gives each rank's losses the factor
  W: the rank average is then the minibatch gradient of one process.
* **Clipping** (``gradient_clipping = train.max_grad_norm``) is applied once per ``step`` to the global
  norm of the full averaged gradient, like ``clip_grad_norm_``; ``step`` returns that norm (pre-clip).
* **The learning rate** given to ``step`` is written into the optimizer's param groups (no DeepSpeed
  scheduler is configured, so nothing overrides it).
* **Head-only logits.** DeepSpeed wraps :class:`sapd.models.scoring.HeadOnlyLM` around the student
  (plain-head families), so every forward, through the engine and its ZeRO hooks, projects to the
  vocabulary at response positions only: (B, T, V) logits, never (B, S, V).
* **ZeRO-3 is built partitioned** (:func:`load_partitioned`: ``zero.Init`` through transformers), so no
  rank ever holds the whole student.
* **Optimizer state is saved and loaded sharded**: each rank names the slices of every parameter's
  AdamW state it holds (:meth:`DeepSpeedEngine.optimizer_shard`: ZeRO-1/2 from DeepSpeed's fragment
  mapping of its flat partition, ZeRO-3 from each parameter's partition) and
  :mod:`sapd.checkpoints` writes and reads exactly those, so no rank gathers the whole state, and a
  checkpoint trained by either engine, on any number of ranks and any ZeRO stage, resumes on any other
  (resharding on load). Checkpoints holding the whole state (written before) still load
  (:meth:`DeepSpeedEngine.load_optimizer_state`). Both are collective (every rank calls them).
* **The fp32 master lives as long as the run.** In bf16 DeepSpeed builds its fp32 partitions from the
  bf16 module, i.e. from the bf16 rounding even of weights handed in as fp32. So the master is part of
  the sharded optimizer state (each rank's slices of its fp32 partitions, beside the moments), and after
  it is loaded :meth:`DeepSpeedEngine.weights_from_master` sets the bf16 module weights from it the way
  DeepSpeed's own step does. The model folder of each checkpoint stays bf16, the master's rounding.
* **Gradients in fp32** (bf16 runs). The ranks' gradients are summed, and a step's micro-batches
  accumulated, in fp32, the master's precision. DeepSpeed's default for a bf16 model is bf16 for both
  (DeepSpeed 0.19.8, ``runtime/engine.py``: ``communication_data_type`` falls back to bf16, l. 1719-1730;
  ``grad_accum_dtype`` to the model's dtype, l. 1806-1807), so :func:`deepspeed_config` sets
  ``"communication_data_type": "fp32"`` and ``"data_types": {"grad_accum_dtype": "fp32"}``. Measured on 2
  CPU ranks (tests/engines/test_bf16_reduction.py records the dtype of every tensor handed to a reducing
  collective, and of the buffers the gradients wait in for the step), before → after:

  - ZeRO-1: a bf16 all-reduce at ``step`` of the bf16 ``.grad`` the micro-batches accumulated in →
    DeepSpeed builds its bf16 optimizer instead (``engine.py`` l. 2305-2310: ZeRO-1, bf16 weights and fp32
    accumulation), which adds each micro-batch's bf16 gradients into fp32 buffers of the whole model
    (``bf16_optimizer.py`` l. 191, 523) and all-reduces those in fp32 (``engine.py`` l. 3800-3801);
  - ZeRO-2: a bf16 all-reduce in each ``backward``, accumulated in bf16 (``stage_1_and_2.py``
    l. 1038-1045) → cast to fp32 before the all-reduce (l. 1493-1494) and added into this rank's fp32
    gradient partition (l. 1259-1262, the compact buffer);
  - ZeRO-3: a bf16 reduce-scatter into a bf16 partition buffer → fp32 (``stage3.py`` l. 1919-1920, the cast
    before the reduce-scatter; l. 790-792 and 2030, the fp32 partition buffer it accumulates in);
  - no ZeRO (stage 0, outside the stages sapd documents): the all-reduce is fp32 (``engine.py``
    l. 3800-3801), but micro-batches still accumulate in bf16: DeepSpeed refuses a ``grad_accum_dtype``
    other than the model's without ZeRO (``engine.py`` l. 2313-2323, ``NotImplementedError``), so it is
    not set there.

  The cost: fp32 gradients — of the whole model on every ZeRO-1 rank, of its partition on a ZeRO-2/3
  rank — and twice the bytes per reduction. The single-process torch engine accumulates in fp32 the same
  way, so a 2-rank ZeRO-2 bf16 round trains the torch engine's weights bit for bit where clipping is
  inactive (tests/engines/test_bf16_reduction.py; the gradient norm, summed over partitions in another
  order, differs in its last bits).
"""

from __future__ import annotations

import contextlib
import os
import socket
from typing import Any, ContextManager

import torch

from sapd.checkpoints import HYPER_KEYS, MASTER_KEY, STATE_KEYS, OptimizerShard
from sapd.config import FLOAT16_NOT_TRAINED, ConfigError, RunConfig
from sapd.models.loading import load_causal_lm
from sapd.models.scoring import HeadOnlyLM, decoder_and_head


def deepspeed_config(cfg: RunConfig, world_size: int) -> dict[str, Any]:
    """The DeepSpeed config, built from the run config (no JSON file to keep in sync)."""
    t = cfg.train
    if t.zero_stage not in (0, 1, 2, 3):
        raise ConfigError(f"train.zero_stage: {t.zero_stage} is not one of 0, 1, 2, 3")
    if cfg.model.dtype == "float16":
        raise ConfigError(FLOAT16_NOT_TRAINED, "model.dtype")
    bf16 = cfg.model.dtype == "bfloat16"
    # bf16: the ranks' gradients are summed and micro-batches accumulated in fp32, as the fp32 master they
    # update (DeepSpeed's default for both is the model's dtype, bf16; see "Gradients in fp32" above).
    # "communication_data_type": the dtype of the tensors handed to the reducing collective — every
    # stage's reduction (ZeRO-1/2 all-reduce, ZeRO-3 reduce-scatter, the engine's own all-reduce) casts to
    # it first. "data_types.grad_accum_dtype": the buffers the reduced gradients accumulate in between
    # steps (ZeRO-2/3: this rank's fp32 gradient partition; ZeRO-1 becomes DeepSpeed's bf16 optimizer,
    # which keeps fp32 gradients of the whole model). ZeRO-0 takes only the first: DeepSpeed refuses a
    # grad_accum_dtype other than the model's without ZeRO.
    reduce_fp32: dict[str, Any] = {}
    if bf16:
        reduce_fp32["communication_data_type"] = "fp32"
        if t.zero_stage >= 1:
            reduce_fp32["data_types"] = {"grad_accum_dtype": "fp32"}
    return {
        # the loop feeds micro-batches of `micro_batch_prefixes` prefixes and owns the accumulation
        "train_micro_batch_size_per_gpu": t.micro_batch_prefixes,
        "gradient_accumulation_steps": 1,
        "train_batch_size": t.micro_batch_prefixes * world_size,
        "managed_gradient_accumulation": False,
        "gradient_clipping": t.max_grad_norm,
        "optimizer": {"type": "AdamW", "params": {"lr": t.lr, "betas": list(t.betas), "eps": 1e-8,
                                                  "weight_decay": t.weight_decay, "torch_adam": True}},
        "zero_optimization": {"stage": t.zero_stage, "overlap_comm": False},
        "bf16": {"enabled": bf16},
        "fp16": {"enabled": False},
        **reduce_fp32,
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
    }


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed() -> None:
    """Join the process group torchrun describes (gloo on CPU); a plain single process (no torchrun
    variables) becomes a group of one."""
    import deepspeed
    from deepspeed.accelerator import get_accelerator
    if "RANK" not in os.environ:
        os.environ.update({"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                           "MASTER_PORT": os.environ.get("MASTER_PORT", str(_free_port()))})
    backend = "gloo" if get_accelerator().device_name() == "cpu" else None
    deepspeed.init_distributed(dist_backend=backend, auto_mpi_discovery=False, verbose=False)


class DeepSpeedEngine:
    """``model`` is the DeepSpeed engine module (call forward on it); ``module`` the HF model inside."""

    def __init__(self, ds_engine, module, cfg: RunConfig):
        self.model = ds_engine
        self.module = module
        self.cfg = cfg
        self._offloaded = False

    # -- the TorchEngine interface

    def backward(self, loss: torch.Tensor) -> None:
        self.model.backward(loss, scale_wrt_gas=False)

    def step(self, lr: float) -> float:
        for group in self.model.optimizer.param_groups:
            group["lr"] = lr
        self.model.step()
        norm = self.model.get_global_grad_norm()
        return float(norm.item() if torch.is_tensor(norm) else norm)

    def _inner(self) -> torch.optim.Optimizer:
        """The torch AdamW that updates this rank's flat fp32 partitions."""
        opt = self.model.optimizer
        return getattr(opt, "optimizer", opt)

    def _params(self) -> list[torch.nn.Parameter]:
        return list(self.module.parameters())  # the order TorchEngine's AdamW indexes them by

    def optimizer_shard(self) -> OptimizerShard:
        """This rank's slices of the AdamW state and of the fp32 weights it updates (views of DeepSpeed's
        own tensors): ZeRO-3 — each parameter's partition (``partition_rank · partition_numel`` onward,
        its padding cut off); ZeRO-1/2 and DeepSpeed's bf16 optimizer — the fragment of the parameter that
        falls into this rank's flat partition (DeepSpeed's ``_hp_mapping``), none where it falls elsewhere;
        no ZeRO — the whole state, replicated on every rank. The fp32 weights are saved (``master``) in
        bf16, where the module holds only their rounding; the moments once the optimizer has stepped."""
        inner = self._inner()
        params = self._params()
        hyper = {k: v for k, v in inner.param_groups[0].items() if k != "params"}
        numels = [int(getattr(p, "ds_numel", p.numel())) for p in params]
        shapes = [tuple(getattr(p, "ds_shape", p.shape)) for p in params]
        stepped = bool(inner.state)
        step = float(next(iter(inner.state.values()))["step"]) if stepped else None
        moments = STATE_KEYS if stepped else ()
        keys = moments + ((MASTER_KEY,) if self.cfg.model.dtype == "bfloat16" else ())
        zero = self.model.optimizer
        replicated = not any(hasattr(p, "ds_id") or hasattr(p, "_hp_mapping") for p in params)
        fragments: list[list[tuple[int, dict[str, torch.Tensor]]]] = []
        for param in params:
            p: Any = param  # DeepSpeed's attributes live on the parameter
            if hasattr(p, "ds_id"):  # ZeRO-3: the parameter's partition on this rank
                part = p.partition_numel()
                start = zero._get_param_partition_rank(p) * part
                n = max(0, min(part, p.ds_numel - start))
                views = {key: zero._get_fp32_opt_state_partition(p, False, key)[0].narrow(0, 0, n)
                         for key in moments}
                views[MASTER_KEY] = zero._get_fp32_opt_state_partition(p, False)[0].detach().narrow(0, 0, n)
                fragments.append([(start, views)] if n else [])
            elif getattr(p, "_hp_mapping", None) is not None:  # ZeRO-1/2, bf16: this rank's fragment
                m = p._hp_mapping
                fragments.append([(m.lp_fragment_address.start,
                                   {**{key: m.get_optim_state_fragment(key) for key in moments},
                                    MASTER_KEY: m.get_hp_fragment().detach()})])
            elif replicated:  # no partitioning: the optimizer holds the parameter itself
                fragments.append([(0, {**{key: inner.state[p][key].view(-1) for key in moments},
                                       MASTER_KEY: p.detach().view(-1)})])
            else:
                fragments.append([])
        return OptimizerShard(numels, fragments, hyper, step, replicated, shapes, keys)

    def prepare_optimizer_shard(self, step: float | None, hyper: dict[str, Any]) -> OptimizerShard:
        """Create AdamW's state as its first step would (zeros at ``step``, on the flat partitions this
        rank owns; none for ``step`` None), link DeepSpeed's per-parameter views to it, set ``hyper``;
        → the slices to fill, the fp32 master's included."""
        if step is not None:
            self._create_state(step)
        for group in self._inner().param_groups:
            for key in HYPER_KEYS:
                if key in hyper and key in group:
                    group[key] = tuple(hyper[key]) if key == "betas" else hyper[key]
        return self.optimizer_shard()

    def _create_state(self, step: float) -> None:
        # torch AdamW creates its state lazily at the first step: create it on the flat partitions this
        # rank owns, then link DeepSpeed's per-parameter views (ZeRO-1/2) to it
        inner = self._inner()
        zero = self.model.optimizer
        flats = (getattr(zero, "fp32_partitioned_groups_flat", None)  # ZeRO-3 (param groups filled per step)
                 or [flat for group in inner.param_groups for flat in group["params"]])
        for flat in flats:
            inner.state[flat] = {"step": torch.tensor(step, dtype=torch.float32),
                                 "exp_avg": torch.zeros_like(flat), "exp_avg_sq": torch.zeros_like(flat)}
        if hasattr(zero, "_lazy_init_hp_params_optimizer_state"):  # ZeRO 1/2, bf16
            zero._hp_optimizer_states_linked = False
            zero._lazy_init_hp_params_optimizer_state()

    def load_optimizer_state(self, saved: dict[str, Any]) -> None:
        """A whole ``torch.optim.AdamW`` state dict (checkpoints written before sharding), set on every
        rank's partitions."""
        from deepspeed.utils import safe_set_full_optimizer_state
        inner = self._inner()
        params = self._params()
        if len(saved["param_groups"]) != 1 or len(saved["param_groups"][0]["params"]) != len(params):
            raise ValueError("optimizer state does not match the model: expected one AdamW group over "
                             f"{len(params)} parameters")
        for group in inner.param_groups:
            for key, value in saved["param_groups"][0].items():
                if key not in ("params", "lr"):
                    group[key] = value
        if not saved["state"]:
            return
        self._create_state(float(next(iter(saved["state"].values()))["step"]))
        for i, p in enumerate(params):
            for key in ("exp_avg", "exp_avg_sq"):
                safe_set_full_optimizer_state(p, saved["state"][i][key].to(self._device()).flatten(), key)

    def weights_from_master(self) -> None:
        """The bf16 module weights set to the rounding of the fp32 partitions (after the master was loaded
        into them), as DeepSpeed's own step ends: ZeRO-1/2 and the bf16 optimizer copy each rank's
        partition and all-gather the flat buffers; ZeRO-3 copies into each rank's partitions and gathers
        the persistent (small, never partitioned) parameters again. A collective."""
        zero = self.model.optimizer
        if hasattr(zero, "update_lp_params"):
            zero.update_lp_params()
        elif hasattr(zero, "fp32_partitioned_groups_flat"):
            zero._partition_all_parameters()
            for i in range(len(zero.fp16_groups)):
                zero._reassign_or_swap_out_partitioned_parameters(i)
            zero.checkpoint_event_epilogue()

    def offload(self) -> bool:
        """DeepSpeed's own ``offload_states`` (ZeRO's flat partitions, the fp32 master and the moments, its
        gradient buffers) to pinned host memory, on a GPU; the allocator's cache emptied. DeepSpeed's bf16
        optimizer (ZeRO-1 with bf16 weights and fp32 gradients) has no ``offload_states``: that trainer stays
        on the GPU (→ False), which ``sapd check``'s one-GPU plan does not assume: train ZeRO-1 on a GPU of its
        own (the cluster), or use the torch engine or ZeRO-2 with ``sapd run``."""
        if self._device().type == "cpu" or self._offloaded or not hasattr(self.model.optimizer, "offload_states"):
            return False
        self.model.offload_states()
        self._offloaded = True
        torch.cuda.empty_cache()
        return True

    def onload(self) -> bool:
        if not self._offloaded:
            return False
        self.model.reload_states()
        self._offloaded = False
        return True

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def world_size(self) -> int:
        return torch.distributed.get_world_size()

    @property
    def rank(self) -> int:
        return torch.distributed.get_rank()

    # -- what the distributed loop needs beyond TorchEngine's

    def _device(self) -> torch.device:
        from deepspeed.accelerator import get_accelerator
        return torch.device(get_accelerator().current_device_name())

    def all_reduce_sum(self, values: list[float]) -> list[float]:
        x = torch.tensor(values, dtype=torch.float64, device=self._device())
        torch.distributed.all_reduce(x)
        return x.tolist()

    def all_gather_object(self, obj: Any) -> list[Any]:
        out: list[Any] = [None] * self.world_size
        torch.distributed.all_gather_object(out, obj)
        return out

    def barrier(self) -> None:
        torch.distributed.barrier()

    def gather(self, params: list[torch.Tensor]) -> ContextManager[Any]:
        """``params`` whole for the block: ZeRO 1/2 keep full module weights on every rank already; ZeRO-3
        gathers just these partitions (a collective: every rank enters), so saving a checkpoint holds one
        shard at a time, never the whole model."""
        if self.cfg.train.zero_stage == 3:
            import deepspeed
            return deepspeed.zero.GatheredParameters(params, modifier_rank=None)
        return contextlib.nullcontext()


def load_partitioned(path: str, cfg: RunConfig):
    """The student for ``train.zero_stage: 3``, built partitioned: transformers constructs it inside
    ``deepspeed.zero.Init`` (while an ``HfDeepSpeedConfig`` of this run's config is alive) and loads
    each weight straight into its partitions, so no rank ever holds the whole model. The global
    ZeRO-3 switch is taken down again at once, so later loads (checkpoint 0 for the KL term) are
    ordinary models."""
    from transformers.integrations.deepspeed import HfDeepSpeedConfig, unset_hf_deepspeed_config
    init_distributed()
    hf_ds = HfDeepSpeedConfig(deepspeed_config(cfg, torch.distributed.get_world_size()))
    try:
        return load_causal_lm(path, dtype=cfg.precision(), trainable=True)
    finally:
        unset_hf_deepspeed_config()
        del hf_ds


def make_deepspeed_engine(model, cfg: RunConfig) -> DeepSpeedEngine:
    """DeepSpeed wraps :class:`sapd.models.scoring.HeadOnlyLM` around ``model`` where its head is a plain
    projection, so training projects to the vocabulary at response positions only (never the (B, S, V)
    logits), with every ZeRO stage's hooks in place; other families run the full forward."""
    import deepspeed
    init_distributed()
    ds_config = deepspeed_config(cfg, torch.distributed.get_world_size())
    wrapped = HeadOnlyLM(model) if decoder_and_head(model)[0] is not None else model
    ds_engine, _, _, _ = deepspeed.initialize(model=wrapped, model_parameters=wrapped.parameters(), config=ds_config)
    return DeepSpeedEngine(ds_engine, model, cfg)
