"""The Kubernetes executor (``python -m sapd.jobs.pipeline``, the pipeline driver): the run's plan
(:mod:`sapd.run.plan`, the same one ``sapd run`` follows) with every step run as a Kubernetes Job:
``build-prefixes``, then per round ``teacher-scores-r<k>`` (an Indexed Job, one pod per worker; the last
worker commits the round, and the driver commits it too if a Job completes with every part written)
and ``train-r<k>``, then ``evaluate-r<R>`` when the chart renders an evaluate template. With a ``stage``
(:meth:`Driver.run_stage`, ``sapd.jobs.pipeline --stage``: the chart's manual mode) it runs one step only,
after waiting — in its own small pod, holding no GPU — until that step's input is committed.

The stage manifests come from the chart (the ``pipeline-templates`` ConfigMap, one file per stage):
``__SAPD_ROUND__`` is replaced by the round, the driver adds its annotations (attempt, run root) and an
owner reference to an object of the release that every revision keeps (the ``pipeline-templates``
ConfigMap): ``helm upgrade`` replaces the driver Job, never the stage Job it started, which the next
driver adopts; ``helm uninstall`` removes the ConfigMap and with it every stage Job.

Idempotent: a stage Job that already exists (a restarted or replaced driver, or a second driver racing —
409 AlreadyExists) is adopted, not duplicated: a running one is waited for, a completed one is checked
for its committed output. A Job that fails — or completes without its output being committed — is
deleted and created again at most ``retries`` times (the attempt number lives in the Job's
``sapd.io/attempt`` annotation, so a restarted driver keeps counting); then the driver stops with
:class:`StageFailed`. Failures that are not the stage's own are not counted:

- a training pod preempted or evicted (the chart's podFailurePolicy fails the train Job on the pod's
  ``DisruptionTarget`` condition): the whole torchrun group is recreated, as JobSet's
  ``RestartJobSetAndIgnoreMaxRestarts`` does for its own;
- a training group that never assembled (some of its pods still unschedulable when it failed: no GPU
  nodes free, and no Kueue to admit the group as a whole).

A permanent failure (exit code 2: the podFailurePolicy's exit-code rule, or JobSet's
``FailJobSetFailurePolicyAction``) is not retried. A Job that Kueue keeps suspended is logged as queued,
and the driver's own limit on a stage (its ``activeDeadlineSeconds`` + 600 s) counts from its admission.
A failed final evaluation is reported and leaves the run complete: its checkpoints are committed.
The evaluation waits first for the Jobs it needs (``evaluate_after``: the chart's ALFWorld data fill,
which writes the game files every evaluation pod reads): it starts once they are Complete, fails (as an
evaluation) if one failed, and goes on if one is not there (finished and deleted after its TTL).
Every wait is bounded; every decision is one plain log line. Given the run root's lease (``lease``, which
``sapd.jobs.pipeline`` holds for the release), the driver stops (exit 2) once another run holds it: it checks
between its polls and before it creates a Job.
"""

from __future__ import annotations

import copy
import datetime as dt
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace as NS
from typing import Any, Callable, Sequence

import urllib3
from kubernetes import client, config
from kubernetes.client.exceptions import ApiException

from sapd import layout, storage, yamlio
from sapd.config import RunConfig
from sapd.data import scored, shards, validation
from sapd.method.objective import objective_of
from sapd.run import plan

ROUND_PLACEHOLDER = "__SAPD_ROUND__"
ROUNDS_PLACEHOLDER = "__SAPD_ROUNDS__"  # how many rounds a stage Job serves (1: per-round Jobs)
POOL_STAGES = ("teacher-scores", "train")  # the stages whose workers may stay up for several rounds
ROUNDS_ANNOTATION = "sapd.io/rounds"  # "K-M": the rounds a persistent stage Job serves
STAGE_JOBS = ("persistent", "per-round")
STAGES = plan.STAGES
JOBSET_API = ("jobset.x-k8s.io", "v1alpha2", "jobsets")  # the train stage may be a JobSet (train.launcher: jobset)
TRAIN_SERVICE = "train-service"
ATTEMPT_ANNOTATION = "sapd.io/attempt"
RUN_ROOT_ANNOTATION = "sapd.io/run-root"
# teacher-scores of the last checkpoint (k = train.rounds): it only validates; a run extended later scores that
# round under the same Job name, so the driver recreates such a Job instead of adopting it
VALIDATION_ONLY_ANNOTATION = "sapd.io/validation-only"
MANAGED_BY = "sapd-pipeline"
# the Failed condition's reasons that end a stage at once: the Job's podFailurePolicy matched its exit-code
# rule (the message then names the rule: "… matching FailJob rule at index N"), or JobSet applied its
# FailJobSet rule (jobset pkg/constants: FailJobSetActionReason)
POD_FAILURE_POLICY = "PodFailurePolicy"
JOBSET_FAIL_ACTION = "FailJobSetFailurePolicyAction"
_RULE_INDEX = re.compile(r"matching FailJob rule at index (\d+)")
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
OWNER_KINDS = {"configmap": ("v1", "ConfigMap"), "job": ("batch/v1", "Job")}


class DriverError(Exception):
    """Bad templates or input: exit code 2."""
    exit_code = 2


class StageFailed(DriverError):
    """A stage Job kept failing (or kept completing without committing its output): exit code 1."""
    exit_code = 1


class KubeError(DriverError):
    """The Kubernetes API refused or kept failing, or a bounded wait ran out: exit code 3."""
    exit_code = 3


# ------------------------------------------------------------------------------------------ templates


def _stringify_quantities(obj: Any, parent: str = "") -> Any:
    """Resource quantities as strings (``nvidia.com/gpu: 1`` → ``"1"``): the API accepts both, the
    typed client only strings."""
    if isinstance(obj, dict):
        return {k: (str(v) if parent in ("limits", "requests") and isinstance(v, (int, float))
                    and not isinstance(v, bool) else _stringify_quantities(v, k)) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_stringify_quantities(v, parent) for v in obj]
    return obj


