"""What sapd runs inside vLLM's workers: :class:`~sapd.models.vllm_worker.SapdWorkerExtension`, given to every
engine sapd starts (``worker_extension_cls``, :func:`sapd.models.vllm_backend.make_llm`). vLLM mixes it into its
worker class in the engine's own process, so the driver calls its methods **by name** through
``LLM.collective_rpc``, as verl and OpenRLHF do. Nothing sapd sends a worker is code: a function shipped through
``collective_rpc`` would be pickled, which vLLM's engine process refuses unless
``VLLM_ALLOW_INSECURE_SERIALIZATION=1`` (its default engine, in its own process, raised ``TypeError: Object of type
<class 'function'> is not serializable`` at the first weight sync). The arguments are plain data: file paths.

The methods:

* :meth:`SapdWorkerExtension.sapd_install_checkpoint_engine` gives the worker sapd's weight-transfer
  engine (:func:`checkpoint_engine_class`) unless it was built with another one; vLLM's own
  ``start_weight_update`` / ``update_weights`` / ``finish_weight_update`` then drive it, one call per
  safetensors shard of the checkpoint folder.
* :meth:`SapdWorkerExtension.sapd_repack_cpu_gemms` rebuilds the packed GEMMs of the CPU backend's linear
  layers whose weight stays materialised (a tied LM head), after a weight update.

This module imports vLLM only inside the methods, so that it imports where vLLM is not installed (the
main environment's documentation and import checks).
"""

from __future__ import annotations

from typing import Any

CHECKPOINT_BACKEND = "sapd_checkpoint"
"""The name of sapd's weight-transfer engine (the data plane: a local checkpoint folder's shards)."""

EXTENSION = f"{__name__}.SapdWorkerExtension"
"""The qualified name vLLM imports in each worker (``worker_extension_cls``)."""


def checkpoint_engine_class() -> type:
    """sapd's vLLM weight-transfer engine (defined on first use in the process that needs it: vLLM is
    imported lazily). Its update info names safetensors files of a local checkpoint folder; each
    ``update_weights`` loads them into the model under vLLM's layerwise reload, which
    ``start_weight_update`` opens and ``finish_weight_update`` closes (weights processed into kernel format
    per layer as its last tensor arrives)."""
    global _ENGINE_CLASS
    if _ENGINE_CLASS is not None:
        return _ENGINE_CLASS
    from dataclasses import dataclass, field

    import torch
    from vllm.distributed.weight_transfer.base import (
        WeightTransferEngine,
        WeightTransferInitInfo,
        WeightTransferUpdateInfo,
    )

    @dataclass
    class CheckpointInitInfo(WeightTransferInitInfo):
        pass

    @dataclass
    class CheckpointUpdateInfo(WeightTransferUpdateInfo):
        files: list[str] = field(default_factory=list)

    class CheckpointWeightTransferEngine(WeightTransferEngine):
        init_info_cls = CheckpointInitInfo
        update_info_cls = CheckpointUpdateInfo
        supports_draft_weight_update = False

        def init_transfer_engine(self, init_info: Any) -> None:
            pass  # no rendezvous: the data plane is a folder on this machine

        def start_weight_update(self) -> None:
            from vllm.model_executor.model_loader.reload import initialize_layerwise_reload
            initialize_layerwise_reload(self.model)

        def finish_weight_update(self) -> None:
            from vllm.model_executor.model_loader.reload import finalize_layerwise_reload
            finalize_layerwise_reload(self.model, self.model_config)

        def update_weights(self, update_info: dict[str, Any]) -> None:
            self.receive_weights(self.parse_update_info(update_info))
            accelerator = getattr(torch, "accelerator", None)
            if accelerator is not None and accelerator.is_available():
                accelerator.synchronize()

        def receive_weights(self, update_info: Any) -> None:
            from safetensors import safe_open
            for path in update_info.files:
                with safe_open(path, framework="pt", device="cpu") as st:
                    self.model.load_weights((name, st.get_tensor(name)) for name in st.keys())

        def shutdown(self) -> None:
            pass

    _ENGINE_CLASS = CheckpointWeightTransferEngine
    return _ENGINE_CLASS


_ENGINE_CLASS: type | None = None


class SapdWorkerExtension:
    """Mixed into vLLM's worker class (``self`` is the worker). Method names carry the ``sapd_`` prefix:
    vLLM refuses an extension whose names collide with the worker's own."""

    # attributes of vLLM's worker this class reads
    weight_transfer_engine: Any
    vllm_config: Any
    device: Any
    model_runner: Any

    def sapd_install_checkpoint_engine(self) -> bool:
        """Give this worker sapd's weight-transfer engine unless it has another one (the engine was built
        with its own ``weight_transfer_config``). → whether vLLM's native update session can be used."""
        if not hasattr(self, "start_weight_update"):
            return False
        engine_class = checkpoint_engine_class()
        current = getattr(self, "weight_transfer_engine", None)
        if current is None:
            from vllm.config.weight_transfer import WeightTransferConfig
            self.weight_transfer_engine = engine_class(WeightTransferConfig(backend=CHECKPOINT_BACKEND),
                                                       self.vllm_config, self.device, self.model_runner.get_model())
            return True
        return isinstance(current, engine_class)

    def sapd_repack_cpu_gemms(self) -> int:
        """After a weight update on the CPU backend: rebuild the packed GEMM of every linear layer whose weight
        is still materialised (a tied LM head, the embeddings), so that none keeps a handle packed from the
        old weights. Layers whose weight vLLM removed after packing were re-packed by the update itself.
        → how many layers were re-packed."""
        import torch
        from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

        n = 0
        for module in self.model_runner.get_model().modules():
            weight = getattr(module, "weight", None)
            if (not hasattr(module, "cpu_linear") or getattr(module, "_cpu_skip_gemm_dispatch", False)
                    or not isinstance(weight, torch.Tensor) or weight.ndim != 2 or weight.numel() == 0):
                continue
            dispatch_cpu_unquantized_gemm(module, remove_weight=False)
            n += 1
        return n
