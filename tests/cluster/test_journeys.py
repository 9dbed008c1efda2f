"""The user's journeys on a cluster, end to end: the chart installed with Helm's engine into the
harness cluster (tests/k8s_harness), every pod a real process running sapd's jobs as the chart's
user (uid 1000) in its image target's own environment (cpu for the smoke overlay; gpu and eval for
the TextWorld overlay, vLLM's CPU build standing in for vLLM), against a real S3 server (SeaweedFS), a
real Pushgateway and Prometheus on loopback. Nothing is stubbed in sapd: the pipeline driver pod finds
the API server through its kubeconfig and drives the run with the `kubernetes` client under the RBAC
the chart grants it. The user follows the runs with the real kubectl, running the docs' (docs/kubernetes/operate.md) and the
chart NOTES' commands, and the tests check what it prints.

Inputs are what a user uploads: a tiny student and teacher (same tokenizer) and TextWorld expert
games recorded with sapd's own collector, in S3; values come as `-f` overlays and `--set`s.
"""

from __future__ import annotations

import dataclasses
import json
import re
import signal
import subprocess
import time
import urllib.parse
import uuid
from pathlib import Path

import pytest
import torch
import yaml

from tests.conftest import debian_binary, free_port, get_url, wait_http
from tests.journey_util import NODE_CACHE, NS, checkpoint_weights, journey_cluster, upload_models, user_s3
from tests.k8s_harness import Cluster
from tests.k8s_harness.kubelet import warm_pod_ops
from tests.k8s_harness.prometheus import TargetWriter, prometheus_config

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "sapd"
SMOKE = CHART / "values" / "smoke.yaml"
TEXTWORLD = CHART / "values" / "textworld.yaml"
pytestmark = [pytest.mark.integration, pytest.mark.slow]
TIMINGS: dict[str, float] = {}


@dataclasses.dataclass
class Inputs:
    prefix: str
    games: Path
    endpoint: str

# the driver's preflight (sapd.run.check.STAGE_CHECKS["driver"]), before it creates any Job
DRIVER_CHECKS = "preflight: 8 checks passed (storage, run root, ranks, data, student, teacher, tokenizers, precision)"

@pytest.fixture(scope="module")
def inputs(tmp_path_factory, s3_server):
    """The user's uploads: models and expert games in S3 (and the games themselves, for a warm cache)."""
    from sapd.data.loaders import write_native_jsonl
    from sapd.envs.loop import LoopOptions, collect_expert
    from sapd.envs.panels import PanelSpec, episode_specs
    tmp = tmp_path_factory.mktemp("journey-inputs")
    with user_s3(s3_server):
        games = tmp / "games"
        # the smoke overlay's evaluation panel (simple + coin, one game each, seed 0): its expert games
        # are the training data too, so one generation serves both
        specs = episode_specs(PanelSpec("textworld", families=("simple", "coin"), games_per_family=1, seed=0,
                                        cache_dir=str(games)))
        trajs = collect_expert(specs, "textworld", successful_only=True, opts=LoopOptions(invalid_action="look"))
        assert len(trajs) == 2
        prefix = f"s3://{s3_server.bucket}/journeys-{uuid.uuid4().hex[:8]}"
        write_native_jsonl(trajs, f"{prefix}/data/textworld.jsonl")
        upload_models(tmp / "models", prefix)
        yield Inputs(prefix, games, s3_server.endpoint_url)


@dataclasses.dataclass
class Monitoring:
    pushgateway: str
    prometheus: str
    targets: Path


@pytest.fixture(scope="module")
def monitoring(tmp_path_factory):
    """Pushgateway + Prometheus scraping with manifests/prometheus-scrape-config.yaml's jobs."""
    tmp = tmp_path_factory.mktemp("monitoring")
    gw_port, prom_port = free_port(), free_port()
    targets = tmp / "pods.json"
    gw = subprocess.Popen([debian_binary("prometheus-pushgateway"), f"--web.listen-address=127.0.0.1:{gw_port}"],
                          stdout=(tmp / "pushgateway.log").open("w"), stderr=subprocess.STDOUT)
    cfg = tmp / "prometheus.yml"
    cfg.write_text(prometheus_config(f"http://127.0.0.1:{gw_port}", targets))
    prom = subprocess.Popen([debian_binary("prometheus"), f"--config.file={cfg}", f"--storage.tsdb.path={tmp / 'tsdb'}",
                             f"--web.listen-address=127.0.0.1:{prom_port}"],
                            stdout=(tmp / "prometheus.log").open("w"), stderr=subprocess.STDOUT)
    try:
        wait_http(f"http://127.0.0.1:{gw_port}/-/ready", gw, tmp / "pushgateway.log")
        wait_http(f"http://127.0.0.1:{prom_port}/-/ready", prom, tmp / "prometheus.log")
        yield Monitoring(f"http://127.0.0.1:{gw_port}", f"http://127.0.0.1:{prom_port}", targets)
    finally:
        for p in (prom, gw):
            p.terminate()
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, inputs, s3_server, monitoring):
    # a node whose shared cache already holds the evaluation panel's games (modelCache: hostPath)
    with journey_cluster(tmp_path_factory.mktemp("cluster"), s3_server, textworld_cache=inputs.games) as c:
        writer = TargetWriter(c, monitoring.targets)
        writer.seen = TARGETS_SEEN
        writer.start()
        try:
            yield c
        finally:
            writer.stop()


def user_sets(inputs: Inputs, monitoring: Monitoring, release: str, *extra: str) -> list[str]:
    """The `--set`s a user passes on top of an overlay: where their data, models, S3 and Pushgateway
    are, the workers, a fast poll, free ports on this one node, and the node's model cache. (A decimal
    for the run config goes through `--set-json`: `--set` makes "0.001" a string, which sapd refuses.)"""
    p = inputs.prefix
    return [f"runRoot={p}/runs/{release}", f"config.data.input={p}/data/textworld.jsonl",
            f"config.model.student={p}/models/student", f"config.model.teacher={p}/models/teacher",
            "config.sampling.max_new_tokens=12", "config.data.val_fraction=0", "config.train.trajectories_per_round=1",
            "teacherScores.parallelism=2", f"s3.endpoint={inputs.endpoint}", f"pushgateway.url={monitoring.pushgateway}",
            "pipeline.pollSeconds=0.5", "pipeline.logEverySeconds=60", "modelCache.type=hostPath",
            "pushgateway.settleSeconds=1", f"train.rendezvousPort={free_port()}", f"train.metricsPort={free_port()}",
            *extra]


