"""The ALFWorld journey on a cluster, as a user runs it (the harness of tests/k8s_harness, as
tests/cluster/test_journeys.py uses it): ALFWorld's expert recorded on the user's machine with
`sapd collect-expert --benchmark alfworld --split train --expert planner` straight into S3 (SeaweedFS),
then `helm install -f values/smoke.yaml -f values/alfworld.yaml`: the chart's one-time fill Job writes a
generated `valid_unseen` split (`sapd alfworld-games`) into the ALFWorld data claim, the driver runs two
rounds and the final evaluation, and the evaluation CronJob — started with docs/kubernetes/operate.md's `kubectl create
job --from=cronjob/…` while round 1 trains — evaluates checkpoint 1. Both evaluations play ALFWorld's own
engine in the `eval` image's environment (the only one with `alfworld`), reading the claim mounted
read-only at /data/alfworld (ALFWORLD_DATA), and report all six task types.

Nothing may be downloaded: every pod runs with its HTTP(S) proxy pointing at a closed local port (S3, the
API server and the rendezvous are on 127.0.0.1, exempt through NO_PROXY), so a pod that reached for the
internet (ALFWorld's `alfworld-download`, a model hub) would fail the journey.

Lean: one game per task type, a 3-step horizon, a tiny model, one train pod on the plain torch engine.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from tests.alfworld_util import generated_games
from tests.journey_util import NS, journey_cluster, upload_models, user_s3
from tests.k8s_harness import Cluster

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "sapd"
SMOKE = CHART / "values" / "smoke.yaml"
ALFWORLD = CHART / "values" / "alfworld.yaml"
REL = "sapd-alf"
SIX = {"Pick", "Look", "Clean", "Heat", "Cool", "Pick2"}
pytestmark = [pytest.mark.integration, pytest.mark.slow]
# egress closed: a proxy on a port nothing listens on; the cluster's own addresses go direct
NO_EGRESS = {"HTTP_PROXY": "http://127.0.0.1:9", "HTTPS_PROXY": "http://127.0.0.1:9", "NO_PROXY": "127.0.0.1,localhost"}


@dataclasses.dataclass
class Inputs:
    prefix: str
    endpoint: str
    expert_log: str
    collect_output: str


@pytest.fixture(scope="module")
def inputs(tmp_path_factory, s3_server):
    """The user's uploads: a tiny student and teacher, and ALFWorld's expert played on generated train
    games, recorded by docs/kubernetes/install.md's command into S3."""
    tmp = tmp_path_factory.mktemp("alfworld-inputs")
    with user_s3(s3_server):
        prefix = f"s3://{s3_server.bucket}/alfworld-journey-{uuid.uuid4().hex[:8]}"
        upload_models(tmp / "models", prefix)
        data = generated_games("train", per_type=1, seed=0)  # `sapd alfworld-games --split train --per-type 1`
        expert_log = f"{prefix}/data/alfworld_expert.jsonl"
        env = {**os.environ, "ALFWORLD_DATA": str(data), "SAPD_S3_ENDPOINT_URL": s3_server.endpoint_url,
               "AWS_ACCESS_KEY_ID": s3_server.access_key, "AWS_SECRET_ACCESS_KEY": s3_server.secret_key,
               "AWS_DEFAULT_REGION": "us-east-1", "PYTHONPATH": str(REPO)}
        run = subprocess.run([sys.executable, "-m", "sapd.cli", "collect-expert", "--benchmark", "alfworld",
                              "--split", "train", "--expert", "planner", "--out", expert_log, "--no-progress"],
                             capture_output=True, text=True, env=env, timeout=900, cwd=tmp)
        assert run.returncode == 0, run.stdout + run.stderr
        yield Inputs(prefix, s3_server.endpoint_url, expert_log, run.stdout)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, inputs, s3_server):
    with journey_cluster(tmp_path_factory.mktemp("cluster"), s3_server) as c:
        yield c


def job_log(cluster: Cluster, job: str) -> str:
    return "\n".join(cluster.logs(p["metadata"]["name"]) for p in cluster.pods(f"batch.kubernetes.io/job-name={job}"))


@dataclasses.dataclass
class Run:
    root: str
    driver_log: str
    fill_job: str
    fill_log: str
    eval_now_log: str
    seconds: float


