"""The journey harness itself (tests/k8s_harness): its Job semantics, its API server's authentication,
RBAC, validation, defaulting and discovery (driven by the real kubectl), its queue admission, and what
a container sees — its image target's environment, its user, its volumes' permissions — each on tiny
`python -c` pods, so that a journey failing in tests/cluster/test_journeys.py can be trusted to be the chart's
or sapd's fault, not the harness's. The pods run as uid 1000 (the image's USER) unless they say
otherwise, which needs the test process to be root (as in CI)."""

from __future__ import annotations

import json
import re
import signal
import ssl
import textwrap
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import yaml

from tests.k8s_harness import Cluster, HelmError
from tests.k8s_harness.protobuf import MEDIA_TYPE

IMAGE = "ghcr.io/sapd/sapd:0.1.0-cpu"
pytestmark = pytest.mark.integration


@pytest.fixture
def cluster(tmp_path):
    c = Cluster(tmp_path / "cluster", backoff_base_seconds=0.05, max_grace_seconds=2).start()
    try:
        yield c
    finally:
        c.stop()


def job(name: str, script: str, **spec) -> dict:
    pod = spec.pop("pod", {})
    container = {"name": "main", "image": IMAGE, "command": ["python", "-c", textwrap.dedent(script)],
                 **spec.pop("container", {})}
    return {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": name},
            "spec": {"template": {"spec": {"restartPolicy": "Never", "containers": [container], **pod}}, **spec}}


SHARED = {"volumes": [{"name": "shared", "hostPath": {"path": "/var/harness-test"}}]}
MOUNT = {"volumeMounts": [{"name": "shared", "mountPath": "/shared"}]}


def test_indexed_job_retries_one_index_and_completes(cluster):
    # index 1 fails once (exit 3, counted) and succeeds on its second pod; every pod sees its index
    cluster.host_path("/var/harness-test", owner=(1000, 1000))  # the node's admin hands it to the pods' user
    cluster.create(job("idx", """
        import os, pathlib
        i = os.environ["JOB_COMPLETION_INDEX"]
        mark = pathlib.Path("/shared/tried-" + i)
        print("index", i, "host", os.environ["HOSTNAME"])
        if i == "1" and not mark.exists():
            mark.write_text("x"); raise SystemExit(3)
        """, completionMode="Indexed", completions=3, parallelism=3, backoffLimit=2,
        pod={**SHARED, "subdomain": "svc"}, container=MOUNT))
    assert cluster.wait_job("idx", 60) == "Complete"
    j = cluster.job("idx")
    assert j["status"]["succeeded"] == 3 and j["status"]["failed"] == 1 and j["status"]["completedIndexes"] == "0-2"
    pods = cluster.pods("batch.kubernetes.io/job-name=idx")
    assert len(pods) == 4
    for p in pods:
        i = p["metadata"]["labels"]["batch.kubernetes.io/job-completion-index"]
        assert p["metadata"]["name"].startswith(f"idx-{i}-") and p["spec"]["hostname"] == f"idx-{i}"
        assert f"index {i} host idx-{i}" in cluster.logs(p["metadata"]["name"])
    assert (cluster.host_path("/var/harness-test") / "tried-1").exists()  # hostPath: shared by the node


def test_pod_failure_policy_fail_job_ends_the_job_and_its_running_pods(cluster):
    cluster.create(job("pfp", """
        import os, time
        if os.environ["JOB_COMPLETION_INDEX"] == "0":
            raise SystemExit(2)
        time.sleep(60)
        """, completionMode="Indexed", completions=2, parallelism=2, backoffLimit=6, podReplacementPolicy="Failed",
        podFailurePolicy={"rules": [{"action": "FailJob", "onExitCodes": {"containerName": "main", "operator": "In",
                                                                            "values": [2]}}]}))
    assert cluster.wait_job("pfp", 60) == "Failed"
    cond = {c["type"]: c for c in cluster.job("pfp")["status"]["conditions"]}
    assert cond["Failed"]["reason"] == "PodFailurePolicy" and cond["FailureTarget"]["status"] == "True"
    assert "exit code 2 matching FailJob rule at index 0" in cond["Failed"]["message"]
    assert not [p for p in cluster.pods("batch.kubernetes.io/job-name=pfp") if p["status"]["phase"] == "Running"]


def test_backoff_limit_per_index_and_max_failed_indexes(cluster):
    # index 0 always exits 75 (counted per index: 1 retry), index 1 succeeds: the Job fails with FailedIndexes
    cluster.create(job("per", """
        import os
        raise SystemExit(75 if os.environ["JOB_COMPLETION_INDEX"] == "0" else 0)
        """, completionMode="Indexed", completions=2, parallelism=2, backoffLimitPerIndex=1, maxFailedIndexes=1,
        podFailurePolicy={"rules": [{"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget"}]},
                                    {"action": "Count", "onExitCodes": {"operator": "In", "values": [75]}}]}))
    assert cluster.wait_job("per", 60) == "Failed"
    st = cluster.job("per")["status"]
    assert st["failedIndexes"] == "0" and st["completedIndexes"] == "1" and st["failed"] == 2
    assert {c["reason"] for c in st["conditions"]} == {"FailedIndexes"}


def test_backoff_limit_counts_sigkilled_pods(cluster):
    cluster.create(job("sleepy", "import time; print('up', flush=True); time.sleep(60)", backoffLimit=1))
    for _n in (1, 2):
        pod = cluster.wait_log("batch.kubernetes.io/job-name=sleepy", "up", 30)
        assert cluster.kill_pod(pod["metadata"]["name"], signal.SIGKILL)
        cluster.wait_for(lambda: cluster.store.get("Pod", "sapd", pod["metadata"]["name"])["status"]["phase"] == "Failed",
                         30, "the killed pod to fail")
        code = cluster.store.get("Pod", "sapd", pod["metadata"]["name"])["status"]["containerStatuses"][0]
        assert code["state"]["terminated"]["exitCode"] == 137
    assert cluster.wait_job("sleepy", 30) == "Failed"
    assert cluster.job("sleepy")["status"]["conditions"][-1]["reason"] == "BackoffLimitExceeded"


