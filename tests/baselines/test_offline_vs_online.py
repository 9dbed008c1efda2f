"""bench/offline_vs_online.py at tiny sizes: both methods per env, stage times that add up to the round; TextWorld
and ScienceWorld at the same decisions, ALFWorld (its real engine, generated games, the planner's logs) at the same
trajectories, run the way its user runs it."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from bench.offline_vs_online import PARTS, main
from tests.alfworld_util import generated_games

REPO = Path(__file__).resolve().parents[2]


def _check_breakdown(rr: dict, online: bool) -> None:
    """The parts are measured (env, generation, score, masks/rules, train) or the rest of the wall time (other):
    none negative, together the round."""
    st = rr["stages"]
    assert all(st[p] >= 0 for p in PARTS), st
    assert sum(st[p] for p in PARTS) == pytest.approx(rr["round_seconds"], abs=1e-9)
    assert all(st[p] > 0 for p in ("generation", "score", "train"))
    assert (st["env"] > 0) == online


@pytest.mark.slow
def test_both_envs_both_methods_same_decisions(tmp_path):
    results = main(["--rounds", "1", "--games", "2", "--horizon", "2", "--group", "2", "--new-tokens", "6",
                    "--hidden", "64", "--teacher-hidden", "64", "--teacher-layers", "2", "--quiet",
                    "--png", str(tmp_path / "f.png")])
    assert [r["env"] for r in results] == ["textworld", "scienceworld"]
    for r in results:
        sapd, opd = r["rounds"]["sapd"][0], r["rounds"]["online_opd"][0]
        assert sapd["decisions"] == opd["decisions"] == r["decisions_per_round"] == 4
        assert sapd["responses"] == 2 * opd["responses"]
        for rr, online in ((sapd, False), (opd, True)):
            _check_breakdown(rr, online)
            assert rr["stages"]["sample"] + rr["stages"]["score"] <= rr["round_seconds"]
        assert r["ratio_per_round"] > 0
    assert (tmp_path / "f.png").stat().st_size > 0


@pytest.mark.slow
def test_alfworld_figure2_as_its_user_runs_it(tmp_path):
    data = generated_games("train", per_type=1, seed=0)  # `sapd alfworld-games --split train --per-type 1`
    out = tmp_path / "fig2.json"
    run = subprocess.run([sys.executable, "bench/offline_vs_online.py", "--env", "alfworld", "--alfworld-data",
                          str(data), "--games", "2", "--rounds", "2", "--horizon", "4", "--group", "2",
                          "--new-tokens", "6", "--hidden", "64", "--teacher-hidden", "64", "--teacher-layers", "2",
                          "--json", str(out)], cwd=REPO, capture_output=True, text=True, timeout=1200)
    assert run.returncode == 0, run.stderr[-3000:]
    lines = run.stdout.strip().splitlines()
    m = re.fullmatch(r"figure 2 \(alfworld\): SAPD (\d+\.\d)× faster per round than online OPD", lines[-1])
    assert m, lines[-5:]
    (r,) = json.loads(out.read_text())
    assert float(m.group(1)) == round(r["ratio_per_round"], 1)
    med = r["median"]
    assert r["ratio_per_round"] == pytest.approx(med["online_opd"]["round_seconds"] / med["sapd"]["round_seconds"])
    # the scale is said: 2 of the paper's 16 trajectories per round, G = 2 of its 8, up to 4 of 50 steps
    scaled = "; ".join(r["scaled_from_paper"].values())
    assert "2 trajectories per round of 16 (÷8)" in scaled and "G = 2 of 8 (÷4)" in scaled and "4 of 50" in scaled
    assert any(line.startswith("scaled down from the paper's setting: ") for line in lines)
    for k in range(2):
        sapd, opd = r["rounds"]["sapd"][k], r["rounds"]["online_opd"][k]
        _check_breakdown(sapd, online=False)
        _check_breakdown(opd, online=True)
        # the same two games: SAPD every prefix of the planner's logs (each cut to 4 steps) × G, online up to 4 steps
        assert sapd["decisions"] == r["decisions_per_round"] <= 2 * 4 and sapd["responses"] == 2 * sapd["decisions"]
        assert 2 <= opd["decisions"] <= 2 * 4 and opd["responses"] == opd["decisions"]
    for method in ("sapd", "online_opd"):  # the printed breakdown is the median round's and adds up to it
        row = med[method]
        assert sum(row[p] for p in PARTS) == pytest.approx(row["round_seconds"], abs=1e-9)
    printed = next(line for line in lines if re.match(r"online round \d+\.\d\d = ", line))
    assert f"online round {med['online_opd']['round_seconds']:.2f} = env {med['online_opd']['env']:.2f}" in printed
