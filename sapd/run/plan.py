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
executor runs a step, then asks again. :func:`input_step` says which step's output a step needs, so a
worker that runs steps as their inputs appear (the cluster's persistent workers, a manual-mode gate)
waits for exactly that commit: checkpoint :func:`~sapd.config.sampler_checkpoint` (k, or k−1 with
``train.overlap: one_step``) for teacher-scores k, round k's scored manifest for train k.
"""

from __future__ import annotations

import time
from typing import Callable

from sapd import checkpoints, layout, storage
from sapd.config import RunConfig, sampler_checkpoint
from sapd.data import scored, shards, validation
from sapd.entry import EXIT_UNAVAILABLE
from sapd.method.objective import objective_of
from sapd.stages.context import STAGE_NAMES, StageName, Step

Stage = StageName  # the plan's steps are the stages' (sapd.stages.context)
STAGES = STAGE_NAMES
__all__ = ["STAGES", "InputNotCommitted", "Stage", "Step", "checkpoint_step", "eval_uri", "fmt_seconds", "input_step",
           "missing", "next_step", "steps", "wait_for_input"]


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


def input_step(cfg: RunConfig, step: Step) -> Step | None:
    """The step whose committed output ``step`` needs (None for build-prefixes): for teacher-scores k, the
    step that commits the checkpoint sampling round k (:func:`~sapd.config.sampler_checkpoint`: checkpoint
    k, or k−1 with ``train.overlap: one_step``); round k's scored manifest for train k (for the sft
    objective, which scores nothing, checkpoint k); checkpoint k for the evaluation of checkpoint k."""
    if step.stage == "build-prefixes":
        return None
    k = step.round
    assert k is not None
    if step.stage == "train" and objective_of(cfg.loss_cfg).data != "recorded":
        return Step("teacher-scores", k)
    if step.stage == "teacher-scores":
        k = sampler_checkpoint(cfg, k)
    return checkpoint_step(k)


class InputNotCommitted(Exception):
    """A step's input stayed uncommitted past the wait's bound: exit 75, worth a retry (sapd.entry)."""
    exit_code = EXIT_UNAVAILABLE


def fmt_seconds(seconds: float) -> str:
    """``0m42s``, ``12m05s``, ``1h02m03s``: how the waits and the driver say durations."""
    s = int(seconds)
    return f"{s // 3600}h{s % 3600 // 60:02d}m{s % 60:02d}s" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


def checkpoint_step(k: int) -> Step:
    """The step that commits checkpoint k: the prefix build for checkpoint 0 (the initial student), else
    train k−1."""
    return Step("build-prefixes") if k == 0 else Step("train", k - 1)


def wait_for_input(cfg: RunConfig, step: Step, *, poll_seconds: float, log: Callable[[str], None],
                   log_every_seconds: float = 30.0, timeout_seconds: float | None = None,
                   sleep: Callable[[float], None] = time.sleep, clock: Callable[[], float] = time.monotonic,
                   storage_attempts: int = 5, need: Step | None = None,
                   expect_seconds: float | None = None) -> float | None:
    """Wait until ``step``'s input (:func:`input_step`, or ``need``'s output when given) is committed,
    polling every ``poll_seconds``: a line when it has to wait, one every ``log_every_seconds`` while it
    does, one when it may go on (nothing when the input is committed already). A storage error is retried a
    few times. Past ``timeout_seconds``: :class:`InputNotCommitted`. → seconds waited (None: the step needs
    no input). The persistent stage workers wait this way before each round, the chart's manual-mode gates
    before creating their Job.

    ``expect_seconds``: how long the wait is likely to take (a persistent worker passes its previous round's
    wait: the other stage's round). Around then — from 0.8× it less one poll to 1.5× it plus one poll — the
    checks come every ``poll_seconds`` / 10 (at most ten a second), so a hand-off between two workers costs
    at most a tenth of a poll (a twentieth on average) instead of up to a whole one; before and after that
    window, every ``poll_seconds``."""
    need = need or input_step(cfg, step)
    if need is None:
        return None
    start = last = clock()
    errors = 0
    first = True
    fast = max(FAST_POLL_MIN_SECONDS, poll_seconds / 10)
    lo, hi = ((max(0.0, 0.8 * expect_seconds - poll_seconds), 1.5 * expect_seconds + poll_seconds)
              if expect_seconds is not None else (0.0, -1.0))
    while True:
        try:
            why = missing(cfg, need)
            errors = 0
        except OSError as e:  # StorageError is an OSError: a hiccup is retried, a lasting failure raises
            errors += 1
            if errors >= storage_attempts:
                raise
            why = f"storage: {e}"
        now = clock()
        if why is None:
            if not first:
                log(f"stage {step}: its input ({need}) is committed after {fmt_seconds(now - start)}")
            return now - start
        if first:
            log(f"stage {step}: waiting for the output of {need} in {cfg.run_root}: {why}")
            first = False
        elif now - last >= log_every_seconds:
            log(f"stage {step}: still waiting ({fmt_seconds(now - start)}): {why}")
            last = now
        if timeout_seconds is not None and now - start > timeout_seconds:
            raise InputNotCommitted(f"stage {step}: its input ({need}) is still not committed after "
                                    f"{fmt_seconds(now - start)} (limit {fmt_seconds(timeout_seconds)}): {why}")
        sleep(_next_poll(now - start, poll_seconds, fast, lo, hi))


FAST_POLL_MIN_SECONDS = 0.1  # the shortest interval between two checks of an input, near its expected time


def _next_poll(elapsed: float, poll: float, fast: float, lo: float, hi: float) -> float:
    """Seconds until the next check of a waited-for input, ``elapsed`` into the wait: every ``fast`` inside
    the expected window [``lo``, ``hi``], every ``poll`` outside it, and no later than the window's start."""
    if lo <= elapsed <= hi:
        return fast
    if elapsed < lo:
        return max(fast, min(poll, lo - elapsed))
    return poll
