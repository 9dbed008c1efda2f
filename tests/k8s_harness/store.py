"""The object store behind the harness's API server: Kubernetes objects as plain dicts, keyed by
(resource, namespace, name), with the metadata bookkeeping an API server does (uid, resourceVersion,
creationTimestamp, generation), label selectors, and deletion with the three propagation policies."""

from __future__ import annotations

import copy
import functools
import itertools
import re
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any, Iterable


@dataclass(frozen=True)
class Kind:
    kind: str
    group: str  # "" for the core group
    version: str
    plural: str
    namespaced: bool = True

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version


SHORT_NAMES = {"pods": ["po"], "services": ["svc"], "configmaps": ["cm"], "serviceaccounts": ["sa"],
               "persistentvolumeclaims": ["pvc"], "events": ["ev"], "namespaces": ["ns"], "cronjobs": ["cj"],
               "deployments": ["deploy"], "networkpolicies": ["netpol"], "poddisruptionbudgets": ["pdb"],
               "priorityclasses": ["pc"]}

KINDS = [Kind(*k) for k in [
    ("Pod", "", "v1", "pods"), ("Service", "", "v1", "services"), ("ConfigMap", "", "v1", "configmaps"),
    ("Secret", "", "v1", "secrets"), ("ServiceAccount", "", "v1", "serviceaccounts"),
    ("PersistentVolumeClaim", "", "v1", "persistentvolumeclaims"), ("Event", "", "v1", "events"),
    ("Namespace", "", "v1", "namespaces", False),
    ("Job", "batch", "v1", "jobs"), ("CronJob", "batch", "v1", "cronjobs"),
    ("Deployment", "apps", "v1", "deployments"),
    ("Role", "rbac.authorization.k8s.io", "v1", "roles"),
    ("RoleBinding", "rbac.authorization.k8s.io", "v1", "rolebindings"),
    ("NetworkPolicy", "networking.k8s.io", "v1", "networkpolicies"),
    ("PodDisruptionBudget", "policy", "v1", "poddisruptionbudgets"),
    ("PriorityClass", "scheduling.k8s.io", "v1", "priorityclasses", False),
    ("JobSet", "jobset.x-k8s.io", "v1alpha2", "jobsets"),
]]
BY_KIND = {k.kind: k for k in KINDS}
BY_PLURAL = {(k.group, k.plural): k for k in KINDS}


def now_rfc3339(t: float | None = None) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() if t is None else t))


class Conflict(Exception):
    """409 AlreadyExists."""


class NotFound(Exception):
    """404."""


class Invalid(Exception):
    """422: the object breaks a rule the API server enforces (an immutable field, a name)."""


# ------------------------------------------------------------------------------------------ selectors


_REQ = re.compile(r"\s*(!?)([\w./-]+)\s*(?:(==|=|!=)\s*([\w./-]*)|\s+(in|notin)\s*\(([^)]*)\))?\s*")


def clone(obj: Any) -> Any:
    """A deep copy of an API object (JSON's types: dicts, lists and immutable scalars), several times faster
    than :func:`copy.deepcopy`: the controllers copy every object they list on every tick."""
    t = type(obj)
    if t is dict:
        return {k: clone(v) for k, v in obj.items()}
    if t is list:
        return [clone(v) for v in obj]
    if t in (str, int, float, bool) or obj is None:
        return obj
    return copy.deepcopy(obj)


@functools.lru_cache(maxsize=4096)
def parse_selector(text: str | None) -> tuple[tuple[str, str, frozenset[str]], ...]:
    """A label selector string (``a=b,c!=d,e,!f,g in (x,y)``) as (key, op, values) requirements (cached: the
    controllers match the same few selectors against every object on every tick)."""
    reqs: list[tuple[str, str, frozenset[str]]] = []
    if not text:
        return ()
    parts, depth, cur = [], 0, ""
    for ch in text:  # commas inside "in (…)" do not split requirements
        depth += ch == "("
        depth -= ch == ")"
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    parts.append(cur)
    for part in parts:
        m = _REQ.fullmatch(part)
        if not m:
            raise ValueError(f"unable to parse requirement: {part!r}")
        neg, key, eq, val, setop, vals = m.groups()
        if eq:
            reqs.append((key, "!=" if eq == "!=" else "=", frozenset({val})))
        elif setop:
            reqs.append((key, setop, frozenset(v.strip() for v in vals.split(",") if v.strip())))
        else:
            reqs.append((key, "!" if neg else "exists", frozenset()))
    return tuple(reqs)