def pods_of(cluster: Cluster, job: str, **labels: str) -> list[dict]:
    sel = ",".join([f"batch.kubernetes.io/job-name={job}", *(f"{k}={v}" for k, v in labels.items())])
    return cluster.pods(sel)


def driver_log(cluster: Cluster, job: str) -> str:
    return "\n".join(cluster.logs(p["metadata"]["name"]) for p in pods_of(cluster, job))


def created_order(log: str) -> list[str]:
    return [ln.split()[1].rstrip(":") for ln in log.splitlines() if ln.startswith("job ") and ": created (" in ln]


def query(prom: str, expr: str) -> list[dict]:
    body = json.loads(get_url(f"{prom}/api/v1/query?query={urllib.parse.quote(expr)}"))
    assert body["status"] == "success", body
    return body["data"]["result"]


def wait_query(prom: str, expr: str, seconds: float = 30.0) -> list[dict]:
    deadline = time.time() + seconds
    while True:
        result = query(prom, expr)
        if result or time.time() > deadline:
            return result
        time.sleep(0.5)


# ------------------------------------------------------------------------------------------ the default path

LR = ["config.train.lr=0.001"]
ROUNDS = 4  # the smoke overlay's run, four rounds long (issue 34: persistent workers shown over ≥ 4 rounds)
# the default, persistent stage Jobs: one scoring Job and one train Job serve every round, created with the
# prefix build (their pods start up while it runs); then the last checkpoint's validation (nothing to score:
# checkpoint ROUNDS's distance to the teacher, the default validation) and the evaluation
ORDER = ["teacher-scores-r0", "train-r0", "build-prefixes", f"teacher-scores-r{ROUNDS}", f"evaluate-r{ROUNDS}"]
CHECKPOINTS = list(range(ROUNDS + 1))


@pytest.fixture(scope="module")
def smoke(cluster, inputs, monitoring):
    """`helm install sapd-smoke charts/sapd -f charts/sapd/values/smoke.yaml --set …`, then nothing by hand."""
    t0 = time.monotonic()
    # one of the two trajectories held out (the users' sets hold none out): the per-round validation runs too
    rel = cluster.helm.install("sapd-smoke", CHART, values_files=[SMOKE],
                               set_values=user_sets(inputs, monitoring, "sapd-smoke", f"config.train.rounds={ROUNDS}"),
                               set_json=[*LR, "config.data.val_fraction=0.5"])
    state = cluster.wait_job("sapd-smoke-pipeline-1", timeout=1200)
    TIMINGS["smoke install → run complete"] = time.monotonic() - t0
    print(cluster.timeline())
    return dataclasses.make_dataclass("Run", ["release", "state", "root"])(rel, state, rel.values["runRoot"])


def test_smoke_install_finishes_four_rounds_and_an_evaluation(smoke, cluster):
    from sapd import layout, storage
    from sapd.data import shards
    assert smoke.state == "Complete", cluster.describe()
    assert "kubectl -n sapd logs -f job/sapd-smoke-pipeline-1" in smoke.release.notes
    log = driver_log(cluster, "sapd-smoke-pipeline-1")
    assert created_order(log) == [f"sapd-smoke-{s}" for s in ORDER], log
    assert f"pipeline done: checkpoints {CHECKPOINTS} committed" in log
    # its first step: the checks, on the real S3 server, before it created any Job
    assert log.index(DRIVER_CHECKS) < log.index("pipeline: release")
    for s in ORDER:
        assert cluster.job_state(f"sapd-smoke-{s}") == "Complete", s
    assert layout.committed_checkpoints(smoke.root) == CHECKPOINTS
    result = storage.read_json(storage.join(layout.evals_dir(smoke.root, ROUNDS), "textworld.json"))
    assert result["checkpoint"] == ROUNDS and result["overall"]["episodes"] == 2
    assert set(result["by_category"]) == {"simple", "coin"} and result["horizon"] == 8  # the smoke panel
    # each checkpoint's validation was committed by the scoring workers (the last one's by the validation-only
    # teacher-scores Job), on held-out prefixes the smoke build keeps (val_fraction 0.5)
    from sapd.data import validation
    for k in range(ROUNDS + 1):
        v = validation.read(smoke.root, k)
        assert v["workers"] == 2 and v["prefixes"] > 0 and v["overall"]["reverse_kl_per_token"]["value"] is not None
    # one scoring Job and one train Job served every round (their rounds annotated), and the driver logged
    # each round's commits as they came
    for stage in ("teacher-scores", "train"):
        assert cluster.job(f"sapd-smoke-{stage}-r0")["metadata"]["annotations"]["sapd.io/rounds"] == f"0-{ROUNDS - 1}"
    for k in range(ROUNDS):
        assert f"round {k}: checkpoint {k + 1} committed (sapd-smoke-train-r0," in log, log
    # the scored rounds were committed by their last worker (the driver's commit then finds them done)
    worker_logs = [cluster.logs(p["metadata"]["name"]) for p in pods_of(cluster, "sapd-smoke-teacher-scores-r0")]
    assert len(worker_logs) == 2
    for k in range(ROUNDS):
        assert shards.read_manifest(layout.scored_dir(smoke.root, k))["workers"] == 2
        assert sum(f"round {k}: committed" in t for t in worker_logs) >= 1
    # the pods ran under the rendered pod specs: GPU-free, read-only root filesystem honoured
    assert cluster.kubelet.rootfs_writes == []
    # the driver drove it through the API with its own ServiceAccount and the Role the chart grants
    driver_calls = [r for r in cluster.api.requests if r[0] == "system:serviceaccount:sapd:sapd-smoke-pipeline"]
    assert {(m, c) for _, m, _, c in driver_calls} >= {("POST", 201), ("GET", 200)}
    assert not [r for r in driver_calls if r[3] in (401, 403)], driver_calls
    # stage Jobs belong to the release's pipeline-templates ConfigMap, which every revision keeps: an
    # upgrade never deletes a running stage, `helm uninstall` removes them with it
    owner = cluster.store.get("ConfigMap", NS, "sapd-smoke-pipeline-templates")["metadata"]["uid"]
    for s in ORDER:
        (ref,) = cluster.job(f"sapd-smoke-{s}")["metadata"]["ownerReferences"]
        assert (ref["kind"], ref["name"], ref["uid"]) == ("ConfigMap", "sapd-smoke-pipeline-templates", owner), s


