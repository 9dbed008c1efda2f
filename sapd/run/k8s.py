"""The Kubernetes executor (``python -m jobs.pipeline``, the pipeline driver): the run's plan
(:mod:`sapd.run.plan`, the same one ``sapd run`` follows) with every step run as a Kubernetes Job:
``build-prefixes``, then per round ``teacher-scores-r<k>`` (an Indexed Job, one pod per worker; the last
worker commits the round, and the driver commits it too if a Job completes with every part written)
and ``train-r<k>``, then ``evaluate-r<R>`` when the chart renders an evaluate template.

The stage manifests come from the chart (the ``pipeline-templates`` ConfigMap, one file per stage):
``__SAPD_ROUND__`` is replaced by the round, the driver adds its annotations (attempt, run root) and an
owner reference to its own Job, and creates the Job in its namespace.

Idempotent: a stage Job that already exists (a restarted driver pod, or a second driver racing — 409
AlreadyExists) is adopted, not duplicated: a running one is waited for, a completed one is checked
for its committed output. A Job that fails — or completes without its output being committed — is
deleted and created again at most ``retries`` times (the attempt number lives in the Job's
``sapd.io/attempt`` annotation, so a restarted driver keeps counting); then the driver stops with
:class:`StageFailed`. Every wait is bounded; every decision is one plain log line.
"""

from __future__ import annotations

import copy
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace as NS
from typing import Any, Callable

import urllib3
from kubernetes import client, config
from kubernetes.client.exceptions import ApiException

from sapd import layout, yamlio
from sapd.config import RunConfig
from sapd.data import scored, shards
from sapd.run import plan

ROUND_PLACEHOLDER = "__SAPD_ROUND__"
STAGES = plan.STAGES
JOBSET_API = ("jobset.x-k8s.io", "v1alpha2", "jobsets")  # the train stage may be a JobSet (train.launcher: jobset)
TRAIN_SERVICE = "train-service"
ATTEMPT_ANNOTATION = "sapd.io/attempt"
RUN_ROOT_ANNOTATION = "sapd.io/run-root"
MANAGED_BY = "sapd-pipeline"
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")


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

    def render(self, stage: str, k: int | None = None) -> dict[str, Any]:
        if stage not in self.texts:
            raise DriverError(f"no template for stage '{stage}' (is `{stage}` disabled in the chart values?)")
        text = self.texts[stage]
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


# ------------------------------------------------------------------------------------------ driver


@dataclass
class DriverStats:
    created: list[str] = field(default_factory=list)
    adopted: list[str] = field(default_factory=list)
    retried: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)


def _fmt_s(seconds: float) -> str:
    s = int(seconds)
    return f"{s // 3600}h{s % 3600 // 60:02d}m{s % 60:02d}s" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


