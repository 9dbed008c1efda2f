"""One fake cluster: the object store, the HTTPS API server, the controllers and the kubelet, driven
by one control loop thread; plus what a test does as a user (helm, kubectl-like reads, fault
injection) and waits with diagnostics."""

from __future__ import annotations

import base64
import os
import secrets
import shutil
import signal
import subprocess
import tempfile
import threading
import time
import traceback
import uuid
from pathlib import Path
from typing import Any, Callable

import yaml

from .admission import default_cronjob, default_job, kueue_webhook
from .apiserver import ApiServer
from .controllers import GarbageCollector, JobController, QueueAdmission
from .helm import Helm
from .kubelet import REPO, Kubelet
from .store import Store


def make_certs(d: Path) -> tuple[Path, Path, Path]:
    """A CA and a server certificate for 127.0.0.1 (openssl), as a cluster's CA bundle would be."""
    d.mkdir(parents=True, exist_ok=True)
    ca_key, ca, key, csr, cert = (d / n for n in ("ca.key", "ca.crt", "server.key", "server.csr", "server.crt"))
    ext = d / "ext.cnf"
    ext.write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\nbasicConstraints=CA:FALSE\n"
                   "keyUsage=digitalSignature,keyEncipherment\nextendedKeyUsage=serverAuth\n")
    run = lambda *a: subprocess.run(["openssl", *a], check=True, capture_output=True)  # noqa: E731
    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(ca_key), "-out", str(ca), "-days", "2",
        "-subj", "/CN=harness-ca")
    run("req", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(csr), "-subj", "/CN=127.0.0.1")
    run("x509", "-req", "-in", str(csr), "-CA", str(ca), "-CAkey", str(ca_key), "-CAcreateserial", "-out", str(cert),
        "-days", "2", "-extfile", str(ext))
    return ca, cert, key


# the version the API server reports and validates against: within the supported skew (±1 minor) of
# the kubectl 1.32 that the journeys run (/usr/bin/kubectl), and inside the chart's kubeVersion range
KUBE_VERSION = "1.33.0"


