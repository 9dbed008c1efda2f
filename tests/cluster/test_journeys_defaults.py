"""The chart's default values as far as a CPU runs them: `helm install` of charts/sapd with no overlay, the GPUs
taken out and the user's data, models and sizes set — bf16 weights with the fp32 master, DeepSpeed ZeRO-2 over
two train pods (one rank each, gloo), vLLM's CPU build (the gpu image's environment, each engine in its own
process, as vLLM runs by default) sampling and scoring, the persistent stage workers. Three rounds; one train
pod killed in the middle of round 1, the driver recreating the train Job, which resumes from checkpoint 1.
Checkpoint 3 must equal, bit for bit, what `sapd run` makes of the same config in the same environment (one
process: the same vLLM engines, DeepSpeed as a world of one): the ranks' gradients are summed in fp32 (the
train pods) as one process accumulates them (`sapd run`), and the kill costs nothing but time.

What stays different from a GPU cluster: `model.dtype` and `sampling.backend` are set (on a CPU, ``auto`` is
float32 and HF), the engines do not sleep (vLLM's CPU build has no sleep mode), gloo carries the collectives
(NCCL needs GPUs), and the tiny models' gradients stay below `train.max_grad_norm` (clipping reads a norm
summed over partitions in another order, which would differ in its last bits).
"""

from __future__ import annotations

import json
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
import yaml

from tests.conftest import free_port, torch_extensions_dir
from tests.journey_util import NODE_CACHE, NS, checkpoint_weights, journey_cluster, user_s3
from tests.k8s_harness.kubelet import warm_pod_ops
from tests.tokenizer_util import SAMPLE_DATA, build_test_tokenizer

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "sapd"
VLLM_PYTHON = REPO / ".venv-vllm" / "bin" / "python"  # the gpu image's environment (`make test` builds it)
pytestmark = [pytest.mark.integration, pytest.mark.slow]
ROUNDS = 3
SHAPE = dict(hidden_size=128, heads=4, kv_heads=2, intermediate_size=256, layers=2)  # head_dim 32: vLLM's CPU kernels


def _upload_models(tmp: Path, prefix: str) -> None:
    from sapd import storage
    from sapd.models.tiny import build_tiny_model
    tok = build_test_tokenizer(tmp / "tokenizer")
    for name, seed in (("student", 0), ("teacher", 1)):
        build_tiny_model(tok, tmp / name, seed=seed, **SHAPE)
        for f in sorted((tmp / name).rglob("*")):
            if f.is_file():
                storage.write_bytes(f"{prefix}/models/{name}/{f.relative_to(tmp / name)}", f.read_bytes())


def _sets(prefix: str, release: str, endpoint: str) -> list[str]:
    """The user's `--set`s over the chart's defaults: data, models, S3; the GPUs out (requests and limits), one
    scoring worker and two one-rank train pods, DeepSpeed and vLLM on the CPU; what auto would choose otherwise on
    a CPU (float32, HF) set to the defaults' GPU choices."""
    return [f"runRoot={prefix}/runs/{release}", f"config.data.input={prefix}/data/alfworld_eto.json",
            f"config.model.student={prefix}/models/student", f"config.model.teacher={prefix}/models/teacher",
            "config.model.dtype=bfloat16", "config.sampling.backend=vllm", "config.sampling.group_size=2",
            "config.sampling.max_new_tokens=8", "config.data.val_fraction=0", f"config.train.rounds={ROUNDS}",
            "config.train.trajectories_per_round=1", "config.train.minibatch_prefixes=2",
            "config.train.micro_batch_prefixes=1", "teacherScores.parallelism=1", "train.parallelism=2",
            "train.procsPerPod=1", "evaluate.enabled=false", "evaluate.schedule=", f"s3.endpoint={endpoint}",
            "pushgateway.url=", "pipeline.pollSeconds=0.5", "modelCache.type=hostPath",
            f"train.rendezvousPort={free_port()}", f"train.metricsPort={free_port()}",
            *(f"{job}.resources.{b}.nvidia\\.com/gpu=null" for job in ("teacherScores", "train", "evaluate")
              for b in ("requests", "limits")),
            "train.extraEnv[0].name=DS_ACCELERATOR", "train.extraEnv[0].value=cpu",
            "train.extraEnv[1].name=OMP_NUM_THREADS", "train.extraEnv[1].value=1",
            "teacherScores.extraEnv[0].name=VLLM_CPU_KVCACHE_SPACE", "teacherScores.extraEnv[0].value=1"]