def test_each_stage_pod_loads_each_model_once_and_reports_its_startup(smoke, cluster):
    """Issue 34: the scoring workers load the teacher and the student once for the four rounds (later
    checkpoints go into the live engine), the trainer its student once (later rounds keep it in memory);
    every stage pod logs its start-up phases once."""
    assert smoke.state == "Complete"
    workers = pods_of(cluster, "sapd-smoke-teacher-scores-r0")
    (trainer,) = pods_of(cluster, "sapd-smoke-train-r0")
    assert len(workers) == 2
    for pod, loads in [*((w, ["teacher", "student"]) for w in workers), (trainer, ["student"])]:
        log = cluster.logs(pod["metadata"]["name"])
        assert re.findall(r"^model load: (\w+)", log, re.M) == loads, log
        assert len(re.findall(r"^startup: imports [\d.]+s, models loaded [\d.]+s, engines ready [\d.]+s, first work "
                              r"[\d.]+s", log, re.M)) == 1, log
    trainer_log = cluster.logs(trainer["metadata"]["name"])
    assert [int(k) for k in re.findall(r"^weights: checkpoint (\d+) kept in memory", trainer_log, re.M)] == \
        list(range(1, ROUNDS))
    for w in workers:
        log = cluster.logs(w["metadata"]["name"])
        assert [int(k) for k in re.findall(r"^weights: student checkpoint (\d+) in place", log, re.M)] == \
            list(range(1, ROUNDS))
    for job in ("sapd-smoke-build-prefixes", f"sapd-smoke-evaluate-r{ROUNDS}"):
        (pod,) = pods_of(cluster, job)
        assert "startup: imports" in cluster.logs(pod["metadata"]["name"]) or job.endswith(f"r{ROUNDS}"), job


def notes_commands(notes: str, **placeholders: str) -> list[list[str]]:
    """The kubectl command lines of the chart's NOTES (without `kubectl`), placeholders filled in."""
    out = []
    for line in notes.splitlines():
        line = line.strip()
        if line.startswith("kubectl "):
            for k, v in placeholders.items():
                line = line.replace(f"<{k}>", v)
            out.append(line.split()[1:])
    return out


KUBECTL_SEEN: dict[str, str] = {}  # command → output, printed at the end (the examples of docs/kubernetes/operate.md)


def kubectl(cluster: Cluster, *args: str) -> str:
    out = cluster.kubectl(*args)
    KUBECTL_SEEN["kubectl " + " ".join(args)] = out
    return out


def test_the_readme_and_notes_kubectl_commands_show_the_run(smoke, cluster):
    """What docs/kubernetes/operate.md "Following a run" and the chart's NOTES tell the user to type, with the real
    kubectl: the Jobs of the release and their status, the driver's log, one stage's pods by label."""
    assert smoke.state == "Complete"
    commands = notes_commands(smoke.release.notes, job="sapd-smoke-teacher-scores-r0")
    assert commands[:2] == [["-n", NS, "get", "jobs", "-l", "app.kubernetes.io/instance=sapd-smoke"],
                            ["-n", NS, "logs", "-f", "job/sapd-smoke-pipeline-1"]], commands
    creates = [c for c in commands if c[2:4] == ["create", "job"]]
    assert creates == [["-n", NS, "create", "job", "--from=cronjob/sapd-smoke-evaluate-cron", "sapd-smoke-eval-now"]]
    commands = [c for c in commands if c not in creates]
    assert len(commands) >= 3 and all(c[:4] == ["-n", NS, "logs", "-l"] for c in commands[2:]), commands
    jobs, driver, *by_label = [kubectl(cluster, *c) for c in commands]
    rows = [ln.split() for ln in jobs.splitlines()]
    assert rows[0] == ["NAME", "STATUS", "COMPLETIONS", "DURATION", "AGE"]
    assert {r[0]: (r[1], r[2]) for r in rows[1:]} == {
        "sapd-smoke-pipeline-1": ("Complete", "1/1"), "sapd-smoke-build-prefixes": ("Complete", "1/1"),
        "sapd-smoke-teacher-scores-r0": ("Complete", "2/2"), "sapd-smoke-train-r0": ("Complete", "1/1"),
        f"sapd-smoke-teacher-scores-r{ROUNDS}": ("Complete", "2/2"), f"sapd-smoke-evaluate-r{ROUNDS}": ("Complete", "1/1")}
    # the driver's whole log (one pod, so no "Found N pods" choice), as `logs -f` prints it once it ended
    assert driver == driver_log(cluster, "sapd-smoke-pipeline-1")
    assert DRIVER_CHECKS in driver and f"pipeline done: checkpoints {CHECKPOINTS} committed" in driver
    worker0 = [p for p in pods_of(cluster, "sapd-smoke-teacher-scores-r0")
               if p["metadata"]["labels"]["batch.kubernetes.io/job-completion-index"] == "0"]
    # NOTES' first by-label command names completion index 0: that worker's log (with a selector kubectl
    # shows the last 10 lines of each pod unless --tail says otherwise)
    assert "batch.kubernetes.io/job-completion-index=0" in commands[2][4]
    whole = cluster.logs(worker0[-1]["metadata"]["name"]).splitlines()
    assert by_label[0].splitlines() == (whole if "--tail=-1" in commands[2] else whole[-10:])
    # the whole log of every worker, each line prefixed with its pod
    everything = kubectl(cluster, "-n", NS, "logs", "-l", "batch.kubernetes.io/job-name=sapd-smoke-teacher-scores-r0",
                         "--prefix", "--tail=-1")
    prefixes = {ln.split("]")[0] + "]" for ln in everything.splitlines()}
    assert prefixes == {f"[pod/{p['metadata']['name']}/teacher-scores]" for p in pods_of(cluster, "sapd-smoke-teacher-scores-r0")}
    assert all(f"round {k}: committed" in everything for k in range(ROUNDS))
    # describe: the Job's defaulted selector finds exactly its pods
    described = kubectl(cluster, "-n", NS, "describe", "job", "sapd-smoke-train-r0")
    uid = cluster.job("sapd-smoke-train-r0")["metadata"]["uid"]
    assert f"batch.kubernetes.io/controller-uid={uid}" in described
    assert re.search(r"Pods Statuses: +0 Active \(0 Ready\) / 1 Succeeded / 0 Failed", described), described
    pods = kubectl(cluster, "-n", NS, "get", "pods", "-l", "batch.kubernetes.io/job-name=sapd-smoke-train-r0")
    assert [ln.split()[1:3] for ln in pods.splitlines()[1:]] == [["0/1", "Completed"]]
    # NOTES' CronJob line, as typed (kubectl sends that Job as protobuf): an evaluation now, which finds the
    # final checkpoint evaluated by the driver already
    assert kubectl(cluster, *creates[0]).strip() == "job.batch/sapd-smoke-eval-now created"
    assert cluster.wait_job("sapd-smoke-eval-now", 300) == "Complete", cluster.describe()
    now = cluster.job("sapd-smoke-eval-now")
    assert now["metadata"]["ownerReferences"][0]["name"] == "sapd-smoke-evaluate-cron"
    assert now["metadata"]["annotations"]["cronjob.kubernetes.io/instantiate"] == "manual"
    assert f"checkpoint {ROUNDS}: textworld already evaluated" in kubectl(cluster, "-n", NS, "logs",
                                                                          "job/sapd-smoke-eval-now")


