"""Config, precompute, training and the resumable local pipeline on tiny real models."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

from sapd import checkpoints, layout, storage
from sapd.config import ConfigError, RunConfig, config_from_dict, dump_config, load_config
from sapd.data import shards
from sapd.data.scored import read_scored
from sapd.method.objective import VARIANTS
from sapd.progress import Progress
from sapd.run.local import run_pipeline
from sapd.run.report import read_step_log, write_report
from tests.pipeline_util import make_models, tiny_config

REPO = Path(__file__).resolve().parents[2]
QUIET = dict(log=lambda s: None, show_progress=False)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return make_models(tmp_path_factory.mktemp("models"))


def _weights(root, k):
    model = checkpoints.load_checkpoint_model(root, k)
    return {n: p.detach().clone() for n, p in model.named_parameters()}


# ------------------------------------------------------------------------------------------ config


def test_defaults_are_the_papers():
    cfg = RunConfig()
    loss = cfg.loss_cfg
    assert (loss.lambda_tok, loss.lambda_step, loss.lambda_rule, loss.token_scale, loss.clip_eps) == (0.1, 0.5, 0.1, 0.15, 0.2)
    assert cfg.sampling.group_size == 8 and cfg.train.lr == 1e-6 and cfg.train.trajectories_per_round == 16
    assert cfg.data.val_fraction == 0.05 and cfg.data.split_seed == 0


def test_overlays_stack_and_unknown_keys_are_errors(tmp_path):
    base = tmp_path / "base.yaml"
    base.write_text("run_root: runs/x\ntrain:\n  lr: 0.001\n  rounds: 3\nsampling:\n  group_size: 4\n")
    over = tmp_path / "over.yaml"
    over.write_text("train:\n  rounds: 5\nloss:\n  clip_eps: 0.3\n")
    cfg = load_config(base, over, "variants/opd")
    assert (cfg.train.lr, cfg.train.rounds, cfg.sampling.group_size) == (0.001, 5, 4)
    assert cfg.variant == "opd" and cfg.loss_cfg.lambda_step == 0.0 and cfg.loss_cfg.clip_eps == 0.3
    bad = tmp_path / "bad.yaml"
    bad.write_text("train:\n  lrr: 0.1\n")
    with pytest.raises(ConfigError, match=r"bad.yaml:2: train.lrr: unknown key \(did you mean 'train.lr'\?\)"):
        load_config(bad)
    bad.write_text("train:\n  rounds: many\n")
    with pytest.raises(ConfigError, match="train.rounds: expected an integer"):
        load_config(bad)
    bad.write_text("sampling:\n  backend: tgi\n")
    with pytest.raises(ConfigError, match=r"sampling.backend: 'tgi' is not one of \['auto', 'hf', 'vllm'\]"):
        load_config(bad)
    bad.write_text("loss:\n  lambda_kl: 1\n")
    with pytest.raises(ConfigError, match="unknown loss option"):
        load_config(bad)
    bad.write_text("loss:\n  no_action_step: drop\n")
    with pytest.raises(ConfigError, match=r"bad.yaml:2: loss.no_action_step: 'drop' is not one of \["):
        load_config(bad)
    with pytest.raises(ConfigError, match="variants/nope: unknown variant; expected one of variants/sapd, "):
        load_config("variants/nope")
    with pytest.raises(ConfigError, match="nope.yaml: no such config file"):
        load_config(tmp_path / "nope.yaml")


@pytest.mark.parametrize("variant,field,value", [
    ("sapd", "lambda_step", 0.5), ("opd", "lambda_rule", 0.0), ("opd_rule", "lambda_step", 0.0),
    ("wo_opd", "lambda_tok", 0.0), ("wo_rule", "lambda_rule", 0.0), ("full_token", "full_token_scoring", True),
    ("std_norm", "std_normalize_step", True), ("sapd_exclude", "no_action_step", "exclude"),
    ("sapd_penalty", "no_action_step", "penalty"), ("sapd_whole", "no_action_step", "whole_response"),
    ("sapd_sdar", "kl_coef", 0.01), ("sapd_paper", "no_action_step", "zero"),
    ("sft", "objective", "sft"), ("grpo", "objective", "grpo")])
def test_every_variant_is_an_overlay_by_name(variant, field, value):
    """``variants/NAME`` on the command line is the named variant of VARIANTS (the one source), resolved once."""
    cfg = load_config(f"variants/{variant}")
    assert cfg.variant == variant and getattr(cfg.loss_cfg, field) == value


def test_variant_and_loss_overrides_resolve_whatever_the_overlay_order(tmp_path):
    over = tmp_path / "over.yaml"
    over.write_text("loss:\n  no_action_step: exclude\n")
    for order in ([over, "variants/opd_rule"], ["variants/opd_rule", over]):
        cfg = load_config(*order)
        assert (cfg.loss_cfg.lambda_step, cfg.loss_cfg.no_action_step) == (0.0, "exclude")
    assert set(VARIANTS) == {"sapd", "opd", "opd_rule", "wo_opd", "wo_rule", "full_token", "std_norm",
                             "sapd_exclude", "sapd_penalty", "sapd_whole", "sapd_sdar", "sapd_paper", "sft", "grpo"}


def test_resolved_config_roundtrips():
    cfg = config_from_dict({"train": {"betas": [0.8, 0.9]}, "variant": "wo_rule"})
    again = config_from_dict(yaml.safe_load(dump_config(cfg)))
    assert again == cfg and again.train.betas == (0.8, 0.9)


# -------------------------------------------------------------------------------------- pipeline


def test_pipeline_end_to_end_and_rerun_is_a_noop(tmp_path, models):
    root = str(tmp_path / "run")
    cfg = config_from_dict(tiny_config(root, *models))
    from sapd.metrics import Metrics
    metrics = Metrics("pipeline")
    result = run_pipeline(cfg, metrics=metrics, **QUIET)
    assert result["checkpoints"] == [0, 1, 2]
    # each round records the share of its responses cut at sampling.max_new_tokens (12 here): in its
    # manifest, its step log and the sapd_response_truncated_ratio gauge (the last round's)
    from sapd.data.scored import read_scored
    for k in (0, 1):
        reasons = [r for row in read_scored(root, k).to_pylist() for r in row["finish_reason"]]
        manifest = shards.read_manifest(layout.scored_dir(root, k))
        assert (manifest["truncated_responses"], manifest["responses"]) == (reasons.count("length"), len(reasons))
        share = reasons.count("length") / len(reasons)
        assert {s["truncated_share"] for s in read_step_log(root) if s["round"] == k} == {share}
    assert share == 1.0  # a random tiny model never closes </action> within 12 tokens (0.25: the scripted round)
    assert metrics.registry.get_sample_value("sapd_response_truncated_ratio") == share
    assert yaml.safe_load(storage.read_text(layout.config_uri(root)))["variant"] == "sapd"
    steps = read_step_log(root)
    assert [s["step"] for s in steps] == list(range(1, len(steps) + 1)) and len(steps) >= 4
    for key in ("loss", "loss_tok", "loss_step", "loss_rule", "teacher_student_gap", "step_adv_abs_mean",
                "clip_fraction", "lr", "grad_norm", "step_seconds"):
        assert all(isinstance(s[key], float) for s in steps), key
    scored = shards.read_manifest(layout.scored_dir(root, 0))
    assert scored["rows"] > 0 and {"sample_seconds", "score_seconds"} <= set(scored["timings"])
    # the exported checkpoint reloads in plain transformers and differs from the initial student
    from transformers import AutoModelForCausalLM
    final = AutoModelForCausalLM.from_pretrained(str(checkpoints.checkpoint_model_path(root, 2)))
    initial = AutoModelForCausalLM.from_pretrained(models[0])
    assert any(not torch.equal(a, b) for a, b in zip(final.parameters(), initial.parameters()))
    state = checkpoints.load_trainer_state(root, 2)
    assert state["global_step"] == len(steps) and state["round"] == 2
    assert checkpoints.consolidated_optimizer_state(root, 2)["state"]  # the optimizer state, sharded by rank
    marker = checkpoints.read_marker(root, 2)
    assert run_pipeline(cfg, **QUIET)["checkpoints"] == [0, 1, 2]
    assert checkpoints.read_marker(root, 2) == marker  # nothing redone
    with pytest.raises(ConfigError, match="different resolved config"):
        run_pipeline(config_from_dict(tiny_config(root, *models, train={"lr": 0.5})), **QUIET)
    paths = write_report(root)
    png = storage.read_bytes(paths[0])
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    summary = json.loads(storage.read_text(paths[1]))
    assert summary["steps"] == len(steps)
    # each round's update of the weights the optimizer keeps: its size, and all of the computed update applied
    assert [u["round"] for u in summary["round_updates"]] == [0, 1]
    assert all(u["update_rel"] > 0 and u["applied_ratio"] == pytest.approx(1.0, abs=1e-3)
               for u in summary["round_updates"])
    assert all(isinstance(s["update_rel"], float) and isinstance(s["update_applied_ratio"], float) for s in steps)


def test_one_student_engine_across_rounds_samples_like_fresh_engines(tmp_path, models, monkeypatch):
    """The local pipeline builds its student sampler once and loads each round's checkpoint into it in
    place; round 1's scored shard equals that of a run which builds a fresh engine every round."""
    from sapd.models.generation import HFGenerator
    from sapd.models.scoring import HFScorer
    from sapd.stages import teacher_scores, train

    built, reloaded = [], []
    real_init, real_load = HFGenerator.__post_init__, HFGenerator.load_weights
    monkeypatch.setattr(HFGenerator, "__post_init__", lambda self: (built.append(self), real_init(self))[1])
    monkeypatch.setattr(HFGenerator, "load_weights", lambda self, d: (reloaded.append(str(d)), real_load(self, d))[1])
    # both kept engines give the device back before each training stage (on a GPU: vLLM sleeps, an HF
    # model moves to host memory; on this CPU the calls change nothing), and the teacher serves again after
    events: list[str] = []
    for cls, name in ((HFGenerator, "student"), (HFScorer, "teacher")):
        real_release = cls.release
        monkeypatch.setattr(cls, "release", lambda self, f=real_release, n=name: (events.append(f"release {n}"),
                                                                                   f(self))[1])
    real_call, real_train = HFScorer.__call__, train.run_train_stage
    monkeypatch.setattr(HFScorer, "__call__", lambda self, *a, **k: (events.append("score"), real_call(self, *a, **k))[1])
    monkeypatch.setattr(train, "run_train_stage", lambda cfg, k, **kw: (events.append(f"train {k}"),
                                                                        real_train(cfg, k, **kw))[1])
    reuse_root = str(tmp_path / "reuse")
    run_pipeline(config_from_dict(tiny_config(reuse_root, *models)), **QUIET)
    # rounds 0 and 1 and the last checkpoint's validation: one student engine, checkpoints 1 and 2 loaded in
    # place (and, once, a sampler on the teacher's model for the validation's teacher samples)
    assert len(built) == 2 and built[1].model is not built[0].model and len(reloaded) == 2
    assert reloaded == [str(checkpoints.checkpoint_model_path(reuse_root, k)) for k in (1, 2)]
    # each round's teacher calls (its validation's, then its scoring) come before both engines are released
    calls = [e for i, e in enumerate(events) if i == 0 or e != events[i - 1]]
    assert calls == ["score", "release student", "release teacher", "train 0",
                     "score", "release student", "release teacher", "train 1",
                     "score", "release student", "release teacher"], events

    real_student = teacher_scores.student_generator
    monkeypatch.setattr(teacher_scores, "student_generator",
                        lambda cfg, k, tok, reuse=None: real_student(cfg, k, tok))  # a fresh engine per round
    fresh_root = str(tmp_path / "fresh")
    run_pipeline(config_from_dict(tiny_config(fresh_root, *models)), **QUIET)
    assert len(built) == 6 and len(reloaded) == 2  # a fresh student engine for each of the 3 teacher-scores steps
    a, b = (read_scored(r, 1).to_pylist() for r in (reuse_root, fresh_root))
    assert len(a) == len(b) > 0
    for x, y in zip(a, b):
        assert x["response_token_ids"] == y["response_token_ids"]
        assert x["sampler_logprobs"] == y["sampler_logprobs"]


