"""Under ZeRO with bf16 weights, DeepSpeed sums the ranks' gradients and accumulates a step's micro-batches in
fp32, the precision of the fp32 master they update (sapd/engines/deepspeed_engine.py "Gradients in fp32"),
and a 2-rank bf16 round still matches the single-process torch engine's.

One bf16 round of the tiny model is sampled, scored and trained by the torch engine (one process); DeepSpeed
rounds on 2 CPU ranks (torchrun, gloo: tests/bf16_reduction_worker.py) train the same scored round from the
same checkpoint 0, each rank recording the dtype of every tensor handed to a reducing collective of
``torch.distributed`` while the engine's ``backward`` or ``step`` runs, and of the buffers the gradients wait
in for the ``step``.

* What is reduced: with sapd's config every gradient reduction is float32 and carries the whole gradient
  every step on each rank — ZeRO-2's all-reduce in each backward, ZeRO-3's reduce-scatter in each backward,
  ZeRO-1's all-reduce at the step — and what a rank's micro-batches accumulate in between steps (two per
  rank and step) is float32: ZeRO-2's and ZeRO-3's gradient partitions, the gradients of DeepSpeed's bf16
  optimizer, which ZeRO-1 then runs. With DeepSpeed's own defaults (the two keys taken out of the config)
  the same runs hand bf16 to the collectives and accumulate in bf16: none of the three stages defaults to
  fp32 (DeepSpeed 0.19.8).
* What it trains: the 2-rank ZeRO-2 round against the torch engine's, both with one prefix per micro-batch
  (the same bf16 forward and backward of each prefix from the same weights). The torch engine adds each
  micro-batch's bf16 gradients into fp32 sums beside its master (sapd/engines/torch_engine.py), the ranks
  sum theirs in fp32 (each rank's gradient is twice its micro-batch's, an exact scaling, and the average
  halves it again), so the two compute the same fp32 gradient, and with clipping inactive (the gradient
  norm, summed over partitions in another order, differs in its last bits) the same update:
    - step 1 (the same weights in both): the same loss, the gradient norm within 2⁻¹⁶ (relative: fp32 partial
      sums of squares added in another order, measured 4.9e-6);
    - the round's update of the fp32 master (checkpoint 1's master − checkpoint 0's, 9 steps at lr 1e-6) is
      the same bit for bit, and so are checkpoint 1's bf16 weights, each run's master rounded to nearest;
    - with DeepSpeed's defaults (bf16 sums of the rank gradients) the update differs from the torch
      engine's: by about bf16's machine epsilon relative to it (measured 2.2e-3 ≈ 2⁻⁸·⁸), the rounding the
      fp32 settings remove."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

pytest.importorskip("deepspeed")

from sapd import checkpoints  # noqa: E402
from sapd.config import config_from_dict  # noqa: E402
from sapd.run.local import run_pipeline  # noqa: E402
from sapd.run.report import read_step_log  # noqa: E402
from tests.pipeline_util import make_models, run_rank_worker, tiny_config  # noqa: E402

# one round of 18 prefixes at the chart's learning rate, one prefix per micro-batch, G full sequences on
# every engine (the torch engine's shared-prompt forward is another bf16 computation): minibatches of 2 give
# each of 2 ranks one micro-batch per step, of 4 two (accumulated between the step's reductions)
TRAIN = {"rounds": 1, "trajectories_per_round": 3, "minibatch_prefixes": 2, "micro_batch_prefixes": 1, "lr": 1e-6,
         "shared_prompt": "off"}
ACCUMULATE = {"minibatch_prefixes": 4}
FP32_KEYS = ("communication_data_type", "data_types")  # what sapd adds; taken out, DeepSpeed's defaults apply
BF16_EPS = 2.0 ** -7  # the spacing of bf16 numbers in [1, 2); rounding to nearest errs by half of it at most


def _config(root: Path, models, **train) -> dict:
    return tiny_config(str(root), *models, model={"dtype": "bfloat16"}, train={**TRAIN, **train})


def _masters(root: Path, k: int) -> torch.Tensor:
    state = checkpoints.consolidated_optimizer_state(str(root), k)
    assert state is not None, f"checkpoint {k} of {root} has no optimizer state"
    return torch.cat([state["state"][i]["master"].reshape(-1) for i in range(len(state["state"]))])


def _bf16_weights(root: Path, k: int) -> torch.Tensor:
    model = checkpoints.load_checkpoint_model(str(root), k, "bfloat16")
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The torch engine's round (one process), then on 2 ranks: ZeRO-2 on its scored round with sapd's config
    and with DeepSpeed's defaults; ZeRO 1, 2, 3 with two micro-batches per rank and step, each with sapd's
    config and with DeepSpeed's defaults."""
    tmp = tmp_path_factory.mktemp("bf16-reduction")
    models = make_models(tmp / "models")
    reference = tmp / "torch"
    run_pipeline(config_from_dict(_config(reference, models)), log=lambda s: None, show_progress=False)
    named = {"zero2": ({"zero_stage": 2}, []), "zero2-defaults": ({"zero_stage": 2}, list(FP32_KEYS))}
    for z in (1, 2, 3):
        named[f"accumulate{z}"] = ({"zero_stage": z, **ACCUMULATE}, [])
        named[f"accumulate{z}-defaults"] = ({"zero_stage": z, **ACCUMULATE}, list(FP32_KEYS))
    jobs = []
    for name, (over, drop) in named.items():
        root = tmp / name
        for part in ("prefixes", "rounds/000000", "checkpoints/000000"):
            shutil.copytree(reference / part, root / part)
        jobs.append({"do": "train", "config": _config(root, models, engine="deepspeed", **over), "drop": drop})
    ranks = run_rank_worker("bf16_reduction_worker.py", jobs, tmp / "worker", 2)
    return {"tmp": tmp, "reference": reference, "names": list(named),
            "jobs": {name: [rank[i] for rank in ranks] for i, name in enumerate(named)},
            "params": _masters(reference, 0).numel()}