def test_a_container_sees_rendered_env_volumes_and_rewritten_paths(cluster, tmp_path):
    cluster.create({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "cfg"},
                    "data": {"job.yaml": "run_root: x\n"}})
    cluster.create_secret("creds", {"KEY": "s3cr3t/&x"})
    cluster.create({"apiVersion": "v1", "kind": "Service", "metadata": {"name": "train"},
                    "spec": {"clusterIP": "None", "selector": {"a": "b"}, "ports": [{"port": 1}]}})
    spec = job("env", """
        import json, os, sys, pathlib
        print(json.dumps({"argv": sys.argv[1:], "cwd": os.getcwd(), "env": dict(os.environ),
                          "cfg": pathlib.Path(sys.argv[1]).read_text()}))
        """, container={
        "args": ["/etc/sapd/config.yaml", "--master-addr=job-0.train", "--out=/scratch/x", "/etc/sapdx"],
        "env": [{"name": "SECRET", "valueFrom": {"secretKeyRef": {"name": "creds", "key": "KEY"}}},
                {"name": "NS", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
                {"name": "RANK", "valueFrom": {"fieldRef": {"fieldPath": "metadata.labels['rank']"}}},
                {"name": "HOME", "value": "/scratch/home"}, {"name": "GREETING", "value": "$(NS)-$$(NS)"},
                # the downward API rounds up (500m is 1 core); an unset limit is the node's allocatable CPU
                {"name": "CPUS", "valueFrom": {"resourceFieldRef": {"resource": "limits.cpu", "divisor": "1"}}},
                {"name": "REQ_MILLI", "valueFrom": {"resourceFieldRef": {"resource": "requests.cpu", "divisor": "1m"}}},
                {"name": "MEM_MI", "valueFrom": {"resourceFieldRef": {"resource": "limits.memory", "divisor": "1Mi"}}}],
        "resources": {"requests": {"cpu": "250m"}, "limits": {"cpu": "500m", "memory": "1Gi"}},
        "volumeMounts": [{"name": "config", "mountPath": "/etc/sapd"}, {"name": "scratch", "mountPath": "/scratch"},
                         {"name": "tmp", "mountPath": "/tmp"}]},
        pod={"volumes": [{"name": "config", "configMap": {"name": "cfg", "items": [{"key": "job.yaml", "path": "config.yaml"}]}},
                         {"name": "scratch", "emptyDir": {}}, {"name": "tmp", "emptyDir": {}}]})
    spec["spec"]["template"]["metadata"] = {"labels": {"rank": "7"}}
    cluster.create(spec)
    assert cluster.wait_job("env", 60) == "Complete", cluster.describe()
    (pod,) = cluster.pods("batch.kubernetes.io/job-name=env")
    seen = json.loads(cluster.logs(pod["metadata"]["name"]).strip().splitlines()[-1])
    vols = cluster.node_root / "pods" / "sapd" / pod["metadata"]["name"] / "volumes"
    assert seen["argv"][0] == f"{vols}/config/config.yaml" and seen["cfg"] == "run_root: x\n"
    assert seen["argv"][1] == "--master-addr=127.0.0.1"  # <pod>.<headless service>
    assert seen["argv"][2] == f"--out={vols}/scratch/x" and seen["argv"][3] == "/etc/sapdx"  # not a mount path
    env = seen["env"]
    assert env["SECRET"] == "s3cr3t/&x" and env["NS"] == "sapd" and env["RANK"] == "7"
    # /tmp: the pod's own folder, through a short link (a Unix socket's path under it must stay under 108 bytes)
    assert env["HOME"] == f"{vols}/scratch/home" and Path(env["TMPDIR"]).resolve() == (vols / "tmp").resolve()
    assert len(env["TMPDIR"]) <= len("/tmp/k8s-12345678") and Path(env["TMPDIR"]).is_symlink()
    assert env["GREETING"] == "sapd-$(NS)"
    assert (env["CPUS"], env["REQ_MILLI"], env["MEM_MI"]) == ("1", "250", "1024")
    assert seen["cwd"].endswith("/rootfs/app")  # the Dockerfile's WORKDIR, on the root filesystem
    assert yaml.safe_load(Path(env["KUBECONFIG"]).read_text())["users"][0]["user"] == {"token": cluster.sa_tokens[("sapd", "default")]}


def test_a_pod_that_writes_to_its_root_filesystem_is_recorded_or_refused(cluster):
    # as root (the image's files are root's) the write lands, and is recorded: a read-only root refuses it
    cluster.create(job("rootfs", "open('cache.txt', 'w').write('x')", pod={"securityContext": {"runAsUser": 0}}))
    assert cluster.wait_job("rootfs", 60) == "Complete"
    assert [path for _, path in cluster.kubelet.rootfs_writes] == ["/app/cache.txt"]
    # as the image's user (1000) it fails at once, as on a node
    cluster.create(job("rootfs-1000", "open('cache.txt', 'w').write('x')", backoffLimit=0))
    assert cluster.wait_job("rootfs-1000", 60) == "Failed"
    (pod,) = cluster.pods("batch.kubernetes.io/job-name=rootfs-1000")
    assert "PermissionError: [Errno 13] Permission denied: 'cache.txt'" in cluster.logs(pod["metadata"]["name"])


def test_read_only_mounts_and_a_read_only_root_filesystem_are_enforced(cluster):
    """As a node mounts them: a volumeMount's readOnly, a claim mounted readOnly and a configMap are read-only
    mounts, and readOnlyRootFilesystem makes every other path read-only (the image's working directory,
    this checkout, the node's /tmp) — EROFS even for root, so it is the mount, not a permission, that stops
    the write; the writable volumes and /dev/shm stay writable."""
    repo = Path(__file__).resolve().parents[2]
    cluster.create({"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": "games"},
                    "spec": {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "1Gi"}}}})
    cluster.create({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "cfg"}, "data": {"a": "1"}})
    targets = {"scratch": "/scratch/f", "ro-mount": "/data/f", "ro-claim": "/games/f", "configmap": "/etc/cfg/f",
               "workdir": "f", "checkout": str(repo / "written-by-a-pod"), "node-tmp": "/tmp/written-by-a-pod",
               "shm": "/dev/shm/written-by-a-pod"}
    script = """
        import json, os, sys
        out = {}
        for what, path in json.loads(sys.argv[1]).items():
            try:
                open(path, "w").write("x")
                out[what] = "written"
                if what == "shm":
                    os.unlink(path)
            except OSError as e:
                out[what] = e.strerror
        print(json.dumps(out))
        """
    pod = {"securityContext": {"runAsUser": 0},
           "volumes": [{"name": "scratch", "emptyDir": {}}, {"name": "data", "emptyDir": {}},
                       {"name": "games", "persistentVolumeClaim": {"claimName": "games", "readOnly": True}},
                       {"name": "cfg", "configMap": {"name": "cfg"}}]}
    mounts = [{"name": "scratch", "mountPath": "/scratch"}, {"name": "data", "mountPath": "/data", "readOnly": True},
              {"name": "games", "mountPath": "/games"}, {"name": "cfg", "mountPath": "/etc/cfg"}]
    cluster.create(job("ro", script, pod=pod, container={"args": [json.dumps(targets)], "volumeMounts": mounts,
                                                         "securityContext": {"readOnlyRootFilesystem": True}}))
    assert cluster.wait_job("ro", 60) == "Complete", cluster.describe()
    (p,) = cluster.pods("batch.kubernetes.io/job-name=ro")
    seen = json.loads(cluster.logs(p["metadata"]["name"]).strip().splitlines()[-1])
    ro = "Read-only file system"
    assert seen == {"scratch": "written", "ro-mount": ro, "ro-claim": ro, "configmap": ro, "workdir": ro,
                    "checkout": ro, "node-tmp": ro, "shm": "written"}, seen
    assert not (repo / "written-by-a-pod").exists() and not Path("/tmp/written-by-a-pod").exists()
    assert cluster.kubelet.rootfs_writes == []
    # the same pod without readOnlyRootFilesystem: only the read-only mounts refuse (the workdir is the image's
    # writable layer, recorded; the checkout and the node's /tmp are not the pod's to reach: a container
    # does not see them, and this one is not run with them read-only, so it does not try them)
    targets = {k: v for k, v in targets.items() if k not in ("checkout", "node-tmp")}
    cluster.create(job("rw", script, pod=pod, container={"args": [json.dumps(targets)], "volumeMounts": mounts}))
    assert cluster.wait_job("rw", 60) == "Complete", cluster.describe()
    (p,) = cluster.pods("batch.kubernetes.io/job-name=rw")
    seen = json.loads(cluster.logs(p["metadata"]["name"]).strip().splitlines()[-1])
    assert seen == {"scratch": "written", "ro-mount": ro, "ro-claim": ro, "configmap": ro, "workdir": "written",
                    "shm": "written"}, seen
    assert [path for pod_name, path in cluster.kubelet.rootfs_writes] == ["/app/f"]


