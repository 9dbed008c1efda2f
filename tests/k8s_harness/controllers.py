"""The controllers of the harness: Job (batch/v1), CronJob (run on demand), the garbage collector,
the TTL-after-finished controller, and a queue admission in the manner of Kueue (QueueAdmission).
There is no JobSet controller: JobSets are stored and validated (apiserver) but never run.

Job semantics implemented (as the Kubernetes Job controller, v1.31+):

* ``parallelism``, ``completions``, ``completionMode: Indexed`` (pods named ``<job>-<i>-<rand>``,
  hostname ``<job>-<i>``, label and annotation ``batch.kubernetes.io/job-completion-index``, env
  ``JOB_COMPLETION_INDEX``), the labels ``batch.kubernetes.io/job-name``/``controller-uid`` (and
  their legacy forms) and a controller owner reference on every pod;
* failed pods → ``podFailurePolicy`` rules in order (``onExitCodes`` In/NotIn, optionally per
  container; ``onPodConditions``) with actions FailJob, FailIndex, Ignore, Count; counted failures
  against ``backoffLimit`` (default 6), or per index against ``backoffLimitPerIndex`` with
  ``maxFailedIndexes``;
* a failed pod is replaced after the exponential back-off delay, 10 s × 2^(n−1) capped at 6 min on a
  real cluster, here ``Cluster.backoff_base_seconds`` × 2^(n−1) capped at 36 × that base;
  ``podReplacementPolicy: Failed`` waits until the failed/terminating pod is fully gone;
* ``activeDeadlineSeconds`` (reason DeadlineExceeded), counted from the Job's (last) start: a
  suspended Job has no pods, a ``Suspended`` condition, and its ``startTime`` and deadline begin
  again when it is resumed; ``ttlSecondsAfterFinished``;
* conditions: FailureTarget/SuccessCriteriaMet once decided, then Failed/Complete once no pod of the
  Job is still running (active pods are deleted, i.e. SIGTERM then SIGKILL after their grace period);
  status counts ``active``/``ready``/``terminating``/``succeeded``/``failed``, ``completedIndexes``/
  ``failedIndexes`` in the API's interval form, ``startTime``/``completionTime``.

Deletion: Foreground (dependents first), Background (the GC removes dependents), Orphan (the API
default for Jobs: pods stay and run on).
"""

from __future__ import annotations

import copy
import time
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .store import NotFound, now_rfc3339

if TYPE_CHECKING:
    from .cluster import Cluster

INDEX_LABEL = "batch.kubernetes.io/job-completion-index"


def compress(indexes: set[int]) -> str:
    """``{0,1,2,5}`` → ``"0-2,5"`` (status.completedIndexes)."""
    out, run = [], []
    for i in sorted(indexes):
        if run and i == run[-1] + 1:
            run.append(i)
            continue
        if run:
            out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
        run = [i]
    if run:
        out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ",".join(out)


@dataclass
class JobState:
    counted: set[str] = field(default_factory=set)
    succeeded: int = 0
    failed: int = 0
    completed: set[int] = field(default_factory=set)
    failed_indexes: set[int] = field(default_factory=set)
    index_failures: dict[int, int] = field(default_factory=dict)
    next_try: dict[int | None, float] = field(default_factory=dict)
    target: tuple[str, str, str] | None = None  # (FailureTarget|SuccessCriteriaMet, reason, message)
    started: float | None = None  # when it last started (created or resumed): activeDeadlineSeconds

    finished_at: float | None = None


