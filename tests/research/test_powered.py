"""The powered study's statistics (the power calculation, paired bootstrap, within-group AUC) by hand,
its held-out metrics and round-0 signal probe on tiny real models, and the per-round health figures."""

from __future__ import annotations

import math
from typing import Any

import pytest

from research.signals import probe_summary, summarize_decisions, with_action
from research.stats import episodes_per_arm, mde, paired_bootstrap, pearson, units_for_mde, within_group_auc


@pytest.mark.parametrize("p,delta,n", [(0.05, 0.05, 432), (0.05, 0.10, 138), (0.2, 0.05, 1091), (0.3, 0.10, 354),
                                       (0.5, 0.10, 385), (0.5, 0.20, 91)])
def test_episodes_per_arm_reproduces_the_audit_table(p, delta, n):
    # n = (z₀.₉₇₅ + z₀.₈)²·[p₁(1−p₁) + p₂(1−p₂)]/δ², p₂ = p + δ
    assert episodes_per_arm(p, p + delta) == n


def test_mde_and_its_inverse_by_hand():
    k = (1.959963984540054 + 0.8416212335729143)
    # p = 0.3, 150 games, 4 seeds, σ_seed 0.04, unpaired: 2.8016·√(2·(0.21/600 + 0.0016/4)) ≈ 0.1085
    assert mde(0.3, 150, 4, 0.04) == pytest.approx(k * math.sqrt(2 * (0.21 / 600 + 0.0004)))
    assert mde(0.3, 150, 4, 0.04) == pytest.approx(0.1085, abs=5e-4)
    assert mde(0.3, 150, 4, 0.03, rho=0.5) == pytest.approx(0.0792, abs=5e-4)  # the audit's "≈ 8 points"
    n = units_for_mde(0.08, 0.3, 4, 0.03, rho=0.5)
    assert mde(0.3, n, 4, 0.03, rho=0.5) <= 0.08 < mde(0.3, n - 1, 4, 0.03, rho=0.5)
    with pytest.raises(ValueError, match="add seeds"):
        units_for_mde(0.05, 0.3, 2, 0.05)


def test_paired_bootstrap_centres_on_the_difference_and_pairs_by_game():
    games = [f"g{i}" for i in range(60)]
    hard = {g: float(i % 3 == 0) for i, g in enumerate(games)}  # game difficulty shared by both arms
    b = {s: dict(hard) for s in range(4)}
    a = {s: {g: 1.0 if (v or i % 5 == 0) else 0.0 for i, (g, v) in enumerate(hard.items())} for s in range(4)}
    res = paired_bootstrap(a, b, n_boot=2000, seed=1)
    exact = sum(a[0].values()) / 60 - sum(hard.values()) / 60
    assert res["diff"] == pytest.approx(exact) and res["lo"] <= exact <= res["hi"]
    assert res["lo"] > 0 and res["units"] == 60 and (res["seeds_a"], res["seeds_b"]) == (4, 4)
    same = paired_bootstrap(b, b, n_boot=500)
    assert same["diff"] == 0.0 and same["lo"] == 0.0 == same["hi"]  # paired: identical arms never differ
    with pytest.raises(ValueError):
        paired_bootstrap({}, b)


def test_within_group_auc_by_hand():
    groups = [[(1.0, True), (0.0, False), (2.0, False)],  # pairs: 1>0 win, 1<2 loss → 1/2
              [(0.5, True), (0.5, False)],                 # tie → 1/2
              [(3.0, True), (1.0, True)],                  # no wrong response: not informative
              [(-1.0, True), (-2.0, False)]]               # win
    res = within_group_auc(groups)
    ci = res.pop("ci")
    assert res == {"auc": (1 + 0 + 0.5 + 1) / 4, "pairs": 4, "groups": 3}
    # the interval resamples the 3 informative groups (prefixes): per-group AUCs are 1/2, 1/2 and 1, so every
    # replicate lies in [1/2, 1], and it is not a point (the groups disagree)
    assert 0.5 <= ci[0] < res["auc"] < ci[1] <= 1.0
    assert within_group_auc(groups)["ci"] == ci
    # groups that all rank perfectly: no spread to resample
    assert within_group_auc([[(1.0, True), (0.0, False)], [(2.0, True), (1.0, False)]])["ci"] == [1.0, 1.0]
    empty = within_group_auc([[(1.0, True)]])
    assert math.isnan(empty["auc"]) and all(math.isnan(x) for x in empty["ci"])
    assert pearson([1, 2, 3], [2, 4, 6]) == pytest.approx(1.0) and math.isnan(pearson([1, 1], [2, 3]))