class Driver:
    """Sequences one run's stage Jobs. ``api_client`` is a ``kubernetes.client.ApiClient``."""

    def __init__(self, cfg: RunConfig, templates: StageTemplates, api_client, namespace: str, *,
                 retries: int = 2, poll_seconds: float = 30.0, log_every_seconds: float = 300.0,
                 stage_timeout_seconds: float | None = None, delete_timeout_seconds: float = 600.0,
                 owner_job: str | None = None, log: Callable[[str], None] = print,
                 sleep: Callable[[float], None] = time.sleep, clock: Callable[[], float] = time.monotonic,
                 api_attempts: int = 5):
        self.cfg, self.templates, self.namespace = cfg, templates, namespace
        self.batch = client.BatchV1Api(api_client)
        self.core = client.CoreV1Api(api_client)
        self.custom = client.CustomObjectsApi(api_client)
        self._jobsets: set[str] = set()  # names of stage "Jobs" that are JobSets
        self.retries, self.poll, self.log_every = retries, poll_seconds, log_every_seconds
        self.stage_timeout, self.delete_timeout = stage_timeout_seconds, delete_timeout_seconds
        self.owner_job, self.log, self.sleep, self.clock = owner_job, log, sleep, clock
        self.api_attempts = api_attempts
        self.stats = DriverStats()
        self._owner_ref: dict[str, Any] | None = None

    # ---------------------------------------------------------------------------------- the sequence

    def run(self) -> dict[str, Any]:
        cfg, root = self.cfg, self.cfg.run_root
        self.log(f"pipeline: run root {root}, {cfg.train.rounds} rounds, {cfg.workers} teacher-scores workers, "
                 f"namespace {self.namespace}, stage retries {self.retries}")
        self._resolve_owner()
        for step in plan.steps(cfg, evaluate=self.templates.has("evaluate")):
            if plan.missing(cfg, step) is None:
                self.log(f"stage {step}: committed, skipping")
                self.stats.skipped.append(str(step))
                continue
            if step.stage == "train":
                self.ensure_service()
            check = (lambda step=step: self._commit_scores(step)) if step.stage == "teacher-scores" else \
                (lambda step=step: plan.missing(cfg, step))
            self.run_job(step.stage, step.round, check)
        done = layout.committed_checkpoints(root)
        self.log(f"pipeline done: checkpoints {done} committed; Jobs created {len(self.stats.created)}, "
                 f"adopted {len(self.stats.adopted)}, retried {len(self.stats.retried)}")
        return {"run_root": root, "checkpoints": done, "created": list(self.stats.created),
                "adopted": list(self.stats.adopted), "retried": list(self.stats.retried),
                "skipped": list(self.stats.skipped)}

    def _commit_scores(self, step: plan.Step) -> str | None:
        """After a teacher-scores Job completes: its last worker committed the round; if that worker died
        between its part and the commit, every part is there and the driver commits it."""
        if plan.missing(self.cfg, step) is None:
            return None
        assert step.round is not None
        try:
            manifest = scored.commit_round(self.cfg, step.round)
        except shards.ShardError as e:
            return str(e)
        self.log(f"round {step.round}: committed {manifest['rows']} scored groups from {manifest['workers']} workers")
        return None

    # ---------------------------------------------------------------------------------- one stage Job

    def manifest(self, stage: str, k: int | None, attempt: int) -> dict[str, Any]:
        doc = copy.deepcopy(self.templates.render(stage, k))
        meta = doc["metadata"]
        meta.setdefault("labels", {})["app.kubernetes.io/managed-by"] = MANAGED_BY
        meta.setdefault("annotations", {}).update({ATTEMPT_ANNOTATION: str(attempt),
                                                   RUN_ROOT_ANNOTATION: self.cfg.run_root})
        if self._owner_ref:
            meta["ownerReferences"] = [dict(self._owner_ref)]
        return doc

    def run_job(self, stage: str, k: int | None, check: Callable[[], str | None]) -> None:
        """Run (or adopt) the stage's Job until it completes with its output committed, bounded retries."""
        doc = self.templates.render(stage, k)
        name = doc["metadata"]["name"]
        if doc["kind"] == "JobSet":
            self._jobsets.add(name)
        max_attempts = self.retries + 1
        job = self._get_job(name)
        if job is None:
            attempt = 1
            self._create_job(stage, k, name, attempt)
        else:
            attempt = self._adopt(name, job)
        while True:
            state, reason = self._wait(name)
            if state == "Complete":
                problem = check()
                if problem is None:
                    self.log(f"job {name}: complete")
                    return
                reason = f"the Job completed, but {problem}"
            self.log(f"job {name}: attempt {attempt}/{max_attempts} failed: {reason}")
            if state != "Gone":
                self._log_failed_pods(name)
            # a podFailurePolicy FailJob rule matched (exit code 2: a config or input error): permanent
            permanent = state == "Failed" and reason.startswith("PodFailurePolicy")
            if attempt >= max_attempts or permanent:
                raise StageFailed(
                    f"stage {stage}{'' if k is None else f' (round {k})'}: Job {name} failed {attempt} time(s), "
                    f"giving up{' (a permanent error: not retried)' if permanent else ''}; last: {reason}. "
                    f"Inspect it with `kubectl -n {self.namespace} describe job {name}` "
                    f"and `kubectl -n {self.namespace} logs job/{name}`; once the cause is fixed, "
                    f"`kubectl -n {self.namespace} delete job {name}` and restart the driver")
            attempt += 1
            self.stats.retried.append(name)
            if state != "Gone":
                self._delete_job(name)
            self._create_job(stage, k, name, attempt)

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
        state, _ = _finished(job)
        self.log(f"job {name}: exists ({(state or 'running').lower()}, attempt {attempt}), adopting it")
        self.stats.adopted.append(name)
        return attempt

    def _create_job(self, stage: str, k: int | None, name: str, attempt: int) -> None:
        body = self.manifest(stage, k, attempt)
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
        self.log(f"job {name}: created (attempt {attempt}/{self.retries + 1}{shape})")
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

    def _wait(self, name: str) -> tuple[str, str]:
        """Poll until the Job is Complete or Failed (or gone); bounded by the stage timeout."""
        start = last_log = self.clock()
        last_counts = None
        timeout = self.stage_timeout
        while True:
            job = self._get_job(name)
            if job is None:
                return "Gone", "the Job disappeared while it ran (deleted by someone?)"
            state, reason = _finished(job)
            if state:
                return state, reason
            if timeout is None and job.spec is not None and job.spec.active_deadline_seconds:
                timeout = job.spec.active_deadline_seconds + 600.0  # the Job fails itself at its deadline
            st = job.status
            counts = (st.active or 0, st.ready or 0, st.succeeded or 0, st.failed or 0) if st else (0, 0, 0, 0)
            now = self.clock()
            if counts != last_counts or now - last_log >= self.log_every:
                total = job.spec.completions if job.spec is not None and job.spec.completions else 1
                self.log(f"job {name}: running {_fmt_s(now - start)}: {counts[0]} active ({counts[1]} ready), "
                         f"{counts[2]}/{total} succeeded, {counts[3]} failed pods")
                last_counts, last_log = counts, now
            if timeout is not None and now - start > timeout:
                raise KubeError(f"job {name}: not finished after {_fmt_s(now - start)} (limit {_fmt_s(timeout)}); "
                                f"check `kubectl -n {self.namespace} describe job {name}`")
            self.sleep(self.poll)

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
            failed = [p for p in pods.items if p.status is not None and p.status.phase == "Failed"]
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
        """Stage Jobs are owned by the driver's Job, so deleting it (``helm uninstall``) removes them."""
        if not self.owner_job:
            return
        try:
            job = self._get_job(self.owner_job)
        except Exception as e:  # noqa: BLE001 - ownership is a convenience
            self.log(f"pipeline: cannot read own Job {self.owner_job} ({e}); stage Jobs get no owner")
            return
        if job is None or not job.metadata.uid:
            self.log(f"pipeline: own Job {self.owner_job} not found; stage Jobs get no owner")
            return
        self._owner_ref = {"apiVersion": "batch/v1", "kind": "Job", "name": self.owner_job,
                           "uid": job.metadata.uid, "controller": False, "blockOwnerDeletion": False}

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


