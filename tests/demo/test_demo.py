"""The embedded demo (``sapd demo``, sapd/demo/) the way a user runs it — the command line, as a subprocess —
at a very small size: games, noisy and clean expert logs, student and teacher made by `sapd run` configs,
SFT / OPD+Rule / SAPD from the student, held-out evaluation with paired differences, the report; then a
second run that reuses everything and finishes in seconds; then what it wrote plugged into `sapd run` and
`sapd evaluate`. Also its pieces: the config file, the quoted powered-study numbers, the in-process game
generator against `tw-make`, the parallel jobs and the progress lines."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TOY = {"pretrain_games": 3, "train_games": 2, "test_games": 1, "student_epochs": 1.0, "teacher_epochs": 1.0,
       "sft_trajectories_per_round": 4, "rounds": 1, "trajectories_per_round": 2, "group_size": 2,
       "max_new_tokens": 24, "horizon": 3, "tokenizer_vocab": 400,
       "shape": {"hidden_size": 32, "layers": 1, "heads": 2, "kv_heads": 1, "intermediate_size": 64}}


def test_demo_config_errors_name_the_file(tmp_path, capsys):
    from sapd.cli import main

    bad = tmp_path / "bigger.yaml"
    bad.write_text("rounds: 4\ntest_gamse: 30\n")
    assert main(["demo", "--out", str(tmp_path / "out"), "--config", str(bad)]) == 2
    err = capsys.readouterr().err
    assert f"{bad}:2: test_gamse: unknown key (did you mean 'test_games'?)" in err
    assert not (tmp_path / "out").exists()  # nothing generated before the setting was checked


def test_demo_config_reads_numbers_as_yaml_1_2(tmp_path):
    from sapd.demo.main import demo_config

    f = tmp_path / "demo.yaml"
    f.write_text("student_lr: 1e-3\nlrs: {sapd: 5e-5}\nshape: {hidden_size: 64}\n")
    cfg = demo_config(f)
    assert cfg.student_lr == 1e-3 and type(cfg.student_lr) is float
    assert cfg.lrs == {"sft": 3e-4, "opd_rule": 3e-4, "sapd": 5e-5} and cfg.shape.hidden_size == 64 and cfg.shape.layers == 2
    f.write_text("lrs: {sapdd: 1e-4}\n")
    with pytest.raises(ValueError, match=r"lrs: unknown arm\(s\) \['sapdd'\]"):
        demo_config(f)


def test_the_quoted_powered_conclusion_is_the_committed_one():
    """The demo quotes the powered study's verdict; the numbers must be the ones POWERED.md states."""
    from sapd.demo.main import POWERED_CONCLUSION

    in_short = (REPO / "docs" / "results" / "POWERED.md").read_text().split("## In short", 1)[1].split("\n## ", 1)[0]
    quoted = re.search(r"sapd − opd_rule: (action match .*? pts, success .*? pts)", POWERED_CONCLUSION)
    assert quoted and f"(sapd − opd_rule: {quoted.group(1)})" in in_short
    assert "C1 refuted at this scale" in in_short and "0 of 7 arms above the student's success" in in_short


def test_progress_lines_carry_counts_and_eta_without_carriage_returns():
    from sapd.demo.progress import duration, progress

    lines: list[str] = []
    with progress("student SFT: training", 4, "rounds", log=lines.append, every=0.0, bar=False) as bar:
        bar.update()
        bar.heartbeat()
        bar.set(4)
    assert lines[0] == "student SFT: training: 0/4 rounds (0 %), 0 s"
    assert re.fullmatch(r"student SFT: training: 1/4 rounds \(25 %\), 0 s, ETA 0 s", lines[1])
    assert lines[-1].startswith("student SFT: training: 4/4 rounds (100 %)") and "ETA" not in lines[-1]
    assert not any("\r" in x for x in lines)
    # resumed: what was done before is counted, not timed; nothing left to do prints nothing
    resumed: list[str] = []
    with progress("games", 10, "games", log=resumed.append, every=0.0, bar=False, initial=8) as bar:
        bar.update()
    assert resumed[0] == "games: 8/10 games (80 %), 0 s" and resumed[1].startswith("games: 9/10 games (90 %), 0 s, ETA")
    assert resumed[-1].startswith("games: 9/10 games (90 %)")  # closed unfinished: says where it stopped
    before = len(resumed)
    with progress("games", 10, "games", log=resumed.append, bar=False, initial=10):
        pass
    assert len(resumed) == before
    assert (duration(42), duration(185), duration(3720)) == ("42 s", "3 min 05 s", "1 h 02 min")


def _square(report, x: int) -> int:
    report("work", 0, 1, "items")
    report("work", 1, 1, "items")
    return x * x


def _fail(report) -> None:
    raise ValueError("this job's own error")


