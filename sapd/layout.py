"""Where everything of one run lives under its root (docs/DESIGN.md "Storage layout"). One place, so the
local pipeline, the Kubernetes jobs and the report agree on every path.

```
config.yaml                            resolved config of the run
prefixes/{train,val}/part-*.parquet    + _MANIFEST.json files; prefixes/_MANIFEST.json commits the build
rounds/NNNNNN/scored/part-WWWWW.parquet  one per precompute worker, + _worker-WWWWW.json, _MANIFEST.json last
checkpoints/NNNNNN/model/              HF format (config, safetensors, tokenizer)
checkpoints/NNNNNN/state/              trainer state (optimizer, scheduler, RNG, cursor); _COMMITTED last
logs/round-NNNNNN.jsonl                per-step training log of a round (written with its checkpoint)
evals/NNNNNN/<benchmark>.json
validation/NNNNNN.json                 checkpoint k's distance to the teacher on prefixes/val (written last)
validation/NNNNNN/part-WWWWW.json      one per teacher-scores worker, merged into the file above
validation/teacher/part-WWWWW.json     the teacher's own samples on the same prefixes (once per run)
```
Checkpoint k is the policy that samples round k (π_old of round k); training round k writes k+1.
"""

from __future__ import annotations

from sapd import storage


def config_uri(root: str) -> str:
    return storage.join(root, "config.yaml")


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


def round_log_uri(root: str, k: int) -> str:
    return storage.join(root, "logs", f"round-{k:06d}.jsonl")


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
