"""A bf16 run learns like a float32 run (docs/design/training.md "The fp32 master"): the weights the optimizer keeps
are an fp32 master for the whole run — the torch engine's master tensors, DeepSpeed's fp32 partitions —
saved in every checkpoint beside the moments and written back on resume, while each checkpoint's model
folder stays bf16. At the chart's lr 1e-6 an AdamW step is far below half a bf16 step of almost every
weight, so without the master a bf16 run keeps ~2 % of its updates (sapd before this: 1.95 % of the
weights changed over 34 steps, against 14.9 % for float32 rounded to bf16).

* On the same scored round, a bf16 round moves the master as a float32 round moves the weights (cosine
  ≥ 0.98, norm within 5 %): torch engine, and DeepSpeed ZeRO 1, 2, 3 on 2 ranks.
* Over 34 optimizer steps with their own sampling, the bf16 runs' checkpoints change as many bf16 weights,
  and by as much, as the float32 run's weights rounded to bf16 do: torch engine and ZeRO 1, 2, 3.
* Resume: the master is restored bit for bit (resharded: 2 ranks → the torch engine) and the bf16 weights
  set from it; checkpoints written before (no master) resume with it rebuilt from their weights, logged.
* Every round measures its update in the kept weights (``round_update_rel``, ``round_update_applied_ratio``)
  and warns when rounding swallowed most of it; float16 is refused with one line.
(SIGKILL mid-save in bf16: tests/checkpoints/test_kill_mid_save.py and tests/run/test_pipeline.py.)"""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import pytest
import torch

from sapd import checkpoints
from sapd.config import ConfigError, config_from_dict
from sapd.engines.deepspeed_engine import deepspeed_config
from sapd.engines.torch_engine import make_torch_engine
from sapd.run.local import run_pipeline
from sapd.run.report import read_step_log
from sapd.stages import train
from tests.bf16_worker import restore_and_compare, write_as_before_master
from tests.pipeline_util import make_models, run_rank_worker, tiny_config

REPO = Path(__file__).resolve().parents[2]
LR = 1e-6
# ~5 optimizer steps per round (minibatches of 2 prefixes) at the chart's learning rate
TRAIN = {"rounds": 1, "trajectories_per_round": 3, "minibatch_prefixes": 2, "micro_batch_prefixes": 2, "lr": LR}
QUIET = dict(log=lambda s: None, show_progress=False)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return make_models(tmp_path_factory.mktemp("models"))


def _config(root: Path, models, dtype: str, **train_over) -> dict:
    return tiny_config(str(root), *models, model={"dtype": dtype}, train={**TRAIN, **train_over})


def _seed(src: Path, dst: Path, *parts: str) -> None:
    for part in parts:
        shutil.copytree(src / part, dst / part)


def _weights(root: Path, k: int, dtype: str = "float32") -> list[torch.Tensor]:
    """Checkpoint k's model-folder weights in ``model.parameters()`` order (the optimizer state's order)."""
    model = checkpoints.load_checkpoint_model(str(root), k, dtype)
    return [p.detach().clone() for p in model.parameters()]


def _masters(root: Path, k: int) -> list[torch.Tensor]:
    state = checkpoints.consolidated_optimizer_state(str(root), k)
    assert state is not None, f"checkpoint {k} of {root} has no optimizer state"
    return [state["state"][i]["master"] for i in range(len(state["state"]))]


def _flat(tensors: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.double().reshape(-1) for t in tensors])


def _against(update: torch.Tensor, reference: torch.Tensor) -> tuple[float, float]:
    """(cosine, norm ratio) of an update against the reference update."""
    return (float(update @ reference / (update.norm() * reference.norm())), float(update.norm() / reference.norm()))


@pytest.fixture(scope="module")
def same_round(tmp_path_factory, models):
    """Round 0 sampled and scored once by a float32 run (torch engine) that trains on it; a bf16 run whose
    run root starts with the same prefixes and scored round 0 (its checkpoint 0 and training its own)."""
    tmp = tmp_path_factory.mktemp("same-round")
    fp32, bf16 = tmp / "fp32", tmp / "bf16"
    run_pipeline(config_from_dict(_config(fp32, models, "float32")), **QUIET)
    _seed(fp32, bf16, "prefixes", "rounds/000000")
    lines: list[str] = []
    run_pipeline(config_from_dict(_config(bf16, models, "bfloat16")), log=lines.append, show_progress=False)
    reference = _flat(_weights(fp32, 1)) - _flat(_weights(fp32, 0))
    return {"tmp": tmp, "fp32": fp32, "bf16": bf16, "reference": reference, "log": lines}


