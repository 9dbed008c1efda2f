"""The student's distance to the teacher on held-out prefixes (issue 36): the figures by hand, the measured
numbers against an independent full-softmax computation on tiny real models, and the validation the way a run
makes it — every round (or every N) inside the teacher-scores stage of ``sapd run``, committed in the run root,
resumed exactly, split over workers, in the metrics and in ``sapd report``."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from sapd import layout, storage
from sapd.config import ConfigError, config_from_dict
from sapd.data import validation
from sapd.data.validation import ratio_interval, summarize, wilson
from sapd.run import plan
from sapd.run.local import run_pipeline
from tests.pipeline_util import make_models, tiny_config

REPO = Path(__file__).resolve().parents[2]
QUIET = dict(log=lambda s: None, show_progress=False)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return make_models(tmp_path_factory.mktemp("models"))


# ------------------------------------------------------------------------------------------ by hand


def _rec(pid, cat, samples, tokens, kl, match, valid=None, rec_tokens=4, rec_s=-8.0, rec_t=-6.0):
    return {"prefix_id": pid, "category": cat, "samples": samples, "tokens": tokens, "reverse_kl": kl,
            "action_tokens": tokens // 5, "reverse_kl_action": kl / 2, "action_match": match, "format_valid": samples if valid is None else valid, "finish_length": 0,
            "recorded_tokens": rec_tokens, "recorded_student_logp": rec_s, "recorded_teacher_logp": rec_t}


def test_the_figures_by_hand():
    records = [_rec("a#0", "x", 4, 20, 2.0, 1), _rec("a#1", "x", 4, 10, 4.0, 3, rec_s=-4.0, rec_t=-4.0),
               _rec("b#0", "y", 4, 30, 0.0, 0)]
    teacher = [{"prefix_id": p, "category": c, "samples": 4, "action_match": m, "format_valid": 4}
               for p, c, m in (("a#0", "x", 4), ("a#1", "x", 3), ("b#0", "y", 2))]
    out = summarize(records, teacher)
    o = out["overall"]
    # reverse KL per token = Σ kl / Σ tokens = 6 / 60; its cluster-robust se by the delta method
    kl = o["reverse_kl_per_token"]
    assert kl["value"] == pytest.approx(0.1)
    resid = [2.0 - 0.1 * 20, 4.0 - 0.1 * 10, 0.0 - 0.1 * 30]
    se = math.sqrt(3 / 2 * sum(r * r for r in resid)) / 60
    assert kl["ci"] == pytest.approx([0.1 - 1.959964 * se, 0.1 + 1.959964 * se], rel=1e-5)
    assert o["reverse_kl_per_sample"]["value"] == pytest.approx(6 / 12)
    assert o["reverse_kl_per_action_token"]["value"] == pytest.approx(3 / 12)  # (1 + 2 + 0) / (4 + 2 + 6)
    # action match 4 / 12, the teacher's 9 / 12; forward log-ratio on the recorded tokens (2 + 0 + 2) / 12
    assert o["action_match"]["value"] == pytest.approx(4 / 12) and o["teacher_action_match"]["value"] == 0.75
    assert o["recorded_logratio_per_token"]["value"] == pytest.approx(4 / 12)
    assert o["recorded_student_nll_per_token"]["value"] == pytest.approx(20 / 12)
    lo, hi = o["action_match"]["ci"]
    assert lo < 4 / 12 < hi
    assert set(out["by_category"]) == {"x", "y"} and out["by_category"]["y"]["reverse_kl_per_token"]["value"] == 0.0
    assert out["by_category"]["x"]["prefixes"] == 2 and out["by_category"]["x"]["teacher_action_match"]["value"] == 7 / 8
    assert ratio_interval([1.0], [2.0]) == (0.5, None, 2.0)  # one prefix: no interval
    assert ratio_interval([0.0], [0.0])[0] is None
    lo, hi = wilson(0.0, 12)
    assert lo == 0.0 and 0.2 < hi < 0.3  # every sample missed: the interval still spans what 12 samples allow


def test_a_paired_difference_by_hand():
    from sapd.data.validation import paired_ratio_difference
    # model a: 6 / 4 = 1.5 nats per token, model b: 3 / 4 = 0.75, on the same two prefixes
    d = paired_ratio_difference([2.0, 4.0], [2.0, 2.0], [1.0, 2.0], [2.0, 2.0])
    # dᵢ = (aᵢ − 1.5·bᵢ)/4 − (cᵢ − 0.75·eᵢ)/4 = ∓0.125; se = √(2 · 2 · 0.125²) = 0.25
    assert d["diff"] == 0.75 and d["ci"] == pytest.approx([0.75 - 1.959964 * 0.25, 0.75 + 1.959964 * 0.25])
    same = paired_ratio_difference([2.0, 4.0], [2.0, 2.0], [2.0, 4.0], [2.0, 2.0])
    assert same["diff"] == 0.0 and same["ci"] == [0.0, 0.0]  # a model against itself: no uncertainty at all


def test_config_checks_name_the_field():
    with pytest.raises(ConfigError, match="validation.group_size: must be at least 1"):
        config_from_dict({"validation": {"group_size": 0}})
    with pytest.raises(ConfigError, match=r"validation.every_rounds: must be at least 0 \(0 = never\)"):
        config_from_dict({"validation": {"every_rounds": -1}})
    with pytest.raises(ConfigError, match="validation.evry_rounds: unknown key"):
        config_from_dict({"validation": {"evry_rounds": 2}})


def test_which_checkpoints_are_validated():
    cfg = config_from_dict({"train": {"rounds": 5}, "validation": {"every_rounds": 2}})
    assert [k for k in range(6) if validation.wanted(cfg, k)] == [0, 2, 4, 5]  # and always the last
    assert [str(s) for s in plan.steps(cfg)][-3:] == ["teacher-scores-r4", "train-r4", "teacher-scores-r5"]
    off = config_from_dict({"train": {"rounds": 5}, "validation": {"every_rounds": 0}})
    assert not any(validation.wanted(off, k) for k in range(6)) and plan.steps(off)[-1] == plan.Step("train", 4)
    sft = config_from_dict({"variant": "sft", "train": {"rounds": 2}})  # no teacher: nothing to measure against
    assert not validation.wanted(sft, 0) and all(s.stage != "teacher-scores" for s in plan.steps(sft))
    rows = [{"prefix_id": f"t{i}#0"} for i in range(10)]
    a, b = validation.sample_rows(rows, 4, 0), validation.sample_rows(list(reversed(rows)), 4, 0)
    assert a == b and len(a) == 4 and validation.sample_rows(rows, 0, 0) == validation.sample_rows(rows, 99, 0)


# ------------------------------------------------------------------------------------------ against full softmax


def _full_logp(model, prompt: list[int], response: list[int]) -> torch.Tensor:
    """log π(response token k | prompt, response<k) from one full forward and a float64 log-softmax over the
    whole vocabulary (a different path from the KV-cached sampler and the shared-prefix scorer)."""
    seq = torch.tensor([prompt + response])
    with torch.no_grad():
        logits = model(input_ids=seq).logits[0, len(prompt) - 1:-1].double()
    return torch.log_softmax(logits, -1), torch.log_softmax(logits, -1).gather(
        -1, torch.tensor(response)[:, None])[:, 0]


@pytest.fixture(scope="module")
def rows_and_models(models, tmp_path_factory):
    from sapd.data.prefix_table import read_prefixes
    from sapd.models.loading import load_causal_lm, load_tokenizer
    from sapd.stages.build_prefixes import ensure_prefixes
    cfg = config_from_dict(tiny_config(str(tmp_path_factory.mktemp("prefixes")), *models))
    tok = load_tokenizer(models[0])
    ensure_prefixes(cfg, tok, **QUIET)
    rows = read_prefixes(layout.prefixes_dir(cfg.run_root), "train").to_pylist()[:12]
    student, teacher = (load_causal_lm(m) for m in models)
    return rows, student.eval(), teacher.eval(), tok


def test_the_distance_equals_a_direct_full_softmax_computation(rows_and_models):
    """Every per-prefix sum the validation reports — Σ log π_S − log π_T over the G samples' tokens, both
    models' log-probs of the recorded response — equals a direct full-softmax computation over the same
    tokens; and the sampled reverse KL agrees with the exact per-position KL Σ_v π_S(v) log π_S(v)/π_T(v)
    summed over the sampled positions (the same expectation, no sampling noise at each position) within its
    sampling error: the estimator is unbiased, not just self-consistent."""
    from sapd.method.action_mask import action_token_mask
    from sapd.models.generation import HFGenerator, SamplingParams
    from sapd.models.scoring import HFScorer
    from sapd.stages.validation import distance_records
    rows, student, teacher, tok = rows_and_models
    pad = tok.pad_token_id
    params = SamplingParams(n=16, temperature=1.0, top_p=1.0, max_new_tokens=10, seed=3)
    gen = HFGenerator(student, tok, prompts_per_batch=4)
    records, timings = distance_records(rows, gen, HFScorer(teacher, pad), HFScorer(student, pad), tok,
                                        "alfworld", params)
    assert set(timings) == {"sample_seconds", "score_seconds", "recorded_seconds"}
    samples = gen.generate([r["prompt"] for r in rows], params)  # the same seed: the same samples
    diffs = []
    for r, rec, group in zip(rows, records, samples):
        prompt = tok(r["prompt"], add_special_tokens=False)["input_ids"]
        sampled = exact = on_actions = 0.0
        for s in group:
            full_s, lp_s = _full_logp(student, prompt, s.token_ids)
            full_t, lp_t = _full_logp(teacher, prompt, s.token_ids)
            sampled += float((lp_s - lp_t).sum())
            exact += float((full_s.exp() * (full_s - full_t)).sum())
            mask = torch.tensor(action_token_mask(tok, s.token_ids, "alfworld"))
            on_actions += float((lp_s - lp_t)[mask].sum())  # (the random models rarely act: see the next test)
        assert rec["reverse_kl"] == pytest.approx(sampled, abs=2e-4 * rec["tokens"]), r["prefix_id"]
        assert rec["reverse_kl_action"] == pytest.approx(on_actions, abs=2e-4 * max(rec["action_tokens"], 1))
        assert rec["tokens"] == sum(len(s.token_ids) for s in group) and rec["samples"] == 16
        diffs.append(sampled - exact)
        recorded = tok(r["recorded_response"], add_special_tokens=False)["input_ids"]
        assert rec["recorded_tokens"] == len(recorded)
        assert rec["recorded_student_logp"] == pytest.approx(float(_full_logp(student, prompt, recorded)[1].sum()),
                                                             abs=1e-3)
        assert rec["recorded_teacher_logp"] == pytest.approx(float(_full_logp(teacher, prompt, recorded)[1].sum()),
                                                             abs=1e-3)
    mean = sum(diffs) / len(diffs)
    se = math.sqrt(sum((d - mean) ** 2 for d in diffs) / (len(diffs) - 1) / len(diffs))
    total_kl = sum(rec["reverse_kl"] for rec in records) / len(records)
    assert total_kl > 0.05  # the two tiny models differ: there is a distance to measure
    print(f"sampled − exact per prefix: {mean:.4f} ± {se:.4f}; sampled KL per prefix {total_kl:.3f}")
    assert abs(mean) < 4 * se + 1e-6, (mean, se, total_kl)


def test_action_tokens_matches_and_format_on_samples_that_act(rows_and_models):
    """Samples with actions (the tiny random models never write one): per prefix the recorded action, another
    action and no action at all, carrying the student's own log-probs. The action-token part of the distance
    sums exactly the action mask's tokens; the match and well-formed counts are the parser's."""
    from sapd.method.action_mask import action_token_mask
    from sapd.models.generation import Sample, SamplingParams
    from sapd.models.scoring import HFScorer
    from sapd.stages.validation import distance_records
    rows, student, teacher, tok = rows_and_models
    rows = rows[:3]

    class Acting:
        def generate(self, prompts, params, progress=None):
            out = []
            for r, prompt in zip(rows, prompts):
                p = tok(prompt, add_special_tokens=False)["input_ids"]
                group = []
                for text in (f"<think>there</think>\n<action>{r['recorded_action']}</action>",
                             "<think>hm</think>\n<action>inventory now</action>", "no action at all"):
                    ids = tok(text, add_special_tokens=False)["input_ids"]
                    group.append(Sample(ids, _full_logp(student, p, ids)[1].tolist(), text, "stop"))
                out.append(group)
            return out

    pad = tok.pad_token_id
    records, _ = distance_records(rows, Acting(), HFScorer(teacher, pad), HFScorer(student, pad), tok, "alfworld",
                                  SamplingParams(n=3, temperature=1.0, top_p=1.0))
    for r, rec, group in zip(rows, records, Acting().generate([x["prompt"] for x in rows], None)):
        assert (rec["samples"], rec["format_valid"], rec["action_match"]) == (3, 2, 1), r["recorded_action"]
        p = tok(r["prompt"], add_special_tokens=False)["input_ids"]
        on, n = 0.0, 0
        for smp in group:
            mask = torch.tensor(action_token_mask(tok, smp.token_ids, "alfworld"))
            d = torch.tensor(smp.logprobs, dtype=torch.float64) - _full_logp(teacher, p, smp.token_ids)[1]
            on, n = on + float(d[mask].sum()), n + int(mask.sum())
        assert n > 0 and rec["action_tokens"] == n
        assert rec["reverse_kl_action"] == pytest.approx(on, abs=1e-4 * n)
    with pytest.raises(ValueError, match="temperature 1"):
        distance_records(rows, Acting(), HFScorer(teacher, pad), HFScorer(student, pad), tok, "alfworld",
                         SamplingParams(n=3, temperature=0.7))


def test_the_distance_is_zero_against_itself_and_offline_eval_reports_it(rows_and_models):
    """Invariant: a student measured against itself is at distance 0 on every token, and its sampled action
    match equals the teacher's (the same samples). offline_eval reports the same figures."""
    import pyarrow as pa

    from sapd.stages.evaluate import offline_eval
    rows, student, _, tok = rows_and_models
    out = offline_eval(student, tok, pa.Table.from_pylist(rows), "alfworld", max_new_tokens=10, teacher=student,
                       group_size=3, seed=5)
    d = out["distance"]["overall"]
    assert d["reverse_kl_per_token"]["value"] == pytest.approx(0.0, abs=1e-5)
    assert d["recorded_logratio_per_token"]["value"] == pytest.approx(0.0, abs=1e-5)
    assert d["action_match"]["value"] == d["teacher_action_match"]["value"]
    assert out["distance"]["prefixes"] == len(rows) == out["prefixes"]


