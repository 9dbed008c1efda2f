"""What the API server answers to a ``meta.k8s.io`` Table request (``kubectl get``): the columns the
Kubernetes printers give Jobs, Pods and CronJobs (NAME STATUS COMPLETIONS DURATION AGE; NAME READY
STATUS RESTARTS AGE; NAME SCHEDULE TIMEZONE SUSPEND ACTIVE LAST SCHEDULE AGE; ``-o wide`` adds
CONTAINERS IMAGES SELECTOR), and NAME/CREATED AT for every other kind, as for custom resources."""

from __future__ import annotations

import calendar
import time
from typing import Any, Callable

Row = list[Any]


def _since(ts: str | None, now: float | None = None) -> float | None:
    if not ts:
        return None
    return (now or time.time()) - calendar.timegm(time.strptime(ts, "%Y-%m-%dT%H:%M:%SZ"))


def human_duration(seconds: float) -> str:
    """Kubernetes' duration.HumanDuration (the AGE and DURATION columns)."""
    s = int(seconds)
    if s < -1:
        return "<invalid>"
    if s < 0:
        return "0s"
    if s < 120:
        return f"{s}s"
    m = s // 60
    if m < 10:
        return f"{m}m" if s % 60 == 0 else f"{m}m{s % 60}s"
    if m < 180:
        return f"{m}m"
    h = s // 3600
    if h < 8:
        return f"{h}h" if m % 60 == 0 else f"{h}h{m % 60}m"
    if h < 48:
        return f"{h}h"
    d = h // 24
    if h < 24 * 8:
        return f"{d}d" if h % 24 == 0 else f"{d}d{h % 24}h"
    return f"{d}d"


def _age(obj: dict) -> str:
    t = _since(obj["metadata"].get("creationTimestamp"))
    return human_duration(t) if t is not None else "<unknown>"


def _has(obj: dict, cond: str) -> bool:
    return any(c["type"] == cond and c.get("status") == "True" for c in (obj.get("status") or {}).get("conditions") or [])


def _selector(sel: dict | None) -> str:
    return ",".join(f"{k}={v}" for k, v in ((sel or {}).get("matchLabels") or {}).items()) or "<none>"


def _wide(pod_spec: dict) -> list[str]:
    cs = pod_spec.get("containers", [])
    return [",".join(c["name"] for c in cs), ",".join(c.get("image", "") for c in cs)]


def job_row(j: dict) -> Row:
    st, spec = j.get("status") or {}, j["spec"]
    if _has(j, "Complete"):
        status = "Complete"
    elif _has(j, "Failed"):
        status = "Failed"
    elif j["metadata"].get("deletionTimestamp"):
        status = "Terminating"
    elif _has(j, "Suspended"):
        status = "Suspended"
    elif _has(j, "FailureTarget"):
        status = "FailureTarget"
    elif _has(j, "SuccessCriteriaMet"):
        status = "SuccessCriteriaMet"
    else:
        status = "Running"
    if spec.get("completions") is not None:
        completions = f"{st.get('succeeded', 0)}/{spec['completions']}"
    elif (spec.get("parallelism") or 0) > 1:
        completions = f"{st.get('succeeded', 0)}/1 of {spec['parallelism']}"
    else:
        completions = f"{st.get('succeeded', 0)}/1"
    duration = ""
    if st.get("startTime"):
        end = _since(st.get("completionTime")) or 0.0
        duration = human_duration((_since(st["startTime"]) or 0.0) - end)
    return [j["metadata"]["name"], status, completions, duration, _age(j),
            *_wide(spec["template"]["spec"]), _selector(spec.get("selector"))]


