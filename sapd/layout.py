"""Where everything of one run lives under its root: the one listing of those files is
docs/reference/run-root.md (checked against these functions by tests/house/test_generated_refs.py). One place, so
the local pipeline, the Kubernetes jobs and the report agree on every path.

Checkpoint k is the policy that samples round k (π_old of round k); training round k writes k+1.
"""

from __future__ import annotations

import re

from sapd import storage


def config_uri(root: str) -> str:
    return storage.join(root, "config.yaml")


def lease_uri(root: str) -> str:
    return storage.join(root, "_LEASE.json")


def prefixes_dir(root: str) -> str:
    return storage.join(root, "prefixes")


def round_dir(root: str, k: int) -> str:
    return storage.join(root, "rounds", f"{k:06d}")


def scored_dir(root: str, k: int) -> str:
    return storage.join(round_dir(root, k), "scored")


def checkpoint_dir(root: str, k: int) -> str:
    return storage.join(root, "checkpoints", f"{k:06d}")


def checkpoint_model_dir(root: str, k: int) -> str:
    return storage.join(checkpoint_dir(root, k), "model")


def checkpoint_state_dir(root: str, k: int) -> str:
    return storage.join(checkpoint_dir(root, k), "state")


def checkpoint_marker(root: str, k: int) -> str:
    return storage.join(checkpoint_state_dir(root, k), "_COMMITTED")


_MODEL_DIR = re.compile(r"^(?P<root>.+)/checkpoints/(?P<k>[0-9]{6})/model/?$")


def checkpoint_of_model_dir(uri: str) -> tuple[str, int] | None:
    """(run root, k) when ``uri`` is checkpoint k's model folder (:func:`checkpoint_model_dir`), else None."""
    m = _MODEL_DIR.match(uri)
    return (m.group("root"), int(m.group("k"))) if m else None


def round_log_uri(root: str, k: int) -> str:
    return storage.join(root, "logs", f"round-{k:06d}.jsonl")


def pushed_metrics_uri(root: str, group: str, step: str) -> str:
    """The figures ``step`` (e.g. ``train-r3``) pushed to the Pushgateway group ``group`` (``train``,
    ``teacher_scores-1``), in the Prometheus text format."""
    return storage.join(root, "metrics", group, f"{step}.prom")


def evals_dir(root: str, k: int) -> str:
    return storage.join(root, "evals", f"{k:06d}")


def validation_uri(root: str, k: int) -> str:
    return storage.join(root, "validation", f"{k:06d}.json")


def validation_part_uri(root: str, k: int, worker: int) -> str:
    return storage.join(root, "validation", f"{k:06d}", f"part-{worker:05d}.json")


def teacher_validation_part_uri(root: str, worker: int) -> str:
    return storage.join(root, "validation", "teacher", f"part-{worker:05d}.json")


def committed_checkpoints(root: str) -> list[int]:
    """Indices of every checkpoint whose commit marker exists, ascending."""
    out = []
    for uri in storage.list_files(storage.join(root, "checkpoints")):
        if uri.endswith("/state/_COMMITTED"):
            out.append(int(uri.split("/")[-3]))
    return sorted(out)
