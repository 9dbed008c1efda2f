"""What this process runs on, as the run config's ``auto`` values need it (:func:`sapd.config.resolve_auto`):
whether torch sees a CUDA device (and whether it computes in bfloat16), whether vLLM is installed, and
torchrun's ``LOCAL_RANK``. :func:`detect` reads this machine; :func:`planned` describes a GPU machine that
is not there (``sapd check --gpu-memory``: capacity planning before renting one).

torch is imported only inside :func:`detect`, so the config module stays cheap to import; vLLM is looked up,
never imported.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from functools import lru_cache


@dataclass(frozen=True)
class Platform:
    cuda: bool  # torch sees at least one CUDA device
    gpus: int = 0  # how many
    bf16: bool = False  # the GPU computes in bfloat16 (compute capability 8.0 or newer)
    vllm: bool = False  # vLLM is installed (the `vllm` package, or vLLM's CPU build, which imports as vllm)
    local_rank: int | None = None  # torchrun's LOCAL_RANK: the GPU this rank takes
    gpu_name: str = ""
    where: str = "this machine"  # "this machine", or how a planned one was described

    def describe_gpus(self) -> str:
        if not self.cuda:
            return "no CUDA device"
        name = f" {self.gpu_name}" if self.gpu_name else ""
        return f"{self.gpus} CUDA device{'s' if self.gpus != 1 else ''}{name}"


def vllm_installed() -> bool:
    try:
        return importlib.util.find_spec("vllm") is not None
    except (ImportError, ValueError):
        return False


def local_rank(env: dict[str, str] | None = None) -> int | None:
    value = (os.environ if env is None else env).get("LOCAL_RANK", "")
    return int(value) if value.isdigit() else None


@lru_cache(maxsize=1)
def detect() -> Platform:
    """This process's platform, read once (``detect.cache_clear()`` reads it again). CUDA as torch sees it
    (``torch.cuda.is_available``); bfloat16 from the compute capability of the GPU this rank takes
    (``LOCAL_RANK``, else the first), read from its properties, which allocates nothing on it."""
    import torch

    rank = local_rank()
    gpus = int(torch.cuda.device_count()) if torch.cuda.is_available() else 0
    if gpus == 0:
        return Platform(False, 0, False, vllm_installed(), rank)
    props = torch.cuda.get_device_properties(rank if rank is not None and rank < gpus else 0)
    return Platform(True, gpus, props.major >= 8, vllm_installed(), rank, str(props.name))


def planned(gpus: int = 1, *, vllm: bool = True, bf16: bool = True, gpu_name: str = "") -> Platform:
    """A GPU machine that is not this one (``sapd check --gpu-memory N``): CUDA devices that compute in
    bfloat16, vLLM installed (``pip install 'sapd[vllm]'`` there) unless ``vllm`` is False."""
    return Platform(True, gpus, bf16, vllm, None, gpu_name, where="planned")
