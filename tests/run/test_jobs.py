"""The job entrypoints (sapd/jobs/) run for real on a tiny run, as the chart's pods would run them."""

from __future__ import annotations

import json
import time

import pytest
import yaml

from sapd import checkpoints
from sapd.config import config_from_dict, load_config
from sapd.data import validation
from sapd.data.batches import round_batch
from sapd.data.scored import read_scored
from tests.pipeline_util import make_models, tiny_config

QUIET = dict(log=lambda s: None, show_progress=False)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return make_models(tmp_path_factory.mktemp("models"))


def test_teacher_scores_two_indexed_workers_then_commit(tmp_path, models, monkeypatch, capsys):
    from sapd.jobs import teacher_scores
    from sapd.models.loading import load_tokenizer
    from sapd.stages.build_prefixes import ensure_initial_checkpoint, ensure_prefixes

    root = str(tmp_path / "run")
    data = tiny_config(root, *models, workers=2)
    config = tmp_path / "config.yaml"  # what the chart mounts at /etc/sapd/config.yaml
    config.write_text(yaml.safe_dump(data))
    cfg = load_config(config)
    ensure_prefixes(cfg, load_tokenizer(models[0]), **QUIET)
    ensure_initial_checkpoint(cfg, lambda s: None)
    args = ["--config", str(config), "--round", "0", "--no-progress"]

    # pod 1 of the Indexed Job: the index comes from JOB_COMPLETION_INDEX
    monkeypatch.setenv("JOB_COMPLETION_INDEX", "1")
    assert teacher_scores.main(args) == 0
    assert teacher_scores.main([*args, "--commit"]) == 2  # worker 0 has not finished
    # checkpoint 0's validation is committed first (a committed round implies it), and waits for worker 0 too
    assert "worker 0 of 2 has not written its part; cannot commit checkpoint 0's validation" in capsys.readouterr().err
    monkeypatch.setenv("JOB_COMPLETION_INDEX", "0")
    assert teacher_scores.main(args) == 0
    assert teacher_scores.main(args) == 0  # a retried pod redoes nothing
    assert "already done" in capsys.readouterr().out
    monkeypatch.delenv("JOB_COMPLETION_INDEX")
    assert teacher_scores.main([*args, "--worker", "2"]) == 2  # outside 0..W-1
    assert "outside 0..1" in capsys.readouterr().err
    assert teacher_scores.main([*args, "--commit"]) == 0
    assert validation.read(root, 0)["workers"] == 2

    table = read_scored(root, 0)
    assert sorted(table.column("prefix_id").to_pylist()) == \
        sorted(round_batch(config_from_dict(data), 0).column("prefix_id").to_pylist())
    G = cfg.sampling.group_size
    assert all(len(r) == G for r in table.column("teacher_logprobs").to_pylist())


def test_teacher_scores_errors_are_one_line_and_exit_2(tmp_path, models, capsys):
    from sapd.jobs import teacher_scores
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(tiny_config(str(tmp_path / "run"), *models, workers=2)))
    assert teacher_scores.main(["--config", str(config), "--round", "0"]) == 2
    assert "pass --worker or set JOB_COMPLETION_INDEX" in capsys.readouterr().err
    assert teacher_scores.main(["--config", str(config), "--round", "0", "--worker", "0"]) == 2
    assert "checkpoint 0 is not committed" in capsys.readouterr().err
    config.write_text("train: {lrr: 1}\n")
    assert teacher_scores.main(["--config", str(config), "--round", "0", "--worker", "0"]) == 2
    assert "did you mean 'train.lr'" in capsys.readouterr().err


def test_build_prefixes_then_scores_then_train_from_one_config(tmp_path, models):
    from sapd.jobs import build_prefixes, teacher_scores, train
    root = str(tmp_path / "run")
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(tiny_config(root, *models)))
    assert build_prefixes.main(["--config", str(config), "--no-progress"]) == 0
    assert checkpoints.is_committed(root, 0)  # the initial student, which the later stages start from
    marker = checkpoints.read_marker(root, 0)
    assert build_prefixes.main(["--config", str(config), "--no-progress"]) == 0  # committed: nothing redone
    assert checkpoints.read_marker(root, 0) == marker
    assert teacher_scores.main(["--config", str(config), "--round", "0", "--worker", "0", "--no-progress"]) == 0
    assert teacher_scores.main(["--config", str(config), "--round", "0", "--commit"]) == 0
    assert train.main(["--config", str(config), "--round", "0", "--no-progress"]) == 0
    assert checkpoints.is_committed(root, 1)