def test_probe_summary_by_hand():
    def rec(d, act, think, correct, finish="stop"):
        return {"d": d, "action": act, "think": think, "correct": correct, "finish_reason": finish}
    T, F = True, False
    g1 = [rec([0.0, -1.0, -0.5], [F, T, T], [T, F, F], True),     # action sum −1.5, mean −0.75, thought 0
          rec([-2.0, -0.2], [F, T], [T, F], False),                 # action sum −0.2, thought −2
          rec([-0.1, -0.1], [F, F], [F, F], False, "length")]      # malformed: r = 0 tops the group
    g2 = [rec([-3.0], [F], [F], False), rec([-1.0], [F], [F], False)]  # all malformed
    out = probe_summary([g1, g2])
    assert out["responses"] == 5 and out["well_formed"] == pytest.approx(2 / 5)
    assert out["finish_length"] == pytest.approx(1 / 5)
    assert out["all_malformed_groups"] == 0.5 and out["malformed_tops_group"] == 0.5 and out["mixed_groups"] == 0.5
    assert out["auc_action_sum"] == 0.0  # the correct response scores −1.5 < −0.2
    assert out["auc_action_mean"] == 0.0  # −0.75 < −0.2
    assert out["auc_thought_sum"] == 1.0  # 0 > −2: here the thought carries the signal
    assert out["auc_full_sum"] == 1.0  # −1.5 > −2.2
    assert out["mean_r_well_formed"] == pytest.approx((-1.5 - 0.2) / 2)
    assert out["len_corr"] == pytest.approx(-1.0)  # two points: 2 tokens at −1.5, 1 token at −0.2


def test_with_action_and_summaries_by_hand():
    assert with_action("<think>I am in the kitchen.</think>\n<action>go east</action>", "take key") == \
        "<think>I am in the kitchen.</think>\n<action>take key</action>"
    with pytest.raises(ValueError, match="no action block"):
        with_action("<think>hm</think>", "go east")
    recs = [{"match": True, "valid": True, "tll": -1.0, "tll_tokens": 2, "sll_expert": -2.0, "sll_tokens": 2},
            {"match": False, "valid": True, "tll": -4.0, "tll_tokens": 1, "sll_expert": -6.0, "sll_tokens": 3},
            {"match": False, "valid": False, "tll": None, "tll_tokens": 0, "sll_expert": -3.0, "sll_tokens": 1}]
    s = summarize_decisions(recs)
    assert s["action_match"] == pytest.approx(1 / 3) and s["format_valid"] == pytest.approx(2 / 3)
    assert s["tll_sum"] == pytest.approx(-2.5) and s["tll_per_token"] == pytest.approx((-0.5 - 4.0) / 2)
    assert s["sll_expert"] == pytest.approx(-11 / 3) and s["sll_expert_per_token"] == pytest.approx((-1 - 2 - 3) / 3)