def test_a_missing_secret_keeps_the_pod_pending_and_a_gpu_request_unschedulable(cluster):
    cluster.create(job("nosecret", "print(1)", container={
        "env": [{"name": "X", "valueFrom": {"secretKeyRef": {"name": "absent", "key": "k"}}}]}))
    cluster.create(job("gpu", "print(1)", container={"resources": {"limits": {"nvidia.com/gpu": 1}}}))
    p = cluster.wait_pod("batch.kubernetes.io/job-name=nosecret", lambda p: "absent" in p["status"].get("message", ""), 30)
    assert p["status"]["phase"] == "Pending"
    g = cluster.wait_pod("batch.kubernetes.io/job-name=gpu", lambda p: p["status"].get("conditions"), 30)
    assert g["status"]["conditions"][0]["reason"] == "Unschedulable"
    cluster.create_secret("absent", {"k": "v"})
    assert cluster.wait_job("nosecret", 60) == "Complete"


def test_api_server_authenticates_authorizes_and_validates(cluster):
    import ssl
    import urllib.error
    import urllib.request

    def call(method, path, body=None, token=cluster.admin_token):
        req = urllib.request.Request(cluster.api.url + path, method=method, data=json.dumps(body).encode() if body else None,
                                     headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, context=ssl.create_default_context(cafile=str(cluster.ca))) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())
    # strict validation: an unknown field is refused (the typed client would refuse it before sending)
    code, status = call("POST", "/apis/batch/v1/namespaces/sapd/jobs?fieldValidation=Strict",
                        {**job("bad", "print(1)"), "spec": {"templat": {}}})
    assert code == 422 and "templat" in status["message"]
    assert call("GET", "/apis/batch/v1/namespaces/sapd/jobs", token="nope")[0] == 401
    # a ServiceAccount may do only what its Role allows (here: read jobs, not list pods)
    cluster.create({"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "reader"}})
    cluster.create({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role", "metadata": {"name": "reader"},
                    "rules": [{"apiGroups": ["batch"], "resources": ["jobs"], "verbs": ["get"]}]})
    cluster.create({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding", "metadata": {"name": "reader"},
                    "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "reader"},
                    "subjects": [{"kind": "ServiceAccount", "name": "reader", "namespace": "sapd"}]})
    cluster.create(job("probe", """
        from kubernetes import client, config
        config.load_kube_config()
        print("job", client.BatchV1Api().read_namespaced_job("probe", "sapd").metadata.name)
        try:
            client.CoreV1Api().list_namespaced_pod("sapd")
        except client.exceptions.ApiException as e:
            print("pods", e.status)
        """, pod={"serviceAccountName": "reader"}))
    assert cluster.wait_job("probe", 90) == "Complete", cluster.describe()
    out = cluster.logs(cluster.pods("batch.kubernetes.io/job-name=probe")[0]["metadata"]["name"])
    assert "job probe" in out and "pods 403" in out
    assert ("system:serviceaccount:sapd:reader", "GET", "/api/v1/namespaces/sapd/pods", 403) in cluster.api.requests


def test_helm_upgrade_refuses_an_immutable_change_and_keeps_resource_policy_keep(cluster, tmp_path):
    chart = tmp_path / "c"
    (chart / "templates").mkdir(parents=True)
    (chart / "Chart.yaml").write_text("apiVersion: v2\nname: c\nversion: 0.1.0\n")
    (chart / "values.yaml").write_text("cmd: a\nkept: true\n")
    (chart / "templates" / "job.yaml").write_text(textwrap.dedent(f"""\
        apiVersion: batch/v1
        kind: Job
        metadata: {{name: {{{{ .Release.Name }}}}-job}}
        spec:
          template:
            spec:
              restartPolicy: Never
              containers: [{{name: m, image: {IMAGE}, command: [python, -c, "print('{{{{ .Values.cmd }}}}')"]}}]
        {{{{- if .Values.kept }}}}
        ---
        apiVersion: v1
        kind: ConfigMap
        metadata: {{name: kept, annotations: {{helm.sh/resource-policy: keep}}}}
        {{{{- end }}}}
        """))
    cluster.helm.install("r", chart)
    assert cluster.wait_job("r-job", 60) == "Complete"
    with pytest.raises(HelmError, match="field is immutable"):
        cluster.helm.upgrade("r", set_values=["cmd=b"])
    cluster.helm.upgrade("r", set_values=["kept=false"])  # the ConfigMap is no longer rendered, but kept
    assert cluster.store.get("ConfigMap", "sapd", "kept") is not None
    assert cluster.job("r-job")["metadata"]["annotations"]["meta.helm.sh/release-name"] == "r"


def test_helm_upgrade_to_another_chart_and_uninstall_hooks(cluster, tmp_path):
    """`helm upgrade r NEWCHART` renders the next revision from the other chart; `helm uninstall` runs the
    pre-delete hooks while the release's objects exist, deletes them, then runs the post-delete hooks (which
    find them gone), and removes hooks that succeeded (hook-delete-policy hook-succeeded)."""
    cluster.host_path("/var/hooks", owner=(1000, 1000))

    def chart(folder: str, version: str) -> Path:
        c = tmp_path / folder
        (c / "templates").mkdir(parents=True)
        (c / "Chart.yaml").write_text(f"apiVersion: v2\nname: c\nversion: {version}\n")
        (c / "templates" / "cm.yaml").write_text(
            "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: settings, labels: {chart: '{{ .Chart.Version }}'}}\n"
            "data: {said: hello}\n")
        hooks = []
        for event in ("pre-delete", "post-delete"):
            script = (f"import os; p='/cfg/said'; open('/hooks/log', 'a').write('{event}: ' + "
                      "(open(p).read() if os.path.exists(p) else 'gone') + chr(10))")
            hooks.append(yaml.safe_dump({
                "apiVersion": "batch/v1", "kind": "Job",
                "metadata": {"name": event, "annotations": {"helm.sh/hook": event,
                                                            "helm.sh/hook-delete-policy": "hook-succeeded"}},
                "spec": {"template": {"spec": {
                    "restartPolicy": "Never",
                    "volumes": [{"name": "cfg", "configMap": {"name": "settings", "optional": True}},
                                {"name": "hooks", "hostPath": {"path": "/var/hooks"}}],
                    "containers": [{"name": "m", "image": IMAGE, "command": ["python", "-c", script],
                                    "volumeMounts": [{"name": "cfg", "mountPath": "/cfg"},
                                                     {"name": "hooks", "mountPath": "/hooks"}]}]}}}}))
        if version != "0.1.0":
            (c / "templates" / "hooks.yaml").write_text("---\n".join(hooks))
        return c

    cluster.helm.install("r", chart("v1", "0.1.0"))
    assert cluster.store.get("ConfigMap", "sapd", "settings")["metadata"]["labels"]["chart"] == "0.1.0"
    rel = cluster.helm.upgrade("r", chart("v2", "0.2.0"))
    assert rel.revision == 2 and rel.chart == tmp_path / "v2"
    assert cluster.store.get("ConfigMap", "sapd", "settings")["metadata"]["labels"]["chart"] == "0.2.0"
    assert cluster.helm.uninstall("r") == [("pre-delete", "Complete"), ("post-delete", "Complete")]
    assert (cluster.host_path("/var/hooks") / "log").read_text() == "pre-delete: hello\npost-delete: gone\n"
    assert cluster.store.get("ConfigMap", "sapd", "settings") is None and "r" not in cluster.helm.releases
    cluster.wait_for(lambda: not cluster.store.list("Job", "sapd"), 30, "the succeeded hooks to be deleted")


def test_pods_run_as_their_user_with_a_nodes_volume_permissions(cluster):
    """runAsUser/runAsGroup/fsGroup as a kubelet applies them: emptyDir and a ReadWriteOnce claim are
    writable through fsGroup; a hostPath the kubelet creates (root's, 0755) and a ReadWriteMany claim
    (no fsGroup) are not; a configMap is read-only."""
    for name, mode in (("rwo", "ReadWriteOnce"), ("rwx", "ReadWriteMany")):
        cluster.create({"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": name},
                        "spec": {"accessModes": [mode], "resources": {"requests": {"storage": "1Gi"}}}})
    cluster.create({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "cfg"}, "data": {"a": "1"}})
    vols = {"scratch": {"emptyDir": {}}, "node": {"hostPath": {"path": "/var/new-cache", "type": "DirectoryOrCreate"}},
            "rwo": {"persistentVolumeClaim": {"claimName": "rwo"}}, "rwx": {"persistentVolumeClaim": {"claimName": "rwx"}},
            "cfg": {"configMap": {"name": "cfg"}}}
    cluster.create(job("who", """
        import json, os, sys
        out = {"uid": os.getuid(), "gid": os.getgid(), "groups": sorted(os.getgroups())}
        for v, path in zip(("scratch", "node", "rwo", "rwx", "cfg"), sys.argv[1:]):
            try:
                open(path, "w").write("x")
                out[v] = "written"
            except OSError as e:
                out[v] = e.strerror
        print(json.dumps(out))
        """, pod={"securityContext": {"runAsUser": 1000, "runAsGroup": 3000, "fsGroup": 2000, "supplementalGroups": [4000]},
                  "volumes": [{"name": n, **v} for n, v in vols.items()]},
        container={"volumeMounts": [{"name": n, "mountPath": f"/v/{n}"} for n in vols],
                   "args": [f"/v/{n}/f" for n in vols]}))
    assert cluster.wait_job("who", 60) == "Complete", cluster.describe()
    (pod,) = cluster.pods("batch.kubernetes.io/job-name=who")
    seen = json.loads(cluster.logs(pod["metadata"]["name"]).strip().splitlines()[-1])
    assert seen == {"uid": 1000, "gid": 3000, "groups": [2000, 3000, 4000], "scratch": "written",
                    "node": "Permission denied", "rwo": "written", "rwx": "Permission denied",
                    "cfg": "Read-only file system"}  # a configMap is mounted read-only, as on a node
    node = cluster.host_path("/var/new-cache")
    assert (node.stat().st_uid, oct(node.stat().st_mode & 0o777)) == (0, "0o755")
    # a pod that must write there fails, as on a node, until the node's admin hands the folder over
    write = "open('/cache/x', 'w').write('x')"
    mount = {"volumeMounts": [{"name": "node", "mountPath": "/cache"}]}
    cluster.create(job("must-write", write, backoffLimit=0, pod={"volumes": [{"name": "node", **vols["node"]}]},
                       container=mount))
    assert cluster.wait_job("must-write", 60) == "Failed"
    cluster.host_path("/var/new-cache", owner=(1000, 1000))
    cluster.create(job("must-write-2", write, backoffLimit=0, pod={"volumes": [{"name": "node", **vols["node"]}]},
                       container=mount))
    assert cluster.wait_job("must-write-2", 60) == "Complete"
    # runAsNonRoot with root: the container is never started
    cluster.create(job("nonroot", "print(1)", pod={"securityContext": {"runAsUser": 0, "runAsNonRoot": True}}))
    p = cluster.wait_pod("batch.kubernetes.io/job-name=nonroot", lambda p: p["status"].get("message"), 30)
    assert p["status"]["phase"] == "Pending" and "runAsNonRoot" in p["status"]["message"]