def test_stage_jobs_share_their_releases_lease_and_refuse_anothers(tmp_path, models, monkeypatch, capsys):
    """A stage Job claims the run root's lease as its release (SAPD_LEASE_OWNER, which the chart sets in
    every pod): it shares the release's lease (its driver holds it) and leaves it to the release; a Job of
    another release refuses the root in one line, exit 2; an evaluation only checks. A door run by hand
    holds the lease as itself and gives it back."""
    from sapd import layout, lease, storage
    from sapd.jobs import build_prefixes
    from sapd.jobs import evaluate as ev
    root = str(tmp_path / "run")
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(tiny_config(root, *models)))
    driver = lease.RunLease(root, lease.Claimant(lease.release_owner("sapd-a", "team"), "sapd-a-pipeline-1-x pid 1",
                                                 "python -m sapd.jobs.pipeline"), ttl_s=60).acquire()
    monkeypatch.setenv(lease.OWNER_ENV, lease.release_owner("sapd-b", "team"))
    assert build_prefixes.main(["--config", str(config), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"build_prefixes: error: run root {root} is held by release sapd-a in "
                                               "namespace team (python -m sapd.jobs.pipeline on sapd-a-pipeline-1-x pid 1")
    assert not storage.exists(layout.config_uri(root))  # refused before any write
    assert ev.main(["--config", str(config)]) == 2  # an evaluation of another release's root: refused too
    assert "is held by release sapd-a in namespace team" in capsys.readouterr().err
    monkeypatch.setenv(lease.OWNER_ENV, lease.release_owner("sapd-a", "team"))
    assert build_prefixes.main(["--config", str(config), "--no-progress"]) == 0  # its own release's: shared
    assert checkpoints.is_committed(root, 0)
    held = json.loads(storage.read_text(layout.lease_uri(root)))
    assert held["owner"] == "release sapd-a in namespace team"  # still theirs
    # the pod that renewed it last is named by its command, as `ps` or the pod spec shows it
    assert held["command"] == "python -m sapd.jobs.build_prefixes", held
    driver.release(for_owner=True)
    monkeypatch.delenv(lease.OWNER_ENV)
    assert build_prefixes.main(["--config", str(config), "--no-progress"]) == 0  # by hand: held, then given back
    assert not storage.exists(layout.lease_uri(root))


@pytest.mark.integration
def test_batch_jobs_push_their_outcome(tmp_path, models, monkeypatch, prometheus_stack):
    """build_prefixes and teacher_scores push to a real Pushgateway; its /metrics shows each job's figures."""
    import urllib.request

    from sapd.jobs import build_prefixes, teacher_scores
    monkeypatch.setenv("SAPD_PUSHGATEWAY_URL", prometheus_stack["pushgateway"])
    monkeypatch.setenv("SAPD_RELEASE", "jobs-test")
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(tiny_config(str(tmp_path / "run"), *models)))
    assert build_prefixes.main(["--config", str(config), "--no-progress"]) == 0
    assert teacher_scores.main(["--config", str(config), "--round", "0", "--worker", "0", "--no-progress"]) == 0
    with urllib.request.urlopen(prometheus_stack["pushgateway"] + "/metrics", timeout=5) as r:
        text = r.read().decode()
    for job in ("build_prefixes", "teacher_scores"):
        assert f'sapd_job_last_success_timestamp_seconds{{instance="",job="{job}",release="jobs-test"}}' in text, job
    assert 'sapd_stage_duration_seconds_count{instance="",job="teacher_scores",release="jobs-test",stage="sample"} 1' in text
    assert 'sapd_stage_duration_seconds_count{instance="",job="build_prefixes",release="jobs-test",stage="build_prefixes"} 1' in text
    # the door again (a retried Job): its work is committed, it does nothing, and its group keeps the figures
    # of the run that did the work (restated from the run root), where a plain push would have emptied it
    assert build_prefixes.main(["--config", str(config), "--no-progress"]) == 0
    with urllib.request.urlopen(prometheus_stack["pushgateway"] + "/metrics", timeout=5) as r:
        again = r.read().decode()
    assert 'sapd_stage_duration_seconds_count{instance="",job="build_prefixes",release="jobs-test",stage="build_prefixes"} 1' in again


# ------------------------------------------------------------------------------------------ the chart's helpers


