"""The evaluation stage on the real embedded TextWorld panel: deterministic numbers per category,
skip when already evaluated, the newest checkpoint in 'latest' mode, and the expert-pool command."""

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

from sapd import layout, storage
from sapd.config import config_from_dict
from sapd.data.loaders import LoadOptions, load_trajectories
from sapd.envs.panels import PanelSpec, episode_specs
from sapd.metrics import Metrics
from sapd.run.local import run_pipeline
from sapd.stages.evaluate import evaluate_checkpoint, latest_checkpoint
from tests.pipeline_util import make_models, tiny_config

REPO = Path(__file__).resolve().parents[2]
QUIET = dict(log=lambda s: None, show_progress=False)


@pytest.fixture(scope="module")
def run_root(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("evalrun")
    student, teacher = make_models(tmp / "models")
    root = str(tmp / "run")
    run_pipeline(config_from_dict(tiny_config(root, student, teacher, train={"rounds": 1})), **QUIET)
    return root


@pytest.mark.slow
def test_evaluation_is_deterministic_per_category_and_skips_done_checkpoints(run_root, tmp_path):
    cache = tmp_path / "games"
    panel = PanelSpec("textworld", families=("simple", "coin"), games_per_family=1, seed=0, cache_dir=str(cache))
    kw = dict(horizon=4, max_new_tokens=24, **QUIET)
    assert latest_checkpoint(run_root) == 1
    first = evaluate_checkpoint(run_root, "latest", panel, **kw)
    assert first["checkpoint"] == 1 and set(first["by_category"]) == {"simple", "coin"}
    assert first["overall"]["episodes"] == 2 and 0.0 <= first["overall"]["success"] <= 1.0
    assert first["overall"]["mean_steps"] <= 4  # the horizon holds
    assert "split" not in first  # TextWorld's games are generated per seed: it has no split to record
    episodes = storage.read_text(storage.join(layout.evals_dir(run_root, 1), "textworld.episodes.jsonl")).splitlines()
    assert len(episodes) == 2
    metrics = Metrics(job="evaluate")  # a CronJob's run that finds the checkpoint evaluated …
    again = evaluate_checkpoint(run_root, 1, panel, metrics=metrics, **kw)
    assert again == first  # skipped: the committed result is returned as it is
    # … still states the success rates: its push replaces the job's Pushgateway group, which must keep them
    for cat, value in [("all", first["overall"]["success"])] + [(c, v["success"]) for c, v in first["by_category"].items()]:
        assert metrics.registry.get_sample_value("sapd_eval_success_ratio",
                                                 {"benchmark": "textworld", "category": cat}) == value
    with pytest.raises(ValueError, match="evaluated on another panel"):
        evaluate_checkpoint(run_root, 1, dataclasses.replace(panel, seed=7), **kw)
    other = evaluate_checkpoint(run_root, 0, panel, **kw)  # same panel and seed, a fresh evaluation …
    storage.delete(storage.join(layout.evals_dir(run_root, 0), "textworld.json"))
    redo = evaluate_checkpoint(run_root, 0, panel, **kw)  # … repeated: the same numbers
    assert {k: redo[k] for k in ("overall", "by_category")} == {k: other[k] for k in ("overall", "by_category")}


def test_splits_are_recorded_under_the_benchmarks_own_names():
    """ALFWorld's aliases name folders (test = valid_unseen, dev = valid_seen): the folder is recorded, and an
    older file that recorded the alias is the same panel; ScienceWorld's own names stay; no split elsewhere."""
    alf = PanelSpec("alfworld")
    assert alf.recorded_split() == "valid_unseen" and alf.identity()["split"] == "valid_unseen"
    assert alf.identity_of({"seed": 0, "games_per_family": 2, "split": "test"}) == alf.identity()
    dev = dataclasses.replace(alf, split="dev")
    assert dev.recorded_split() == "valid_seen" and dev.identity_of({"split": "test"})["split"] == "valid_unseen"
    assert PanelSpec("scienceworld", split="dev").recorded_split() == "dev"
    assert [PanelSpec(b).recorded_split() for b in ("textworld", "searchqa", "webshop")] == [None, None, None]


def test_unknown_environment_is_a_clear_error():
    with pytest.raises(FileNotFoundError, match="alfworld-download"):
        episode_specs(PanelSpec("alfworld", data_dir="/nonexistent/alfworld"))
    with pytest.raises(ValueError, match="search QA needs --rows"):
        episode_specs(PanelSpec("searchqa"))
    with pytest.raises(FileNotFoundError, match="no committed checkpoint"):
        latest_checkpoint("/nonexistent/run")


@pytest.mark.slow
def test_collect_expert_writes_a_pool_the_prefix_builder_reads(tmp_path):
    out = tmp_path / "pool.jsonl"
    res = subprocess.run([sys.executable, "-m", "sapd.cli", "collect-expert", "--families", "simple,treasure",
                          "--games-per-family", "1", "--cache", str(tmp_path / "games"), "--out", str(out)],
                         capture_output=True, text=True, cwd=REPO, timeout=600)
    assert res.returncode == 0, res.stderr
    assert "wrote 2 expert trajectories" in res.stdout and "expert success 1.00" in res.stdout
    trajs = load_trajectories(str(out), "native", LoadOptions("textworld")).trajectories
    assert {t.category for t in trajs} == {"simple", "treasure"} and all(t.success for t in trajs)
    assert all(turn.response.startswith("<think>") and "<action>" in turn.response for t in trajs for turn in t.turns)


def test_evaluate_job_reads_run_root_and_benchmark_from_the_config(tmp_path, capsys):
    cfg = tmp_path / "config.yaml"
    cfg.write_text(json.dumps({"run_root": str(tmp_path / "empty-run"), "data": {"benchmark": "textworld"}}))
    from sapd.jobs.evaluate import main
    # no checkpoint yet: a CronJob started before the first round has nothing to do, and that is no failure
    assert main(["--config", str(cfg), "--no-progress"]) == 0
    assert "no committed checkpoint yet, nothing to evaluate" in capsys.readouterr().out
    # a named checkpoint that does not exist is a user error (exit code 2), said in one line
    assert main(["--config", str(cfg), "--checkpoint", "3", "--no-progress"]) == 2
    assert "evaluate: error:" in capsys.readouterr().err


@pytest.mark.slow
def test_evaluation_on_an_s3_run_root(s3_storage, tmp_path):
    student, teacher = make_models(tmp_path / "models")
    root = storage.join(s3_storage, "run")
    run_pipeline(config_from_dict(tiny_config(root, student, teacher, train={"rounds": 1})), **QUIET)
    panel = PanelSpec("textworld", families=("simple",), games_per_family=1, seed=0, cache_dir=str(tmp_path / "games"))
    kw = dict(horizon=2, max_new_tokens=16, **QUIET)
    result = evaluate_checkpoint(root, "latest", panel, **kw)
    dest = storage.join(layout.evals_dir(root, 1), "textworld.json")
    assert storage.read_json(dest) == result and result["checkpoint"] == 1
    assert storage.exists(storage.join(layout.evals_dir(root, 1), "textworld.episodes.jsonl"))
    assert evaluate_checkpoint(root, 1, panel, **kw) == result  # skipped on S3 too


@pytest.mark.slow
def test_sampled_evaluation_at_a_temperature_is_seeded_and_kept_apart_from_greedy(run_root, tmp_path):
    """SDAR validates at T = 0.4: a sampled evaluation is its own result file, reproducible by seed."""
    import shutil
    shutil.copytree(run_root, tmp_path / "run", ignore=shutil.ignore_patterns("evals"))  # its own run root:
    run_root = str(tmp_path / "run")  # other tests evaluate checkpoint 0 greedily on other panels
    panel = PanelSpec("textworld", families=("coin",), games_per_family=2, seed=3, cache_dir=str(tmp_path / "g"))
    kw = dict(horizon=3, max_new_tokens=24, **QUIET)
    sampled = evaluate_checkpoint(run_root, 0, panel, temperature=0.4, **kw)
    assert sampled["temperature"] == 0.4
    folder = layout.evals_dir(run_root, 0)
    assert storage.exists(storage.join(folder, "textworld@T0.4.json"))
    texts = storage.read_text(storage.join(folder, "textworld@T0.4.episodes.jsonl"))
    storage.delete(storage.join(folder, "textworld@T0.4.json"))
    again = evaluate_checkpoint(run_root, 0, panel, temperature=0.4, **kw)
    assert storage.read_text(storage.join(folder, "textworld@T0.4.episodes.jsonl")) == texts  # same seed
    assert again["overall"] == sampled["overall"]
    greedy = evaluate_checkpoint(run_root, 0, panel, **kw)
    assert greedy["temperature"] == 0.0 and storage.exists(storage.join(folder, "textworld.json"))
    with pytest.raises(ValueError, match="temperature"):
        evaluate_checkpoint(run_root, 0, panel, temperature=-1.0, **kw)


def test_offline_eval_samples_at_a_temperature_reproducibly(run_root):
    from sapd import checkpoints
    from sapd.data import shards
    from sapd.models.loading import load_tokenizer
    from sapd.stages.evaluate import offline_eval
    rows = shards.read_shards(storage.join(layout.prefixes_dir(run_root), "train"))
    rows = rows.slice(0, 6)
    tok = load_tokenizer(str(checkpoints.checkpoint_model_path(run_root, 0)))
    model = checkpoints.load_checkpoint_model(run_root, 0)
    a = offline_eval(model, tok, rows, "alfworld", max_new_tokens=12, temperature=0.4, seed=1)
    b = offline_eval(model, tok, rows, "alfworld", max_new_tokens=12, temperature=0.4, seed=1)
    assert a == b and a["prefixes"] == 6
