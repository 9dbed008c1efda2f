"""Stage workers that stay up for the run (issue 34): a trainer that keeps its model and optimizer state from
round to round ends where a trainer reloaded from every checkpoint does, bit for bit; the stage doors run as
the chart's persistent pods run them (``python -m sapd.jobs.teacher_scores … --rounds 0`` beside ``python -m
sapd.jobs.train … --rounds 0``), each loading every model once and waiting for its input; ``train.overlap:
one_step`` samples round k with checkpoint k−1 and weights the loss by the sampler's log-probs."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

from sapd import checkpoints, layout, lease
from sapd.config import config_from_dict
from sapd.progress import QUIET
from sapd.run import plan
from sapd.run.local import STAGES, run_pipeline
from sapd.run.plan import InputNotCommitted, wait_for_input
from sapd.stages.context import Engines, StageContext, Startup, Step, process_started_at, run_stage
from tests.pipeline_util import make_models, ranks_failed, tiny_config, wait_together

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return make_models(tmp_path_factory.mktemp("models"))


def weights(root: str, k: int) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file
    folder = checkpoints.checkpoint_model_path(root, k)
    out: dict[str, torch.Tensor] = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def assert_same_weights(root: str, reference: str, ks) -> None:
    for k in ks:
        a, b = weights(reference, k), weights(root, k)
        assert a.keys() == b.keys() and a
        for name in a:
            assert torch.equal(a[name], b[name]), f"checkpoint {k} {name}: max |Δ| {(a[name] - b[name]).abs().max()}"


def keep_everything(cfg, lines: list[str]) -> StageContext:
    """The context of a worker that stays up: its engines kept, the trainer too, nothing released."""
    return StageContext(cfg, log=lines.append, progress=QUIET,
                        engines=Engines(keep=True, release=False, keep_trainer=True))


def test_a_kept_trainer_ends_where_a_trainer_reloaded_every_round_does(tmp_path, models):
    """`sapd run` rebuilds its trainer from checkpoint k every round; a persistent trainer keeps the model,
    the AdamW state and the RNG state in memory. Three rounds later both wrote the same checkpoints, bit
    for bit, and the same loss terms; the persistent one loaded each model once."""
    ref_root, root = str(tmp_path / "reloaded"), str(tmp_path / "kept")
    run_pipeline(config_from_dict(tiny_config(ref_root, *models, train={"rounds": 3})), log=lambda s: None,
                 show_progress=False)
    cfg = config_from_dict(tiny_config(root, *models, train={"rounds": 3}))
    lines: list[str] = []
    ctx = keep_everything(cfg, lines)
    for step in plan.steps(cfg):
        run_stage(STAGES[step.stage], ctx, step)
    assert layout.committed_checkpoints(root) == [0, 1, 2, 3]
    assert_same_weights(root, ref_root, (1, 2, 3))
    for k in range(3):  # the same loss terms, step by step (the timings aside)
        a, b = ([{key: v for key, v in json.loads(ln).items() if not key.endswith("_seconds")}
                 for ln in Path(layout.round_log_uri(r, k)).read_text().splitlines()] for r in (ref_root, root))
        assert a == b and a[0]["loss"] != 0
    loads = [ln for ln in lines if ln.startswith("model load:")]
    assert [re.sub(r" \(.*", "", ln) for ln in loads] == [
        f"model load: teacher {models[1]}", "model load: student checkpoint 0 for sampling round 0",
        "model load: student checkpoint 0 for training"], loads
    assert [ln for ln in lines if ln.startswith("weights: checkpoint")] == [
        f"weights: checkpoint {k} kept in memory from round {k - 1} (model, optimizer state), not reloaded"
        for k in (1, 2)]
    # checkpoints 1 and 2 sample rounds 1 and 2, checkpoint 3 its validation: each taken in place
    assert sum(ln.startswith("weights: student checkpoint") and " in place for sampling round" in ln
               for ln in lines) == 3
    assert ctx.engines.trainer.checkpoint == 3


def test_a_kept_bf16_trainer_keeps_its_fp32_master_in_memory_and_measures_each_round(tmp_path, models):
    """In bf16 the optimizer updates an fp32 master (docs/design/training.md "The fp32 master"). A persistent trainer
    keeps that master in memory: the same tensors, never rebuilt from the bf16 weights nor read back from
    a checkpoint, after three rounds equal bit for bit to the master checkpoint 3 stores, and to the one
    `sapd run` (a trainer reloaded every round, the master read back each time) stores. The bf16 weights
    are its rounding. Each round's UpdateProbe still measures that round alone: the per-step and
    per-round update figures equal `sapd run`'s, and every round logs its own update line."""
    train_cfg = {"rounds": 3, "lr": 1e-5}  # small steps: most of them are below half a bf16 spacing
    ref_root, root = str(tmp_path / "reloaded"), str(tmp_path / "kept")
    run_pipeline(config_from_dict(tiny_config(ref_root, *models, model={"dtype": "bfloat16"}, train=train_cfg)),
                 log=lambda s: None, show_progress=False)
    cfg = config_from_dict(tiny_config(root, *models, model={"dtype": "bfloat16"}, train=train_cfg))
    lines: list[str] = []
    ctx = keep_everything(cfg, lines)
    kept_masters: list[list[torch.Tensor]] = []
    for step in plan.steps(cfg):
        run_stage(STAGES[step.stage], ctx, step)
        if step.stage == "train":
            kept_masters.append(ctx.engines.trainer.engine.masters)
    assert layout.committed_checkpoints(root) == [0, 1, 2, 3]
    masters = kept_masters[0]
    assert masters and all(m is masters for m in kept_masters)  # one list of tensors, kept from round to round
    assert all(m.dtype == torch.float32 for m in masters)
    model = ctx.engines.trainer.engine.model
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    for name, r in (("kept", root), ("reloaded", ref_root)):
        stored = checkpoints.consolidated_optimizer_state(r, 3)
        assert stored is not None
        for i, m in enumerate(masters):
            assert torch.equal(stored["state"][i]["master"].reshape(m.shape), m), (name, i)
    for p, m in zip(model.parameters(), masters, strict=True):
        assert torch.equal(p, m.to(torch.bfloat16))  # the weights are the master's rounding
    # the master holds what bf16 cannot: it differs from its own rounding, and from checkpoint 0's weights
    assert any(not torch.equal(m, m.to(torch.bfloat16).float()) for m in masters)
    assert_same_weights(root, ref_root, (1, 2, 3))
    for k in range(3):
        a, b = ([{key: v for key, v in json.loads(ln).items() if not key.endswith("_seconds")}
                 for ln in Path(layout.round_log_uri(r, k)).read_text().splitlines()] for r in (ref_root, root))
        assert a == b, k
        assert all(rec["update_rel"] > 0 for rec in b)
        assert b[-1]["round_update_rel"] > 0 and b[-1]["round_update_applied_ratio"] > 0.5, b[-1]
        assert all("round_update_rel" not in rec for rec in b[:-1])
    updates = [ln for ln in lines if re.match(r"round \d update of the weights the optimizer keeps", ln)]
    assert [ln.split(" update")[0] for ln in updates] == ["round 0", "round 1", "round 2"], updates
    assert all("(its fp32 master)" in ln for ln in updates)
    assert [re.sub(r" \(.*", "", ln) for ln in lines if ln.startswith("model load:")] == [
        f"model load: teacher {models[1]}", "model load: student checkpoint 0 for sampling round 0",
        "model load: student checkpoint 0 for training"]