# ------------------------------------------------------------------------------------------ in the run


def test_every_round_in_sapd_run_committed_resumed_and_reported(tmp_path, models, monkeypatch):
    """``sapd run``'s plan validates checkpoints 0, 1 and the last (2) with the engines of the teacher-scores
    stage; each result is committed before its round's manifest; a worker that dies after its validation
    part resumes without redoing it, to the same numbers; a rerun is a no-op; the metrics and ``sapd report``
    carry the figures."""
    from sapd.data import scored
    from sapd.metrics import Metrics
    from sapd.run.report import write_report

    root = str(tmp_path / "run")
    cfg = config_from_dict(tiny_config(root, *models))
    metrics = Metrics(job="pipeline")
    run_pipeline(cfg, metrics=metrics, **QUIET)
    results = [validation.read(root, k) for k in range(3)]
    assert [r["checkpoint"] for r in results] == [0, 1, 2] and [r["checkpoint"] for r in validation.committed(root)] == [0, 1, 2]
    for r in results:
        assert r["prefixes"] == len(validation.validation_rows(cfg)) > 0
        assert r["settings"] == validation.settings(cfg) and r["settings"]["group_size"] == 4
        assert r["overall"]["reverse_kl_per_token"]["value"] is not None and r["overall"]["samples"] == 4 * r["prefixes"]
        assert r["teacher"] == cfg.model.teacher and {"sample_seconds", "score_seconds"} <= set(r["timings"])
    assert results[0]["teacher_records"] == results[2]["teacher_records"]  # the teacher sampled once
    assert metrics.registry.get_sample_value("sapd_validation_checkpoint") == 2
    assert metrics.registry.get_sample_value("sapd_validation_reverse_kl", {"category": "all"}) == pytest.approx(
        results[2]["overall"]["reverse_kl_per_token"]["value"])
    assert metrics.registry.get_sample_value("sapd_stage_duration_seconds_count", {"stage": "validation"}) == 3

    # a worker killed after its validation part, before its scored part: the rerun keeps the part
    again = str(tmp_path / "again")
    cfg2 = config_from_dict(tiny_config(again, *models))
    real = scored.write_worker_part
    calls = []

    def dying(out_dir, *a, **kw):
        if out_dir == layout.scored_dir(again, 1) and not calls:
            calls.append(1)
            raise RuntimeError("killed")
        return real(out_dir, *a, **kw)
    monkeypatch.setattr(scored, "write_worker_part", dying)
    with pytest.raises(RuntimeError, match="killed"):
        run_pipeline(cfg2, **QUIET)
    part_uri = layout.validation_part_uri(again, 1, 0)
    assert storage.exists(part_uri) and not validation.is_committed(again, 1)
    stamp = Path(part_uri).stat().st_mtime_ns
    run_pipeline(cfg2, **QUIET)
    assert Path(part_uri).stat().st_mtime_ns == stamp  # not redone
    for k in range(3):
        a, b = validation.read(root, k), validation.read(again, k)
        assert a["records"] == b["records"] and a["overall"] == b["overall"], k  # the same numbers

    marker = Path(layout.validation_uri(root, 2)).stat().st_mtime_ns
    run_pipeline(cfg, **QUIET)
    assert Path(layout.validation_uri(root, 2)).stat().st_mtime_ns == marker  # a rerun redoes nothing

    paths = write_report(root)
    summary = json.loads(storage.read_text(paths[1]))
    assert [v["checkpoint"] for v in summary["validation"]] == [0, 1, 2]
    assert summary["validation"][1]["reverse_kl_per_token"] == results[1]["overall"]["reverse_kl_per_token"]