def test_prometheus_sees_the_train_pods_metrics_and_each_workers_push(smoke, cluster, monitoring):
    assert smoke.state == "Complete"
    prom = monitoring.prometheus
    # rank 0 of each train Job, found through the manifest's relabel rules, scraped while it trained
    scraped = wait_query(prom, 'max_over_time(up{job="sapd-train", release="sapd-smoke"}[1h]) == 1')
    pods = {r["metric"]["pod"] for r in scraped}
    assert pods and all(p.startswith("sapd-smoke-train-r0-0-") for p in pods), pods  # one trainer, every round
    steps = wait_query(prom, 'max_over_time(sapd_optimizer_steps_total{job="sapd-train", release="sapd-smoke"}[1h])')
    assert steps and all(r["metric"]["namespace"] == NS and r["metric"]["round"] == "0" for r in steps)
    # the trainer's start-up phases, scraped from rank 0 (sapd_startup_seconds, issue 34)
    startup = wait_query(prom, 'max_over_time(sapd_startup_seconds{job="sapd-train", release="sapd-smoke"}[1h])')
    assert {r["metric"]["phase"] for r in startup} == {"imports", "models_loaded", "engines_ready", "first_work"}
    # the two teacher-scores workers pushed under their own grouping keys (instance = completion index), their
    # start-up too
    pushed = wait_query(prom, 'sapd_job_last_success_timestamp_seconds{job="teacher_scores", release="sapd-smoke"}')
    assert {r["metric"]["instance"] for r in pushed} == {"0", "1"}
    first_work = wait_query(prom, 'sapd_startup_seconds{job="teacher_scores", release="sapd-smoke", phase="first_work"}')
    assert {r["metric"]["instance"] for r in first_work} == {"0", "1"}
    assert all(0 < float(r["value"][1]) < 600 for r in first_work), first_work
    evals = wait_query(prom, 'sapd_eval_success_ratio{release="sapd-smoke", category="all"}')
    assert evals and evals[0]["metric"]["benchmark"] == "textworld"
    # the distance to the teacher, pushed by the teacher-scores workers (the newest: the last checkpoint's)
    kl = wait_query(prom, 'sapd_validation_reverse_kl{job="teacher_scores", release="sapd-smoke", category="all"}')
    assert kl and all(float(r["value"][1]) == float(kl[0]["value"][1]) for r in kl)
    (ckpt, *_) = wait_query(prom, 'max(sapd_validation_checkpoint{job="teacher_scores", release="sapd-smoke"})')
    assert float(ckpt["value"][1]) == ROUNDS
    match = wait_query(prom, 'sapd_validation_action_match_ratio{release="sapd-smoke", category="all"}')
    assert {r["metric"]["model"] for r in match} == {"student", "teacher"}


def test_helm_test_preflight_passes(smoke, cluster):
    (result,) = cluster.helm.test("sapd-smoke", timeout=120)
    assert result == ("sapd-smoke-preflight", "Succeeded"), cluster.describe()
    out = cluster.logs("sapd-smoke-preflight")
    assert "check run root: ok" in out and "check pushgateway: ok" in out and "check: 10/10 passed" in out


def test_helm_upgrade_replaces_the_driver_which_finds_the_run_done(smoke, cluster):
    """Jobs are immutable: the upgrade creates the next revision's driver instead of patching the
    finished one; it skips every committed stage and creates nothing."""
    assert smoke.state == "Complete"
    rel = cluster.helm.upgrade("sapd-smoke", reuse_values=True, set_values=["pipeline.logEverySeconds=30"])
    assert rel.revision == 2
    assert cluster.wait_job("sapd-smoke-pipeline-2", 300) == "Complete", cluster.describe()
    cluster.wait_for(lambda: cluster.job("sapd-smoke-pipeline-1") is None, 60, "the first driver Job to go")
    log = driver_log(cluster, "sapd-smoke-pipeline-2")
    assert created_order(log) == [] and "Jobs created 0" in log
    assert f"stage train-r{ROUNDS - 1}: committed, skipping" in log
    assert f"stage evaluate-r{ROUNDS}: committed, skipping" in log


# ------------------------------------------------------------------------------------------ faults