@pytest.fixture(scope="module")
def run(cluster, inputs) -> Run:
    """`helm install sapd-alf -f smoke.yaml -f alfworld.yaml --set …` (the user's data, models, S3, a short
    horizon and one generated game per task type for the claim), and while round 1 trains, the docs'
    `kubectl create job --from=cronjob/sapd-alf-evaluate-cron sapd-alf-eval-now`."""
    from sapd import checkpoints
    t0 = time.monotonic()
    p = inputs.prefix
    sets = [f"runRoot={p}/runs/{REL}", f"config.data.input={inputs.expert_log}",
            f"config.model.student={p}/models/student", f"config.model.teacher={p}/models/teacher",
            "config.data.val_fraction=0", "config.data.max_prompt_tokens=4096", "config.sampling.max_new_tokens=12",
            "config.train.trajectories_per_round=1", f"s3.endpoint={inputs.endpoint}", "pushgateway.url=",
            "pipeline.pollSeconds=0.5", "pipeline.logEverySeconds=60",
            *(f"jobDefaults.extraEnv[{i}].{k}" for i, (name, value) in enumerate(NO_EGRESS.items())
              for k in (f"name={name}", "value=" + value.replace(",", "\\,")))]  # --set's escaped comma
    fill = ["sapd", "alfworld-games", "--out", "/data/alfworld", "--split", "valid_unseen", "--per-type", "1"]
    cluster.helm.install(REL, CHART, values_files=[SMOKE, ALFWORLD], set_values=sets,
                         set_json=["config.train.lr=0.001", f"evaluate.alfworld.fill.command={json.dumps(fill)}",
                                   'evaluate.args=["--horizon", "3"]'])
    root = f"{p}/runs/{REL}"
    fill_job = next(j["metadata"]["name"] for j in cluster.store.list("Job", NS)
                    if j["metadata"]["name"].startswith(f"{REL}-alfworld-fill-"))
    # the trainer (persistent: one pod for both rounds), paused (SIGSTOP) from the moment it committed
    # checkpoint 1 until the CronJob's evaluation is done: the tiny model trains in seconds, and the evaluation
    # must find checkpoint 1 the newest
    trainer = cluster.wait_log(f"batch.kubernetes.io/job-name={REL}-train-r0", "round 0: checkpoint 1 committed", 1200)
    assert cluster.kill_pod(trainer["metadata"]["name"], signal.SIGSTOP)
    try:
        assert checkpoints.is_committed(root, 1) and not checkpoints.is_committed(root, 2)
        assert cluster.wait_job(fill_job, 600) == "Complete", cluster.describe()
        out = cluster.kubectl("-n", NS, "create", "job", f"--from=cronjob/{REL}-evaluate-cron", f"{REL}-eval-now")
        assert out.strip() == f"job.batch/{REL}-eval-now created"
        assert cluster.wait_job(f"{REL}-eval-now", 900) == "Complete", cluster.describe()
        eval_now_log = cluster.kubectl("-n", NS, "logs", f"job/{REL}-eval-now")
    finally:
        cluster.kill_pod(trainer["metadata"]["name"], signal.SIGCONT)
    assert cluster.wait_job(f"{REL}-pipeline-1", 1500) == "Complete", cluster.describe()
    seconds = time.monotonic() - t0
    print(cluster.timeline())
    print(f"\nALFWorld journey: helm install → run complete (two rounds, two evaluations) in {seconds:.0f}s")
    return Run(root, job_log(cluster, f"{REL}-pipeline-1"), fill_job, job_log(cluster, fill_job), eval_now_log, seconds)


def test_the_expert_log_is_alfworlds_planner_on_generated_games(inputs):
    from sapd import storage
    trajs = [json.loads(line) for line in storage.read_text(inputs.expert_log).splitlines()]
    assert len(trajs) == 6 and all(t["success"] and t["benchmark"] == "alfworld" for t in trajs)
    assert {t["category"] for t in trajs} == SIX
    assert f"wrote 6 expert trajectories to {inputs.expert_log}; expert success 1.00" in inputs.collect_output


