"""A run's lifecycle on a cluster, end to end (the harness of tests/k8s_harness, as tests/cluster/test_journeys.py
uses it): what a user does to a release while it runs, each ending in the same committed result as a run
nobody touched.

- `helm upgrade` in the middle of a stage, from the chart's previous version (rendered from git history,
  :data:`PREVIOUS_CHART`) to this one: the new driver adopts the running stage Job — which belongs to the
  release's pipeline-templates ConfigMap, kept by every revision and version — instead of the garbage
  collector deleting it with the old driver Job;
- `helm upgrade --reuse-values --set config.train.rounds=2` on a finished run of 1 round: the new driver
  continues from checkpoint 1;
- mode manual: small gate Jobs create each stage Job once its input is committed (no GPU held while
  waiting; the evaluation's deadline starts when it runs), round after round with `--set round=K+1`;
- `--set kueue.queueName=…` on a cluster whose queue (a Kueue-like admission by quota) cannot admit the
  train stage yet: the driver logs its stage Job as queued, does not count its deadline while it waits,
  and the run completes once the platform's admin raises the quota;
- a second release installed with the runRoot of one that runs: its driver refuses in one line naming the
  holder (the first release) and how to take over, creates nothing, and the first run is untouched.

Inputs are what a user uploads (a tiny student and teacher, TextWorld expert games recorded with sapd's
collector) in a real S3 server (SeaweedFS); the first four releases run side by side in one cluster, the
queued one in a cluster of its own (with the queue admission on).
"""

from __future__ import annotations

import dataclasses
import io
import re
import signal
import subprocess
import tarfile
import time
import uuid
from pathlib import Path

import pytest
import torch
import yaml

from tests.conftest import free_port
from tests.journey_util import NS, checkpoint_weights, journey_cluster, upload_models, user_s3
from tests.k8s_harness import Cluster

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "sapd"
SMOKE = CHART / "values" / "smoke.yaml"
LR = ["config.train.lr=0.001"]
# the chart's previous version: the commit whose charts/sapd a user installed before upgrading to this one
# (move it on when Chart.yaml's version moves on)
PREVIOUS_CHART = ("d2c6d15", "0.2.0")
pytestmark = [pytest.mark.integration, pytest.mark.slow]


@dataclasses.dataclass
class Inputs:
    prefix: str
    endpoint: str
    games: Path


@pytest.fixture(scope="module")
def inputs(tmp_path_factory, s3_server):
    """The user's uploads: models and expert games (the smoke panel's, which are its training data too)."""
    from sapd.data.loaders import write_native_jsonl
    from sapd.envs.loop import LoopOptions, collect_expert
    from sapd.envs.panels import PanelSpec, episode_specs
    tmp = tmp_path_factory.mktemp("lifecycle-inputs")
    with user_s3(s3_server):
        specs = episode_specs(PanelSpec("textworld", families=("simple", "coin"), games_per_family=1, seed=0,
                                        cache_dir=str(tmp / "games")))
        trajs = collect_expert(specs, "textworld", successful_only=True, opts=LoopOptions(invalid_action="look"))
        prefix = f"s3://{s3_server.bucket}/lifecycle-{uuid.uuid4().hex[:8]}"
        write_native_jsonl(trajs, f"{prefix}/data/textworld.jsonl")
        upload_models(tmp / "models", prefix)
        yield Inputs(prefix, s3_server.endpoint_url, tmp / "games")