PROBE = """
import json, os, sys, time
out = {"argv": sys.argv, "path0": sys.path[0], "cwd": os.getcwd(), "uid": os.getuid(), "gid": os.getgid(),
       "groups": sorted(os.getgroups()), "env": os.environ.get("GREETING"), "main": __name__,
       "leader": os.getsid(0) == os.getpid() == os.getpgid(0), "warm": "torch" in sys.modules}
try:
    open(os.path.join(os.environ["PYTHONPATH"], "written-by-a-pod"), "w").write("x")  # the checkout: the root
except OSError as e:
    out["root"] = e.strerror
print(json.dumps(out), flush=True)
if sys.argv[1] == "wait":
    print("up", flush=True)
    time.sleep(60)
sys.exit(int(sys.argv[1]))
"""


def test_a_python_module_pod_forks_from_a_warm_process_and_is_the_same_container(cluster, monkeypatch):
    """Every stage pod is `python -m MODULE …`: the kubelet forks it from a zygote of its image environment that
    has imported torch (tests/k8s_harness/zygote.py) instead of importing it afresh. What the container is stays
    as the sandbox makes it: its user and groups, its read-only root, its environment, its working directory
    first on sys.path and its module as __main__, a session of its own, its exit code; a signal ends it as it
    ends any process (SIGTERM: 143); its CPU seconds are charged to the test process."""
    from tests.k8s_harness import kubelet
    from tests.k8s_harness.zygote import ForkedProcess, Zygotes
    # zygotes of this test's own (the test process's may all be serving other clusters' pods: then a pod starts
    # afresh, as it may)
    zygotes = Zygotes()
    monkeypatch.setattr(kubelet, "ZYGOTES", zygotes)
    charged = ForkedProcess.cpu_seconds
    cluster.create({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "probe"}, "data": {"probe.py": PROBE}})
    pod = {"securityContext": {"runAsUser": 1000, "runAsGroup": 3000, "fsGroup": 2000},
           "volumes": [{"name": "probe", "configMap": {"name": "probe"}}]}
    container = {"command": ["python", "-m", "probe"], "workingDir": "/probe",
                 "env": [{"name": "GREETING", "value": "hello"}], "securityContext": {"readOnlyRootFilesystem": True},
                 "volumeMounts": [{"name": "probe", "mountPath": "/probe"}]}
    cluster.create(job("mod", "", backoffLimit=0, pod=pod, container={**container, "args": ["3"]}))
    cluster.create(job("mod-wait", "", backoffLimit=0, pod=pod, container={**container, "args": ["wait"]}))
    assert cluster.wait_job("mod", 120) == "Failed", cluster.describe()
    (p,) = cluster.pods("batch.kubernetes.io/job-name=mod")
    seen = json.loads(cluster.logs(p["metadata"]["name"]).strip().splitlines()[-1])
    probe_dir = cluster.node_root / "pods" / "sapd" / p["metadata"]["name"] / "volumes" / "probe"
    assert seen == {"argv": [f"{probe_dir}/probe.py", "3"], "path0": str(probe_dir), "cwd": str(probe_dir),
                    "uid": 1000, "gid": 3000, "groups": [2000, 3000], "env": "hello", "main": "__main__",
                    "leader": True, "warm": True, "root": "Read-only file system"}, seen
    assert p["status"]["containerStatuses"][0]["state"]["terminated"]["exitCode"] == 3
    waiting = cluster.wait_log("batch.kubernetes.io/job-name=mod-wait", "up", 60)
    assert cluster.kill_pod(waiting["metadata"]["name"], signal.SIGTERM)
    assert cluster.wait_job("mod-wait", 60) == "Failed"
    state = cluster.store.get("Pod", "sapd", waiting["metadata"]["name"])["status"]["containerStatuses"][0]["state"]
    assert state["terminated"]["exitCode"] == 143
    assert ForkedProcess.cpu_seconds > charged  # their CPU is the test's (tests/conftest.py, the durations table)
    # one zygote served both (S3 credentials and the torch extensions folder are read when used: not its settings)
    assert len(zygotes.servers) == 1
    zygotes.stop()