def _gradient_reductions(job_ranks: list[dict]) -> list[dict]:
    """Every rank's reductions of more than one element (the scalars are grad-norm and overflow checks)."""
    return [r for rank in job_ranks for r in rank["records"] if r["numel"] > 1]


@pytest.mark.slow  # a torch round and eight 2-rank DeepSpeed rounds of the tiny model (~1.5 min on 2 cores)
def test_gradients_are_reduced_and_accumulated_in_fp32_under_every_zero_stage(runs):
    jobs, params = runs["jobs"], runs["params"]
    summary = {}
    for name in runs["names"]:
        job_ranks = jobs[name]
        defaults = name.endswith("-defaults")
        expected = "bfloat16" if defaults else "float32"
        ds_config = job_ranks[0]["ds_config"]
        if defaults:
            assert not set(FP32_KEYS) & set(ds_config), ds_config
        else:
            assert ds_config["communication_data_type"] == "fp32"
            assert ds_config["data_types"] == {"grad_accum_dtype": "fp32"}
        reductions = _gradient_reductions(job_ranks)
        steps = len(job_ranks[0]["steps"])
        assert steps >= 5 and all(len(rank["steps"]) == steps == rank["calls"]["step"] for rank in job_ranks), name
        if name.startswith("accumulate"):  # two micro-batches per rank in every step but the round's last
            assert all(rank["calls"]["backward"] == 2 * steps - 1 for rank in job_ranks), (name, steps)
        # the collectives were handed the whole gradient every step, on each rank, in the expected dtype
        assert {r["dtype"] for r in reductions} == {expected}, (name, reductions[:4])
        for rank in job_ranks:
            assert sum(r["numel"] for r in rank["records"] if r["numel"] > 1) >= steps * params, name
        # where the micro-batches' gradients wait for the step (the parameters' own .grad aside: under the bf16
        # optimizer, what autograd wrote of the last micro-batch, cleared before each backward)
        for rank in job_ranks:
            for step in rank["steps"]:
                held = [b for b in step["buffers"] if b["where"] != "param.grad"]
                if defaults and not held:  # ZeRO-1's default optimizer accumulates in the parameters' .grad
                    held = step["buffers"]
                assert held and {b["dtype"] for b in held} == {expected}, (name, step)
                assert sum(b["numel"] for b in held) >= params // 2, (name, step)  # at least this rank's share
        summary[name] = (sorted({r["op"] + "/" + r["phase"] for r in reductions}), expected,
                         job_ranks[0]["steps"][-1]["optimizer"])
    print("\n" + "\n".join(f"{name}: {ops} in {dtype} ({optimizer})" for name, (ops, dtype, optimizer)
                           in summary.items()))
    # the stages were all exercised as documented: ZeRO-1 reduces at the step, ZeRO-2 and -3 in each backward
    assert summary["accumulate1"][0] == ["all_reduce/step"] and summary["accumulate1"][2] == "BF16_Optimizer"
    assert summary["accumulate2"][0] == ["all_reduce/backward"]
    assert summary["accumulate3"][0] == ["reduce_scatter_tensor/backward"]


@pytest.mark.slow  # a torch round and eight 2-rank DeepSpeed rounds of the tiny model (~1.5 min on 2 cores)
def test_a_two_rank_bf16_zero2_round_matches_one_process_within_one_bf16_rounding(runs):
    tmp, reference = runs["tmp"], runs["reference"]
    zero2, defaults = tmp / "zero2", tmp / "zero2-defaults"
    steps_1, steps_2 = read_step_log(str(reference)), read_step_log(str(zero2))
    assert [s["prefixes"] for s in steps_2] == [s["prefixes"] for s in steps_1] and len(steps_1) == 9
    # step 1, the same weights: the same forward and the same fp32 gradient; its norm summed in another order
    assert steps_2[0]["loss"] == pytest.approx(steps_1[0]["loss"], rel=1e-6)
    assert abs(steps_2[0]["grad_norm"] - steps_1[0]["grad_norm"]) <= 2.0 ** -16 * steps_1[0]["grad_norm"]
    assert all(s["grad_norm"] < TRAIN.get("max_grad_norm", 1.0) for s in steps_1)  # clipping inactive

    m0 = _masters(reference, 0)
    update_1 = (_masters(reference, 1) - m0).double()
    update_2 = (_masters(zero2, 1) - m0).double()
    update_d = (_masters(defaults, 1) - m0).double()
    rel_defaults = float((update_d - update_1).norm() / update_1.norm())
    w1, w2 = _bf16_weights(reference, 1), _bf16_weights(zero2, 1)
    print(f"\nZeRO-2 on 2 ranks (fp32 reduction) vs the torch engine, {len(steps_1)} steps at lr {TRAIN['lr']:g}: "
          f"master update equal: {torch.equal(update_2, update_1)}; DeepSpeed's bf16 defaults off by "
          f"{rel_defaults:.3g} (relative, L2); step-1 grad norm {steps_2[0]['grad_norm']:.8g} vs "
          f"{steps_1[0]['grad_norm']:.8g}")
    assert torch.equal(_masters(zero2, 1), _masters(reference, 1))  # bit for bit
    assert torch.equal(w2, w1) and torch.equal(w1, _masters(reference, 1).to(torch.bfloat16))
    assert 2.0 ** -12 <= rel_defaults <= BF16_EPS  # bf16 sums: off by one bf16 rounding, which fp32 removes