class Cluster:
    """``queues``: run a Kueue-like admission (controllers.QueueAdmission) with these LocalQueues, each
    a nominal quota, e.g. ``{"team": {"nvidia.com/gpu": 8, "cpu": 64}}``; None: no Kueue installed (the
    queue-name label means nothing). The node's folders (pods, hostPath, claims) live in a fresh
    folder under the system's temporary directory that any user may traverse (``node_root``), since
    pods run as their own users; it goes with ``stop()``."""

    def __init__(self, root: Path, *, namespace: str = "sapd", backoff_base_seconds: float = 0.2,
                 max_grace_seconds: float = 5.0, deadline_scale: float = 1.0,
                 node_capacity: dict[str, Any] | None = None, kube_version: str = KUBE_VERSION,
                 dockerfile: Path = REPO / "Dockerfile", tick_seconds: float = 0.05,
                 queues: dict[str, dict[str, Any]] | None = None) -> None:
        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        self.node_root = Path(tempfile.mkdtemp(prefix="sapd-harness-node-"))
        self.node_root.chmod(0o755)
        self.namespace = namespace
        self.backoff_base_seconds = backoff_base_seconds
        self.max_grace_seconds = max_grace_seconds
        self.deadline_scale = deadline_scale
        self.node_capacity = node_capacity or {}
        self.kube_version = kube_version
        self.dockerfile = dockerfile
        self.tick = tick_seconds
        self.store = Store()
        self.admin_token = secrets.token_hex(16)
        self.tokens: dict[str, str] = {self.admin_token: "admin"}
        self.sa_tokens: dict[tuple[str, str], str] = {}
        self.ca, cert, key = make_certs(root / "pki")
        self.api = ApiServer(self, cert, key)
        self.kubelet = Kubelet(self)
        self.jobs = JobController(self)
        self.gc = GarbageCollector(self)
        self.queues = QueueAdmission(self, queues) if queues is not None else None
        self.helm = Helm(self)
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="harness-control-loop", daemon=True)

    # -------------------------------------------------------------------------------- lifecycle

    def start(self) -> "Cluster":
        if self.kubelet.identity:  # pods run as uid 1000: they must reach the checkout and its environments
            for p in [REPO, *REPO.parents]:
                if not p.stat().st_mode & 0o001:
                    raise RuntimeError(f"the harness's pods run as their own users (uid 1000) and cannot reach "
                                       f"{REPO}: {p} is not searchable by others (chmod o+x {p})")
        self.api.start()
        self.create({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": self.namespace}})
        self.create({"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "default"}}, self.namespace)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        self.kubelet.stop_all()
        self.api.stop()
        shutil.rmtree(self.node_root, ignore_errors=True)

    def _loop(self) -> None:
        while not self._stop.is_set():
            for part in (self.kubelet, *([self.queues] if self.queues else []), self.jobs, self.gc):
                try:
                    part.sync()
                except Exception:  # noqa: BLE001 - a controller bug must show up in the test, not kill the loop
                    err = traceback.format_exc()
                    if not self.errors or self.errors[-1] != err:
                        self.errors.append(err)
            self._stop.wait(self.tick)

    # -------------------------------------------------------------------------------- objects

    def create(self, obj: dict, namespace: str | None = None, *, validate: bool = False,
               strict: bool = False) -> dict:
        """Create as the API server does: defaults and admission webhooks first, then (``validate``)
        the schema and name checks, then the store."""
        obj = dict(obj)
        if obj["kind"] == "Secret" and obj.get("stringData"):
            data = dict(obj.get("data") or {})
            data.update({k: base64.b64encode(str(v).encode()).decode() for k, v in obj["stringData"].items()})
            obj = {**{k: v for k, v in obj.items() if k != "stringData"}, "data": data}
        uid = str(uuid.uuid4())
        obj["metadata"] = dict(obj.get("metadata") or {})
        if obj["kind"] == "Job" and obj["metadata"].get("name"):
            obj = default_job(obj, uid)
            if self.queues is not None:
                obj = kueue_webhook(obj)
        elif obj["kind"] == "CronJob":
            obj = default_cronjob(obj)
        if validate:
            from .store import BY_KIND
            self.api.validate(BY_KIND[obj["kind"]], obj, strict)
        out = self.store.create(obj, namespace or self.namespace, uid=uid)
        if obj["kind"] == "ServiceAccount":
            token = secrets.token_hex(16)
            key = (out["metadata"]["namespace"], out["metadata"]["name"])
            self.sa_tokens[key] = token
            self.tokens[token] = f"system:serviceaccount:{key[0]}:{key[1]}"
        return out

    def sa_token(self, pod: dict) -> str | None:
        ns, spec = pod["metadata"]["namespace"], pod["spec"]
        sa_name = spec.get("serviceAccountName") or "default"
        sa = self.store.get("ServiceAccount", ns, sa_name)
        if sa is None:
            return None
        mount = spec.get("automountServiceAccountToken")
        if mount is None:
            mount = sa.get("automountServiceAccountToken", True)
        return self.sa_tokens.get((ns, sa_name)) if mount else None

    def kubeconfig_text(self, token: str | None, namespace: str) -> str:
        user: dict[str, Any] = {"token": token} if token else {}
        ca = base64.b64encode(self.ca.read_bytes()).decode()  # inline: pods need not read the test's folder
        return yaml.safe_dump({
            "apiVersion": "v1", "kind": "Config", "current-context": "harness",
            "clusters": [{"name": "harness", "cluster": {"server": self.api.url, "certificate-authority-data": ca}}],
            "users": [{"name": "pod", "user": user}],
            "contexts": [{"name": "harness", "context": {"cluster": "harness", "user": "pod", "namespace": namespace}}]})

    def admin_kubeconfig(self) -> Path:
        p = self.root / "admin.kubeconfig"
        p.write_text(self.kubeconfig_text(self.admin_token, self.namespace))
        return p

    def kubectl(self, *args: str, check: bool = True, timeout: float = 60, input: str | None = None) -> str:
        """Run the real kubectl (/usr/bin/kubectl, or $KUBECTL) against this cluster as its admin; its
        stdout (stderr appended when ``check`` is false); a failure raises with both."""
        exe = os.environ.get("KUBECTL", "/usr/bin/kubectl")
        env = {**os.environ, "KUBECONFIG": str(self.admin_kubeconfig()), "KUBECACHEDIR": str(self.root / "kubecache")}
        r = subprocess.run([exe, *args], capture_output=True, text=True, env=env, timeout=timeout, input=input)
        if check and r.returncode != 0:
            raise AssertionError(f"kubectl {' '.join(args)} exited {r.returncode}:\n{r.stdout}{r.stderr}")
        return r.stdout if check else r.stdout + r.stderr

    def client(self):
        """A kubernetes.client.ApiClient as the cluster admin (the test's `kubectl`)."""
        from kubernetes import client, config
        conf = client.Configuration()
        config.load_kube_config(config_file=str(self.admin_kubeconfig()), client_configuration=conf)
        return client.ApiClient(conf)

    def host_path(self, path: str, owner: tuple[int, int] | None = None) -> Path:
        """The folder a hostPath volume of ``path`` is on this (single) node, created as a node's admin
        would (root's, 0755; ``owner`` (uid, gid): handed to that user, e.g. the pods' 1000:1000)."""
        d = self.node_root / "node-hostpath" / path.strip("/")
        self.kubelet._make_node_dirs(d)
        if owner is not None:
            for p in [d, *d.rglob("*")]:
                os.chown(p, *owner, follow_symlinks=False)
        return d

    def create_secret(self, name: str, data: dict[str, str], namespace: str | None = None) -> None:
        self.create({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": name}, "type": "Opaque",
                     "stringData": data}, namespace)

    # -------------------------------------------------------------------------------- reads

    def job(self, name: str, namespace: str | None = None) -> dict | None:
        return self.store.get("Job", namespace or self.namespace, name)

    def job_state(self, name: str) -> str | None:
        j = self.job(name)
        if j is None:
            return None
        for c in (j.get("status") or {}).get("conditions") or []:
            if c["type"] in ("Complete", "Failed") and c["status"] == "True":
                return c["type"]
        return "Running"

    def pods(self, selector: str | None = None) -> list[dict]:
        return self.store.list("Pod", self.namespace, selector)

    def logs(self, pod: str) -> str:
        return self.kubelet.log_text(self.namespace, pod)

    def get_jobs_table(self, selector: str | None = None) -> str:
        """What `kubectl get jobs` prints (NAME, STATUS, COMPLETIONS), for messages and the README."""
        rows = [("NAME", "STATUS", "COMPLETIONS")]
        for j in self.store.list("Job", self.namespace, selector):
            st = j.get("status") or {}
            rows.append((j["metadata"]["name"], self.job_state(j["metadata"]["name"]) or "",
                         f"{st.get('succeeded', 0)}/{j['spec'].get('completions', 1)}"))
        w = [max(len(r[i]) for r in rows) for i in range(3)]
        return "\n".join("   ".join(c.ljust(w[i]) for i, c in enumerate(r)).rstrip() for r in rows)

    def timeline(self) -> str:
        """Each pod's containers with their start and finish times (a run's profile)."""
        rows = []
        for p in self.store.list("Pod", self.namespace):
            st = p.get("status", {})
            for cs in st.get("initContainerStatuses", []) + st.get("containerStatuses", []):
                t = cs["state"].get("terminated") or cs["state"].get("running") or {}
                rows.append((t.get("startedAt", ""), t.get("finishedAt", ""), p["metadata"]["name"], cs["name"]))
        return "\n".join(f"{a[11:19]} {b[11:19] or '--:--:--'} {pod} [{c}]" for a, b, pod, c in sorted(rows))

    def describe(self, tail: int = 25) -> str:
        """Jobs, pods (with exit codes) and the log tails of failed or running pods: a test's failure text."""
        out = [self.get_jobs_table(), ""]
        for p in self.store.list("Pod", self.namespace):
            st = p.get("status", {})
            codes = [cs["state"].get("terminated", {}).get("exitCode") for cs in st.get("containerStatuses", [])]
            out.append(f"pod {p['metadata']['name']}: {st.get('phase')} exit {codes} {st.get('message', '')}")
            if st.get("phase") != "Succeeded":
                text = self.logs(p["metadata"]["name"]).splitlines()[-tail:]
                out += [f"    | {ln}" for ln in text]
        out += [f"event {e['kind']} {e['name']}: {e['reason']}: {e['message']}" for e in self.store.events[-20:]]
        out += [f"controller error: {e}" for e in self.errors[-3:]]
        # last, where a log cut to its tail still shows it: why each failed pod ended, in its own words
        from tests.pipeline_util import why_lines
        for p in self.store.list("Pod", self.namespace):
            if p.get("status", {}).get("phase") == "Failed":
                name = p["metadata"]["name"]
                out += [f"why {name} failed: {ln}" for ln in why_lines(self.logs(name), 6)]
        return "\n".join(out)

    # -------------------------------------------------------------------------------- waits, faults

    def wait_for(self, pred: Callable[[], Any], timeout: float, what: str, poll: float = 0.1) -> Any:
        deadline = time.monotonic() + timeout
        while True:
            v = pred()
            if v:
                return v
            if self.errors:
                raise AssertionError(f"harness controller error while waiting for {what}:\n{self.errors[-1]}")
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}\n{self.describe()}")
            time.sleep(poll)

    def wait_job(self, name: str, timeout: float = 300) -> str:
        """Wait until Job ``name`` exists and is Complete or Failed; returns which."""
        return self.wait_for(lambda: self.job_state(name) in ("Complete", "Failed") and self.job_state(name),
                             timeout, f"job {name} to finish")

    def wait_pod(self, selector: str, pred: Callable[[dict], bool], timeout: float = 300, what: str = "") -> dict:
        def find():
            for p in self.pods(selector):
                if pred(p):
                    return p
            return None
        return self.wait_for(find, timeout, what or f"a pod matching {selector}")

    def wait_log(self, selector: str, text: str, timeout: float = 300) -> dict:
        return self.wait_pod(selector, lambda p: p.get("status", {}).get("phase") == "Running"
                             and text in self.logs(p["metadata"]["name"]), timeout,
                             f"a running pod ({selector}) to log {text!r}")

    def kill_pod(self, pod: str, sig: int = signal.SIGKILL) -> bool:
        return self.kubelet.kill_container(self.namespace, pod, sig)

    def run_cronjob(self, name: str) -> str | None:
        return self.jobs.run_cronjob(self.namespace, name)