def test_two_rounds_and_the_final_evaluation_play_alfworlds_engine(run, cluster):
    from sapd import layout, storage
    assert "pipeline done: checkpoints [0, 1, 2] committed" in run.driver_log
    assert "WARNING" not in run.driver_log and "FAILED" not in run.driver_log, run.driver_log
    assert layout.committed_checkpoints(run.root) == [0, 1, 2]
    # the overlay reads sapd's own expert log (format auto)
    manifest = json.loads(storage.read_text(storage.join(layout.prefixes_dir(run.root), "_MANIFEST.json")))
    assert manifest["format_read"].startswith("auto → native"), manifest["format_read"]
    result = storage.read_json(storage.join(layout.evals_dir(run.root, 2), "alfworld.json"))
    # the panel's default split ("test"), recorded under ALFWorld's own name: valid_unseen, the games the fill
    # Job generated on the claim (recorded as generated, not ALFWorld's official split)
    assert result["checkpoint"] == 2 and result["split"] == "valid_unseen" and result["horizon"] == 3
    assert result["games"]["generated_by"] == "sapd alfworld-games" and result["games"]["per_type"] == 1
    assert set(result["by_category"]) == SIX and result["overall"]["episodes"] == 6
    for cat in SIX:
        lo, hi = result["by_category"][cat]["success_ci"]
        assert 0.0 <= lo <= result["by_category"][cat]["success"] <= hi <= 1.0
    episodes = [json.loads(e) for e in storage.read_text(
        storage.join(layout.evals_dir(run.root, 2), "alfworld.episodes.jsonl")).splitlines()]
    assert all(e["metadata"]["engine_wording"] == "move" for e in episodes)  # ALFWorld 0.4's engine played them
    claim = cluster.node_root / "pvc" / NS / f"{REL}-alfworld-data" / "json_2.1.1" / "valid_unseen"
    assert sorted(e["id"] for e in episodes) == sorted(f"alfworld/{g.parent.parent.name}/{g.parent.name}"
                                                       for g in claim.glob("*/trial_*/game.tw-pddl"))
    # the stages ran the smoke overlay's cpu image, every evaluation the eval image (ALFWorld's engine)
    images = {(p["metadata"]["labels"]["app.kubernetes.io/component"], p["spec"]["containers"][0]["image"])
              for p in cluster.pods(f"app.kubernetes.io/instance={REL}")}
    assert {c for c, i in images if i.endswith("-eval")} == {"evaluate", "alfworld-fill"}, images
    assert all(i.endswith("-cpu") for c, i in images if c not in ("evaluate", "alfworld-fill")), images


def test_the_cronjob_evaluates_checkpoint_1_on_the_claim(run, cluster):
    from sapd import layout, storage
    assert "checkpoint 1: 6 alfworld episodes" in run.eval_now_log, run.eval_now_log
    assert "95% intervals (Wilson): overall" in run.eval_now_log
    result = storage.read_json(storage.join(layout.evals_dir(run.root, 1), "alfworld.json"))
    assert result["checkpoint"] == 1 and set(result["by_category"]) == SIX
    job = cluster.job(f"{REL}-eval-now")
    assert job["metadata"]["ownerReferences"][0]["name"] == f"{REL}-evaluate-cron"
    pod = job["spec"]["template"]["spec"]
    mount = next(m for m in pod["containers"][0]["volumeMounts"] if m["name"] == "alfworld")
    assert mount == {"name": "alfworld", "mountPath": "/data/alfworld", "readOnly": True}
    assert {"name": "alfworld", "persistentVolumeClaim": {"claimName": f"{REL}-alfworld-data", "readOnly": True}} \
        in pod["volumes"]


def test_the_claim_was_filled_once_by_the_chart_and_nothing_was_downloaded(run, cluster):
    # the fill Job generated the split into the claim (ALFWorld's layout, six games), before any evaluation
    games = cluster.node_root / "pvc" / NS / f"{REL}-alfworld-data" / "json_2.1.1" / "valid_unseen"
    assert len(list(games.glob("*/trial_*/game.tw-pddl"))) == 6, sorted(games.rglob("*"))[:20]
    (fill_pod,) = cluster.pods(f"batch.kubernetes.io/job-name={run.fill_job}")
    first_eval = min(p["status"]["startTime"] for p in cluster.pods(f"app.kubernetes.io/instance={REL}")
                     if p["metadata"]["labels"]["app.kubernetes.io/component"] == "evaluate")
    finished = fill_pod["status"]["containerStatuses"][0]["state"]["terminated"]["finishedAt"]
    assert finished <= first_eval
    assert "json_2.1.1/valid_unseen: 6 games (pick_and_place_simple 1," in run.fill_log, run.fill_log
    # no pod fetched anything from outside: every pod ran with egress closed, and all of them succeeded
    pods = cluster.pods(f"app.kubernetes.io/instance={REL}")
    assert pods and all(p["status"]["phase"] == "Succeeded" for p in pods), cluster.describe()
    for p in pods:
        env = {e["name"]: e.get("value") for e in p["spec"]["containers"][0].get("env", [])}
        assert {k: env.get(k) for k in NO_EGRESS} == NO_EGRESS, p["metadata"]["name"]
        assert "alfworld-download" not in json.dumps(p["spec"])
        log = cluster.logs(p["metadata"]["name"]).lower()
        assert "downloading" not in log and "alfworld-download" not in log, p["metadata"]["name"]
    assert cluster.kubelet.rootfs_writes == []