# The first SAPD losses of the tiny run on a fixed seed. A change here means the math, the data path,
# the sampler or the seeding changed: check that it is intended, then update the numbers.
PINNED_LOSSES = [0.00011059304233640432, 0.00014947527961339802, -1.8085003830492496e-05, 0.0003220308863092214]


def test_pinned_losses(tmp_path, models):
    root = str(tmp_path / "run")
    run_pipeline(config_from_dict(tiny_config(root, *models, train={"rounds": 1})), **QUIET)
    losses = [s["loss"] for s in read_step_log(root)]
    # loose enough for another CPU's float summation order, tight enough for any change of a coefficient
    assert losses == pytest.approx(PINNED_LOSSES, rel=1e-3, abs=1e-6), losses


class ScriptedGenerator:
    """A sampler whose G responses per prompt are fixed texts (well-formed, repeated, malformed), so the
    step and rule terms are non-zero; the real teacher scores them and the real train stage learns."""

    TEXTS = ["<think>the key is here</think>\n<action>take key 1 from drawer 1</action>",
             "<think>look</think>\n<action>look</action>",
             "<think>I will open it</think>\n<action>open drawer 1</action>",
             "I am not sure what to do"]

    def __init__(self, tokenizer):
        self.tok = tokenizer

    def generate(self, prompts, params, progress=None):
        from sapd.models.generation import Sample
        out = []
        for i, _ in enumerate(prompts):
            group = []
            for j in range(params.n):
                text = self.TEXTS[(i + j) % len(self.TEXTS)]
                ids = self.tok(text, add_special_tokens=False)["input_ids"]
                # the text without an action stands for a response cut at the token limit
                group.append(Sample(ids, [0.0] * len(ids), text, "stop" if "<action>" in text else "length"))
            out.append(group)
        return out


