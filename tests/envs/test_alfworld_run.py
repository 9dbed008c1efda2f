"""The local ALFWorld journey as a user runs it, on CPU with tiny models: ``sapd alfworld-games`` (train and
valid_unseen), ALFWorld's expert recorded with ``sapd collect-expert``, ``sapd init --benchmark alfworld``
filled in, ``sapd run`` for two rounds, then ``sapd evaluate`` on valid_unseen (ALFWorld's engine plays
the checkpoint) and the evaluation job (``sapd.jobs.evaluate``) the way the chart runs it, with ALFWORLD_DATA."""

from __future__ import annotations

import json

import pytest
import yaml

import sapd.jobs.evaluate
from sapd import layout, storage
from sapd.cli import main
from tests.alfworld_util import generated_games
from tests.pipeline_util import make_models

SIX = {"Pick", "Look", "Clean", "Heat", "Cool", "Pick2"}


@pytest.mark.slow
def test_alfworld_journey_games_expert_init_run_evaluate(tmp_path, capsys, monkeypatch):
    data = generated_games("valid_unseen", per_type=1, seed=0)
    assert generated_games("train", per_type=1, seed=0) == data  # both splits in one ALFWORLD_DATA
    capsys.readouterr()
    monkeypatch.setenv("ALFWORLD_DATA", str(data))

    expert = tmp_path / "alfworld_expert.jsonl"
    assert main(["collect-expert", "--benchmark", "alfworld", "--split", "train", "--expert", "planner",
                 "--out", str(expert)]) == 0
    trajs = [json.loads(line) for line in expert.read_text().splitlines()]
    assert len(trajs) == 6 and all(t["success"] for t in trajs) and {t["category"] for t in trajs} == SIX

    config = tmp_path / "alfworld.yaml"
    assert main(["init", "--benchmark", "alfworld", "--out", str(config)]) == 0
    starter = yaml.safe_load(config.read_text())
    student, teacher = make_models(tmp_path / "models")
    text = config.read_text().replace(starter["data"]["input"], str(expert))
    config.write_text(text.replace(starter["model"]["student"], student).replace(starter["model"]["teacher"], teacher))
    tiny = tmp_path / "tiny.yaml"  # the run itself at CPU size; everything else is the starter's
    tiny.write_text(yaml.safe_dump({
        "data": {"max_prompt_tokens": 4096},
        "sampling": {"group_size": 2, "max_new_tokens": 12, "prompts_per_batch": 4},
        "train": {"rounds": 2, "trajectories_per_round": 2, "minibatch_prefixes": 4, "micro_batch_prefixes": 2,
                  "lr": 1e-3}}))
    run_root = tmp_path / "runs" / "alfworld"
    assert main(["run", str(config), str(tiny), "--run-root", str(run_root), "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "checkpoints [0, 1, 2]" in out
    manifest = json.loads(storage.read_text(storage.join(layout.prefixes_dir(str(run_root)), "_MANIFEST.json")))
    assert manifest["format_read"].startswith("auto → native")  # the collect-expert records, read back

    assert main(["evaluate", "--run", str(run_root), "--benchmark", "alfworld", "--split", "valid_unseen",
                 "--alfworld-data", str(data), "--horizon", "3", "--max-new-tokens", "12", "--no-progress"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    printed = json.loads(lines[-1])
    assert printed["checkpoint"] == 2 and set(printed["by_category"]) == SIX
    assert set(printed["interval95"]) == SIX | {"overall"}
    assert any(line.startswith("95% intervals (Wilson): overall ") for line in lines)
    result = json.loads((run_root / "evals" / "000002" / "alfworld.json").read_text())
    assert result["split"] == "valid_unseen" and result["overall"]["episodes"] == 6
    for cat in SIX:
        lo, hi = result["by_category"][cat]["success_ci"]
        assert 0.0 <= lo <= result["by_category"][cat]["success"] <= hi <= 1.0
    episodes = (run_root / "evals" / "000002" / "alfworld.episodes.jsonl").read_text().splitlines()
    assert all(json.loads(e)["metadata"]["engine_wording"] == "move" for e in episodes)  # the real engine played

    # the evaluation job as the chart runs it: the run's config, ALFWORLD_DATA from the environment
    assert sapd.jobs.evaluate.main(["--config", str(run_root / "config.yaml"), "--checkpoint", "1", "--horizon", "3",
                               "--no-progress"]) == 0
    job = json.loads((run_root / "evals" / "000001" / "alfworld.json").read_text())
    assert set(job["by_category"]) == SIX and job["checkpoint"] == 1
    # the panel's default split ("test") is recorded under ALFWorld's own name, the folder it played, and
    # the games are recorded as sapd's generated ones, not ALFWorld's official split
    assert job["split"] == "valid_unseen"
    assert job["games"] == {"generated_by": "sapd alfworld-games", "generator_version": 1, "seed": 0, "per_type": 1,
                            "check_expert": "planner"}
    # a file written before (the split recorded as "test") is the same panel: skipped, not refused
    old = run_root / "evals" / "000001" / "alfworld.json"
    old.write_text(json.dumps({**job, "split": "test"}))
    capsys.readouterr()
    assert sapd.jobs.evaluate.main(["--config", str(run_root / "config.yaml"), "--checkpoint", "1", "--horizon", "3",
                               "--no-progress"]) == 0
    assert "checkpoint 1: alfworld already evaluated" in capsys.readouterr().out