@dataclass
class StageTemplates:
    """The stage manifests of one release: ``<stage>.yaml`` texts with ``__SAPD_ROUND__`` placeholders."""
    texts: dict[str, str]

    @classmethod
    def from_dir(cls, folder: str | Path) -> "StageTemplates":
        folder = Path(folder)
        if not folder.is_dir():
            raise DriverError(f"{folder}: no stage templates folder (the chart mounts the pipeline-templates "
                              "ConfigMap there)")
        texts = {p.name[:-5]: p.read_text() for p in sorted(folder.iterdir())
                 if p.name.endswith(".yaml") and not p.name.startswith(".") and p.is_file()}
        unknown = set(texts) - set(STAGES) - {TRAIN_SERVICE}
        if unknown:
            raise DriverError(f"{folder}: unknown stage template(s) {sorted(unknown)}; expected {list(STAGES)}")
        return cls(texts)

    def has(self, stage: str) -> bool:
        return stage in self.texts

    def serves_rounds(self, stage: str) -> bool:
        """Whether the stage's Job can serve several rounds (its command takes ``--rounds __SAPD_ROUNDS__``)."""
        return ROUNDS_PLACEHOLDER in self.texts.get(stage, "")

    def render(self, stage: str, k: int | None = None, rounds: int = 1) -> dict[str, Any]:
        if stage not in self.texts:
            raise DriverError(f"no template for stage '{stage}' (is `{stage}` disabled in the chart values?)")
        text = self.texts[stage].replace(ROUNDS_PLACEHOLDER, str(rounds))
        if ROUND_PLACEHOLDER in text:
            if k is None:
                raise DriverError(f"template '{stage}' needs a round")
            text = text.replace(ROUND_PLACEHOLDER, str(k))
        try:
            doc = yamlio.load(text)
        except yamlio.yaml.YAMLError as e:
            raise DriverError(f"template '{stage}' is not YAML: {e}") from e
        kinds = ("Service",) if stage == TRAIN_SERVICE else ("Job", "JobSet") if stage == "train" else ("Job",)
        if not isinstance(doc, dict) or doc.get("kind") not in kinds or not doc.get("metadata", {}).get("name"):
            raise DriverError(f"template '{stage}' is not a {' or '.join(kinds)} manifest with a name")
        name = doc["metadata"]["name"]
        longest = name
        if doc["kind"] == "Job" and doc.get("spec", {}).get("completionMode") == "Indexed":
            longest = f"{name}-{int(doc['spec'].get('completions', 1)) - 1}"  # the pods' hostnames
        elif doc["kind"] == "JobSet":  # <jobset>-<replicated job>-<job index>-<pod index>
            longest = max((f"{name}-{rj['name']}-{int(rj.get('replicas', 1)) - 1}-"
                           f"{int(rj['template']['spec'].get('completions', 1)) - 1}"
                           for rj in doc.get("spec", {}).get("replicatedJobs", [])), key=len, default=name)
        if not _DNS_LABEL.match(name) or len(longest) > 63:
            raise DriverError(f"template '{stage}': '{longest}' is not a valid DNS label of at most 63 characters "
                              "(choose a shorter release name)")
        return _stringify_quantities(doc)


input_step = plan.input_step  # what a step waits for is the plan's


# ------------------------------------------------------------------------------------------ driver


@dataclass
class DriverStats:
    created: list[str] = field(default_factory=list)
    adopted: list[str] = field(default_factory=list)
    retried: list[str] = field(default_factory=list)
    restarted: list[str] = field(default_factory=list)  # recreated without counting: preempted, never assembled
    skipped: list[str] = field(default_factory=list)


_fmt_s = plan.fmt_seconds


@dataclass
class Outcome:
    """How one incarnation of a stage Job ended."""
    state: str  # Complete | Failed | Gone
    reason: str = ""
    message: str = ""
    rule: str = ""  # a PodFailurePolicy failure: the kind of rule that matched (see _rule_kind)
    unscheduled: str = ""  # the group had pods the scheduler could not place when it failed (why), if any

    @property
    def text(self) -> str:
        return ": ".join(x for x in (self.reason, self.message) if x) or self.state