def test_the_last_teacher_scores_worker_commits_the_round(tmp_path, models, capsys):
    """With no driver (the chart's manual mode) nobody runs --commit: the worker that finds every part
    done commits the round itself; the others leave it."""
    from sapd import layout
    from sapd.data import shards
    from sapd.jobs import teacher_scores
    from sapd.models.loading import load_tokenizer
    from sapd.stages.build_prefixes import ensure_initial_checkpoint, ensure_prefixes
    root = str(tmp_path / "run")
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(tiny_config(root, *models, workers=2)))
    cfg = load_config(config)
    ensure_prefixes(cfg, load_tokenizer(models[0]), **QUIET)
    ensure_initial_checkpoint(cfg, lambda s: None)
    args = ["--config", str(config), "--round", "0", "--no-progress"]
    assert teacher_scores.main([*args, "--worker", "1"]) == 0
    assert shards.read_manifest(layout.scored_dir(root, 0)) is None
    assert "round 0: 1/2 workers done; the last one to finish commits the round" in capsys.readouterr().out
    assert teacher_scores.main([*args, "--worker", "0"]) == 0
    assert "round 0: committed" in capsys.readouterr().out
    manifest = shards.read_manifest(layout.scored_dir(root, 0))
    assert manifest["workers"] == 2 and len(manifest["parts"]) == 2
    assert teacher_scores.main([*args, "--worker", "1"]) == 0  # a retried worker: the manifest is kept
    assert shards.read_manifest(layout.scored_dir(root, 0)) == manifest


def test_wait_returns_once_the_input_is_committed(tmp_path, models, capsys):
    import threading

    from sapd.jobs import build_prefixes, wait
    root = str(tmp_path / "run")
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(tiny_config(root, *models)))
    base = ["--config", str(config), "--poll-seconds", "0.05"]
    assert wait.main([*base, "--for", "checkpoint:0", "--timeout-seconds", "0.2"]) == 75  # not there: retried
    assert wait.main([*base, "--for", "checkpoint"]) == 2
    assert "expected prefixes, checkpoint:K or scored:K" in capsys.readouterr().err
    t = threading.Timer(0.3, lambda: build_prefixes.main(["--config", str(config), "--no-progress"]))
    t.start()
    try:
        assert wait.main([*base, "--for", "prefixes", "--timeout-seconds", "120"]) == 0
    finally:
        t.join()
    assert wait.main([*base, "--for", "checkpoint:0"]) == 0
    assert "wait: checkpoint 0 is committed" in capsys.readouterr().out
    sft = tmp_path / "sft.yaml"
    sft.write_text(yaml.safe_dump(tiny_config(root, *models, variant="sft")))
    assert wait.main(["--config", str(sft), "--for", "scored:0", "--poll-seconds", "0.05"]) == 0  # sft: checkpoint 0


def test_check_reports_each_preflight_item(tmp_path, models, capsys, monkeypatch):
    from sapd.jobs import check
    monkeypatch.delenv("SAPD_PUSHGATEWAY_URL", raising=False)
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(tiny_config(str(tmp_path / "run"), *models)))
    assert check.main(["--config", str(config)]) == 0
    out = capsys.readouterr().out
    assert "check student: ok" in out and "check storage: ok" in out and "check: 10/10 passed" in out, out  # ranks and precision are the 9th and 10th
    config.write_text(yaml.safe_dump(tiny_config(str(tmp_path / "run"), str(tmp_path / "nope"), models[1])))
    monkeypatch.setenv("SAPD_PUSHGATEWAY_URL", "http://127.0.0.1:1")
    assert check.main(["--config", str(config)]) == 2  # a user error first; the Pushgateway is only unreachable
    out = capsys.readouterr().out
    assert "check student: FAILED" in out and "nope" in out and "check pushgateway: FAILED" in out
    assert "check teacher: ok" in out
    config.write_text("run_root: [unclosed\n")
    assert check.main(["--config", str(config)]) == 2
    assert "check config: FAILED" in capsys.readouterr().out


def _no_work(monkeypatch):
    """Every stage's work raises: a job that reaches it did not stop at its checks."""
    import sapd.stages.build_prefixes as bp
    import sapd.stages.evaluate as ev
    import sapd.stages.teacher_scores as ts
    import sapd.stages.train as tr

    def work(*a, **kw):
        raise AssertionError("the stage's work started")
    for mod in (bp, ev, ts, tr):
        monkeypatch.setattr(mod, "run", work)


@pytest.mark.parametrize("job, extra", [("build_prefixes", []), ("teacher_scores", ["--round", "0", "--worker", "0"]),
                                        ("train", ["--round", "1"])])
def test_each_job_checks_its_inputs_before_its_work(tmp_path, models, monkeypatch, capsys, job, extra):
    import importlib
    mod = importlib.import_module(f"sapd.jobs.{job}")
    _no_work(monkeypatch)
    config = tmp_path / "config.yaml"
    missing = tmp_path / "no-such-student"
    bad = tiny_config(str(tmp_path / "run"), str(missing), models[1])
    bad["data"]["input"] = str(tmp_path / "no-such-data.json")
    config.write_text(yaml.safe_dump(bad))
    assert mod.main(["--config", str(config), "--no-progress", *extra]) == 2
    out, err = capsys.readouterr()
    assert "check student: FAILED" in out and "no-such-student" in out
    assert len([line for line in err.splitlines() if line.strip()]) == 1, err
    assert f"{job}: error: check " in err and "--no-check" in err
    assert not (tmp_path / "run").exists()  # nothing written, the probe removed
    with pytest.raises(AssertionError, match="the stage's work started"):  # --no-check: straight to the work
        mod.main(["--config", str(config), "--no-progress", "--no-check", *extra])
    assert "check " not in capsys.readouterr().out