# ------------------------------------------------------------------------------ on tiny real models


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    from sapd import checkpoints, layout, storage
    from sapd.config import config_from_dict
    from sapd.data import shards
    from sapd.models.loading import load_tokenizer
    from sapd.run.local import run_pipeline
    from tests.pipeline_util import make_models, tiny_config
    tmp = tmp_path_factory.mktemp("powered")
    student, teacher = make_models(tmp / "models")
    root = str(tmp / "run")
    run_pipeline(config_from_dict(tiny_config(root, student, teacher, train={"rounds": 2})),
                 log=lambda s: None, show_progress=False)
    rows = shards.read_shards(storage.join(layout.prefixes_dir(root), "train")).slice(0, 4).to_pylist()
    for r in rows:  # the study's held-out rows: a thought that does not name the action, then the action
        r["recorded_response"] = f"<think>I look around.</think>\n<action>{r['recorded_action']}</action>"
    tok = load_tokenizer(student)
    return root, checkpoints.load_checkpoint_model(root, 0), checkpoints.load_checkpoint_model(root, 2), tok, rows


class Scripted:
    """Greedy/sampled decoding replaced by fixed texts per prompt (tokenised, log-probs −1 per token)."""

    def __init__(self, tok, texts_for):
        self.tok, self.texts_for = tok, texts_for

    def generate(self, prompts, params, progress=None):
        from sapd.models.generation import Sample
        out = []
        for i, _ in enumerate(prompts):
            group = []
            for text in self.texts_for(i)[:params.n]:
                ids = list(self.tok(text, add_special_tokens=False)["input_ids"])
                group.append(Sample(token_ids=ids, logprobs=[-1.0] * len(ids), text=text, finish_reason="stop"))
            out.append(group)
        return out


def test_heldout_decisions_teacher_equal_student_gives_tll_equal_to_the_expert_likelihood(tiny_run):
    """When the teacher is the student and the student's greedy action is the expert's, the teacher's
    log-likelihood of that action (after the recorded thought) is exactly the student's likelihood of the
    expert action; a wrong action is scored, a malformed response is not."""
    from research.signals import heldout_decisions
    _, student, _, tok, rows = tiny_run
    texts = [f"<think>x</think>\n<action>{rows[0]['recorded_action']}</action>",
             "<think>x</think>\n<action>jump around</action>", "no action at all",
             f"<think>y</think>\n<action>{rows[3]['recorded_action'].upper()}</action>"]
    recs = heldout_decisions(student, student, tok, rows, generator=Scripted(tok, lambda i: [texts[i]]))
    assert [r["match"] for r in recs] == [True, False, False, True]  # case-insensitive match
    assert [r["valid"] for r in recs] == [True, True, False, True]
    assert recs[0]["tll"] == pytest.approx(recs[0]["sll_expert"], abs=1e-5) and recs[0]["tll_tokens"] > 0
    assert recs[1]["tll"] is not None and recs[1]["tll"] != pytest.approx(recs[1]["sll_expert"], abs=1e-3)
    assert recs[2]["tll"] is None and all(r["sll_expert"] < 0 for r in recs)
    s = summarize_decisions(recs)
    assert s["action_match"] == 0.5 and s["decisions"] == 4


def test_signal_probe_on_real_teacher_scores(tiny_run):
    from research.signals import signal_probe
    from sapd.models.scoring import score_groups
    _, student, teacher, tok, rows = tiny_run
    rows = rows[:2]

    def texts(i):
        return [f"<think>a</think>\n<action>{rows[i]['recorded_action']}</action>",
                "<think>a</think>\n<action>go west</action>", "<think>a</think> and then nothing"]
    out = signal_probe(student, teacher, tok, rows, group_size=3, generator=Scripted(tok, texts))
    assert out["responses"] == 6 and out["well_formed"] == pytest.approx(4 / 6) and out["mixed_groups"] == 1.0
    assert out["auc_groups"] == 2 and out["auc_pairs"] == 2
    # the action-only AUC recomputed from the teacher's own scores of the two action tokens' spans
    from sapd.method.action_mask import action_token_mask
    wins = 0.0
    for i, r in enumerate(rows):
        prompt = list(tok(r["prompt"], add_special_tokens=False)["input_ids"])
        ids = [list(tok(t, add_special_tokens=False)["input_ids"]) for t in texts(i)[:2]]
        lp = score_groups(teacher, [("p", prompt, ids)], pad_id=tok.pad_token_id)[0]
        sums = [sum(x + 1.0 for x, m in zip(lp[j], action_token_mask(tok, ids[j], "textworld")) if m)
                for j in range(2)]
        wins += 1.0 if sums[0] > sums[1] else 0.5 if sums[0] == sums[1] else 0.0
    assert out["auc_action_sum"] == pytest.approx(wins / 2)