@pytest.fixture(scope="module")
def previous_chart(tmp_path_factory) -> Path:
    """charts/sapd as it was at :data:`PREVIOUS_CHART` (`git archive`), what the user installed first."""
    commit, version = PREVIOUS_CHART
    out = tmp_path_factory.mktemp("previous-chart")
    tar = subprocess.run(["git", "-C", str(REPO), "archive", commit, "charts/sapd"], capture_output=True)
    assert tar.returncode == 0, f"the previous chart needs this checkout's history (commit {commit}): {tar.stderr.decode()}"
    with tarfile.open(fileobj=io.BytesIO(tar.stdout)) as t:
        t.extractall(out, filter="data")
    chart = out / "charts" / "sapd"
    assert f"version: {version}" in (chart / "Chart.yaml").read_text()
    assert f"version: {version}" not in (CHART / "Chart.yaml").read_text()  # this chart is a later version
    return chart


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, inputs, s3_server):
    # a node whose shared cache already holds the evaluation panel's games (modelCache: hostPath)
    with journey_cluster(tmp_path_factory.mktemp("cluster"), s3_server, textworld_cache=inputs.games) as c:
        yield c


def user_sets(inputs: Inputs, release: str, *extra: str) -> list[str]:
    p = inputs.prefix
    return [f"runRoot={p}/runs/{release}", f"config.data.input={p}/data/textworld.jsonl",
            f"config.model.student={p}/models/student", f"config.model.teacher={p}/models/teacher",
            "config.sampling.max_new_tokens=12", "config.data.val_fraction=0", "config.train.trajectories_per_round=1",
            "teacherScores.parallelism=2", f"s3.endpoint={inputs.endpoint}", "pushgateway.url=",
            "pipeline.pollSeconds=0.5", "pipeline.logEverySeconds=60", "manual.pollSeconds=1", "modelCache.type=hostPath",
            f"train.rendezvousPort={free_port()}", f"train.metricsPort={free_port()}", *extra]


def logs_of_job(cluster: Cluster, job: str) -> str:
    return "\n".join(cluster.logs(p["metadata"]["name"]) for p in cluster.pods(f"batch.kubernetes.io/job-name={job}"))


def finished(cluster: Cluster, job: str, timeout: float = 1200) -> str:
    """Wait for a driver or gate Job; it must be Complete with no stage left failing (its log, and the
    failed pods' logs, are the failure message)."""
    state = cluster.wait_job(job, timeout)
    log = logs_of_job(cluster, job)
    assert state == "Complete" and "FAILED" not in log and "WARNING" not in log, f"{job}:\n{log}\n{cluster.describe()}"
    return log


def assert_same_result(root: str, reference: str, rounds: tuple[int, ...] = (0, 1)) -> None:
    """The committed scored rounds and checkpoint weights of ``root`` are ``reference``'s."""
    from sapd import layout
    from sapd.data.scored import read_scored
    assert layout.committed_checkpoints(root) == layout.committed_checkpoints(reference)
    cols = ["prefix_id", "response_token_ids", "teacher_logprobs"]
    for k in rounds:
        a, b = read_scored(reference, k), read_scored(root, k)
        assert a.sort_by("prefix_id").select(cols).equals(b.sort_by("prefix_id").select(cols)), k
        wa, wb = checkpoint_weights(reference, k + 1), checkpoint_weights(root, k + 1)
        assert wa.keys() == wb.keys()
        for name in wa:
            torch.testing.assert_close(wa[name], wb[name], rtol=0, atol=1e-6, msg=f"checkpoint {k + 1} {name}")


def evaluation(root: str, k: int) -> dict:
    from sapd import layout, storage
    ev = storage.read_json(storage.join(layout.evals_dir(root, k), "textworld.json"))
    return {key: ev[key] for key in ("checkpoint", "overall", "by_category")}


@dataclasses.dataclass
class Releases:
    """Four releases of the smoke overlay, started together: `base` left alone, `upg` installed from the
    chart's previous version and upgraded to this one in the middle of train-r0, `ext` installed with 1
    round then extended to 2, `man` in mode manual."""
    roots: dict[str, str]
    notes: dict[str, str]
    adopted_train_uid: str
    seen: dict[str, object]


