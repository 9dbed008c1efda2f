"""ALFWorld games for the tests: generated once with ``sapd alfworld-games`` (the user's command) into the
ignored ``.cache/alfworld-games/`` of the checkout, one folder per generator version, seed and size, so a
second session (or a second test module) finds them ready. Test processes running side by side (pytest-xdist's
workers) take turns on a folder: one generates, the other then finds it ready."""

from __future__ import annotations

import contextlib
import fcntl
from pathlib import Path
from typing import Iterator

from sapd.cli import main
from sapd.envs.alfworld_games import GENERATOR_VERSION, generate_split, read_manifest

REPO = Path(__file__).resolve().parents[1]
CACHE = REPO / ".cache" / "alfworld-games"


@contextlib.contextmanager
def _one_generator(root: Path) -> Iterator[None]:
    """Hold ``root``'s lock file while generating into it (another test process waits, then finds it done);
    closing the file releases the lock."""
    CACHE.mkdir(parents=True, exist_ok=True)
    with open(CACHE / f".{root.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def generated_games(split: str = "valid_unseen", per_type: int = 1, seed: int = 0) -> Path:
    """An ALFWORLD_DATA folder holding ``split`` with ``per_type`` games of each of the six task types."""
    root = CACHE / f"v{GENERATOR_VERSION}-seed{seed}-per{per_type}"
    with _one_generator(root):
        done = read_manifest(root, split)
        if done is None or done.get("per_type") != per_type:
            code = main(["alfworld-games", "--out", str(root), "--split", split, "--per-type", str(per_type),
                         "--seed", str(seed), "--no-progress"])
            assert code == 0, f"sapd alfworld-games failed with exit code {code}"
    return root


def generated_type(task_type: str, per_type: int, seed: int = 0, split: str = "valid_unseen") -> Path:
    """An ALFWORLD_DATA folder holding only ``task_type`` games (the generator's own task-type filter)."""
    root = CACHE / f"v{GENERATOR_VERSION}-seed{seed}-{task_type}-per{per_type}"
    with _one_generator(root):
        generate_split(root, split, per_type, seed, task_types=(task_type,), log=lambda s: None,
                       show_progress=False)
    return root