def test_killed_pods_end_in_the_same_committed_result(smoke, cluster, inputs, monitoring):
    """The persistent workers of four rounds, killed one after the other, each in the middle of a round:
    SIGKILL a teacher-scores worker while it scores round 1, the driver while round 2 trains, the trainer
    as it starts round 3. The Indexed Job restarts the worker, which skips what is committed and redoes
    its part; the driver's restart adopts both running Jobs; the driver recreates the train Job, which
    resumes from checkpoint 3. The run completes, to the scores, weights and evaluation of the undisturbed
    smoke run."""
    from sapd import checkpoints, layout, storage
    from sapd.data.scored import read_scored
    assert smoke.state == "Complete"
    t0 = time.monotonic()
    # the undisturbed smoke run's config exactly (its held-out share too), so the results can be compared
    rel = cluster.helm.install("sapd-kill", CHART, values_files=[SMOKE], set_json=[*LR, "config.data.val_fraction=0.5"],
                               set_values=user_sets(inputs, monitoring, "sapd-kill", f"config.train.rounds={ROUNDS}"))
    root = rel.values["runRoot"]
    running = lambda p: p["status"].get("phase") == "Running"  # noqa: E731

    # 1. teacher-scores worker 1, once it has started scoring round 1
    sel = "batch.kubernetes.io/job-name=sapd-kill-teacher-scores-r0,batch.kubernetes.io/job-completion-index=1"
    worker = cluster.wait_log(sel, "round 1 worker 1/2:", 600)
    assert cluster.kill_pod(worker["metadata"]["name"], signal.SIGKILL)
    # 2. the driver, while round 2 trains. The tiny model trains a round in seconds, a real one for minutes:
    # the trainer is paused (SIGSTOP) until the new driver has adopted it, so round 3 comes after that
    train_sel = "batch.kubernetes.io/job-name=sapd-kill-train-r0"
    paused = cluster.wait_log(train_sel, "round 2 step", 600)
    assert cluster.kill_pod(paused["metadata"]["name"], signal.SIGSTOP)  # torchrun and its workers
    try:
        (driver,) = [p for p in pods_of(cluster, "sapd-kill-pipeline-1") if running(p)]
        assert cluster.kill_pod(driver["metadata"]["name"], signal.SIGKILL)
        cluster.wait_for(lambda: "job sapd-kill-train-r0: exists (running, attempt 1), adopting it"
                         in driver_log(cluster, "sapd-kill-pipeline-1"), 600, "the new driver to adopt train-r0")
    finally:
        cluster.kill_pod(paused["metadata"]["name"], signal.SIGCONT)
    # 3. the trainer, in round 3: paused as it starts the round (its weights kept from round 2), seen not to
    # have committed checkpoint 4, killed (its workers with it: the container's every process)
    trainer = cluster.wait_log(train_sel, "weights: checkpoint 3 kept in memory", 600)
    assert cluster.kill_pod(trainer["metadata"]["name"], signal.SIGSTOP)
    assert not checkpoints.is_committed(root, 4)
    assert cluster.kill_pod(trainer["metadata"]["name"], signal.SIGKILL)

    assert cluster.wait_job("sapd-kill-pipeline-1", 1200) == "Complete", cluster.describe()
    TIMINGS["killed run (3 SIGKILLs)"] = time.monotonic() - t0
    exit_codes = {p["metadata"]["name"]: p["status"]["containerStatuses"][0]["state"]["terminated"]["exitCode"]
                  for p in cluster.pods("app.kubernetes.io/instance=sapd-kill")
                  if p["status"]["phase"] == "Failed"}
    # the worker and the driver pods stay as Failed (137 = SIGKILL); the killed train pod went with its
    # Job, which the driver deleted and created again (the whole torchrun group restarts)
    assert sorted(exit_codes) == sorted([driver["metadata"]["name"], worker["metadata"]["name"]]), exit_codes
    assert set(exit_codes.values()) == {137}
    assert cluster.job("sapd-kill-teacher-scores-r0")["status"]["failed"] == 1  # index 1 retried in place
    assert cluster.job("sapd-kill-train-r0")["metadata"]["annotations"]["sapd.io/attempt"] == "2", \
        driver_log(cluster, "sapd-kill-pipeline-1")
    log = driver_log(cluster, "sapd-kill-pipeline-1")
    # the restarted driver found both Jobs (named for round 0) while they served round 2
    assert "job sapd-kill-train-r0: exists (running, attempt 1), adopting it" in log
    assert "job sapd-kill-teacher-scores-r0: exists (running, attempt 1), adopting it" in log
    assert "stage train-r1: committed, skipping" in log
    assert "job sapd-kill-train-r0: attempt 1/3 failed: BackoffLimitExceeded" in log
    assert f"log lines of failed pod {trainer['metadata']['name']}:" in log  # why, in the driver's own log
    # the replacements loaded their models once and went on from the commits: the restarted worker skipped
    # round 0 and redid its part of round 1; the new trainer loaded checkpoint 3 and trained round 3 only
    (again,) = [p for p in cluster.pods(sel) if p["metadata"]["name"] != worker["metadata"]["name"]]
    again_log = cluster.logs(again["metadata"]["name"])
    assert "stage teacher-scores-r0: committed, skipping" in again_log
    assert re.findall(r"^model load: (\w+)", again_log, re.M) == ["teacher", "student"], again_log
    (new_trainer,) = [p for p in cluster.pods(train_sel) if p["metadata"]["name"] != trainer["metadata"]["name"]]
    new_log = cluster.logs(new_trainer["metadata"]["name"])
    assert re.findall(r"^model load: student checkpoint (\d+)", new_log, re.M) == ["3"], new_log
    # the same committed result as the undisturbed run
    assert layout.committed_checkpoints(root) == CHECKPOINTS
    for k in range(ROUNDS):
        a, b = read_scored(smoke.root, k), read_scored(root, k)
        assert a.sort_by("prefix_id").select(["prefix_id", "response_token_ids", "teacher_logprobs"]).equals(
            b.sort_by("prefix_id").select(["prefix_id", "response_token_ids", "teacher_logprobs"])), k
    for k in range(1, ROUNDS + 1):
        wa, wb = checkpoint_weights(smoke.root, k), checkpoint_weights(root, k)
        assert wa.keys() == wb.keys()
        for name in wa:  # bit for bit: the killed run loaded from commits what the other kept in memory
            assert torch.equal(wa[name], wb[name]), f"checkpoint {k} {name}: {float((wa[name] - wb[name]).abs().max())}"
    ev = lambda r: storage.read_json(storage.join(layout.evals_dir(r, ROUNDS), "textworld.json"))  # noqa: E731
    assert {k: ev(root)[k] for k in ("overall", "by_category")} == {k: ev(smoke.root)[k] for k in ("overall", "by_category")}