@pytest.fixture(scope="module")
def releases(cluster, inputs, previous_chart) -> Releases:
    from sapd import checkpoints
    roots, notes, seen = {}, {}, {}
    for rel, extra in (("base", []), ("upg", []), ("ext", ["config.train.rounds=1"]),
                       ("man", ["mode=manual", "round=0"])):
        chart = previous_chart if rel == "upg" else CHART
        r = cluster.helm.install(f"sapd-{rel}", chart, values_files=[chart / "values" / "smoke.yaml"],
                                 set_values=user_sets(inputs, f"sapd-{rel}", *extra), set_json=LR)
        roots[rel], notes[rel] = r.values["runRoot"], r.notes

    # manual mode: the stage Jobs appear only once their input is committed (the gates create them)
    def first_sight(job: str, k: int) -> bool:
        if cluster.job(job) is None:
            return False
        seen[job] = checkpoints.is_committed(roots["man"], k)
        return True
    cluster.wait_for(lambda: first_sight("sapd-man-teacher-scores-r0", 0), 600, "the manual teacher-scores-r0 Job")

    # dup: a second release on base's runRoot, once base's driver holds its lease: refused (exit 2, the Job
    # fails at once), nothing created
    cluster.wait_for(lambda: "pipeline: holding the lease of" in logs_of_job(cluster, "sapd-base-pipeline-1"), 600,
                     "sapd-base's driver to hold its run root's lease")
    cluster.helm.install("sapd-dup", CHART, values_files=[SMOKE], set_json=LR,
                         set_values=user_sets(inputs, "sapd-dup", f"runRoot={roots['base']}"))
    seen["dup state"] = cluster.wait_job("sapd-dup-pipeline-1", 600)
    seen["dup log"] = logs_of_job(cluster, "sapd-dup-pipeline-1")
    seen["dup jobs"] = sorted(j["metadata"]["name"] for j in cluster.store.list("Job", NS)
                              if j["metadata"]["name"].startswith("sapd-dup-"))

    # upg: `helm upgrade sapd-upg charts/sapd` (this chart's version) while train-r0, started by the previous
    # version's driver from the previous version's templates, runs. The tiny model trains in seconds, a real
    # one for hours: the train pod is paused (SIGSTOP) from its start until the new driver has met it
    # running, so the upgrade lands mid-stage whatever the load on this machine
    trainer = cluster.wait_pod("batch.kubernetes.io/job-name=sapd-upg-train-r0",
                               lambda p: p["status"].get("phase") == "Running", 900)
    uid = cluster.job("sapd-upg-train-r0")["metadata"]["uid"]
    seen["chart before"] = cluster.store.get("ConfigMap", NS, "sapd-upg-pipeline-templates")["metadata"]["labels"][
        "helm.sh/chart"]
    assert cluster.kill_pod(trainer["metadata"]["name"], signal.SIGSTOP)
    try:
        assert cluster.helm.upgrade("sapd-upg", CHART, reuse_values=True,
                                    set_values=["pipeline.logEverySeconds=30"]).revision == 2
        cluster.wait_for(lambda: cluster.job("sapd-upg-pipeline-1") is None, 60, "the first driver Job to go")
        cluster.wait_for(lambda: "job sapd-upg-train-r0: exists" in logs_of_job(cluster, "sapd-upg-pipeline-2"), 600,
                         "the new driver to find train-r0")
        seen["train alive after the upgrade"] = cluster.job("sapd-upg-train-r0") is not None
        seen["chart after"] = cluster.store.get("ConfigMap", NS, "sapd-upg-pipeline-templates")["metadata"][
            "labels"]["helm.sh/chart"]
    finally:
        cluster.kill_pod(trainer["metadata"]["name"], signal.SIGCONT)
    seen["train pod"] = trainer["metadata"]["name"]

    # ext: 1 round done (and evaluated), then 2
    finished(cluster, "sapd-ext-pipeline-1")
    seen["ext round 1 evaluation"] = evaluation(roots["ext"], 1)
    assert cluster.helm.upgrade("sapd-ext", reuse_values=True, set_values=["config.train.rounds=2"]).revision == 2

    # man: round 0 done, then round 1
    for gate in ("gate-train-r0", "gate-evaluate-r1"):
        name = next(j["metadata"]["name"] for j in cluster.store.list("Job", NS)
                    if j["metadata"]["name"].startswith(f"sapd-man-{gate}-"))
        seen[gate] = finished(cluster, name)  # its log, before the next revision's gates replace it
    cluster.helm.upgrade("sapd-man", reuse_values=True, set_values=["round=1"])
    for gate in ("gate-train-r1", "gate-evaluate-r2"):
        name = next(j["metadata"]["name"] for j in cluster.store.list("Job", NS)
                    if j["metadata"]["name"].startswith(f"sapd-man-{gate}-"))
        finished(cluster, name)

    for driver in ("sapd-base-pipeline-1", "sapd-upg-pipeline-2", "sapd-ext-pipeline-2"):
        finished(cluster, driver)
    return Releases(roots, notes, uid, seen)


