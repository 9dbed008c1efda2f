"""What the API server does to an object between the request and the store: defaulting (batch/v1
Jobs and CronJobs, as the Kubernetes API defaults them) and the mutating webhook of Kueue's Job
integration when the cluster runs a queue admission (controllers.QueueAdmission).

Job defaults (``SetDefaults_Job`` and the Job strategy's PrepareForCreate): ``spec.selector`` =
``batch.kubernetes.io/controller-uid=<uid>`` and the template labels ``batch.kubernetes.io/
controller-uid``, ``batch.kubernetes.io/job-name`` (and their legacy forms ``controller-uid``,
``job-name``); ``completions``/``parallelism`` 1 when neither is given, else ``parallelism`` 1;
``backoffLimit`` 6 (the int32 maximum with ``backoffLimitPerIndex``); ``completionMode: NonIndexed``;
``suspend: false``; ``manualSelector`` stays unset; ``podReplacementPolicy`` Failed with a
podFailurePolicy, else TerminatingOrFailed; ``status: "True"`` on every ``onPodConditions`` pattern.
CronJob defaults: ``concurrencyPolicy: Allow``, ``suspend: false``, history limits 3 and 1.
"""

from __future__ import annotations

import copy

QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
UID_LABEL = "batch.kubernetes.io/controller-uid"
NAME_LABEL = "batch.kubernetes.io/job-name"


def default_job(job: dict, uid: str) -> dict:
    """``job`` as the API server stores it: every default filled in, the selector bound to ``uid``."""
    job = copy.deepcopy(job)
    name, spec = job["metadata"]["name"], job.setdefault("spec", {})
    if spec.get("completions") is None and spec.get("parallelism") is None:
        spec["completions"] = 1
        spec["parallelism"] = 1
    spec.setdefault("parallelism", 1)
    spec.setdefault("backoffLimit", 2147483647 if spec.get("backoffLimitPerIndex") is not None else 6)
    spec.setdefault("completionMode", "NonIndexed")
    spec.setdefault("suspend", False)
    if spec.get("podFailurePolicy"):
        spec.setdefault("podReplacementPolicy", "Failed")
        for rule in spec["podFailurePolicy"].get("rules", []):
            for pattern in rule.get("onPodConditions") or []:
                if not pattern.get("status"):  # unset or "" (Go's zero value, what JSON clients send)
                    pattern["status"] = "True"
    else:
        spec.setdefault("podReplacementPolicy", "TerminatingOrFailed")
    if not spec.get("manualSelector"):
        spec["selector"] = {"matchLabels": {UID_LABEL: uid}}
        tmeta = spec.setdefault("template", {}).setdefault("metadata", {})
        tmeta["labels"] = {**(tmeta.get("labels") or {}), UID_LABEL: uid, NAME_LABEL: name,
                           "controller-uid": uid, "job-name": name}
    return job


def default_cronjob(cj: dict) -> dict:
    cj = copy.deepcopy(cj)
    spec = cj.setdefault("spec", {})
    spec.setdefault("concurrencyPolicy", "Allow")
    spec.setdefault("suspend", False)
    spec.setdefault("successfulJobsHistoryLimit", 3)
    spec.setdefault("failedJobsHistoryLimit", 1)
    return cj


def kueue_webhook(job: dict) -> dict:
    """Kueue's Job webhook: a Job labelled with a queue name is created suspended; the queue admission
    unsuspends it once its quota allows."""
    if (job["metadata"].get("labels") or {}).get(QUEUE_LABEL):
        job = copy.deepcopy(job)
        job["spec"]["suspend"] = True
    return job