class Driver:
    """Sequences one run's stage Jobs. ``api_client`` is a ``kubernetes.client.ApiClient``; ``owner`` is
    ``configmap/<name>`` (the chart's: the release's pipeline-templates ConfigMap) or ``job/<name>``, the
    object every stage Job is made a dependent of."""

    def __init__(self, cfg: RunConfig, templates: StageTemplates, api_client, namespace: str, *,
                 retries: int = 2, poll_seconds: float = 30.0, log_every_seconds: float = 300.0,
                 stage_timeout_seconds: float | None = None, delete_timeout_seconds: float = 600.0,
                 owner: str | None = None, log: Callable[[str], None] = print,
                 sleep: Callable[[float], None] = time.sleep, clock: Callable[[], float] = time.monotonic,
                 api_attempts: int = 5, lease: Any = None, evaluate_after: Sequence[str] = (),
                 stage_jobs: str = "persistent", rounds_per_job: int = 0):
        if stage_jobs not in STAGE_JOBS:
            raise DriverError(f"stage jobs {stage_jobs!r}: expected one of {', '.join(STAGE_JOBS)}")
        if rounds_per_job < 0:
            raise DriverError(f"rounds per job {rounds_per_job}: expected 0 (every round) or a positive count")
        if stage_jobs == "persistent":
            old = [st for st in POOL_STAGES if templates.has(st) and not templates.serves_rounds(st)]
            if old:
                raise DriverError(f"the stage templates of {', '.join(old)} take no {ROUNDS_PLACEHOLDER} (a chart "
                                  "older than persistent workers): pass --stage-jobs per-round, or upgrade the chart")
        self.stage_jobs, self.rounds_per_job = stage_jobs, rounds_per_job
        self.cfg, self.templates, self.namespace = cfg, templates, namespace
        self.batch = client.BatchV1Api(api_client)
        self.core = client.CoreV1Api(api_client)
        self.custom = client.CustomObjectsApi(api_client)
        self._jobsets: set[str] = set()  # names of stage "Jobs" that are JobSets
        self.retries, self.poll, self.log_every = retries, poll_seconds, log_every_seconds
        self.stage_timeout, self.delete_timeout = stage_timeout_seconds, delete_timeout_seconds
        self.owner, self.log, self.sleep, self.clock = owner, log, sleep, clock
        self.api_attempts = api_attempts
        self.evaluate_after = list(evaluate_after)  # Jobs of the release the evaluation needs complete first
        self.stats = DriverStats()
        self.lease = lease  # the run root's sapd.lease.RunLease this driver holds (sapd.jobs.pipeline), if any
        self._owner_ref: dict[str, Any] | None = None
        self.evaluation_failed: str | None = None
        self._pools_since = 0.0  # when the persistent stage Jobs of the current rounds were started (or adopted)

    # ---------------------------------------------------------------------------------- the sequence

    def run(self) -> dict[str, Any]:
        cfg, root = self.cfg, self.cfg.run_root
        jobs = ("per-round stage Jobs" if self.stage_jobs == "per-round" else
                "persistent stage Jobs, " + (f"{self.rounds_per_job} rounds each" if self.rounds_per_job else
                                             "one per pool for the whole run"))
        self.log(f"pipeline: run root {root}, {cfg.train.rounds} rounds, {cfg.workers} teacher-scores workers, "
                 f"{jobs}, namespace {self.namespace}, stage retries {self.retries}"
                 + (", train.overlap one_step" if cfg.train.overlap == "one_step" else ""))
        self._resolve_owner()
        served = 0  # rounds below this were seen through by persistent stage Jobs in this run of the driver
        started: tuple[list[Pool], int] | None = None  # persistent Jobs created while the prefixes are built
        for step in plan.steps(cfg, evaluate=self.templates.has("evaluate")):
            # the last checkpoint's validation (teacher-scores R) is a Job of its own, after the pools
            pooled = self.stage_jobs == "persistent" and step.stage in POOL_STAGES and \
                (step.round is None or step.round < cfg.train.rounds)
            if pooled and step.round is not None and step.round < served:
                continue
            if plan.missing(cfg, step) is None:
                nothing = step.stage == "teacher-scores" and step.round is not None and step.round >= cfg.train.rounds \
                    and not validation.is_committed(root, step.round)
                self.log(f"stage {step}: " + ("nothing to validate (the prefix build has no validation prefixes), "
                                              "skipping" if nothing else "committed, skipping"))
                self.stats.skipped.append(str(step))
                continue
            if pooled:
                assert step.round is not None
                served = self._run_pools(step.round, started if step.round == 0 else None)
                started = None
                continue
            if step.stage == "build-prefixes" and self.stage_jobs == "persistent" and cfg.train.rounds > 0:
                # the rounds' Jobs start with the build: their pods' start-up (scheduling, image, imports)
                # overlaps it, and their workers wait for checkpoint 0
                started = self._start_pools(0)
                try:
                    self._run_step(step)
                except DriverError:
                    for pool in started[0]:
                        self.log(f"job {pool.name}: deleting it: its rounds cannot start without the prefix build")
                        self._delete_job(pool.name)
                    raise
                continue
            if step.stage != "evaluate":
                self._run_step(step)
                continue
            try:
                self._run_step(step)
            except StageFailed as e:  # the checkpoints are committed: the run is done, its evaluation is not
                self.evaluation_failed = str(e)
                self.log(f"pipeline: WARNING: the final evaluation failed; checkpoints are committed, so the run "
                         f"completes. {e}")
        done = layout.committed_checkpoints(root)
        evaluation = ("; the final evaluation FAILED (see the WARNING above)" if self.evaluation_failed else "")
        self.log(f"pipeline done: checkpoints {done} committed{evaluation}; Jobs created {len(self.stats.created)}, "
                 f"adopted {len(self.stats.adopted)}, retried {len(self.stats.retried)}"
                 + (f", restarted uncounted {len(self.stats.restarted)}" if self.stats.restarted else ""))
        return {"run_root": root, "checkpoints": done, "created": list(self.stats.created),
                "adopted": list(self.stats.adopted), "retried": list(self.stats.retried),
                "restarted": list(self.stats.restarted), "skipped": list(self.stats.skipped),
                "evaluation_failed": self.evaluation_failed}

    def run_stage(self, step: plan.Step) -> dict[str, Any]:
        """One step of the plan (the chart's manual mode: one such Job per stage of a round): skip it if it is
        committed, else wait until its input is, then run its Job like :meth:`run` does."""
        self._resolve_owner()
        if plan.missing(self.cfg, step) is None:
            self.log(f"stage {step}: committed, skipping")
            self.stats.skipped.append(str(step))
        else:
            self.wait_for_input(step)
            self._run_step(step)
        return {"run_root": self.cfg.run_root, "step": str(step), "created": list(self.stats.created),
                "adopted": list(self.stats.adopted), "retried": list(self.stats.retried),
                "restarted": list(self.stats.restarted), "skipped": list(self.stats.skipped)}

    def wait_for_input(self, step: plan.Step) -> None:
        """Poll until ``step``'s input is committed (:func:`sapd.run.plan.wait_for_input`), a line every
        ``log_every_seconds``, the lease checked between the polls. Bounded by the pod's own
        activeDeadlineSeconds."""

        def sleep(seconds: float) -> None:
            self._still_holding(strict=False)
            self.sleep(seconds)
        plan.wait_for_input(self.cfg, step, poll_seconds=self.poll, log=self.log, log_every_seconds=self.log_every,
                            sleep=sleep, clock=self.clock)

    def _still_holding(self, *, strict: bool) -> None:
        """Stop (``LeaseLost``, exit 2) once another run holds the run root's lease; ``strict``: also when it
        cannot be confirmed now (before creating a Job), else an outage is left to the lease's own thread."""
        if self.lease is None:
            return
        try:
            self.lease.check()
        except storage.StorageUnavailable:
            if strict:
                raise

    def _run_step(self, step: plan.Step) -> None:
        cfg = self.cfg
        if step.stage == "train":
            self.ensure_service()
        if step.stage == "evaluate":
            for name in self.evaluate_after:
                self.wait_for_job(name, step)
        check = (lambda: self._commit_scores(step)) if step.stage == "teacher-scores" else \
            (lambda: plan.missing(cfg, step))
        self.run_job(step.stage, step.round, check)

    def wait_for_job(self, name: str, step: plan.Step) -> None:
        """Wait until Job ``name`` of the release, which ``step`` needs first, is Complete (bounded like any
        stage Job: its activeDeadlineSeconds + 600 s once it runs). One that failed or went away while
        waited for ends ``step`` as a :class:`StageFailed`; one that is not there finished and was deleted
        after its TTL (Helm creates it before the driver), or was never made: the step goes on."""
        job = self._get_job(name)
        if job is None:
            self.log(f"stage {step}: job {name}, which it needs first, is not there (finished and deleted after its "
                     "TTL?); going on")
            return
        out = _finished(job)
        if out is None:
            self.log(f"stage {step}: waiting for job {name} to complete first")
            out = self._wait(name)
        if out.state == "Complete":
            self.log(f"stage {step}: job {name} is complete")
            return
        ended = "failed" if out.state == "Failed" else "is gone"
        raise StageFailed(f"stage {step}: job {name}, which it needs first, {ended}: {out.text}. Inspect it with "
                          f"`kubectl -n {self.namespace} describe job {name}` and "
                          f"`kubectl -n {self.namespace} logs job/{name}`; once the cause is fixed, delete it and "
                          "`helm upgrade` the release, which creates it again")

    def _commit_scores(self, step: plan.Step) -> str | None:
        """After a teacher-scores Job completes: its last worker committed the round (checkpoint k's validation,
        then the scored manifest); if that worker died between its part and the commit, every part is there
        and the driver commits it."""
        if plan.missing(self.cfg, step) is None:
            return None
        assert step.round is not None
        try:
            result, manifest = scored.commit_teacher_scores(self.cfg, step.round)
        except shards.ShardError as e:
            return str(e)
        if result is not None:
            self.log(f"checkpoint {step.round}: committed its validation on {result['prefixes']} held-out prefixes")
        if manifest is not None:
            self.log(f"round {step.round}: committed {manifest['rows']} scored groups from {manifest['workers']} "
                     "workers")
        return plan.missing(self.cfg, step)

    # ---------------------------------------------------------------------------------- one stage Job

    def manifest(self, stage: str, k: int | None, attempt: int, rounds: int = 1,
                 pool: bool = False) -> dict[str, Any]:
        """The stage's Job for round ``k`` as the driver creates it: the template with its round (and the
        number of rounds it serves), the driver's label and annotations, the owner. ``pool``: a persistent
        stage Job (annotated with its rounds ``K-M``), whose activeDeadlineSeconds — per round in the chart
        — becomes ``rounds`` × one round of every pool stage (its workers wait through the other's rounds)."""
        doc = copy.deepcopy(self.templates.render(stage, k, rounds))
        meta = doc["metadata"]
        meta.setdefault("labels", {})["app.kubernetes.io/managed-by"] = MANAGED_BY
        meta.setdefault("annotations", {}).update({ATTEMPT_ANNOTATION: str(attempt),
                                                   RUN_ROOT_ANNOTATION: self.cfg.run_root})
        if pool:
            assert k is not None
            meta["annotations"][ROUNDS_ANNOTATION] = f"{k}-{k + rounds - 1}"
            per_round = sum(d for st in self._pool_stages() if (d := _deadline(self.templates.render(st, k))))
            if per_round:
                _set_deadline(doc, int(rounds * per_round))
        if stage == "teacher-scores" and k is not None and k >= self.cfg.train.rounds:
            meta["annotations"][VALIDATION_ONLY_ANNOTATION] = "true"
        if self._owner_ref:
            meta["ownerReferences"] = [dict(self._owner_ref)]
        return doc

    def run_job(self, stage: str, k: int | None, check: Callable[[], str | None]) -> None:
        """Run (or adopt) the stage's Job until it completes with its output committed, bounded retries."""
        doc = self.templates.render(stage, k)
        name = doc["metadata"]["name"]
        if doc["kind"] == "JobSet":
            self._jobsets.add(name)
        job = self._get_job(name)
        if job is not None and self._stale_validation_only(stage, k, name, job):
            self._delete_job(name)
            job = None
        if job is None:
            attempt = 1
            self._create_job(stage, k, name, attempt)
        else:
            attempt = self._adopt(name, job)
        while True:
            out = self._wait(name, gang=stage == "train")
            if out.state == "Complete":
                problem = check()
                if problem is None:
                    self.log(f"job {name}: complete")
                    return
                out.reason, out.message = "", f"the Job completed, but {problem}"
            attempt = self._after_failure(stage, k, name, out, attempt)
            self._create_job(stage, k, name, attempt)

    def _after_failure(self, stage: str, k: int | None, name: str, out: Outcome, attempt: int) -> int:
        """An incarnation of the stage's Job ended without its output: the failed pod's log, then either
        :class:`StageFailed` (retries spent, or a permanent error) or the Job deleted for the next attempt
        (not counted when the failure was not the stage's own). → the next attempt's number."""
        max_attempts = self.retries + 1
        if out.state != "Gone":
            self._log_failed_pods(name)
        uncounted = self._not_its_fault(out)
        if uncounted:
            self.log(f"job {name}: attempt {attempt}/{max_attempts} ended: {out.text}; {uncounted}: recreating "
                     "the whole group, not counted against the retries")
            self.stats.restarted.append(name)
        else:
            self.log(f"job {name}: attempt {attempt}/{max_attempts} failed: {out.text}")
            # exit code 2 (a config or input error) matched the podFailurePolicy's exit-code rule, or JobSet
            # applied its FailJobSet rule: permanent, not worth a retry on GPU nodes
            permanent = out.state == "Failed" and (out.reason == JOBSET_FAIL_ACTION or (
                out.reason == POD_FAILURE_POLICY and out.rule != "disruption"))
            if attempt >= max_attempts or permanent:
                described = f"{name}-node-0" if name in self._jobsets else name  # a JobSet's child Job
                raise StageFailed(
                    f"stage {stage}{'' if k is None else f' (round {k})'}: Job {name} failed {attempt} time(s), "
                    f"giving up{' (a permanent error: not retried)' if permanent else ''}; last: {out.text}. "
                    f"Inspect it with `kubectl -n {self.namespace} describe job {described}` "
                    f"and `kubectl -n {self.namespace} logs job/{described}`; once the cause is fixed, "
                    f"`kubectl -n {self.namespace} delete {'jobset' if name in self._jobsets else 'job'} {name}` "
                    "and restart the driver (a `helm upgrade` starts a new one)")
            attempt += 1
            self.stats.retried.append(name)
        if out.state != "Gone":
            self._delete_job(name)
        return attempt

    # ---------------------------------------------------------------------------------- persistent stage Jobs

    def _pool_stages(self) -> list[str]:
        scores = objective_of(self.cfg.loss_cfg).data == "scored"  # the plan's rule (sapd.run.plan.steps)
        return [st for st in POOL_STAGES if self.templates.has(st) and (scores or st == "train")]

    def _start_pools(self, k: int) -> tuple[list[Pool], int]:
        """The persistent stage Jobs of rounds k…: a train Job and a teacher-scores Job (while some round of
        the train Job's range is unscored), each serving up to ``rounds_per_job`` rounds (0: every round
        left); a running one of an earlier driver is adopted (its rounds decide). → (the Jobs, the round
        after the train Job's last)."""
        R = self.cfg.train.rounds
        self.ensure_service()
        running = self._find_pool("train", k)  # an earlier driver's train Job decides the rounds
        end = running[2] + 1 if running else R if not self.rounds_per_job else min(R, k + self.rounds_per_job)
        pools = []
        if "teacher-scores" in self._pool_stages() and (j := self._first_missing("teacher-scores", k, end)) is not None:
            pools.append(self._open_pool("teacher-scores", j, end))
        pools.append(self._open_pool("train", k, end, running))
        self._pools_since = self.clock()
        return pools, end

    def _run_pools(self, k: int, started: tuple[list[Pool], int] | None = None) -> int:
        """Rounds k… by persistent stage Jobs (``--stage-jobs persistent``; ``started``: already created by
        :meth:`_start_pools`, during the prefix build): their workers keep their models loaded and start
        each round once its input is committed. Watched together: each round's commits are logged; a Job
        that fails, or that commits nothing for one round's time limit once that round's input is
        committed, is recreated like any stage Job (bounded retries; it resumes from the commits); when one
        gives up, the other is deleted. → the round after the last one the train Job served (its checkpoint
        committed)."""
        pools, end = started or self._start_pools(k)
        train = pools[-1]
        start = self._pools_since = self.clock()
        while True:
            for pool in pools:
                if not pool.done:
                    self._poll_pool(pool, pools)
            for pool in pools:
                self._advance(pool)  # a line per round committed
            scoring = [p for p in pools if p.stage == "teacher-scores"]
            if train.done and all(p.done or p.last >= end for p in scoring):
                self.log(f"rounds {k}–{end - 1}: checkpoint {end} committed after {_fmt_s(self.clock() - start)}")
                return end
            if scoring and all(p.done for p in scoring) and (j := self._first_missing("teacher-scores", k, end)) \
                    is not None:  # an adopted Job served fewer rounds than this train Job needs
                pools.append(self._open_pool("teacher-scores", j, end))
            self._still_holding(strict=False)
            self.sleep(self.poll)

    def _open_pool(self, stage: str, k: int, end: int, found: tuple[str, int, int, Any] | None = None) -> Pool:
        """The stage's persistent Job for rounds k … end-1: a running one of this run that serves round k
        (with its own rounds; ``found`` if already looked up) is adopted; else the Job named for round k is
        created (or adopted: a driver that restarted keeps counting its attempts; a finished one of other
        rounds is replaced uncounted)."""
        gang = stage == "train"
        limit = self.stage_timeout
        if limit is None:
            limit = (_deadline(self.templates.render(stage, k)) or 86400.0) + 600.0

        def pool(name: str, first: int, last: int, attempt: int) -> Pool:
            return Pool(stage, first, last, name, attempt, JobWatch(self, name, gang, pool=True), limit,
                        next_round=first)
        found = found or self._find_pool(stage, k)
        if found is not None:
            name, first, last, job = found
            return pool(name, first, last, self._adopt(name, job))
        doc = self.templates.render(stage, k, end - k)
        name = doc["metadata"]["name"]
        if doc["kind"] == "JobSet":
            self._jobsets.add(name)
        job = self._get_job(name)
        attempt = 1
        if job is not None:
            rounds = _rounds_of(job)
            if rounds == (k, end - 1):
                return pool(name, k, end - 1, self._adopt(name, job))
            self.log(f"job {name}: exists for rounds {rounds[0]}–{rounds[1]}, finished; replacing it with the Job of "
                     f"rounds {k}–{end - 1} (not counted)")
            self._delete_job(name)
        self._create_job(stage, k, name, attempt, rounds=end - k)
        return pool(name, k, end - 1, attempt)

    def _find_pool(self, stage: str, k: int) -> tuple[str, int, int, Any] | None:
        """The stage Job of this run (its run-root annotation) that serves round k, whatever round it is
        named after: a driver that restarted, or a `helm upgrade`'s, finds the Job an earlier one started —
        a running one first; else one that ended while no driver watched (failed: it is retried under its
        name, its attempts counted on). A per-round Job (no ``sapd.io/rounds``) is taken only while it runs
        (a chart before persistent workers started it), for its one round."""
        doc = self.templates.render(stage, k)
        labels = doc["metadata"].get("labels") or {}
        sel = ",".join(f"{key}={labels[key]}" for key in ("app.kubernetes.io/instance", "app.kubernetes.io/component")
                       if key in labels)
        sel = ",".join(x for x in (sel, f"app.kubernetes.io/managed-by={MANAGED_BY}") if x)
        if doc["kind"] == "JobSet":
            listed = self._api(f"list jobsets ({sel})", lambda: self.custom.list_namespaced_custom_object(
                *JOBSET_API[:2], self.namespace, JOBSET_API[2], label_selector=sel))
            items = [_jobset_view(d) for d in listed.get("items", [])]
        else:
            items = self._api(f"list jobs ({sel})", lambda: self.batch.list_namespaced_job(
                self.namespace, label_selector=sel)).items
        ours = [job for job in items if ROUNDS_ANNOTATION in (ann := job.metadata.annotations or {})
                and ann.get(RUN_ROOT_ANNOTATION) == self.cfg.run_root]  # persistent Jobs of this run root
        covering = [job for job in ours if _rounds_of(job)[0] <= k <= _rounds_of(job)[1]]
        # a per-round Job of round k that still runs: one a chart before persistent workers started (a
        # `helm upgrade` landing mid-stage), adopted for its one round rather than replaced, so the upgrade
        # loses nothing; the rounds after it get persistent Jobs
        covering += [job for job in items if ROUNDS_ANNOTATION not in (job.metadata.annotations or {})
                     and _rounds_of(job) == (k, k) and _finished(job) is None]
        covering.sort(key=lambda j: (_finished(j) is not None, str(j.metadata.name)))  # running ones first
        if not covering:
            return None
        job = covering[0]
        name = str(job.metadata.name)
        if doc["kind"] == "JobSet":
            self._jobsets.add(name)
        first, last = _rounds_of(job)
        return name, first, last, job

    def _first_missing(self, stage: str, k: int, end: int) -> int | None:
        """The first round in k … end-1 whose ``stage`` output is not committed (None: all are)."""
        return next((j for j in range(k, end) if plan.missing(self.cfg, plan.Step(stage, j)) is not None), None)  # type: ignore[arg-type]

    def _poll_pool(self, pool: Pool, pools: list[Pool]) -> None:
        """One read of a persistent stage Job: done when it completed with every round of its range committed;
        recreated (or StageFailed, the other Jobs deleted) when it failed, completed without them, or let one
        round's time limit pass with the round's input committed."""
        out = pool.watch.poll()
        if out is None:
            out = self._stalled(pool)
            if out is None:
                return
        elif out.state == "Complete":
            problem = self._pool_missing(pool)
            if problem is None:
                self.log(f"job {pool.name}: complete (rounds {pool.first}–{pool.last})")
                pool.done = True
                return
            out.reason, out.message = "", f"the Job completed, but {problem}"
        try:
            pool.attempt = self._after_failure(pool.stage, pool.first, pool.name, out, pool.attempt)
        except StageFailed:
            for other in pools:
                if other is not pool and not other.done:
                    self.log(f"job {other.name}: deleting it: its rounds cannot go on without {pool.name}")
                    self._delete_job(other.name)
            raise
        self._create_job(pool.stage, pool.first, pool.name, pool.attempt, rounds=pool.last - pool.first + 1)
        pool.watch = JobWatch(self, pool.name, pool.stage == "train", pool=True)
        pool.stall_round = None

    def _advance(self, pool: Pool) -> int | None:
        """The pool's first round whose output is not committed (its cursor only moves forward); one line per
        round it sees committed: its scores, its checkpoint."""
        while pool.next_round <= pool.last and plan.missing(
                self.cfg, plan.Step(pool.stage, pool.next_round)) is None:  # type: ignore[arg-type]
            j = pool.next_round
            what = f"checkpoint {j + 1} committed" if pool.stage == "train" else "scored round committed"
            self.log(f"round {j}: {what} ({pool.name}, {_fmt_s(self.clock() - self._pools_since)} into its rounds)")
            pool.next_round += 1
        return pool.next_round if pool.next_round <= pool.last else None

    def _stalled(self, pool: Pool) -> Outcome | None:
        """The per-round watchdog of a running persistent Job: an Outcome (RoundTimeout) when the input of
        its next round has been committed for longer than one round's limit and the round's output is not."""
        if pool.watch.running_since is None:  # queued (Kueue), or not read yet: no round is due
            pool.stall_round = None
            return None
        j = self._advance(pool)
        need = None if j is None else plan.input_step(self.cfg, plan.Step(pool.stage, j))  # type: ignore[arg-type]
        if j is None or (need is not None and plan.missing(self.cfg, need) is not None):
            pool.stall_round = None  # done, or waiting for the other pool: not its fault
            return None
        now = self.clock()
        if pool.stall_round != j:
            pool.stall_round, pool.stall_since = j, max(now, pool.watch.running_since)
            return None
        if now - pool.stall_since <= pool.round_limit:
            return None
        return Outcome("Failed", "RoundTimeout", f"round {j} is not committed {_fmt_s(now - pool.stall_since)} "
                       f"after its input was (limit {_fmt_s(pool.round_limit)} per round)")

    def _pool_missing(self, pool: Pool) -> str | None:
        """What a completed persistent Job left uncommitted in its rounds (None: nothing). A scored round
        whose every part is written is committed here, as after a per-round teacher-scores Job."""
        for j in range(pool.first, pool.last + 1):
            step = plan.Step(pool.stage, j)  # type: ignore[arg-type]
            if pool.stage == "teacher-scores" and (self._commit_scores(step) is None):
                continue
            if (why := plan.missing(self.cfg, step)) is not None:
                return why
        return None

    @staticmethod
    def _not_its_fault(out: Outcome) -> str:
        """Why a failed incarnation is no failure of the stage itself ("" if it is one)."""
        if out.state != "Failed":
            return ""
        if out.reason == POD_FAILURE_POLICY and out.rule == "disruption":
            return "a pod was preempted or evicted (DisruptionTarget)"
        if out.unscheduled:
            return f"the group never assembled ({out.unscheduled})"
        return ""

    def _stale_validation_only(self, stage: str, k: int | None, name: str, job) -> bool:
        """A finished teacher-scores Job that only validated the last checkpoint of a shorter run, where the run
        (``train.rounds`` grown since) now scores that round: it did other work, so it is replaced, not adopted."""
        ann = job.metadata.annotations or {}
        if (stage != "teacher-scores" or k is None or k >= self.cfg.train.rounds
                or ann.get(VALIDATION_ONLY_ANNOTATION) != "true" or _finished(job) is None):
            return False
        self.log(f"job {name}: exists, but it only validated checkpoint {k}, the last of a shorter run; the run "
                 f"now scores round {k}: creating it anew")
        return True

    def _adopt(self, name: str, job) -> int:
        ann = job.metadata.annotations or {}
        other = ann.get(RUN_ROOT_ANNOTATION)
        if other is not None and other != self.cfg.run_root:
            raise DriverError(f"job {name} exists but belongs to run root {other}, not {self.cfg.run_root}; "
                              f"delete it (`kubectl -n {self.namespace} delete job {name}`) or use another release")
        try:
            attempt = max(1, int(ann.get(ATTEMPT_ANNOTATION, "1")))
        except ValueError:
            attempt = 1
        out = _finished(job)
        state = out.state if out else ("queued" if _suspended(job) else "running")
        self.log(f"job {name}: exists ({state.lower()}, attempt {attempt}), adopting it")
        self.stats.adopted.append(name)
        return attempt

    def _create_job(self, stage: str, k: int | None, name: str, attempt: int, rounds: int | None = None) -> None:
        """Create the stage's Job (``rounds``: a persistent Job serving that many rounds from k)."""
        self._still_holding(strict=True)
        body = self.manifest(stage, k, attempt, rounds or 1, pool=rounds is not None)
        try:
            if name in self._jobsets:
                self._api(f"create jobset {name}", lambda: self.custom.create_namespaced_custom_object(
                    *JOBSET_API[:2], self.namespace, JOBSET_API[2], body, field_validation="Strict"))
            else:
                self._api(f"create job {name}", lambda: self.batch.create_namespaced_job(
                    self.namespace, body, field_validation="Strict"))  # type: ignore[arg-type]  # dicts are accepted
        except ApiException as e:
            if e.status != 409:
                raise
            # created meanwhile (another driver pod); adopt it rather than run the stage twice
            job = self._get_job(name)
            if job is None:
                raise KubeError(f"create job {name}: 409 AlreadyExists, but it cannot be read back") from e
            self._adopt(name, job)
            return
        spec = body["spec"]
        if name in self._jobsets:
            spec = spec["replicatedJobs"][0]["template"]["spec"]
        shape = (f", Indexed: {spec.get('completions')} completions, parallelism {spec.get('parallelism')}"
                 if spec.get("completionMode") == "Indexed" else "")
        shape = f", a JobSet{shape}" if name in self._jobsets else shape
        served = f", rounds {k}–{k + rounds - 1}" if rounds is not None and k is not None else ""
        self.log(f"job {name}: created (attempt {attempt}/{self.retries + 1}{shape}{served})")
        self.stats.created.append(name)

    def ensure_service(self) -> None:
        if not self.templates.has(TRAIN_SERVICE):
            return
        body = self.templates.render(TRAIN_SERVICE)
        name = body["metadata"]["name"]
        body["metadata"].setdefault("labels", {})["app.kubernetes.io/managed-by"] = MANAGED_BY
        try:
            self._api(f"read service {name}", lambda: self.core.read_namespaced_service(name, self.namespace))
            return
        except ApiException as e:
            if e.status != 404:
                raise
        try:
            self._api(f"create service {name}", lambda: self.core.create_namespaced_service(
                self.namespace, body, field_validation="Strict"))  # type: ignore[arg-type]  # dicts are accepted
            self.log(f"service {name}: created (headless, train rendezvous)")
        except ApiException as e:
            if e.status != 409:
                raise

    def _wait(self, name: str, gang: bool = False) -> Outcome:
        """Poll until the Job is Complete or Failed (or gone): :class:`JobWatch`, one read per poll."""
        watch = JobWatch(self, name, gang)
        while (out := watch.poll()) is None:
            self._still_holding(strict=False)
            self.sleep(self.poll)
        return out

    def _unscheduled_pods(self, name: str) -> str:
        """"1 of 2 pods unschedulable: 0/3 nodes are available: …" for the Job's pods that the scheduler
        could not place (PodScheduled False), "" when there are none or the pods cannot be listed."""
        label = "jobset.sigs.k8s.io/jobset-name" if name in self._jobsets else "batch.kubernetes.io/job-name"
        try:
            pods = self._api(f"list pods of {name}", lambda: self.core.list_namespaced_pod(
                self.namespace, label_selector=f"{label}={name}")).items
        except (ApiException, KubeError):
            return ""
        waiting = []
        for p in pods:
            if p.status is None or p.status.phase != "Pending":
                continue
            for c in p.status.conditions or []:
                if c.type == "PodScheduled" and c.status == "False":
                    waiting.append(c.message or c.reason or "not scheduled")
        if not waiting:
            return ""
        return f"{len(waiting)} of {len(pods)} pods unschedulable: {waiting[-1]}"

    def _delete_job(self, name: str) -> None:
        self.log(f"job {name}: deleting it (and its pods) before the next attempt")
        try:
            if name in self._jobsets:
                self._api(f"delete jobset {name}", lambda: self.custom.delete_namespaced_custom_object(
                    *JOBSET_API[:2], self.namespace, JOBSET_API[2], name, propagation_policy="Foreground"))
            else:
                self._api(f"delete job {name}", lambda: self.batch.delete_namespaced_job(
                    name, self.namespace, propagation_policy="Foreground"))
        except ApiException as e:
            if e.status != 404:
                raise
        start = self.clock()
        while self._get_job(name) is not None:
            if self.clock() - start > self.delete_timeout:
                raise KubeError(f"job {name}: still there {_fmt_s(self.delete_timeout)} after deleting it")
            self.sleep(max(self.poll / 10, 0.0) if self.poll else 0.0)

    def _get_job(self, name: str):
        try:
            if name in self._jobsets:
                return _jobset_view(self._api(f"read jobset {name}", lambda: self.custom.get_namespaced_custom_object(
                    *JOBSET_API[:2], self.namespace, JOBSET_API[2], name)))
            return self._api(f"read job {name}", lambda: self.batch.read_namespaced_job(name, self.namespace))
        except ApiException as e:
            if e.status == 404:
                return None
            raise

    def _log_failed_pods(self, name: str, tail: int = 20) -> None:
        """Best effort: the end of the newest failed pod's log, so the driver's log says why."""
        try:
            label = "jobset.sigs.k8s.io/jobset-name" if name in self._jobsets else "batch.kubernetes.io/job-name"
            pods = self.core.list_namespaced_pod(self.namespace, label_selector=f"{label}={name}")
            failed = sorted((p for p in pods.items if p.status is not None and p.status.phase == "Failed"),
                            key=_finished_at)  # the API lists by name, not by time
            if not failed:
                return
            pod = str(failed[-1].metadata.name)  # type: ignore[union-attr]  # a listed pod has metadata
            text = self.core.read_namespaced_pod_log(pod, self.namespace, tail_lines=tail)
        except Exception as e:  # noqa: BLE001 - diagnostics must never stop the driver
            self.log(f"job {name}: could not read its pods' logs ({type(e).__name__})")
            return
        lines = (text or "").rstrip().splitlines()[-tail:]
        self.log(f"job {name}: last {len(lines)} log lines of failed pod {pod}:")
        for line in lines:
            self.log(f"  | {line}")

    def _resolve_owner(self) -> None:
        """Stage Jobs are dependents of ``owner`` (the chart: the release's pipeline-templates ConfigMap,
        which every revision keeps), so `helm uninstall` removes them and `helm upgrade` does not."""
        if not self.owner:
            return
        kind, _, name = self.owner.partition("/")
        if kind.lower() not in OWNER_KINDS or not name:
            raise DriverError(f"--owner {self.owner!r}: expected configmap/<name> or job/<name>")
        api_version, kind = OWNER_KINDS[kind.lower()]
        try:
            if kind == "ConfigMap":
                obj = self._api(f"read configmap {name}", lambda: self.core.read_namespaced_config_map(
                    name, self.namespace))
            else:
                obj = self._api(f"read job {name}", lambda: self.batch.read_namespaced_job(name, self.namespace))
        except (ApiException, KubeError) as e:
            self.log(f"pipeline: cannot read the owner {kind} {name} ({getattr(e, 'status', '') or e}); stage Jobs "
                     "get no owner (`helm uninstall` will not remove them)")
            return
        self._owner_ref = {"apiVersion": api_version, "kind": kind, "name": name, "uid": obj.metadata.uid,
                           "controller": False, "blockOwnerDeletion": False}

    def _api(self, what: str, call: Callable[[], Any]):
        """One API call, retried on transient errors (5xx, 429, connection errors); 4xx pass through
        except 401/403, which become a KubeError naming the RBAC rule to check."""
        delay = 1.0
        for i in range(1, self.api_attempts + 1):
            try:
                return call()
            except ApiException as e:
                if e.status in (401, 403):
                    raise KubeError(f"{what}: {e.status} {e.reason}: the driver's ServiceAccount may not do this "
                                    "(see the chart's pipeline Role)") from e
                if not (e.status in (0, 429) or (e.status or 0) >= 500):
                    raise  # 404, 409, 422 …: the caller decides
                if i == self.api_attempts:
                    raise KubeError(f"{what}: {e.status} {e.reason} after {i} attempts") from e
                problem = f"{e.status} {e.reason}"
            except urllib3.exceptions.HTTPError as e:
                if i == self.api_attempts:
                    raise KubeError(f"{what}: the API server is unreachable after {i} attempts: {e}") from e
                problem = type(e).__name__
            self.log(f"{what}: {problem}, retrying in {delay:.0f}s ({i}/{self.api_attempts})")
            self.sleep(delay)
            delay = min(delay * 2, 30.0)