def test_round_health_reads_step_logs_and_scored_rounds(tiny_run):
    from research.signals import round_health
    root = tiny_run[0]
    health = round_health(root)
    assert [h["round"] for h in health] == [0, 1]
    for h in health:
        assert 0.0 <= h["well_formed"] <= 1.0 and 0.0 <= h["action_less"] <= 1.0
        assert {"no_action_fraction", "all_no_action_groups", "step_adv_abs_mean", "clip_fraction"} <= set(h)
        assert h["action_less"] == pytest.approx(h["no_action_fraction"], abs=1e-6)


# ------------------------------------------------------------------------- the pre-registered config


def test_the_committed_config_states_the_power_calculation_it_was_derived_from():
    from pathlib import Path

    from research.powered import PoweredStudy, check_power, load_powered_config
    repo = Path(__file__).resolve().parents[2]
    cfg = load_powered_config(repo / "experiments" / "powered.yaml")
    seeds = len(cfg.final_seeds)
    assert seeds >= 4
    recomputed = check_power(cfg.power, seeds)
    assert cfg.power.games_required == recomputed["games_required"]
    assert cfg.power.match_mde == pytest.approx(recomputed["match_mde"], abs=1e-3)
    test_games = cfg.test_games * len(cfg.families)
    assert test_games >= max(150, cfg.power.games_required)
    assert cfg.power.expected_test_decisions >= 700
    assert (cfg.group_size, cfg.temperature, cfg.thought) == (8, 1.0, "observe") and cfg.noise > 0
    # the arms, each with a learning-rate grid to choose from on the validation panel
    variants = {a.variant for a in cfg.arms.values()}
    assert {"sft", "opd", "opd_rule", "sapd_paper", "sapd", "wo_rule", "full_token"} <= variants
    assert all(len(a.lrs) >= 2 for a in cfg.arms.values())
    study = PoweredStudy(cfg, repo / "experiments" / "powered", repo / ".cache" / "powered-test-unused")
    panels = study.panels()  # disjoint by construction (an overlap is a ConfigError)
    assert len(panels["test"]) == test_games and len(panels["val"]) == cfg.val_games * len(cfg.families)


@pytest.mark.slow
def test_powered_study_is_resumable_in_units_and_rebuilds_its_cache_deterministically(tmp_path):
    """The smoke config end to end: every finished unit is a JSON in the ledger, a rerun does nothing,
    a lost cache is rebuilt to the same weights, and the test panel stays locked without a committed plan."""
    import shutil
    import time
    from pathlib import Path

    from research.powered import PoweredStudy, load_powered_config, weights_hash
    cfg = load_powered_config(Path(__file__).resolve().parents[1] / "powered_smoke.yaml")
    ledger, cache = tmp_path / "ledger", tmp_path / "cache"
    study = PoweredStudy(cfg, ledger, cache, log=lambda s: None, config_path=tmp_path / "not-committed.yaml")
    pilot = study.pilot()
    assert pilot["pools"]["train_noisy"]["won"] >= 1 and pilot["sapd_round_seconds"] > 0
    study.probe()
    done = study.sweep(max_units=2)
    assert done == ["sweep/opd-lr0.0001", "sweep/sapd.exclude-lr0.0001"]
    assert sorted(study.ledger.units()) == sorted(["pilot", "probe-round0", *done])
    unit = study.ledger.get(done[1])
    assert {"action_match", "tll_sum", "sll_expert", "success", "per_game", "per_decision"} <= set(unit["eval"])
    assert unit["health"] and {"well_formed", "no_action_fraction", "all_no_action_groups"} <= set(unit["health"][0])
    with pytest.raises(RuntimeError, match="sweep is not complete"):
        study.final()
    # a fresh session: the cache is gone, the ledger (committed) is not
    shutil.rmtree(cache)
    again = PoweredStudy(cfg, ledger, cache, log=lambda s: None, config_path=tmp_path / "not-committed.yaml")
    t0 = time.perf_counter()
    assert again.pilot() == pilot and again.probe()["prefixes"] == 3  # read from the ledger
    assert time.perf_counter() - t0 < 5
    models = again.ensure_models()  # rebuilt from nothing: the same games, pools, tokenizer and weights
    assert {k: weights_hash(v) for k, v in models.items()} == pilot["weights"]
    assert again.sweep(max_units=1) == ["sweep/sapd.penalty-lr0.0001"]  # continues where it stopped
    assert not again.plan_is_committed()