# ------------------------------------------------------------------------------------------ manual mode, CronJob


def gate_jobs(cluster: Cluster, release: str) -> dict[str, str]:
    """mode manual: stage of the current revision's gates (e.g. "train-r0") → its gate Job's name,
    `<release>-gate-<stage>-r<K>-<values hash>`."""
    out = {}
    for d in cluster.helm.releases[release].manifests:
        name = d["metadata"]["name"]
        if d["kind"] == "Job" and name.startswith(f"{release}-gate-"):
            out[name[len(release) + 6:].rsplit("-", 1)[0]] = name
    return out


def job_log(cluster: Cluster, job: str) -> str:
    return "\n".join(cluster.logs(p["metadata"]["name"]) for p in pods_of(cluster, job))


def eval_now(cluster: Cluster, cron: str, name: str) -> str:
    """docs/kubernetes/operate.md "Evaluation": `kubectl create job --from=cronjob/<cron> <name>`, run to the end: the evaluation's log."""
    assert kubectl(cluster, "-n", NS, "create", "job", f"--from=cronjob/{cron}", name).strip() == f"job.batch/{name} created"
    assert cluster.wait_job(name, 300) == "Complete", cluster.describe()
    return kubectl(cluster, "-n", NS, "logs", f"job/{name}")


CPU_TEXTWORLD = [  # the TextWorld overlay (GPU pools, the gpu and eval images) on this CPU node: the user's --sets
    "config.model.device=cpu", "config.model.dtype=float32", "config.sampling.backend=hf",
    "config.sampling.group_size=2", "config.train.rounds=2", "config.train.minibatch_prefixes=2",
    "config.train.micro_batch_prefixes=1", "config.train.zero_stage=1", "train.parallelism=2", "train.procsPerPod=1",
    *(f"{job}.resources.{b}.nvidia\\.com/gpu=null" for job in ("teacherScores", "train", "evaluate")
      for b in ("requests", "limits")),
    # DeepSpeed on CPU: its gloo accelerator (its one JIT op, which the gpu image lacks, built before the pods
    # start into the folder the harness gives the image's pods: warm_pod_ops)
    "train.extraEnv[0].name=DS_ACCELERATOR", "train.extraEnv[0].value=cpu",
    "train.extraEnv[1].name=OMP_NUM_THREADS", "train.extraEnv[1].value=1",
    "evaluate.args={--families,simple,--games-per-family,1,--horizon,8}",
]


