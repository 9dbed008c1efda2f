"""bench/offline_vs_online.py at tiny sizes: both methods per env, same decisions, stage times within the round."""

from __future__ import annotations

import pytest

from bench.offline_vs_online import main


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
            st = rr["stages"]
            assert all(st[s] > 0 for s in ("sample", "generation", "score", "train"))
            assert (st["env"] > 0) == online
            assert st["sample"] + st["score"] + st["masks_rules"] + st["train"] <= rr["round_seconds"]
        assert r["ratio_same_decisions"] > 0
    assert (tmp_path / "f.png").stat().st_size > 0
