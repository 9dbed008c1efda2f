"""The Helm chart (charts/sapd) and the install-once manifests (manifests/), without a cluster.

Every values set (the base and each overlay under values/) is rendered and linted strictly with the
Helm 4 library (PyPI ``helm-python-sdk``, libhelm_c through ctypes: no helm binary), in both modes
(the default `pipeline`, whose stage Jobs are the driver's templates, and `manual`, whose gate Jobs create
them from the same templates), and every rendered document is validated with ``kubernetes-validate`` in
strict mode (unknown fields are errors) against the lowest Kubernetes minor of the chart's `kubeVersion`
and the newest one it ships schemas for; JobSets against the vendored JobSet CRD schema.
How the chart behaves on a cluster is tests/cluster/test_journeys.py's subject.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import helm_python as helm
import kubernetes_validate
import pytest
import yaml

from sapd.config import load_config
from tests.k8s_harness.apiserver import ApiError, ApiServer, crd_schema, validate_crd
from tests.k8s_harness.helm import deep_merge
from tests.k8s_harness.store import BY_KIND

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "sapd"
MANIFESTS = REPO / "manifests"
KUBE_VERSION = kubernetes_validate.utils.latest_version()  # "1.37.0" with kubernetes-validate 1.37
# the declared range's lowest minor (Chart.yaml kubeVersion ">=1.31.0-0") and the newest: 1.31-1.34's
# schemas require fields that later ones default (podFailurePolicy onPodConditions `status`)
LOWEST_KUBE = re.search(r"(\d+\.\d+)", yaml.safe_load((CHART / "Chart.yaml").read_text())["kubeVersion"]).group(1) + ".0"
KUBE_VERSIONS = [LOWEST_KUBE, KUBE_VERSION]
OVERLAYS = ["alfworld", "webshop", "searchqa", "textworld", "smoke"]
VALUE_SETS = ["base", *OVERLAYS]
GPU = "nvidia.com/gpu"
ROUND_PLACEHOLDER = "__SAPD_ROUND__"  # what the pipeline driver replaces in its stage templates
ROUNDS_PLACEHOLDER = "__SAPD_ROUNDS__"  # … and the rounds a (persistent) stage Job serves
STAGES = ("build-prefixes", "teacher-scores", "train", "evaluate")
JOBSET_SCHEMA = crd_schema(BY_KIND["JobSet"])


def overlay_values(name: str) -> dict:
    if name == "base":
        return {}
    return helm.values_from_yaml((CHART / "values" / f"{name}.yaml").read_text())


def render_files(values: dict, release: str = "sapd-test", revision: int = 1) -> dict[str, str]:
    with helm.Chart.load(CHART) as chart:
        return chart.render(values=values, name=release, namespace="sapd", revision=revision, is_install=revision == 1,
                            is_upgrade=revision > 1)


def render(values: dict, release: str = "sapd-test", with_templates: bool = True, revision: int = 1,
           round_: int = 0) -> list[dict]:
    """Every rendered document (hooks included, NOTES.txt not); in pipeline mode the stage Jobs the
    driver creates (the pipeline-templates ConfigMap's entries, round `round_` filled in) are appended,
    so each check below covers the Jobs the driver creates as well as those Helm creates."""
    out = render_files(values, release, revision)
    docs = [d for path, text in out.items() if not path.endswith("NOTES.txt") for d in yaml.safe_load_all(text) if d]
    if with_templates:
        docs += [d for _, d in stage_templates(docs, round_)]
    return docs


def stage_templates(docs: list[dict], round_: int = 0) -> list[tuple[str, dict]]:
    found = [d for d in docs if d["kind"] == "ConfigMap"
             and d["metadata"]["labels"]["app.kubernetes.io/component"] == "pipeline-templates"]
    return [(key.removesuffix(".yaml"), yaml.safe_load(text.replace(ROUND_PLACEHOLDER, str(round_))
                                                       .replace(ROUNDS_PLACEHOLDER, "1")))
            for cm in found for key, text in sorted(cm["data"].items())]


def manual(values: dict) -> dict:
    return {**values, "mode": "manual"}


@pytest.fixture(scope="module", params=[(v, m) for v in VALUE_SETS for m in ("pipeline", "manual")],
                ids=lambda p: f"{p[0]}-{p[1]}")
def rendered(request) -> tuple[str, list[dict]]:
    name, mode = request.param
    values = overlay_values(name)
    return f"{name}-{mode}", render(manual(values) if mode == "manual" else values)


def by_kind(docs: list[dict], kind: str) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def job(docs: list[dict], component: str) -> dict:
    found = [d for d in docs if d["kind"] in ("Job", "JobSet")
             and d["metadata"]["labels"]["app.kubernetes.io/component"] == component]
    assert len(found) == 1, (component, [d["metadata"]["name"] for d in found])
    return found[0]


def container(job_spec: dict) -> dict:
    (c,) = job_spec["template"]["spec"]["containers"]
    return c


def job_specs(docs: list[dict]) -> list[tuple[str, dict]]:
    out = [(d["metadata"]["name"], d["spec"]) for d in docs if d["kind"] == "Job"]
    out += [(d["metadata"]["name"], d["spec"]["jobTemplate"]["spec"]) for d in docs if d["kind"] == "CronJob"]
    out += [(f"{d['metadata']['name']}/{rj['name']}", rj["template"]["spec"]) for d in docs if d["kind"] == "JobSet"
            for rj in d["spec"]["replicatedJobs"]]
    return out


def pod_specs(docs: list[dict]) -> list[tuple[str, dict]]:
    out = [(n, s["template"]["spec"]) for n, s in job_specs(docs)]
    out += [(d["metadata"]["name"], d["spec"]) for d in docs if d["kind"] == "Pod"]
    out += [(d["metadata"]["name"], d["spec"]["template"]["spec"]) for d in docs if d["kind"] == "Deployment"]
    return out


def env_of(c: dict) -> dict[str, dict]:
    return {e["name"]: e for e in c.get("env", [])}


# ------------------------------------------------------------------------------------------ lint, schema


@pytest.mark.parametrize("name", VALUE_SETS)
def test_lint_is_clean_in_strict_mode(name):
    for values in (overlay_values(name), manual(overlay_values(name))):
        report = helm.lint(CHART, values, strict=True, kube_version=f"v{KUBE_VERSION}")
        assert report["total_charts_linted"] == 1
        assert report["errors"] == [] and report["messages"] == [], report


def validate(d: dict) -> None:
    if d["kind"] == "JobSet":
        assert validate_crd(d, JOBSET_SCHEMA) == [], d["metadata"]["name"]
    else:
        for version in KUBE_VERSIONS:
            assert kubernetes_validate.validate(d, version, strict=True), (d["kind"], version)


def test_every_rendered_document_passes_the_strict_schema_at_both_ends_of_the_range(rendered):
    name, docs = rendered
    kinds = {d["kind"] for d in docs}
    assert {"ConfigMap", "CronJob", "Job", "Service", "Pod", "ServiceAccount", "Role", "RoleBinding"} <= kinds, name
    assert LOWEST_KUBE == "1.31.0" and tuple(map(int, KUBE_VERSION.split(".")[:2])) >= (1, 35)
    for d in docs:
        validate(d)


def test_the_lowest_version_is_what_catches_a_missing_condition_status():
    """1.31–1.34 require `status` in onPodConditions (1.35+ default it): validating at the newest version
    alone passed a chart that every 1.31–1.34 CI gate rejects."""
    spec = job(render({}), "teacher-scores")
    cond = spec["spec"]["podFailurePolicy"]["rules"][0]["onPodConditions"][0]
    assert cond == {"type": "DisruptionTarget", "status": "True"}
    del cond["status"]
    assert kubernetes_validate.validate(spec, KUBE_VERSION, strict=True)
    with pytest.raises(kubernetes_validate.ValidationError, match="'status' is a required property"):
        kubernetes_validate.validate(spec, LOWEST_KUBE, strict=True)


def test_the_schema_checks_are_strict():
    # guards the checks above: a misspelt field must fail, not pass silently
    (bad,) = [d for d in render({}, with_templates=False) if d["kind"] == "Service"]
    bad["spec"]["clusterIp"] = "None"
    with pytest.raises(kubernetes_validate.ValidationError, match="clusterIp"):
        kubernetes_validate.validate(bad, KUBE_VERSION, strict=True)
    js = job(render({"train": {"launcher": "jobset"}}), "train")
    assert validate_crd(js, JOBSET_SCHEMA) == []
    js["spec"]["failurePolicy"]["maxRestart"] = 3
    js["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]["containers"][0]["imagePolicy"] = "x"
    errors = validate_crd(js, JOBSET_SCHEMA)
    assert any("maxRestart" in e for e in errors) and any("imagePolicy" in e for e in errors), errors


@pytest.mark.parametrize("bad,what", [({"teacherScores": {"paralelism": 8}}, "paralelism"),
                                      ({"mode": "standalone"}, "mode"),
                                      ({"train": {"launcher": "mpi"}}, "launcher"),
                                      ({"jobDefaults": {"extraEnv": {"NCCL_DEBUG": "INFO"}}}, "extraEnv")])
def test_values_schema_rejects_typos_in_install_and_lint(bad, what):
    with pytest.raises(helm.HelmValuesError, match=what):
        render_files(bad)
    report = helm.lint(CHART, bad, strict=True, kube_version=f"v{KUBE_VERSION}")
    assert any(what in e for e in report["errors"]), report


def test_every_values_key_has_a_comment():
    lines = (CHART / "values.yaml").read_text().splitlines()
    for i, line in enumerate(lines):
        if re.match(r"^\s*[A-Za-z][\w./-]*:", line):
            assert lines[i - 1].lstrip().startswith("#"), f"values.yaml:{i + 1}: {line.strip()!r} has no comment"


def test_every_values_key_is_in_the_schema_and_the_job_blocks_are_symmetric():
    """Pod settings are stated once, in `jobDefaults`: a job block's schema takes every one of them (set
    there, it is merged over jobDefaults'), its values.yaml lists only its own keys."""
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    schema = json.loads((CHART / "values.schema.json").read_text())
    assert set(values) == set(schema["properties"])
    pod_keys = set(values["jobDefaults"])
    common = {"image", "resources", "config", "activeDeadlineSeconds", "ttlSecondsAfterFinished", "scratchSize"}
    for b in ["buildPrefixes", "teacherScores", "train", "evaluate", "pipeline"]:
        block = set(schema["properties"][b]["properties"])
        assert set(values[b]) == block - pod_keys, (b, set(values[b]) ^ (block - pod_keys))
        assert common <= set(values[b]), (b, common - set(values[b]))
        assert pod_keys - {"serviceAccountName"} <= block, (b, pod_keys - block)
        assert "enabled" in values[b] or b == "pipeline"
    assert "parallelism" in values["teacherScores"] and "parallelism" in values["train"]


# ------------------------------------------------------------------------------------------ what matters


def test_batch_fields_and_failure_policy_on_every_job(rendered):
    name, docs = rendered
    specs = job_specs(docs)
    # the four stage templates (the driver's, or the manual gates'), the CronJob's, the driver (pipeline)
    # or the four gates (manual), ALFWorld's data fill where the benchmark is ALFWorld, and the uninstall
    # hook that deletes the release's Pushgateway groups
    alfworld = any(n.startswith("sapd-test-alfworld-fill-") for n, _ in specs)
    assert alfworld == (name.split("-")[0] in ("base", "alfworld")), name
    assert "sapd-test-delete-metrics" in [n for n, _ in specs]
    assert len(specs) == (7 if name.endswith("pipeline") else 10) + alfworld, [n for n, _ in specs]
    for job_name, spec in specs:
        retries = "backoffLimitPerIndex" if "teacher-scores" in job_name and "gate" not in job_name else "backoffLimit"
        for f in (retries, "activeDeadlineSeconds", "ttlSecondsAfterFinished"):
            assert isinstance(spec.get(f), int) and spec[f] >= 0, (name, job_name, f)
        assert spec["template"]["spec"]["restartPolicy"] == "Never"
        assert spec["podReplacementPolicy"] == "Failed"
        rules = spec["podFailurePolicy"]["rules"]
        # a preemption is not the pod's fault: ignored (the pod is replaced, uncounted), except in a torchrun
        # group, which cannot take one replaced rank: there it fails the Job, and the whole group restarts
        gang = container(spec)["name"] == "train"
        assert rules[0] == {"action": "FailJob" if gang else "Ignore",
                            "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]}, job_name
        fail = [r for r in rules if "onExitCodes" in r]
        assert rules[1:] == fail and len(fail) == 1 and fail[0]["action"] == "FailJob"  # rule 1: JobSet relies on it
        assert fail[0]["onExitCodes"]["containerName"] == container(spec)["name"]
        codes = fail[0]["onExitCodes"]["values"]
        # a config error (2) is not retried on a GPU node; storage trouble (75) and kills (137) are
        assert 2 in codes and 75 not in codes and 137 not in codes
        driver = "pipeline" in job_name or "-gate-" in job_name
        assert codes == ([1, 2] if driver else [2]), job_name


def test_pods_run_as_non_root_with_a_read_only_root_and_tini_as_pid_1(rendered):
    _, docs = rendered
    for name, pod in pod_specs(docs):
        if "webshop" in name:
            continue
        assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] != 0
        for c in pod["containers"] + pod.get("initContainers", []):
            sc = c["securityContext"]
            assert sc["allowPrivilegeEscalation"] is False and sc["capabilities"]["drop"] == ["ALL"]
            assert sc["readOnlyRootFilesystem"] is True
            # `args`, never `command`: the image's ENTRYPOINT (tini) stays PID 1
            assert "command" not in c and c["args"], (name, c["name"])
    # OpenShift (restricted-v2): the UID may be left to the platform
    docs = render({"securityContext": {"pod": {"runAsUser": None, "runAsGroup": None, "fsGroup": None}}})
    for _, pod in pod_specs(docs):
        assert not {"runAsUser", "runAsGroup", "fsGroup"} & set(pod["securityContext"])
        assert pod["securityContext"]["runAsNonRoot"] is True


def test_gpu_jobs_request_gpus_in_alfworld_and_smoke_requests_none():
    docs = render(overlay_values("alfworld"))
    for component, n in (("teacher-scores", 1), ("train", 8), ("evaluate", 1)):
        res = container(job(docs, component)["spec"])["resources"]
        assert res["limits"][GPU] == n and res["requests"][GPU] == n, component
    assert GPU not in json.dumps(container(job(docs, "build-prefixes")["spec"])["resources"])
    smoke = render(overlay_values("smoke"))
    assert GPU not in json.dumps([d for d in smoke if d["kind"] in ("Job", "CronJob")])
    assert all(c["image"].endswith(":0.1.0-cpu") for _, p in pod_specs(smoke) for c in p["containers"])


def test_every_pod_requests_ephemeral_storage_and_sizes_its_scratch(rendered):
    _, docs = rendered
    for name, pod in pod_specs(docs):
        c = pod["containers"][0]
        assert "ephemeral-storage" in c["resources"]["requests"], name
        (scratch,) = [v for v in pod["volumes"] if v["name"] == "scratch"]
        assert scratch["emptyDir"]["sizeLimit"], name


def test_chart_metadata_names_its_home_its_own_icon_and_the_images_it_runs():
    """What Helm and ArtifactHub users read first: home, sources, the chart's own icon (a file of this
    repository, served from it), and the images the jobs pull, consistent with values.yaml's defaults."""
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert chart["home"].startswith("https://") and chart["sources"] and chart["maintainers"][0].get("url")
    repo_raw = "https://raw.githubusercontent.com/sapd/sapd/main/"
    assert chart["icon"].startswith(repo_raw)
    icon = REPO / chart["icon"].removeprefix(repo_raw)
    assert icon.is_file() and icon.read_text().lstrip().startswith("<svg")
    notes = chart["annotations"]
    assert notes["artifacthub.io/license"] == "Apache-2.0"
    image = yaml.safe_load((CHART / "values.yaml").read_text())["image"]
    images = {i["image"] for i in yaml.safe_load(notes["artifacthub.io/images"])}
    assert images == {f"{image['repository']}:{chart['appVersion']}-{flavor}" for flavor in ("gpu", "cpu", "eval")}
    assert all(link["url"].startswith("https://") for link in yaml.safe_load(notes["artifacthub.io/links"]))


def test_image_tag_defaults_to_app_version_and_a_digest_per_flavor_pins_it():
    app = yaml.safe_load((CHART / "Chart.yaml").read_text())["appVersion"]
    docs = render(overlay_values("searchqa"))
    assert container(job(docs, "train")["spec"])["image"] == f"ghcr.io/sapd/sapd:{app}-gpu"
    assert container(job(docs, "evaluate")["spec"])["image"] == f"ghcr.io/sapd/sapd:{app}-eval"  # benchmarks
    retriever = by_kind(docs, "Deployment")["sapd-test-retriever"]["spec"]["template"]["spec"]
    assert {c["image"] for c in retriever["containers"] + retriever["initContainers"]} == {f"ghcr.io/sapd/sapd:{app}-cpu"}
    # each flavor is its own image: a digest per flavor, so the evaluation keeps the eval image's
    gpu, ev, cpu = ("sha256:" + c * 64 for c in "abc")
    docs = render({**overlay_values("searchqa"),
                   "image": {"repository": "registry.example/sapd", "digests": {"gpu": gpu, "eval": ev, "cpu": cpu}}})
    assert container(job(docs, "train")["spec"])["image"] == f"registry.example/sapd@{gpu}"
    assert container(job(docs, "evaluate")["spec"])["image"] == f"registry.example/sapd@{ev}"
    (cron,) = by_kind(docs, "CronJob").values()
    assert container(cron["spec"]["jobTemplate"]["spec"])["image"] == f"registry.example/sapd@{ev}"
    dep = by_kind(docs, "Deployment")["sapd-test-retriever"]["spec"]["template"]["spec"]
    assert dep["containers"][0]["image"] == f"registry.example/sapd@{cpu}"
    # a flavor without a digest keeps its tag; a job's own digest pins that job alone
    docs = render({"image": {"digests": {"gpu": gpu}}, "pipeline": {"image": {"digest": cpu}}})
    assert container(job(docs, "evaluate")["spec"])["image"] == f"ghcr.io/sapd/sapd:{app}-eval"
    assert container(job(docs, "pipeline")["spec"])["image"] == f"ghcr.io/sapd/sapd@{cpu}"
    assert container(job(docs, "train")["spec"])["image"] == f"ghcr.io/sapd/sapd@{gpu}"
    with pytest.raises(helm.HelmValuesError, match="digest"):  # one digest for every flavor: refused
        render_files({"image": {"digest": gpu}})
    docs = render({"image": {"tag": "dev"}, "evaluate": {"image": {"tag": "dev-eval"}}})
    assert container(job(docs, "train")["spec"])["image"].endswith(":dev")
    assert container(job(docs, "evaluate")["spec"])["image"].endswith(":dev-eval")


@pytest.mark.parametrize("name,workers", [("base", 4), ("searchqa", 8), ("smoke", 1)])
def test_teacher_scores_is_an_indexed_job_of_one_pod_per_worker(name, workers):
    docs = render(overlay_values(name))
    spec = job(docs, "teacher-scores")["spec"]
    assert spec["completionMode"] == "Indexed"
    assert spec["completions"] == spec["parallelism"] == workers
    assert spec["backoffLimitPerIndex"] == 2 and spec["maxFailedIndexes"] == 0 and "backoffLimit" not in spec
    c = container(spec)
    assert c["args"][:3] == ["python", "-m", "sapd.jobs.teacher_scores"] and c["args"][3:5] == ["--config", "/etc/sapd/config.yaml"]
    # each worker pushes its metrics under its own grouping key: its completion index
    inst = env_of(c)["SAPD_METRICS_INSTANCE"]["valueFrom"]["fieldRef"]["fieldPath"]
    assert inst == "metadata.annotations['batch.kubernetes.io/job-completion-index']"
    cm = by_kind(docs, "ConfigMap")["sapd-test-config"]
    assert yaml.safe_load(cm["data"]["teacher-scores.yaml"])["workers"] == workers


def test_tensor_parallel_engines_request_that_many_gpus_and_shm_is_a_value():
    docs = render({"teacherScores": {"tensorParallelSize": 2, "teacherTensorParallelSize": 4, "shmSize": "32Gi"}})
    spec = job(docs, "teacher-scores")["spec"]
    res = container(spec)["resources"]
    assert res["requests"][GPU] == res["limits"][GPU] == 4
    (shm,) = [v for v in spec["template"]["spec"]["volumes"] if v["name"] == "dshm"]
    assert shm["emptyDir"] == {"medium": "Memory", "sizeLimit": "32Gi"}
    cm = by_kind(docs, "ConfigMap")["sapd-test-config"]
    sampling = yaml.safe_load(cm["data"]["teacher-scores.yaml"])["sampling"]
    assert sampling["tensor_parallel_size"] == 2 and sampling["teacher_tensor_parallel_size"] == 4
    assert "tensor_parallel_size" not in cm["data"]["train.yaml"]  # the experiment config is untouched
    # sapd takes them, and they are no change of the run's config (train has none)
    from sapd.config import config_differences, config_from_dict
    train_cfg = yaml.safe_load(cm["data"]["train.yaml"])
    scoring = config_from_dict({**train_cfg, "sampling": {**train_cfg.get("sampling", {}), **sampling}})
    assert (scoring.sampling.tensor_parallel_size, scoring.sampling.teacher_tensor_parallel_size) == (2, 4)
    assert config_differences(scoring, config_from_dict(train_cfg)) == []
    base = yaml.safe_load(by_kind(render({}), "ConfigMap")["sapd-test-config"]["data"]["teacher-scores.yaml"])
    assert "tensor_parallel_size" not in base.get("sampling", {})  # 1: nothing sapd would not know


def test_model_cache_is_shared_per_node():
    # hostPath: an existing folder (a created one would be root-owned, unwritable for uid 1000)
    for cache, vol in (({"type": "hostPath", "hostPath": "/mnt/nvme/sapd"}, {"hostPath": {"path": "/mnt/nvme/sapd", "type": "Directory"}}),
                       ({"type": "pvc", "claimName": "models"}, {"persistentVolumeClaim": {"claimName": "models"}})):
        docs = render({"modelCache": cache})
        for name, pod in pod_specs(docs):
            (v,) = [v for v in pod["volumes"] if v["name"] == "model-cache"]
            assert {k: x for k, x in v.items() if k != "name"} == vol, name
            c = pod["containers"][0]
            assert {"name": "model-cache", "mountPath": "/cache"} in c["volumeMounts"]
            env = env_of(c)
            assert env["SAPD_CACHE_DIR"]["value"] == "/cache/sapd" and env["HF_HOME"]["value"] == "/cache/hf"
            assert env["SAPD_TEXTWORLD_CACHE"]["value"] == "/cache/textworld"
    assert "model-cache" not in json.dumps(render({}))


def test_train_rendezvous_goes_through_the_headless_service():
    docs = render(overlay_values("alfworld"), release="sapd-alfworld")
    (svc,) = by_kind(docs, "Service").values()
    assert svc["spec"]["clusterIP"] == "None" and svc["spec"]["publishNotReadyAddresses"] is True
    t = job(docs, "train")
    spec = t["spec"]
    assert spec["completionMode"] == "Indexed" and spec["completions"] == spec["parallelism"] == 2
    assert spec["backoffLimit"] == 0  # one failed rank fails the group: the driver restarts all of it
    pod = spec["template"]["spec"]
    assert pod["subdomain"] == svc["metadata"]["name"]
    assert svc["spec"]["selector"].items() <= spec["template"]["metadata"]["labels"].items()
    c = container(spec)
    cmd = c["args"]
    assert cmd[0] == "torchrun" and "--nnodes=2" in cmd and "--nproc-per-node=8" in cmd
    assert f"--master-addr={t['metadata']['name']}-0.{svc['metadata']['name']}" in cmd  # pod 0's DNS name
    assert "--node-rank=$(NODE_RANK)" in cmd and cmd[cmd.index("-m") + 1] == "sapd.jobs.train"
    env = env_of(c)
    assert "job-completion-index" in env["NODE_RANK"]["valueFrom"]["fieldRef"]["fieldPath"]
    assert env["OMP_WAIT_POLICY"]["value"] == "PASSIVE"  # spinning OpenMP threads starve DeepSpeed/gloo on CPU
    assert env["SAPD_METRICS_ADDR"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    port = int(cmd[[a.startswith("--master-port=") for a in cmd].index(True)].split("=")[1])
    assert port in [p["port"] for p in svc["spec"]["ports"]]
    # Guaranteed QoS: requests equal limits, whole CPUs
    assert c["resources"]["requests"] == c["resources"]["limits"] and float(c["resources"]["limits"]["cpu"]).is_integer()
    with pytest.raises(helm.HelmRenderError, match="procsPerPod"):
        render_files({"train": {"procsPerPod": 4}})


def test_torch_threads_follow_the_cpu_limit_and_passive_waits_only_where_ranks_share_cores():
    """OMP_NUM_THREADS is each container's CPU limit in whole cores (the downward API rounds up), except in a train
    pod of several processes, where torchrun gives each one; OMP_WAIT_POLICY=PASSIVE only where DeepSpeed or
    several ranks wait in OpenMP's company (one torch-engine process loses ~40 % of a CPU step to it)."""
    def train_env(values: dict) -> dict[str, dict]:
        t = job(render(values), "train")
        spec = t["spec"] if t["kind"] == "Job" else t["spec"]["replicatedJobs"][0]["template"]["spec"]
        return env_of(container(spec))

    smoke = overlay_values("smoke")
    assert smoke["config"]["train"].get("engine", "torch") == "torch" and smoke["train"]["parallelism"] == 1
    docs = render(smoke)
    for name, pod in pod_specs(docs):
        for c in pod["containers"]:
            if c["args"][0] in ("python", "torchrun"):
                ref = env_of(c)["OMP_NUM_THREADS"]["valueFrom"]["resourceFieldRef"]
                assert ref == {"resource": "limits.cpu", "divisor": "1"}, name
    env = train_env(smoke)
    assert "OMP_WAIT_POLICY" not in env and "resourceFieldRef" in env["OMP_NUM_THREADS"]["valueFrom"]
    for over in ({"config": {"train": {"engine": "deepspeed"}}}, {"train": {"config": {"train": {"engine": "deepspeed"}}}},
                 {"train": {"parallelism": 2}}):
        assert train_env(deep_merge(smoke, over))["OMP_WAIT_POLICY"]["value"] == "PASSIVE", over
    # the chart's default (DeepSpeed, 8 processes a pod): passive waits, and torchrun's one thread per process
    env = train_env({})
    assert env["OMP_WAIT_POLICY"]["value"] == "PASSIVE" and "OMP_NUM_THREADS" not in env
    # a user's extraEnv comes last, so it overrides the chart's
    env = train_env(deep_merge(smoke, {"train": {"extraEnv": [{"name": "OMP_NUM_THREADS", "value": "3"}]}}))
    assert env["OMP_NUM_THREADS"] == {"name": "OMP_NUM_THREADS", "value": "3"}


def test_train_as_a_jobset_restarts_the_group_and_the_driver_may_create_it():
    values = {"train": {"launcher": "jobset", "maxRestarts": 5, "parallelism": 4}, "kueue": {"queueName": "gpu-queue"}}
    docs = render(values)
    js = job(docs, "train")
    assert js["apiVersion"] == "jobset.x-k8s.io/v1alpha2" and validate_crd(js, JOBSET_SCHEMA) == []
    name = js["metadata"]["name"]
    assert js["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "gpu-queue"
    # JobSet's host-maintenance pattern: the child Job fails on a preempted pod (rule 0) and on exit code 2
    # (rule 1); the first restarts the group without counting, the second fails the JobSet
    assert js["spec"]["failurePolicy"] == {"maxRestarts": 5, "rules": [
        {"name": "preempted", "action": "RestartJobSetAndIgnoreMaxRestarts", "onJobFailureReasons": ["PodFailurePolicy"],
         "onJobFailureMessagePatterns": ["matching FailJob rule at index 0$"]},
        {"name": "permanent-error", "action": "FailJobSet", "onJobFailureReasons": ["PodFailurePolicy"],
         "onJobFailureMessagePatterns": ["matching FailJob rule at index 1$"]}]}
    assert js["spec"]["network"] == {"enableDNSHostnames": True, "publishNotReadyAddresses": True}
    (rj,) = js["spec"]["replicatedJobs"]
    spec = rj["template"]["spec"]
    assert rj["replicas"] == 1 and spec["completions"] == spec["parallelism"] == 4 and spec["backoffLimit"] == 0
    rules = spec["podFailurePolicy"]["rules"]
    assert rules[0]["action"] == "FailJob" and rules[0]["onPodConditions"][0]["type"] == "DisruptionTarget"
    assert rules[1]["action"] == "FailJob" and rules[1]["onExitCodes"]["values"] == [2]
    assert "kueue.x-k8s.io/queue-name" not in rj["template"]["metadata"]["labels"]  # the JobSet is the workload
    args = container(spec)["args"]
    assert f"--master-addr={name}-node-0-0.{name}" in args  # JobSet's pod hostname and Service
    res = container(spec)["resources"]
    assert res["requests"] == res["limits"]
    assert "Service" not in {d["kind"] for d in docs}  # JobSet creates its own
    (role,) = by_kind(docs, "Role").values()
    assert {"apiGroups": ["jobset.x-k8s.io"], "resources": ["jobsets"], "verbs": ["create", "get", "list", "delete"]} in role["rules"]
    # manual mode: the same JobSet template, created by the train gate
    m = render(manual(values))
    assert job(m, "train")["kind"] == "JobSet" and job(m, "gate-train")["kind"] == "Job"


def test_kueue_labels_on_every_job_the_cronjob_template_and_the_driver_templates():
    docs = render({"kueue": {"queueName": "team-a", "priorityClass": "batch-low"}})
    jobs = [d for d in docs if d["kind"] == "Job"]
    assert len(jobs) == 7  # the driver + its four templates + ALFWorld's data fill + the uninstall hook
    for d in jobs:
        assert d["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "team-a", d["metadata"]["name"]
        assert d["metadata"]["labels"]["kueue.x-k8s.io/priority-class"] == "batch-low"
    (cron,) = by_kind(docs, "CronJob").values()
    assert cron["spec"]["jobTemplate"]["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "team-a"
    for d in render(manual({"kueue": {"queueName": "team-a"}})):
        if d["kind"] == "Job":
            assert d["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "team-a"
    assert "kueue.x-k8s.io" not in json.dumps(render({}))


def test_extension_points_merge_job_defaults_into_every_pod():
    values = {
        "jobDefaults": {"extraEnv": [{"name": "NCCL_DEBUG", "value": "WARN"}], "podAnnotations": {"a": "1"},
                        "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
                        "runtimeClassName": "nvidia", "priorityClassName": "batch", "serviceAccountName": "sapd-irsa",
                        "schedulerName": "volcano", "terminationGracePeriodSeconds": 60,
                        "envFrom": [{"secretRef": {"name": "hf-token"}}],
                        "extraVolumes": [{"name": "efa", "emptyDir": {}}],
                        "extraVolumeMounts": [{"name": "efa", "mountPath": "/efa"}]},
        "train": {"extraEnv": [{"name": "NCCL_SOCKET_IFNAME", "value": "eth0"}], "podAnnotations": {"a": "2", "b": "3"},
                  "podLabels": {"team": "x"}, "priorityClassName": "train-high",
                  "affinity": {"podAntiAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": []}},
                  "topologySpreadConstraints": [{"maxSkew": 1, "topologyKey": "zone", "whenUnsatisfiable": "DoNotSchedule"}]},
    }
    docs = render(values)
    for name, pod in pod_specs(docs):
        c = pod["containers"][0]
        assert env_of(c)["NCCL_DEBUG"]["value"] == "WARN", name
        assert pod["runtimeClassName"] == "nvidia" and pod["schedulerName"] == "volcano"
        assert pod["terminationGracePeriodSeconds"] == 60 and pod["tolerations"][0]["key"] == "nvidia.com/gpu"
        assert {"secretRef": {"name": "hf-token"}} in c["envFrom"] and {"name": "efa", "mountPath": "/efa"} in c["volumeMounts"]
        if "pipeline" in name:
            assert pod["serviceAccountName"] == "sapd-test-pipeline"  # the driver keeps its own
        else:
            assert pod["serviceAccountName"] == "sapd-irsa"
    t = job(docs, "train")["spec"]["template"]
    assert t["metadata"]["annotations"] == {"a": "2", "b": "3"} and t["metadata"]["labels"]["team"] == "x"
    assert t["spec"]["priorityClassName"] == "train-high" and "podAntiAffinity" in t["spec"]["affinity"]
    assert [e["name"] for e in container(job(docs, "train")["spec"])["env"]][-2:] == ["NCCL_DEBUG", "NCCL_SOCKET_IFNAME"]
    assert job(docs, "evaluate")["spec"]["template"]["spec"]["priorityClassName"] == "batch"
    for d in render(values):
        validate(d)


def test_evaluation_cronjob():
    (cron,) = by_kind(render({}), "CronJob").values()
    spec = cron["spec"]
    assert spec["schedule"] == "0 */6 * * *" and spec["concurrencyPolicy"] == "Forbid"
    assert spec["timeZone"] == "Etc/UTC" and spec["startingDeadlineSeconds"] == 600
    assert spec["jobTemplate"]["metadata"]["labels"]["app.kubernetes.io/component"] == "evaluate"
    assert container(spec["jobTemplate"]["spec"])["args"][:3] == ["python", "-m", "sapd.jobs.evaluate"]
    (cron,) = by_kind(render(overlay_values("smoke")), "CronJob").values()
    assert cron["spec"]["schedule"] == "*/30 * * * *"
    assert not by_kind(render({"evaluate": {"schedule": ""}}), "CronJob")
    assert not by_kind(render({"evaluate": {"enabled": False}}), "CronJob")  # disabled: no evaluation at all


def test_evaluation_gets_each_benchmark_what_it_needs():
    def ev(values):
        docs = render(values)
        return docs, job(docs, "evaluate")["spec"]["template"]["spec"]
    # the driver's evaluate-r<R> evaluates exactly checkpoint R (the CronJob: the newest)
    _, pod = ev({})
    args = pod["containers"][0]["args"]
    assert args[args.index("--checkpoint") + 1] == "0"  # round 0 of the rendered template
    (cron,) = by_kind(render({}), "CronJob").values()
    assert "--checkpoint" not in container(cron["spec"]["jobTemplate"]["spec"])["args"]
    # ALFWorld: the game files on a claim filled once, mounted read-only: no download in evaluation pods
    docs, pod = ev({})
    assert "initContainers" not in pod and "alfworld-download" not in json.dumps(docs)
    assert {"name": "alfworld", "persistentVolumeClaim": {"claimName": "sapd-test-alfworld-data", "readOnly": True}} \
        in pod["volumes"]
    assert {"name": "alfworld", "mountPath": "/data/alfworld", "readOnly": True} in pod["containers"][0]["volumeMounts"]
    assert env_of(pod["containers"][0])["ALFWORLD_DATA"]["value"] == "/data/alfworld"
    assert args[args.index("--data-dir") + 1] == "/data/alfworld"
    (pvc,) = by_kind(docs, "PersistentVolumeClaim").values()
    assert pvc["metadata"]["name"] == "sapd-test-alfworld-data" and pvc["spec"]["resources"]["requests"]["storage"] == "10Gi"
    (fill,) = [d for d in docs if d["kind"] == "Job" and d["metadata"]["name"].startswith("sapd-test-alfworld-fill-")]
    fpod = fill["spec"]["template"]["spec"]
    assert container(fill["spec"])["args"] == ["sapd", "alfworld-games", "--out", "/data/alfworld", "--split", "valid_unseen",
                                              "--per-type", "5"]
    assert container(fill["spec"])["image"].endswith("-eval") and GPU not in json.dumps(fpod)
    assert {"name": "alfworld", "persistentVolumeClaim": {"claimName": "sapd-test-alfworld-data"}} in fpod["volumes"]
    assert env_of(container(fill["spec"]))["ALFWORLD_DATA"]["value"] == "/data/alfworld"
    # a changed command is a new Job (Jobs are immutable); the same one is left alone by an upgrade
    other = render({"evaluate": {"alfworld": {"fill": {"command": ["alfworld-download"]}}}})
    assert [d["metadata"]["name"] for d in other if "alfworld-fill" in d["metadata"]["name"]] != [fill["metadata"]["name"]]
    # a claim of one's own, filled by hand: no claim and no fill rendered
    docs, pod = ev({"evaluate": {"alfworld": {"claimName": "alfworld-games", "fill": {"enabled": False}}}})
    assert not by_kind(docs, "PersistentVolumeClaim") and "alfworld-fill" not in json.dumps(docs)
    assert {"name": "alfworld", "persistentVolumeClaim": {"claimName": "alfworld-games", "readOnly": True}} in pod["volumes"]
    # WebShop: bring your own server; the chart deploys no image it cannot name, and helm test probes the URL
    docs, pod = ev(overlay_values("webshop"))
    args = pod["containers"][0]["args"]
    assert args[args.index("--webshop-url") + 1] == "http://webshop.sapd-system.svc.cluster.local:3000"
    assert not by_kind(docs, "Deployment") and "webshop" not in " ".join(by_kind(docs, "Service"))
    assert env_of(pod["containers"][0])["SAPD_WEBSHOP_URL"]["value"] == "http://webshop.sapd-system.svc.cluster.local:3000"
    (test_pod,) = by_kind(docs, "Pod").values()
    assert env_of(test_pod["spec"]["containers"][0])["SAPD_WEBSHOP_URL"]["value"].endswith(":3000")
    with pytest.raises(helm.HelmRenderError, match="evaluate.webshop.url is required for benchmark webshop"):
        render_files({"config": {"data": {"benchmark": "webshop"}}})
    with pytest.raises(helm.HelmValuesError, match="server"):
        render_files({"evaluate": {"webshop": {"server": {"enabled": True}}}})
    # search QA: question rows from S3 and the release's BM25 retriever (on the cpu image: it has bm25s)
    docs, pod = ev(overlay_values("searchqa"))
    args = pod["containers"][0]["args"]
    assert args[args.index("--rows") + 1] == "s3://sapd/data/searchqa/test.parquet"
    assert args[args.index("--retriever-url") + 1] == "http://sapd-test-retriever:8000"
    dep = by_kind(docs, "Deployment")["sapd-test-retriever"]["spec"]["template"]["spec"]
    assert dep["initContainers"][0]["args"][:3] == ["python", "-m", "sapd.jobs.fetch"]
    assert dep["containers"][0]["args"][:3] == ["python", "-m", "sapd.envs.retriever"] and dep["restartPolicy"] == "Always"
    assert dep["containers"][0]["image"].endswith("-cpu") and GPU not in json.dumps(dep)
    assert by_kind(docs, "Service")["sapd-test-retriever"]["spec"]["ports"][0]["port"] == 8000
    assert not by_kind(docs, "PersistentVolumeClaim")  # no ALFWorld data for another benchmark
    # TextWorld: games generated into the scratch volume (the root filesystem is read-only)
    _, pod = ev(overlay_values("textworld"))
    assert env_of(pod["containers"][0])["SAPD_TEXTWORLD_CACHE"]["value"] == "/scratch/textworld"
    assert "--data-dir" not in pod["containers"][0]["args"]


def test_s3_secret_reference_endpoint_and_pushgateway(rendered):
    _, docs = rendered
    for name, pod in pod_specs(docs):
        if "webshop" in name or name == "sapd-test-delete-metrics":  # the uninstall hook needs no S3 (below)
            continue
        env = env_of(pod["containers"][0])
        for var, key in (("AWS_ACCESS_KEY_ID", "AWS_ACCESS_KEY_ID"), ("AWS_SECRET_ACCESS_KEY", "AWS_SECRET_ACCESS_KEY")):
            assert env[var]["valueFrom"]["secretKeyRef"] == {"name": "sapd-s3-credentials", "key": key}, name
            assert "value" not in env[var]
        assert env["SAPD_S3_ENDPOINT_URL"]["value"].startswith("http")
        assert env["SAPD_PUSHGATEWAY_URL"]["value"] == "http://pushgateway.sapd-system.svc.cluster.local:9091"
    irsa = render({"s3": {"useServiceAccount": True}})
    assert "AWS_ACCESS_KEY_ID" not in json.dumps(irsa) and "sapd-s3-credentials" not in json.dumps(irsa)


def test_every_pod_of_a_release_claims_the_run_roots_lease_as_the_release(rendered):
    """The driver, its gates, the stage Jobs it creates and the evaluation CronJob share one lease owner —
    the one the driver computes from its release and namespace (sapd.lease.release_owner) — so none of them
    waits for another, and a second release on the same runRoot is refused."""
    from sapd.lease import OWNER_ENV, release_owner
    _, docs = rendered
    owners = {name: env_of(pod["containers"][0]).get(OWNER_ENV, {}).get("value") for name, pod in pod_specs(docs)
              if "webshop" not in name and "retriever" not in name}
    assert owners and set(owners.values()) == {release_owner("sapd-test", "sapd")}, owners


def test_force_takeover_is_a_value_of_the_driver_and_its_gates():
    for values in ({}, manual({})):
        drivers = [d for d in render(values, with_templates=False) if d["kind"] == "Job"
                   and container(d["spec"])["args"][:3] == ["python", "-m", "sapd.jobs.pipeline"]]
        assert drivers and not [d for d in drivers if "--force-takeover" in container(d["spec"])["args"]]
        forced = [d for d in render({**values, "pipeline": {"forceTakeover": True}}, with_templates=False)
                  if d["kind"] == "Job" and container(d["spec"])["args"][:3] == ["python", "-m", "sapd.jobs.pipeline"]]
        assert len(forced) == len(drivers) and all("--force-takeover" in container(d["spec"])["args"] for d in forced)


def test_pipeline_driver_rbac_is_what_it_calls():
    docs = render({})
    (role,) = by_kind(docs, "Role").values()
    rules = {(tuple(r["apiGroups"]), tuple(r["resources"])): r["verbs"] for r in role["rules"]}
    # the calls of sapd/run/k8s.py: read/list/create/delete job (a restarted driver lists the persistent stage
    # Jobs of its run), read its owner (the templates ConfigMap, no other), read/create service, list pods, read
    # a log
    assert rules == {(("batch",), ("jobs",)): ["create", "get", "list", "delete"], (("",), ("services",)): ["get", "create"],
                     (("",), ("configmaps",)): ["get"], (("",), ("pods",)): ["list"], (("",), ("pods/log",)): ["get"]}
    (cm_rule,) = [r for r in role["rules"] if r["resources"] == ["configmaps"]]
    assert cm_rule["resourceNames"] == ["sapd-test-pipeline-templates"]
    (binding,) = by_kind(docs, "RoleBinding").values()
    (sa,) = by_kind(docs, "ServiceAccount").values()
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": sa["metadata"]["name"], "namespace": "sapd"}]
    drv = job(docs, "pipeline")["spec"]["template"]["spec"]
    assert drv["serviceAccountName"] == sa["metadata"]["name"] and drv["automountServiceAccountToken"] is True
    # manual mode: the gates run as the same ServiceAccount, with the same Role
    mdocs = render(manual({}))
    assert by_kind(mdocs, "Role") == by_kind(docs, "Role")
    for stage in STAGES:
        assert job(mdocs, f"gate-{stage}")["spec"]["template"]["spec"]["serviceAccountName"] == sa["metadata"]["name"]
    for component in STAGES:
        assert job(docs, component)["spec"]["template"]["spec"]["automountServiceAccountToken"] is False


def test_persistent_stage_jobs_are_the_default_and_per_round_jobs_a_value():
    """pipeline.stageJobs: the driver's flag (persistent by default); the teacher-scores and train commands
    take the rounds the driver fills in, the input poll, and a wait bound of one round of each pool."""
    for values, flag in (({}, "persistent"), ({"pipeline": {"stageJobs": "perRound", "roundsPerJob": 3}}, "per-round")):
        docs = render(values, with_templates=False)
        args = container(job(docs, "pipeline")["spec"])["args"]
        assert args[args.index("--stage-jobs") + 1] == flag
        assert args[args.index("--rounds-per-job") + 1] == str(values.get("pipeline", {}).get("roundsPerJob", 0))
    cm = by_kind(render({"pipeline": {"inputPollSeconds": 0.5}}, with_templates=False), "ConfigMap")
    texts = cm["sapd-test-pipeline-templates"]["data"]
    for stage in ("teacher-scores", "train"):
        cargs = container(yaml.safe_load(texts[f"{stage}.yaml"])["spec"])["args"]
        tail = cargs[cargs.index("--round"):]
        assert tail == ["--round", ROUND_PLACEHOLDER, "--rounds", ROUNDS_PLACEHOLDER, "--poll-seconds", "0.5",
                        "--input-timeout-seconds", str(21600 + 43200)], tail
    for stage in ("build-prefixes", "evaluate"):
        assert ROUNDS_PLACEHOLDER not in texts[f"{stage}.yaml"]
    with pytest.raises(helm.HelmValuesError, match="stageJobs"):
        render({"pipeline": {"stageJobs": "perround"}})


def test_pipeline_driver_creates_the_stage_jobs_from_the_same_templates_as_manual_mode():
    docs = render({}, with_templates=False)
    assert [d["metadata"]["name"] for d in docs if d["kind"] == "Job" and "fill" not in d["metadata"]["name"]
            and "helm.sh/hook" not in d["metadata"].get("annotations", {})] == ["sapd-test-pipeline-1"]
    (svc,) = by_kind(docs, "Service").values()  # round-independent: rendered either way
    templates = dict(stage_templates(docs, round_=3))
    assert set(templates) == {"build-prefixes", "teacher-scores", "train", "train-service", "evaluate"}
    assert templates["train-service"] == svc
    assert templates["teacher-scores"]["metadata"]["name"] == "sapd-test-teacher-scores-r3"
    assert templates["evaluate"]["metadata"]["name"] == "sapd-test-evaluate-r3"
    # the driver pod mounts its templates where its command reads them, and makes the stage Jobs dependents
    # of the templates ConfigMap, which every revision keeps (an upgrade never deletes a running stage)
    drv = job(docs, "pipeline")
    args = container(drv["spec"])["args"]
    assert args[:3] == ["python", "-m", "sapd.jobs.pipeline"] and args[args.index("--templates") + 1] == "/etc/sapd-pipeline"
    assert args[args.index("--owner") + 1] == "configmap/sapd-test-pipeline-templates"
    (vol,) = [v for v in drv["spec"]["template"]["spec"]["volumes"] if v["name"] == "stage-templates"]
    assert vol["configMap"]["name"] == "sapd-test-pipeline-templates"
    mount = next(m for m in container(drv["spec"])["volumeMounts"] if m["name"] == "stage-templates")
    assert mount["mountPath"] == "/etc/sapd-pipeline" and mount["readOnly"] is True
    assert args[args.index("--retries") + 1] == "2"
    # Argo CD (helm template: revision 1 forever) deletes and recreates the driver Job when it changes
    assert drv["metadata"]["annotations"]["argocd.argoproj.io/sync-options"] == "Force=true,Replace=true"
    # manual mode renders the same templates, and per stage a gate Job: the driver limited to that stage,
    # a small CPU pod that creates the stage Job once its input is committed (no GPU held while waiting)
    alone = render(manual({"round": 3}), revision=4, with_templates=False)
    assert dict(stage_templates(alone, round_=3)) == templates
    gates = {d["metadata"]["labels"]["app.kubernetes.io/component"]: d for d in alone
             if d["kind"] == "Job" and "-gate-" in d["metadata"]["name"]}
    assert set(gates) == {f"gate-{s}" for s in STAGES} and not [d for d in alone if d["kind"] == "Job" and
                                                             d["metadata"]["name"].endswith(("-r3", "-r4"))]
    suffix = gates["gate-train"]["metadata"]["name"].rsplit("-", 1)[1]
    assert re.fullmatch(r"[0-9a-f]{5}", suffix)
    rounds = {"build-prefixes": None, "teacher-scores": "3", "train": "3", "evaluate": "4"}
    for stage, k in rounds.items():
        g = gates[f"gate-{stage}"]
        assert g["metadata"]["name"] == f"sapd-test-gate-{stage}{'' if k is None else f'-r{k}'}-{suffix}"
        gargs = container(g["spec"])["args"]
        assert gargs[:3] == ["python", "-m", "sapd.jobs.pipeline"] and gargs[gargs.index("--stage") + 1] == stage
        assert (gargs[gargs.index("--round") + 1] if "--round" in gargs else None) == k
        assert gargs[gargs.index("--owner") + 1] == "configmap/sapd-test-pipeline-templates"
        gpod = g["spec"]["template"]["spec"]
        assert GPU not in json.dumps(gpod) and "initContainers" not in gpod
        assert container(g["spec"])["resources"] == container(drv["spec"])["resources"]  # the driver's
        assert [v["configMap"]["name"] for v in gpod["volumes"] if "configMap" in v] == \
            ["sapd-test-config", "sapd-test-pipeline-templates"]
    # a disabled stage has no template (the driver then refuses or skips it), and no gate
    off = render({"evaluate": {"enabled": False}}, with_templates=False)
    assert "evaluate" not in dict(stage_templates(off)) and "train" in dict(stage_templates(off))
    assert "gate-evaluate" not in json.dumps(render(manual({"evaluate": {"enabled": False}}), with_templates=False))


def test_config_map_holds_overlays_that_sapd_loads(rendered, tmp_path):
    name, docs = rendered
    cm = by_kind(docs, "ConfigMap")[f"{docs[0]['metadata']['labels']['app.kubernetes.io/instance']}-config"]
    assert set(cm["data"]) == {"config.yaml", "build-prefixes.yaml", "teacher-scores.yaml", "train.yaml",
                               "evaluate.yaml", "pipeline.yaml"}
    for key, text in cm["data"].items():
        path = tmp_path / key
        path.write_text(text)
        cfg = load_config(path)  # the same format as a local overlay: unknown keys or bad types raise
        assert cfg.run_root == yaml.safe_load(text)["run_root"] and cfg.run_root.startswith("s3://")
    # every job mounts its own overlay at /etc/sapd/config.yaml, which its command reads (but the uninstall
    # hook, which runs once the ConfigMap is gone)
    for job_name, spec in job_specs(docs):
        if job_name.endswith("-delete-metrics"):
            continue
        pod = spec["template"]["spec"]
        (vol,) = [v for v in pod["volumes"] if v["name"] == "config"]
        assert vol["configMap"]["name"] == cm["metadata"]["name"]
        assert vol["configMap"]["items"][0]["path"] == "config.yaml"
        assert vol["configMap"]["items"][0]["key"] in cm["data"]
        mount = next(m for m in container(spec)["volumeMounts"] if m["name"] == "config")
        assert mount["mountPath"] == "/etc/sapd"
        if container(spec)["name"] != "alfworld-fill":  # ALFWorld's game files need no run config
            assert "/etc/sapd/config.yaml" in container(spec)["args"]


def test_config_map_content_per_overlay(tmp_path):
    def cfg(name, key="train.yaml", extra=None):
        values = overlay_values(name)
        if extra:
            values = {**values, **extra}
        cm = by_kind(render(values), "ConfigMap")["sapd-test-config"]
        (tmp_path / key).write_text(cm["data"][key])
        return load_config(tmp_path / key)
    smoke = cfg("smoke")  # "auto" on this CPU, as in the smoke overlay's CPU pods
    assert (smoke.model.device, smoke.sampling.backend, smoke.train.engine, smoke.workers) == ("cpu", "hf", "torch", 1)
    assert [line.split(":")[0] for line in smoke.auto_lines()] == ["model.device", "model.dtype", "sampling.backend"]
    assert (smoke.data.benchmark, smoke.data.format) == ("textworld", "native")
    searchqa = cfg("searchqa", "teacher-scores.yaml")
    assert (searchqa.data.benchmark, searchqa.data.format, searchqa.train.trajectories_per_round) == \
        ("searchqa", "searchr1", 128)
    assert cfg("webshop").data.benchmark == "webshop" and cfg("textworld").data.format == "native"
    # Go writes small floats as 1e-06 (YAML 1.2, which sapd reads, takes it as a float)
    assert cfg("base", extra={"config": {"train": {"lr": 5e-7, "weight_decay": 1e20}}}).train.lr == 5e-7
    # a job's own config lands in its overlay only
    per_job = cfg("base", "evaluate.yaml", extra={"evaluate": {"config": {"sampling": {"max_new_tokens": 64}}}})
    assert per_job.sampling.max_new_tokens == 64 and cfg("base").sampling.max_new_tokens == 512


def test_overlays_list_only_differences():
    base = yaml.safe_load((CHART / "values.yaml").read_text())

    def same_leaves(overlay, ref, path=""):
        for k, v in overlay.items():
            if isinstance(v, dict) and isinstance(ref.get(k), dict):
                yield from same_leaves(v, ref[k], f"{path}{k}.")
            elif k in ref and ref[k] == v:
                yield f"{path}{k}"
    # a benchmark overlay names its benchmark even where the base has it: layered after the smoke overlay
    # (`-f smoke.yaml -f alfworld.yaml`), it must undo smoke's textworld
    restated = {"alfworld": ["config.data.benchmark"]}
    for name in OVERLAYS:
        overlay = yaml.safe_load((CHART / "values" / f"{name}.yaml").read_text())
        assert list(same_leaves(overlay, base)) == restated.get(name, []), name


# ------------------------------------------------------------------------------------------ lifecycle, names


def test_helm_upgrade_with_other_values_changes_no_immutable_field():
    """Helm patches the objects both revisions render with the difference of the two renderings; the
    API server refuses a change to an immutable field (Job specs above all: helm/helm#7725). Jobs of a
    revision are named after it, so no Job is ever patched."""
    changes = [{"image": {"tag": "0.1.1-gpu"}}, {"train": {"resources": {"requests": {"cpu": "48"}, "limits": {"cpu": "48"}}}},
               {"config": {"train": {"rounds": 200}}}, {"pipeline": {"pollSeconds": 10}}, {"teacherScores": {"parallelism": 8}}]
    for mode in ("pipeline", "manual"):
        for change in changes:
            v1, v2 = {"mode": mode}, {"mode": mode, **change}
            old = {(d["kind"], d["metadata"]["name"]): d for d in render(v1, with_templates=False)}
            new = {(d["kind"], d["metadata"]["name"]): d for d in render(v2, with_templates=False, revision=2)}
            for key in old.keys() & new.keys():
                if "helm.sh/hook" in (old[key]["metadata"].get("annotations") or {}):
                    continue  # the test and uninstall hooks: Helm deletes a hook before creating it again
                try:
                    ApiServer.check_immutable(BY_KIND[key[0]], old[key], new[key])
                except ApiError as e:
                    pytest.fail(f"{mode} {change}: {e.message}")
            assert any(k[0] == "Job" for k in new.keys() - old.keys()), (mode, change)  # new Jobs instead
    # an upgrade that changes nothing replaces nothing in manual mode (a running round goes on)
    same = [{(d["kind"], d["metadata"]["name"]) for d in render(manual({}), with_templates=False, revision=r)} for r in (1, 2)]
    assert same[0] == same[1]
    # a changed Job spec under the same name is what the check catches
    old = job(render({}, with_templates=False), "pipeline")
    with pytest.raises(ApiError, match="immutable"):
        ApiServer.check_immutable(BY_KIND["Job"], old, job(render({"image": {"tag": "x"}}, with_templates=False), "pipeline"))


LONG = "sapd-" + "x" * 44 + "-run"  # 53 characters: Helm's limit for release names


@pytest.mark.parametrize("launcher", ["job", "jobset"])
@pytest.mark.parametrize("mode", ["pipeline", "manual"])
def test_a_53_character_release_name_renders_valid_names(mode, launcher):
    helm.validate_release_name(LONG)
    assert len(LONG) == 53
    values = {"mode": mode, "round": 9998, "teacherScores": {"parallelism": 64}, "train": {"parallelism": 16, "launcher": launcher}}
    docs = render(values, release=LONG, round_=9999, revision=1234)  # the driver's largest round and index
    names = set()
    for d in docs:
        validate(d)
        name = d["metadata"]["name"]
        limit = {"CronJob": 52}.get(d["kind"], 63)
        assert len(name) <= limit and re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", name), (d["kind"], name)
        names.add((d["kind"], name))
        for v in (d["metadata"].get("labels") or {}).values():
            assert len(str(v)) <= 63, (name, v)
        if d["kind"] == "Job" and d["spec"].get("completionMode") == "Indexed":
            assert len(f"{name}-{d['spec']['completions'] - 1}") <= 63, name  # the pods' hostnames
        if d["kind"] == "JobSet":
            for rj in d["spec"]["replicatedJobs"]:
                assert len(f"{name}-{rj['name']}-{rj['replicas'] - 1}-{rj['template']['spec']['completions'] - 1}") <= 63
    stage_names = [n for k, n in names if k in ("Job", "JobSet")]
    assert len(stage_names) == len(set(stage_names)) >= 4  # cut names stay distinct
    assert all(n.startswith("sapd-" + "x" * 20) for n in stage_names)
    # the driver accepts its templates for round 9999 (it checks names and hostnames itself)
    if mode == "pipeline":
        from sapd.run.k8s import StageTemplates
        cm = [d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"].endswith("pipeline-templates")][0]
        t = StageTemplates({k.removesuffix(".yaml"): v for k, v in cm["data"].items()})
        for stage in STAGES:
            t.render(stage, 9999)


def test_notes_say_what_to_run():
    notes = render_files({})["sapd/templates/NOTES.txt"]
    assert "kubectl -n sapd get jobs -l app.kubernetes.io/instance=sapd-test" in notes
    assert "kubectl -n sapd logs -f job/sapd-test-pipeline-1" in notes
    assert "batch.kubernetes.io/job-completion-index=0" in notes and "helm -n sapd test sapd-test" in notes
    manual_notes = render_files({"mode": "manual", "round": 2})["sapd/templates/NOTES.txt"]
    assert "--set round=3" in manual_notes and "WARNING" in manual_notes


def test_chart_metadata_and_labels():
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert chart["kubeVersion"].startswith(">=1.31")
    docs = render({})
    for d in docs:
        labels = d["metadata"]["labels"]
        assert labels["helm.sh/chart"] == f"sapd-{chart['version']}".replace("+", "_")
        assert labels["app.kubernetes.io/name"] == "sapd" and labels["app.kubernetes.io/part-of"] == "sapd"
    for name, pod_tmpl in [(n, s["template"]) for n, s in job_specs(docs)]:
        labels = pod_tmpl["metadata"]["labels"]
        assert {"app.kubernetes.io/name", "app.kubernetes.io/instance", "app.kubernetes.io/component",
                "app.kubernetes.io/version", "app.kubernetes.io/part-of"} <= set(labels), name
    assert job(docs, "train")["spec"]["template"]["metadata"]["labels"]["sapd.io/round"] == "0"


def test_network_policy_is_opt_in():
    assert "NetworkPolicy" not in {d["kind"] for d in render({})}
    docs = render({"networkPolicy": {"enabled": True, "extraEgress": [{"to": [{"ipBlock": {"cidr": "10.0.0.0/8"}}]}],
                                     "metricsFrom": [{"namespaceSelector": {"matchLabels": {"name": "monitoring"}}}]}})
    (np,) = by_kind(docs, "NetworkPolicy").values()
    assert np["spec"]["podSelector"]["matchLabels"]["app.kubernetes.io/instance"] == "sapd-test"
    assert np["spec"]["ingress"][1]["ports"] == [{"port": 9400, "protocol": "TCP"}]
    assert {"to": [{"ipBlock": {"cidr": "10.0.0.0/8"}}]} in np["spec"]["egress"]


def test_uninstall_deletes_the_releases_pushgateway_groups():
    """A post-delete hook Job (sapd.jobs.delete_metrics): it runs after the release's objects are gone, so it
    mounts no ConfigMap and needs no S3 Secret; only with a Pushgateway, and it can be turned off."""
    (hook,) = [d for d in render({}) if d["kind"] == "Job" and d["metadata"]["name"] == "sapd-test-delete-metrics"]
    ann = hook["metadata"]["annotations"]
    assert ann["helm.sh/hook"] == "post-delete" and ann["helm.sh/hook-delete-policy"] == "before-hook-creation,hook-succeeded"
    pod = hook["spec"]["template"]["spec"]
    c = container(hook["spec"])
    assert c["args"] == ["python", "-m", "sapd.jobs.delete_metrics", "--settle-seconds", "30"]
    assert not [v for v in pod["volumes"] if "configMap" in v or "secret" in v]
    env = env_of(c)
    assert "AWS_ACCESS_KEY_ID" not in env and env["SAPD_RELEASE"]["value"] == "sapd-test"
    assert env["SAPD_NAMESPACE"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.namespace"
    assert env["SAPD_PUSHGATEWAY_URL"]["value"] == "http://pushgateway.sapd-system.svc.cluster.local:9091"
    assert pod["automountServiceAccountToken"] is False  # it calls no Kubernetes API
    for values in ({"pushgateway": {"url": ""}}, {"pushgateway": {"deleteOnUninstall": False}}):
        assert "sapd-test-delete-metrics" not in by_kind(render(values), "Job")


def test_every_cache_goes_to_a_writable_volume(rendered):
    """The root filesystem is read-only: HOME and the caches libraries write (torch extensions and vLLM under
    XDG_CACHE_HOME, vLLM's config, triton, matplotlib, Hugging Face, TextWorld's games) point into a volume
    the container mounts writable."""
    _, docs = rendered
    cache_vars = ("HOME", "XDG_CACHE_HOME", "XDG_CONFIG_HOME", "TRITON_CACHE_DIR", "MPLCONFIGDIR", "HF_HOME",
                  "SAPD_TEXTWORLD_CACHE")
    for name, pod in pod_specs(docs):
        if "webshop" in name:
            continue
        for c in pod["containers"] + pod.get("initContainers", []):
            writable = [m["mountPath"] for m in c["volumeMounts"] if not m.get("readOnly")]
            env = env_of(c)
            for var in cache_vars:
                value = env[var]["value"]
                assert any(value == w or value.startswith(w.rstrip("/") + "/") for w in writable), (name, var, value)
            assert "/tmp" in writable  # TMPDIR's default


@pytest.mark.parametrize("name", VALUE_SETS)
def test_vllm_runs_as_vllm_runs_it_and_a_gpu_pod_that_sees_no_gpu_stops(name):
    """Nothing sets vLLM's engine to run in-process or lets its engine unpickle code: the scoring and evaluation
    pods run each engine in its own process (vLLM's default), which sapd's weight sync reaches by method name
    (sapd.models.vllm_worker). Every container given GPUs carries their count (SAPD_POD_GPUS), so that
    `model.device: auto` stops there instead of falling back to the CPU when torch sees none."""
    docs = render(overlay_values(name))
    for pod, spec in pod_specs(docs):
        for c in spec["containers"] + spec.get("initContainers", []):
            env = env_of(c)
            assert not {"VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_ALLOW_INSECURE_SERIALIZATION"} & env.keys(), pod
            gpus = ((c.get("resources") or {}).get("limits") or {}).get(GPU)
            assert env.get("SAPD_POD_GPUS", {}).get("value") == (str(gpus) if gpus else None), (pod, c["name"])
    assert "VLLM_" not in (REPO / "Dockerfile").read_text() and "VLLM_" not in (REPO / "docker" / "install.sh").read_text()


def test_helm_test_hook_is_a_preflight_pod():
    (pod,) = [d for d in render({}) if d["kind"] == "Pod"]
    assert pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
    # it has none of the run's GPUs: it plans for GPUs of tests.gpuMemoryGiB (the training ranks: SAPD_TRAIN_PROCESSES)
    assert pod["spec"]["containers"][0]["args"] == ["python", "-m", "sapd.jobs.check", "--config", "/etc/sapd/config.yaml",
                                                    "--gpu-memory", "80"]
    (smoke,) = [d for d in render(overlay_values("smoke")) if d["kind"] == "Pod"]  # no GPUs: this machine's memory
    assert smoke["spec"]["containers"][0]["args"][-1] == "/etc/sapd/config.yaml"
    assert pod["spec"]["volumes"][0]["configMap"]["items"][0]["key"] == "config.yaml"
    assert not [d for d in render({"tests": {"enabled": False}}) if d["kind"] == "Pod"]


# ------------------------------------------------------------------------------------------ manifests


MANIFEST_FILES = ["namespace.yaml", "pushgateway.yaml", "prometheus-scrape-config.yaml",
                  "s3-credentials-secret.template.yaml", "seaweedfs/seaweedfs.yaml"]


@pytest.mark.parametrize("file", MANIFEST_FILES)
def test_manifests_pass_the_strict_schema(file):
    docs = [d for d in yaml.safe_load_all((MANIFESTS / file).read_text()) if d]
    assert docs
    for d in docs:
        assert kubernetes_validate.validate(d, KUBE_VERSION, strict=True), (file, d["kind"])


def test_manifest_pieces():
    kinds = {f: sorted(d["kind"] for d in yaml.safe_load_all((MANIFESTS / f).read_text()) if d) for f in MANIFEST_FILES}
    assert kinds["pushgateway.yaml"] == ["Deployment", "Service"]
    assert kinds["seaweedfs/seaweedfs.yaml"] == ["Deployment", "PersistentVolumeClaim", "Service"]
    values = yaml.safe_load((CHART / "values.yaml").read_text())["s3"]
    (svc,) = [d for d in yaml.safe_load_all((MANIFESTS / "seaweedfs" / "seaweedfs.yaml").read_text())
              if d and d["kind"] == "Service"]
    assert values["endpoint"] == f"http://{svc['metadata']['name']}.sapd-system.svc.cluster.local:{svc['spec']['ports'][0]['port']}"
    text = (MANIFESTS / "seaweedfs" / "seaweedfs.yaml").read_text()
    assert '"actions": ["Read:sapd", "Write:sapd", "List:sapd"]' in text  # the jobs' user is scoped to the bucket
    (secret,) = yaml.safe_load_all((MANIFESTS / "s3-credentials-secret.template.yaml").read_text())
    assert secret["metadata"]["name"] == values["secretName"]
    assert set(secret["stringData"]) == {values["accessKeyIdKey"], values["secretAccessKeyKey"]}
    recipe = (MANIFESTS / "s3-credentials-secret.template.yaml").read_text()
    assert "--dry-run=client -o yaml | kubectl apply -n <release-namespace> -f -" in recipe and "sed" not in recipe
    kust = yaml.safe_load((MANIFESTS / "kustomization.yaml").read_text())  # the base: no object storage
    assert sorted(kust["resources"]) == sorted(set(MANIFEST_FILES) - {"s3-credentials-secret.template.yaml",
                                                                      "seaweedfs/seaweedfs.yaml"})
    assert kust["namespace"] == "sapd-system"
    assert yaml.safe_load((MANIFESTS / "seaweedfs" / "kustomization.yaml").read_text())["resources"] == ["seaweedfs.yaml"]
    (cm,) = yaml.safe_load_all((MANIFESTS / "prometheus-scrape-config.yaml").read_text())
    scrape = yaml.safe_load(cm["data"]["sapd-scrape-configs.yaml"])["scrape_configs"]
    jobs = {s["job_name"]: s for s in scrape}
    assert jobs["sapd-pushgateway"]["honor_labels"] is True
    assert "pushgateway.sapd-system.svc.cluster.local:9091" in jobs["sapd-pushgateway"]["static_configs"][0]["targets"]
    keep = [r for r in jobs["sapd-train"]["relabel_configs"] if r.get("action") == "keep"]
    assert [r["regex"] for r in keep] == ["sapd;train", "0", "metrics"]  # train pods, rank 0, the `metrics` port


def test_grafana_dashboard_uses_sapd_metrics_by_convention():
    dash = json.loads((MANIFESTS / "grafana-dashboard.json").read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    exprs += [v["query"]["query"] for v in dash["templating"]["list"] if isinstance(v.get("query"), dict)]
    promql_words = {"sum", "by", "rate", "time", "label_values", "stage", "term", "benchmark", "category",
                    "release", "job", "namespace"}
    metrics = set()
    for e in exprs:
        e = re.sub(r'"[^"]*"', '""', e)  # label values
        e = re.sub(r"\[[^\]]*\]", "", e)  # range selectors
        for word in re.findall(r"[A-Za-z_:][A-Za-z0-9_:]*", e):
            if word not in promql_words:
                metrics.add(word)
    assert metrics and all(m.startswith("sapd_") for m in metrics), metrics
    for needed in ("sapd_stage_duration_seconds_sum", "sapd_tokens_total", "sapd_loss", "sapd_clip_ratio",
                   "sapd_teacher_student_gap", "sapd_eval_success_ratio", "sapd_weight_update_ratio",
                   "sapd_update_applied_ratio"):
        assert needed in metrics
    assert "sapd_clip_fraction" not in metrics and "histogram_quantile" not in json.dumps(exprs)
    # rate() only over what Prometheus scrapes (rank 0's /metrics), never over one-shot pushed series
    for e in exprs:
        if "rate(" in e:
            assert 'job="sapd-train"' in e, e
    # legends name the namespace as well as the release: two teams' releases of one name stay apart
    for p in dash["panels"]:
        for t in p["targets"]:
            assert "{{namespace}}/{{release}}" in t["legendFormat"], p["title"]
            assert 'namespace=~"$namespace"' in t["expr"], p["title"]
            by = re.findall(r"by \(([^)]*)\)", t["expr"])
            assert all("namespace" in b.split(", ") for b in by), t["expr"]
    assert [v["name"] for v in dash["templating"]["list"]][:3] == ["datasource", "namespace", "release"]
    assert len({p["id"] for p in dash["panels"]}) == len(dash["panels"])


# ------------------------------------------------------------------------------------------ image


# The Dockerfile's structure and every target's resolution: tests/cluster/test_images.py


@pytest.mark.parametrize("how", ["set", "values-file"])
def test_float_values_arrive_as_floats(tmp_path, how):
    """`--set config.train.lr=1e-6` (Helm types only integers: the value is the string "1e-6") and a values
    file's `lr: 1e-6` (Go writes it back as 1e-06) both reach the run config as floats."""
    pairs = {"train.lr": 1e-6, "train.weight_decay": 5e-7, "sampling.top_p": 0.5, "train.max_grad_norm": 0.25,
             "loss.lambda_tok": 1.5e-2, "data.val_fraction": 0.125}
    written = {"train.lr": "1e-6", "train.weight_decay": "5E-7", "sampling.top_p": ".5",
               "train.max_grad_norm": "0.25", "loss.lambda_tok": "1.5e-2", "data.val_fraction": ".125"}
    if how == "set":
        values = helm.parse_set_string(",".join(f"config.{k}={v}" for k, v in written.items()))
        assert values["config"]["train"]["lr"] == "1e-6"  # what Helm hands the chart: a string
    else:
        nested: dict = {}
        for k, v in written.items():
            section, key = k.split(".")
            nested.setdefault(section, {})[key] = v
        text = "config:\n" + "".join(f"  {s}:\n" + "".join(f"    {k}: {v}\n" for k, v in kv.items())
                                     for s, kv in nested.items())
        values = helm.values_from_yaml(text)
    cm = by_kind(render(values), "ConfigMap")["sapd-test-config"]
    for key in ("config.yaml", "train.yaml", "teacher-scores.yaml"):
        (tmp_path / key).write_text(cm["data"][key])
        cfg = load_config(tmp_path / key)
        for dotted, want in pairs.items():
            section, name = dotted.split(".")
            got = cfg.loss[name] if section == "loss" else getattr(getattr(cfg, section), name)
            assert isinstance(got, float) and got == want, (key, dotted, got)
    # strings stay strings: only a whole value with a dot or an exponent is unquoted
    values = helm.parse_set_string("config.data.input=1e5.jsonl,config.model.device=cuda:1")
    (tmp_path / "s.yaml").write_text(by_kind(render(values), "ConfigMap")["sapd-test-config"]["data"]["config.yaml"])
    cfg = load_config(tmp_path / "s.yaml")
    assert (cfg.data.input, cfg.model.device) == ("1e5.jsonl", "cuda:1")


# ------------------------------------------------------------------------------------------ cluster review 2


def test_a_dotted_release_name_is_refused_with_a_clear_message():
    """Helm accepts "sapd.alfworld"; the API server would refuse the Service `sapd.alfworld-train` (a
    DNS-1035 label) once half the release exists. The chart refuses it first, naming a name that works."""
    helm.validate_release_name("sapd.alfworld")  # Helm's own rule lets it through
    for bad, better in (("sapd.alfworld", "sapd-alfworld"), ("1sapd", "1sapd")):
        with pytest.raises(helm.HelmRenderError, match=rf'release name "{re.escape(bad)}": the chart names Services '
                                                       rf'after it.*DNS-1035.*"{better}"'):
            render_files({}, release=bad)
    assert render_files({}, release="sapd-alfworld-2")


def test_volumes_are_chowned_only_on_a_root_mismatch():
    for _, pod in pod_specs(render({"modelCache": {"type": "pvc", "claimName": "models"}})):
        assert pod["securityContext"]["fsGroup"] == 1000
        assert pod["securityContext"]["fsGroupChangePolicy"] == "OnRootMismatch"


def test_job_level_annotations_go_on_the_job_not_its_pods():
    """Kueue reads its partial-admission annotation from the Job's own metadata."""
    min_par = {"kueue.x-k8s.io/job-min-parallelism": "2"}
    values = {"jobDefaults": {"jobAnnotations": {"team": "nlp"}}, "teacherScores": {"jobAnnotations": min_par}}
    docs = render(values)
    ts = job(docs, "teacher-scores")
    assert ts["metadata"]["annotations"] == {"team": "nlp", **min_par}
    assert "kueue.x-k8s.io/job-min-parallelism" not in json.dumps(ts["spec"]["template"])
    assert job(docs, "pipeline")["metadata"]["annotations"]["team"] == "nlp"
    (cron,) = by_kind(docs, "CronJob").values()
    assert cron["spec"]["jobTemplate"]["metadata"]["annotations"] == {"team": "nlp"}
    js = job(render({"train": {"launcher": "jobset", "jobAnnotations": {
        "alpha.jobset.sigs.k8s.io/exclusive-topology": "cloud.google.com/gke-nodepool"}}}), "train")
    assert js["metadata"]["annotations"] == {"alpha.jobset.sigs.k8s.io/exclusive-topology": "cloud.google.com/gke-nodepool"}
    # the driver keeps them when it adds its own (attempt, run root)
    from sapd.run.k8s import Driver, StageTemplates
    cm = [d for d in render(values, with_templates=False) if d["metadata"]["name"] == "sapd-test-pipeline-templates"][0]
    drv = Driver.__new__(Driver)
    drv.templates = StageTemplates({k.removesuffix(".yaml"): v for k, v in cm["data"].items()})
    drv.cfg, drv._owner_ref = load_config_from_docs(docs), None
    assert drv.manifest("teacher-scores", 1, 2)["metadata"]["annotations"] == {
        "team": "nlp", **min_par, "sapd.io/attempt": "2", "sapd.io/run-root": "s3://sapd/runs/default"}


def load_config_from_docs(docs: list[dict]):
    from sapd.config import config_from_dict
    return config_from_dict(yaml.safe_load(by_kind(docs, "ConfigMap")["sapd-test-config"]["data"]["pipeline.yaml"]))


def test_the_train_rendezvous_waits_for_the_whole_group():
    """torchrun's static rendezvous gives up after 600 s: a group whose second pod waits for a GPU node
    would fail and burn a retry. Its timeout is a value (an hour by default)."""
    args = container(job(render({}), "train")["spec"])["args"]
    assert "--rdzv-conf=timeout=3600" in args and args.index("--rdzv-conf=timeout=3600") < args.index("-m")
    args = container(job(render({"train": {"rendezvousTimeoutSeconds": 7200}}), "train")["spec"])["args"]
    assert "--rdzv-conf=timeout=7200" in args


# ------------------------------------------------------------------------------------------ cluster conventions
# The install-once kustomizations (storage optional, the Prometheus Operator's monitors), values examples for
# AWS S3 and for N GPUs, the evaluation CronJob under evaluate.enabled, the GPUs NOTES and the README state.

EXAMPLES = CHART / "values" / "examples"  # not overlays: no test iterates over them but those below
KUBECTL = os.environ.get("KUBECTL", "/usr/bin/kubectl")  # the journeys' kubectl 1.32 (kustomize v5)


def kustomize(folder: Path) -> list[dict]:
    """`kubectl kustomize <folder>`, offline: the documents `kubectl apply -k <folder>` would send."""
    if not Path(KUBECTL).is_file():
        pytest.skip(f"no kubectl at {KUBECTL} (set KUBECTL)")
    out = subprocess.run([KUBECTL, "kustomize", str(folder)], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "KUBECONFIG": os.devnull})
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def kinds_and_names(docs: list[dict]) -> set[tuple[str, str]]:
    return {(d["kind"], d["metadata"]["name"]) for d in docs}


def test_kustomize_base_holds_no_storage_and_seaweedfs_is_an_addon():
    """`kubectl apply -k manifests/` gives a cluster that has S3 what it needs and no SeaweedFS;
    `manifests/seaweedfs/` adds SeaweedFS alone, beside the base, in the same namespace."""
    base, seaweed = kustomize(MANIFESTS), kustomize(MANIFESTS / "seaweedfs")
    assert kinds_and_names(base) == {("Namespace", "sapd-system"), ("Deployment", "pushgateway"),
                                     ("Service", "pushgateway"), ("ConfigMap", "sapd-prometheus-scrape-config")}
    assert "seaweedfs" not in json.dumps(base)
    assert kinds_and_names(seaweed) == {("PersistentVolumeClaim", "seaweedfs-data"), ("Deployment", "seaweedfs"),
                                        ("Service", "seaweedfs-s3")}
    for d in base + seaweed:
        assert kubernetes_validate.validate(d, KUBE_VERSION, strict=True), (d["kind"], d["metadata"]["name"])
        assert d["metadata"]["labels"]["app.kubernetes.io/part-of"] == "sapd"
        if d["kind"] != "Namespace":
            assert d["metadata"]["namespace"] == "sapd-system", d["metadata"]["name"]
    images = {c["image"] for d in base + seaweed if d["kind"] == "Deployment"
              for c in d["spec"]["template"]["spec"]["containers"]}
    assert images == {"prom/pushgateway:v1.11.1", "chrislusf/seaweedfs:4.48"}
    # the chart's default endpoint is the add-on's Service
    (svc,) = [d for d in seaweed if d["kind"] == "Service"]
    endpoint = yaml.safe_load((CHART / "values.yaml").read_text())["s3"]["endpoint"]
    assert endpoint == f"http://{svc['metadata']['name']}.sapd-system.svc.cluster.local:{svc['spec']['ports'][0]['port']}"
    # the install page says so: the base alone for S3, the add-on beside it otherwise
    install = (REPO / "docs" / "kubernetes" / "install.md").read_text()
    assert "kubectl apply -k manifests/ " in install and "kubectl apply -k manifests/seaweedfs/" in install


# what a monitoring.coreos.com/v1 object may hold where these monitors use it (the Operator's CRDs, abridged):
# kubernetes-validate ships no CRD schemas, so a misspelt key (`honor_labels`) would pass unnoticed
MONITOR_SPEC_KEYS = {"ServiceMonitor": {"selector", "namespaceSelector", "endpoints", "jobLabel", "targetLabels",
                                        "podTargetLabels", "sampleLimit"},
                     "PodMonitor": {"selector", "namespaceSelector", "podMetricsEndpoints", "jobLabel",
                                    "podTargetLabels", "sampleLimit"}}
ENDPOINT_KEYS = {"port", "path", "scheme", "interval", "scrapeTimeout", "honorLabels", "honorTimestamps",
                 "relabelings", "metricRelabelings", "params"}
RELABEL_KEYS = {"sourceLabels", "separator", "targetLabel", "regex", "modulus", "replacement", "action"}


def relabel_targets(relabelings: list[dict]) -> dict[str, str]:
    """target label → what it is set from: a pod label's meta name, or a fixed replacement."""
    return {r["targetLabel"]: (r["sourceLabels"][0] if r.get("sourceLabels") else r["replacement"])
            for r in relabelings}


def test_prometheus_operator_monitors_select_the_pushgateway_and_rank_0_of_the_train_pods():
    """manifests/prometheus-operator/: a ServiceMonitor whose selector and port match the Pushgateway Service
    of the base, and a PodMonitor that selects exactly the chart's rank-0 train pods (Job or JobSet) on their
    `metrics` port, with the plain scrape config's job name and labels (the dashboard's)."""
    docs = kustomize(MANIFESTS / "prometheus-operator")
    assert kinds_and_names(docs) == {("ServiceMonitor", "sapd-pushgateway"), ("PodMonitor", "sapd-train")}
    for d in docs:
        assert d["apiVersion"] == "monitoring.coreos.com/v1" and d["metadata"]["namespace"] == "sapd-system"
        assert set(d["spec"]) <= MONITOR_SPEC_KEYS[d["kind"]], d["kind"]
        for ep in d["spec"].get("endpoints", []) + d["spec"].get("podMetricsEndpoints", []):
            assert set(ep) <= ENDPOINT_KEYS and all(set(r) <= RELABEL_KEYS for r in ep.get("relabelings", []))
    monitors = {d["kind"]: d["spec"] for d in docs}
    (cm,) = yaml.safe_load_all((MANIFESTS / "prometheus-scrape-config.yaml").read_text())
    plain = {s["job_name"]: s for s in yaml.safe_load(cm["data"]["sapd-scrape-configs.yaml"])["scrape_configs"]}

    # the ServiceMonitor: the base's Pushgateway Service, in its namespace, by port name
    sm = monitors["ServiceMonitor"]
    (svc,) = [d for d in kustomize(MANIFESTS) if d["kind"] == "Service" and d["metadata"]["name"] == "pushgateway"]
    assert sm["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
    assert sm["namespaceSelector"]["matchNames"] == [svc["metadata"]["namespace"]]
    (ep,) = sm["endpoints"]
    assert ep["port"] in {p["name"] for p in svc["spec"]["ports"]}
    assert ep["honorLabels"] is plain["sapd-pushgateway"]["honor_labels"] is True
    assert relabel_targets(ep["relabelings"]) == {"job": "sapd-pushgateway"}

    # the PodMonitor: every namespace; the chart's train pods with completion index 0, nothing else
    pm = monitors["PodMonitor"]
    assert pm["namespaceSelector"] == {"any": True}
    want = pm["selector"]["matchLabels"]
    assert set(pm["selector"]) == {"matchLabels"}
    (pep,) = pm["podMetricsEndpoints"]
    seen = 0
    for values in ({}, {"train": {"launcher": "jobset"}}, overlay_values("textworld")):
        docs = render(values)
        for name, spec in job_specs(docs):
            labels, pod = spec["template"]["metadata"]["labels"], spec["template"]["spec"]
            for index in range(int(spec.get("completions") or 1)):
                # what the Job controller adds to each pod of an Indexed Job (Kubernetes 1.28+)
                carried = {**labels, "batch.kubernetes.io/job-completion-index": str(index)}
                selected = want.items() <= carried.items()
                is_rank0 = labels["app.kubernetes.io/component"] == "train" and index == 0
                assert selected == is_rank0, (name, index)
                if selected:
                    seen += 1
                    assert pep["port"] in {p["name"] for c in pod["containers"] for p in c.get("ports", [])}
                    # the pod labels the relabelings read are there
                    for source in relabel_targets(pep["relabelings"]).values():
                        if source.startswith("__meta_kubernetes_pod_label_"):
                            assert source.removeprefix("__meta_kubernetes_pod_label_") in {
                                re.sub(r"[^a-zA-Z0-9_]", "_", k) for k in carried}, source
    assert seen == 3  # one train template per values set
    # the plain config's selection (train pods, index 0, the `metrics` port) and its labels, as the dashboard reads them
    keep = [r["regex"] for r in plain["sapd-train"]["relabel_configs"] if r.get("action") == "keep"]
    assert keep == ["sapd;train", "0", "metrics"]
    assert (want["app.kubernetes.io/name"], want["app.kubernetes.io/component"],
            want["batch.kubernetes.io/job-completion-index"], pep["port"]) == ("sapd", "train", "0", "metrics")
    plain_targets = {r["target_label"]: r["source_labels"][0] for r in plain["sapd-train"]["relabel_configs"]
                     if "target_label" in r}
    ours = relabel_targets(pep["relabelings"])
    assert ours["job"] == plain["sapd-train"]["job_name"] == "sapd-train"
    assert {k: v for k, v in ours.items() if k != "job"} == {
        k: v for k, v in plain_targets.items() if k in ("release", "round")}
    # namespace and pod: the Operator sets them itself; the dashboard's queries use job="sapd-train"
    assert 'job=\\"sapd-train\\"' in (MANIFESTS / "grafana-dashboard.json").read_text()


def example(name: str, *under: dict) -> dict:
    """Overlays and then a file of values/examples/, as `-f a.yaml -f examples/<name>.yaml` merges them."""
    values: dict = {}
    for v in (*under, helm.values_from_yaml((EXAMPLES / f"{name}.yaml").read_text())):
        values = deep_merge(values, v)
    return values


@pytest.mark.parametrize("mode", ["pipeline", "manual"])
def test_aws_s3_examples_render_the_s3_environment_of_every_pod(mode):
    """values/examples/aws-s3-irsa.yaml and aws-s3-secret.yaml over the ALFWorld overlay: AWS's own endpoint
    (an empty SAPD_S3_ENDPOINT_URL, which sapd.storage reads as the SDK's default), the region, and either no key
    variables and the user's ServiceAccount (IRSA) or the keys from the user's Secret."""
    alfworld = overlay_values("alfworld")
    for name in ("aws-s3-irsa", "aws-s3-secret"):
        values = example(name, alfworld)
        if mode == "manual":
            values = manual(values)
        docs = render(values)
        irsa = name == "aws-s3-irsa"
        assert (values["s3"]["endpoint"], values["s3"]["region"]) == ("", "eu-west-1")
        assert values["runRoot"].startswith("s3://my-bucket/")
        pods = [(n, p) for n, p in pod_specs(docs) if n != "sapd-test-delete-metrics"]  # the hook needs no S3
        assert len(pods) >= 5, [n for n, _ in pods]
        for pod_name, pod in pods:
            env = env_of(pod["containers"][0])
            assert env["SAPD_S3_ENDPOINT_URL"].get("value", "") == "", pod_name
            assert env["AWS_DEFAULT_REGION"]["value"] == "eu-west-1", pod_name
            driver = "-pipeline-" in pod_name or "-gate-" in pod_name  # the chart's own ServiceAccount
            if irsa:
                assert "AWS_ACCESS_KEY_ID" not in env and "AWS_SECRET_ACCESS_KEY" not in env, pod_name
                assert pod["serviceAccountName"] == ("sapd-test-pipeline" if driver else "sapd-jobs"), pod_name
                assert pod["automountServiceAccountToken"] is driver  # IRSA's webhook mounts its own token
            else:
                for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
                    assert env[var]["valueFrom"]["secretKeyRef"] == {"name": "sapd-aws-s3", "key": var}, pod_name
                assert pod.get("serviceAccountName", "sapd-test-pipeline") == "sapd-test-pipeline", pod_name
        for d in docs:
            validate(d)
        # IRSA reaches the driver too: the chart's own ServiceAccount carries the role's annotation
        (sa,) = [d for d in docs if d["kind"] == "ServiceAccount" and d["metadata"]["name"] == "sapd-test-pipeline"]
        assert sa["metadata"].get("annotations") == (
            {"eks.amazonaws.com/role-arn": "arn:aws:iam::111122223333:role/sapd-s3"} if irsa else None)
        notes = render_files(values)["sapd/templates/NOTES.txt"]
        assert ("from the Secret sapd-aws-s3" in notes) is not irsa
        assert "sapd-s3-credentials" not in json.dumps(docs) + notes


def test_evaluate_enabled_decides_the_cronjob_and_a_nightly_schedule_renders_as_documented():
    """evaluate.enabled false renders no evaluation at all (no CronJob, no stage template, no gate, no NOTES line);
    an empty schedule no CronJob; operate.md's nightly example renders a CronJob at 03:00 in its time zone."""
    for values in ({"evaluate": {"enabled": False}}, manual({"evaluate": {"enabled": False}})):
        docs = render(values)
        assert not by_kind(docs, "CronJob") and "evaluate" not in {
            d["metadata"]["labels"]["app.kubernetes.io/component"] for d in docs if d["kind"] == "Job"}
        assert "evaluate-cron" not in render_files(values)["sapd/templates/NOTES.txt"]
    docs = render({"evaluate": {"schedule": ""}})
    assert not by_kind(docs, "CronJob") and job(docs, "evaluate")  # the driver's final evaluation stays
    assert "evaluate-cron" not in render_files({"evaluate": {"schedule": ""}})["sapd/templates/NOTES.txt"]
    operate = (REPO / "docs" / "kubernetes" / "operate.md").read_text()
    section = operate[operate.index("## Evaluation"):]
    (nightly,) = [yaml.safe_load(b) for b in re.findall(r"```yaml\n(.*?)```", section, flags=re.S)
                  if "schedule" in b]
    (cron,) = by_kind(render(nightly), "CronJob").values()
    assert cron["spec"]["schedule"] == nightly["evaluate"]["schedule"] == "0 3 * * *"
    assert cron["spec"]["timeZone"] == nightly["evaluate"]["timeZone"]
    validate(cron)
    assert '--set-string evaluate.schedule="0 3 * * *"' in " ".join(section.split())
    notes = render_files(nightly)["sapd/templates/NOTES.txt"]
    assert "sapd-test-evaluate-cron (0 3 * * *)" in notes


GPU_LINE = re.compile(r"^GPUs: (\d+) (held for the whole run|at most at once)", re.M)


def notes_gpus(values: dict) -> tuple[int, str]:
    notes = render_files(values)["sapd/templates/NOTES.txt"]
    m = GPU_LINE.search(notes)
    assert m, notes
    return int(m.group(1)), m.group(2)


def test_notes_state_the_gpus_a_values_file_holds():
    """train.parallelism × the train pod's GPUs (= procsPerPod) + teacherScores.parallelism × a scoring pod's GPUs
    (the larger tensor-parallel size above 1): the sum with persistent stage Jobs (both pools held all run long),
    the larger of the two where the stages take turns (perRound, manual mode); the evaluation's GPU on its own line."""
    assert notes_gpus({}) == (20, "held for the whole run")  # 2 pods × 8 + 4 workers × 1
    notes = render_files({})["sapd/templates/NOTES.txt"]
    assert "train 2 pods × 8 GPUs (16) and teacher-scores 4 pods × 1 GPU (4)" in " ".join(notes.split())
    assert "Evaluation: 1 GPU per evaluation Job" in notes
    assert notes_gpus({"teacherScores": {"teacherTensorParallelSize": 2}}) == (24, "held for the whole run")
    assert notes_gpus({"train": {"parallelism": 4}, "teacherScores": {"parallelism": 8}}) == (40, "held for the whole run")
    assert notes_gpus({"pipeline": {"stageJobs": "perRound"}}) == (16, "at most at once")
    assert notes_gpus(manual({})) == (16, "at most at once")
    assert notes_gpus({"teacherScores": {"enabled": False}}) == (16, "held for the whole run")
    # the 8-GPU example: 1 train pod × 4 + 4 workers × 1, what the formula gives from its own values
    gpus8 = example("gpus-8")
    t, s = gpus8["train"], gpus8["teacherScores"]
    assert t["resources"]["limits"][GPU] == t["procsPerPod"]
    assert notes_gpus(gpus8) == (t["parallelism"] * t["procsPerPod"] + s["parallelism"] * 1, "held for the whole run") \
        == (8, "held for the whole run")
    assert "CronJob" not in render_files(gpus8)["sapd/templates/NOTES.txt"]  # no ninth GPU asked for during the rounds
    for d in render(gpus8):
        validate(d)
    # a CPU values set holds none
    assert "GPUs: none" in render_files(overlay_values("smoke"))["sapd/templates/NOTES.txt"]


def test_chart_readme_opens_with_the_values_most_users_set_and_a_values_file_for_n_gpus():
    """The chart's README (README.md.tmpl) names five values before its generated tables, each a real key; shows
    values/examples/gpus-8.yaml as it is; states the defaults' GPUs as NOTES prints them; and no longer says
    stage Jobs are created per round in the default mode (nor do the Kubernetes pages)."""
    readme = (CHART / "README.md.tmpl").read_text()
    head = readme[readme.index("## The values most users set"):readme.index("## Values")]
    assert readme.index("## The values most users set") < readme.index("## Prerequisites")
    rows = re.findall(r"^\| `([\w.]+)` \|", head, flags=re.M)
    assert rows == ["image.repository", "runRoot", "config.data.input", "config.model.student", "config.model.teacher"]
    defaults = yaml.safe_load((CHART / "values.yaml").read_text())
    for key in rows:
        value = defaults
        for part in key.split("."):
            value = value[part]  # a KeyError: the README names a value the chart does not have
        assert f"| `{value}` |" in head, key  # the default shown is the chart's
    (block,) = re.findall(r"```yaml\n(.*?)```", head, flags=re.S)
    file_values = "".join(ln + "\n" for ln in (EXAMPLES / "gpus-8.yaml").read_text().splitlines()
                          if not ln.startswith("#"))
    assert block == file_values
    assert re.search(r"\*\*(\d+) GPUs\*\*", head).group(1) == str(notes_gpus({})[0])
    for page in [CHART / "README.md.tmpl", *(REPO / "docs" / "kubernetes").glob("*.md")]:
        assert "then per round teacher-scores" not in page.read_text(), page
