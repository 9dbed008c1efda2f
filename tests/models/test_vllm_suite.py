"""tests/vllm, run in its own environment as one test of the main suite (``make test``).

The vLLM backend's tests need ``.venv-vllm/`` (vLLM's CPU build and its own torch and transformers), so they
cannot be collected by the main suite's test processes. They used to run after the main suite, alone, for
≈ 6 minutes of CI's wall time; as one long test here they take one test process's turn while the other test
process goes on (the main suite is CPU-bound, so that costs about half of it), in the order of the durations
table (tests/conftest.py ``longest_first``).

Every test of tests/vllm runs exactly as ``make test-vllm`` runs them (the same command, from the checkout), and
this test fails with the tail of their output when one fails, errors or is skipped, or when none ran.
``SAPD_TEST_DURATIONS`` passes through, so their rows stay in the durations table (scripts/test_durations.py
leaves this file's row out of the totals: its time is theirs).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
VLLM_PYTHON = REPO / ".venv-vllm" / "bin" / "python"
COMMAND = ["-m", "pytest", "tests/vllm", "-p", "no:cacheprovider", "-q", "-o", "addopts="]  # = make test-vllm

pytestmark = pytest.mark.slow


def test_the_vllm_backends_tests_pass_in_the_vllm_environment(tmp_path):
    if not VLLM_PYTHON.exists():
        pytest.fail(f"{VLLM_PYTHON.parent.parent}: no vLLM environment; `make envs` (scripts/setup_vllm_venv.sh) "
                    "builds it")
    # not this test process's pytest settings (its xdist worker name, its current test): the run is its own
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    # vLLM leaves its engines' ZeroMQ sockets in TMPDIR (≈ 1000 a run): a folder of the run's own, removed after
    # it, short enough for a Unix socket's path (at most 107 bytes)
    scratch = tempfile.mkdtemp(prefix="sapd-vllm-tests-")
    log = tmp_path / "vllm-tests.log"
    try:
        with log.open("w") as out:
            rc = subprocess.run([str(VLLM_PYTHON), *COMMAND], cwd=REPO, env={**env, "TMPDIR": scratch}, stdout=out,
                                stderr=subprocess.STDOUT, timeout=1800).returncode
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    text = log.read_text(errors="replace")
    summary = text.strip().splitlines()[-1] if text.strip() else ""
    tail = "\n".join(text.splitlines()[-150:])
    counts = {word: int(n) for n, word in re.findall(r"(\d+) (passed|failed|errors?|skipped|xfailed|xpassed)",
                                                      summary)}
    assert rc == 0, f"tests/vllm in .venv-vllm exited {rc}:\n{tail}"
    assert counts.get("passed", 0) > 0 and set(counts) == {"passed"}, f"tests/vllm: {summary!r}\n{tail}"