@pytest.mark.slow  # a torch and a DeepSpeed round of the tiny model (minutes on 2 cores)
def test_a_bf16_round_moves_the_master_as_float32_moves_the_weights(same_round):
    fp32, bf16 = same_round["fp32"], same_round["bf16"]
    # checkpoint 0: the master is the student's own float32 weights, the folder their bf16 rounding
    w0, m0 = _weights(fp32, 0), _masters(bf16, 0)
    assert all(torch.equal(a, b) for a, b in zip(m0, w0, strict=True))
    assert all(torch.equal(f, m.to(torch.bfloat16)) for f, m in zip(_weights(bf16, 0, "bfloat16"), m0, strict=True))
    assert not all(torch.equal(m, m.to(torch.bfloat16).float()) for m in m0)  # a real fp32 master, not bf16 values
    m1 = _masters(bf16, 1)
    cos, ratio = _against(_flat(m1) - _flat(m0), same_round["reference"])
    print(f"\ntorch engine, one round ({len(read_step_log(str(bf16)))} steps at lr {LR:g}): the bf16 run's master "
          f"update against the float32 run's: cosine {cos:.4f}, norm ratio {ratio:.4f}")
    assert cos >= 0.98 and abs(ratio - 1) <= 0.05
    # checkpoint 1's folder is the master's rounding: what samples and is evaluated
    assert all(torch.equal(f, m.to(torch.bfloat16)) for f, m in zip(_weights(bf16, 1, "bfloat16"), m1, strict=True))
    # the round's log measures the update of the kept weights: all of it applied, as large as float32's
    (last16,), (last32,) = ([r for r in read_step_log(str(root)) if "round_update_rel" in r] for root in (bf16, fp32))
    assert last16["round_update_applied_ratio"] == pytest.approx(1.0, abs=1e-3)
    assert last16["round_update_rel"] == pytest.approx(last32["round_update_rel"], rel=0.05)
    assert any("update of the weights the optimizer keeps (its fp32 master)" in line for line in same_round["log"])
    assert not any("WARNING" in line for line in same_round["log"])


@pytest.mark.slow  # a torch and a DeepSpeed round of the tiny model (minutes on 2 cores)
def test_restore_writes_the_master_back_into_the_bf16_weights(same_round, tmp_path):
    # an engine built from checkpoint 0's folder, given checkpoint 1's optimizer state: its master is the
    # saved one bit for bit, and its bf16 weights become the master's rounding (they were checkpoint 0's)
    cfg = _config(tmp_path / "x", ("", ""), "bfloat16")
    lines: list[str] = []
    got = restore_and_compare({"config": cfg, "root": str(same_round["bf16"]), "model_from": 0}, lines)
    assert got["restored"] == "sharded" and got["master_vs_saved"] == 0.0 and got["weights_vs_master_rounding"] == 0.0
    assert got["weights_changed_by_restore"] > 0 and not lines