def matches(labels: dict[str, str] | None, selector: str | dict | None) -> bool:
    labels = labels or {}
    if isinstance(selector, dict):  # a matchLabels map (a Service's selector)
        return all(labels.get(k) == v for k, v in selector.items())
    for key, op, vals in parse_selector(selector):
        have = key in labels
        if op == "=" and labels.get(key) not in vals:
            return False
        if op == "!=" and have and labels[key] in vals:
            return False
        if op == "exists" and not have:
            return False
        if op == "!" and have:
            return False
        if op == "in" and labels.get(key) not in vals:
            return False
        if op == "notin" and have and labels[key] in vals:
            return False
    return True


# ------------------------------------------------------------------------------------------ the store


class Store:
    """Thread-safe objects of one fake cluster. Every method returns deep copies."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.objects: dict[tuple[str, str, str], dict[str, Any]] = {}
        self._rv = itertools.count(1000)
        self.changed = threading.Condition(self.lock)
        self.events: list[dict[str, Any]] = []
        self.version = 0  # bumped by every change: a controller whose work depends only on the objects may skip
        # a tick in which it did not move

    def _changed(self) -> None:
        self.version += 1
        self.changed.notify_all()

    @staticmethod
    def key(kind: str, namespace: str | None, name: str) -> tuple[str, str, str]:
        k = BY_KIND.get(kind)
        return kind, (namespace or "") if (k is None or k.namespaced) else "", name

    def create(self, obj: dict[str, Any], namespace: str | None = None, uid: str | None = None) -> dict[str, Any]:
        obj = clone(obj)
        meta = obj.setdefault("metadata", {})
        kind = obj["kind"]
        if not meta.get("name") and meta.get("generateName"):
            meta["name"] = meta["generateName"] + uuid.uuid4().hex[:5]
        if not meta.get("name"):
            raise Invalid(f"{kind}: metadata.name is required")
        k = BY_KIND.get(kind)
        if k is None or k.namespaced:
            meta["namespace"] = namespace or meta.get("namespace") or "default"
        else:
            meta.pop("namespace", None)
        key = self.key(kind, meta.get("namespace"), meta["name"])
        with self.lock:
            if key in self.objects:
                raise Conflict(f'{(k.plural if k else kind.lower() + "s")} "{meta["name"]}" already exists')
            meta.update(uid=uid or str(uuid.uuid4()), creationTimestamp=now_rfc3339(), generation=1,
                        resourceVersion=str(next(self._rv)))
            if kind in ("Job", "Pod", "CronJob", "JobSet", "Deployment"):
                obj.setdefault("status", {})
            self.objects[key] = obj
            self._changed()
            return clone(obj)

    def get(self, kind: str, namespace: str | None, name: str) -> dict[str, Any] | None:
        with self.lock:
            obj = self.objects.get(self.key(kind, namespace, name))
            return clone(obj) if obj is not None else None

    def list(self, kind: str, namespace: str | None = None, selector: str | dict | None = None) -> list[dict]:
        with self.lock:
            out = [clone(o) for (k, ns, _), o in self.objects.items()
                   if k == kind and (namespace is None or ns == namespace)
                   and matches(o["metadata"].get("labels"), selector)]
        return sorted(out, key=lambda o: (o["metadata"]["creationTimestamp"], int(o["metadata"]["resourceVersion"])))

    def by_uid(self, uid: str) -> dict[str, Any] | None:
        with self.lock:
            for o in self.objects.values():
                if o["metadata"].get("uid") == uid:
                    return clone(o)
        return None

    def update(self, obj: dict[str, Any], *, status_only: bool = False) -> dict[str, Any]:
        """Replace an object (or only its status); bumps resourceVersion, and generation on a spec change."""
        meta = obj["metadata"]
        key = self.key(obj["kind"], meta.get("namespace"), meta["name"])
        with self.lock:
            cur = self.objects.get(key)
            if cur is None:
                raise NotFound(f'{obj["kind"]} "{meta["name"]}" not found')
            new = clone(cur)
            if status_only:
                new["status"] = clone(obj.get("status", {}))
            else:
                for k, v in obj.items():
                    if k != "metadata":
                        new[k] = clone(v)
                for k in ("labels", "annotations", "ownerReferences", "finalizers"):
                    if k in meta:
                        new["metadata"][k] = clone(meta[k])
                if cur.get("spec") != new.get("spec"):
                    new["metadata"]["generation"] = cur["metadata"].get("generation", 1) + 1
            new["metadata"]["resourceVersion"] = str(next(self._rv))
            self.objects[key] = new
            self._changed()
            return clone(new)

    def mutate(self, kind: str, namespace: str | None, name: str, fn) -> dict[str, Any] | None:
        """Apply ``fn(obj)`` in place under the lock (a controller's status write); None if gone. A write that
        changes nothing is no change: same resourceVersion, no ``version`` bump."""
        with self.lock:
            cur = self.objects.get(self.key(kind, namespace, name))
            if cur is None:
                return None
            before = clone(cur)
            fn(cur)
            if cur == before:  # a write that changes nothing keeps its resourceVersion, as on an API server
                return before
            cur["metadata"]["resourceVersion"] = str(next(self._rv))
            self._changed()
            return clone(cur)

    def delete(self, kind: str, namespace: str | None, name: str, propagation: str | None = None) -> dict[str, Any]:
        """Delete with the API's propagation policies. Background: the object goes now and the garbage
        collector removes its dependents. Foreground: the object gets a deletionTimestamp and the
        ``foregroundDeletion`` finalizer, and goes once its dependents are gone. Orphan (the default for
        batch/v1 Jobs, kept for compatibility): dependents lose their owner reference and stay."""
        if propagation is None:
            propagation = "Orphan" if kind == "Job" else "Background"
        with self.lock:
            key = self.key(kind, namespace, name)
            cur = self.objects.get(key)
            if cur is None:
                raise NotFound(f'{kind} "{name}" not found')
            uid = cur["metadata"]["uid"]
            meta = cur["metadata"]
            meta.setdefault("deletionTimestamp", now_rfc3339())
            if propagation == "Foreground":
                fin = meta.setdefault("finalizers", [])
                if "foregroundDeletion" not in fin:
                    fin.append("foregroundDeletion")
                if kind == "Pod":  # a pod's "dependents" are its processes: the kubelet ends them
                    meta["finalizers"].remove("foregroundDeletion")
            elif propagation == "Orphan":
                for o in self.objects.values():
                    refs = o["metadata"].get("ownerReferences") or []
                    if any(r.get("uid") == uid for r in refs):
                        o["metadata"]["ownerReferences"] = [r for r in refs if r.get("uid") != uid]
            if kind != "Pod" and not meta.get("finalizers"):
                del self.objects[key]
            meta["resourceVersion"] = str(next(self._rv))
            self._changed()
            return clone(cur)

    def remove(self, kind: str, namespace: str | None, name: str) -> None:
        """Drop an object for good (the last finalizer done; a pod whose processes ended)."""
        with self.lock:
            self.objects.pop(self.key(kind, namespace, name), None)
            self._changed()

    def dependents(self, uid: str) -> list[dict[str, Any]]:
        with self.lock:
            return [clone(o) for o in self.objects.values()
                    if any(r.get("uid") == uid for r in o["metadata"].get("ownerReferences") or [])]

    def all(self) -> Iterable[dict[str, Any]]:
        with self.lock:
            return [clone(o) for o in self.objects.values()]

    def event(self, obj: dict[str, Any], reason: str, message: str, type_: str = "Normal") -> None:
        with self.lock:
            self.events.append({"kind": obj["kind"], "name": obj["metadata"]["name"], "reason": reason,
                                "message": message, "type": type_, "time": time.time(),
                                "namespace": obj["metadata"].get("namespace", ""), "uid": obj["metadata"].get("uid", ""),
                                "apiVersion": obj.get("apiVersion", "")})