def test_textworld_overlay_in_manual_mode_two_train_pods_and_the_cronjob(cluster, inputs, monitoring):
    """`-f textworld.yaml` on CPU, mode manual: Helm creates a small gate Job per stage of the round; each
    waits (no stage Job, no GPU held) until its input is committed, then creates its stage Job and sees it
    through; training runs on two pods meeting through the headless Service (DeepSpeed, gloo);
    Prometheus scrapes rank 0 only; the evaluation gate of checkpoint `round` + 1 evaluates it once it is
    committed, and the evaluation CronJob, run with the docs' `kubectl create job --from=cronjob/…`, finds nothing
    to evaluate before checkpoint 0, skips a checkpoint the gate evaluated, and evaluates a new one the gate has
    not reached yet (which the gate then finds evaluated): each checkpoint is evaluated once."""
    from sapd import layout, storage
    from sapd.data import shards
    t0 = time.monotonic()
    op = warm_pod_ops("gpu") / "deepspeed_shm_comm" / "deepspeed_shm_comm.so"  # DeepSpeed's CPU op for the gpu
    built = op.stat().st_mtime_ns  # image's train pods, built once per checkout
    cluster.host_path(NODE_CACHE, owner=(1000, 1000))
    rel_name, cron = "sapd-tw", "sapd-tw-evaluate-cron"
    sets = user_sets(inputs, monitoring, rel_name, *CPU_TEXTWORLD, "mode=manual", "round=0", "manual.pollSeconds=1",
                     "buildPrefixes.enabled=false")
    rel = cluster.helm.install(rel_name, CHART, values_files=[TEXTWORLD], set_values=sets, set_json=LR)
    root = rel.values["runRoot"]
    first = gate_jobs(cluster, rel_name)
    assert set(first) == {"teacher-scores-r0", "train-r0", "evaluate-r1"}  # Helm created the gates at once; they wait
    cluster.wait_for(lambda: "stage teacher-scores-r0: waiting for the output of build-prefixes"
                     in job_log(cluster, first["teacher-scores-r0"]), 120, "the teacher-scores gate to wait")
    assert cluster.job("sapd-tw-teacher-scores-r0") is None and cluster.job("sapd-tw-train-r0") is None
    gate_pods = [p for g in first.values() for p in pods_of(cluster, g)]
    assert gate_pods and all("nvidia.com/gpu" not in str(c.get("resources")) for p in gate_pods
                             for c in p["spec"]["containers"])  # the gates hold no GPU
    # the CronJob before any checkpoint: nothing to evaluate, and a success (no retries on a GPU node)
    assert "nothing to evaluate" in eval_now(cluster, cron, "sapd-tw-eval-0")

    cluster.helm.upgrade(rel_name, reuse_values=True, set_values=["buildPrefixes.enabled=true"])
    gates = gate_jobs(cluster, rel_name)  # a changed value: new gates (new names), the old ones deleted
    assert set(gates) == {"build-prefixes", "teacher-scores-r0", "train-r0", "evaluate-r1"}
    assert not set(gates.values()) & set(first.values())
    cluster.wait_for(lambda: not any(cluster.job(n) for n in first.values()), 60, "the first revision's gates to go")
    assert cluster.wait_job(gates["train-r0"], 900) == "Complete", cluster.describe()
    assert layout.committed_checkpoints(root) == [0, 1]
    ts_gate = job_log(cluster, gates["teacher-scores-r0"])
    assert ts_gate.index("its input (build-prefixes) is committed") < ts_gate.index("job sapd-tw-teacher-scores-r0: created")
    train_gate = job_log(cluster, gates["train-r0"])
    assert train_gate.index("its input (teacher-scores-r0) is committed") < train_gate.index("job sapd-tw-train-r0: created")
    for stage in ("build-prefixes", "teacher-scores-r0", "train-r0"):  # plain stage Jobs, owned by the ConfigMap
        assert cluster.job_state(f"sapd-tw-{stage}") == "Complete", stage
        assert cluster.job(f"sapd-tw-{stage}")["metadata"]["ownerReferences"][0]["name"] == "sapd-tw-pipeline-templates"
        assert all(not p["spec"].get("initContainers") for p in pods_of(cluster, f"sapd-tw-{stage}"))
    train_pods = pods_of(cluster, "sapd-tw-train-r0")
    assert sorted(p["metadata"]["labels"]["batch.kubernetes.io/job-completion-index"] for p in train_pods) == ["0", "1"]
    assert all(p["status"]["phase"] == "Succeeded" for p in train_pods)
    assert shards.read_manifest(layout.scored_dir(root, 0))["workers"] == 2  # committed by the last worker
    rank0 = next(p for p in train_pods if p["metadata"]["labels"]["batch.kubernetes.io/job-completion-index"] == "0")
    assert "round 0: checkpoint 1 committed" in cluster.logs(rank0["metadata"]["name"])
    assert op.stat().st_mtime_ns == built  # the train pods loaded the op built before them: they compiled nothing

    # checkpoint 1: evaluated by its gate's evaluation Job, then skipped by the CronJob
    assert cluster.wait_job(gates["evaluate-r1"], 900) == "Complete", cluster.describe()
    assert "checkpoint 1: 1 textworld episodes" in job_log(cluster, "sapd-tw-evaluate-r1")
    first_eval = storage.read_json(storage.join(layout.evals_dir(root, 1), "textworld.json"))
    assert "checkpoint 1: textworld already evaluated" in eval_now(cluster, cron, "sapd-tw-eval-1")

    cluster.helm.upgrade(rel_name, reuse_values=True, set_values=["round=1"])
    gates = gate_jobs(cluster, rel_name)
    assert {"teacher-scores-r1", "train-r1", "evaluate-r2"} <= set(gates)
    # checkpoint 2: the CronJob first (the gate, waiting for the checkpoint, is paused), then the gate finds it done
    gate = cluster.wait_pod(f"batch.kubernetes.io/job-name={gates['evaluate-r2']}",
                            lambda p: p["status"].get("phase") == "Running", 120, "the evaluation gate to run")
    # paused once it waits (past its check of whether checkpoint 2 is evaluated), not while it starts: a gate
    # that starts after the CronJob's evaluation skips its step and creates no Job
    cluster.wait_for(lambda: "stage evaluate-r2: waiting for the output of" in job_log(cluster, gates["evaluate-r2"]),
                     120, "the evaluation gate to wait for checkpoint 2")
    assert cluster.kill_pod(gate["metadata"]["name"], signal.SIGSTOP)
    try:
        assert cluster.wait_job(gates["train-r1"], 900) == "Complete", cluster.describe()
        assert cluster.job_state("sapd-tw-train-r1") == "Complete"
        assert layout.committed_checkpoints(root) == [0, 1, 2]
        out2 = eval_now(cluster, cron, "sapd-tw-eval-2")
    finally:
        cluster.kill_pod(gate["metadata"]["name"], signal.SIGCONT)
    assert "checkpoint 2: 1 textworld episodes" in out2 and "checkpoint 1" not in out2  # only the new one
    assert cluster.wait_job(gates["evaluate-r2"], 900) == "Complete", cluster.describe()
    assert "checkpoint 2: textworld already evaluated" in job_log(cluster, "sapd-tw-evaluate-r2")
    assert storage.read_json(storage.join(layout.evals_dir(root, 1), "textworld.json")) == first_eval
    assert not storage.exists(storage.join(layout.evals_dir(root, 0), "textworld.json"))
    assert "checkpoint 2: textworld already evaluated" in eval_now(cluster, cron, "sapd-tw-eval-3")
    TIMINGS["textworld overlay, manual mode, 2 train pods, 4 CronJob runs"] = time.monotonic() - t0
    # the overlay's images: the stages on gpu, the evaluation CronJob's Jobs on eval (the benchmarks)
    images = {p["metadata"]["labels"]["app.kubernetes.io/component"]: p["spec"]["containers"][0]["image"]
              for p in cluster.pods(f"app.kubernetes.io/instance={rel_name}")}
    assert images["train"].endswith("-gpu") and images["teacher-scores"].endswith("-gpu"), images
    # the evaluation's Jobs (the gate's and the CronJob's) on eval; its gate, a pipeline pod, on the pipeline's
    assert [i for c, i in images.items() if c.startswith("evaluate")] and all(
        i.endswith("-eval") for c, i in images.items() if c.startswith("evaluate")), images
    assert images["gate-evaluate"] == images["gate-train"], images
    cron_rows = kubectl(cluster, "-n", NS, "get", "cronjobs", "-l", f"app.kubernetes.io/instance={rel_name}").splitlines()
    assert cron_rows[0].split()[:4] == ["NAME", "SCHEDULE", "TIMEZONE", "SUSPEND"] and cron_rows[1].startswith(cron)

    # Prometheus scraped rank 0 (completion index 0) of each train Job and never index 1, whose pods also
    # declare the metrics port (the relabel rules of manifests/prometheus-scrape-config.yaml)
    scraped = wait_query(monitoring.prometheus, 'max_over_time(up{job="sapd-train", release="sapd-tw"}[1h]) == 1')
    assert scraped and all(r["metric"]["pod"].split("-")[-2] == "0" for r in scraped), scraped
    writer_seen = [t for k, t in cluster_targets(monitoring).items() if "sapd-tw-train" in k]
    assert {t["__meta_kubernetes_pod_label_batch_kubernetes_io_job_completion_index"] for t in writer_seen} == {"0", "1"}


# ------------------------------------------------------------------------------------------ dashboards


