"""Sequential training over two TextWorld families (SFT, tiny models): the lower-triangular
forgetting matrix, its files, and stage 2 starting from stage 1's final checkpoint."""

import json
from pathlib import Path

import pytest

from research.sequential import Stage, forgetting_markdown, run_sequential
from sapd import layout
from tests.pipeline_util import make_models, tiny_config

QUIET = dict(log=lambda s: None, show_progress=False)


def test_markdown_is_lower_triangular():
    res = {"variant": "sft", "stages": ["a", "b"], "tasks": ["a", "b"],
           "matrix": {"a": {"a": 0.5}, "b": {"a": 0.25, "b": 1.0}}}
    md = forgetting_markdown(res).splitlines()
    assert md[0] == "| after stage (sft) | a | b |"
    assert md[2] == "| a | 0.500 |  |" and md[3] == "| b | 0.250 | 1.000 |"
    assert md[4] == "| forgetting | +0.250 | +0.000 |"


@pytest.mark.slow
def test_two_stage_sft_sequence(tmp_path):
    from safetensors.torch import load_file

    from sapd.data.loaders import write_native_jsonl
    from sapd.envs.loop import LoopOptions, collect_expert
    from sapd.envs.panels import textworld_specs

    student, teacher = make_models(tmp_path / "models")
    games = tmp_path / "games"
    stages = []
    for fam in ("simple", "coin"):
        specs = textworld_specs([fam], 1, 0, games)
        pool = tmp_path / f"{fam}.jsonl"
        write_native_jsonl(collect_expert(specs, "textworld", LoopOptions(horizon=3)), str(pool))
        stages.append(Stage(fam, {"input": str(pool), "format": "native", "benchmark": "textworld",
                                  "val_fraction": 0.0, "max_prompt_tokens": None},
                            eval_specs=lambda fam=fam: textworld_specs([fam], 1, 0, games)))
    base = tiny_config("unused", student, teacher, train={"rounds": 1, "trajectories_per_round": 1})
    root = str(tmp_path / "seq")
    res = run_sequential(base, stages, root, variant="sft", horizon=3, max_new_tokens=16, **QUIET)

    assert res["variant"] == "sft" and res["stages"] == ["simple", "coin"]
    assert set(res["matrix"]["simple"]) == {"simple"}  # stage 1 row: only the first task
    assert set(res["matrix"]["coin"]) == {"simple", "coin"}  # stage 2 row: both
    assert all(0.0 <= v <= 1.0 for row in res["matrix"].values() for v in row.values())
    assert json.loads((Path(root) / "sequential.json").read_text())["matrix"] == res["matrix"]
    md = (Path(root) / "forgetting.md").read_text()
    assert "| simple |" in md and "| coin |" in md and "forgetting" in md

    r1, r2 = res["runs"]["simple"]["run_root"], res["runs"]["coin"]["run_root"]
    assert r1 == str(Path(root) / "stage-0-simple") and r2 == str(Path(root) / "stage-1-coin")
    k1 = res["runs"]["simple"]["final_checkpoint"]
    assert k1 == 1 and res["runs"]["coin"]["student"] == layout.checkpoint_model_dir(r1, k1)
    w_prev = load_file(str(Path(layout.checkpoint_model_dir(r1, k1)) / "model.safetensors"))
    w_start = load_file(str(Path(layout.checkpoint_model_dir(r2, 0)) / "model.safetensors"))
    w_orig = load_file(str(Path(layout.checkpoint_model_dir(r1, 0)) / "model.safetensors"))
    assert w_prev.keys() == w_start.keys()
    assert all((w_prev[n] == w_start[n]).all() for n in w_prev)  # stage 2 starts where stage 1 ended
    assert any((w_prev[n] != w_orig[n]).any() for n in w_prev)  # … and stage 1 did train
    for run, tasks in ((r1, ["simple"]), (r2, ["simple", "coin"])):
        k = layout.committed_checkpoints(run)[-1]
        for t in tasks:
            assert (Path(layout.evals_dir(run, k)) / f"sequential-{t}.json").is_file()

    # resumable: a second call retrains nothing and returns the same matrix
    again = run_sequential(base, stages, root, variant="sft", horizon=3, max_new_tokens=16, **QUIET)
    assert again["matrix"] == res["matrix"]
