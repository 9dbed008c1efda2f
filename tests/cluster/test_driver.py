"""The pipeline driver (sapd/jobs/pipeline.py, sapd/run/k8s.py) against the real ``kubernetes`` client,
with only its HTTP layer faked: ``urllib3.PoolManager.request`` is routed to an in-memory API server
that stores the Jobs, JobSets, Services and the ConfigMap it is sent, plays a Job controller (a test
scripts each Job's attempts: complete, fail, fail permanently, be preempted, stay queued by Kueue, wait
for an unschedulable pod, keep running) and a JobSet controller with JobSet's own condition reasons
(FailJobSetFailurePolicyAction, ReachedMaxRestarts — never the child Job's), and, when a Job completes,
performs the Job's effect on a local run root — the commit markers the real stage would write (prefix
manifest, checkpoint markers, precompute workers' done-markers, evaluation files). The driver itself
commits each round's scored manifest with the real ``sapd.data.scored.commit_round``.

The stage templates and the driver's config come from rendering the chart (pipeline enabled), and
every Job or Service body the client puts on the wire is validated with ``kubernetes-validate`` in
strict mode, as the chart tests validate the chart.
"""

from __future__ import annotations

import hashlib
import io
import json
import re
import urllib.parse
from pathlib import Path
from typing import Any, Callable

import helm_python as helm
import kubernetes_validate
import pytest
import urllib3
import yaml

from sapd import checkpoints, layout, storage
from sapd.config import load_config
from sapd.data import shards, validation

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "sapd"
KUBE_VERSION = kubernetes_validate.utils.latest_version()
NS = "sapd"
RELEASE = "sapd-t"


# ------------------------------------------------------------------------------------------ fake API server


