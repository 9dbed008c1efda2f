"""`python -m research sequential` (a sequence file → stage runs and the forgetting matrix) and `sapd teacher-pool`
(a teacher-generated pool), through their command lines: what a user types."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from research.__main__ import main as research_main
from research.sequential import load_sequence
from sapd.cli import main
from sapd.config import ConfigError
from tests.pipeline_util import make_models, tiny_config


def _write(path: Path, data) -> str:
    path.write_text(yaml.safe_dump(data))
    return str(path)


def _spec(tmp_path: Path, **over):
    spec = {"root": str(tmp_path / "seq"), "base": {"run_root": "unused"},
            "stages": [{"name": "a", "data": {"input": "a.jsonl", "benchmark": "textworld"},
                        "eval": {"families": ["simple"], "games_per_family": 1, "seed": 0}}]}
    spec.update(over)
    return spec


def test_sequence_file_is_checked_key_by_key(tmp_path):
    ok = load_sequence(_write(tmp_path / "ok.yaml", _spec(tmp_path, horizon=5)))
    assert ok["root"] == str(tmp_path / "seq") and ok["horizon"] == 5 and ok["stages"][0].eval_benchmark == "textworld"
    with pytest.raises(ConfigError, match=r"bad\.yaml: unknown key\(s\) \['stagez'\]"):
        load_sequence(_write(tmp_path / "bad.yaml", {**_spec(tmp_path), "stagez": []}))
    bad_eval = _spec(tmp_path)
    bad_eval["stages"][0]["eval"]["famillies"] = ["x"]
    with pytest.raises(ConfigError, match=r"stages\[0\]\.eval\.famillies: unknown key \(did you mean 'eval\.families'\?\)"):
        load_sequence(_write(tmp_path / "e.yaml", bad_eval))
    no_data = _spec(tmp_path)
    del no_data["stages"][0]["data"]
    with pytest.raises(ConfigError, match=r"stages\[0\]: missing 'data'"):
        load_sequence(_write(tmp_path / "d.yaml", no_data))
    with pytest.raises(ConfigError, match=r"base: .*trainn: unknown key"):
        load_sequence(_write(tmp_path / "b.yaml", _spec(tmp_path, base=[_write(tmp_path / "o.yaml", {"trainn": {}})])))


def test_cli_refuses_a_variant_override_into_the_same_root(tmp_path, capsys):
    spec = _write(tmp_path / "s.yaml", _spec(tmp_path, variant="sapd"))
    assert research_main(["sequential", spec, "--variant", "sft"]) == 2
    assert "give --root too" in capsys.readouterr().err


@pytest.mark.slow
def test_sapd_sequence_and_teacher_pool_through_the_cli(tmp_path, capsys):
    from sapd import layout
    from sapd.data.loaders import LoadOptions, load_trajectories, write_native_jsonl
    from sapd.envs.loop import LoopOptions, collect_expert
    from sapd.envs.panels import textworld_specs

    student, teacher = make_models(tmp_path / "models")
    games = tmp_path / "games"
    stages = []
    for fam in ("simple", "coin"):
        pool = tmp_path / f"{fam}.jsonl"
        write_native_jsonl(collect_expert(textworld_specs([fam], 1, 0, games), "textworld", LoopOptions(horizon=3)),
                           str(pool))
        stages.append({"name": fam, "data": {"input": str(pool), "format": "native", "benchmark": "textworld",
                                             "val_fraction": 0.0, "max_prompt_tokens": None},
                       "eval": {"families": [fam], "games_per_family": 1, "seed": 0, "cache_dir": str(games)}})
    base = tiny_config("unused", student, teacher, train={"rounds": 1, "trajectories_per_round": 1})
    (tmp_path / "base.yaml").write_text(yaml.safe_dump(base))
    root = tmp_path / "seq"
    spec = _write(tmp_path / "seq.yaml", {"root": str(root), "base": ["base.yaml"], "variant": "sapd", "horizon": 3,
                                          "max_new_tokens": 16, "env_timeout_s": 120, "stages": stages})
    assert research_main(["sequential", spec, "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "| after stage (sapd) | simple | coin |" in out and "| forgetting |" in out
    res = json.loads((root / "sequential.json").read_text())
    assert res["variant"] == "sapd" and set(res["matrix"]["coin"]) == {"simple", "coin"}
    r1 = res["runs"]["simple"]["run_root"]
    assert res["runs"]["coin"]["student"] == layout.checkpoint_model_dir(r1, 1)
    # SAPD stages precompute teacher scores: the scored round of each stage is committed
    for st in ("stage-0-simple", "stage-1-coin"):
        assert (root / st / "rounds" / "000000" / "scored" / "_MANIFEST.json").is_file()
        assert yaml.safe_load((root / st / "config.yaml").read_text())["variant"] == "sapd"

    # the sequence's last checkpoint plays as a teacher: a sampled, seeded pool
    pool = tmp_path / "teacher.jsonl"
    args = ["teacher-pool", "--run", str(root / "stage-1-coin"), "--families", "coin", "--games-per-family", "1",
            "--cache", str(games), "--samples-per-game", "2", "--horizon", "3", "--max-new-tokens", "16",
            "--sampling-seed", "3", "--out", str(pool), "--no-progress"]
    assert main(args) == 0
    assert "wrote 2 teacher trajectories" in capsys.readouterr().out
    trajs = load_trajectories(str(pool), "native", LoadOptions("textworld")).trajectories
    assert len(trajs) == 2 and all(t.metadata["teacher"].endswith("stage-1-coin@1") for t in trajs)
    first = pool.read_text()
    assert main(args) == 0 and pool.read_text() == first  # the same seed, the same pool
    assert main(["teacher-pool", "--families", "coin", "--out", str(pool)]) == 2
    assert "exactly one of --model" in capsys.readouterr().err
