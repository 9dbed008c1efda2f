"""A vLLM worker extension whose weight updates hang: each shard takes 3 s to load. Named by its qualified
name (``worker_extension_cls="bench.slow_weight_sync.SlowShardExtension"``), so that vLLM imports it in the
engine's own process, where a monkeypatch of the caller's process would not reach: the weight sync's deadline
probe of bench/gpu_check.py (vllm_engine_reuse) and of tests/vllm/test_vllm_backend.py. The engine's process
must find this checkout on its path (run from the repository's root, or with it on PYTHONPATH)."""

from __future__ import annotations

import time
from typing import Any

from sapd.models.vllm_worker import SapdWorkerExtension, checkpoint_engine_class

SHARD_SECONDS = 3.0


class SlowShardExtension(SapdWorkerExtension):
    def sapd_install_checkpoint_engine(self) -> bool:
        base = checkpoint_engine_class()

        class SlowEngine(base):  # type: ignore[misc, valid-type]
            def receive_weights(self, update_info: Any) -> None:
                time.sleep(SHARD_SECONDS)
                super().receive_weights(update_info)

        from vllm.config.weight_transfer import WeightTransferConfig
        self.weight_transfer_engine = SlowEngine(WeightTransferConfig(backend="sapd_checkpoint"), self.vllm_config,
                                                 self.device, self.model_runner.get_model())
        return True