# Every loss term and the gradient norm of each optimizer step of one round trained on a scripted scored
# round (fixed responses, the real tiny teacher's scores). A change here means the math, the data path or
# the seeding changed: check that it is intended, then update the numbers.
PINNED_TERMS = [  # loss_tok, loss_step, loss_rule, grad_norm per optimizer step (ρ = 1 at step 1: step, rule ≈ 0)
    [0.003614580607973039, -9.313225746154785e-09, 5.960464477539063e-08, 0.10620512068271637],
    [0.0019099477212876081, -0.02368270419538021, 0.07102027535438538, 0.17483823001384735],
    [0.0041701102163642645, -0.018623489886522293, 0.035143936052918434, 0.0848596915602684],
    [0.005887977778911591, -0.007536271587014198, -0.01651519536972046, 0.10706300288438797]]


def test_pinned_loss_terms_of_a_scored_round(tmp_path, models):
    from sapd.models.loading import load_tokenizer
    from sapd.stages import teacher_scores
    from sapd.stages.build_prefixes import ensure_initial_checkpoint, ensure_prefixes
    from sapd.stages.train import run_train_stage
    root = str(tmp_path / "run")
    # a scripted sampler has no model to validate with: this round only scores
    cfg = config_from_dict(tiny_config(root, *models, sampling={"group_size": 4}, train={"rounds": 1},
                                       validation={"every_rounds": 0}))
    tok = load_tokenizer(models[0])
    ensure_prefixes(cfg, tok, **QUIET)
    ensure_initial_checkpoint(cfg, lambda s: None)
    res = teacher_scores.run_worker(cfg, 0, 0, ScriptedGenerator(tok), teacher_scores.teacher_scorer(cfg, tok), tok,
                                    **QUIET)
    assert res.committed  # the only worker is the last one: it commits the round
    assert (res.truncated, res.responses) == (res.rows, 4 * res.rows)  # one of each group's 4 texts
    run_train_stage(cfg, 0, **QUIET)
    steps = read_step_log(root)
    assert {s["truncated_share"] for s in steps} == {0.25}
    terms = [[s[k] for k in ("loss_tok", "loss_step", "loss_rule", "grad_norm")] for s in steps]
    # the scripted groups carry real step and rule signal: both terms move once the weights have moved
    assert all(s["step_adv_abs_mean"] > 0 and s["rule_adv_abs_mean"] > 0 for s in steps)
    assert any(abs(t[1]) > 1e-6 for t in terms[1:]) and any(abs(t[2]) > 1e-6 for t in terms[1:])
    for s, t in zip(steps, terms):  # the total is the paper's weighting of the pinned terms
        assert s["loss"] == pytest.approx(0.1 * t[0] + 0.5 * t[1] + 0.1 * t[2], rel=1e-6, abs=1e-9)
    flat = [x for t in terms for x in t]
    assert flat == pytest.approx([x for t in PINNED_TERMS for x in t], rel=1e-3, abs=1e-6), terms