@pytest.mark.slow  # a torch and a DeepSpeed round of the tiny model (minutes on 2 cores)
def test_checkpoints_without_a_master_resume_with_it_rebuilt(same_round, models, tmp_path):
    """Checkpoints written before sapd kept the master: checkpoint 0 with no state, checkpoint k with the
    moments only (format dcp-adamw/1; the torch engine's were bf16). Both resume, the master rebuilt from
    their bf16 weights, and the log says so; the rebuilt run still learns like float32."""
    bf16 = same_round["bf16"]
    root = tmp_path / "before-master"
    _seed(bf16, root, "prefixes", "rounds/000000", "checkpoints/000000")
    write_as_before_master(str(root), 0)
    assert checkpoints.load_trainer_state(str(root), 0) is None
    lines: list[str] = []
    run_pipeline(config_from_dict(_config(root, models, "bfloat16")), log=lines.append, show_progress=False)
    assert any(line.startswith("checkpoint 0: no optimizer state and no fp32 master stored") and "rebuilt from its "
               "half-precision weights" in line for line in lines), lines
    # the master started from checkpoint 0's bf16 weights; its update is still float32's
    start = _flat([w.float() for w in _weights(root, 0, "bfloat16")])
    cos, ratio = _against(_flat(_masters(root, 1)) - start, same_round["reference"])
    assert cos >= 0.98 and abs(ratio - 1) <= 0.05, (cos, ratio)

    write_as_before_master(str(root), 1, moments_dtype=torch.bfloat16)
    assert checkpoints.read_marker(str(root), 1)["optimizer"] == "dcp-adamw/1"
    lines.clear()
    run_pipeline(config_from_dict(_config(root, models, "bfloat16", rounds=2)), log=lines.append, show_progress=False)
    assert any(line.startswith("checkpoint 1: no fp32 master stored (written before sapd kept one); the fp32 master "
                               "is rebuilt") for line in lines), lines
    m2 = _masters(root, 2)  # checkpoints from now on store it
    assert checkpoints.read_marker(str(root), 2)["optimizer"] == checkpoints.OPTIMIZER_FORMAT
    assert not all(torch.equal(a, b) for a, b in zip(m2, _weights(root, 1), strict=True))


def test_float16_is_refused_in_one_line(models, tmp_path):
    from sapd.models.loading import load_causal_lm
    cfg = config_from_dict(_config(tmp_path / "run", models, "float16"))
    with pytest.raises(ConfigError, match=r"^model.dtype: float16 is not trained: its gradients need dynamic loss "
                                          r"scaling, which sapd does not do; use bfloat16") as e:
        make_torch_engine(load_causal_lm(models[0], dtype="float16", trainable=True), cfg)
    assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match="float16 is not trained"):
        deepspeed_config(config_from_dict(_config(tmp_path / "run", models, "float16", engine="deepspeed")), 1)


# --------------------------------------------------------------------------------------------------
# the update probe


def _probe_step(weights: torch.Tensor, lr: float, weight_decay: float) -> tuple[dict, torch.Tensor, torch.Tensor]:
    model = torch.nn.Linear(4, 3, bias=False)
    with torch.no_grad():
        model.weight.copy_(weights)
    cfg = config_from_dict(tiny_config("unused", "", "", train={"lr": lr, "weight_decay": weight_decay}))
    engine = make_torch_engine(model, cfg)
    probe = train.UpdateProbe(engine)
    before = model.weight.detach().clone()
    (model(torch.linspace(-1, 1, 8).view(2, 4)) ** 2).sum().backward()
    probe.before_step()
    engine.step(lr)
    return probe.after_step(lr), before, model.weight.detach().clone()


def test_the_probe_measures_the_step_against_adamw_by_hand():
    torch.manual_seed(0)
    w = torch.randn(3, 4)
    figures, before, after = _probe_step(w, 1e-2, 0.1)
    # AdamW's first step by hand: m̂ = g, v̂ = g², so the update is −lr·(wd·w + g/(|g| + ε)) ≈ −lr·(wd·w + sign g)
    # (a probe that left out the decoupled weight decay, 1e-3 here against 1e-2, would be several % off)
    step = after.double() - before.double()
    assert figures["update_rel"] == pytest.approx(float(step.norm() / before.double().norm()), rel=1e-9)
    assert figures["update_applied_ratio"] == pytest.approx(1.0, abs=1e-4)  # float32 keeps a 1e-2 step
    # weights of size ~1 and an update of 1e-12: below half the float32 spacing (6e-8), all of it lost
    figures, before, after = _probe_step(torch.full((3, 4), 1.5), 1e-12, 0.0)
    assert torch.equal(before, after) and figures["update_rel"] == 0.0 and figures["update_applied_ratio"] == 0.0