def test_jobs_run_after_their_inputs_and_errors_name_nothing_else():
    from sapd.demo.workers import Job, run_jobs

    lines: list[str] = []
    out = run_jobs([Job("b", _square, {"x": 3}, after=("a",)), Job("a", _square, {"x": 2})], workers=2,
                   log=lines.append, bar=False)
    assert out == {"a": 4, "b": 9}
    assert "a: work: 1/1 items (100 %), 0 s" in [re.sub(r", \d+ s", ", 0 s", x) for x in lines]
    with pytest.raises(ValueError, match="this job's own error"):
        run_jobs([Job("bad", _fail)], workers=1, log=lambda s: None, bar=False)
    with pytest.raises(ValueError, match=r"job 'x' comes after unknown job\(s\) \['nope'\]"):
        run_jobs([Job("x", _square, {"x": 1}, after=("nope",))], workers=1, log=lambda s: None)


@pytest.mark.slow
def test_games_generated_in_process_are_tw_make_s(tmp_path):
    """The demo's generator (one TextWorld generator call per game, in worker processes) makes the game `tw-make`
    makes (sapd.envs.textworld_env.ensure_game): the same .z8 byte for byte for the coin routes; for the
    families whose game records its output path (two tw-make runs differ there too), the same description
    and the same game to play — the walkthrough's observations are equal step by step."""
    pytest.importorskip("textworld")
    from sapd.demo.games import generate_games
    from sapd.envs.textworld_env import GameSpec, ensure_game, game_path, make_env

    games = [GameSpec("coin_mid", 5), GameSpec("coin_near", 7), GameSpec("kitchen_cut", 2), GameSpec("simple", 1),
             GameSpec("treasure", 3)]
    assert generate_games(games, tmp_path / "fast", workers=2) == 5
    assert generate_games(games, tmp_path / "fast", workers=2) == 0  # present: nothing generated again
    for g in games:
        ensure_game(g, tmp_path / "tw-make")
        fast, slow = game_path(g, tmp_path / "fast"), game_path(g, tmp_path / "tw-make")
        if g.family.startswith("coin"):
            assert fast.read_bytes() == slow.read_bytes(), g
        meta = [json.loads(f.with_suffix(".json").read_text())["metadata"] for f in (fast, slow)]
        for m in meta:
            m.get("settings", {}).pop("output", None)
        assert meta[0] == meta[1], g
        played = []
        for cache in (tmp_path / "fast", tmp_path / "tw-make"):
            env = make_env(g, cache)
            first = env.reset()
            seen = [first.task, first.observation]
            seen += [env.step(a).observation for a in env.walkthrough()]
            env.close()
            played.append(seen)
        assert played[0] == played[1] and len(played[0]) > 2, g