def test_a_kept_trainer_that_finds_another_checkpoint_loads_it(tmp_path, models):
    """A trainer kept at checkpoint 1 asked for round 2 (checkpoint 2 written by someone else meanwhile)
    loads checkpoint 2 rather than train on stale weights."""
    root = str(tmp_path / "run")
    cfg = config_from_dict(tiny_config(root, *models, train={"rounds": 3}))
    run_pipeline(cfg, log=lambda s: None, show_progress=False)
    lines: list[str] = []
    ctx = keep_everything(cfg, lines)
    from sapd.stages import train
    ctx.engines.trainer = train.load_trainer(cfg, 1)
    for p in Path(layout.checkpoint_dir(root, 3)).rglob("_COMMITTED"):
        p.unlink()  # round 2 is to be trained again
    run_stage(train, ctx, Step("train", 2))
    assert any(ln.startswith("the kept trainer holds checkpoint 1, round 2 starts from checkpoint 2") for ln in lines)
    assert any(ln.startswith("model load: student checkpoint 2 for training") for ln in lines)
    assert ctx.engines.trainer.checkpoint == 3


def test_a_worker_waits_for_its_input_logs_it_and_gives_up_past_its_bound(tmp_path, models):
    root = str(tmp_path / "run")
    cfg = config_from_dict(tiny_config(root, *models))
    lines: list[str] = []
    now = [0.0]
    polls: list[float] = []

    def sleep(s: float) -> None:
        polls.append(s)
        now[0] += 10.0
        if len(polls) == 7:  # round 0's build lands while the worker waits
            from sapd.stages import build_prefixes
            run_stage(build_prefixes, StageContext(cfg, log=lambda s: None, progress=QUIET), Step("build-prefixes"))
    waited = wait_for_input(cfg, Step("teacher-scores", 0), poll_seconds=0.5, log=lines.append, sleep=sleep,
                            clock=lambda: now[0])
    assert waited == 70.0 and polls == [0.5] * 7
    assert lines[0] == f"stage teacher-scores-r0: waiting for the output of build-prefixes in {root}: no prefix build " \
                       f"committed in {layout.prefixes_dir(root)}"
    assert [ln.split(":")[1] for ln in lines[1:-1]] == [" still waiting (0m30s)", " still waiting (1m00s)"]
    assert lines[-1] == "stage teacher-scores-r0: its input (build-prefixes) is committed after 1m10s"
    # committed already: no wait, no line
    lines.clear()
    assert wait_for_input(cfg, Step("teacher-scores", 0), poll_seconds=0.5, log=lines.append) == \
        pytest.approx(0, abs=5)
    assert lines == []
    # train-r0 needs round 0's scores, which never come: past the bound, exit 75 (the pod is retried)
    with pytest.raises(InputNotCommitted, match=r"stage train-r0: its input \(teacher-scores-r0\) is still not "
                                                r"committed after 0m40s \(limit 0m30s\)") as e:
        wait_for_input(cfg, Step("train", 0), poll_seconds=1, log=lines.append, timeout_seconds=30,
                       sleep=lambda s: now.__setitem__(0, now[0] + 20.0), clock=lambda: now[0])
    assert e.value.exit_code == 75