def pod_status(p: dict) -> str:
    """The STATUS column of `kubectl get pods`: the phase, or the reason a container is waiting or ended."""
    st = p.get("status") or {}
    if p["metadata"].get("deletionTimestamp"):
        return "Terminating"
    inits = st.get("initContainerStatuses") or []
    for i, cs in enumerate(inits):
        term = cs["state"].get("terminated")
        if term and term.get("exitCode") != 0:
            return f"Init:{term.get('reason') or 'Error'}"
        if not term:
            return f"Init:{i}/{len(p['spec'].get('initContainers', []))}"
    reason = st.get("reason") or st.get("phase") or "Pending"
    for cs in st.get("containerStatuses") or []:
        state = cs["state"]
        if state.get("waiting", {}).get("reason") not in (None, "PodInitializing"):
            reason = state["waiting"]["reason"]
        elif state.get("terminated"):
            reason = state["terminated"].get("reason") or ("Completed" if state["terminated"]["exitCode"] == 0
                                                           else "Error")
    if reason == "Pending" and st.get("reason"):
        reason = st["reason"]
    return reason


def pod_row(p: dict) -> Row:
    st = p.get("status") or {}
    cs = st.get("containerStatuses") or []
    ready = sum(1 for c in cs if c.get("ready"))
    restarts = sum(int(c.get("restartCount", 0)) for c in cs)
    return [p["metadata"]["name"], f"{ready}/{len(p['spec'].get('containers', []))}", pod_status(p), str(restarts),
            _age(p), st.get("podIP") or "<none>", p["spec"].get("nodeName") or "<none>", "<none>", "<none>"]


def cronjob_row(cj: dict) -> Row:
    spec, st = cj["spec"], cj.get("status") or {}
    last = _since(st.get("lastScheduleTime"))
    return [cj["metadata"]["name"], spec.get("schedule", ""), spec.get("timeZone") or "<none>",
            str(bool(spec.get("suspend"))), str(len(st.get("active") or [])),
            human_duration(last) if last is not None else "<none>", _age(cj),
            *_wide(spec["jobTemplate"]["spec"]["template"]["spec"]),
            _selector(spec["jobTemplate"]["spec"].get("selector"))]


def default_row(o: dict) -> Row:
    return [o["metadata"]["name"], o["metadata"].get("creationTimestamp", "")]


def _cols(*spec: tuple[str, str, int]) -> list[dict]:
    return [{"name": n, "type": t, "format": "name" if n == "Name" else "", "description": n, "priority": p}
            for n, t, p in spec]


COLUMNS: dict[str, tuple[list[dict], Callable[[dict], Row]]] = {
    "Job": (_cols(("Name", "string", 0), ("Status", "string", 0), ("Completions", "string", 0),
                  ("Duration", "string", 0), ("Age", "string", 0), ("Containers", "string", 1),
                  ("Images", "string", 1), ("Selector", "string", 1)), job_row),
    "Pod": (_cols(("Name", "string", 0), ("Ready", "string", 0), ("Status", "string", 0),
                  ("Restarts", "string", 0), ("Age", "string", 0), ("IP", "string", 1), ("Node", "string", 1),
                  ("Nominated Node", "string", 1), ("Readiness Gates", "string", 1)), pod_row),
    "CronJob": (_cols(("Name", "string", 0), ("Schedule", "string", 0), ("Timezone", "string", 0),
                      ("Suspend", "boolean", 0), ("Active", "integer", 0), ("Last Schedule", "string", 0),
                      ("Age", "string", 0), ("Containers", "string", 1), ("Images", "string", 1),
                      ("Selector", "string", 1)), cronjob_row),
}
DEFAULT = (_cols(("Name", "string", 0), ("Created At", "date", 0)), default_row)


def table(kind: str, objects: list[dict], resource_version: str = "1") -> dict:
    cols, row = COLUMNS.get(kind, DEFAULT)
    return {"kind": "Table", "apiVersion": "meta.k8s.io/v1", "metadata": {"resourceVersion": resource_version},
            "columnDefinitions": cols,
            "rows": [{"cells": row(o), "object": {"kind": "PartialObjectMetadata", "apiVersion": "meta.k8s.io/v1",
                                                  "metadata": o["metadata"]}} for o in objects]}