class JobWatch:
    """One incarnation of a stage Job (or JobSet) watched one read at a time (:meth:`JobWatch.poll`): its log lines,
    its time limit, and what became of it. A Job that Kueue keeps suspended is queued: the stage timeout
    (the Job's activeDeadlineSeconds + 600 s, which the Job controller also counts from its admission)
    starts when it runs, and again after a JobSet restarts its group. ``gang``: the pods of a torchrun
    group that the scheduler cannot place yet are logged with the scheduler's reason and remembered, so a
    group that fails without ever assembling is not counted as the stage's failure."""

    def __init__(self, driver: "Driver", name: str, gang: bool = False, pool: bool = False) -> None:
        self.d, self.name, self.gang = driver, name, gang
        self.last_log = -float("inf")
        self.last_line = ""
        self.queued_since: float | None = None
        self.running_since: float | None = None  # None while queued (or not read yet)
        self.restarts = 0
        self.unscheduled = ""
        # a persistent Job's whole life is bounded by its own deadline (rounds × one round); the driver's stage
        # timeout is then per round (Driver._stalled)
        self.timeout = None if pool else driver.stage_timeout

    def poll(self) -> Outcome | None:
        """Read the Job once: its Outcome when it finished (or is gone), else None (logged when it changed)."""
        d, name = self.d, self.name
        job = d._get_job(name)
        if job is None:
            return Outcome("Gone", message="the Job disappeared while it ran (deleted by someone?)")
        out = _finished(job)
        if out is not None:
            if out.reason == POD_FAILURE_POLICY:
                out.rule = _rule_kind(job, out.message)
            out.unscheduled = self.unscheduled
            return out
        now = d.clock()
        if _suspended(job):
            if self.queued_since is None:
                self.queued_since, self.running_since = now, None
            labels = job.metadata.labels or {}
            queue = labels.get("kueue.x-k8s.io/queue-name")
            line = (f"job {name}: queued {_fmt_s(now - self.queued_since)}: suspended, "
                    + (f"waiting for admission by Kueue (LocalQueue {queue})" if queue else
                       "waiting for whoever suspended it to resume it (no Kueue queue label)"))
            key = "queued"
        else:
            if self.running_since is None or getattr(job.status, "restarts", 0) != self.restarts:
                if self.running_since is not None:
                    d.log(f"job {name}: its group was restarted by JobSet (restart "
                          f"{job.status.restarts}); its time limit starts again")
                self.restarts = getattr(job.status, "restarts", 0) or 0
                self.running_since, self.queued_since = now, None
            if self.timeout is None and job.spec is not None and job.spec.active_deadline_seconds:
                self.timeout = job.spec.active_deadline_seconds + 600.0  # the Job fails itself at its deadline
            st = job.status
            counts = (st.active or 0, st.ready or 0, st.succeeded or 0, st.failed or 0) if st else (0, 0, 0, 0)
            total = job.spec.completions if job.spec is not None and job.spec.completions else 1
            self.unscheduled = d._unscheduled_pods(name) if self.gang else ""
            line = (f"job {name}: running {_fmt_s(now - self.running_since)}: {counts[0]} active ({counts[1]} "
                    f"ready), {counts[2]}/{total} succeeded, {counts[3]} failed pods"
                    + (f"; waiting for the group to assemble: {self.unscheduled}" if self.unscheduled else ""))
            key = f"{counts} {self.unscheduled}"
            if self.timeout is not None and now - self.running_since > self.timeout:
                raise KubeError(f"job {name}: not finished after {_fmt_s(now - self.running_since)} (limit "
                                f"{_fmt_s(self.timeout)}); check `kubectl -n {d.namespace} describe job {name}`")
        if key != self.last_line or now - self.last_log >= d.log_every:
            d.log(line)
            self.last_line, self.last_log = key, now
        return None