def test_workers_split_a_round(tmp_path, models):
    from sapd.data.batches import round_batch
    from sapd.data.scored import commit_round, read_scored
    from sapd.models.generation import HFGenerator
    from sapd.models.loading import load_causal_lm, load_tokenizer
    from sapd.models.scoring import HFScorer
    from sapd.stages.build_prefixes import ensure_initial_checkpoint, ensure_prefixes
    from sapd.stages.teacher_scores import run_worker
    root = str(tmp_path / "run")
    cfg = config_from_dict(tiny_config(root, *models, workers=2))
    tok = load_tokenizer(models[0])
    ensure_prefixes(cfg, tok, **QUIET)
    ensure_initial_checkpoint(cfg, lambda s: None)
    gen = HFGenerator(checkpoints.load_checkpoint_model(root, 0), tok)
    scorer = HFScorer(load_causal_lm(models[1]), tok.pad_token_id)

    run_worker(cfg, 0, 1, gen, scorer, tok, **QUIET)
    with pytest.raises(shards.ShardError, match="worker 0 of 2 has not finished"):
        commit_round(cfg, 0)
    run_worker(cfg, 0, 0, gen, scorer, tok, **QUIET)
    assert run_worker(cfg, 0, 0, gen, scorer, tok, **QUIET).skipped  # a retried worker redoes nothing
    manifest = commit_round(cfg, 0)
    assert [p["name"] for p in manifest["parts"]] == ["part-00000.parquet", "part-00001.parquet"]
    table = read_scored(root, 0)
    assert sorted(table.column("prefix_id").to_pylist()) == sorted(round_batch(cfg, 0).column("prefix_id").to_pylist())
    row = table.slice(0, 1).to_pylist()[0]
    G = cfg.sampling.group_size
    assert len(row["response_token_ids"]) == len(row["teacher_logprobs"]) == len(row["action_mask"]) == G
    assert all(len(a) == len(b) == len(c) for a, b, c in
               zip(row["response_token_ids"], row["teacher_logprobs"], row["action_mask"]))
    assert all(r in (0.0, -1.0, -2.0) for r in row["rule_score"])


