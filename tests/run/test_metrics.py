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

    # `sapd run` again over the finished run: nothing to do, and the group keeps every figure (it is
    # restated from what the run recorded in its root), with the new success time on top
    gateway = prometheus_stack["pushgateway"]
    before = _group(gateway, job="pipeline", release="test-release")
    assert before["sapd_loss"] and before["sapd_optimizer_steps_total"]
    rerun = Metrics(job="pipeline", pushgateway=gateway, release="test-release")
    lines: list[str] = []
    run_pipeline(cfg, log=lines.append, show_progress=False, metrics=rerun)
    after = _group(gateway, job="pipeline", release="test-release")
    assert any("restated its committed figures" in line for line in lines), lines
    success = "sapd_job_last_success_timestamp_seconds"
    assert {k: v for k, v in after.items() if k != success} == {k: v for k, v in before.items() if k != success}
    assert after[success][()] > before[success][()]


def _group(gateway: str, **labels: str) -> dict[str, dict[tuple, float]]:
    """The samples of one Pushgateway group (the one with these grouping labels): metric → {labels: value}
    (the gateway's own push_time/push_failure_time samples left out)."""
    groups = [g for g in json.loads(get_url(f"{gateway}/api/v1/metrics"))["data"]
              if all(g["labels"].get(k) == v for k, v in labels.items())]
    assert len(groups) == 1, groups
    out: dict[str, dict[tuple, float]] = {}
    for name, family in groups[0].items():
        if name in ("labels", "last_push_successful", "push_time_seconds", "push_failure_time_seconds"):
            continue
        for m in family["metrics"]:
            key = tuple(sorted(m.get("labels", {}).items()))
            if "buckets" in m:  # a histogram: its count and sum stand for it
                out.setdefault(name, {})[key] = (float(m["count"]), float(m["sum"]))  # type: ignore[assignment]
            else:
                out.setdefault(name, {})[key] = float(m["value"])
    grouping = set(groups[0]["labels"]) | {"instance"}  # every sample carries them (instance "" if none)
    return {name: {tuple((k, v) for k, v in lab if k not in grouping): val for lab, val in vals.items()}
            for name, vals in out.items()}


@pytest.mark.integration
def test_a_stage_that_skips_leaves_its_groups_figures(tmp_path, prometheus_stack):
    """A train Job retried after its checkpoint was committed finds nothing to do. Its push must not replace
    the group with a registry that holds no loss: it restates what the run that trained pushed (recorded in
    the run root), with its own success time; with no record (the trainer died between its commit and its
    push) it adds its own figures and leaves the rest of the group as it was. A plain push (the behaviour
    before) empties the group's loss: what this test would catch."""
    from sapd import layout, storage
    from sapd.run.job import push_metrics
    gateway = prometheus_stack["pushgateway"]
    cfg = config_from_dict(tiny_config(str(tmp_path / "run"), "student", "teacher"))
    key = dict(job="train", release="rel", namespace="team")

    def metrics() -> Metrics:
        return Metrics(job="train", pushgateway=gateway, release="rel", namespace="team")

    worked = metrics()
    worked.record_step({"loss": 1.25, "loss_tok": 0.5, "round": 3, "teacher_student_gap": 0.75, "clip_fraction": 0.1,
                        "response_tokens_mean": 4, "prefixes": 2, "step_seconds": 0.3}, group_size=2)
    worked.observe_stage("train", 12.0)
    worked.mark_success()
    push_metrics(cfg, worked, "train-r3", skipped=False, log=lambda s: None)
    trained = _group(gateway, **key)
    assert trained["sapd_loss"] == {(("term", "total"),): 1.25, (("term", "tok"),): 0.5}
    assert trained["sapd_round"] == {(): 3.0} and trained["sapd_clip_ratio"] == {(): 0.1}
    recorded = layout.pushed_metrics_uri(cfg.run_root, "train", "train-r3")
    assert storage.read_text(recorded) == worked.exposition()

    time.sleep(0.01)
    skipped = metrics()
    skipped.mark_success()
    lines: list[str] = []
    push_metrics(cfg, skipped, "train-r3", skipped=True, log=lines.append)
    restated = _group(gateway, **key)
    success = "sapd_job_last_success_timestamp_seconds"
    assert restated[success][()] > trained[success][()]
    assert {k: v for k, v in restated.items() if k != success} == {k: v for k, v in trained.items() if k != success}
    assert lines == [f"metrics: train-r3 was committed already: restated its committed figures ({recorded}) to the "
                     "Pushgateway"]

    storage.delete(recorded)  # a trainer that committed, then died before it pushed and recorded
    late = metrics()
    late.mark_success()
    push_metrics(cfg, late, "train-r3", skipped=True, log=lines.append)
    added = _group(gateway, **key)
    assert added[success][()] > restated[success][()]
    assert {k: v for k, v in added.items() if k != success} == {k: v for k, v in trained.items() if k != success}
    assert "no committed figures recorded" in lines[-1]

    plain = metrics()  # what every skip did before: a plain push of an empty registry
    plain.mark_success()
    plain.push()
    emptied = _group(gateway, **key)
    assert "sapd_loss" not in emptied and emptied["sapd_round"] == {(): 0.0}