@dataclass
class Pool:
    """A stage Job that serves rounds ``first`` … ``last`` (pipeline.stageJobs persistent): its workers stay
    up, waiting for each round's input. ``stall_round``/``stall_since``: the round whose input the driver
    saw committed, and when, while its output is not (the per-round watchdog)."""

    stage: str
    first: int
    last: int
    name: str
    attempt: int
    watch: JobWatch
    round_limit: float  # seconds one round of this pool may take once its input is committed
    next_round: int = 0  # its first round whose output the driver has not seen committed
    done: bool = False
    stall_round: int | None = None
    stall_since: float = 0.0


def _jobset_view(d: dict[str, Any]):
    """A JobSet (a dict from the custom-objects API) seen through the Job attributes the driver reads:
    conditions (Completed → Complete, Failed), suspension, restarts, pod counts summed over the child
    Jobs, and the child Jobs' activeDeadlineSeconds (the driver restarts its limit at each restart)."""

    meta, spec, status = d.get("metadata", {}), d.get("spec", {}), d.get("status") or {}
    rjobs = spec.get("replicatedJobs", [])
    child = rjobs[0]["template"]["spec"] if rjobs else {}
    counts = {k: sum(int(r.get(k, 0)) for r in status.get("replicatedJobsStatus") or [])
              for k in ("active", "ready", "succeeded", "failed")}
    conds = [NS(type={"Completed": "Complete"}.get(c.get("type"), c.get("type")), status=c.get("status"),
                reason=c.get("reason"), message=c.get("message")) for c in status.get("conditions") or []]
    return NS(metadata=NS(annotations=meta.get("annotations") or {}, labels=meta.get("labels") or {},
                          uid=meta.get("uid"), name=meta.get("name")),
              spec=NS(active_deadline_seconds=child.get("activeDeadlineSeconds"), suspend=bool(spec.get("suspend")),
                      completions=sum(int(r.get("replicas", 1)) * int(r["template"]["spec"].get("completions", 1))
                                      for r in rjobs) or 1, pod_failure_policy=None),
              status=NS(conditions=conds, restarts=int(status.get("restarts", 0)), **counts))