def test_the_charts_defaults_on_a_cpu_train_three_rounds_through_a_kill_to_sapd_runs_weights(tmp_path, s3_server):
    from sapd import layout, storage
    assert VLLM_PYTHON.exists(), ".venv-vllm is not built: make test builds it (scripts/setup_vllm_venv.sh)"
    prefix = f"s3://{s3_server.bucket}/defaults-{time.time_ns()}"
    with user_s3(s3_server):
        storage.write_bytes(f"{prefix}/data/alfworld_eto.json", (SAMPLE_DATA / "alfworld_eto.json").read_bytes())
        _upload_models(tmp_path / "models", prefix)
    with journey_cluster(tmp_path / "cluster", s3_server) as cluster:
        warm_pod_ops("gpu")  # DeepSpeed's CPU op for the gpu image's train pods, built once per checkout
        cluster.host_path(NODE_CACHE, owner=(1000, 1000))
        rel = cluster.helm.install("sapd-defaults", CHART, set_values=_sets(prefix, "sapd-defaults", s3_server.endpoint_url))
        root = rel.values["runRoot"]
        # one train pod killed in the middle of round 1 (its workers with it): rank 0 (the one that logs) is paused at
        # a step of round 1, so that the round cannot commit before the kill; the group then fails and the
        # driver recreates it, which resumes from checkpoint 1
        job = "batch.kubernetes.io/job-name=sapd-defaults-train-r0,batch.kubernetes.io/job-completion-index="
        rank0 = cluster.wait_log(job + "0", "round 1 step", 900)  # (steps are counted over the run)
        assert cluster.kill_pod(rank0["metadata"]["name"], signal.SIGSTOP)
        try:
            (victim,) = [p for p in cluster.pods(job + "1") if p["status"].get("phase") == "Running"]
            assert cluster.kill_pod(victim["metadata"]["name"], signal.SIGKILL)
        finally:
            cluster.kill_pod(rank0["metadata"]["name"], signal.SIGCONT)
        assert cluster.wait_job("sapd-defaults-pipeline-1", timeout=1500) == "Complete", cluster.describe()
        with user_s3(s3_server):
            assert layout.committed_checkpoints(root) == list(range(ROUNDS + 1))
            config = json.loads(cluster.kubectl("-n", NS, "get", "configmap", "sapd-defaults-config", "-o",
                                                "json"))["data"]["config.yaml"]
            cluster_weights = checkpoint_weights(root, ROUNDS)
        scoring = "\n".join(cluster.logs(p["metadata"]["name"]) for p in
                            cluster.pods("batch.kubernetes.io/job-name=sapd-defaults-teacher-scores-r0"))
        trainers = [cluster.logs(p["metadata"]["name"]) for p in
                    cluster.pods("batch.kubernetes.io/job-name=sapd-defaults-train-r0")]
        driver = "\n".join(cluster.logs(p["metadata"]["name"]) for p in
                           cluster.pods("batch.kubernetes.io/job-name=sapd-defaults-pipeline-1"))
    # the pods ran the defaults: vLLM engines taking each checkpoint in place, bf16 DeepSpeed ranks, a restart
    assert "config: model.device: auto → cpu" in scoring and "model load: teacher" in scoring
    assert "weights: student checkpoint 2 in place" in scoring, scoring[-3000:]
    assert "job sapd-defaults-train-r0: attempt 1/3 failed" in driver, driver[-3000:]
    assert any("2 ranks" in log for log in trainers)
    # `sapd run` of the same config, in the gpu image's environment, against the same S3
    cfg = yaml.safe_load(config)
    cfg["run_root"] = f"{prefix}/runs/sapd-run"
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(cfg))
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1",
           "VLLM_CPU_KVCACHE_SPACE": "1", "PYTHONPATH": str(REPO), "SAPD_S3_ENDPOINT_URL": s3_server.endpoint_url,
           "AWS_ACCESS_KEY_ID": s3_server.access_key, "AWS_SECRET_ACCESS_KEY": s3_server.secret_key,
           "AWS_DEFAULT_REGION": "us-east-1", "TORCH_EXTENSIONS_DIR": torch_extensions_dir(VLLM_PYTHON.parents[1])}
    proc = subprocess.run([str(VLLM_PYTHON), "-m", "sapd.cli", "run", str(tmp_path / "run.yaml"), "--no-progress"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    with user_s3(s3_server):
        local = checkpoint_weights(cfg["run_root"], ROUNDS)
    assert local.keys() == cluster_weights.keys()
    for name in local:
        assert local[name].dtype == torch.bfloat16
        assert torch.equal(local[name], cluster_weights[name]), \
            f"{name}: {float((local[name].float() - cluster_weights[name].float()).abs().max())}"