def test_a_wait_of_expected_length_checks_often_around_its_expected_end(tmp_path, models):
    """A worker's next wait is likely as long as its last (the other stage's round): with that expectation
    the checks come every poll/10 from shortly before it, so the input committed at t = 10.03 s is seen
    ≤ 0.1 s later instead of up to a poll later, and past the window the checks slow down again."""
    root = str(tmp_path / "run")
    cfg = config_from_dict(tiny_config(root, *models))

    def run(expect: float | None, lands: float, poll: float = 1.0) -> tuple[float, list[float]]:
        now, polls, built = [0.0], [], [False]

        def sleep(s: float) -> None:
            polls.append(round(s, 6))
            now[0] += s
            if now[0] >= lands and not built[0]:  # round 0's build lands while the worker waits
                built[0] = True
                from sapd.stages import build_prefixes
                run_stage(build_prefixes, StageContext(cfg, log=lambda s: None, progress=QUIET), Step("build-prefixes"))
        waited = wait_for_input(cfg, Step("teacher-scores", 0), poll_seconds=poll, log=lambda line: None, sleep=sleep,
                                clock=lambda: now[0], expect_seconds=expect)
        shutil.rmtree(layout.prefixes_dir(root))
        return waited, polls

    waited, polls = run(None, 10.03)
    assert waited == pytest.approx(11.0) and polls == [1.0] * 11  # a check a second: seen 0.97 s late
    waited, polls = run(10.0, 10.03)
    # every second up to 0.8 × 10 − 1 = 7 s, then every 0.1 s: seen within 0.1 s of the commit
    assert polls[:7] == [1.0] * 7 and set(polls[7:]) == {0.1}
    assert 10.03 <= waited <= 10.13 and len(polls) == 7 + 31
    # an expectation of 2 s for a wait of 20 s: fast from 0.6 s to 1.5 × 2 + 1 = 4 s, then every second again
    waited, polls = run(2.0, 20.0)
    assert waited == pytest.approx(20.0, abs=1.0) and polls[-5:] == [1.0] * 5 and polls.count(0.1) <= 35
    # a short poll (0.5 s: a tenth would be 0.05 s) keeps a floor of 0.1 s between two checks
    waited, polls = run(3.0, 3.0, poll=0.5)
    assert min(polls) == 0.1 and 3.0 <= waited <= 3.1
    assert plan.FAST_POLL_MIN_SECONDS == 0.1