def _deadline(doc: dict[str, Any]) -> float | None:
    """A rendered stage manifest's activeDeadlineSeconds (a JobSet's: its child Jobs')."""
    spec = doc.get("spec", {})
    if doc.get("kind") == "JobSet":
        rjobs = spec.get("replicatedJobs") or [{}]
        spec = rjobs[0].get("template", {}).get("spec", {})
    value = spec.get("activeDeadlineSeconds")
    return float(value) if value else None


def _set_deadline(doc: dict[str, Any], seconds: int) -> None:
    if doc.get("kind") == "JobSet":
        for rj in doc["spec"].get("replicatedJobs", []):
            rj["template"]["spec"]["activeDeadlineSeconds"] = seconds
    else:
        doc["spec"]["activeDeadlineSeconds"] = seconds


def _rounds_of(job) -> tuple[int, int]:
    """The rounds a stage Job serves: its ``sapd.io/rounds`` annotation, else its ``sapd.io/round`` label."""
    ann = (job.metadata.annotations or {}).get(ROUNDS_ANNOTATION)
    if ann and re.fullmatch(r"\d+-\d+", ann):
        a, b = ann.split("-")
        return int(a), int(b)
    k = int((job.metadata.labels or {}).get("sapd.io/round", "-1") or -1)
    return k, k


