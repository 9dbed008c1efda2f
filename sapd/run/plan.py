"""The one plan of a run: which stage runs next is decided by what is committed in the run root.

Both executors follow it — :mod:`sapd.run.local` (``sapd run``: every stage in this process) and
:mod:`sapd.run.k8s` (the pipeline driver: every stage a Kubernetes Job) — so they cannot drift apart:

1. ``build-prefixes`` until the prefix build (``prefixes/_MANIFEST.json``) *and* checkpoint 0 are committed;
2. for each round k < ``train.rounds`` whose checkpoint k+1 is not committed:
   ``teacher-scores`` k until round k's scored manifest is committed (no such step for the ``sft``
   objective, which trains on the recorded responses), then ``train`` k until checkpoint k+1 is committed;
   the teacher-scores stage of round k also validates checkpoint k (:mod:`sapd.data.validation`) and
   commits that before the manifest;
3. ``teacher-scores`` R (R = ``train.rounds``) when the last checkpoint is validated: no round to score, only
   checkpoint R's distance to the teacher, until ``validation/R.json`` is written (nothing to do when the
   prefix build turned out to have no validation prefixes);
4. optionally ``evaluate`` R until ``evals/R/<benchmark>.json`` is written.

:func:`missing` says, in one line, what a step has not committed yet (None once it is done); an
executor runs a step, then asks again.
"""

from __future__ import annotations

from sapd import checkpoints, layout, storage
from sapd.config import RunConfig
from sapd.data import scored, shards, validation
from sapd.method.objective import objective_of
from sapd.stages.context import STAGE_NAMES, StageName, Step

Stage = StageName  # the plan's steps are the stages' (sapd.stages.context)
STAGES = STAGE_NAMES
__all__ = ["STAGES", "Stage", "Step", "eval_uri", "missing", "next_step", "steps"]


def steps(cfg: RunConfig, *, evaluate: bool = False) -> list[Step]:
    """Every step of the run, in order (done or not)."""
    out = [Step("build-prefixes")]
    scores = objective_of(cfg.loss_cfg).data == "scored"  # sft trains on the recorded responses: nothing to score
    for k in range(cfg.train.rounds):
        if scores:
            out.append(Step("teacher-scores", k))
        out.append(Step("train", k))
    if scores and validation.wanted(cfg, cfg.train.rounds):
        out.append(Step("teacher-scores", cfg.train.rounds))  # the last checkpoint's validation
    if evaluate:
        out.append(Step("evaluate", cfg.train.rounds))
    return out


def eval_uri(cfg: RunConfig, k: int) -> str:
    """The evaluation summary that marks checkpoint k as evaluated on the run's benchmark."""
    return storage.join(layout.evals_dir(cfg.run_root, k), f"{cfg.data.benchmark}.json")


def missing(cfg: RunConfig, step: Step) -> str | None:
    """What ``step`` has not committed yet, as one line; None when it is done."""
    root = cfg.run_root
    if step.stage == "build-prefixes":
        if shards.read_manifest(layout.prefixes_dir(root)) is None:
            return f"no prefix build committed in {layout.prefixes_dir(root)}"
        if not checkpoints.is_committed(root, 0):
            return f"checkpoint 0 (the initial student) is not committed in {layout.checkpoint_dir(root, 0)}"
        return None
    k = step.round
    assert k is not None
    if step.stage == "teacher-scores" and k >= cfg.train.rounds:  # the last checkpoint: validation only
        if validation.is_committed(root, k) or not validation.wanted(cfg, k):  # (no validation prefixes)
            return None
        return f"checkpoint {k}'s validation is not committed ({layout.validation_uri(root, k)})"
    if step.stage == "teacher-scores":
        if checkpoints.is_committed(root, k + 1) or scored.is_committed(root, k):
            return None  # a trained round needs no scores any more
        return f"round {k}'s scored manifest is not committed in {layout.scored_dir(root, k)}"
    if step.stage == "train":
        if checkpoints.is_committed(root, k + 1):
            return None
        return f"checkpoint {k + 1} is not committed in {layout.checkpoint_dir(root, k + 1)}"
    if step.stage == "evaluate":
        if storage.exists(eval_uri(cfg, k)):
            return None
        return f"no {cfg.data.benchmark}.json under {layout.evals_dir(root, k)}"
    raise ValueError(f"unknown stage {step.stage!r}")


def next_step(cfg: RunConfig, *, evaluate: bool = False) -> Step | None:
    """The first step that is not done, or None when the run is complete."""
    for step in steps(cfg, evaluate=evaluate):
        if missing(cfg, step) is not None:
            return step
    return None