def test_report_shows_only_finished_units_and_the_paired_differences(tmp_path):
    from pathlib import Path

    from research.powered import PoweredStudy, load_powered_config
    from research.powered_report import render_powered
    cfg = load_powered_config(Path(__file__).resolve().parents[1] / "powered_smoke.yaml")
    cfg.final_seeds = [1, 2]
    study = PoweredStudy(cfg, tmp_path / "ledger", tmp_path / "cache", log=lambda s: None)

    def final(arm, seed, matches, wins, tll):
        ev = {"per_decision": {f"d{i}": [m, None if m is None else tll] for i, m in enumerate(matches)},
              "per_game": {f"g{i}": w for i, w in enumerate(wins)}}
        ms = [m or 0 for m in matches]
        ev.update(action_match=sum(ms) / len(ms), tll_sum=tll, success=sum(wins) / len(wins), sll_expert=-2.0,
                  format_valid=1.0, seconds=20.0)
        curve = [{"round": 0, "action_match": 0.2}, {"round": 1, "action_match": sum(ms) / len(ms)}]
        health = [{"round": 1, "well_formed": 0.9, "action_less": 0.1, "all_no_action_groups": 0.0}]
        study.ledger.put(f"final/{arm}-s{seed}", {"seed": seed, "eval": ev, "curve": curve, "health": health,
                                                  "train_seconds": 10.0, "curve_seconds": 5.0})
    for seed in (1, 2):
        final("opd_rule", seed, [1, 0, 0, 0], [0, 0, 1], -2.0)
        final("sapd", seed, [1, 1, 0, 0], [1, 0, 1], -1.5)
    study.ledger.put("final/reference-student", {"eval": {"action_match": 0.1, "tll_sum": -3.0, "success": 0.0,
                                                          "sll_expert": -4.0, "format_valid": 0.95}})
    cfg.arms = {"opd_rule": cfg.arms["opd"], **cfg.arms}
    text = render_powered(study, tmp_path / "out").read_text()
    assert "Validation sweep (0 of" in text and "Still to run:" in text  # nothing invented for the sweep
    assert "Test panel (4 of" in text
    # the absolute rows: the reference as recorded, each arm as the mean over its seeds
    assert "| *student (reference)* | – | 0.100 | -3.000 | 0.000 |" in text
    assert next(x for x in text.splitlines() if x.startswith("| sapd | 2 |")).startswith(
        "| sapd | 2 | 0.500 ± 0.000 | -1.500 ± 0.000 | 0.667 ± 0.000 |")
    # action match 0.5 − 0.25, TLL −1.5 − (−2.0), success 2/3 − 1/3, paired; identical seeds
    row = next(line for line in text.splitlines() if line.startswith("| C1: SAPD (chosen treatment) − OPD+Rule |"))
    assert "| 2 / 2 | +0.250 [" in row and "+0.500 [" in row and "+0.333 [" in row
    assert "Reading of C1 by the plan's rule" in text  # decided by the plan's code, not by hand
    # the summary leads with the C1 reading
    short = text.split("## In short", 1)[1].split("\n## ", 1)[0]
    assert "4 of" in short and "- Reading of C1 by the plan's rule" in short and "- SAPD beats OPD+Rule:" in short
    assert ("the student before any round has action match 0.100 and success 0.000; the arms so far end at "
            "0.250–0.500 match and 0.333–0.667 success (means over seeds; 2 of 2 arms above" in short)
    for fig in ("powered_curves.png", "powered_differences.png", "powered_final_health.png"):
        assert (tmp_path / "out" / fig).is_file() and f"]({fig})" in text, fig
    # the power check: both arms' seeds agree exactly here, so the observed seed sd is 0
    assert "| success | 0.030 | 0.000 (2 arms) |" in text
    assert "Mean recorded cost per final run 35 s" in text  # the final runs' own cost (train + eval + curve)
    assert "learning-curve evaluations of the" not in text  # every run recorded its curve's time
    # the paper's claims: C1 measured (+25 points, both seeds in), the others not run yet
    claim = next(x for x in text.splitlines() if x.startswith("| SAPD beats OPD+Rule |"))
    assert "| sapd − opd_rule | +25.0 [" in claim and "(provisional)" not in claim
    assert next(x for x in text.splitlines() if x.startswith("| the rule term matters")).endswith("| not run yet |")

    # once every planned final run is in, the summary stops calling itself partial; with the round-0 probes
    # recorded (here the study's own units), the premise line gives both models' AUCs
    import json
    committed = Path(__file__).resolve().parents[2] / "experiments" / "powered"
    for unit in ("probe-round0", "probe-smollm2"):
        study.ledger.put(unit, json.loads((committed / f"{unit}.json").read_text()))
    cfg.arms = {a: cfg.arms[a] for a in ("opd_rule", "sapd")}
    text = render_powered(study, tmp_path / "out").read_text()
    short = text.split("## In short", 1)[1].split("\n## ", 1)[0]
    assert "nothing remains to run." in text and "**Measured cost in all:" in text
    assert "All 4 final runs are in." in short and "provisional" not in short and "so far" not in short
    assert "the arms end at 0.250–0.500 match" in short
    assert ("SAPD's premise at round 0 holds: action-only AUC 0.896 [0.687, 1.000]; with the real SmolLM2-135M "
            "(after a few SFT rounds, no SAPD training) 0.892 [0.798, 0.969]") in short