def _suspended(job) -> bool:
    return bool(job.spec is not None and job.spec.suspend)


def _finished(job) -> Outcome | None:
    """The Job's terminal condition as an Outcome, or None while it runs (or is queued)."""
    for c in (job.status.conditions or []) if job.status is not None else []:
        if c.type in ("Complete", "Failed") and c.status == "True":
            return Outcome(c.type, c.reason or "", c.message or "")
    return None


def _rule_kind(job, message: str) -> str:
    """Which rule of the Job's podFailurePolicy a "… matching FailJob rule at index N" message names:
    "disruption" (an onPodConditions rule on DisruptionTarget: a preempted, evicted or drained pod),
    "exit-code", or "unknown"."""
    if "has condition DisruptionTarget" in message:  # the Job controller's own wording for such a rule
        return "disruption"
    m = _RULE_INDEX.search(message)
    policy = job.spec.pod_failure_policy if job.spec is not None else None
    rules = (policy.rules if policy is not None else None) or []
    if m is None or int(m.group(1)) >= len(rules):
        return "unknown"
    rule = rules[int(m.group(1))]
    if any(c.type == "DisruptionTarget" for c in rule.on_pod_conditions or []):
        return "disruption"
    return "exit-code" if rule.on_exit_codes is not None else "unknown"


