"""What the two front doors share — the ``sapd`` command line and the ``sapd/jobs/*`` entry points the chart
runs: one exit-code map, one error handler and the run-config flags. (A stage's job is one call of
:func:`sapd.run.job.stage_main`; the evaluation panel's flags are in :mod:`sapd.panel_flags`.)

Exit codes (the chart's podFailurePolicy keys on them):

- 0 done (or nothing to do);
- 1 a stage kept failing (the pipeline driver gave up after its retries);
- 2 a user error: bad config or input, a missing input, mismatched tokenizers, a stored file that is not
  what was committed, a run root whose lease another run holds — fix it and run again; retrying as is
  cannot help;
- 3 the Kubernetes API refused or kept failing, or a bounded wait ran out (the pipeline driver);
- 75 a service was unreachable (object storage down past ``storage.retry_deadline_s``, …): transient,
  worth retrying.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
from typing import Callable

from sapd.config import ConfigError, RunConfig, apply_storage_settings, load_config
from sapd.data.errors import InvalidRecordError
from sapd.data.shards import ShardError
from sapd.storage import StorageError, StorageUnavailable

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USER_ERROR = 2
EXIT_KUBE = 3
EXIT_UNAVAILABLE = 75  # EX_TEMPFAIL (sysexits.h)

# (mismatched tokenizers are a ValueError; the teacher's scoring errors and the pipeline driver's carry
# their own exit_code)
USER_ERRORS: tuple[type[BaseException], ...] = (
    InvalidRecordError, ShardError, StorageError, ConfigError, FileNotFoundError, ValueError)


def exit_code(e: BaseException) -> int | None:
    """The exit code of an error a front door reports in one line; None for a bug (let it raise)."""
    code = getattr(e, "exit_code", None)  # errors that know their own code
    if isinstance(code, int):
        return code
    if isinstance(e, StorageUnavailable):
        return EXIT_UNAVAILABLE
    if isinstance(e, USER_ERRORS):
        return EXIT_USER_ERROR
    return None


def run_main(prog: str, fn: Callable[[], int | None]) -> int:
    """Run a front door's body: its return value (None = 0), or one ``prog: error: …`` line on stderr and
    the error's exit code. Anything else is a bug and raises with its traceback."""
    try:
        rc = fn()
        return EXIT_OK if rc is None else rc
    except Exception as e:
        code = exit_code(e)
        if code is None:
            raise
        print(f"{prog}: error: {e}", file=sys.stderr, flush=True)
        if isinstance(e, InvalidRecordError):
            print("(pass --skip-invalid to skip such records; each is counted and reported)", file=sys.stderr)
        return code
    finally:
        # join Arrow's background threads while Arrow is still alive, not in the interpreter's final
        # teardown, where they can abort the process after the work is done (apache/arrow#34314)
        gc.collect()


def log_line(line: str) -> None:
    """How front doors log: one flushed line on stdout (what `kubectl logs` shows)."""
    print(line, flush=True)


# ---------------------------------------------------------------------------------------------------
# the run-config flags every job takes


def add_config_flags(p: argparse.ArgumentParser, *, progress: bool = True, check: bool = True,
                     takeover: bool = True) -> None:
    """``--config`` (overlays), ``--run-root``, and optionally ``--no-progress``, ``--no-check`` (skip the
    checks a job runs before its stage: :func:`sapd.run.check.preflight`) and ``--force-takeover``."""
    p.add_argument("--config", nargs="+", required=True, help="YAML overlays, applied in order over the defaults")
    p.add_argument("--run-root", default=None, help="override run_root (a folder or s3:// URI)")
    if progress:
        p.add_argument("--no-progress", action="store_true", help="no progress bars (plain log lines only)")
    if check:
        p.add_argument("--no-check", action="store_true",
                       help="skip the checks run before the stage (storage, inputs, models: see `sapd check`)")
    if takeover:
        add_takeover_flag(p)


def add_takeover_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--force-takeover", action="store_true",
                   help="take the run root's lease even from a live holder (only when you know that run is dead "
                        "or must stop: docs/FAULTS.md)")


def config_from_args(args: argparse.Namespace, *, announce: bool = True) -> RunConfig:
    """The run config of :func:`add_config_flags`' flags; its storage settings (how long storage operations
    retry) apply to this process from here on. ``announce``: the values this process resolved from "auto"
    (``model.device``, ``model.dtype``, ``sampling.backend``) and why are the first lines it logs, on the
    main rank (every stage pod's log opens with them)."""
    cfg = load_config(*args.config, overrides={"run_root": args.run_root} if args.run_root else None)
    apply_storage_settings(cfg)
    if announce and int(os.environ.get("RANK", "0") or 0) == 0:
        for line in cfg.auto_lines():
            log_line(f"config: {line}")
    return cfg