@pytest.mark.slow
def test_demo_command_small(tmp_path):
    pytest.importorskip("textworld")
    import yaml

    from sapd import layout
    from sapd.config import load_config
    from sapd.demo.main import ARMS, BEFORE, TEACHER

    out = tmp_path / "demo-out"
    (tmp_path / "toy.yaml").write_text(yaml.safe_dump(TOY))
    sapd = [sys.executable, "-m", "sapd.cli"]
    demo = [*sapd, "demo", "--out", str(out), "--config", str(tmp_path / "toy.yaml"), "--no-progress"]
    t0 = time.perf_counter()
    cli = subprocess.run(demo, capture_output=True, text=True, timeout=1800, cwd=REPO)
    first_s = time.perf_counter() - t0
    assert cli.returncode == 0, cli.stderr[-3000:]
    lines = cli.stdout.splitlines()
    labels = [BEFORE, *(a[0] for a in ARMS.values()), TEACHER]
    evaluation = json.loads((out / "evaluation.json").read_text())
    assert list(evaluation["rows"]) == labels
    for name, r in evaluation["rows"].items():
        assert r["games"] == 2 and r["decisions"] >= 2, name  # 1 game per family, the same panel for every model
        assert r["success_ci"][0] <= r["success"] <= r["success_ci"][1], name
    sapd_row = evaluation["rows"]["SAPD"]
    d = sapd_row["success_vs_before"]
    assert d["units"] == 2 and d["lo"] <= d["diff"] <= d["hi"]
    assert d["diff"] == pytest.approx(sapd_row["success"] - evaluation["rows"][BEFORE]["success"])
    # every model's distance to the teacher on the same held-out decisions, with its interval (the teacher's
    # own is 0 by definition, not measured), each arm's paired to the student
    for name, r in evaluation["rows"].items():
        if name != TEACHER:
            lo, hi = r["reverse_kl_ci"]
            assert lo <= r["reverse_kl"] <= hi and 0 <= r["sampled_action_match"] <= 1, name
    assert evaluation["rows"][TEACHER]["reverse_kl"] == 0.0 and "sampled_action_match" not in evaluation["rows"][TEACHER]
    k = sapd_row["reverse_kl_vs_before"]
    assert k["units"] == evaluation["rows"][BEFORE]["decisions"] and k["lo"] <= k["diff"] <= k["hi"]
    assert k["diff"] == pytest.approx(sapd_row["reverse_kl"] - evaluation["rows"][BEFORE]["reverse_kl"])
    assert (out / "runs" / "sapd" / "evals" / "000001" / "heldout-distance.json").is_file()
    report = (out / "REPORT.md").read_text()
    assert all(name in report for name in labels) and "What the numbers mean" in report
    assert "reverse KL to the teacher [95 % CI]" in report and "Moving toward the teacher, in 1 round: " in report
    assert "| 0 (itself) |" in report
    assert "SAPD − student before: reverse KL to the teacher" in report
    assert "SAPD − OPD+Rule (baseline): success" in report and "In plain words:" in report
    assert "found SAPD and OPD+Rule not separable" in report  # the powered study's verdict beside one seed
    summary = json.loads((out / "demo-summary.json").read_text())
    assert summary["readings"][0].startswith(f"{TEACHER} − {BEFORE}: action match")  # the premise, first
    assert isinstance(summary["premise_holds"], bool)
    assert (out / "runs" / "sapd" / "report" / "training.png").is_file() and (out / "success.png").is_file()

    # every model was made by a `sapd run` config the demo wrote, which `sapd run` loads as it is
    for name in ("student", "teacher", *ARMS):
        cfg = load_config(out / "configs" / f"{name}.yaml")
        assert layout.committed_checkpoints(cfg.run_root)[-1] == cfg.train.rounds, name
    assert load_config(out / "configs" / "sapd.yaml").loss_cfg.no_action_step == "penalty"
    assert (out / "runs" / "sapd" / "evals" / "000001" / "textworld.json").is_file()  # sapd evaluate's own file

    # progress a person can follow: counts on every long step, in lines (no carriage returns) off a terminal
    for pattern in (r"^coin_near games: 3/3 games", r"^coin_near games: expert episodes: 3/3 episodes",
                    r"^logs and held-out games: training games: 4/4 games",
                    r"^logs and held-out games: training games: expert episodes: 8/8 episodes",
                    r"^student SFT: training: 1/1 rounds", r"^teacher SFT: training: 2/2 rounds",
                    r"^SAPD: training: 1/1 rounds", r"^teacher: held-out decisions: \d+/\d+ decisions",
                    r"^SAPD: distance: distance to the teacher: \d+/\d+ decisions"):
        assert any(re.search(pattern, x) for x in lines), pattern
    assert "\r" not in cli.stdout + cli.stderr
    assert any("held-out TextWorld results" in x for x in lines) and any("SAPD − student before" in x for x in lines)

    # a second run reuses all of it: nothing trained or evaluated again, the same numbers, in seconds
    stamp = (out / "runs" / "sapd" / "checkpoints").stat().st_mtime_ns
    t0 = time.perf_counter()
    again = subprocess.run(demo, capture_output=True, text=True, timeout=600, cwd=REPO)
    second_s = time.perf_counter() - t0
    assert again.returncode == 0, again.stderr[-3000:]
    assert json.loads((out / "evaluation.json").read_text())["rows"] == evaluation["rows"]
    assert (out / "runs" / "sapd" / "checkpoints").stat().st_mtime_ns == stamp
    assert second_s < min(60.0, first_s / 3), (first_s, second_s)

    # what the demo wrote plugs into the next commands as it is: its SAPD student (a model folder), its
    # teacher (a run root: it stands for its newest committed model) and its logs, in `sapd run`, then
    # `sapd evaluate`
    mine = tmp_path / "byo"
    cfg = {"run_root": str(mine), "variant": "sapd",
           "model": {"student": str(out / "sapd_student"), "teacher": str(out / "models" / "teacher")},
           "data": {"input": str(out / "pools" / "train_noisy.jsonl"), "format": "native", "benchmark": "textworld"},
           "sampling": {"group_size": 2, "max_new_tokens": 12},
           "train": {"rounds": 1, "trajectories_per_round": 2, "minibatch_prefixes": 2, "micro_batch_prefixes": 2,
                     "lr": 1e-6}}
    (tmp_path / "byo.yaml").write_text(yaml.safe_dump(cfg))
    run = subprocess.run([*sapd, "run", str(tmp_path / "byo.yaml"), "--no-progress"], capture_output=True,
                         text=True, timeout=900, cwd=REPO)
    assert run.returncode == 0, run.stderr[-3000:]
    assert layout.committed_checkpoints(str(mine)) == [0, 1]
    ev = subprocess.run([*sapd, "evaluate", "--run", str(mine), "--benchmark", "textworld", "--families", "coin_near",
                         "--games-per-family", "1", "--horizon", "2", "--max-new-tokens", "12",
                         "--cache", str(out / "textworld"), "--no-progress"],
                        capture_output=True, text=True, timeout=900, cwd=REPO)
    assert ev.returncode == 0, ev.stderr[-3000:]
    result = json.loads((mine / "evals" / "000001" / "textworld.json").read_text())
    assert result["checkpoint"] == 1 and result["overall"]["episodes"] == 1
    # notices a user cannot act on are silenced at the source (DeepSpeed's accelerator line; transformers'
    # generation-config and padding notices: sapd samples with its own loop, pads and masks itself)
    noise = ("Setting accelerator", "generation flags are not valid", "Setting `pad_token_id`",
             "attention mask and the pad token id were not set", "GenerationConfig")
    assert not [line for line in (cli.stderr + run.stderr + ev.stderr).splitlines() if any(n in line for n in noise)]