@pytest.mark.integration
def test_an_uninstalled_releases_groups_are_deleted(prometheus_stack):
    """`python -m sapd.jobs.delete_metrics` (the chart's post-delete hook): every group of the release in its
    namespace goes (each stage's, each worker's), the same release in another namespace and other releases
    stay; a group pushed while it settles (a pod that was still stopping) goes too."""
    import threading

    import sapd.jobs.delete_metrics
    gateway = prometheus_stack["pushgateway"]
    pushes = [("build_prefixes", "team", "rel", ""), ("teacher_scores", "team", "rel", "0"),
              ("teacher_scores", "team", "rel", "1"), ("train", "team", "rel", ""), ("train", "other", "rel", ""),
              ("train", "team", "rel2", "")]
    for job, ns, rel, inst in pushes:
        m = Metrics(job=job, pushgateway=gateway, release=rel, namespace=ns, instance=inst)
        m.mark_success()
        m.push()

    def groups() -> set[tuple[str, ...]]:
        return {(g["labels"]["job"], g["labels"]["namespace"], g["labels"]["release"], g["labels"].get("instance", ""))
                for g in json.loads(get_url(f"{gateway}/api/v1/metrics"))["data"]}
    assert groups() == set(pushes)

    def straggler() -> None:  # a train pod that was still stopping pushes once more, during the settle time
        time.sleep(0.8)
        m = Metrics(job="train", pushgateway=gateway, release="rel", namespace="team")
        m.mark_success()
        m.push()

    thread = threading.Thread(target=straggler)
    thread.start()
    try:
        assert sapd.jobs.delete_metrics.main(["--pushgateway", gateway, "--namespace", "team", "--release", "rel",
                                         "--settle-seconds", "2"]) == 0
    finally:
        thread.join()
    assert groups() == {("train", "other", "rel", ""), ("train", "team", "rel2", "")}


def test_an_unreachable_pushgateway_never_fails_an_uninstall(capsys):
    import sapd.jobs.delete_metrics
    port = free_port()
    t0 = time.monotonic()
    assert sapd.jobs.delete_metrics.main(["--pushgateway", f"http://127.0.0.1:{port}", "--namespace", "team", "--release",
                                     "rel", "--deadline-seconds", "2", "--settle-seconds", "0"]) == 0
    assert time.monotonic() - t0 < 10
    out = capsys.readouterr().out
    assert "retrying" in out and "delete-metrics: WARNING: the Pushgateway" in out
    assert f"curl -X DELETE http://127.0.0.1:{port}/metrics/job/<job>/namespace/team/release/rel" in out


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