def test_sdar_regularisers_in_a_real_round(tmp_path, models):
    """The loss block selects SDAR's regularisers; the train stage then computes checkpoint 0's log-probs
    (the KL reference) and the student's entropy, and logs both. Round 0's first step starts at
    θ = θ_ref, so its KL is exactly 0; later steps have moved away from it."""
    root = str(tmp_path / "sdar")
    cfg = config_from_dict(tiny_config(root, *models, train={"rounds": 2, "lr": 3e-3},
                                       loss={"kl_coef": 0.5, "kl_type": "low_var_kl", "entropy_coef": 0.01,
                                             "dual_clip": 3.0, "no_action_step": "penalty",
                                             "reduction": "token_mean"}))
    assert cfg.loss_cfg.kl_coef == 0.5 and cfg.loss_cfg.no_action_step == "penalty"
    run_pipeline(cfg, **QUIET)
    steps = read_step_log(root)
    assert steps[0]["loss_kl"] == 0.0 and "ref_logp_seconds" in steps[0]
    assert max(s["loss_kl"] for s in steps[1:]) > 0.0
    assert all(s["loss_entropy"] > 0.0 and "dual_clip_fraction" in s and "all_no_action_groups" in s for s in steps)
    plain = str(tmp_path / "plain")
    run_pipeline(config_from_dict(tiny_config(plain, *models, train={"rounds": 1})), **QUIET)
    assert "loss_kl" not in read_step_log(plain)[0] and "ref_logp_seconds" not in read_step_log(plain)[0]