def test_the_input_of_each_step_follows_the_overlap(tmp_path):
    cfg = config_from_dict({"run_root": str(tmp_path), "train": {"rounds": 4}})
    lagged = config_from_dict({"run_root": str(tmp_path), "train": {"rounds": 4, "overlap": "one_step"}})
    sft = config_from_dict({"run_root": str(tmp_path), "variant": "sft", "train": {"rounds": 4}})
    names = lambda c, stage: [str(plan.input_step(c, Step(stage, k))) for k in range(4)]  # noqa: E731
    assert names(cfg, "teacher-scores") == ["build-prefixes", "train-r0", "train-r1", "train-r2"]
    assert names(lagged, "teacher-scores") == ["build-prefixes", "build-prefixes", "train-r0", "train-r1"]
    assert names(cfg, "train") == names(lagged, "train") == [f"teacher-scores-r{k}" for k in range(4)]
    assert names(sft, "train") == ["build-prefixes", "train-r0", "train-r1", "train-r2"]
    assert plan.input_step(cfg, Step("build-prefixes")) is None
    with pytest.raises(ValueError, match="train.overlap: one_step .* variant sft"):
        config_from_dict({"variant": "sft", "train": {"overlap": "one_step"}})


def test_startup_marks_each_phase_once_and_reports_at_first_work():
    reported = []
    s = Startup(started_at=0.0, report=lambda line, secs: reported.append((line, secs)))
    s.mark("models_loaded")  # reached without a marked import: the earlier phases take its time
    s.mark("models_loaded")
    assert set(s.seconds) == {"imports", "models_loaded"} and reported == []
    s.mark("first_work")
    (line, secs), = reported
    assert set(secs) == {"imports", "models_loaded", "engines_ready", "first_work"}
    assert re.fullmatch(r"startup: imports \d+\.\ds, models loaded \d+\.\ds, engines ready \d+\.\ds, first work "
                        r"\d+\.\ds \(since the process started\)", line), line
    s.waited = 12.34
    assert s.line().endswith("(since the process started; 12.3s of it waiting for the first input)")
    s.mark("first_work")
    assert len(reported) == 1
    with pytest.raises(ValueError, match="unknown start-up phase"):
        s.mark("warmup")
    assert 0 <= time.time() - process_started_at() < 3600  # this test process started a moment ago


# ------------------------------------------------------------------------------------------ the doors, as pods


def _env() -> dict[str, str]:
    # the chart's pods of one release share the run root's lease as the release (SAPD_LEASE_OWNER)
    return {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "SAPD_PUSHGATEWAY_URL": "",
            "SAPD_LEASE_OWNER": lease.release_owner("persistent-doors", "test")}