def test_every_n_rounds_and_workers_split_the_sample(tmp_path, models):
    """every_rounds 2 over 3 rounds validates checkpoints 0, 2 and 3; two workers (the cluster's Indexed Job,
    here one door call each) split the sample, the last to finish commits both the validation and the round,
    and a worker run again redoes nothing."""
    from sapd.stages import build_prefixes, teacher_scores, train
    from sapd.stages.context import StageContext, Step, run_stage

    root = str(tmp_path / "run")
    cfg = config_from_dict(tiny_config(root, *models, workers=2, train={"rounds": 3},
                                       validation={"every_rounds": 2, "group_size": 2}))
    assert [str(s) for s in plan.steps(cfg) if s.stage == "teacher-scores"] == [
        "teacher-scores-r0", "teacher-scores-r1", "teacher-scores-r2", "teacher-scores-r3"]
    ctx = StageContext(cfg, log=lambda s: None)
    run_stage(build_prefixes, ctx, Step("build-prefixes"))
    one = StageContext(cfg, log=lambda s: None, options={"teacher-scores": teacher_scores.Options(worker=1)})
    teacher_scores.run(one, Step("teacher-scores", 0))
    assert validation.part(cfg, 0, 1) is not None and not validation.is_committed(root, 0)
    with pytest.raises(Exception, match="worker 0 of 2 has not written its part"):
        validation.commit(cfg, 0)
    zero = StageContext(cfg, log=lambda s: None, options={"teacher-scores": teacher_scores.Options(worker=0)})
    out = teacher_scores.run(zero, Step("teacher-scores", 0))
    assert any(r.committed for r in out.value) and validation.is_committed(root, 0)
    merged = validation.read(root, 0)
    assert sorted(r["prefix_id"] for r in merged["records"]) == sorted(
        r["prefix_id"] for r in validation.validation_rows(cfg)) and merged["workers"] == 2
    assert teacher_scores.run(zero, Step("teacher-scores", 0)).skipped
    for k in range(3):
        if k:
            teacher_scores.run(ctx, Step("teacher-scores", k))
        run_stage(train, ctx, Step("train", k))
    teacher_scores.run(ctx, Step("teacher-scores", 3))
    assert [k for k in range(4) if validation.is_committed(root, k)] == [0, 2, 3]
    assert plan.next_step(cfg) is None


