"""Metrics for real: Debian's prometheus-pushgateway and prometheus on loopback; a tiny pipeline pushes,
Prometheus scrapes the gateway, and the figures are read back through Prometheus' HTTP query API."""

import json
import time
import urllib.parse
import urllib.request

import pytest

from sapd.config import config_from_dict
from sapd.metrics import Metrics
from sapd.run.local import run_pipeline
from tests.conftest import free_port, get_url
from tests.pipeline_util import make_models, tiny_config


def _query(prom: str, expr: str) -> list[dict]:
    body = json.loads(get_url(f"{prom}/api/v1/query?query={urllib.parse.quote(expr)}"))
    assert body["status"] == "success", body
    return body["data"]["result"]


def _wait_query(prom: str, expr: str, seconds: float = 30.0) -> list[dict]:
    deadline = time.time() + seconds
    while time.time() < deadline:
        result = _query(prom, expr)
        if result:
            return result
        time.sleep(0.5)
    pytest.fail(f"Prometheus never returned a sample for {expr}")


@pytest.mark.integration
def test_pipeline_metrics_reach_prometheus(tmp_path, prometheus_stack):
    models = make_models(tmp_path / "models")
    cfg = config_from_dict(tiny_config(str(tmp_path / "run"), *models, train={"rounds": 1}))
    metrics = Metrics(job="pipeline", pushgateway=prometheus_stack["pushgateway"], release="test-release")
    t_start = time.time()
    run_pipeline(cfg, log=lambda s: None, show_progress=False, metrics=metrics)
    prom = prometheus_stack["prometheus"]
    # the job's last push carries every figure; wait until Prometheus has scraped that one
    (last,) = _wait_query(prom, f"sapd_job_last_success_timestamp_seconds >= {t_start}")
    stages = _wait_query(prom, 'sapd_stage_duration_seconds_count{release="test-release"}')
    assert {"build_prefixes", "sample", "score", "train", "train_step"} <= {r["metric"]["stage"] for r in stages}
    assert all(r["metric"]["job"] == "pipeline" for r in stages)
    losses = {r["metric"]["term"]: float(r["value"][1]) for r in _wait_query(prom, "sapd_loss")}
    assert {"total", "tok", "step", "rule"} <= set(losses)
    tokens = {r["metric"]["stage"]: float(r["value"][1]) for r in _wait_query(prom, "sapd_tokens_total")}
    assert tokens["sample"] > 0 and tokens["train"] > 0
    assert last["metric"]["release"] == "test-release"
    (steps,) = _wait_query(prom, "sapd_optimizer_steps_total")
    from sapd.run.report import read_step_log
    log = read_step_log(cfg.run_root)
    assert float(steps["value"][1]) == len(log)
    assert _wait_query(prom, "sapd_teacher_student_gap")
    # the held-out distance to the teacher of the newest validated checkpoint (1, the last), as committed
    from sapd.data import validation
    committed = validation.read(cfg.run_root, 1)
    (ckpt,) = _wait_query(prom, "sapd_validation_checkpoint")
    assert float(ckpt["value"][1]) == 1
    kl = {r["metric"]["category"]: float(r["value"][1]) for r in _wait_query(prom, "sapd_validation_reverse_kl")}
    assert kl["all"] == pytest.approx(committed["overall"]["reverse_kl_per_token"]["value"], rel=1e-9)
    match = {r["metric"]["model"] for r in _wait_query(prom, 'sapd_validation_action_match_ratio{category="all"}')}
    assert match == {"student", "teacher"}
    assert {r["metric"]["stage"] for r in stages} >= {"validation"}
    # the round's update in the weights the optimizer keeps: its size, and all of the computed update applied
    (last,) = [r for r in log if "round_update_rel" in r]
    (moved,) = _wait_query(prom, "sapd_weight_update_ratio")
    (applied,) = _wait_query(prom, "sapd_update_applied_ratio")
    assert float(moved["value"][1]) == pytest.approx(last["round_update_rel"]) and last["round_update_rel"] > 0
    assert float(applied["value"][1]) == pytest.approx(1.0, abs=1e-3)


def test_metrics_endpoint_serves_training_figures():
    m = Metrics(job="train")
    port = free_port()
    server, _ = m.serve(port, addr="127.0.0.1")
    try:
        m.record_step({"round": 3, "loss": 0.5, "loss_tok": 0.1, "teacher_student_gap": -0.25,
                       "step_adv_abs_mean": 0.7, "clip_fraction": 0.1, "step_seconds": 1.5,
                       "response_tokens_mean": 10.0, "prefixes": 4, "round_update_rel": 2.5e-05,
                       "round_update_applied_ratio": 0.25}, group_size=8)
        m.record_eval("alfworld", 0.5, {"Pick": 1.0})
        text = get_url(f"http://127.0.0.1:{port}/metrics")
    finally:
        server.shutdown()
    assert 'sapd_loss{term="total"} 0.5' in text and "sapd_teacher_student_gap -0.25" in text
    assert 'sapd_tokens_total{stage="train"} 320.0' in text and "sapd_round 3.0" in text
    assert 'sapd_eval_success_ratio{benchmark="alfworld",category="Pick"} 1.0' in text
    assert 'sapd_stage_duration_seconds_count{stage="train_step"} 1.0' in text
    assert "sapd_weight_update_ratio 2.5e-05" in text and "sapd_update_applied_ratio 0.25" in text
    # nothing in the exposition carries a high-cardinality id label
    assert "prefix_id" not in text and "trajectory_id" not in text


def test_no_pushgateway_configured_pushes_nothing(monkeypatch):
    monkeypatch.delenv("SAPD_PUSHGATEWAY_URL", raising=False)
    m = Metrics.from_env("pipeline")
    assert m.pushgateway is None
    m.push()  # a no-op, not an error
    monkeypatch.setenv("SAPD_PUSHGATEWAY_URL", "http://127.0.0.1:1")
    with pytest.raises(OSError):  # configured but unreachable: the job hears about it
        Metrics.from_env("pipeline").push()


@pytest.mark.integration
def test_the_same_release_in_two_namespaces_keeps_two_groups(prometheus_stack, monkeypatch):
    """Two teams install a release named alike in their own namespaces, sharing the cluster's Pushgateway:
    the namespace is part of the grouping key, so neither push replaces the other's."""
    monkeypatch.setenv("SAPD_PUSHGATEWAY_URL", prometheus_stack["pushgateway"])
    monkeypatch.setenv("SAPD_RELEASE", "sapd-alfworld")
    for ns, value in (("team-a", 0.25), ("team-b", 0.75)):
        monkeypatch.setenv("SAPD_NAMESPACE", ns)
        m = Metrics.from_env("evaluate")
        m.record_eval("alfworld", value)
        m.push()
    groups = json.loads(get_url(f"{prometheus_stack['pushgateway']}/api/v1/metrics"))["data"]
    keys = sorted((g["labels"]["namespace"], g["labels"]["release"], g["labels"]["job"]) for g in groups)
    assert keys == [("team-a", "sapd-alfworld", "evaluate"), ("team-b", "sapd-alfworld", "evaluate")]
    got = {r["metric"]["namespace"]: float(r["value"][1])
           for r in _wait_query(prometheus_stack["prometheus"], 'sapd_eval_success_ratio{category="all"}')}
    if len(got) < 2:  # one scrape may predate the second push
        time.sleep(2)
        got = {r["metric"]["namespace"]: float(r["value"][1])
               for r in _query(prometheus_stack["prometheus"], 'sapd_eval_success_ratio{category="all"}')}
    assert got == {"team-a": 0.25, "team-b": 0.75}