def test_helm_upgrade_mid_stage_from_the_previous_chart_version_keeps_the_running_stage(releases, cluster):
    """Installed from the chart's previous version, upgraded to this one while train-r0 ran: the old driver
    Job went (Helm deletes what the new revision no longer renders), the train Job it had started from the
    previous version's templates did not: the new version's driver adopted it, and the run ends with the
    untouched run's weights."""
    upg = releases.roots["upg"]
    assert releases.seen["train alive after the upgrade"]
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())["version"]
    assert (releases.seen["chart before"], releases.seen["chart after"]) == (f"sapd-{PREVIOUS_CHART[1]}", f"sapd-{chart}")
    job = cluster.job("sapd-upg-train-r0")
    assert job["metadata"]["uid"] == releases.adopted_train_uid and job["metadata"]["annotations"]["sapd.io/attempt"] == "1"
    assert job["metadata"]["ownerReferences"][0]["kind"] == "ConfigMap"
    assert job["metadata"]["ownerReferences"][0]["name"] == "sapd-upg-pipeline-templates"
    (pod,) = cluster.pods("batch.kubernetes.io/job-name=sapd-upg-train-r0")
    assert pod["metadata"]["name"] == releases.seen["train pod"] and pod["status"]["phase"] == "Succeeded"
    log = logs_of_job(cluster, "sapd-upg-pipeline-2")
    assert "job sapd-upg-train-r0: exists (running, attempt 1), adopting it" in log
    assert "pipeline done: checkpoints [0, 1, 2] committed" in log
    assert_same_result(upg, releases.roots["base"])
    assert evaluation(upg, 2) == evaluation(releases.roots["base"], 2)
    # `helm uninstall` still removes every stage Job: they belong to the release's ConfigMap
    cluster.helm.uninstall("sapd-upg")
    cluster.wait_for(lambda: not [j for j in cluster.store.list("Job", NS)
                                  if j["metadata"]["name"].startswith("sapd-upg-")], 120, "sapd-upg's Jobs to go")


def test_a_second_release_on_a_running_root_is_refused_naming_the_holder(releases, cluster):
    """Two releases, one runRoot: the second's driver fails at once (exit 2, no retry) with one line naming
    the release that holds the root and the value that takes it over; it created no stage Job, and the
    first run ends with the result every other release reaches."""
    base = releases.roots["base"]
    assert releases.seen["dup state"] == "Failed" and releases.seen["dup jobs"] == ["sapd-dup-pipeline-1"]
    (error,) = [ln for ln in releases.seen["dup log"].splitlines() if "error:" in ln]
    # held by the release; the process named is whichever of its pods renewed last (driver or stage Job)
    assert error.startswith(f"pipeline: error: run root {base} is held by release sapd-base in namespace {NS} ("), error
    assert re.search(r"\(python -m sapd\.jobs\.\w+ on sapd-base-[a-z0-9-]+ pid \d+, since ", error), error
    assert error.endswith("take over now: helm upgrade sapd-dup --reuse-values --set pipeline.forceTakeover=true "
                          "(or run sapd.jobs.pipeline with --force-takeover)"), error
    (pod,) = cluster.pods("batch.kubernetes.io/job-name=sapd-dup-pipeline-1")
    assert pod["status"]["containerStatuses"][0]["state"]["terminated"]["exitCode"] == 2
    log = logs_of_job(cluster, "sapd-base-pipeline-1")
    assert "pipeline done: checkpoints [0, 1, 2] committed" in log and "this run's lease is held by" not in log