def test_the_commit_step_and_evaluate_check_storage_only(tmp_path, models, monkeypatch, capsys):
    from sapd.jobs import evaluate, teacher_scores
    _no_work(monkeypatch)
    config = tmp_path / "config.yaml"
    blocker = tmp_path / "file"
    blocker.write_text("not a folder\n")
    config.write_text(yaml.safe_dump(tiny_config(str(blocker / "run"), str(tmp_path / "absent"), models[1])))
    assert evaluate.main(["--config", str(config), "--no-progress"]) == 2
    out, err = capsys.readouterr()
    assert "check storage: FAILED" in out and "check student" not in out and err.startswith("evaluate: error: check storage")
    assert teacher_scores.main(["--config", str(config), "--round", "0", "--commit"]) == 2
    out, err = capsys.readouterr()
    assert "check storage: FAILED" in out and "check student" not in out


def test_the_pipeline_driver_checks_before_it_reads_its_templates(tmp_path, models, capsys):
    from sapd.jobs import pipeline
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(tiny_config(str(tmp_path / "run"), *models, data={"input": str(tmp_path / "x.json")})))
    args = ["--config", str(config), "--release", "r", "--templates", str(tmp_path / "no-templates")]
    assert pipeline.main(args) == 2
    out, err = capsys.readouterr()
    assert "check data: FAILED" in out and "x.json" in out and "pipeline: error: check data" in err
    assert "templates" not in out
    assert pipeline.main([*args, "--no-check"]) == 2  # unchecked, it gets as far as the templates
    out, err = capsys.readouterr()
    assert "check " not in out and "no-templates" in err


def test_evaluate_takes_device_and_budget_from_the_config_and_skips_a_run_without_checkpoints(tmp_path, monkeypatch, capsys):
    import sapd.jobs.evaluate as ev
    from sapd import checkpoints
    cfg = tmp_path / "config.yaml"
    root = tmp_path / "run"
    cfg.write_text(yaml.safe_dump({"run_root": str(root), "data": {"benchmark": "textworld"},
                                   "model": {"device": "cuda"}, "sampling": {"max_new_tokens": 48}}))
    import sapd.stages.evaluate as stage
    seen = []
    monkeypatch.setattr(stage, "evaluate_checkpoint",
                        lambda root, k, panel, **kw: seen.append((root, k, panel, kw)) or {"overall": {"success": 0.5}})
    assert ev.main(["--config", str(cfg)]) == 0 and seen == []
    assert "nothing to evaluate" in capsys.readouterr().out
    from sapd import layout, storage
    storage.write_json(layout.checkpoint_marker(str(root), 0), {"checkpoint": 0, "commit_id": "c0"})
    assert checkpoints.is_committed(str(root), 0)
    assert ev.main(["--config", str(cfg), "--families", "simple"]) == 0
    run_root, k, panel, kw = seen[-1]
    assert (run_root, k, panel.benchmark, panel.families) == (str(root), 0, "textworld", ("simple",))  # the newest
    assert "checkpoint 0: textworld success 0.500" in capsys.readouterr().out
    assert kw["device"] == "cuda" and kw["max_new_tokens"] == 48  # from the run config
    assert ev.main(["--config", str(cfg), "--max-new-tokens=16", "--device", "cpu"]) == 0
    assert (seen[-1][3]["max_new_tokens"], seen[-1][3]["device"]) == (16, "cpu")  # a flag given wins


def test_unreachable_storage_exits_75(tmp_path, models, monkeypatch, capsys):
    """75 (EX_TEMPFAIL) is what the chart's podFailurePolicy retries (2 would fail the Job at once)."""
    from sapd.jobs import build_prefixes
    monkeypatch.setenv("SAPD_S3_ENDPOINT_URL", "http://127.0.0.1:1")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "k")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s")
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(tiny_config("s3://bucket/run", *models, storage={"retry_deadline_s": 2})))
    t0 = time.monotonic()
    assert build_prefixes.main(["--config", str(config), "--no-progress"]) == 75
    err = capsys.readouterr().err
    assert 2 <= time.monotonic() - t0 < 60  # retried until the config's deadline, then given up
    assert "unreachable" in err and "still failing after 2 s of retries; storage.retry_deadline_s is 2" in err
    assert "S3 unreachable: retrying until " in err  # the wait said so while it lasted