def test_c1_and_default_readings_follow_the_plan():
    from research.powered_report import c1_reading, default_reading

    def c(m, t=(0.1, 0.05, 0.2), s=(0.0, -0.05, 0.05)):
        return {"match": dict(zip(("diff", "lo", "hi"), m)), "tll": dict(zip(("diff", "lo", "hi"), t)),
                "success": dict(zip(("diff", "lo", "hi"), s))}
    assert "supported" in c1_reading(c((0.10, 0.07, 0.13)), 0.061)
    assert "not separable" in c1_reading(c((0.10, 0.07, 0.13), t=(0.1, -0.1, 0.2)), 0.061)  # TLL not above 0
    assert "refuted" in c1_reading(c((0.0, -0.03, 0.03)), 0.061)  # a large effect is excluded
    assert "not separable" in c1_reading(c((0.03, -0.01, 0.07)), 0.061)
    assert default_reading(c((0.0, -0.02, 0.02)), paper_collapsed=True).startswith("change")
    assert default_reading(c((0.0, -0.02, 0.02)), paper_collapsed=False).startswith("keep")
    assert default_reading(c((0.05, 0.01, 0.09)), paper_collapsed=False).startswith("change")
    assert default_reading(c((-0.05, -0.09, -0.01)), paper_collapsed=True).startswith("keep")