def _run_pipeline_single_threaded(cfg) -> None:
    """`sapd run` in this process with the pods' one intra-op thread (`_env`'s OMP_NUM_THREADS=1): a float32
    reduction split over another number of threads rounds otherwise, which bit-exactness would see."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        run_pipeline(cfg, log=lambda s: None, show_progress=False)
    finally:
        torch.set_num_threads(threads)


def _run_side_by_side(tmp_path, commands: dict[str, list[str]], timeout_s: float = 900) -> dict[str, str]:
    """Start the doors together and wait for all; the first to fail stops the others (each waits on the
    others' commits, so a failed one would leave them polling until the timeout). Returns each one's log."""
    outs = {name: open(tmp_path / f"{name}.log", "w+") for name in commands}
    procs = {name: subprocess.Popen(cmd, cwd=REPO, env=_env(), stdout=outs[name], stderr=subprocess.STDOUT)
             for name, cmd in commands.items()}
    wait_together(procs, timeout_s)
    logs = {}
    for name, f in outs.items():
        f.seek(0)
        logs[name] = f.read()
        f.close()
    for name, p in procs.items():
        assert p.returncode == 0, f"{name} exited {p.returncode}:\n{logs[name]}\n(others:\n" + "\n".join(
            f"--- {other}:\n{log[-3000:]}" for other, log in logs.items() if other != name) + ")"
    return logs


@pytest.mark.slow
@pytest.mark.parametrize("overlap, dtype", [("off", "bfloat16"), ("one_step", "float32")])
def test_the_persistent_doors_side_by_side_end_where_sapd_run_does(tmp_path, models, overlap, dtype):
    """The chart's persistent pods, as processes: build-prefixes, then one teacher-scores worker and one
    trainer started together, each serving every round (`--rounds 0`) and waiting for its input. They end
    with `sapd run`'s checkpoints bit for bit (in bf16, its fp32 master included; with train.overlap:
    one_step too), each process logged one `model load:` per model and its start-up phases, and the trainer
    one update line per round, measured in the weights the optimizer keeps (bf16: the fp32 master)."""
    data = tiny_config(str(tmp_path / "pods"), *models, model={"dtype": dtype}, train={"rounds": 3, "overlap": overlap})
    ref = str(tmp_path / "sapd-run")
    _run_pipeline_single_threaded(config_from_dict({**data, "run_root": ref}))
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(data))
    base = ["--config", str(config), "--no-progress", "--no-check"]
    subprocess.run([sys.executable, "-m", "sapd.jobs.build_prefixes", *base], cwd=REPO, env=_env(), check=True,
                   capture_output=True)
    pool = ["--round", "0", "--rounds", "0", "--poll-seconds", "0.2"]
    logs = _run_side_by_side(tmp_path, {name: [sys.executable, "-m", f"sapd.jobs.{name}", *base, *pool, *extra]
                                        for name, extra in (("teacher_scores", ["--worker", "0"]), ("train", []))})
    root = data["run_root"]
    assert layout.committed_checkpoints(root) == [0, 1, 2, 3]
    assert_same_weights(root, ref, (1, 2, 3))
    scorer, trainer = logs["teacher_scores"], logs["train"]
    assert re.findall(r"^model load: (\w+)", scorer, re.M) == ["teacher", "student"], scorer
    assert re.findall(r"^model load: (\w+)", trainer, re.M) == ["student"], trainer
    assert len(re.findall(r"^weights: student checkpoint \d in place", scorer, re.M)) == (2 if overlap == "off" else 1)
    assert len(re.findall(r"^weights: checkpoint \d kept in memory", trainer, re.M)) == 2
    kept = "its fp32 master" if dtype == "bfloat16" else "its float32 weights"
    assert re.findall(rf"^round (\d) update of the weights the optimizer keeps \({kept}\): ‖Δw‖/‖w‖ [\d.e+-]+, "
                      r"[\d.]+% of the update it computed applied$", trainer, re.M) == ["0", "1", "2"], trainer
    if dtype == "bfloat16":
        a, b = (checkpoints.consolidated_optimizer_state(r, 3) for r in (ref, root))
        assert a is not None and b is not None
        for i, (sa, sb) in enumerate(zip(a["state"].values(), b["state"].values(), strict=True)):
            for key in ("master", "exp_avg", "exp_avg_sq"):
                assert torch.equal(sa[key], sb[key]), (i, key)
    for log in (scorer, trainer):
        assert len(re.findall(r"^startup: imports [\d.]+s, models loaded [\d.]+s, engines ready [\d.]+s, first work",
                              log, re.M)) == 1, log
    # the trainer loaded checkpoint 0 while round 0 was being scored (its prepare), not after its scores came
    assert "weights: checkpoint 0 loaded while round 0's scores were made" in trainer, trainer
    assert trainer.index("model load: student checkpoint 0 for training") < trainer.index(
        "weights: checkpoint 0 loaded while round 0's scores were made") < trainer.index("round 0 step 1:")
    # without the overlap the trainer waits for every round's scores (the scorer starts round k once
    # checkpoint k is committed), with it the scorer works a round ahead
    if overlap == "off":
        assert "stage train-r2: its input (teacher-scores-r2) is committed after" in trainer
        assert "stage teacher-scores-r1: waiting for the output of train-r0" in scorer
    else:  # round 1 was sampled by checkpoint 0 (no wait, no new weights) while round 0 trained
        assert "stage teacher-scores-r1: waiting" not in scorer
        assert "weights: student checkpoint 1 in place for sampling round 2 (train.overlap: one_step)" in scorer


@pytest.mark.slow
def test_overlap_one_step_samples_round_k_with_checkpoint_k_minus_1_and_weights_it(tmp_path, models):
    """`train.overlap: one_step` on `sapd run`: round 1's sampled tokens have checkpoint 0's log-probs (the
    sampler's own equal a recompute under checkpoint 0, not under checkpoint 1); round 1's first optimizer
    step starts at ρ = 1 and reports the behaviour weights, which round 0 (sampled by its own checkpoint)
    does not; checkpoint 1 equals the non-overlapped run's (round 0 is the same round in both)."""
    from sapd.data.scored import read_scored, scored_prefixes
    from sapd.models.loading import load_tokenizer
    from sapd.run.report import read_step_log
    from sapd.stages.train import recompute_old_logprobs
    root, plain = str(tmp_path / "overlap"), str(tmp_path / "plain")
    run_pipeline(config_from_dict(tiny_config(root, *models, train={"rounds": 2, "overlap": "one_step"})),
                 log=lambda s: None, show_progress=False)
    run_pipeline(config_from_dict(tiny_config(plain, *models, train={"rounds": 2})), log=lambda s: None,
                 show_progress=False)
    assert_same_weights(root, plain, (1,))
    prefixes = scored_prefixes(read_scored(root, 1))
    pad = load_tokenizer(models[0]).pad_token_id
    sampled = [lp for sp in prefixes for lp in sp.sampler_logp_G_T]
    for k, close in ((0, True), (1, False)):
        model = checkpoints.load_checkpoint_model(root, k)
        recompute_old_logprobs(model, prefixes, pad, 2)
        worst = max(abs(a - b) for sp, s_G in zip(prefixes, [sp.sampler_logp_G_T for sp in prefixes])
                    for a_T, b_T in zip(sp.old_logp_G_T, s_G) for a, b in zip(a_T, b_T))
        assert (worst < 1e-4) == close, (k, worst)
    assert sampled
    steps = read_step_log(root)
    first = {rec["round"]: rec for rec in reversed(steps)}  # each round's first step
    assert "behaviour_weight_mean" not in first[0] and "behaviour_weight_mean" in first[1]
    assert first[1]["ratio_mean"] == pytest.approx(1.0, abs=1e-6)
    assert first[1]["behaviour_weight_mean"] != 1.0


@pytest.mark.slow
@pytest.mark.parametrize("zero_stage, dtype", [(2, "float32"), (3, "bfloat16")])
def test_a_kept_deepspeed_trainer_on_two_ranks_ends_where_per_round_trainers_do(tmp_path, models, zero_stage, dtype):
    """DeepSpeed ZeRO on 2 processes: one torchrun of `python -m sapd.jobs.train --round 0 --rounds 0` keeps its
    engine (the partitions, the optimizer state, in bf16 DeepSpeed's fp32 master partitions) for both
    rounds; two torchruns of one round each rebuild it from checkpoints 0 and 1. Same scored rounds in, the
    same checkpoints out, bit for bit, the stored master included; each round logs its own update."""
    pytest.importorskip("deepspeed")
    import shutil

    from tests.conftest import free_port
    train = {"rounds": 2, "trajectories_per_round": 3, "minibatch_prefixes": 4, "micro_batch_prefixes": 2,
             "engine": "deepspeed", "zero_stage": zero_stage, **({"checkpoint_shard_mb": 0.1} if zero_stage == 3 else {})}
    source = str(tmp_path / "scored")  # every round scored by `sapd run` (its own trainer), then copied
    run_pipeline(config_from_dict(tiny_config(source, *models, train={**train, "engine": "torch"})), log=lambda s: None,
                 show_progress=False)
    roots = {}
    for name in ("per-round", "kept"):
        root = tmp_path / name
        for uri in (layout.prefixes_dir(source), layout.round_dir(source, 0), layout.round_dir(source, 1),
                    layout.checkpoint_dir(source, 0)):
            rel = os.path.relpath(uri, source)
            shutil.copytree(Path(source) / rel, root / rel)
        config = tmp_path / f"{name}.yaml"
        config.write_text(yaml.safe_dump(tiny_config(str(root), *models, model={"dtype": dtype}, train=train)))
        roots[name] = (str(root), config)

    def torchrun(config: Path, *args: str) -> str:
        port = str(free_port())
        env = {**_env(), "DS_ACCELERATOR": "cpu", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port,
               "OMP_WAIT_POLICY": "PASSIVE",
               "TORCH_EXTENSIONS_DIR": os.environ.get("TORCH_EXTENSIONS_DIR", str(REPO / ".cache" / "torch_extensions"))}
        proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr",
                               "127.0.0.1", "--master_port", port, "-m", "sapd.jobs.train", "--config", str(config),
                               "--no-progress", "--no-check", *args], cwd=REPO, env=env, capture_output=True,
                              text=True, timeout=900)
        assert proc.returncode == 0, ranks_failed(proc)
        return proc.stdout
    for k in (0, 1):
        torchrun(roots["per-round"][1], "--round", str(k))
    kept = torchrun(roots["kept"][1], "--round", "0", "--rounds", "0", "--poll-seconds", "0.2")
    assert re.findall(r"^model load: student checkpoint (\d+)", kept, re.M) == ["0"], kept
    assert "weights: checkpoint 1 kept in memory from round 0" in kept
    assert_same_weights(roots["kept"][0], roots["per-round"][0], (1, 2))
    from sapd.checkpoints import consolidated_optimizer_state
    a, b = (consolidated_optimizer_state(roots[n][0], 2) for n in ("per-round", "kept"))
    assert a is not None and b is not None
    for i, (sa, sb) in enumerate(zip(a["state"].values(), b["state"].values())):
        for key in ("exp_avg", "exp_avg_sq", *(("master",) if dtype == "bfloat16" else ())):
            assert torch.equal(sa[key], sb[key]), (i, key)
    kept_what = "its fp32 master" if dtype == "bfloat16" else "its float32 weights"
    assert re.findall(rf"^round (\d) update of the weights the optimizer keeps \({kept_what}\)", kept, re.M) == ["0", "1"]