def test_sft_variant_lowers_the_loss(tmp_path, models):
    root = str(tmp_path / "sft")
    cfg = config_from_dict(tiny_config(root, *models, variant="sft",
                                       train={"rounds": 4, "trajectories_per_round": 8, "lr": 3e-3}))
    run_pipeline(cfg, **QUIET)
    steps = read_step_log(root)
    per_round = {}
    for s in steps:
        per_round.setdefault(s["round"], []).append(s["loss_sft"])
    first, last = sum(per_round[0]) / len(per_round[0]), sum(per_round[3]) / len(per_round[3])
    assert last < first - 0.05, (first, last)
    assert not storage.list_files(storage.join(root, "rounds"))  # SFT samples nothing


def test_pipeline_on_an_s3_run_root(s3_storage, models):
    root = storage.join(s3_storage, "run")
    cfg = config_from_dict(tiny_config(root, *models, train={"rounds": 1}))
    assert run_pipeline(cfg, **QUIET)["checkpoints"] == [0, 1]
    names = {u[len(root) + 1:] for u in storage.list_files(root)}
    assert {"config.yaml", "prefixes/_MANIFEST.json", "rounds/000000/scored/_MANIFEST.json",
            "checkpoints/000001/state/_COMMITTED", "checkpoints/000001/model/model.safetensors",
            "logs/round-000000.jsonl"} <= names
    assert checkpoints.load_checkpoint_model(root, 1) is not None


# ---------------------------------------------------------------------------- kill and resume


def _run_cli(cfg_path: Path, env=None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "sapd.cli", "run", str(cfg_path), "--no-progress"],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, **(env or {})})


@pytest.mark.slow
@pytest.mark.parametrize("kill_when,dtype", [("round 1 worker 0/1:", "float32"), ("round 1 step", "float32"),
                                             ("round 1 step", "bfloat16")])
def test_killed_run_resumes_to_the_same_result(tmp_path, models, kill_when, dtype):
    ref_root = str(tmp_path / "ref")
    model = {"dtype": dtype}
    run_pipeline(config_from_dict(tiny_config(ref_root, *models, model=model, train={"rounds": 3})), **QUIET)
    root = tmp_path / "killed"
    cfg_path = tmp_path / "cfg.yaml"
    cfg_path.write_text(yaml.safe_dump(tiny_config(str(root), *models, model=model, train={"rounds": 3})))
    proc = _run_cli(cfg_path)
    seen = []
    deadline = time.time() + 900  # generous: a loaded 2-core machine is slow, and the kill point must be reached
    for line in proc.stdout:  # kill the process as soon as it reaches the chosen point of round 1
        seen.append(line)
        if kill_when in line:
            proc.send_signal(signal.SIGKILL)
            break
        assert time.time() < deadline, "".join(seen)
    proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL, "".join(seen)
    assert not checkpoints.is_committed(str(root), 2)  # killed inside round 1
    proc = _run_cli(cfg_path)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out
    assert "checkpoint 1 already committed" in out or "round 0" not in out.split("prefixes:")[-1].split("round 1")[0]
    a, b = _weights(ref_root, 3), _weights(str(root), 3)
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=0, atol=1e-6 if dtype == "float32" else 0, msg=name)
    ref_losses = [s["loss"] for s in read_step_log(ref_root)]
    assert [s["loss"] for s in read_step_log(str(root))] == pytest.approx(ref_losses, rel=1e-5, abs=1e-8)
    if dtype == "bfloat16":  # bit for bit: the bf16 weights, and the fp32 master the optimizer keeps
        oa, ob = (checkpoints.consolidated_optimizer_state(r, 3)["state"] for r in (ref_root, str(root)))
        assert all(torch.equal(oa[i]["master"], ob[i]["master"]) for i in oa) and len(oa) > 0