@pytest.mark.slow  # a torch and a DeepSpeed round of the tiny model (minutes on 2 cores)
def test_a_round_that_loses_its_update_warns(models, tmp_path):
    """lr 1e-11 is below half the float32 spacing of every weight above ~2^-13: the round log, the metric and
    a warning naming the cause say so, though the loss and gradient norm look as usual."""
    root = tmp_path / "tiny-lr"
    lines: list[str] = []
    run_pipeline(config_from_dict(_config(root, models, "float32", lr=1e-11)), log=lines.append, show_progress=False)
    (last,) = [r for r in read_step_log(str(root)) if "round_update_rel" in r]
    assert last["round_update_applied_ratio"] < 0.1 and last["round_update_rel"] < 1e-9
    (warning,) = [line for line in lines if "WARNING" in line]
    assert warning.startswith("round 0: WARNING: the weights the optimizer keeps (float32) took only")
    assert "at lr 1.0e-11 most updates are below half the float32 spacing" in warning and "raise train.lr" in warning


# --------------------------------------------------------------------------------------------------
# DeepSpeed ZeRO 1-3 (gloo, CPU); many steps with their own sampling


def _worker(jobs: list[dict], out: Path, ranks: int) -> list[list[dict]]:
    return run_rank_worker("bf16_worker.py", jobs, out, ranks)


@pytest.mark.slow
def test_zero_rounds_on_two_ranks_move_the_master_as_float32_moves_the_weights(same_round, models):
    pytest.importorskip("deepspeed")
    tmp, bf16 = same_round["tmp"], same_round["bf16"]
    stages = (1, 2, 3)
    jobs: list[dict] = []
    for z in stages:  # the same scored round 0 and checkpoint 0 (with its master) as the torch engine's bf16 run
        root = tmp / f"zero{z}"
        _seed(bf16, root, "prefixes", "rounds/000000", "checkpoints/000000")
        # one prefix per micro-batch: a minibatch of 2 feeds both ranks (train.micro_batch_prefixes 2 would idle one)
        cfg = _config(root, models, "bfloat16", engine="deepspeed", zero_stage=z, micro_batch_prefixes=1)
        jobs.append({"do": "train", "config": cfg})
    for z in stages:  # checkpoint 1's state into an engine built from checkpoint 0's folder
        jobs.append({"do": "restore", "config": _config(tmp / f"restore{z}", models, "bfloat16", engine="deepspeed",
                                                        zero_stage=z), "root": str(tmp / f"zero{z}"), "model_from": 0})
    # a checkpoint 1 as sapd wrote it before the master (the torch engine's, moments only), resumed by ZeRO-2
    _seed(bf16, tmp / "legacy", "checkpoints")
    write_as_before_master(str(tmp / "legacy"), 1)
    jobs.append({"do": "restore", "config": _config(tmp / "legacy2", models, "bfloat16", engine="deepspeed",
                                                    zero_stage=2), "root": str(tmp / "legacy"), "model_from": 1})
    ranks = _worker(jobs, tmp / "zero-worker", 2)
    m0 = _flat(_masters(bf16, 0))
    for z, job in zip(stages, ranks[0]):
        root = tmp / f"zero{z}"
        m1 = _masters(root, 1)
        cos, ratio = _against(_flat(m1) - m0, same_round["reference"])
        print(f"\nZeRO-{z}, 2 ranks: master update against float32's: cosine {cos:.4f}, norm ratio {ratio:.4f}")
        assert cos >= 0.98 and abs(ratio - 1) <= 0.05, z
        assert all(torch.equal(f, m.to(torch.bfloat16)) for f, m in zip(_weights(root, 1, "bfloat16"), m1, strict=True))
        assert any("update of the weights the optimizer keeps (its fp32 master)" in line for line in job["log"])
    for rank in ranks:
        for job in rank[len(stages):len(stages) * 2]:  # restored bit for bit, the bf16 weights set from it
            assert job["restored"] == "sharded" and job["master_vs_saved"] == 0.0
            assert job["weights_vs_master_rounding"] == 0.0 and job["weights_changed_by_restore"] > 0
        legacy = rank[-1]  # a checkpoint without a master: DeepSpeed's, built from the bf16 weights, kept
        assert legacy["restored"] == "sharded" and legacy["master_vs_saved"] == 0.0
        assert legacy["weights_changed_by_restore"] == 0
    assert any("no fp32 master stored (written before sapd kept one); the fp32 master is rebuilt" in line
               for line in ranks[0][-1]["log"])
    # the 2-rank ZeRO-3 checkpoint resharded into the torch engine (one process): the same master, bit for bit
    got = restore_and_compare({"config": _config(tmp / "into-torch", models, "bfloat16"), "root": str(tmp / "zero3"),
                               "model_from": 0}, [])
    assert got["restored"] == "sharded" and got["master_vs_saved"] == 0.0 and got["weights_vs_master_rounding"] == 0.0