def test_selection_lines_show_where_match_and_success_disagree(tmp_path):
    from pathlib import Path

    from research.powered import PoweredStudy, load_powered_config
    from research.powered_report import selection_lines
    study = PoweredStudy(load_powered_config(Path(__file__).resolve().parents[1] / "powered_smoke.yaml"), tmp_path / "l",
                         tmp_path / "c", log=lambda s: None)

    def run(m, s):
        return {"eval": {"action_match": m, "success": s}}
    done = {"sft-lr0.0003": run(0.8, 0.5), "sft-lr0.001": run(0.7, 0.4),
            "opd-lr3e-05": run(0.7, 0.8), "opd-lr0.0003": run(0.8, 0.6)}
    study.selection = lambda: {"arms": {"sft": {"unit": "sweep/sft-lr0.0003"}, "opd": {"unit": "sweep/opd-lr0.0003"}}}
    text = "\n".join(selection_lines(study, done))
    assert "| opd | opd-lr0.0003 | 0.800 / 0.600 | opd-lr3e-05 | 0.700 / 0.800 |" in text
    assert "| sft | sft-lr0.0003 | 0.800 / 0.500 | sft-lr0.0003 |" in text
    assert "different learning rates for 1 of 2 arms (opd): in each, the higher learning rate" in text


def test_claims_are_read_in_their_own_direction():
    from research.powered_report import claim_reading

    def c(lo, hi):
        return {"match": {"diff": (lo + hi) / 2, "lo": lo, "hi": hi}}
    assert claim_reading(c(0.01, 0.05), 1) == "agrees"
    assert claim_reading(c(0.01, 0.05), -1) == "**contradicts**"  # e.g. SFT − OPD+Rule above 0
    assert claim_reading(c(-0.05, -0.01), -1) == "agrees"
    assert claim_reading(c(-0.02, 0.03), 1) == "not separable at this power"


def test_wilson_interval_matches_the_textbook_values():
    from sapd.demo.intervals import wilson_interval
    lo, hi = wilson_interval(0.5, 100)
    assert abs(lo - 0.4038) < 5e-4 and abs(hi - 0.5962) < 5e-4  # 50 of 100: [0.404, 0.596]
    lo, hi = wilson_interval(0.0, 10)
    assert lo == 0.0 and abs(hi - 0.2775) < 5e-4  # 0 of 10: [0, 0.278]
    assert wilson_interval(0.3, 0) == (0.0, 1.0)


def test_claims_split_units_between_processes_and_stale_claims_are_taken_over(tmp_path):
    """Two processes of the same sweep: a unit claimed by a live process is skipped, one whose process
    is gone is taken over, and nothing is run twice."""
    import subprocess
    import sys
    from pathlib import Path

    from research.powered import PoweredStudy, load_powered_config
    cfg = load_powered_config(Path(__file__).resolve().parents[1] / "powered_smoke.yaml")
    study = PoweredStudy(cfg, tmp_path / "ledger", tmp_path / "cache", log=lambda s: None)
    ran: list[str] = []

    def fake_train(unit, variant, loss, lr, seed, panel="val"):
        ran.append(unit)
        return study.ledger.put(unit, {"eval": {"action_match": 0.5, "tll_sum": -1.0}})
    study.train_and_validate = fake_train  # type: ignore[method-assign]
    first, second = (u for u, *_ in study.sweep_units()[:2])
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        claim = study.claims._path(first)
        claim.parent.mkdir(parents=True)
        claim.write_text(str(other.pid))
        assert not study.claims.take(first)  # a live process holds it
        assert study.sweep(max_units=1) == [second] and ran == [second]
        assert study.claims.holder(second) is None  # released when done
    finally:
        other.kill()
        other.wait()
    assert study.sweep(max_units=1) == [first]  # the holder is gone: its claim is stale
    assert ran == [second, first] and study.claims.holder(first) is None