def _jobset_view(d: dict[str, Any]):
    """A JobSet (a dict from the custom-objects API) seen through the Job attributes the driver reads:
    conditions (Completed → Complete, Failed), pod counts summed over the child Jobs, and a deadline of
    the child Jobs' activeDeadlineSeconds times the restarts allowed."""

    meta, spec, status = d.get("metadata", {}), d.get("spec", {}), d.get("status") or {}
    rjobs = spec.get("replicatedJobs", [])
    child = rjobs[0]["template"]["spec"] if rjobs else {}
    restarts = int((spec.get("failurePolicy") or {}).get("maxRestarts", 0)) + 1
    ads = child.get("activeDeadlineSeconds")
    counts = {k: sum(int(r.get(k, 0)) for r in status.get("replicatedJobsStatus") or [])
              for k in ("active", "ready", "succeeded", "failed")}
    conds = [NS(type={"Completed": "Complete"}.get(c.get("type"), c.get("type")), status=c.get("status"),
                reason=c.get("reason"), message=c.get("message")) for c in status.get("conditions") or []]
    return NS(metadata=NS(annotations=meta.get("annotations") or {}, uid=meta.get("uid"), name=meta.get("name")),
              spec=NS(active_deadline_seconds=ads * restarts if ads else None,
                      completions=sum(int(r.get("replicas", 1)) for r in rjobs) or 1),
              status=NS(conditions=conds, **counts))


def _finished(job) -> tuple[str | None, str]:
    """("Complete"|"Failed", reason) from the Job's terminal condition, or (None, "") while it runs."""
    for c in (job.status.conditions or []) if job.status is not None else []:
        if c.type in ("Complete", "Failed") and c.status == "True":
            return c.type, ": ".join(x for x in (c.reason, c.message) if x) or c.type
    return None, ""


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