@pytest.mark.slow
def test_many_steps_with_own_sampling_move_bf16_checkpoints_as_far_as_float32(models, tmp_path):
    """4 rounds (34 optimizer steps at lr 1e-6), each run sampling its own rounds: a bf16 checkpoint changes
    where the master has crossed half a bf16 step, so it is compared with the float32 run's weights rounded
    to bf16 — the share of weights changed since checkpoint 0 and the size of the change."""
    pytest.importorskip("deepspeed")
    arms = {"float32": {}, "bf16-torch": {}, **{f"bf16-zero{z}": {"engine": "deepspeed", "zero_stage": z}
                                                for z in (1, 2, 3)}}
    jobs = [{"do": "pipeline", "config": _config(tmp_path / arm, models, "float32" if arm == "float32" else "bfloat16",
                                                 rounds=4, **over)} for arm, over in arms.items()]
    _worker(jobs, tmp_path / "worker", 1)

    def moved(arm: str) -> tuple[float, float, int]:
        root = tmp_path / arm
        start, end = (_flat([w.to(torch.bfloat16).float() for w in _weights(root, k)]) for k in (0, 4))
        return float((start != end).double().mean()), float((end - start).norm()), len(read_step_log(str(root)))

    share32, norm32, steps = moved("float32")
    assert steps >= 30 and share32 > 0.10  # enough steps at lr 1e-6 for bf16 copies to move visibly
    for arm in arms:
        if arm == "float32":
            continue
        share, norm, arm_steps = moved(arm)
        print(f"\n{arm}: {share:.2%} of bf16 weights changed over {arm_steps} steps (float32 rounded to bf16: "
              f"{share32:.2%}); ‖Δ‖ {norm:.3e} vs {norm32:.3e}")
        assert arm_steps == steps
        assert math.isclose(share, share32, rel_tol=0.1) and math.isclose(norm, norm32, rel_tol=0.1), arm
        updates = [r for r in read_step_log(str(tmp_path / arm)) if "round_update_rel" in r]
        assert len(updates) == 4 and all(r["round_update_applied_ratio"] > 0.99 for r in updates)


def test_a_float32_checkpoint_0_gives_a_bf16_trainer_the_master_a_bf16_build_stores(tmp_path, models):
    """``model.dtype: auto`` resolves per process: on the cluster the prefix build runs on a CPU (float32:
    checkpoint 0 holds float32 weights, no master) and the trainer on a GPU (bfloat16). The trainer then takes
    its fp32 master from those float32 weights, exactly, and starts where a bf16 build's checkpoint 0 (bf16
    weights + the fp32 master beside them) starts it, as on one GPU: the same master, the same bf16 weights."""
    from sapd.stages.build_prefixes import ensure_initial_checkpoint
    starts = {}
    lines: list[str] = []
    for build in ("float32", "bfloat16"):
        root = tmp_path / build
        ensure_initial_checkpoint(config_from_dict(_config(root, models, build)), log=lambda s: None)
        trainer = train.load_trainer(config_from_dict(_config(root, models, "bfloat16")), 0, log=lines.append)
        engine = trainer.engine
        starts[build] = ([m.clone() for m in engine.masters], [p.detach().clone() for p in engine.model.parameters()])
    student = checkpoints.load_checkpoint_model(str(tmp_path / "float32"), 0, "float32")
    assert all(torch.equal(m, p.detach()) for m, p in zip(starts["float32"][0], student.parameters()))  # exact
    assert any(not torch.equal(m, m.to(torch.bfloat16).float()) for m in starts["float32"][0])  # not the rounding
    for a, b in zip(starts["float32"][0] + starts["float32"][1], starts["bfloat16"][0] + starts["bfloat16"][1]):
        assert a.dtype == b.dtype and torch.equal(a, b)
    assert any("float32 weights" in line and "they are the fp32 master, exactly" in line for line in lines), lines