def test_more_rounds_extend_a_finished_run(releases, cluster):
    """`helm upgrade --reuse-values --set config.train.rounds=2` after a 1-round run: the new driver
    checks the run root (rounds may grow under a constant learning rate), skips round 0 and continues
    from checkpoint 1, to the result of a run that had 2 rounds from the start."""
    from sapd import layout, storage, yamlio
    ext = releases.roots["ext"]
    log = logs_of_job(cluster, "sapd-ext-pipeline-2")
    assert "stage train-r0: committed, skipping" in log and "job sapd-ext-train-r1: created" in log
    created = [ln.split()[1].rstrip(":") for ln in log.splitlines() if ln.startswith("job ") and ": created (" in ln]
    assert created == ["sapd-ext-teacher-scores-r1", "sapd-ext-train-r1", "sapd-ext-evaluate-r2"]
    assert_same_result(ext, releases.roots["base"])
    assert evaluation(ext, 2) == evaluation(releases.roots["base"], 2)
    assert releases.seen["ext round 1 evaluation"] == evaluation(ext, 1)  # the first revision's evaluation stays
    assert yamlio.load(storage.read_text(layout.config_uri(ext)))["train"]["rounds"] == 2


def test_manual_mode_gates_create_each_stage_once_its_input_is_committed(releases, cluster):
    """mode manual: Helm renders small gate Jobs; each stage Job (with its GPUs, on a GPU cluster) exists
    only from the moment its input is committed, so nothing waits inside a GPU pod and the evaluation's
    deadline is not eaten by waiting. Two rounds end in the pipeline's result."""
    man = releases.roots["man"]
    assert releases.seen["sapd-man-teacher-scores-r0"] is True  # checkpoint 0 was committed when it appeared
    gate_log = releases.seen["gate-evaluate-r1"]
    assert f"stage evaluate-r1: waiting for the output of train-r0 in {man}" in gate_log
    assert gate_log.index("its input (train-r0) is committed") < gate_log.index("job sapd-man-evaluate-r1: created")
    for stage in ("build-prefixes", "teacher-scores-r0", "train-r0", "evaluate-r1", "teacher-scores-r1", "train-r1",
                  "evaluate-r2"):
        job = cluster.job(f"sapd-man-{stage}")
        assert job is not None and cluster.job_state(f"sapd-man-{stage}") == "Complete", stage
        assert job["metadata"]["ownerReferences"][0]["name"] == "sapd-man-pipeline-templates"
        for p in cluster.pods(f"batch.kubernetes.io/job-name=sapd-man-{stage}"):
            assert not p["spec"].get("initContainers"), stage
    assert_same_result(man, releases.roots["base"])
    assert evaluation(man, 2) == evaluation(releases.roots["base"], 2)
    assert evaluation(man, 1)["checkpoint"] == 1
    assert "gate Job" in releases.notes["man"] and "--set round=1" in releases.notes["man"]


@pytest.fixture(scope="module", autouse=True)
def report_time():
    t0 = time.monotonic()
    yield
    print(f"\nlifecycle journeys: {time.monotonic() - t0:.0f}s")


# ------------------------------------------------------------------------------------------ queued


QUEUE = "sapd-queue"
TRAIN_DEADLINE = 45  # seconds: the train Job's activeDeadlineSeconds, shorter than its wait in the queue


@pytest.fixture(scope="module")
def queue_cluster(tmp_path_factory, inputs, s3_server):
    """A cluster with Kueue-like admission: LocalQueue `sapd-queue`'s quota admits the driver and any one
    stage of the smoke overlay except training (2 CPUs), until its admin raises it."""
    with journey_cluster(tmp_path_factory.mktemp("queue-cluster"), s3_server, textworld_cache=inputs.games,
                         queues={QUEUE: {"cpu": "1.5", "memory": "16Gi", "ephemeral-storage": "16Gi"}}) as c:
        yield c