def policy_action(policy: dict | None, pod: dict) -> tuple[str | None, str]:
    """The action of the first podFailurePolicy rule that matches a failed pod, and why."""
    if not policy:
        return None, ""
    st = pod.get("status", {})
    statuses = st.get("containerStatuses", []) + st.get("initContainerStatuses", [])
    for i, rule in enumerate(policy.get("rules", [])):
        if "onExitCodes" in rule:
            r = rule["onExitCodes"]
            for cs in statuses:
                term = cs.get("state", {}).get("terminated")
                if term is None or (r.get("containerName") and cs["name"] != r["containerName"]):
                    continue
                code = term["exitCode"]
                hit = code in r["values"] if r["operator"] == "In" else (code != 0 and code not in r["values"])
                if hit:
                    return rule["action"], (f"Container {cs['name']} for pod {pod['metadata']['namespace']}/"
                                            f"{pod['metadata']['name']} failed with exit code {code} matching "
                                            f"{rule['action']} rule at index {i}")
        for pc in rule.get("onPodConditions", []):
            for c in st.get("conditions", []):
                if c["type"] == pc["type"] and c.get("status") == pc.get("status", "True"):
                    return rule["action"], (f"Pod {pod['metadata']['namespace']}/{pod['metadata']['name']} has "
                                            f"condition {c['type']} matching {rule['action']} rule at index {i}")
    return None, ""