class FakeKube:
    """A tiny API server: jobs and jobsets (create/read/delete), services (create/read), configmaps (read),
    pods (list) and pod logs.

    ``script[name]`` lists what each attempt (each created incarnation) of Job ``name`` does:
    "complete" (run the effect, then the Complete condition), "fail" (a failed pod, then Failed:
    BackoffLimitExceeded), "fail-permanent" (exit code 2: the podFailurePolicy's exit-code rule),
    "preempted" (a pod's DisruptionTarget: the policy's rule 0 for train), "unschedulable" (a pod the
    scheduler cannot place, until the group fails), "queued:N" (suspended by Kueue for N reads, then it
    completes), "run" (stay running). Unscripted attempts complete. A Job finishes on its second read.
    A JobSet plays JobSet's controller over the same script: a preempted group restarts by itself
    (status.restarts), exit code 2 fails it with FailJobSetFailurePolicyAction, a failure with
    ReachedMaxRestarts. A persistent stage Job (annotated ``sapd.io/rounds``) that is to complete does one
    round's work per read, once that round's input is committed (``tick``), and completes after its last;
    "run" then means a worker that never gets a round done. Jobs (and JobSets) are listed by label."""

    def __init__(self, effect: Callable[[dict], None], tick: Callable[[dict], bool] | None = None):
        self.effect = effect
        self.tick = tick  # a persistent Job's work for one read: True once every round of it is done
        self.jobs: dict[str, dict] = {}
        self.services: dict[str, dict] = {}
        self.pods: dict[str, list[dict]] = {}
        self.script: dict[str, list[str]] = {}
        self.incarnations: dict[str, int] = {}
        self.posted: list[dict] = []  # every Job/Service body as received, in order
        self.calls: list[tuple[str, str]] = []
        self.invalid: list[str] = []
        self.reads: dict[str, int] = {}
        self.race_on_create: set[str] = set()  # POST finds the Job created meanwhile → 409
        self.fail_next: list[int] = []  # statuses to answer the next requests with (transient errors)
        self.configmaps: dict[str, dict] = {}
        self.ended: dict[str, str] = {}  # how each Job's last incarnation failed (the scripted action)
        self.uid = 0

    # -- helpers for tests
    def posted_jobs(self) -> list[str]:
        return [b["metadata"]["name"] for b in self.posted if b["kind"] == "Job"]

    def add_job(self, body: dict, state: str | None = None, attempt: int = 1) -> None:
        """A Job that exists before the driver starts (made by an earlier driver pod)."""
        body = json.loads(json.dumps(body))
        body.setdefault("metadata", {}).setdefault("annotations", {})["sapd.io/attempt"] = str(attempt)
        self._store(body)
        if state:
            self._finish(body["metadata"]["name"], state)

    # -- HTTP
    def request(self, method, url, body=None, fields=None, headers=None, timeout=None, preload_content=True, **kw):
        parts = urllib.parse.urlsplit(url)
        path, query = parts.path, urllib.parse.parse_qs(parts.query)
        self.calls.append((method, path))
        if self.fail_next:
            return self._status(self.fail_next.pop(0), "InternalError", "etcdserver: request timed out")
        m = re.fullmatch(rf"/apis/batch/v1/namespaces/{NS}/jobs(?:/([^/]+))?", path)
        if m:
            return self._jobs(method, m.group(1), json.loads(body) if body else None, query)
        m = re.fullmatch(rf"/apis/jobset.x-k8s.io/v1alpha2/namespaces/{NS}/jobsets(?:/([^/]+))?", path)
        if m:  # a JobSet (train.launcher: jobset): stored and scripted like a Job, its status JobSet's own
            return self._jobs(method, m.group(1), json.loads(body) if body else None, query)
        m = re.fullmatch(rf"/api/v1/namespaces/{NS}/configmaps/([^/]+)", path)
        if m and method == "GET":
            cm = self.configmaps.get(m.group(1))
            return self._json(200, cm) if cm else self._status(404, "NotFound", f'configmaps "{m.group(1)}" not found')
        m = re.fullmatch(rf"/api/v1/namespaces/{NS}/services(?:/([^/]+))?", path)
        if m:
            return self._services(method, m.group(1), json.loads(body) if body else None, query)
        if method == "GET" and path == f"/api/v1/namespaces/{NS}/pods":
            sel = query.get("labelSelector", [""])[0]
            label, _, job = sel.partition("=")
            assert label in ("batch.kubernetes.io/job-name", "jobset.sigs.k8s.io/jobset-name"), sel
            items = sorted(self.pods.get(job, []), key=lambda p: p["metadata"]["name"])  # the API lists by name
            return self._json(200, {"kind": "PodList", "apiVersion": "v1", "metadata": {}, "items": items})
        m = re.fullmatch(rf"/api/v1/namespaces/{NS}/pods/([^/]+)/log", path)
        if m and method == "GET":
            return self._raw(200, f"loading checkpoint\nRuntimeError: CUDA out of memory ({m.group(1)})\n",
                             "text/plain")
        return self._status(404, "NotFound", f"no route {method} {path}")

    def _jobs(self, method, name, body, query):
        if method == "GET" and name is None:  # a list, by label selector (a=b,c=d)
            sel = dict(kv.split("=", 1) for kv in query.get("labelSelector", [""])[0].split(",") if kv)
            items = [self._list_view(j) for n, j in sorted(self.jobs.items())
                     if all((j["metadata"].get("labels") or {}).get(k) == v for k, v in sel.items())]
            return self._json(200, {"kind": "List", "apiVersion": "v1", "metadata": {}, "items": items})
        if method == "POST":
            self._check(body, query)
            name = body["metadata"]["name"]
            if name in self.race_on_create:
                self.race_on_create.discard(name)
                self.add_job(body)  # "another driver pod" created it a moment ago
                return self._status(409, "AlreadyExists", f'jobs.batch "{name}" already exists')
            if name in self.jobs:
                return self._status(409, "AlreadyExists", f'jobs.batch "{name}" already exists')
            self.posted.append(body)
            self.incarnations[name] = self.incarnations.get(name, 0) + 1
            return self._json(201, self._store(body))
        job = self.jobs.get(name)
        if job is None:
            return self._status(404, "NotFound", f'jobs.batch "{name}" not found')
        if method == "DELETE":
            assert json.loads(json.dumps(query)).get("propagationPolicy") == ["Foreground"]
            job["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
            return self._json(200, job)
        # GET: the Job controller acts on reads
        if job["metadata"].get("deletionTimestamp"):
            del self.jobs[name]  # foreground deletion finishes: pods gone
            self.pods.pop(name, None)
            return self._json(200, job)
        self.reads[name] = self.reads.get(name, 0) + 1
        attempt = self.incarnations.get(name, 1)
        steps = self.script.get(name, [])
        action = steps[attempt - 1] if attempt <= len(steps) else "complete"
        if action.startswith("queued:"):  # Kueue keeps it suspended for N reads, then admits it
            job["spec"]["suspend"] = self.reads[name] <= int(action.split(":")[1])
            if job["spec"]["suspend"]:
                job["status"] = {"active": 0}
                return self._view(job)
            job["status"].setdefault("startTime", "2026-01-01T00:30:00Z")
            if self.reads[name] == int(action.split(":")[1]) + 1:  # admitted: running for one read
                job["status"]["active"] = job["spec"].get("completions", 1)
                return self._view(job)
            action = "complete"
        if job["kind"] == "JobSet" and action == "preempted" and not job["status"].get("restarts") \
                and self.reads[name] >= 2:
            job["status"]["restarts"] = 1  # JobSet restarts the group itself (RestartJobSetAndIgnoreMaxRestarts)
            self.reads[name] = 0
            return self._view(job)
        if action == "unschedulable" and self.reads[name] == 1:
            self.pods[name] = [self._pod(name, 0, "Running"), self._pod(name, 1, "Pending")]
        pool = "sapd.io/rounds" in job["metadata"].get("annotations", {})
        if not job["status"].get("conditions") and self.reads[name] >= 2:
            if action != "run":
                if action in ("complete", "preempted") and job["kind"] == "JobSet":
                    action = "complete"
                if action == "complete" and pool:
                    if self.tick is not None and not self.tick(job):
                        return self._view(job)  # a round done (or its input awaited): still running
                elif action == "complete":
                    self.effect(job)
                self._finish(name, action)
        return self._view(job)

    def _list_view(self, job: dict) -> dict:
        """A listed item as the API returns it (a JobSet with its own status), without a controller's read."""
        return json.loads(self._view(job).data) if job["kind"] == "JobSet" else job

    def _view(self, job: dict):
        """The object as the API returns it; a JobSet with JobSet's own status."""
        if job["kind"] != "JobSet":
            return self._json(200, job)
        st = job["status"]
        reasons = {"fail-permanent": ("FailJobSetFailurePolicyAction", "applying FailJobSet failure policy action"),
                   "fail": ("ReachedMaxRestarts", "jobset failed due to reaching max number of restarts")}
        conds = []
        for c in st.get("conditions", []):
            if c["type"] == "Complete":
                conds.append({**c, "type": "Completed", "reason": "AllJobsCompleted", "message": "jobset completed successfully"})
            else:
                reason, message = reasons[self.ended[job["metadata"]["name"]]]
                conds.append({"type": "Failed", "status": "True", "reason": reason, "message": message,
                              "lastTransitionTime": c["lastTransitionTime"]})
        status = {"conditions": conds, "restarts": st.get("restarts", 0),
                  "replicatedJobsStatus": [{"name": "node", "active": st.get("active", 0), "ready": 0,
                                            "succeeded": st.get("succeeded", 0), "failed": 0, "suspended": 0}]}
        return self._json(200, {**job, "status": status})

    @staticmethod
    def _pod(job: str, index: int, phase: str, finished: str = "2026-01-01T01:00:00Z", suffix: str = "abcde") -> dict:
        conds = [{"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                  "message": "0/3 nodes are available: 3 Insufficient nvidia.com/gpu."}] if phase == "Pending" else []
        status: dict[str, Any] = {"phase": phase, "conditions": conds}
        if phase == "Failed":
            status["containerStatuses"] = [{"name": "train", "ready": False, "restartCount": 0, "image": "x",
                                            "imageID": "", "state": {"terminated": {"exitCode": 1, "finishedAt": finished}}}]
        return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": f"{job}-{index}-{suffix}",
                                                               "creationTimestamp": "2026-01-01T00:00:00Z"},
                "status": status}

    def _services(self, method, name, body, query):
        if method == "POST":
            self._check(body, query)
            self.posted.append(body)
            if body["metadata"]["name"] in self.services:
                return self._status(409, "AlreadyExists", "exists")
            self.services[body["metadata"]["name"]] = body
            return self._json(201, body)
        if name in self.services:
            return self._json(200, self.services[name])
        return self._status(404, "NotFound", f'services "{name}" not found')

    def _check(self, body, query):
        assert query.get("fieldValidation") == ["Strict"], query
        if body["kind"] == "JobSet":
            from tests.k8s_harness.apiserver import crd_schema, validate_crd
            from tests.k8s_harness.store import BY_KIND
            self.invalid += validate_crd(body, crd_schema(BY_KIND["JobSet"]))
            return
        try:
            kubernetes_validate.validate(body, KUBE_VERSION, strict=True)
        except kubernetes_validate.ValidationError as e:
            self.invalid.append(f"{body['metadata']['name']}: {e}")

    def _store(self, body: dict) -> dict:
        self.uid += 1
        body = json.loads(json.dumps(body))
        body["metadata"].update({"namespace": NS, "uid": f"uid-{self.uid}", "creationTimestamp": "2026-01-01T00:00:00Z"})
        n = body["spec"].get("completions", 1) if body["kind"] == "Job" else 1
        body["status"] = {"active": n, "ready": 0, "startTime": "2026-01-01T00:00:00Z"}
        if "kueue.x-k8s.io/queue-name" in body["metadata"].get("labels", {}):
            body["spec"]["suspend"] = True  # Kueue's webhook suspends a queued Job until it admits it
        self.jobs[body["metadata"]["name"]] = body
        self.reads[body["metadata"]["name"]] = 0
        return body

    def _finish(self, name: str, state: str) -> None:
        job = self.jobs[name]
        n = job["spec"].get("completions", 1) if job["kind"] == "Job" else 1
        t = "2026-01-01T01:00:00Z"
        if state == "complete":
            job["status"] = {"succeeded": n, "active": 0, "completionTime": t,
                             "conditions": [{"type": "Complete", "status": "True", "lastTransitionTime": t}]}
        else:
            # the Job controller's own wording (pkg/controller/job/pod_failure_policy.go)
            reason, message = {
                "fail-permanent": ("PodFailurePolicy", "Container train for pod sapd/x failed with exit code 2 "
                                   "matching FailJob rule at index 1"),
                "preempted": ("PodFailurePolicy", f"Pod sapd/{name}-1-abcde has condition DisruptionTarget matching "
                              "FailJob rule at index 0"),
            }.get(state, ("BackoffLimitExceeded", "Job has reached the specified backoff limit"))
            job["status"] = {"failed": job["spec"].get("backoffLimit", 0) + 1, "active": 0, "conditions": [
                {"type": "Failed", "status": "True", "reason": reason, "message": message, "lastTransitionTime": t}]}
            self.ended[name] = state
            pending = [p for p in self.pods.get(name, []) if p["status"]["phase"] == "Pending"]
            self.pods[name] = [self._pod(name, 0, "Failed")] + pending

    def _json(self, status: int, obj: Any):
        return self._raw(status, json.dumps(obj), "application/json")

    def _status(self, code: int, reason: str, message: str):
        return self._json(code, {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                                 "message": message, "reason": reason, "code": code})

    @staticmethod
    def _raw(status: int, text: str, ctype: str):
        return urllib3.HTTPResponse(body=io.BytesIO(text.encode()), status=status, headers={"Content-Type": ctype},
                                    preload_content=False, reason={200: "OK", 201: "Created"}.get(status, "Error"))


# ------------------------------------------------------------------------------------------ job effects


def job_effect(root: str, commit: bool = True) -> Callable[[dict], None]:
    """What each stage's pods leave in the run root when they succeed (the commit markers the
    driver checks; the scored parts as the precompute workers write them, before the commit)."""
    def effect(job: dict) -> None:
        labels = job["metadata"]["labels"]
        stage = labels["app.kubernetes.io/component"]
        k = int(labels["sapd.io/round"]) if "sapd.io/round" in labels else None
        effect.log.append(job["metadata"]["name"])
        if not commit:
            return
        if stage == "build-prefixes":
            shards.commit_manifest(layout.prefixes_dir(root), {"kind": "prefix-build", "stats": {"train": 4, "val": 1}})
            storage.write_json(layout.checkpoint_marker(root, 0), {"checkpoint": 0, "commit_id": "c0"})
        elif stage == "teacher-scores":
            cfg = load_config(Path(root).parent / "config.yaml", overrides={"run_root": root})
            out = layout.scored_dir(root, k)
            for w in range(job["spec"]["completions"]):  # pod w = JOB_COMPLETION_INDEX w
                if validation.wanted(cfg, k):  # checkpoint k's validation, before the scored part
                    validation.write_teacher_part(cfg, w, [], 0.0)
                    validation.write_part(cfg, k, w, [], {"sample_seconds": 0.1})
                if k >= cfg.train.rounds:
                    continue  # the last checkpoint: validated only
                data = f"part {w} of round {k}".encode()
                storage.write_bytes(storage.join(out, f"part-{w:05d}.parquet"), data)
                storage.write_json(storage.join(out, f"_worker-{w:05d}.json"),
                                   {"worker": w, "rows": 3, "bytes": len(data),
                                    "sha256": hashlib.sha256(data).hexdigest(), "timings": {}})
        elif stage == "train":
            storage.write_json(layout.checkpoint_marker(root, k + 1), {"checkpoint": k + 1, "commit_id": f"c{k + 1}"})
        elif stage == "evaluate":
            storage.write_json(storage.join(layout.evals_dir(root, k), "alfworld.json"), {"success": 0.5})
    effect.log = []
    return effect


def pool_tick(root: str, cfg) -> Callable[[dict], bool]:
    """What the pods of a persistent stage Job leave in the run root, one round per read of the Job: the
    scoring workers write round k's parts and commit it once its sampling checkpoint is committed, the
    trainer commits checkpoint k+1 once round k is scored. → True when every round of the Job is done."""
    from sapd.config import sampler_checkpoint
    from sapd.data.scored import commit_round

    def tick(job: dict) -> bool:
        stage = job["metadata"]["labels"]["app.kubernetes.io/component"]
        first, last = map(int, job["metadata"]["annotations"]["sapd.io/rounds"].split("-"))
        for k in range(first, last + 1):
            if checkpoints.is_committed(root, k + 1):
                continue
            if stage == "teacher-scores":
                if shards.read_manifest(layout.scored_dir(root, k)) is not None:
                    continue
                if checkpoints.is_committed(root, sampler_checkpoint(cfg, k)):
                    out = layout.scored_dir(root, k)
                    for w in range(job["spec"]["completions"]):
                        data = f"part {w} of round {k}".encode()
                        storage.write_bytes(storage.join(out, f"part-{w:05d}.parquet"), data)
                        storage.write_json(storage.join(out, f"_worker-{w:05d}.json"),
                                           {"worker": w, "workers": cfg.workers, "rows": 3, "bytes": len(data),
                                            "sha256": hashlib.sha256(data).hexdigest(), "timings": {}})
                    commit_round(cfg, k)  # the last worker commits
                    tick.log.append(f"{job['metadata']['name']}: scored {k}")
                return False
            if shards.read_manifest(layout.scored_dir(root, k)) is not None or cfg.loss_cfg.objective == "sft":
                storage.write_json(layout.checkpoint_marker(root, k + 1), {"checkpoint": k + 1, "commit_id": f"c{k + 1}"})
                tick.log.append(f"{job['metadata']['name']}: trained {k}")
            return False
        return True
    tick.log = []
    return tick


# ------------------------------------------------------------------------------------------ fixtures


def render_chart(values: dict) -> list[dict]:
    with helm.Chart.load(CHART) as chart:
        out = chart.render(values=values, name=RELEASE, namespace=NS, is_install=True)
    return [d for path, text in out.items() if not path.endswith("NOTES.txt") for d in yaml.safe_load_all(text) if d]


class Env:
    """A rendered release, its driver's config and templates, a fake API server and a run root; the driver
    runs ``stage_jobs`` (the tests of per-round Jobs, then those of persistent ones, below)."""

    def __init__(self, tmp_path: Path, monkeypatch, values: dict | None = None, stage_jobs: str = "per-round"):
        self.stage_jobs = stage_jobs
        values = {"teacherScores": {"parallelism": 2},
                  "config": {"train": {"rounds": 2}}, **(values or {})}
        docs = render_chart(values)
        cms = {d["metadata"]["name"]: d for d in docs if d["kind"] == "ConfigMap"}
        self.templates = tmp_path / "templates"  # what the driver pod sees at /etc/sapd-pipeline
        self.templates.mkdir()
        for key, text in cms[f"{RELEASE}-pipeline-templates"]["data"].items():
            (self.templates / key).write_text(text)
        self.config = tmp_path / "config.yaml"  # … and at /etc/sapd/config.yaml
        self.config.write_text(cms[f"{RELEASE}-config"]["data"]["pipeline.yaml"])
        (self.driver_job,) = [d for d in docs if d["kind"] == "Job"
                              and d["metadata"]["labels"]["app.kubernetes.io/component"] == "pipeline"]
        self.root = str(tmp_path / "run")
        self.cfg = load_config(self.config, overrides={"run_root": self.root})
        self.effect = job_effect(self.root)
        self.tick = pool_tick(self.root, self.cfg)
        self.kube = FakeKube(self.effect, self.tick)
        self.kube.add_job(self.driver_job)  # the driver's own Job (of this revision)
        # the release's templates ConfigMap, which every revision keeps: the owner of the stage Jobs
        self.owner = f"{RELEASE}-pipeline-templates"
        self.kube.configmaps[self.owner] = {**cms[self.owner], "metadata": {
            **cms[self.owner]["metadata"], "namespace": NS, "uid": "uid-templates-cm"}}
        monkeypatch.setattr(urllib3.PoolManager, "request",
                            lambda pm, *a, **kw: self.kube.request(*a, **kw))
        self.kubeconfig = tmp_path / "kubeconfig"
        self.kubeconfig.write_text(yaml.safe_dump({
            "apiVersion": "v1", "kind": "Config", "current-context": "fake",
            "clusters": [{"name": "fake", "cluster": {"server": "https://kube.fake.invalid:6443",
                                                      "insecure-skip-tls-verify": True}}],
            "users": [{"name": "u", "user": {"token": "t0ken"}}],
            "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "u", "namespace": NS}}]}))

    def argv(self, *extra: str) -> list[str]:
        # --no-check: the config names S3 inputs the stand-in stage pods never read (the driver's checks,
        # which run before it creates anything, are tested in tests/run/test_jobs.py)
        return ["--no-check", "--config", str(self.config), "--run-root", self.root, "--release", RELEASE,
                "--templates", str(self.templates), "--namespace", NS, "--kubeconfig", str(self.kubeconfig),
                "--poll-seconds", "0", "--owner", f"configmap/{self.owner}", "--stage-jobs", self.stage_jobs, *extra]

    def driver(self, **kw):
        from sapd.run.k8s import Driver, StageTemplates, load_api_client
        kw.setdefault("poll_seconds", 0)
        kw.setdefault("log", self.lines.append)
        kw.setdefault("owner", f"configmap/{self.owner}")
        kw.setdefault("stage_jobs", self.stage_jobs)
        return Driver(self.cfg, StageTemplates.from_dir(self.templates), load_api_client(str(self.kubeconfig)), NS,
                      **kw)

    lines: list[str]


@pytest.fixture
def env(tmp_path, monkeypatch):
    e = Env(tmp_path, monkeypatch)
    e.lines = []
    return e


# teacher-scores-r2: no round to score, the last checkpoint's validation (validation.every_rounds: 1)
ORDER = [f"{RELEASE}-build-prefixes", f"{RELEASE}-teacher-scores-r0", f"{RELEASE}-train-r0",
         f"{RELEASE}-teacher-scores-r1", f"{RELEASE}-train-r1", f"{RELEASE}-teacher-scores-r2",
         f"{RELEASE}-evaluate-r2"]


# ------------------------------------------------------------------------------------------ tests


def test_the_driver_checks_first_and_creates_no_job_when_a_check_fails(env, capsys):
    """Here the data and models are simulated S3 URIs no server holds: the driver's checks (its first
    step in the chart) stop it with exit 2 and a line naming the input, before any Job exists."""
    from sapd.jobs import pipeline
    assert pipeline.main([a for a in env.argv() if a != "--no-check"]) == 2
    cap = capsys.readouterr()
    assert "check data: FAILED" in cap.out and "check data: FAILED" in cap.err
    assert env.kube.posted_jobs() == []


def test_two_rounds_in_order_with_valid_manifests(env, capsys):
    from sapd.jobs import pipeline
    assert pipeline.main(env.argv()) == 0
    out = capsys.readouterr().out
    assert env.kube.posted_jobs() == ORDER == env.effect.log
    assert env.kube.invalid == []
    for body in env.kube.posted:  # the strict schema check, once more here, on what went over the wire
        assert kubernetes_validate.validate(body, KUBE_VERSION, strict=True)
    assert layout.committed_checkpoints(env.root) == [0, 1, 2]
    for k in (0, 1):  # committed by the driver (commit_round) once the Indexed Job completed
        m = shards.read_manifest(layout.scored_dir(env.root, k))
        assert m["round"] == k and m["workers"] == 2 and m["rows"] == 6
    # each checkpoint's validation too, the last one (2) by its own teacher-scores Job, which scores nothing
    assert [validation.read(env.root, k)["workers"] for k in (0, 1, 2)] == [2, 2, 2]
    assert not shards.read_manifest(layout.scored_dir(env.root, 2))
    assert "checkpoint 2: committed its validation on 0 held-out prefixes" in out
    jobs = {b["metadata"]["name"]: b for b in env.kube.posted if b["kind"] == "Job"}
    last = jobs[f"{RELEASE}-teacher-scores-r2"]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert last[last.index("--round") + 1] == "2"
    for k in (0, 1):
        ts = jobs[f"{RELEASE}-teacher-scores-r{k}"]
        assert ts["spec"]["completionMode"] == "Indexed"
        assert ts["spec"]["completions"] == ts["spec"]["parallelism"] == 2 == env.cfg.workers
        cmd = ts["spec"]["template"]["spec"]["containers"][0]["args"]
        assert cmd[:3] == ["python", "-m", "sapd.jobs.teacher_scores"] and cmd[cmd.index("--round") + 1] == str(k)
        assert ts["metadata"]["labels"]["sapd.io/round"] == str(k)
        tr = jobs[f"{RELEASE}-train-r{k}"]
        tcmd = tr["spec"]["template"]["spec"]["containers"][0]["args"]
        assert tcmd[tcmd.index("--round") + 1] == str(k)
        assert f"--master-addr={RELEASE}-train-r{k}-0.{RELEASE}-train" in tcmd
        assert tr["spec"]["completionMode"] == "Indexed"
    for name, body in jobs.items():
        last = {"sapd.io/validation-only": "true"} if name == f"{RELEASE}-teacher-scores-r2" else {}
        assert body["metadata"]["annotations"] == {"sapd.io/attempt": "1", "sapd.io/run-root": env.root, **last}
        # owned by the release's templates ConfigMap, which `helm upgrade` keeps (it deletes the old driver
        # Job, whose dependents the garbage collector would delete), and `helm uninstall` removes
        assert body["metadata"]["ownerReferences"] == [{
            "apiVersion": "v1", "kind": "ConfigMap", "name": f"{RELEASE}-pipeline-templates", "uid": "uid-templates-cm",
            "controller": False, "blockOwnerDeletion": False}]
        assert body["metadata"]["labels"]["app.kubernetes.io/managed-by"] == "sapd-pipeline"
        assert "__SAPD_ROUND__" not in json.dumps(body)
    # nothing the chart renders was dropped by the typed client on the way out
    from sapd.run.k8s import StageTemplates
    t = StageTemplates.from_dir(env.templates)
    assert jobs[f"{RELEASE}-train-r1"]["spec"] == t.render("train", 1)["spec"]
    assert [b["metadata"]["name"] for b in env.kube.posted if b["kind"] == "Service"] == [f"{RELEASE}-train"]
    assert "job sapd-t-teacher-scores-r0: created (attempt 1/3, Indexed: 2 completions, parallelism 2)" in out
    assert "round 1: committed 6 scored groups from 2 workers" in out
    assert "pipeline done: checkpoints [0, 1, 2] committed" in out


def test_rerun_of_a_finished_run_creates_nothing(env, capsys):
    from sapd.jobs import pipeline
    assert pipeline.main(env.argv()) == 0
    n = len(env.kube.posted)
    assert pipeline.main(env.argv()) == 0
    assert len(env.kube.posted) == n
    out = capsys.readouterr().out
    assert "stage build-prefixes: committed, skipping" in out
    assert "stage train-r1: committed, skipping" in out and "stage evaluate-r2: committed, skipping" in out


class Crash(Exception):
    """The driver pod is killed."""


def kill_driver_while_running(env, name: str) -> None:
    """Run the driver until Job ``name`` runs, kill it there (:class:`Crash`), then script ``name`` to
    complete while the next driver watches it."""
    env.kube.script[name] = ["run"]
    sleeps = []

    def dying_sleep(s):
        sleeps.append(s)
        if name in env.kube.jobs and len(sleeps) > 5:
            raise Crash
    with pytest.raises(Crash):
        env.driver(sleep=dying_sleep).run()
    env.kube.script[name] = ["complete"]
    env.kube.reads[name] = 0


def test_restart_skips_committed_stages_and_adopts_the_running_job(env):
    kill_driver_while_running(env, f"{RELEASE}-train-r1")
    assert env.kube.posted_jobs() == ORDER[:5]
    assert not checkpoints.is_committed(env.root, 2)
    # the new driver pod: train-r1 is still running; it finishes while being watched
    env.lines.clear()
    result = env.driver().run()
    assert env.kube.posted_jobs() == ORDER  # only the last validation and evaluate are new: no duplicate train-r1
    assert result["adopted"] == [f"{RELEASE}-train-r1"] and result["created"] == ORDER[5:]
    assert result["skipped"] == ["build-prefixes", "teacher-scores-r0", "train-r0", "teacher-scores-r1"]
    assert f"job {RELEASE}-train-r1: exists (running, attempt 1), adopting it" in env.lines
    assert layout.committed_checkpoints(env.root) == [0, 1, 2]


def test_restart_after_an_indexed_job_completed_commits_the_round(env):
    # the driver died after teacher-scores-r0 completed but before it committed the round
    from sapd.run.k8s import StageTemplates
    t = StageTemplates.from_dir(env.templates)
    job_effect(env.root)(t.render("build-prefixes"))
    ts = t.render("teacher-scores", 0)
    env.effect(ts)
    env.kube.add_job(ts, state="complete")
    env.driver().run()
    assert f"{RELEASE}-teacher-scores-r0" not in env.kube.posted_jobs()
    assert shards.read_manifest(layout.scored_dir(env.root, 0))["workers"] == 2
    assert env.kube.posted_jobs() == ORDER[2:]


def test_a_409_on_create_adopts_the_job_instead_of_duplicating_it(env):
    name = f"{RELEASE}-teacher-scores-r0"
    env.kube.race_on_create.add(name)
    result = env.driver().run()
    assert name in result["adopted"] and name not in env.kube.posted_jobs()
    assert env.kube.incarnations.get(name) is None and name in env.effect.log  # ran once: the other pod's
    assert layout.committed_checkpoints(env.root) == [0, 1, 2]


def test_a_failed_job_is_recreated_then_succeeds(env):
    name = f"{RELEASE}-teacher-scores-r1"
    env.kube.script[name] = ["fail"]
    result = env.driver(retries=2).run()
    assert result["retried"] == [name] and env.kube.incarnations[name] == 2
    assert ("DELETE", f"/apis/batch/v1/namespaces/{NS}/jobs/{name}") in env.kube.calls
    second = [b for b in env.kube.posted if b["metadata"]["name"] == name][-1]
    assert second["metadata"]["annotations"]["sapd.io/attempt"] == "2"
    assert any("attempt 1/3 failed: BackoffLimitExceeded" in ln for ln in env.lines)
    assert any("CUDA out of memory" in ln for ln in env.lines)  # the failed pod's log tail
    assert layout.committed_checkpoints(env.root) == [0, 1, 2]


def test_a_stage_that_keeps_failing_stops_the_driver_with_exit_1(env, capsys):
    from sapd.jobs import pipeline
    name = f"{RELEASE}-train-r0"
    env.kube.script[name] = ["fail"] * 5
    assert pipeline.main(env.argv("--retries", "2")) == 1
    captured = capsys.readouterr()
    assert env.kube.incarnations[name] == 3 and env.kube.posted_jobs()[-1] == name  # nothing after it
    err = captured.err.strip()
    assert len(err.splitlines()) == 1
    assert f"stage train (round 0): Job {name} failed 3 time(s), giving up" in err
    assert "BackoffLimitExceeded" in err and f"kubectl -n {NS} delete job {name}" in err
    assert f"job {name}: attempt 3/3 failed" in captured.out
    # a restarted driver keeps counting (the attempt annotation): it gives up at once, creating nothing
    n = len(env.kube.posted)
    assert pipeline.main(env.argv("--retries", "2")) == 1
    assert len(env.kube.posted) == n and "adopting it" in capsys.readouterr().out


def test_a_job_that_completes_without_committing_counts_as_a_failure(env, capsys):
    from sapd.jobs import pipeline
    env.kube.effect = job_effect(env.root, commit=False)
    assert pipeline.main(env.argv("--retries", "1")) == 1
    err = capsys.readouterr().err
    assert f"Job {RELEASE}-build-prefixes failed 2 time(s)" in err
    assert "the Job completed, but no prefix build committed" in err


def test_transient_api_errors_are_retried(env):
    env.kube.fail_next = [500, 503]
    slept = []
    env.driver(sleep=slept.append).run()
    assert layout.committed_checkpoints(env.root) == [0, 1, 2]
    assert slept[:2] == [1.0, 2.0] and any("500" in ln and "retrying" in ln for ln in env.lines)


def test_a_job_that_never_finishes_hits_the_stage_timeout_exit_3(env):
    from sapd.run.k8s import KubeError
    env.kube.script[f"{RELEASE}-build-prefixes"] = ["run"]
    now = [0.0]
    with pytest.raises(KubeError, match=r"not finished after 1h00m06s \(limit 1h00m00s\)") as e:
        env.driver(stage_timeout_seconds=3600, sleep=lambda s: now.__setitem__(0, now[0] + 601),
                   clock=lambda: now[0], log_every_seconds=1200).run()
    assert e.value.exit_code == 3
    running = [ln for ln in env.lines if "running" in ln]
    assert 3 <= len(running) <= 5 and "1 active (0 ready), 0/1 succeeded" in running[0]


def test_sft_runs_no_teacher_scores(tmp_path, monkeypatch):
    e = Env(tmp_path, monkeypatch, {"config": {"variant": "sft", "train": {"rounds": 2}}})
    e.lines = []
    e.driver().run()
    assert e.kube.posted_jobs() == [ORDER[0], ORDER[2], ORDER[4], ORDER[6]]


def test_a_run_extended_past_its_last_validation_scores_that_round_in_a_new_job(tmp_path, monkeypatch):
    """A 1-round run ends with teacher-scores-r1 validating checkpoint 1 (nothing to score). Given 2 rounds
    (`helm upgrade --set config.train.rounds=2`), round 1 must be scored under the same Job name: the finished
    validation-only Job is replaced, not adopted as if it had scored the round, and not counted as a retry."""
    e = Env(tmp_path, monkeypatch, {"config": {"train": {"rounds": 1}}})
    e.lines = []
    e.driver().run()
    first = e.kube.jobs[f"{RELEASE}-teacher-scores-r1"]
    assert first["metadata"]["annotations"]["sapd.io/validation-only"] == "true"
    assert validation.is_committed(e.root, 1) and not shards.read_manifest(layout.scored_dir(e.root, 1))
    e.config.write_text(e.config.read_text().replace("rounds: 1", "rounds: 2"))
    e.cfg = load_config(e.config, overrides={"run_root": e.root})
    assert e.cfg.train.rounds == 2
    e.lines = []
    result = e.driver().run()
    name = f"{RELEASE}-teacher-scores-r1"
    assert f"job {name}: exists, but it only validated checkpoint 1, the last of a shorter run; the run now " \
           "scores round 1: creating it anew" in e.lines
    assert result["created"][:3] == [name, f"{RELEASE}-train-r1", f"{RELEASE}-teacher-scores-r2"]
    assert name not in result["retried"] and name not in result["adopted"]
    assert "sapd.io/validation-only" not in e.kube.jobs[name]["metadata"]["annotations"]
    assert shards.read_manifest(layout.scored_dir(e.root, 1))["workers"] == 2 and validation.is_committed(e.root, 2)


def test_a_build_without_validation_prefixes_has_no_last_validation_job(tmp_path, monkeypatch):
    """data.val_fraction 0: the plan made before the build names the last checkpoint's validation; once the
    build shows no validation prefixes, the driver skips it, saying why, and creates no Job for it."""
    e = Env(tmp_path, monkeypatch)
    e.lines = []
    real = e.kube.effect

    def no_val(job: dict) -> None:  # the build commits no validation prefixes
        real(job)
        if job["metadata"]["labels"]["app.kubernetes.io/component"] == "build-prefixes":
            shards.commit_manifest(layout.prefixes_dir(e.root), {"kind": "prefix-build", "stats": {"train": 4, "val": 0}})
    e.kube.effect = no_val
    e.driver().run()
    assert e.kube.posted_jobs() == [ORDER[0], ORDER[1], ORDER[2], ORDER[3], ORDER[4], ORDER[6]]
    assert "stage teacher-scores-r2: nothing to validate (the prefix build has no validation prefixes), skipping" \
        in e.lines
    assert not validation.is_committed(e.root, 0)


def test_forbidden_is_a_clear_exit_3(env, capsys):
    from sapd.jobs import pipeline
    env.kube.fail_next = [403]
    assert pipeline.main(env.argv("--owner", "")) == 3
    assert "the driver's ServiceAccount may not do this" in capsys.readouterr().err


def test_templates_are_checked(tmp_path):
    from sapd.run.k8s import DriverError, StageTemplates
    with pytest.raises(DriverError, match="no stage templates folder"):
        StageTemplates.from_dir(tmp_path / "missing")
    (tmp_path / "trian.yaml").write_text("kind: Job\n")
    with pytest.raises(DriverError, match="unknown stage template"):
        StageTemplates.from_dir(tmp_path)
    long = StageTemplates({"train": yaml.safe_dump({"kind": "Job", "metadata": {"name": "x" * 60 + "-r__SAPD_ROUND__"},
                                                    "spec": {"completionMode": "Indexed", "completions": 2}})})
    with pytest.raises(DriverError, match="at most 63 characters"):
        long.render("train", 1)
    with pytest.raises(DriverError, match="no template for stage 'evaluate'"):
        long.render("evaluate", 1)


def test_a_permanent_failure_is_not_retried(env, capsys):
    """Exit code 2 (a config or input error) matches the chart's FailJob rule: the Job fails with reason
    PodFailurePolicy, and the driver stops at once instead of spending its retries on GPU nodes."""
    from sapd.jobs import pipeline
    name = f"{RELEASE}-train-r0"
    env.kube.script[name] = ["fail-permanent"]
    assert pipeline.main(env.argv("--retries", "2")) == 1
    assert env.kube.incarnations[name] == 1
    assert "a permanent error: not retried" in capsys.readouterr().err


def test_a_jobset_train_stage_is_created_watched_and_retried(tmp_path, monkeypatch):
    e = Env(tmp_path, monkeypatch, {"train": {"launcher": "jobset", "parallelism": 2}})
    e.lines = []
    name = f"{RELEASE}-train-r1"
    e.kube.script[name] = ["fail"]
    result = e.driver(retries=1).run()
    assert e.kube.invalid == []  # every JobSet body matched the vendored CRD schema
    posted = [b for b in e.kube.posted if b["kind"] == "JobSet"]
    assert [b["metadata"]["name"] for b in posted] == [f"{RELEASE}-train-r0", name, name]
    assert posted[-1]["metadata"]["annotations"]["sapd.io/attempt"] == "2"
    assert ("DELETE", f"/apis/jobset.x-k8s.io/v1alpha2/namespaces/{NS}/jobsets/{name}") in e.kube.calls
    assert result["retried"] == [name] and layout.committed_checkpoints(e.root) == [0, 1, 2]
    assert any(f"job {name}: created (attempt 1/2, a JobSet, Indexed: 2 completions" in ln for ln in e.lines)
    assert not any(b["kind"] == "Service" for b in e.kube.posted)  # JobSet makes its own


# ------------------------------------------------------------------------------------------ queues, gangs, failures


def test_a_jobset_permanent_failure_is_recognised_by_jobsets_own_reason(tmp_path, monkeypatch, capsys):
    """Exit code 2 in a JobSet's child Job: JobSet applies the chart's FailJobSet rule and reports
    FailJobSetFailurePolicyAction (never the child's PodFailurePolicy): no retry on 16 GPUs, exit 1."""
    from sapd.jobs import pipeline
    e = Env(tmp_path, monkeypatch, {"train": {"launcher": "jobset"}})
    name = f"{RELEASE}-train-r0"
    e.kube.script[name] = ["fail-permanent"]
    assert pipeline.main(e.argv("--retries", "2")) == 1
    err = capsys.readouterr().err
    assert e.kube.incarnations[name] == 1 and "a permanent error: not retried" in err
    assert "FailJobSetFailurePolicyAction" in err and f"describe job {name}-node-0" in err  # the child Job's name
    assert f"delete jobset {name}" in err


def test_a_preempted_jobset_restarts_itself_and_the_driver_waits_on(tmp_path, monkeypatch):
    e = Env(tmp_path, monkeypatch, {"train": {"launcher": "jobset"}})
    e.lines = []
    name = f"{RELEASE}-train-r0"
    e.kube.script[name] = ["preempted"]
    result = e.driver(retries=0).run()
    assert e.kube.incarnations[name] == 1 and result["retried"] == [] and result["restarted"] == []
    assert f"job {name}: its group was restarted by JobSet (restart 1); its time limit starts again" in e.lines
    assert layout.committed_checkpoints(e.root) == [0, 1, 2]


def test_a_preempted_train_pod_restarts_the_whole_group_uncounted(env):
    """The chart fails the train Job on a pod's DisruptionTarget (rule 0): one replaced rank cannot rejoin a
    static torchrun group. The driver recreates the group and does not count it: with no retries at all,
    the run still completes."""
    name = f"{RELEASE}-train-r0"
    env.kube.script[name] = ["preempted", "preempted", "complete"]
    result = env.driver(retries=0).run()
    assert env.kube.incarnations[name] == 3 and result["retried"] == [] and result["restarted"] == [name, name]
    assert all(b["metadata"]["annotations"]["sapd.io/attempt"] == "1" for b in env.kube.posted
               if b["metadata"]["name"] == name)
    assert any(f"job {name}: attempt 1/1 ended: PodFailurePolicy: Pod sapd/{name}-1-abcde has condition "
               "DisruptionTarget matching FailJob rule at index 0; a pod was preempted or evicted (DisruptionTarget): "
               "recreating the whole group, not counted against the retries" == ln for ln in env.lines), env.lines
    assert layout.committed_checkpoints(env.root) == [0, 1, 2]


def test_a_kueue_queued_job_is_logged_as_queued_and_its_time_limit_starts_at_admission(tmp_path, monkeypatch):
    """Kueue suspends a Job until it admits it; the driver logs it as queued, and its stage limit (here
    1000 s) counts from the admission: 50 minutes in the queue are no timeout."""
    e = Env(tmp_path, monkeypatch, {"kueue": {"queueName": "team-a"}})
    e.lines = []
    name = f"{RELEASE}-teacher-scores-r0"
    e.kube.script[name] = ["queued:5"]
    now = [0.0]
    e.driver(stage_timeout_seconds=1000, sleep=lambda s: now.__setitem__(0, now[0] + 600), clock=lambda: now[0],
             log_every_seconds=1200).run()
    queued = [ln for ln in e.lines if ln.startswith(f"job {name}: queued")]
    assert queued[0] == f"job {name}: queued 0m00s: suspended, waiting for admission by Kueue (LocalQueue team-a)"
    assert len(queued) >= 2 and any("queued 50m00s" in ln or "queued 40m00s" in ln for ln in queued), queued
    assert any(ln.startswith(f"job {name}: running 0m00s:") for ln in e.lines)
    assert layout.committed_checkpoints(e.root) == [0, 1, 2]


def test_without_kueue_a_group_that_never_assembled_is_recreated_uncounted(env):
    """No Kueue: train pod 1 cannot be scheduled (no free GPU node) and pod 0 gives up at its rendezvous
    timeout. The driver logged why the group waited, and the failure is not counted against the retries."""
    name = f"{RELEASE}-train-r0"
    env.kube.script[name] = ["unschedulable", "complete"]
    result = env.driver(retries=0).run()
    assert env.kube.incarnations[name] == 2 and result["retried"] == [] and result["restarted"] == [name]
    unsched = "1 of 2 pods unschedulable: 0/3 nodes are available: 3 Insufficient nvidia.com/gpu."
    assert any(ln.startswith(f"job {name}: running") and ln.endswith(f"; waiting for the group to assemble: {unsched}")
               for ln in env.lines), env.lines
    assert any(f"; the group never assembled ({unsched}): recreating the whole group, not counted" in ln
               for ln in env.lines)


def test_the_newest_failed_pod_is_the_one_whose_log_is_shown(env):
    """The API lists pods by name, not by time: the driver picks the failed pod that ended last."""
    drv = env.driver()
    name = f"{RELEASE}-train-r0"
    env.kube.pods[name] = [env.kube._pod(name, 0, "Failed", "2026-01-01T01:00:00Z", "zzzzz"),
                           env.kube._pod(name, 0, "Failed", "2026-01-01T02:00:00Z", "aaaaa")]
    drv._log_failed_pods(name)
    assert f"job {name}: last 2 log lines of failed pod {name}-0-aaaaa:" in env.lines


def test_a_failed_final_evaluation_leaves_the_run_complete(env, capsys):
    """The checkpoints are committed: an evaluation that keeps failing is reported, and the driver exits 0
    (the driver Job Complete) instead of failing a run whose training succeeded."""
    from sapd.jobs import pipeline
    name = f"{RELEASE}-evaluate-r2"
    env.kube.script[name] = ["fail"] * 3
    assert pipeline.main(env.argv("--retries", "2")) == 0
    out = capsys.readouterr().out
    assert env.kube.incarnations[name] == 3
    assert f"pipeline: WARNING: the final evaluation failed; checkpoints are committed, so the run completes. stage " \
           f"evaluate (round 2): Job {name} failed 3 time(s), giving up" in out
    assert "pipeline done: checkpoints [0, 1, 2] committed; the final evaluation FAILED (see the WARNING above)" in out


def fill_job(env: Env) -> dict:
    """The chart's ALFWorld data fill Job (the base values' benchmark is ALFWorld), which the driver's
    rendered arguments name as the evaluation's prerequisite."""
    args = env.driver_job["spec"]["template"]["spec"]["containers"][0]["args"]
    (fill,) = [d for d in render_chart({"teacherScores": {"parallelism": 2}, "config": {"train": {"rounds": 2}}})
               if d["kind"] == "Job" and d["metadata"]["labels"]["app.kubernetes.io/component"] == "alfworld-fill"]
    assert args[args.index("--evaluate-after-job") + 1] == fill["metadata"]["name"]
    return fill


def test_the_evaluation_waits_for_the_alfworld_fill_job(env, capsys):
    """The chart's driver arguments name ALFWorld's fill Job: the final evaluation is created only once that
    Job is complete (here it is still running when the driver gets there)."""
    from sapd.jobs import pipeline
    fill = fill_job(env)
    name = fill["metadata"]["name"]
    env.kube.add_job(fill)  # Helm created it with the release; it runs (completes on its second read)
    assert pipeline.main(env.argv("--evaluate-after-job", name)) == 0
    out = capsys.readouterr().out
    waiting = out.index(f"stage evaluate-r2: waiting for job {name} to complete first")
    assert waiting < out.index(f"stage evaluate-r2: job {name} is complete") < out.index(
        f"job {RELEASE}-evaluate-r2: created")
    assert env.kube.posted_jobs() == ORDER  # nothing created for it: it is Helm's


def test_a_failed_fill_job_fails_the_evaluation_not_the_run(env, capsys):
    from sapd.jobs import pipeline
    fill = fill_job(env)
    name = fill["metadata"]["name"]
    env.kube.add_job(fill, state="fail")
    assert pipeline.main(env.argv("--evaluate-after-job", name)) == 0
    out = capsys.readouterr().out
    assert f"{RELEASE}-evaluate-r2" not in env.kube.posted_jobs()  # no evaluation pod on missing game files
    assert (f"pipeline: WARNING: the final evaluation failed; checkpoints are committed, so the run completes. stage "
            f"evaluate-r2: job {name}, which it needs first, failed: BackoffLimitExceeded") in out
    assert f"`kubectl -n {NS} logs job/{name}`" in out


def test_a_fill_job_deleted_after_its_ttl_counts_as_done(env, capsys):
    from sapd.jobs import pipeline
    name = fill_job(env)["metadata"]["name"]
    assert pipeline.main(env.argv("--evaluate-after-job", name)) == 0
    out = capsys.readouterr().out
    assert f"stage evaluate-r2: job {name}, which it needs first, is not there" in out
    assert env.kube.posted_jobs() == ORDER


def test_evaluate_r_evaluates_exactly_checkpoint_r(env):
    from sapd.run.k8s import StageTemplates
    args = StageTemplates.from_dir(env.templates).render("evaluate", 2)["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--checkpoint") + 1] == "2"


# ------------------------------------------------------------------------------------------ one stage (manual mode)


def test_one_stage_waits_for_its_input_then_runs_only_its_job(env):
    """`python -m sapd.jobs.pipeline --stage train --round 1` (a manual-mode gate): a small pod that waits until
    round 1's scored manifest is committed — no GPU, no deadline running meanwhile — then creates train-r1."""
    from sapd.data.scored import commit_round
    from sapd.run.k8s import StageTemplates
    from sapd.run.plan import Step
    t = StageTemplates.from_dir(env.templates)
    for stage, k in (("build-prefixes", None), ("teacher-scores", 0), ("train", 0)):
        env.effect(t.render(stage, k))
        if stage == "teacher-scores":
            commit_round(env.cfg, 0)
    polls = []

    def sleep(s):  # round 1's scoring finishes while the gate waits
        polls.append(s)
        if len(polls) == 3:
            env.effect(t.render("teacher-scores", 1))
            commit_round(env.cfg, 1)
    result = env.driver(sleep=sleep, log_every_seconds=0).run_stage(Step("train", 1))
    assert env.kube.posted_jobs() == [f"{RELEASE}-train-r1"] and result["created"] == [f"{RELEASE}-train-r1"]
    assert env.lines[0].startswith(f"stage train-r1: waiting for the output of teacher-scores-r1 in {env.root}: "
                                   "round 1's scored manifest is not committed")
    assert any(ln.startswith("stage train-r1: still waiting (0m00s): round 1's scored manifest is not committed")
               for ln in env.lines)
    assert any(ln.startswith("stage train-r1: its input (teacher-scores-r1) is committed after") for ln in env.lines)
    assert layout.committed_checkpoints(env.root) == [0, 1, 2]
    # run again (the gate pod restarted, or a later revision's gate): committed, nothing created
    env.lines.clear()
    assert env.driver().run_stage(Step("train", 1))["skipped"] == ["train-r1"]
    assert len(env.kube.posted_jobs()) == 1


def test_one_stage_from_the_command_line(env, capsys):
    from sapd.jobs import pipeline
    assert pipeline.main(env.argv("--stage", "build-prefixes")) == 0
    assert env.kube.posted_jobs() == [f"{RELEASE}-build-prefixes"]
    for bad in (["--stage", "train"], ["--stage", "build-prefixes", "--round", "0"]):
        with pytest.raises(SystemExit) as e:
            pipeline.main(env.argv(*bad))
        assert e.value.code == 2
    assert "--stage train needs a --round" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------ persistent stage Jobs


@pytest.fixture
def pools(tmp_path, monkeypatch):
    """The chart's default: persistent stage Jobs, 3 rounds."""
    e = Env(tmp_path, monkeypatch, {"config": {"train": {"rounds": 3}}}, stage_jobs="persistent")
    e.lines = []
    return e


# the rounds' Jobs are created with the prefix build (their pods start up meanwhile; their workers wait for
# checkpoint 0), then the final evaluation
POOLS = [f"{RELEASE}-teacher-scores-r0", f"{RELEASE}-train-r0", f"{RELEASE}-build-prefixes",
         f"{RELEASE}-teacher-scores-r3", f"{RELEASE}-evaluate-r3"]  # r3: the last checkpoint's validation, alone


def test_persistent_jobs_serve_every_round_from_one_scoring_and_one_train_job(pools, capsys):
    """`helm install` with the defaults: after build-prefixes, one teacher-scores Job and one train Job,
    created together, serve rounds 0–2 (their workers wait for each round's input); the driver logs each
    round's commits; the Jobs' time limit is their rounds × one round of each pool."""
    from sapd.jobs import pipeline
    assert pipeline.main(pools.argv()) == 0
    out = capsys.readouterr().out
    assert pools.kube.posted_jobs() == POOLS and pools.kube.invalid == []
    assert out.index(f"job {RELEASE}-train-r0: created") < out.index(f"job {RELEASE}-build-prefixes: created")
    assert layout.committed_checkpoints(pools.root) == [0, 1, 2, 3]
    jobs = {b["metadata"]["name"]: b for b in pools.kube.posted if b["kind"] == "Job"}
    for stage in ("teacher-scores", "train"):
        body = jobs[f"{RELEASE}-{stage}-r0"]
        assert body["metadata"]["annotations"] == {"sapd.io/attempt": "1", "sapd.io/run-root": pools.root,
                                                   "sapd.io/rounds": "0-2"}
        args = body["spec"]["template"]["spec"]["containers"][0]["args"]
        assert args[args.index("--round") + 1] == "0" and args[args.index("--rounds") + 1] == "3"
        assert body["spec"]["activeDeadlineSeconds"] == 3 * (21600 + 43200)
        assert "__SAPD_ROUNDS__" not in json.dumps(body)
    assert jobs[f"{RELEASE}-evaluate-r3"]["spec"]["activeDeadlineSeconds"] == 14400  # a one-off Job: as rendered
    assert "persistent stage Jobs, one per pool for the whole run" in out
    assert f"job {RELEASE}-teacher-scores-r0: created (attempt 1/3, Indexed: 2 completions, parallelism 2, rounds 0–2)" \
        in out
    for k in range(3):
        assert re.search(rf"^round {k}: scored round committed \({RELEASE}-teacher-scores-r0, ", out, re.M), out
        assert re.search(rf"^round {k}: checkpoint {k + 1} committed \({RELEASE}-train-r0, ", out, re.M), out
    assert out.index("round 0: checkpoint 1 committed") < out.index("round 1: scored round committed")
    assert f"job {RELEASE}-train-r0: complete (rounds 0–2)" in out and "rounds 0–2: checkpoint 3 committed" in out
    # the workers took the rounds in order, each once its input was committed (the fake's own record)
    assert pools.tick.log == [f"{RELEASE}-teacher-scores-r0: scored 0", f"{RELEASE}-train-r0: trained 0",
                              f"{RELEASE}-teacher-scores-r0: scored 1", f"{RELEASE}-train-r0: trained 1",
                              f"{RELEASE}-teacher-scores-r0: scored 2", f"{RELEASE}-train-r0: trained 2"]


def test_a_restarted_driver_adopts_the_persistent_jobs_whatever_round_they_are_at(pools):
    """The driver pod dies while the Jobs of rounds 0–2 are at round 1: the next one finds them by label
    (not by the name of round 1), adopts both, creates no duplicate, and the run completes."""
    sleeps = []

    def dying_sleep(s):
        sleeps.append(s)
        if checkpoints.is_committed(pools.root, 1):
            raise Crash
    with pytest.raises(Crash):
        pools.driver(sleep=dying_sleep).run()
    assert not checkpoints.is_committed(pools.root, 2)
    pools.lines.clear()
    result = pools.driver().run()
    assert pools.kube.posted_jobs() == POOLS
    assert result["adopted"] == [f"{RELEASE}-teacher-scores-r0", f"{RELEASE}-train-r0"]
    assert result["created"] == POOLS[3:]
    assert f"job {RELEASE}-train-r0: exists (running, attempt 1), adopting it" in pools.lines
    assert "stage train-r0: committed, skipping" in pools.lines
    assert layout.committed_checkpoints(pools.root) == [0, 1, 2, 3]


def test_a_per_round_job_a_previous_chart_started_is_adopted_for_its_one_round(tmp_path, monkeypatch):
    """`helm upgrade` from a chart before persistent workers while its per-round train-r1 runs (3 rounds):
    the new, persistent driver adopts train-r1 for round 1 (it neither deletes nor replaces it, though the
    persistent Job of rounds 1–2 would take its name), then serves round 2 with persistent Jobs."""
    e = Env(tmp_path, monkeypatch, {"config": {"train": {"rounds": 3}}}, stage_jobs="per-round")
    e.lines = []
    kill_driver_while_running(e, f"{RELEASE}-train-r1")
    assert not checkpoints.is_committed(e.root, 2)
    e.lines.clear()
    result = e.driver(stage_jobs="persistent").run()
    assert result["adopted"][0] == f"{RELEASE}-train-r1", result
    assert not any("replacing it" in ln or "deleting" in ln for ln in e.lines), e.lines
    assert e.kube.posted_jobs().count(f"{RELEASE}-train-r1") == 1
    assert {f"{RELEASE}-teacher-scores-r2", f"{RELEASE}-train-r2"} <= set(e.kube.posted_jobs())
    assert layout.committed_checkpoints(e.root) == [0, 1, 2, 3]


def test_a_prefix_build_that_fails_takes_the_waiting_round_jobs_with_it(pools, capsys):
    from sapd.jobs import pipeline
    pools.kube.script[f"{RELEASE}-build-prefixes"] = ["fail-permanent"]
    assert pipeline.main(pools.argv()) == 1
    out = capsys.readouterr().out
    for stage in ("teacher-scores", "train"):
        assert f"job {RELEASE}-{stage}-r0: deleting it: its rounds cannot start without the prefix build" in out
        assert f"{RELEASE}-{stage}-r0" not in pools.kube.jobs


def test_a_persistent_job_that_failed_while_no_driver_watched_is_retried_under_its_name(pools):
    """The driver pod dies at round 1; the trainer fails before the next one starts: the next driver finds the
    failed Job of rounds 0–2 (not a fresh Job for round 1), counts its attempt and recreates it."""
    name = f"{RELEASE}-train-r0"

    def dying_sleep(s):
        if checkpoints.is_committed(pools.root, 1):
            raise Crash
    with pytest.raises(Crash):
        pools.driver(sleep=dying_sleep).run()
    pools.kube._finish(name, "fail")
    pools.lines.clear()
    result = pools.driver(retries=1).run()
    assert f"job {name}: exists (failed, attempt 1), adopting it" in pools.lines
    assert result["retried"] == [name] and pools.kube.incarnations[name] == 2
    assert pools.kube.posted_jobs() == POOLS[:3] + [name, *POOLS[3:]]  # no train-r1
    assert [b for b in pools.kube.posted if b["metadata"]["name"] == name][-1]["metadata"]["annotations"][
        "sapd.io/rounds"] == "0-2"
    assert layout.committed_checkpoints(pools.root) == [0, 1, 2, 3]


def test_a_failed_persistent_job_is_recreated_and_resumes_from_the_commits(pools):
    name = f"{RELEASE}-train-r0"
    pools.kube.script[name] = ["fail"]
    result = pools.driver(retries=1).run()
    assert result["retried"] == [name] and pools.kube.incarnations[name] == 2
    second = [b for b in pools.kube.posted if b["metadata"]["name"] == name][-1]
    assert second["metadata"]["annotations"]["sapd.io/attempt"] == "2"
    assert second["metadata"]["annotations"]["sapd.io/rounds"] == "0-2"  # the same rounds: committed ones are skipped
    assert layout.committed_checkpoints(pools.root) == [0, 1, 2, 3]


def test_when_one_persistent_job_gives_up_the_other_is_deleted(pools, capsys):
    """Exit code 2 in the scoring workers: no retry, and the trainer, which would wait for scores that never
    come, is deleted too (its GPUs freed); the driver exits 1 naming the scoring Job."""
    from sapd.jobs import pipeline
    name = f"{RELEASE}-teacher-scores-r0"
    pools.kube.script[name] = ["fail-permanent"]
    assert pipeline.main(pools.argv("--retries", "2")) == 1
    captured = capsys.readouterr()
    assert f"Job {name} failed 1 time(s), giving up (a permanent error: not retried)" in captured.err
    assert f"job {RELEASE}-train-r0: deleting it: its rounds cannot go on without {name}" in captured.out
    assert f"{RELEASE}-train-r0" not in pools.kube.jobs


def test_a_persistent_job_that_commits_no_round_is_recreated(pools):
    """The per-round watchdog: round 0's checkpoint is committed, but the scoring Job's workers commit nothing
    for longer than one round's limit (here the stage timeout, 1000 s): it is a failed attempt, recreated; the next
    incarnation does the work. Waiting for the other pool's round is not counted as stalling."""
    name = f"{RELEASE}-teacher-scores-r0"
    pools.kube.script[name] = ["run", "complete"]
    now = [0.0]
    result = pools.driver(stage_timeout_seconds=1000, sleep=lambda s: now.__setitem__(0, now[0] + 300),
                          clock=lambda: now[0], log_every_seconds=1e9).run()
    assert result["retried"] == [name] and pools.kube.incarnations[name] == 2
    assert any(re.fullmatch(rf"job {name}: attempt 1/3 failed: RoundTimeout: round 0 is not committed \d+m\d\ds after "
                            r"its input was \(limit 16m40s per round\)", ln)
               for ln in pools.lines), pools.lines
    # the trainer waited all that time for round 0's scores: its input, never its own stall
    assert f"{RELEASE}-train-r0" not in result["retried"]
    assert layout.committed_checkpoints(pools.root) == [0, 1, 2, 3]


def test_rounds_per_job_starts_a_new_pair_of_jobs_after_that_many_rounds(tmp_path, monkeypatch):
    e = Env(tmp_path, monkeypatch, {"config": {"train": {"rounds": 3}}}, stage_jobs="persistent")
    e.lines = []
    e.driver(rounds_per_job=2).run()
    assert e.kube.posted_jobs() == [f"{RELEASE}-teacher-scores-r0", f"{RELEASE}-train-r0", f"{RELEASE}-build-prefixes",
                                    f"{RELEASE}-teacher-scores-r2", f"{RELEASE}-train-r2", *POOLS[3:]]
    rounds = {b["metadata"]["name"]: b["metadata"]["annotations"]["sapd.io/rounds"] for b in e.kube.posted
              if "sapd.io/rounds" in b["metadata"].get("annotations", {})}
    assert rounds == {f"{RELEASE}-teacher-scores-r0": "0-1", f"{RELEASE}-train-r0": "0-1",
                      f"{RELEASE}-teacher-scores-r2": "2-2", f"{RELEASE}-train-r2": "2-2"}
    assert layout.committed_checkpoints(e.root) == [0, 1, 2, 3]


def test_a_finished_job_of_other_rounds_under_the_same_name_is_replaced_uncounted(pools):
    """A per-round train-r0 of an earlier revision (stageJobs perRound) completed round 0 only; the persistent
    driver needs train-r0 for rounds 0–2: it replaces it, without counting a failure."""
    from sapd.run.k8s import StageTemplates
    t = StageTemplates.from_dir(pools.templates)
    job_effect(pools.root)(t.render("build-prefixes"))
    stale = t.render("train", 0)
    stale["metadata"]["labels"]["app.kubernetes.io/managed-by"] = "sapd-pipeline"
    stale["metadata"].setdefault("annotations", {})["sapd.io/run-root"] = pools.root
    pools.kube.add_job(stale, state="fail")
    result = pools.driver(retries=0).run()
    assert f"job {RELEASE}-train-r0: exists for rounds 0–0, finished; replacing it with the Job of rounds 0–2 " \
           "(not counted)" in pools.lines
    assert result["retried"] == [] and layout.committed_checkpoints(pools.root) == [0, 1, 2, 3]


def test_sft_runs_one_persistent_train_job(tmp_path, monkeypatch):
    e = Env(tmp_path, monkeypatch, {"config": {"variant": "sft", "train": {"rounds": 3}}}, stage_jobs="persistent")
    e.lines = []
    e.driver().run()
    assert e.kube.posted_jobs() == [POOLS[1], POOLS[2], POOLS[4]]  # sft: nothing scored, nothing validated
    assert layout.committed_checkpoints(e.root) == [0, 1, 2, 3]


@pytest.mark.parametrize("overlap", ["off", "one_step"])
def test_overlap_one_step_lets_the_scoring_job_work_a_round_ahead(tmp_path, monkeypatch, overlap):
    """The train Job is held in Kueue's queue for a while: with train.overlap one_step the scoring workers
    score round 1 with checkpoint 0 meanwhile; without it they wait for checkpoint 1."""
    e = Env(tmp_path, monkeypatch, {"config": {"train": {"rounds": 3, "overlap": overlap}},
                                    "kueue": {"queueName": "team-a"}}, stage_jobs="persistent")
    e.lines = []
    e.kube.script[f"{RELEASE}-teacher-scores-r0"] = ["queued:0"]
    e.kube.script[f"{RELEASE}-train-r0"] = ["queued:6"]
    e.driver().run()
    ahead = [f"{RELEASE}-teacher-scores-r0: scored 0", f"{RELEASE}-teacher-scores-r0: scored 1"]
    assert (e.tick.log[:2] == ahead) == (overlap == "one_step"), e.tick.log
    assert ("train.overlap one_step" in e.lines[0]) == (overlap == "one_step")
    assert any(ln.startswith(f"job {RELEASE}-train-r0: queued 0m00s") for ln in e.lines)
    assert layout.committed_checkpoints(e.root) == [0, 1, 2, 3]


def test_templates_without_the_rounds_placeholder_refuse_persistent_jobs(pools, capsys):
    from sapd.jobs import pipeline
    for f in ("teacher-scores.yaml", "train.yaml"):
        path = pools.templates / f
        path.write_text(path.read_text().replace("__SAPD_ROUNDS__", "1"))
    assert pipeline.main(pools.argv()) == 2
    assert "take no __SAPD_ROUNDS__ (a chart older than persistent workers): pass --stage-jobs per-round" in \
        capsys.readouterr().err
    assert pipeline.main(pools.argv("--stage-jobs", "per-round")) == 0