def test_zygotes_are_keyed_by_start_up_settings_and_idle_ones_give_way(tmp_path):
    """A zygote serves the pods whose start-up settings (what the interpreter and the preloaded libraries read at
    start: thread counts, PYTHON*, PATH) are its own; per-pod values read later (credentials, caches) do not
    start another. Past its limit, one idle for a while and without a running child gives way; a busy one
    never does (it carries its children's exit statuses)."""
    import sys

    from tests.k8s_harness.zygote import Zygotes, startup_env
    env = {"PATH": f"{Path(sys.prefix) / 'bin'}:/usr/bin:/bin", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
           "AWS_SECRET_ACCESS_KEY": "a", "TORCH_EXTENSIONS_DIR": "/x", "HF_HOME": "/h", "HOME": "/home/x"}
    assert startup_env(env) == {k: env[k] for k in ("PATH", "OMP_NUM_THREADS", "PYTHONUNBUFFERED")}
    zygotes = Zygotes()
    zygotes.LIMIT, zygotes.IDLE_SECONDS = 1, 0.0
    try:
        spec = {"mounts": [], "read_only_root": False, "cwd": str(tmp_path)}
        first = zygotes.spawn(["python", "-m", "this"], {**env, "AWS_SECRET_ACCESS_KEY": "b"}, spec, tmp_path / "a.log")
        assert first is not None and first.wait(60) == 0 and "Zen of Python" in (tmp_path / "a.log").read_text()
        sleeper = zygotes.spawn(["python", "-m", "timeit", "-n", "1", "-r", "1", "import time; time.sleep(4)"],
                                {**env, "HOME": "/home/y"}, spec, tmp_path / "b.log")
        assert sleeper is not None and len(zygotes.servers) == 1  # the same zygote
        two = {**env, "OMP_NUM_THREADS": "2"}
        assert zygotes.spawn(["python", "-m", "this"], two, spec, tmp_path / "c.log") is None  # it is busy: afresh
        assert sleeper.wait(60) == 0
        other = zygotes.spawn(["python", "-m", "this"], two, spec, tmp_path / "c.log")
        assert other is not None and other.wait(60) == 0  # the idle one gave way
        assert [dict(k[1])["OMP_NUM_THREADS"] for k in zygotes.servers] == ["2"]
        busy = zygotes.spawn(["python", "-c", "pass"], env, spec, tmp_path / "d.log")
        assert busy is None  # not `python -m` / torchrun: started afresh by the kubelet
    finally:
        zygotes.stop()