def pushed_series(prom: str, release: str, namespace: str = NS) -> dict[tuple, float]:
    """Every sapd_* series Prometheus has from the Pushgateway for ``release`` in ``namespace`` now: (name,
    sorted labels) → value (the scrape's own `instance`/`job` relabelling aside, the grouping labels are the
    pushed ones). Another namespace's release of the same name is another team's: not these."""
    out = {}
    for r in query(prom, f'{{__name__=~"sapd_.+", namespace="{namespace}", release="{release}", job!="sapd-train"}}'):
        labels = dict(r["metric"])
        name = labels.pop("__name__")
        out[(name, tuple(sorted(labels.items())))] = float(r["value"][1])
    return out


def test_dashboards_keep_their_series_through_a_skipped_stage_and_lose_them_at_uninstall(smoke, cluster,
                                                                                         monitoring):
    """The smoke run's series on the real Prometheus, fed by the real Pushgateway: a train Job of the last
    round created again (the manifest the driver creates on a retry, read from the release's templates)
    finds its checkpoint committed and does nothing — and every series stays as it was, restated from what the
    run recorded, its success time moving on. The Grafana dashboard's queries name the namespace. Then
    `helm uninstall`: its hook Job deletes the release's groups, Prometheus drops the series, and the other
    releases' groups stay."""
    from sapd import layout, storage
    assert smoke.state == "Complete"
    prom, gw = monitoring.prometheus, monitoring.pushgateway
    success = "sapd_job_last_success_timestamp_seconds"
    before = pushed_series(prom, "sapd-smoke")
    train = {k: v for k, v in before.items() if ("job", "train") in k[1]}
    assert {k[0] for k in train} >= {"sapd_loss", "sapd_round", "sapd_optimizer_steps_total", "sapd_clip_ratio",
                                      "sapd_teacher_student_gap", success}, sorted(train)
    last_round = ROUNDS - 1  # the persistent trainer's last round: its figures are the group's
    assert [v for k, v in train.items() if k[0] == "sapd_round"] == [float(last_round)], [
        (k, v) for k, v in train.items() if k[0] == "sapd_round"]
    last = next(v for k, v in train.items() if k[0] == success)

    # a retried train Job of the last round: the driver's manifest, from the templates ConfigMap (one round,
    # as a per-round retry), created by hand
    retried = f"sapd-smoke-train-r{last_round}"
    manifest = kubectl(cluster, "-n", NS, "get", "configmap", "sapd-smoke-pipeline-templates", "-o",
                       "jsonpath={.data.train\\.yaml}").replace("__SAPD_ROUND__", str(last_round)).replace(
                           "__SAPD_ROUNDS__", "1")
    # created as the driver creates it on a retry (`kubectl create -f` would want the OpenAPI document, which
    # the harness does not serve)
    from kubernetes import client
    client.BatchV1Api(cluster.client()).create_namespaced_job(NS, yaml.safe_load(manifest), field_validation="Strict")
    assert cluster.wait_job(retried, 300) == "Complete", cluster.describe()
    log = kubectl(cluster, "-n", NS, "logs", f"job/{retried}")
    recorded = layout.pushed_metrics_uri(smoke.root, "train", f"train-r{last_round}")
    assert f"metrics: train-r{last_round} was committed already: restated its committed figures ({recorded})" \
        in log, log
    assert storage.exists(recorded)
    cluster.wait_for(lambda: any(k[0] == success and ("job", "train") in k[1] and v > last
                                 for k, v in pushed_series(prom, "sapd-smoke").items()), 60,
                     "Prometheus to scrape the skipped stage's push")
    after = pushed_series(prom, "sapd-smoke")
    assert after.keys() == before.keys()  # no series lost
    changed = {k for k in before if before[k] != after[k]}
    assert changed == {k for k in train if k[0] == success}, sorted(changed)  # only the train job's success time

    # the dashboard's queries on the real Prometheus: each result carries the namespace its legend names
    dash = json.loads((REPO / "manifests" / "grafana-dashboard.json").read_text())
    answered = 0
    for panel in dash["panels"]:
        for t in panel["targets"]:
            expr = (t["expr"].replace("$namespace", NS).replace("$release", "sapd-smoke")
                    .replace("$benchmark", ".*").replace("$__rate_interval", "1m"))
            result = query(prom, expr)
            answered += bool(result)
            assert all(r["metric"].get("namespace") == NS and r["metric"].get("release") == "sapd-smoke"
                       for r in result), (panel["title"], result)
            assert "{{namespace}}" in t["legendFormat"]
    assert answered >= 6  # every panel over pushed series (the scraped training rate is over once training is)

    # `helm uninstall`: the post-delete hook deletes every group of the release; the others stay — among
    # them another team's release of the same name in its own namespace, sharing the Pushgateway
    from sapd.metrics import Metrics
    theirs = Metrics(job="train", pushgateway=gw, release="sapd-smoke", namespace="other-team")
    theirs.mark_success()
    theirs.push()
    others = {(g["labels"].get("namespace"), g["labels"]["release"]) for g in json.loads(get_url(f"{gw}/api/v1/metrics"))["data"]}
    others -= {(NS, "sapd-smoke")}
    kubectl(cluster, "-n", NS, "delete", "job", retried)  # the one made by hand, no owner
    assert cluster.helm.uninstall("sapd-smoke") == [("sapd-smoke-delete-metrics", "Complete")]
    groups = [g["labels"] for g in json.loads(get_url(f"{gw}/api/v1/metrics"))["data"]]
    assert not [g for g in groups if (g.get("namespace"), g["release"]) == (NS, "sapd-smoke")], groups
    assert {(g.get("namespace"), g["release"]) for g in groups} == others and ("other-team", "sapd-smoke") in others
    cluster.wait_for(lambda: not pushed_series(prom, "sapd-smoke"), 60, "Prometheus to drop sapd-smoke's series")
    assert pushed_series(prom, "sapd-smoke", "other-team")  # theirs stay


def cluster_targets(monitoring: Monitoring) -> dict[str, dict]:
    return TARGETS_SEEN


TARGETS_SEEN: dict[str, dict] = {}


@pytest.fixture(scope="module", autouse=True)
def report_timings():
    yield
    if TIMINGS:
        print("\njourney timings: " + ", ".join(f"{k} {v:.0f}s" for k, v in TIMINGS.items()))
    for command, out in KUBECTL_SEEN.items():
        print(f"\n$ {command}\n{out}", end="")
