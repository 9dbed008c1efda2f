"""The vLLM backend's tests: run only inside ``.venv-vllm`` (``scripts/setup_vllm_venv.sh``), with

    .venv-vllm/bin/python -m pytest tests/vllm -p no:cacheprovider -q -o addopts=""

The main suite ignores this folder (``--ignore=tests/vllm``). Nothing here skips when vLLM is
missing: the test module imports it at the top, so the wrong environment fails at collection.

The environment is set before vLLM is first imported (it reads these lazily, at engine start):
the engine core runs in this process (no spawned engine process re-importing pytest's ``__main__``,
and a second faster start), no usage reporting, nothing fetched from a hub.
"""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
os.environ.setdefault("DO_NOT_TRACK", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "vllm: needs vLLM installed (run in .venv-vllm: scripts/setup_vllm_venv.sh)")
