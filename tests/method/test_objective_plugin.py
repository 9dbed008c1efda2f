""""A new objective is one registered function", end to end: an objective defined outside the package
(tests/toy_objective.py) is named in a run config as ``package.module:function`` or installed as an entry
point of the group ``sapd.objectives``; it trains through the real stages — the stage Jobs' doors
(``python -m sapd.jobs.<stage>``) and ``sapd run`` — and its own loss terms reach the round log and the step
lines, Prometheus (a real Pushgateway scraped by a real Prometheus) and ``sapd report``'s plotted
series, with no edit anywhere in sapd."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from prometheus_client import generate_latest

from sapd.config import ConfigError, config_from_dict, load_config
from sapd.method import objective
from sapd.metrics import Metrics
from tests.conftest import get_url
from tests.pipeline_util import make_models, tiny_config

REPO = Path(__file__).resolve().parents[2]
TOY = "tests.toy_objective:squared_gap"


@pytest.fixture
def registry(monkeypatch):
    """OBJECTIVES as a copy, so what a test loads does not outlive it."""
    monkeypatch.setattr(objective, "OBJECTIVES", dict(objective.OBJECTIVES))
    return objective.OBJECTIVES


def test_a_function_named_package_module_function_is_the_objective(registry, tmp_path):
    cfg = config_from_dict(tiny_config(str(tmp_path / "run"), "s", "t", loss={"objective": TOY}))
    obj = objective.objective_of(cfg.loss_cfg)
    assert obj.name == TOY and obj.data == "scored"
    assert obj.needs == {"new_logp_P_G_T", "response_mask_P_G_T", "teacher_logp_P_G_T"}
    assert objective.required_inputs(cfg.loss_cfg) == obj.needs  # no π_old, no reference log-probs
    # the variant may name it too: the objective with the default knobs
    by_variant = config_from_dict(tiny_config(str(tmp_path / "run"), "s", "t", variant=TOY))
    assert by_variant.loss_cfg.objective == TOY and by_variant.variant == TOY


def test_an_objective_that_does_not_load_is_one_line_naming_the_file_and_key(registry, tmp_path):
    path = tmp_path / "run.yaml"
    for name, says in (("no_such_pkg.mod:fn", "cannot load 'fn' from module 'no_such_pkg.mod'"),
                       ("tests.toy_objective:nothing_here", "cannot load 'nothing_here'"),
                       ("tests.toy_objective:LossConfig", "must take new_logp_P_G_T"),
                       ("no_such_objective", "a package.module:function, or an entry point")):
        path.write_text(f"run_root: {tmp_path / 'r'}\nloss: {{objective: '{name}'}}\n")
        with pytest.raises(ConfigError) as e:
            load_config(path)
        assert str(e.value).startswith(f"{path}:2: variant/loss: ") and says in str(e.value), str(e.value)
        assert "\n" not in str(e.value)


def test_an_entry_point_of_group_sapd_objectives_loads(registry, tmp_path, monkeypatch):
    """What ``pip install`` of a package declaring ``[project.entry-points."sapd.objectives"] toy_gap =
    "tests.toy_objective:squared_gap"`` leaves on sys.path: a dist-info folder with entry_points.txt."""
    dist = tmp_path / "site" / "toy_objectives-0.1.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: toy-objectives\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text(f"[sapd.objectives]\ntoy_gap = {TOY}\n")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    cfg = config_from_dict(tiny_config(str(tmp_path / "run"), "s", "t", variant="toy_gap"))
    assert objective.objective_of(cfg.loss_cfg).loss.__qualname__ == "squared_gap"
    assert "toy_gap" in registry


def test_every_loss_term_is_a_prometheus_term():
    m = Metrics(job="train")
    m.record_step({"round": 0, "loss": 0.5, "loss_gap": 0.25, "loss_abs_gap": 0.4, "loss_kl": 0.01,
                   "lr": 1e-6, "step_seconds": 1.0})
    text = generate_latest(m.registry).decode()
    for term, value in (("total", 0.5), ("gap", 0.25), ("abs_gap", 0.4), ("kl", 0.01)):
        assert f'sapd_loss{{term="{term}"}} {value}' in text, text
    assert 'term="lr"' not in text


def _run(args: list[str], env: dict[str, str]) -> str:
    proc = subprocess.run([sys.executable, *args], env=env, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{args}: exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


@pytest.mark.integration
def test_a_toy_objective_from_a_user_module_trains_and_shows_its_terms_everywhere(tmp_path, prometheus_stack):
    student, teacher = make_models(tmp_path / "models")
    root = tmp_path / "run"
    cfg_path = tmp_path / "toy.yaml"
    cfg_path.write_text(yaml.safe_dump(tiny_config(str(root), student, teacher, loss={"objective": TOY})))
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1",
           "SAPD_PUSHGATEWAY_URL": prometheus_stack["pushgateway"], "SAPD_RELEASE": "toy"}
    # round 0 as the chart's stage Jobs run it: one door per stage, each a process of its own
    _run(["-m", "sapd.jobs.build_prefixes", "--config", str(cfg_path)], env)
    _run(["-m", "sapd.jobs.teacher_scores", "--config", str(cfg_path), "--round", "0", "--worker", "0"], env)
    train_log = _run(["-m", "sapd.jobs.train", "--config", str(cfg_path), "--round", "0", "--no-progress"], env)
    # round 1 as `sapd run` runs it locally (it resumes from what the Jobs committed)
    run_log = _run(["-m", "sapd.cli", "run", str(cfg_path), "--no-progress"], env)
    assert "holds checkpoints [0, 1, 2]" in run_log, run_log

    # the round logs, and the step lines both doors printed
    for k in (0, 1):
        steps = [json.loads(line) for line in (root / "logs" / f"round-{k:06d}.jsonl").read_text().splitlines()]
        assert steps and all(s["loss"] == s["loss_gap"] > 0 and s["loss_abs_gap"] > 0 for s in steps), steps
        assert all("loss_tok" not in s and "old_logp_seconds" not in s for s in steps)  # its own terms only
    for out in (train_log, run_log):
        assert any(" (gap " in line and " abs_gap " in line for line in out.splitlines()), out

    # Prometheus: the train Job's push, scraped from the Pushgateway
    from tests.run.test_metrics import _wait_query
    terms = {r["metric"]["term"]: float(r["value"][1])
             for r in _wait_query(prometheus_stack["prometheus"], 'sapd_loss{job="train",release="toy"}')}
    assert {"total", "gap", "abs_gap"} == set(terms), terms
    last0 = json.loads((root / "logs" / "round-000000.jsonl").read_text().splitlines()[-1])
    assert terms["gap"] == pytest.approx(last0["loss_gap"]) and terms["total"] == pytest.approx(last0["loss"])
    exposition = get_url(f"{prometheus_stack['pushgateway']}/metrics")
    assert any(line.startswith("sapd_loss{") and 'term="abs_gap"' in line and 'job="train"' in line
               for line in exposition.splitlines()), exposition

    # sapd report: the toy's terms are plotted series
    _run(["-m", "sapd.cli", "report", str(root)], env)
    summary = json.loads((root / "report" / "summary.json").read_text())
    assert sorted(summary["plotted"]["loss terms"]) == ["loss", "loss_abs_gap", "loss_gap"], summary["plotted"]
    assert (root / "report" / "training.png").stat().st_size > 10_000