@pytest.mark.integration
def test_s3_server_dying_mid_checkpoint_leaves_nothing_committed(private_s3_server, models, monkeypatch):
    """The S3 server is SIGKILLed just as checkpoint 1's commit marker is written and stays down past the
    retry deadline: the run stops with a clear storage error, nothing reads checkpoint 1 as committed, and
    after a restart the same command finishes the round. (An outage shorter than the deadline is ridden
    out: tests/run/test_faults.py.)"""
    import dataclasses

    from sapd.storage import StorageError
    server = private_s3_server
    previous = storage.configure_s3()
    storage.configure_s3(server.endpoint_url, server.access_key, server.secret_key)
    try:
        server.client().create_bucket(Bucket="sapd-pipe")
        server.wait_writable("sapd-pipe")
        root = "s3://sapd-pipe/run"
        cfg = config_from_dict(tiny_config(root, *models, train={"rounds": 1}, storage={"retry_deadline_s": 2}))
        real_write_json = storage.write_json

        def dying_write_json(uri, obj):
            if uri.endswith("checkpoints/000001/state/_COMMITTED"):
                server.kill()
            real_write_json(uri, obj)

        monkeypatch.setattr(storage, "write_json", dying_write_json)
        with pytest.raises(StorageError, match="unreachable"):
            run_pipeline(cfg, **QUIET)
        monkeypatch.setattr(storage, "write_json", real_write_json)
        server.start()
        server.wait_writable("sapd-pipe")  # a restarted SeaweedFS answers 500s until its volume is back
        assert checkpoints.is_committed(root, 0) and not checkpoints.is_committed(root, 1)
        assert storage.list_files(storage.join(root, "checkpoints", "000001"))  # the parts that did land…
        assert run_pipeline(cfg, **QUIET)["checkpoints"] == [0, 1]  # …are redone, then committed
    finally:
        storage.configure_s3(**dataclasses.asdict(previous))


def test_a_registered_objective_trains_through_the_real_stages(tmp_path, models, monkeypatch):
    """Adding an objective is one registered function plus its variant entry: a toy objective (the squared
    gap between the student's and the teacher's log-probs of the sampled tokens) trains a round through
    the real teacher-scores and train stages; only the inputs it takes are computed (no π_old recompute)."""
    from sapd.method import objective
    monkeypatch.setattr(objective, "OBJECTIVES", dict(objective.OBJECTIVES))
    monkeypatch.setitem(VARIANTS, "toy", {"objective": "toy_squared_gap"})
    shapes = []

    @objective.register_objective("toy_squared_gap")
    def toy(new_logp_P_G_T, response_mask_P_G_T, teacher_logp_P_G_T, cfg):
        shapes.append(tuple(new_logp_P_G_T.shape))
        gap = objective.reduce_loss((new_logp_P_G_T - teacher_logp_P_G_T) ** 2, response_mask_P_G_T, cfg.reduction)
        return gap, {"loss": float(gap.detach()), "loss_gap": float(gap.detach())}

    root = str(tmp_path / "run")
    cfg = config_from_dict(tiny_config(root, *models, variant="toy", train={"rounds": 1}))
    assert cfg.loss_cfg.objective == "toy_squared_gap"
    lines: list[str] = []  # and the run's progress, as a log shows it (every update a line here)
    run_pipeline(cfg, log=lambda s: None, progress=Progress(lines.append, mode="lines", every=0.0))
    assert any(line.startswith(f"run {root}: 4/4 steps (100%)") for line in lines), lines  # + checkpoint 1's validation
    segments = [seg for line in lines for seg in line.split(" | ")]  # open tasks side by side in one line
    for what in ("round 0 sampling: ", "round 0 teacher scoring: ", "round 0 training: "):
        assert any(seg.startswith(what) and "ETA" in seg for seg in segments), (what, lines)
    assert not [line for line in lines if "\r" in line]
    steps = read_step_log(root)
    assert steps and all(s["loss"] == s["loss_gap"] > 0 and s["variant"] == "toy" for s in steps)
    assert "old_logp_seconds" not in steps[0]  # the toy does not take π_old: it is not recomputed
    assert shapes and all(p <= 2 and g == 2 for p, g, _ in shapes)  # micro-batches of ≤ 2 prefixes × G = 2
    before, after = _weights(root, 0), _weights(root, 1)
    assert any(not torch.equal(before[n], after[n]) for n in before)  # it trained
