"""The device a process loads its models onto. Under torchrun every rank of a pod sees all of the pod's
GPUs, and ``model.device: cuda`` alone means cuda:0 to each of them: 8 ranks would each put a copy of
the student on GPU 0 before DeepSpeed moved it (and leave 7 CUDA contexts there). So the device comes
from ``LOCAL_RANK`` before any model is loaded, and the process's current CUDA device is set to it, as
DeepSpeed, the HF Trainer and verl do (docs/guides/scaling.md "Device placement").
"""

from __future__ import annotations

import os
from typing import Mapping

from sapd.config import ConfigError


def rank_device(device: str, env: Mapping[str, str] | None = None) -> str:
    """The device this process uses for ``model.device``: ``cuda`` becomes ``cuda:<LOCAL_RANK>`` when
    torchrun set ``LOCAL_RANK`` (a plain process: ``cuda`` stays cuda, i.e. the current device); an explicit
    ``cuda:N`` under torchrun with several ranks is refused unless N is this rank's, since every rank
    would otherwise share GPU N; ``cpu`` is ``cpu``.

    >>> rank_device("cuda", {"LOCAL_RANK": "3", "LOCAL_WORLD_SIZE": "8"})
    'cuda:3'
    >>> rank_device("cuda", {}), rank_device("cpu", {"LOCAL_RANK": "3"})
    ('cuda', 'cpu')
    """
    env = os.environ if env is None else env
    local = env.get("LOCAL_RANK", "")
    if not device.startswith("cuda") or not local.isdigit():
        return device
    if device == "cuda":
        return f"cuda:{int(local)}"
    index = device.split(":", 1)[1]
    if int(env.get("LOCAL_WORLD_SIZE", "1") or 1) > 1 and index != local:
        raise ConfigError(f"model.device: {device} under torchrun would put every rank on GPU {index}; set "
                          "model.device: cuda (each rank takes cuda:LOCAL_RANK)", "model.device")
    return device


def bind_rank_device(device: str) -> str:
    """:func:`rank_device`, made this process's current CUDA device (``torch.cuda.set_device``) before
    anything is allocated, so that every later ``.to("cuda")``, CUDA context and NCCL communicator of this
    rank lands on its own GPU. → the device to load onto."""
    resolved = rank_device(device)
    if resolved.startswith("cuda:"):
        import torch
        torch.cuda.set_device(torch.device(resolved))
    return resolved