def test_each_image_target_runs_in_its_own_environment(cluster):
    """cpu has TextWorld and no vLLM; gpu has vLLM (its CPU build here) and no TextWorld; eval has both
    and ALFWorld — each from the Dockerfile's install script, not from the test's environment."""
    probe = """
        import importlib.util, json, sys
        print(json.dumps({"prefix": sys.prefix, **{m: importlib.util.find_spec(m) is not None
                          for m in ("textworld", "alfworld", "bm25s", "vllm", "deepspeed", "pytest_timeout")}}))
        """
    for target in ("cpu", "gpu", "eval"):
        cluster.create(job(f"env-{target}", probe, container={"image": f"ghcr.io/sapd/sapd:0.1.0-{target}"}))
    seen = {}
    for target in ("cpu", "gpu", "eval"):
        assert cluster.wait_job(f"env-{target}", 120) == "Complete", cluster.describe()
        (pod,) = cluster.pods(f"batch.kubernetes.io/job-name=env-{target}")
        seen[target] = json.loads(cluster.logs(pod["metadata"]["name"]).strip().splitlines()[-1])
    assert seen["cpu"]["prefix"].endswith("/.cache/images/cpu")
    assert seen["eval"]["prefix"].endswith("/.cache/images/eval") and seen["gpu"]["prefix"].endswith("/.cache/images/gpu")
    assert Path(seen["gpu"]["prefix"]).resolve().name == ".venv-vllm"  # the gpu environment is .venv-vllm
    has = {t: {m for m, v in s.items() if v is True} for t, s in seen.items()}
    assert has == {"cpu": {"textworld", "bm25s", "deepspeed"}, "gpu": {"vllm", "deepspeed"},
                   "eval": {"textworld", "alfworld", "bm25s", "vllm", "deepspeed"}}


