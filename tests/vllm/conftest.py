"""The vLLM backend's tests: run only inside ``.venv-vllm`` (``scripts/setup_vllm_venv.sh``), with

    .venv-vllm/bin/python -m pytest tests/vllm -p no:cacheprovider -q -o addopts=""

The main suite ignores this folder (``--ignore=tests/vllm``). Nothing here skips when vLLM is
missing: the test module imports it at the top, so the wrong environment fails at collection.

The environment is set before vLLM is first imported (it reads these lazily, at engine start):
each engine core runs in its own process, vLLM's default and what the pods and ``sapd run`` run (an
in-process engine once hid that every weight sync failed there: a function shipped to the workers,
which the engine's process refuses to unpickle), no usage reporting, nothing fetched from a hub.
"""

from __future__ import annotations

import os

import pytest

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"  # vLLM's default, as the pods and `sapd run` run it
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
os.environ.setdefault("DO_NOT_TRACK", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "vllm: needs vLLM installed (run in .venv-vllm: scripts/setup_vllm_venv.sh)")
