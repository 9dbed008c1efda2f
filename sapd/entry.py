"""What the two front doors share — the ``sapd`` command line and the ``jobs/*`` entry points the chart
runs: one exit-code map, one error handler, and the flags that pick an evaluation panel.

Exit codes (the chart's podFailurePolicy keys on them):

- 0 done (or nothing to do);
- 1 a stage kept failing (the pipeline driver gave up after its retries);
- 2 a user error: bad config or input, a missing input, mismatched tokenizers — fix it and run again;
  retrying as is cannot help;
- 3 the Kubernetes API refused or kept failing, or a bounded wait ran out (the pipeline driver);
- 75 a service was unreachable (object storage down, …): transient, worth retrying.
"""

from __future__ import annotations

import argparse
import gc
import sys
from typing import Callable

from sapd.config import ConfigError, RunConfig, load_config
from sapd.data.errors import InvalidRecordError
from sapd.data.shards import ShardError
from sapd.envs.panels import PanelSpec
from sapd.method.benchmarks import BENCHMARKS
from sapd.models.loading import TokenizerMismatch
from sapd.models.scoring import TeacherScoringError
from sapd.storage import StorageError, StorageUnavailable

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USER_ERROR = 2
EXIT_KUBE = 3
EXIT_UNAVAILABLE = 75  # EX_TEMPFAIL (sysexits.h)

USER_ERRORS: tuple[type[BaseException], ...] = (
    InvalidRecordError, ShardError, StorageError, ConfigError, TokenizerMismatch, TeacherScoringError,
    FileNotFoundError, ValueError)


def exit_code(e: BaseException) -> int | None:
    """The exit code of an error a front door reports in one line; None for a bug (let it raise)."""
    code = getattr(e, "exit_code", None)  # the pipeline driver's errors carry their own
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


def add_config_flags(p: argparse.ArgumentParser, *, progress: bool = True, check: bool = True) -> None:
    """``--config`` (overlays), ``--run-root``, and optionally ``--no-progress`` and ``--no-check`` (skip the
    checks a job runs before its stage: :func:`sapd.run.check.preflight`)."""
    p.add_argument("--config", nargs="+", required=True, help="YAML overlays, applied in order over the defaults")
    p.add_argument("--run-root", default=None, help="override run_root (a folder or s3:// URI)")
    if progress:
        p.add_argument("--no-progress", action="store_true", help="no progress bars (plain log lines only)")
    if check:
        p.add_argument("--no-check", action="store_true",
                       help="skip the checks run before the stage (storage, inputs, models: see `sapd check`)")


def config_from_args(args: argparse.Namespace) -> RunConfig:
    """The run config of :func:`add_config_flags`' flags."""
    return load_config(*args.config, overrides={"run_root": args.run_root} if args.run_root else None)


# ---------------------------------------------------------------------------------------------------
# evaluation panels as flags


def _names(value: str | None) -> tuple[str, ...] | None:
    return tuple(f.strip() for f in value.split(",") if f.strip()) if value else None


def add_panel_flags(p: argparse.ArgumentParser, *, benchmark_default: str | None = "textworld") -> None:
    """The flags of :class:`~sapd.envs.panels.PanelSpec` (and the environment deadline)."""
    p.add_argument("--benchmark", default=benchmark_default, choices=sorted(BENCHMARKS))
    p.add_argument("--families", default=None, help="comma-separated TextWorld families (default: all)")
    p.add_argument("--games-per-family", type=int, default=2)
    p.add_argument("--seed", type=int, default=0, help="panel seed: the same seed, the same games")
    p.add_argument("--cache", default=None, help="game cache folder (default .cache/textworld)")
    p.add_argument("--tasks", default=None, help="ScienceWorld: comma-separated task names (default: all 30)")
    p.add_argument("--variations-per-task", type=int, default=2, help="ScienceWorld: variations per task")
    p.add_argument("--split", choices=["train", "dev", "test", "all", "valid_seen", "valid_unseen"], default="test",
                   help="ScienceWorld: which variations to draw from; ALFWorld: train | valid_seen (= dev) | "
                        "valid_unseen (= test, the default)")
    p.add_argument("--rows", default=None, help="search QA: Search-R1 rows (JSONL/Parquet) to ask")
    p.add_argument("--retriever-url", default=None, help="search QA: a Search-R1 /retrieve server")
    p.add_argument("--limit", type=int, default=None, help="search QA / ALFWorld / WebShop: at most this many episodes")
    p.add_argument("--alfworld-data", "--data-dir", dest="data_dir", default=None, metavar="DIR",
                   help="ALFWorld: the data folder holding json_2.1.1/<split>/ (default $ALFWORLD_DATA, else "
                        "~/.cache/alfworld)")
    p.add_argument("--webshop-url", default=None, help="WebShop: the server (default http://127.0.0.1:3000)")
    p.add_argument("--env-timeout", type=float, default=300.0, metavar="SECONDS",
                   help="each episode's environment runs in its own process; a call that takes longer is "
                        "killed and the environment rebuilt (default 300; 0 = in-process, no deadline)")


def panel_from_args(args: argparse.Namespace, benchmark: str | None = None) -> PanelSpec:
    return PanelSpec(benchmark=benchmark or args.benchmark, families=_names(args.families),
                     games_per_family=args.games_per_family, seed=args.seed, cache_dir=args.cache,
                     tasks=_names(args.tasks), variations_per_task=args.variations_per_task, split=args.split,
                     rows=args.rows, retriever_url=args.retriever_url, limit=args.limit, data_dir=args.data_dir,
                     webshop_url=args.webshop_url)


def env_timeout(args: argparse.Namespace) -> float | None:
    return args.env_timeout if args.env_timeout and args.env_timeout > 0 else None
