"""A complete tiny run: a real tokenizer, a tiny Qwen2 student and a different tiny teacher (same
tokenizer), the shipped ALFWorld sample as data, and a config small enough for seconds on a CPU."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from tests.tokenizer_util import SAMPLE_DATA, build_test_tokenizer

REPO = Path(__file__).resolve().parents[1]


def cpu_ranks_env() -> dict[str, str]:
    """The environment of DeepSpeed processes on the CPU: gloo (``DS_ACCELERATOR=cpu``), one thread each that
    sleeps while it waits, this checkout on the path, DeepSpeed's JIT-built op cached in ``.cache``."""
    return {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE",
            "PYTHONPATH": str(REPO), "TORCH_EXTENSIONS_DIR": os.environ.get(
                "TORCH_EXTENSIONS_DIR", str(REPO / ".cache" / "torch_extensions"))}


_WHY = ("terminate called", "what():", "Fatal Python error", "Error", "error:", "Exception", "Killed", "Aborted",
        "exitcode", "Signal ")


def why_lines(text: str | list[str], last: int) -> list[str]:
    """The last ``last`` lines of ``text`` that say why a process ended (a C++ ``terminate … what()``, a fatal
    Python error, an exception, an exit signal), stripped: what a failure message repeats at its end."""
    lines = text.splitlines() if isinstance(text, str) else text
    return [ln.strip() for ln in lines if any(w in ln for w in _WHY)][-last:]


def ranks_failed(proc: subprocess.CompletedProcess, limit: int = 6000) -> str:
    """What a failed multi-rank run printed, for an assertion message: its last ``limit`` characters without
    torchrun's own traceback (its Root Cause block stays), then once more the lines that say why (a C++
    ``terminate … what()``, a fatal Python error, an exception, the ranks' exit signals) — last, where a CI
    log cut to its tail still shows them (a rank that aborted in CI left only torchrun's traceback there)."""
    text = (proc.stdout or "") + (proc.stderr or "")
    lines = text.splitlines()
    out = lines
    end = max((i for i, ln in enumerate(lines) if ln.startswith("torch.distributed.elastic.multiprocessing.errors."
                                                                 "ChildFailedError")), default=None)
    if end is not None:  # the agent's own stack (how torchrun raised, not why a rank died) goes
        start = max((i for i, ln in enumerate(lines[:end]) if ln.startswith("Traceback (most recent call last)")),
                    default=end)
        out = lines[:start] + lines[end + 1:]
    return "\n".join(out)[-limit:] + "\n-- why, as the ranks and torchrun said it --\n" + "\n".join(why_lines(out, 12))


def ranks_command(args: list[str], ranks: int, torchrun: bool | None = None) -> list[str]:
    """``python ARGS`` as one plain process, or under torchrun as ``ranks`` processes (a free port on
    127.0.0.1); ``torchrun`` (default: more than one rank) forces the choice."""
    if not (ranks > 1 if torchrun is None else torchrun):
        return [sys.executable, *args]
    from tests.conftest import free_port
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks), "--master_addr",
            "127.0.0.1", "--master_port", str(free_port()), *args]


def run_rank_worker(script: str, jobs: list[dict], out: Path, ranks: int, torchrun: bool | None = None) -> list[list[dict]]:
    """A worker of the tests (``tests/<script>``: a JSON list of jobs, each rank writing ``{out}.rank{r}.json``)
    on ``ranks`` CPU processes (:func:`ranks_command`); → every rank's results, in rank order."""
    import json
    import subprocess
    cmd = ranks_command([str(REPO / "tests" / script), json.dumps(jobs), str(out)], ranks, torchrun)
    proc = subprocess.run(cmd, cwd=REPO, env=cpu_ranks_env(), capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, ranks_failed(proc)
    return [json.loads(Path(f"{out}.rank{r}.json").read_text()) for r in range(ranks)]


def wait_together(procs: dict[str, subprocess.Popen], timeout_s: float, poll_s: float = 0.2) -> None:
    """Wait for processes started together that wait on each other's commits (the persistent stage doors): the
    first to fail, or the timeout, stops the others, which would otherwise poll for their input until their own
    bound. On return every one has exited; their exit codes are the caller's to check."""
    deadline = time.monotonic() + timeout_s
    try:
        while any(p.poll() is None for p in procs.values()):
            if any(p.returncode not in (None, 0) for p in procs.values()) or time.monotonic() > deadline:
                break
            time.sleep(poll_s)
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()


def make_models(root: Path) -> tuple[str, str]:
    from sapd.models.tiny import build_tiny_model
    tok = build_test_tokenizer(root / "tokenizer")
    student, teacher = root / "student", root / "teacher"
    if not (student / "config.json").exists():
        build_tiny_model(tok, student, seed=0)
        build_tiny_model(tok, teacher, seed=1)
    return str(student), str(teacher)


def tiny_config(run_root: str, student: str, teacher: str, **over: Any) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "run_root": run_root,
        "variant": "sapd",
        "data": {"input": str(SAMPLE_DATA / "alfworld_eto.json"), "format": "eto", "benchmark": "alfworld",
                 "max_prompt_tokens": 2048},
        "model": {"student": student, "teacher": teacher},
        "sampling": {"group_size": 2, "max_new_tokens": 12, "prompts_per_batch": 4},
        "train": {"rounds": 2, "trajectories_per_round": 2, "minibatch_prefixes": 4, "micro_batch_prefixes": 2,
                  "lr": 1e-3, "seed": 0},
    }
    for k, v in over.items():
        if isinstance(v, dict):
            cfg.setdefault(k, {}).update(v)
        else:
            cfg[k] = v
    return cfg