def _finished_at(pod) -> dt.datetime:
    """When a pod's last container ended (its creation time if none reports it): orders failed pods."""
    st = pod.status
    statuses = (st.container_statuses or []) + (st.init_container_statuses or [])
    times = [cs.state.terminated.finished_at for cs in statuses
             if cs.state is not None and cs.state.terminated is not None and cs.state.terminated.finished_at]
    created = pod.metadata.creation_timestamp if pod.metadata is not None else None
    fallback = created or dt.datetime.min.replace(tzinfo=dt.timezone.utc)
    return max(times, default=fallback)


def load_api_client(kubeconfig: str | None = None):
    """In a pod: the ServiceAccount's in-cluster config; elsewhere the kubeconfig (``--kubeconfig``,
    $KUBECONFIG or ~/.kube/config)."""
    conf = client.Configuration()
    if kubeconfig is None and os.environ.get("KUBERNETES_SERVICE_HOST"):
        config.load_incluster_config(client_configuration=conf)
    else:
        config.load_kube_config(config_file=kubeconfig, client_configuration=conf)
    return client.ApiClient(conf)


def current_namespace(flag: str | None) -> str:
    if flag:
        return flag
    if os.environ.get("SAPD_NAMESPACE"):
        return os.environ["SAPD_NAMESPACE"]
    sa = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")
    if sa.is_file():
        return sa.read_text().strip()
    return "default"