def test_final_runs_the_arms_in_the_order_asked_then_the_reference_rows(tmp_path):
    """`final --arms` orders the work (never a result): the named arms' seeds, then the student and the
    teacher on the test panel (reference rows); an unknown arm is refused before anything runs."""
    from pathlib import Path

    from research.powered import PoweredStudy, load_powered_config
    cfg = load_powered_config(Path(__file__).resolve().parents[1] / "powered_smoke.yaml")
    cfg.final_seeds = [1, 2]
    study = PoweredStudy(cfg, tmp_path / "ledger", tmp_path / "cache", log=lambda s: None)
    # a finished sweep: penalty wins the treatment choice
    for unit, *_ in study.sweep_units():
        study.ledger.put(unit, {"train_seconds": 1.0, "eval": {"action_match": 0.9 if "penalty" in unit else 0.5,
                                                               "tll_sum": -1.0, "seconds": 1.0}})
    for unit, *_ in study.sweep_units():  # wo_rule appears once the treatment is chosen
        if study.ledger.get(unit) is None:
            study.ledger.put(unit, {"train_seconds": 1.0, "eval": {"action_match": 0.5, "tll_sum": -1.0,
                                                                   "seconds": 1.0}})
    # the measured cost: each unit's training and evaluation seconds, summed over the ledger
    assert study.spent_seconds() == pytest.approx(2.0 * len(study.sweep_units()))
    ran: list[tuple[str, str, Any]] = []

    def fake_train(unit, variant, loss, lr, seed, panel="val"):
        ran.append((unit, panel, loss.get("no_action_step")))
        return study.ledger.put(unit, {"eval": {}})

    def fake_reference(unit, who, panel):
        ran.append((unit, panel, who))
        return study.ledger.put(unit, {"eval": {}})
    study.train_and_validate = fake_train  # type: ignore[method-assign]
    study.evaluate_reference = fake_reference  # type: ignore[method-assign]
    study.plan_is_committed = lambda: True  # type: ignore[method-assign]
    with pytest.raises(ValueError, match="unknown arm"):
        study.final(arms=["sapd", "nope"])
    assert ran == []
    assert study.final(max_units=3, arms=["wo_rule", "student", "sapd"]) == \
        ["final/wo_rule-s1", "final/wo_rule-s2", "final/reference-student"]
    assert ran[0] == ("final/wo_rule-s1", "test", "penalty")  # the chosen treatment, on the test panel
    assert study.final() == ["final/opd-s1", "final/opd-s2", "final/sapd-s1", "final/sapd-s2",
                             "final/reference-teacher"]  # the rest, in the config's order
    assert study.ledger.get("selection")["treatment"] == "penalty"
    assert study.status()["final"] == "8/8"


def test_tokenizer_and_teacher_data_keep_to_the_first_pretraining_games(tmp_path, monkeypatch):
    """`tokenizer_pretrain_games` / `teacher_pretrain_games`: the tokenizer's text and the teacher's data
    take only the first N pre-training games (what they were built from before the pool grew), so that a
    cache rebuilt from nothing makes the recorded tokenizer and models."""
    from pathlib import Path

    from research import powered
    from research.powered import PoweredStudy, load_powered_config
    from sapd.data.loaders import write_native_jsonl
    from sapd.data.schema import Trajectory, Turn
    cfg = load_powered_config(Path(__file__).resolve().parents[1] / "powered_smoke.yaml")
    cfg.tokenizer_pretrain_games = 2
    study = PoweredStudy(cfg, tmp_path / "ledger", tmp_path / "cache", log=lambda s: None)
    study.pools.mkdir(parents=True)

    def traj(game: str) -> Trajectory:
        return Trajectory(id=game, benchmark="textworld", task="take the coin", success=True,
                          turns=[Turn(observation=f"room of {game}", response=f"<think>on</think><action>go {game}</action>",
                                      action=f"go {game}")], metadata={"game": game})
    write_native_jsonl([traj(f"coin_near-{i}") for i in range(3)], str(study.pool_path("pretrain")))
    for n in ("train_clean", "train_noisy"):
        write_native_jsonl([traj(f"coin-{n}")], str(study.pool_path(n)))
    seen: list[str] = []
    monkeypatch.setattr(powered, "ensure_tokenizer", lambda out, texts, vocab_size: seen.extend(texts()))
    study.ensure_tokenizer()
    text = "\n".join(seen)
    assert "go coin_near-0" in text and "go coin_near-1" in text and "go coin_near-2" not in text
    assert "go coin-train_clean" in text and "go coin-train_noisy" in text
    assert study._first_pretrain_games(None) == {f"coin_near-{i}" for i in range(cfg.pretrain_games)}