def test_a_queued_stage_waits_for_admission_without_its_deadline_running(queue_cluster, inputs):
    """`helm install … --set kueue.queueName=sapd-queue`: every Job is created suspended and admitted by
    quota; train-r0 (2 CPUs, the persistent trainer of both rounds) does not fit while the driver and the
    scoring workers hold their share, so it stays suspended — the
    driver logs it as queued, longer than the Job's own activeDeadlineSeconds, without timing out or
    retrying — until the admin raises the quota; then it runs, within its deadline counted from
    admission, and the run completes."""
    from sapd import layout
    c = queue_cluster
    t0 = time.monotonic()
    c.helm.install("sapd-q", CHART, values_files=[SMOKE], set_json=LR, set_values=user_sets(
        inputs, "sapd-q", f"kueue.queueName={QUEUE}", f"train.activeDeadlineSeconds={TRAIN_DEADLINE}",
        "pipeline.logEverySeconds=10"))
    driver = "sapd-q-pipeline-1"

    def queued_for() -> int:
        """Seconds of the longest "queued" line the driver has logged for train-r0 (kubectl logs job/…)."""
        log = c.kubectl("-n", NS, "logs", f"job/{driver}", check=False)
        spans = re.findall(r"job sapd-q-train-r0: queued (\d+)m(\d\d)s: suspended", log)
        return max((int(m) * 60 + int(s) for m, s in spans), default=-1)
    c.wait_for(lambda: queued_for() > TRAIN_DEADLINE, 900, f"train-r0 queued longer than {TRAIN_DEADLINE}s")
    rows = {ln.split()[0]: ln.split()[1] for ln in c.kubectl("-n", NS, "get", "jobs").splitlines()[1:]}
    assert rows["sapd-q-train-r0"] == "Suspended" and rows[driver] == "Running", rows
    assert c.pods("batch.kubernetes.io/job-name=sapd-q-train-r0") == []
    # admitted before (its workers scored round 0 and wait for checkpoint 1, holding their quota: the persistent
    # workers of both pools are admitted for the whole run)
    assert c.job("sapd-q-teacher-scores-r0")["spec"]["suspend"] is False
    c.queues.set_quota(QUEUE, {"cpu": "4", "memory": "16Gi", "ephemeral-storage": "16Gi"})  # the admin adds capacity

    assert c.wait_job(driver, 900) == "Complete", c.describe()
    log = c.kubectl("-n", NS, "logs", f"job/{driver}")
    assert "job sapd-q-train-r0: queued 0m00s: suspended, waiting for admission by Kueue (LocalQueue sapd-queue)" in log
    assert re.search(r"job sapd-q-train-r0: running \d+m\d\ds: ", log), log
    assert "pipeline done: checkpoints [0, 1, 2] committed" in log and "not finished after" not in log
    train = c.job("sapd-q-train-r0")
    assert c.job_state("sapd-q-train-r0") == "Complete" and train["metadata"]["annotations"]["sapd.io/attempt"] == "1"
    assert not [cond for cond in train["status"]["conditions"] if cond.get("reason") == "DeadlineExceeded"]
    assert layout.committed_checkpoints(f"{inputs.prefix}/runs/sapd-q") == [0, 1, 2]
    # every Job of the release went through the queue: the driver's own, the stages', in creation order
    admitted = [e["name"] for e in c.store.events if e["reason"] == "QuotaReserved"]
    # (the persistent scoring Job is created with the prefix build: Kueue may admit either first)
    assert admitted[0] == driver and set(admitted[1:3]) == {"sapd-q-build-prefixes", "sapd-q-teacher-scores-r0"} \
        and admitted[3:] == ["sapd-q-train-r0", "sapd-q-evaluate-r2"], admitted
    print(f"\nqueued journey: {time.monotonic() - t0:.0f}s")