def test_a_build_without_validation_prefixes_validates_nothing(tmp_path, models):
    """data.val_fraction 0 (every trajectory trains, as the demo's arms): nothing to measure on, so no checkpoint
    is validated and the last checkpoint gets no step of its own."""
    root = str(tmp_path / "run")
    cfg = config_from_dict(tiny_config(root, *models, train={"rounds": 1}, data={"val_fraction": 0.0}))
    assert plan.steps(cfg)[-1] == plan.Step("teacher-scores", 1)  # before the build: not known yet
    run_pipeline(cfg, **QUIET)
    assert not storage.list_files(storage.join(root, "validation"))
    assert plan.steps(cfg)[-1] == plan.Step("train", 0) and plan.next_step(cfg) is None


@pytest.mark.slow
def test_sapd_run_and_report_from_the_command_line(tmp_path, models):
    """The way a user runs it: ``sapd run CONFIG`` prints each checkpoint's distance, writes
    ``validation/NNNNNN.json``; ``sapd report RUN`` plots it beside the loss terms."""
    import yaml
    cfg_path = tmp_path / "run.yaml"
    root = tmp_path / "run"
    cfg_path.write_text(yaml.safe_dump(tiny_config(str(root), *models, train={"rounds": 1})))
    sapd = [sys.executable, "-m", "sapd.cli"]
    run = subprocess.run([*sapd, "run", str(cfg_path), "--no-progress"], capture_output=True, text=True,
                         timeout=900, cwd=REPO)
    assert run.returncode == 0, run.stderr[-3000:]
    out = run.stdout + run.stderr
    for k in (0, 1):
        assert f"checkpoint {k}: reverse KL(student ‖ teacher) " in out, out[-3000:]
        assert (root / "validation" / f"{k:06d}.json").is_file()
    rep = subprocess.run([*sapd, "report", str(root)], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert rep.returncode == 0, rep.stderr[-3000:]
    summary = json.loads((root / "report" / "summary.json").read_text())
    assert [v["checkpoint"] for v in summary["validation"]] == [0, 1]
    assert (root / "report" / "training.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
