"""``helm install/upgrade/test/uninstall`` against the harness cluster, with Helm's own template engine
(PyPI ``helm-python-sdk``: the Helm 4 library through ctypes) doing values merging, schema validation
and rendering; the release bookkeeping Helm does around it is reproduced here:

* values: ``-f`` files merged in order (maps deeply, later wins), then ``--set`` expressions parsed by
  Helm's strvals parser; Helm coalesces them with the chart's values.yaml (``null`` deletes a key) and
  validates values.schema.json;
* install: hooks (``helm.sh/hook``) apart from the release's manifests; ``pre-install`` hooks by
  weight, then the manifests in Helm's install order by kind (Namespace … ServiceAccount, Secret,
  ConfigMap, … Role, RoleBinding, Service, … Pod, …, Deployment, …, Job, CronJob, …; unknown kinds
  last), then ``post-install`` hooks; a hook Job or Pod is waited for, as Helm does, and deleted per
  ``helm.sh/hook-delete-policy`` (``before-hook-creation`` is the default); every resource gets Helm's
  ``meta.helm.sh/release-*`` annotations and ``app.kubernetes.io/managed-by: Helm``;
* upgrade: objects in both revisions are patched — Helm's three-way patch carries the difference
  between the old and the new rendering (here a JSON merge patch, applied to the live object, so what
  the cluster set — defaults, a queue's ``suspend`` — stays), so a change to an immutable field fails the upgrade with the
  API server's "field is immutable"; objects no longer rendered are deleted (propagation Background)
  unless annotated ``helm.sh/resource-policy: keep``; new ones are created;
* upgrade to another chart (``chart=``: e.g. this chart's previous version, from git history): the
  new chart renders the next revision, and the upgrade goes on as above;
* test: the ``test`` hooks, waited for; uninstall: the ``pre-delete`` hooks, everything but ``keep``
  resources in reverse order (propagation Background, as `helm uninstall`'s default cascade), then the
  ``post-delete`` hooks, each waited for (a failed one makes the uninstall fail, as Helm's does, after
  the release's objects are deleted).
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import helm_python
import yaml

from .apiserver import merge_patch
from .store import BY_KIND, NotFound

if TYPE_CHECKING:
    from .cluster import Cluster

INSTALL_ORDER = [
    "PriorityClass", "Namespace", "NetworkPolicy", "ResourceQuota", "LimitRange", "PodSecurityPolicy",
    "PodDisruptionBudget", "ServiceAccount", "Secret", "SecretList", "ConfigMap", "StorageClass",
    "PersistentVolume", "PersistentVolumeClaim", "CustomResourceDefinition", "ClusterRole", "ClusterRoleList",
    "ClusterRoleBinding", "ClusterRoleBindingList", "Role", "RoleList", "RoleBinding", "RoleBindingList",
    "Service", "DaemonSet", "Pod", "ReplicationController", "ReplicaSet", "Deployment", "HorizontalPodAutoscaler",
    "StatefulSet", "Job", "CronJob", "IngressClass", "Ingress", "APIService", "MutatingWebhookConfiguration",
    "ValidatingWebhookConfiguration",
]


class HelmError(Exception):
    pass


def deep_merge(base: dict, over: dict) -> dict:
    out = copy.deepcopy(base)
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = deep_merge(out[k], v)
        else:
            out[k] = copy.deepcopy(v)
    return out


def user_values(files: list[Path | str] = (), set_values: list[str] = (), set_string: list[str] = (),
                set_json: list[str] = ()) -> dict:
    vals: dict = {}
    for f in files:
        vals = deep_merge(vals, helm_python.values_from_yaml(Path(f).read_text()) or {})
    # Helm parses every --set into one map (list elements set by index merge); joining them with ","
    # and parsing once with Helm's strvals parser does the same
    if set_values:
        vals = deep_merge(vals, helm_python.parse_set_string(",".join(set_values)))
    if set_string:
        vals = deep_merge(vals, helm_python.parse_set_string_values(",".join(set_string)))
    for expr in set_json:
        vals = deep_merge(vals, helm_python.parse_set_json(expr))
    return vals


def render(chart: Path, values: dict, release: str, namespace: str, revision: int = 1,
           upgrade: bool = False) -> tuple[list[dict], list[dict], str]:
    """(manifests, hooks, NOTES.txt) of one rendering."""
    helm_python.validate_release_name(release)
    with helm_python.Chart.load(chart) as c:
        out = c.render(values=values, name=release, namespace=namespace, revision=revision,
                       is_install=not upgrade, is_upgrade=upgrade)
    docs, hooks, notes = [], [], ""
    for path, text in sorted(out.items()):
        if path.endswith("NOTES.txt"):
            notes = text
            continue
        for d in yaml.safe_load_all(text):
            if not d:
                continue
            (hooks if "helm.sh/hook" in (d.get("metadata", {}).get("annotations") or {}) else docs).append(d)
    return docs, hooks, notes


def order_key(d: dict) -> tuple[int, str]:
    kind = d["kind"]
    return (INSTALL_ORDER.index(kind) if kind in INSTALL_ORDER else len(INSTALL_ORDER), d["metadata"]["name"])


@dataclass
class Release:
    name: str
    namespace: str
    chart: Path
    revision: int
    values: dict
    manifests: list[dict]
    hooks: list[dict]
    notes: str
    history: list[int] = field(default_factory=list)


class Helm:
    def __init__(self, cluster: "Cluster") -> None:
        self.cluster = cluster
        self.releases: dict[str, Release] = {}

    def _annotate(self, d: dict, rel: Release) -> dict:
        d = copy.deepcopy(d)
        meta = d.setdefault("metadata", {})
        meta.setdefault("annotations", {}).update({"meta.helm.sh/release-name": rel.name,
                                                   "meta.helm.sh/release-namespace": rel.namespace})
        meta.setdefault("labels", {})["app.kubernetes.io/managed-by"] = "Helm"
        return d

    def _create(self, d: dict, rel: Release) -> None:
        kind = BY_KIND.get(d["kind"])
        if kind is None:
            raise HelmError(f'resource mapping not found for kind "{d["kind"]}": ensure CRDs are installed first')
        body = self._annotate(d, rel)
        from .apiserver import ApiError
        try:
            self.cluster.create(body, rel.namespace, validate=True, strict=True)
        except ApiError as e:
            raise HelmError(f"{d['kind']} {d['metadata']['name']}: {e.message}") from e

    def _run_hooks(self, rel: Release, event: str, timeout: float) -> list[tuple[str, str]]:
        hooks = [h for h in rel.hooks
                 if event in [s.strip() for s in h["metadata"]["annotations"]["helm.sh/hook"].split(",")]]
        hooks.sort(key=lambda h: (int(h["metadata"]["annotations"].get("helm.sh/hook-weight", "0")),
                                  h["kind"], h["metadata"]["name"]))
        results = []
        for h in hooks:
            ann = h["metadata"]["annotations"]
            policies = [p.strip() for p in ann.get("helm.sh/hook-delete-policy", "before-hook-creation").split(",")]
            name, kind = h["metadata"]["name"], h["kind"]
            if "before-hook-creation" in policies and self.cluster.store.get(kind, rel.namespace, name):
                self.cluster.store.delete(kind, rel.namespace, name, "Background")
                self.cluster.wait_for(lambda: self.cluster.store.get(kind, rel.namespace, name) is None, 30,
                                      f"old hook {kind} {name} to go")
            self._create(h, rel)
            phase = "created"
            if kind in ("Job", "Pod"):
                phase = self._wait_hook(kind, rel.namespace, name, timeout)
            results.append((name, phase))
            if phase in ("Succeeded", "Complete") and "hook-succeeded" in policies or \
                    phase in ("Failed",) and "hook-failed" in policies:
                self.cluster.store.delete(kind, rel.namespace, name, "Background")
            if phase == "Failed":
                raise HelmError(f"{event} hook {kind} {name} failed")
        return results

    def _wait_hook(self, kind: str, ns: str, name: str, timeout: float) -> str:
        def phase() -> str | None:
            o = self.cluster.store.get(kind, ns, name)
            if o is None:
                return "Failed"
            if kind == "Pod":
                p = o.get("status", {}).get("phase")
                return p if p in ("Succeeded", "Failed") else None
            for c in (o.get("status") or {}).get("conditions") or []:
                if c["type"] in ("Complete", "Failed") and c["status"] == "True":
                    return c["type"]
            return None
        self.cluster.wait_for(lambda: phase() is not None, timeout, f"hook {kind} {name}")
        return phase()  # type: ignore[return-value]

    def install(self, release: str, chart: Path, *, namespace: str | None = None, values_files=(), set_values=(),
                set_string=(), set_json=(), timeout: float = 300) -> Release:
        ns = namespace or self.cluster.namespace
        if release in self.releases:
            raise HelmError(f"INSTALLATION FAILED: cannot re-use a name that is still in use: {release}")
        vals = user_values(values_files, set_values, set_string, set_json)
        docs, hooks, notes = render(chart, vals, release, ns, 1)
        rel = Release(release, ns, chart, 1, vals, docs, hooks, notes, [1])
        self._run_hooks(rel, "pre-install", timeout)
        for d in sorted(docs, key=order_key):
            self._create(d, rel)
        self.releases[release] = rel
        self._run_hooks(rel, "post-install", timeout)
        return rel

    def upgrade(self, release: str, chart: Path | None = None, *, values_files=(), set_values=(), set_string=(),
                set_json=(), reuse_values: bool = False, timeout: float = 300) -> Release:
        old = self.releases[release]
        chart = chart or old.chart
        vals = user_values(values_files, set_values, set_string, set_json)
        if reuse_values:
            vals = deep_merge(old.values, vals)
        rev = old.revision + 1
        docs, hooks, notes = render(chart, vals, release, old.namespace, rev, upgrade=True)
        new = Release(release, old.namespace, chart, rev, vals, docs, hooks, notes, old.history + [rev])
        key = lambda d: (d["kind"], d["metadata"]["name"])  # noqa: E731
        before = {key(d): d for d in old.manifests}
        after = {key(d): d for d in docs}
        from .apiserver import ApiError
        for k in after:  # check every patch before changing anything, as the API server would refuse it
            if k in before and self.cluster.store.get(k[0], old.namespace, k[1]) is not None:
                try:
                    self.cluster.api.check_immutable(BY_KIND[k[0]], before[k], after[k])
                except ApiError as e:
                    raise HelmError(f'UPGRADE FAILED: cannot patch "{k[1]}" with kind {k[0]}: {e.message}') from e
        self._run_hooks(new, "pre-upgrade", timeout)
        for d in sorted(docs, key=order_key):
            live = self.cluster.store.get(d["kind"], old.namespace, d["metadata"]["name"])
            if live is None:
                self._create(d, new)
            elif before.get(key(d)) != d:
                # Helm's three-way patch: what changed between the two renderings, applied to the live
                # object (fields that only the cluster set — defaults, Kueue's suspend — stay)
                patch = diff_patch(self._annotate(before[key(d)], old), self._annotate(d, new)) \
                    if key(d) in before else self._annotate(d, new)
                self.cluster.store.update(merge_patch(live, patch))
        for k, d in sorted(before.items(), key=lambda kv: order_key(kv[1]), reverse=True):
            if k not in after and (d["metadata"].get("annotations") or {}).get("helm.sh/resource-policy") != "keep":
                try:
                    self.cluster.store.delete(k[0], old.namespace, k[1], "Background")
                except NotFound:
                    pass
        self.releases[release] = new
        self._run_hooks(new, "post-upgrade", timeout)
        return new

    def test(self, release: str, timeout: float = 300) -> list[tuple[str, str]]:
        return self._run_hooks(self.releases[release], "test", timeout)

    def uninstall(self, release: str, timeout: float = 300) -> list[tuple[str, str]]:
        """The release's objects deleted between its pre- and post-delete hooks; the hooks' results."""
        rel = self.releases[release]
        results = self._run_hooks(rel, "pre-delete", timeout)
        self.releases.pop(release)
        for d in sorted(rel.manifests, key=order_key, reverse=True):
            if (d["metadata"].get("annotations") or {}).get("helm.sh/resource-policy") == "keep":
                continue
            try:
                self.cluster.store.delete(d["kind"], rel.namespace, d["metadata"]["name"], "Background")
            except NotFound:
                pass
        return results + self._run_hooks(rel, "post-delete", timeout)

    @staticmethod
    def lint(chart: Path, values: dict, kube_version: str) -> dict[str, Any]:
        return helm_python.lint(chart, values, strict=True, kube_version=f"v{kube_version}")


def diff_patch(old: Any, new: Any) -> Any:
    """The JSON merge patch that turns ``old`` into ``new`` (removed keys → null, lists whole)."""
    if not (isinstance(old, dict) and isinstance(new, dict)):
        return copy.deepcopy(new)
    out: dict = {k: None for k in old if k not in new}
    for k, v in new.items():
        if k not in old:
            out[k] = copy.deepcopy(v)
        elif old[k] != v:
            out[k] = diff_patch(old[k], v)
    return out


def wait_seconds(start: float) -> float:
    return time.monotonic() - start