class JobController:
    TIMER_SECONDS = 0.2  # how late a back-off's end, a deadline or a TTL may be noticed, at most

    def __init__(self, cluster: "Cluster") -> None:
        self.cluster = cluster
        self.state: dict[str, JobState] = {}
        self.cron_counter: dict[str, int] = {}
        self._seen, self._synced_at = -1, 0.0

    def _delay(self, n: int) -> float:
        base = self.cluster.backoff_base_seconds
        return min(base * 2 ** max(n - 1, 0), base * 36)

    def sync(self) -> None:
        store = self.cluster.store
        # a tick in which no object changed can only matter for the clocks (back-off, deadlines, TTLs): those are
        # checked every TIMER_SECONDS, the objects' changes at once
        now = time.monotonic()
        if store.version == self._seen and now - self._synced_at < self.TIMER_SECONDS:
            return
        self._seen, self._synced_at = store.version, now
        for job in store.list("Job"):
            if job["metadata"].get("deletionTimestamp"):
                continue  # the garbage collector finishes it
            try:
                self._sync_job(job)
            except NotFound:
                pass

    def _pod_template(self, job: dict, index: int | None) -> dict:
        meta, spec = job["metadata"], job["spec"]
        tmpl = copy.deepcopy(spec["template"])
        tmeta, pspec = tmpl.setdefault("metadata", {}), tmpl["spec"]
        labels = dict(tmeta.get("labels") or {})
        labels.update({"batch.kubernetes.io/job-name": meta["name"], "job-name": meta["name"],
                       "batch.kubernetes.io/controller-uid": meta["uid"], "controller-uid": meta["uid"]})
        annotations = dict(tmeta.get("annotations") or {})
        if index is not None:
            labels[INDEX_LABEL] = str(index)
            annotations[INDEX_LABEL] = str(index)
            pspec["hostname"] = f"{meta['name']}-{index}"
            env = {"name": "JOB_COMPLETION_INDEX",
                   "valueFrom": {"fieldRef": {"fieldPath": f"metadata.annotations['{INDEX_LABEL}']"}}}
            for c in pspec.get("containers", []) + pspec.get("initContainers", []):
                if not any(e["name"] == "JOB_COMPLETION_INDEX" for e in c.get("env", [])):
                    c.setdefault("env", []).append(env)
        prefix = f"{meta['name']}-{index}-" if index is not None else f"{meta['name']}-"
        name = prefix[:58] + uuid.uuid4().hex[:5]
        return {"apiVersion": "v1", "kind": "Pod",
                "metadata": {"name": name, "labels": labels, "annotations": annotations,
                             "ownerReferences": [{"apiVersion": "batch/v1", "kind": "Job", "name": meta["name"],
                                                  "uid": meta["uid"], "controller": True,
                                                  "blockOwnerDeletion": True}]},
                "spec": pspec}

    def _sync_job(self, job: dict) -> None:
        store = self.cluster.store
        meta, spec = job["metadata"], job["spec"]
        ns, uid = meta["namespace"], meta["uid"]
        st = self.state.setdefault(uid, JobState())
        conds = {c["type"]: c for c in (job.get("status") or {}).get("conditions") or []}
        pods = store.list("Pod", ns, f"batch.kubernetes.io/controller-uid={uid}")
        finished = any(conds.get(t, {}).get("status") == "True" for t in ("Complete", "Failed"))
        running = [p for p in pods if p.get("status", {}).get("phase") not in ("Succeeded", "Failed")]
        if finished:
            self._ttl(job, conds)
            return
        if spec.get("suspend"):
            for p in running:
                self._delete_pod(p)
            if st.started is not None or not any(c["type"] == "Suspended" for c in conds.values()):
                st.started = None
                self._set_suspended(job, True)
            self._publish(job, st, pods)
            return
        if st.started is None:
            st.started = time.monotonic()
            if "Suspended" in conds:
                self._set_suspended(job, False)
        indexed = spec.get("completionMode") == "Indexed"
        completions = spec.get("completions") or 1
        parallelism = spec.get("parallelism", 1)
        per_index = spec.get("backoffLimitPerIndex")
        backoff_limit = spec.get("backoffLimit", 2147483647 if per_index is not None else 6)
        now = time.monotonic()
        for p in pods:
            phase = p.get("status", {}).get("phase")
            if phase not in ("Succeeded", "Failed") or p["metadata"]["uid"] in st.counted:
                continue
            st.counted.add(p["metadata"]["uid"])
            idx = int(p["metadata"]["labels"][INDEX_LABEL]) if indexed else None
            if phase == "Succeeded":
                if indexed:
                    if idx not in st.failed_indexes:
                        st.completed.add(idx)
                else:
                    st.succeeded += 1
                continue
            action, why = policy_action(spec.get("podFailurePolicy"), p)
            if action == "FailJob" and st.target is None:
                st.target = ("FailureTarget", "PodFailurePolicy", why)
                st.failed += 1
            elif action == "FailIndex" and indexed:
                st.failed += 1
                st.failed_indexes.add(idx)
            elif action == "Ignore":
                store.event(job, "PodFailureIgnored", why)
            else:
                st.failed += 1
                if indexed and per_index is not None:
                    st.index_failures[idx] = st.index_failures.get(idx, 0) + 1
                    if st.index_failures[idx] > per_index:
                        st.failed_indexes.add(idx)
                    st.next_try[idx] = now + self._delay(st.index_failures[idx])
                else:
                    st.next_try[None] = now + self._delay(st.failed)
        if st.target is None:
            ads = spec.get("activeDeadlineSeconds")
            done = st.completed if indexed else set()
            if ads is not None and now - st.started > ads * self.cluster.deadline_scale:
                st.target = ("FailureTarget", "DeadlineExceeded", "Job was active longer than specified deadline")
            elif per_index is not None and indexed and spec.get("maxFailedIndexes") is not None \
                    and len(st.failed_indexes) > spec["maxFailedIndexes"]:
                st.target = ("FailureTarget", "MaxFailedIndexesExceeded", "Job has exceeded maxFailedIndexes")
            elif indexed and st.failed_indexes and len(done | st.failed_indexes) >= completions:
                st.target = ("FailureTarget", "FailedIndexes", "Job has failed indexes")
            elif per_index is None and st.failed > backoff_limit:
                st.target = ("FailureTarget", "BackoffLimitExceeded", "Job has reached the specified backoff limit")
            elif (len(st.completed) if indexed else st.succeeded) >= completions:
                st.target = ("SuccessCriteriaMet", "CompletionsReached", "Reached expected number of succeeded pods")
        if st.target is not None:
            for p in running:
                self._delete_pod(p)
            still = [p for p in store.list("Pod", ns, f"batch.kubernetes.io/controller-uid={uid}")
                     if p.get("status", {}).get("phase") not in ("Succeeded", "Failed")]
            final = None if still else ("Failed" if st.target[0] == "FailureTarget" else "Complete")
            self._publish(job, st, pods, final)
            if final:
                store.event(job, st.target[1], f"{final}: {st.target[2]}")
            return
        # create what is missing
        replace_failed_only = spec.get("podReplacementPolicy") == "Failed" or bool(spec.get("podFailurePolicy"))
        live = [p for p in running if not (p["metadata"].get("deletionTimestamp") and not replace_failed_only)]
        active = [p for p in running if not p["metadata"].get("deletionTimestamp")]
        slots = parallelism - len(active)
        if indexed:
            busy = {int(p["metadata"]["labels"][INDEX_LABEL]) for p in live}
            for i in range(completions):
                if slots <= 0:
                    break
                if i in st.completed or i in st.failed_indexes or i in busy:
                    continue
                if now < st.next_try.get(i if per_index is not None else None, 0.0):
                    continue
                self._create_pod(job, i)
                slots -= 1
        else:
            need = min(slots, completions - st.succeeded - len(active))
            if now >= st.next_try.get(None, 0.0):
                for _ in range(max(need, 0)):
                    self._create_pod(job, None)
        self._publish(job, st, store.list("Pod", ns, f"batch.kubernetes.io/controller-uid={uid}"))

    def _create_pod(self, job: dict, index: int | None) -> None:
        pod = self._pod_template(job, index)
        hostname = pod["spec"].get("hostname")
        if hostname and len(hostname) > 63:
            self.cluster.store.event(job, "FailedCreate", f"Pod hostname {hostname!r} is longer than 63 characters",
                                     "Warning")
            raise ValueError(f"job {job['metadata']['name']}: pod hostname {hostname!r} is longer than 63 characters")
        self.cluster.store.create(pod, job["metadata"]["namespace"])

    def _delete_pod(self, pod: dict) -> None:
        if not pod["metadata"].get("deletionTimestamp"):
            try:
                self.cluster.store.delete("Pod", pod["metadata"]["namespace"], pod["metadata"]["name"])
            except NotFound:
                pass

    def _set_suspended(self, job: dict, suspended: bool) -> None:
        """The Suspended condition; resuming restarts the clock (startTime), as the Job controller does."""
        t = now_rfc3339()

        def fn(j: dict) -> None:
            s = j.setdefault("status", {})
            conds = [c for c in s.get("conditions") or [] if c["type"] != "Suspended"]
            conds.append({"type": "Suspended", "status": str(suspended), "lastProbeTime": t, "lastTransitionTime": t,
                          "reason": "JobSuspended" if suspended else "JobResumed",
                          "message": "Job suspended" if suspended else "Job resumed"})
            s["conditions"] = conds
            if suspended:
                s.pop("startTime", None)
            else:
                s["startTime"] = t
        self.cluster.store.mutate("Job", job["metadata"]["namespace"], job["metadata"]["name"], fn)
        self.cluster.store.event(job, "Suspended" if suspended else "Resumed",
                                 "Job suspended" if suspended else "Job resumed")

    def _publish(self, job: dict, st: JobState, pods: list[dict], final: str | None = None) -> None:
        indexed = job["spec"].get("completionMode") == "Indexed"

        def fn(j: dict) -> None:
            s = j.setdefault("status", {})
            if not j["spec"].get("suspend"):
                s.setdefault("startTime", now_rfc3339())
            running = [p for p in pods if p.get("status", {}).get("phase") not in ("Succeeded", "Failed")]
            s["active"] = len([p for p in running if not p["metadata"].get("deletionTimestamp")])
            s["terminating"] = len([p for p in running if p["metadata"].get("deletionTimestamp")])
            s["ready"] = len([p for p in running if p.get("status", {}).get("phase") == "Running"])
            s["succeeded"] = len(st.completed) if indexed else st.succeeded
            s["failed"] = st.failed
            if indexed:
                s["completedIndexes"] = compress(st.completed)
                if j["spec"].get("backoffLimitPerIndex") is not None:
                    s["failedIndexes"] = compress(st.failed_indexes)
            conds = s.setdefault("conditions", [])
            t = now_rfc3339()
            if st.target and not any(c["type"] == st.target[0] for c in conds):
                conds.append({"type": st.target[0], "status": "True", "reason": st.target[1],
                              "message": st.target[2], "lastProbeTime": t, "lastTransitionTime": t})
            if final and not any(c["type"] == final for c in conds):
                conds.append({"type": final, "status": "True", "reason": st.target[1], "message": st.target[2],
                              "lastProbeTime": t, "lastTransitionTime": t})
                s["active"] = 0
                if final == "Complete":
                    s["completionTime"] = t
                self.state[j["metadata"]["uid"]].finished_at = time.monotonic()
            if not conds:
                del s["conditions"]
        self.cluster.store.mutate("Job", job["metadata"]["namespace"], job["metadata"]["name"], fn)

    def _ttl(self, job: dict, conds: dict) -> None:
        ttl = job["spec"].get("ttlSecondsAfterFinished")
        st = self.state.get(job["metadata"]["uid"])
        at = st.finished_at if st is not None else None
        if ttl is None or at is None:
            return
        if time.monotonic() - at >= ttl * self.cluster.deadline_scale:
            try:
                self.cluster.store.delete("Job", job["metadata"]["namespace"], job["metadata"]["name"], "Background")
            except NotFound:
                pass

    # -------------------------------------------------------------------------------- CronJob

    def run_cronjob(self, namespace: str, name: str) -> str | None:
        """Create the Job the CronJob controller would create at its next schedule time (now), honouring
        ``suspend`` and ``concurrencyPolicy: Forbid``; returns the Job's name, or None if skipped."""
        store = self.cluster.store
        cj = store.get("CronJob", namespace, name)
        if cj is None:
            raise NotFound(f"cronjob {name} not found")
        spec = cj["spec"]
        if spec.get("suspend"):
            return None
        owned = [j for j in store.list("Job", namespace)
                 if any(r.get("uid") == cj["metadata"]["uid"] for r in j["metadata"].get("ownerReferences") or [])]
        active = [j for j in owned if not any(c["type"] in ("Complete", "Failed") and c["status"] == "True"
                                              for c in (j.get("status") or {}).get("conditions") or [])]
        if active and spec.get("concurrencyPolicy") == "Forbid":
            return None
        minute = int(time.time() // 60) + self.cron_counter.get(name, 0)
        self.cron_counter[name] = self.cron_counter.get(name, 0) + 1
        tmpl = copy.deepcopy(spec["jobTemplate"])
        tmeta = tmpl.get("metadata") or {}
        body = {"apiVersion": "batch/v1", "kind": "Job",
                "metadata": {"name": f"{name}-{minute}", "labels": dict(tmeta.get("labels") or {}),
                             "annotations": {**(tmeta.get("annotations") or {}),
                                             "batch.kubernetes.io/cronjob-scheduled-timestamp": now_rfc3339()},
                             "ownerReferences": [{"apiVersion": "batch/v1", "kind": "CronJob", "name": name,
                                                  "uid": cj["metadata"]["uid"], "controller": True,
                                                  "blockOwnerDeletion": True}]},
                "spec": tmpl["spec"]}
        job = store.create(body, namespace)
        return job["metadata"]["name"]


def pod_requests(job: dict) -> dict[str, float]:
    """What one Job asks of a queue's quota: ``parallelism`` × its pod's requests (limits where a
    request is not given; init containers count with their largest), as Kueue computes a PodSet."""
    from .kubelet import _quantity
    spec = job["spec"]["template"]["spec"]
    total: dict[str, float] = {}
    for c in spec.get("containers", []):
        res = c.get("resources") or {}
        for r, q in {**(res.get("limits") or {}), **(res.get("requests") or {})}.items():
            if q is not None:
                total[r] = total.get(r, 0.0) + _quantity(q)
    for c in spec.get("initContainers", []):
        res = c.get("resources") or {}
        for r, q in {**(res.get("limits") or {}), **(res.get("requests") or {})}.items():
            if q is not None:
                total[r] = max(total.get(r, 0.0), _quantity(q))
    n = job["spec"].get("parallelism", 1)
    return {r: v * n for r, v in total.items()}


class QueueAdmission:
    """Kueue in miniature: a Job labelled ``kueue.x-k8s.io/queue-name: <q>`` is created suspended
    (admission.kueue_webhook) and waits; in creation order, a Job whose requests (pod_requests) fit in
    what its queue's nominal quota has left is admitted — its ``suspend`` set to false, a
    ``QuotaReserved`` event — and holds that quota until it finishes or goes. A queue name the cluster
    does not have, or a resource the quota does not list, keeps the Job waiting (Kueue: inadmissible).
    Not modelled: ClusterQueue cohorts and borrowing, preemption, partial admission, waitForPodsReady."""

    def __init__(self, cluster: "Cluster", queues: dict[str, dict]) -> None:
        from .kubelet import _quantity
        self.cluster = cluster
        self.quota = {q: {r: _quantity(v) for r, v in res.items()} for q, res in queues.items()}
        self.admitted: dict[str, tuple[str, dict[str, float]]] = {}  # job uid → (queue, usage)
        self._seen = -1  # the store's version at the last pass (-1: pass at the next tick)

    def set_quota(self, queue: str, resources: dict) -> None:
        """The queue's nominal quota from now on (an admin editing its ClusterQueue), e.g. more GPUs."""
        from .kubelet import _quantity
        self.quota[queue] = {r: _quantity(v) for r, v in resources.items()}
        self._seen = -1

    def sync(self) -> None:
        from .admission import QUEUE_LABEL
        # admission depends only on the Jobs and the quotas: a tick in which neither changed has nothing to do
        if self.cluster.store.version == self._seen:
            return
        self._seen = self.cluster.store.version
        jobs = self.cluster.store.list("Job")
        live = {j["metadata"]["uid"]: j for j in jobs}
        for uid in list(self.admitted):
            j = live.get(uid)
            if j is None or any(c["type"] in ("Complete", "Failed") and c["status"] == "True"
                                for c in (j.get("status") or {}).get("conditions") or []):
                del self.admitted[uid]
        for j in jobs:
            queue = (j["metadata"].get("labels") or {}).get(QUEUE_LABEL)
            uid = j["metadata"]["uid"]
            if not queue or uid in self.admitted or not j["spec"].get("suspend") or j["metadata"].get("deletionTimestamp"):
                continue
            quota = self.quota.get(queue)
            if quota is None:
                continue
            need = pod_requests(j)
            used: dict[str, float] = {}
            for q, usage in self.admitted.values():
                if q == queue:
                    for r, v in usage.items():
                        used[r] = used.get(r, 0.0) + v
            if all(r in quota and used.get(r, 0.0) + v <= quota[r] + 1e-9 for r, v in need.items() if v > 0):
                self.admitted[uid] = (queue, need)
                ns, name = j["metadata"]["namespace"], j["metadata"]["name"]
                self.cluster.store.mutate("Job", ns, name, lambda o: o["spec"].update(suspend=False))
                self.cluster.store.event(j, "QuotaReserved", f"Quota reserved in ClusterQueue of LocalQueue {queue}")


class GarbageCollector:
    """Owner references: a dependent whose owners are all gone is deleted (background); an object in
    foreground deletion goes once its dependents are gone."""

    def __init__(self, cluster: "Cluster") -> None:
        self.cluster = cluster
        self._seen = -1  # the store's version at the last sync: what it decides depends on the objects alone

    def sync(self) -> None:
        store = self.cluster.store
        if store.version == self._seen:
            return
        self._seen = store.version
        objs = store.all()
        uids = {o["metadata"]["uid"] for o in objs if not (o["metadata"].get("deletionTimestamp")
                                                          and o["kind"] != "Pod" and not o["metadata"].get("finalizers"))}
        for o in objs:
            meta = o["metadata"]
            refs = meta.get("ownerReferences") or []
            if refs and not meta.get("deletionTimestamp") and not any(r.get("uid") in uids for r in refs):
                try:
                    store.delete(o["kind"], meta.get("namespace"), meta["name"], "Background")
                except NotFound:
                    pass
            if meta.get("deletionTimestamp") and "foregroundDeletion" in (meta.get("finalizers") or []):
                deps = store.dependents(meta["uid"])
                for d in deps:
                    if not d["metadata"].get("deletionTimestamp"):
                        try:
                            store.delete(d["kind"], d["metadata"].get("namespace"), d["metadata"]["name"], "Background")
                        except NotFound:
                            pass
                if not deps:
                    store.remove(o["kind"], meta.get("namespace"), meta["name"])