def test_real_kubectl_creates_gets_describes_and_reads_logs(cluster):
    """The real kubectl (1.32) against the API server: discovery, Job defaulting (selector, template
    labels), Tables, events, logs by Job and by selector, and `create job --from=cronjob/…`, whose Job
    kubectl sends as protobuf."""
    version = json.loads(cluster.kubectl("version", "-o", "json"))
    assert version["serverVersion"]["gitVersion"] == "v1.33.0"
    spec = job("hello", "print('line 1'); print('line 2')")
    assert cluster.kubectl("create", "--validate=false", "-f", "-", input=json.dumps(spec)).strip() == "job.batch/hello created"
    assert cluster.wait_job("hello", 60) == "Complete", cluster.describe()
    j = cluster.job("hello")
    uid = j["metadata"]["uid"]
    assert j["spec"]["selector"] == {"matchLabels": {"batch.kubernetes.io/controller-uid": uid}}
    assert j["spec"]["template"]["metadata"]["labels"]["batch.kubernetes.io/job-name"] == "hello"
    assert (j["spec"]["completions"], j["spec"]["parallelism"], j["spec"]["backoffLimit"]) == (1, 1, 6)
    table = cluster.kubectl("get", "jobs").splitlines()
    assert table[0].split() == ["NAME", "STATUS", "COMPLETIONS", "DURATION", "AGE"]
    assert table[1].split()[:3] == ["hello", "Complete", "1/1"]
    pods = cluster.kubectl("get", "pods", "-l", "batch.kubernetes.io/job-name=hello").splitlines()
    assert pods[0].split() == ["NAME", "READY", "STATUS", "RESTARTS", "AGE"] and pods[1].split()[1:4] == ["0/1", "Completed", "0"]
    assert cluster.kubectl("logs", "job/hello") == "line 1\nline 2\n"
    assert cluster.kubectl("logs", "-l", "job-name=hello", "--tail=1") == "line 2\n"
    described = cluster.kubectl("describe", "job", "hello")
    assert re.search(rf"Selector: +batch.kubernetes.io/controller-uid={uid}\n", described), described
    assert re.search(r"Pods Statuses: +0 Active \(0 Ready\) / 1 Succeeded / 0 Failed", described), described
    assert "CompletionsReached" in described  # the controller's event
    cluster.create({"apiVersion": "batch/v1", "kind": "CronJob", "metadata": {"name": "tick"},
                    "spec": {"schedule": "0 * * * *", "jobTemplate": {"spec": job("x", "print('tick')")["spec"]}}})
    assert cluster.kubectl("get", "cronjobs").split()[:9] == ["NAME", "SCHEDULE", "TIMEZONE", "SUSPEND", "ACTIVE",
                                                              "LAST", "SCHEDULE", "AGE", "tick"]
    assert cluster.kubectl("create", "job", "--from=cronjob/tick", "tick-now").strip() == "job.batch/tick-now created"
    assert cluster.wait_job("tick-now", 60) == "Complete" and cluster.kubectl("logs", "job/tick-now") == "tick\n"
    assert [r for r in cluster.api.requests if r[1:3] == ("POST", "/apis/batch/v1/namespaces/sapd/jobs")][-1][3] == 201


def test_a_protobuf_job_is_stored_as_kubectls_own_json_of_it_would_be(cluster):
    """kubectl sends `create job --from=cronjob/…` as protobuf (runtime.Unknown + batch/v1 Job), decoded with
    the schema inside the kubectl binary: the stored Job is the one `kubectl create -f` stores from
    kubectl's own JSON of the same command (`--dry-run=client -o json`) — pointer fields at zero kept
    (backoffLimit 0, suspend false), inlined structs (volume sources, config map references),
    quantities, int-or-strings, maps — and a body that is not the envelope is refused with 400."""
    container = {"name": "main", "image": IMAGE, "command": ["python", "-c", "print('tock')"], "workingDir": "/tmp",
                 "resources": {"requests": {"cpu": "250m", "memory": "1Gi", "nvidia.com/gpu": "0"},
                               "limits": {"cpu": "1", "memory": "2Gi", "ephemeral-storage": "1Gi"}},
                 "env": [{"name": "EMPTY", "value": ""}, {"name": "POD", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
                         {"name": "CM", "valueFrom": {"configMapKeyRef": {"name": "cm", "key": "k", "optional": True}}}],
                 "ports": [{"name": "metrics", "containerPort": 9400}],
                 "volumeMounts": [{"name": "scratch", "mountPath": "/tmp"}, {"name": "cfg", "mountPath": "/etc/cfg", "readOnly": True}],
                 "readinessProbe": {"httpGet": {"path": "/", "port": "metrics"}, "periodSeconds": 5},
                 "securityContext": {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                                     "capabilities": {"drop": ["ALL"]}}}
    template = {"metadata": {"labels": {"app": "tock"}, "annotations": {"note": "x"}},
                "spec": {"backoffLimit": 0, "suspend": False, "activeDeadlineSeconds": 600, "ttlSecondsAfterFinished": 60,
                         "podFailurePolicy": {"rules": [{"action": "FailJob", "onExitCodes": {"operator": "In", "values": [2]}},
                                                        {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget"}]}]},
                         "template": {"metadata": {"labels": {"app": "tock"}},
                                      "spec": {"restartPolicy": "Never", "terminationGracePeriodSeconds": 30,
                                               "securityContext": {"runAsUser": 1000, "runAsGroup": 1000, "fsGroup": 1000,
                                                                   "runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}},
                                               "volumes": [{"name": "scratch", "emptyDir": {"sizeLimit": "1Gi"}},
                                                           {"name": "cfg", "configMap": {"name": "cm", "optional": True,
                                                                                         "defaultMode": 0o444}}],
                                               "containers": [container]}}}}
    cluster.create({"apiVersion": "batch/v1", "kind": "CronJob", "metadata": {"name": "tock"},
                    "spec": {"schedule": "0 * * * *", "jobTemplate": template}})
    own_json = json.loads(cluster.kubectl("create", "job", "--from=cronjob/tock", "tock-json", "--dry-run=client", "-o", "json"))
    cluster.kubectl("create", "job", "--from=cronjob/tock", "tock-proto")
    cluster.kubectl("create", "--validate=false", "-f", "-", input=json.dumps(own_json))

    def stored(name: str) -> dict:
        j = json.loads(json.dumps(cluster.job(name)).replace(name, "NAME").replace(cluster.job(name)["metadata"]["uid"], "UID"))
        return {"metadata": {k: v for k, v in j["metadata"].items() if k not in ("creationTimestamp", "resourceVersion")},
                "spec": j["spec"]}
    assert stored("tock-proto") == stored("tock-json")
    assert stored("tock-proto")["spec"]["backoffLimit"] == 0 and stored("tock-proto")["spec"]["suspend"] is False
    vols = stored("tock-proto")["spec"]["template"]["spec"]["volumes"]
    assert vols[1] == {"name": "cfg", "configMap": {"name": "cm", "optional": True, "defaultMode": 0o444}}
    posts = [r for r in cluster.api.requests if r[1] == "POST" and r[2].endswith("/jobs")]
    assert [r[3] for r in posts[-2:]] == [201, 201]
    assert cluster.wait_job("tock-proto", 60) == "Complete", cluster.describe()
    # not the envelope: 400 with the reason, not a guess
    req = urllib.request.Request(f"{cluster.api.url}/apis/batch/v1/namespaces/sapd/jobs", data=b"\x0a\x03abc", method="POST",
                                 headers={"Content-Type": MEDIA_TYPE, "Authorization": f"Bearer {cluster.admin_token}"})
    ctx = ssl.create_default_context(cafile=str(cluster.ca))
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, context=ctx)
    assert e.value.code == 400 and "'k8s\\x00' magic" in json.loads(e.value.read())["message"]


def test_queue_admission_keeps_jobs_suspended_until_their_quota_frees(tmp_path):
    """A Kueue-like admission: two Jobs of queue `team` (quota: 1 CPU) each asking 1 CPU run one after
    the other; a Job for a queue the cluster lacks waits; an unlabelled Job runs at once."""
    c = Cluster(tmp_path / "cluster", backoff_base_seconds=0.05, max_grace_seconds=2,
                queues={"team": {"cpu": "1"}}).start()
    try:
        one_cpu = {"resources": {"requests": {"cpu": "1"}, "limits": {"cpu": "1"}}}
        for name, queue in (("first", "team"), ("second", "team"), ("lost", "nope"), ("free", None)):
            spec = job(name, "import time; time.sleep(1.5)", container=one_cpu)
            if queue:
                spec["metadata"]["labels"] = {"kueue.x-k8s.io/queue-name": queue}
            c.create(spec)
        assert c.wait_job("first", 60) == "Complete" and c.wait_job("free", 60) == "Complete"
        assert c.wait_job("second", 60) == "Complete", c.describe()
        first, second = c.job("first")["status"], c.job("second")["status"]
        assert second["startTime"] >= first["completionTime"]  # admitted only once `first` was done
        assert c.job("lost")["spec"]["suspend"] is True and c.pods("batch.kubernetes.io/job-name=lost") == []
        rows = {r.split()[0]: r.split()[1] for r in c.kubectl("get", "jobs").splitlines()[1:]}
        assert rows == {"first": "Complete", "second": "Complete", "lost": "Suspended", "free": "Complete"}
        reasons = [e["reason"] for e in c.store.events if e["name"] == "second"]
        assert reasons.index("Suspended") < reasons.index("QuotaReserved") < reasons.index("Resumed")
    finally:
        c.stop()


def test_a_write_that_changes_nothing_is_no_change_and_the_controllers_sleep_through_it(cluster):
    """As on an API server, a status write equal to what is stored keeps its resourceVersion; the store's version
    moves only on a change, and the garbage collector and the Job controller skip a tick in which it did not
    (the Job controller still wakes for its clocks)."""
    from tests.k8s_harness.store import Store
    store = Store()
    store.create({"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "j"}, "spec": {}}, "sapd")
    rv, version = store.get("Job", "sapd", "j")["metadata"]["resourceVersion"], store.version
    store.mutate("Job", "sapd", "j", lambda o: o["status"].update(active=0) if "active" in o["status"] else None)
    assert (store.get("Job", "sapd", "j")["metadata"]["resourceVersion"], store.version) == (rv, version)
    store.mutate("Job", "sapd", "j", lambda o: o["status"].update(active=1))
    assert store.get("Job", "sapd", "j")["metadata"]["resourceVersion"] != rv and store.version == version + 1
    # the running cluster's controllers: idle between changes, awake after one
    listed = []
    real_list = cluster.store.list
    cluster.store.list = lambda *a, **k: (listed.append(a[0]), real_list(*a, **k))[1]  # type: ignore[method-assign]
    try:
        time.sleep(1.0)
        quiet = listed.count("Job")
        assert quiet <= 1.0 / cluster.jobs.TIMER_SECONDS + 2  # its clocks only, not every 0.05 s tick (20)
        cluster.create(job("wake", "pass"))
        assert cluster.wait_job("wake", 60) == "Complete"
    finally:
        cluster.store.list = real_list  # type: ignore[method-assign]


def test_a_failed_clusters_description_ends_with_why_each_failed_pod_ended():
    """``Cluster.describe()`` (a failed journey's message) ends with the lines of each failed pod's log that say
    why it ended, where a CI log cut to its tail still shows them; a pod that succeeded adds none."""
    from types import SimpleNamespace

    pods = [{"metadata": {"name": "train-1"}, "status": {"phase": "Failed"}},
            {"metadata": {"name": "train-0"}, "status": {"phase": "Succeeded"}}]
    logs = {"train-1": "step 3\nterminate called after throwing an instance of 'gloo::IoException'\n  what():  reset\nbye",
            "train-0": "ValueError: not shown"}
    fake = SimpleNamespace(namespace="sapd", get_jobs_table=lambda: "JOBS", errors=[], logs=logs.__getitem__,
                           store=SimpleNamespace(list=lambda kind, ns: pods, events=[]))
    assert Cluster.describe(fake).splitlines()[-2:] == [  # type: ignore[arg-type]
        "why train-1 failed: terminate called after throwing an instance of 'gloo::IoException'",
        "why train-1 failed: what():  reset"]
