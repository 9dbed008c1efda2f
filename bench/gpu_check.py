"""GPU proof: the product's own pipeline on one GPU, timed — student sampling and teacher scoring (HF and,
where installed, vLLM), the SAPD training stage with the torch engine and with DeepSpeed ZeRO-2 and
ZeRO-3, for a 0.5B (or 1.5B) Qwen2.5-shaped model built from its config (random weights: no network, no
download; throughput and step time do not depend on the weights' values). Prints a short table and
writes ``gpu_check.json`` and ``gpu_check.md`` into ``--out``.

    python bench/gpu_check.py --out bench/results              # on the GPU machine (~12 min)
    bash bench/gpu_check.sh                                    # the same, installing what is missing
    python bench/gpu_check.py --dry-run --out /tmp/gpu-dry     # CPU, tiny shape: the test suite's check

Each section runs through the library exactly as ``sapd run`` does (``run_pipeline`` over a run root;
the timings are read back from the round manifests and step logs), so what it times is what a user
runs. A section whose dependency is missing (vLLM, DeepSpeed, CUDA) is reported as skipped with the
reason, never silently dropped; a section that fails is reported with its error and never hides the
others. The sections:

* ``hf_torch`` / ``vllm``: two (one) SAPD rounds with HF (vLLM) sampling and scoring, torch engine.
* ``engine_reuse``: new weights loaded into the live HF student engine (as the local pipeline does
  between rounds), timed against a fresh model load; the tokens sampled after it must equal a freshly
  built engine's on the same weights and seed.
* ``vllm_engine_reuse`` (vLLM on a GPU; in the dry run vLLM's CPU build through ``--vllm-python``): the
  same for the vLLM student engine (``VLLMGenerator.load_weights``: vLLM's native weight-update session
  where the installed vLLM has it, which must then be the path taken) against a fresh engine build,
  then ``release()`` (sleep level 2: the freed GiB reported; a generate while asleep must be refused)
  and ``load_weights`` again (wake + reload): the samples must still equal the fresh engine's; last, a
  shard that loads for 3 s against a 0.5 s ``sync_timeout_s`` must end in ``WeightSyncTimeout`` in time.
* ``deepspeed_zero2`` / ``deepspeed_zero3``: DeepSpeed on the torch run's scored round 0 (the run root
  seeded with a copy), so the first-step losses must agree; the table prints the difference. ZeRO-3
  also checks the student the training stage built: every parameter a DeepSpeed-partitioned one
  (``zero.Init``), no whole tensor held, this rank's partitions covering its 1/W share (on one device
  W = 1, so the partition is the whole model: what one device can prove is that the build went
  through ``zero.Init`` and trains to the same loss).
* ``sharded_checkpoint``: the ZeRO-3 run's checkpoint 1 holds its optimizer state as DCP shards (one
  per rank) beside a small ``trainer.pt``; round 1 resumes from it under ZeRO-3, ZeRO-2 (the state
  resharded onto another layout) and the torch engine, ZeRO-2's losses equal to ZeRO-3's.
* ``checkpoint_memory``: ``bench/checkpoint_memory.py`` (1 and 2 ranks, DeepSpeed on the CPU: two ranks
  cannot share one GPU); rank 0's peak while saving or loading must be about 1/2 of the whole state
  with 2 ranks (``--checkpoint-memory-before REV`` adds the code at REV, where the git history is).
* ``pi_old_once``: π_old per round from the step logs (``old_logp_seconds``, ``old_logp_forward_passes``
  of each round's first record): the forward passes must equal the round's micro-batches, and the time
  is set beside one plain no-grad forward over the same sequences and beside the training loop.
* ``rank_placement`` (2 GPUs; the dry run: 2 CPU processes): the train job (``python -m sapd.jobs.train``)
  under ``torchrun --nproc-per-node 2``, DeepSpeed ZeRO-2, on a round of its own: each rank's device at
  the model load (``cuda:LOCAL_RANK``, the process's current device), where its parameters landed, what
  it had allocated on every GPU right after the load (nothing on the other rank's), and its peak memory.
  On one GPU it is skipped, saying so.
* ``vllm_teacher_scoring`` (vLLM on a GPU; the dry run: vLLM's CPU build through ``--vllm-python``):
  ``bench/teacher_scoring.py --backend vllm`` on ALFWorld-shaped groups (P = 264, G = 8, R ≈ 77): the
  teacher's tokens computed per group with each prompt read from vLLM's prefix cache, against the
  prompt recomputed per response and the references G·(P + R) and P + G·R, the time per group, and the
  log-prob difference between the two paths.
* ``bf16_master``: a bf16 run learns like a float32 run (the fp32 master, docs/design/training.md). One round of the
  same scored data at lr 1e-6, trained in float32 and in bf16 (torch engine, and DeepSpeed ZeRO-2 where
  installed) on the device: the bf16 run's fp32 master must move as the float32 run's weights do
  (cosine ≥ 0.98, norm within 5 %), checkpoint 0's master be the student's weights, checkpoint 1's folder
  the master's bf16 rounding, and the round log show the computed update applied; the table also gives
  the share of bf16 weights each run changed (the float32 run's rounded to bf16). Self-contained: its own
  float32 run samples and scores the round.
* ``throughput_mfu``: achieved model FLOP/s of training (6·N per token, N = non-embedding parameters,
  plus the LM head at response positions and causal attention; activation recomputation not counted),
  π_old (one forward), sampling and scoring (one forward, the prompt shared by its group), and their
  fraction of the device's peak dense bf16 FLOP/s (MFU) from a small table by device name or
  ``--peak-tflops``; an unknown device (the CPU of the dry run) gets FLOP/s only, peak "unknown".
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    from sapd.models.loading import DType

REPO = Path(__file__).resolve().parents[1]
SAMPLES = REPO / "sapd" / "sample_data"

# Qwen2.5 shapes (config.json of the released models); the vocabulary is padded to the real size so the
# embedding and the LM head cost what they cost there
SHAPES: dict[str, dict[str, int]] = {
    "0.5b": dict(hidden_size=896, layers=24, heads=14, kv_heads=2, intermediate_size=4864, vocab_size=151936),
    "1.5b": dict(hidden_size=1536, layers=28, heads=12, kv_heads=2, intermediate_size=8960, vocab_size=151936),
    "dry": dict(hidden_size=64, layers=2, heads=4, kv_heads=2, intermediate_size=128, vocab_size=4096),
}


# named sets of sections for ``--only``: ``scale`` is issue #37's GPU proof (the bf16 update against
# float32 on the device, each of 2 training ranks' device and peak memory, the vLLM teacher's tokens and
# time per group), meant to fit one run of at most 10 minutes on one GPU
PRESETS: dict[str, tuple[str, ...]] = {"scale": ("bf16_master", "rank_placement", "vllm_teacher_scoring")}

# proofs of their own, each a script beside this one with its own results file (``--only NAME`` runs it alone):
# one-gpu — `sapd run` of the alfworld starter on auto at Qwen2.5-1.5B/3B shapes, every phase on one GPU
# (bench/one_gpu.py, ≤ 8 min); ranks — the multi-rank training path as far as one GPU shows it (bench/gpu_ranks.py,
# ≤ 5 min)
SCRIPTS: dict[str, str] = {"one-gpu": "one_gpu.py", "ranks": "gpu_ranks.py"}

# the sections a section reads the results of (``--only`` runs them too)
NEEDS: dict[str, tuple[str, ...]] = {
    "deepspeed_zero2": ("hf_torch",), "deepspeed_zero3": ("hf_torch",), "shared_prompt_ab": ("hf_torch",),
    "sharded_checkpoint": ("hf_torch", "deepspeed_zero3"), "pi_old_once": ("hf_torch",),
    "throughput_mfu": ("hf_torch",),
}


def _section(results: dict[str, Any], name: str, fn: Callable[[], dict[str, Any]], log: Callable[[str], None]) -> None:
    t0 = time.perf_counter()
    try:
        out = fn()
        results[name] = {"status": "ok", **out, "seconds": time.perf_counter() - t0}
        log(f"[{name}] ok in {results[name]['seconds']:.1f} s")
    except _Skip as e:
        results[name] = {"status": "skipped", "reason": str(e)}
        log(f"[{name}] skipped: {e}")
    except Exception as e:  # noqa: BLE001 - one broken section must not hide the others
        results[name] = {"status": "failed", "reason": f"{type(e).__name__}: {e}",
                         "traceback": traceback.format_exc(limit=8)}
        log(f"[{name}] FAILED: {type(e).__name__}: {e}")


class _Skip(Exception):
    pass


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _importable(name: str) -> bool:
    import importlib.util
    return importlib.util.find_spec(name) is not None


def build_models(work: Path, shape: dict[str, int], dtype: str) -> tuple[str, str]:
    """A tokenizer trained on the shipped samples, a student and a teacher of ``shape`` (different seeds)."""
    import torch

    from sapd.models.byte_tokenizer import build_tokenizer
    from sapd.models.tiny import build_tiny_model
    texts = [p.read_text(encoding="utf-8") for p in sorted(SAMPLES.iterdir()) if p.suffix in (".json", ".jsonl")]
    tok = build_tokenizer(texts, work / "tokenizer", vocab_size=4096)
    paths = []
    for name, seed in (("student", 0), ("teacher", 1)):
        out = work / name
        if not (out / "config.json").is_file():
            dims: dict[str, Any] = dict(shape)  # ints only: none of them is build_tiny_model's ``arch``
            model = build_tiny_model(tok, out, seed=seed, max_positions=8192, **dims)
            if dtype == "bfloat16":  # store what the runs load: half the bytes to write and read back
                model.to(torch.bfloat16).save_pretrained(str(out))
            del model
        paths.append(str(out))
    return paths[0], paths[1]


def run_config(root: Path, student: str, teacher: str, *, backend: str, engine: str, dry: bool,
               device: str, dtype: str, rounds: int, zero_stage: int = 2,
               checkpointing: bool | None = None, shared_prompt: str = "auto") -> dict[str, Any]:
    G, new = (2, 16) if dry else (8, 128)
    return {
        "run_root": str(root), "variant": "sapd",
        "data": {"input": str(SAMPLES / "alfworld_eto.json"), "format": "eto", "benchmark": "alfworld",
                 "val_fraction": 0.0, "max_prompt_tokens": 4096},
        "model": {"student": student, "teacher": teacher, "device": device, "dtype": dtype},
        "sampling": {"backend": backend, "group_size": G, "max_new_tokens": new, "prompts_per_batch": 8,
                     "gpu_memory_utilization": 0.35},
        "train": {"rounds": rounds, "trajectories_per_round": 3, "minibatch_prefixes": 8,
                  "micro_batch_prefixes": 2 if dry else 4, "lr": 1e-6, "engine": engine, "zero_stage": zero_stage,
                  "gradient_checkpointing": (not dry) if checkpointing is None else checkpointing,
                  "shared_prompt": shared_prompt},
    }


def seed_root(src: Path, root: Path) -> None:
    """Copy a run's prefixes, checkpoint 0 and scored round 0 into ``root``: round 0 trains on them."""
    for part in ("prefixes", "checkpoints/000000", "rounds/000000"):
        (root / part).parent.mkdir(parents=True, exist_ok=True)
        shutil.copytree(src / part, root / part)


def summarize_run(root: str) -> dict[str, Any]:
    """Sampling / scoring throughput from the round manifests, step times from the step logs."""
    from sapd.run.report import read_step_log, round_timings
    rounds = round_timings(root)
    steps = read_step_log(root)
    tokens = sum(r.get("generated_tokens", 0) for r in rounds)
    sample_s = sum(r.get("sample_seconds", 0.0) for r in rounds)
    score_s = sum(r.get("score_seconds", 0.0) for r in rounds)
    step_s = [s["step_seconds"] for s in steps]
    # the first step of a round includes warm-up (allocator, kernels): report the median too
    med = sorted(step_s)[len(step_s) // 2] if step_s else float("nan")
    return {"rounds": len(rounds), "generated_tokens": tokens,
            "sample_tokens_per_s": tokens / sample_s if sample_s else None,
            "score_tokens_per_s": tokens / score_s if score_s else None,
            "optimizer_steps": len(steps), "step_seconds_median": med,
            "step_seconds_mean": sum(step_s) / len(step_s) if step_s else None,
            "first_loss": steps[0]["loss"] if steps else None}


# Peak dense bf16 tensor-core FLOP/s (no sparsity), from the vendors' data sheets, matched against
# torch.cuda.get_device_name() in this order (the first entry whose words all occur wins)
PEAK_BF16_TFLOPS: list[tuple[tuple[str, ...], float]] = [
    (("H200",), 989.0),
    (("H100", "PCIE"), 756.0),
    (("H100",), 989.0),  # SXM (HBM3)
    (("A100",), 312.0),
    (("L40S",), 362.0),
    (("L4",), 121.0),
]


def peak_flops(device_name: str, override_tflops: float | None = None) -> tuple[float | None, str]:
    """The device's peak dense bf16 FLOP/s and where the figure comes from; ``(None, "unknown ...")``
    for a device not in :data:`PEAK_BF16_TFLOPS` (a CPU among them) unless ``override_tflops`` is given."""
    if override_tflops is not None:
        return override_tflops * 1e12, "--peak-tflops"
    name = device_name.upper()
    for words, tflops in PEAK_BF16_TFLOPS:
        if all(w in name for w in words):
            return tflops * 1e12, f"table: {' '.join(words)} {tflops:g} TFLOP/s"
    return None, f"unknown for {device_name!r} (pass --peak-tflops)"


def model_dims(model: Any) -> dict[str, int]:
    """What the FLOP counts need: N (parameters outside the embedding and the LM head, counted once
    where tied), the hidden size, the query width of attention, layers and vocabulary."""
    cfg = model.config
    skip = {id(model.get_input_embeddings().weight)}
    out_emb = model.get_output_embeddings()
    if out_emb is not None:
        skip.add(id(out_emb.weight))
    heads = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    return {"non_embedding_parameters": sum(p.numel() for p in model.parameters() if id(p) not in skip),
            "hidden_size": cfg.hidden_size, "attention_width": heads * head_dim, "layers": cfg.num_hidden_layers,
            "vocab_size": cfg.vocab_size}


def sequence_forward_flops(dims: dict[str, int], prompt: int, response: int) -> float:
    """Model FLOPs of one forward over prompt + response as training and π_old run it (one row per
    response, LM head at the response positions only): 2·N per token, 2·d·V per head position, and
    causal attention (QKᵀ and AV: 4·L·width·context per token, summed over the positions)."""
    S = prompt + response
    attn = 2.0 * dims["layers"] * dims["attention_width"] * S * (S + 1)
    return 2.0 * dims["non_embedding_parameters"] * S + 2.0 * dims["hidden_size"] * dims["vocab_size"] * response + attn


def shared_prefix_forward_flops(dims: dict[str, int], prompt: int, responses: list[int]) -> float:
    """Model FLOPs of sampling or scoring one prefix: the prompt once (its KV cache shared by the group),
    then every response token attending to prompt + its own past, the LM head at every response token."""
    L, w = dims["layers"], dims["attention_width"]
    flops = 2.0 * dims["non_embedding_parameters"] * prompt + 2.0 * L * w * prompt * (prompt + 1)
    for r in responses:
        flops += 2.0 * dims["non_embedding_parameters"] * r + 2.0 * dims["hidden_size"] * dims["vocab_size"] * r
        flops += 4.0 * L * w * (r * prompt + r * (r + 1) / 2)
    return flops


def round_prefixes(root: str, k: int) -> list[tuple[int, list[int]]]:
    """(prompt length, [response lengths]) of every scored prefix of round k."""
    from sapd.data.scored import read_scored, scored_prefixes
    return [(len(sp.prompt), [len(r) for r in sp.responses_G_T]) for sp in scored_prefixes(read_scored(root, k))]


def round_logs(root: str) -> dict[int, list[dict[str, Any]]]:
    """The step records of each round's log ``logs/round-*.jsonl``, by round."""
    from sapd.run.report import read_step_log
    out: dict[int, list[dict[str, Any]]] = {}
    for rec in read_step_log(root):
        out.setdefault(int(rec["round"]), []).append(rec)
    return out


def training_flops(root: str, dims: dict[str, int], peak: float | None) -> dict[str, Any]:
    """Training (forward + backward: 3 forwards' FLOPs per epoch over the round's sequences,
    recomputation by activation checkpointing not counted) and π_old (one forward per round) FLOP/s of
    every round of a run, from its step logs."""
    logs = round_logs(root)
    flops = train_s = old_s = old_flops = tokens = 0.0
    for k, recs in sorted(logs.items()):
        epochs = 1 + max(r["epoch"] for r in recs)
        fwd = 0.0
        for prompt, responses in round_prefixes(root, k):
            fwd += sum(sequence_forward_flops(dims, prompt, r) for r in responses)
            tokens += epochs * sum(prompt + r for r in responses)
        flops += 3.0 * epochs * fwd
        train_s += sum(r["step_seconds"] for r in recs)
        if "old_logp_seconds" in recs[0]:
            old_s += recs[0]["old_logp_seconds"]
            old_flops += fwd
    achieved = flops / train_s if train_s else 0.0
    old_achieved = old_flops / old_s if old_s else 0.0
    return {"train_tokens": tokens, "train_seconds": train_s,
            "train_tokens_per_s": tokens / train_s if train_s else 0.0,
            "train_flops": flops, "train_flops_per_s": achieved,
            "train_mfu": achieved / peak if peak else None,
            "old_logp_flops_per_s": old_achieved, "old_logp_mfu": old_achieved / peak if peak and old_s else None}


def bf16_master_check(work: Path, student: str, teacher: str, *, dry: bool, device: str,
                      checkpointing: bool | None, shared_prompt: str) -> dict[str, Any]:
    """The ``bf16_master`` section: one round of the same scored data trained in float32 and in bf16 at
    lr 1e-6; the bf16 runs' fp32 master update against the float32 run's weight update."""
    import torch

    from sapd import checkpoints
    from sapd.config import config_from_dict
    from sapd.run.local import run_pipeline
    from sapd.run.report import read_step_log
    quiet: dict[str, Any] = dict(log=lambda s: None, show_progress=False)

    def config(root: Path, engine: str, dtype: str, zero_stage: int = 2) -> Any:
        return config_from_dict(run_config(root, student, teacher, backend="hf", engine=engine, dry=dry,
                                           device=device, dtype=dtype, rounds=1, zero_stage=zero_stage,
                                           checkpointing=checkpointing, shared_prompt=shared_prompt))

    def weights(root: Path, k: int, dtype: DType = "float32") -> list[Any]:
        return [p.detach().clone() for p in checkpoints.load_checkpoint_model(str(root), k, dtype).parameters()]

    def masters(root: Path, k: int) -> list[Any]:
        state = checkpoints.consolidated_optimizer_state(str(root), k)
        if state is None or "master" not in state["state"][0]:
            raise RuntimeError(f"{root}: checkpoint {k} holds no fp32 master")
        return [state["state"][i]["master"] for i in range(len(state["state"]))]

    def flat(tensors: list[Any]) -> Any:
        return torch.cat([t.double().reshape(-1) for t in tensors])

    def changed(a: list[Any], b: list[Any]) -> float:
        x, y = flat([t.to(torch.bfloat16) for t in a]), flat([t.to(torch.bfloat16) for t in b])
        return float((x != y).double().mean())

    fp32 = work / "float32"
    run_pipeline(config(fp32, "torch", "float32"), **quiet)
    w0, w1 = weights(fp32, 0), weights(fp32, 1)
    reference = flat(w1) - flat(w0)
    arms = {"torch": ("torch", 2)}
    if _importable("deepspeed"):
        arms["deepspeed_zero2"] = ("deepspeed", 2)
    out: dict[str, Any] = {"lr": 1e-6, "optimizer_steps": len(read_step_log(str(fp32))),
                           "float32_update_norm": float(reference.norm()),
                           "float32_changed_share_bf16": changed(w0, w1), "arms": {},
                           "skipped": [] if "deepspeed_zero2" in arms else ["deepspeed_zero2: DeepSpeed not installed"]}
    for name, (engine, stage) in arms.items():
        root = work / name
        for part in ("prefixes", "rounds/000000"):  # the float32 run's scored round: the same data
            shutil.copytree(fp32 / part, root / part)
        t0 = time.perf_counter()
        run_pipeline(config(root, engine, "bfloat16", stage), **quiet)
        seconds = time.perf_counter() - t0
        m0, m1 = masters(root, 0), masters(root, 1)
        update = flat(m1) - flat(m0)
        folder0, folder1 = weights(root, 0, "bfloat16"), weights(root, 1, "bfloat16")
        last = [r for r in read_step_log(str(root)) if "round_update_rel" in r][-1]
        arm = {"cosine_vs_float32": float(update @ reference / (update.norm() * reference.norm())),
               "norm_vs_float32": float(update.norm() / reference.norm()),
               "master0_is_the_student": all(bool(torch.equal(a, b)) for a, b in zip(m0, w0)),
               "folder_is_master_rounding": all(bool(torch.equal(f, m.to(torch.bfloat16)))
                                                for f, m in zip(folder1, m1)),
               "changed_share_bf16": changed(folder0, folder1),
               "round_update_rel": last["round_update_rel"],
               "round_update_applied_ratio": last["round_update_applied_ratio"], "seconds": seconds}
        out["arms"][name] = arm
        if not (arm["cosine_vs_float32"] >= 0.98 and abs(arm["norm_vs_float32"] - 1) <= 0.05
                and arm["master0_is_the_student"] and arm["folder_is_master_rounding"]
                and arm["round_update_applied_ratio"] > 0.99):
            raise RuntimeError(f"bf16 ({name}) does not learn like float32: {json.dumps(arm)}")
    return out


def vllm_reuse_check(student: str, teacher: str, dtype: DType, *, gpu: bool) -> dict[str, Any]:
    """The vLLM student engine kept across rounds: built on the student, the teacher's weights loaded in
    place (``load_weights``: vLLM's native weight-update session where the installed vLLM has it, else
    ``reload_weights``) against a fresh engine build on them; the samples of both must be equal (same
    weights, same seed). Then ``release()`` (sleep level 2 where sleep mode is on: the weights and KV cache
    freed), a generate refused while asleep, and ``load_weights`` (wake + reload): the samples must still
    equal the fresh engine's. Last, the deadline: a weight update whose shard takes longer than
    ``sync_timeout_s`` must fail with :class:`WeightSyncTimeout` within about that time."""
    import gc

    import torch

    from sapd.models import vllm_backend
    from sapd.models.generation import SamplingParams
    from sapd.models.vllm_backend import VLLMGenerator, WeightSyncTimeout

    kw: dict[str, Any] = {"gpu_memory_utilization": 0.3} if gpu else {"kv_cache_memory_bytes": 128 * 2**20,
                                                                      "max_model_len": 256}

    def build(path: str) -> tuple[VLLMGenerator, float]:
        t0 = time.perf_counter()
        return VLLMGenerator.from_path(path, dtype=dtype, **kw), time.perf_counter() - t0

    def free_gib() -> float:
        return torch.cuda.mem_get_info()[0] / 2**30 if gpu else 0.0

    params = SamplingParams(n=4, temperature=1.0, top_p=1.0, max_new_tokens=64 if gpu else 16, stop=(), seed=0)
    prompts = ["You are in a kitchen. Your task is to: heat some water.", "Find a red mug under 10 dollars.",
               "You are in the middle of a room. Your task is to: put a clean plate in the cabinet."]

    def ids(groups: list[list[Any]]) -> list[list[list[int]]]:
        return [[s.token_ids for s in g] for g in groups]

    live, student_build = build(student)
    before = live.generate(prompts, params)
    t0 = time.perf_counter()
    live.load_weights(teacher)
    in_place = time.perf_counter() - t0
    after = live.generate(prompts, params)
    out: dict[str, Any] = {"student_build_seconds": student_build, "in_place_seconds": in_place,
                           "sleeps": live.sleeps, "weight_sync": live.weight_sync,
                           "native_available": vllm_backend.native_weight_sync_available()}
    free0 = free_gib()
    live.release()
    out["freed_by_release_gib"] = free_gib() - free0
    if live.sleeps:
        try:
            live.generate(prompts, params)
            out["generate_refused_while_asleep"] = False
        except RuntimeError:
            out["generate_refused_while_asleep"] = True
    t0 = time.perf_counter()
    live.load_weights(teacher)  # wakes the engine, then reloads
    out["wake_reload_seconds"] = time.perf_counter() - t0
    woken = live.generate(prompts, params)
    out["deadline_error"], out["deadline_seconds"] = None, None
    if live.weight_sync == "native":  # the probe hangs sapd's transfer engine, which only that path uses
        # the deadline: an engine whose every shard takes 3 s to load (bench/slow_weight_sync.py, in the engine's
        # own process) against a 0.5 s deadline
        del live
        gc.collect()
        if gpu:
            torch.cuda.empty_cache()
        slow = VLLMGenerator.from_path(student, dtype=dtype, sync_timeout_s=0.5,
                                       worker_extension_cls="bench.slow_weight_sync.SlowShardExtension", **kw)
        t0 = time.perf_counter()
        try:
            slow.load_weights(teacher)
        except WeightSyncTimeout as e:
            out["deadline_error"] = str(e)
        out["deadline_seconds"] = time.perf_counter() - t0
        try:
            slow.generate(prompts, params)
            out["refused_after_timeout"] = False
        except RuntimeError:
            out["refused_after_timeout"] = True
        live = slow
    del live  # the fresh engine is built alone on the device, as a per-round rebuild would be
    gc.collect()
    if gpu:
        torch.cuda.empty_cache()
    fresh, out["rebuild_seconds"] = build(teacher)
    ref = fresh.generate(prompts, params)
    del fresh
    gc.collect()
    if gpu:
        torch.cuda.empty_cache()
    out.update(differs_before_update=ids(before) != ids(after), tokens_match_fresh=ids(after) == ids(ref),
               tokens_match_after_release=ids(woken) == ids(ref),
               deadline_kept=None if out["deadline_seconds"] is None
               else out["deadline_error"] is not None and out["deadline_seconds"] < 2.5
               and out["refused_after_timeout"],
               max_logprob_diff=max(abs(x - y) for ga, gb in zip(after, ref) for sa, sb in zip(ga, gb)
                                    for x, y in zip(sa.logprobs, sb.logprobs)) if ids(after) == ids(ref) else None)
    bad = [k for k in ("differs_before_update", "tokens_match_fresh", "tokens_match_after_release",
                       "generate_refused_while_asleep", "deadline_kept") if out.get(k) is False]
    if out["native_available"] and out["weight_sync"] != "native":
        bad.append("weight_sync (native expected)")
    if bad:
        raise RuntimeError(f"vLLM engine reuse: {', '.join(bad)} is False ({json.dumps(out, default=str)})")
    return out


def _vllm_reuse_only(work: str, target: str) -> int:
    """``--vllm-reuse-only WORK OUT``: :func:`vllm_reuse_check` on vLLM's CPU build, on two models of its
    own (head_dim 32, which its CPU attention needs), result to ``OUT`` as JSON."""
    from sapd.models.byte_tokenizer import build_tokenizer
    from sapd.models.tiny import build_tiny_model
    root = Path(work)
    texts = [p.read_text(encoding="utf-8") for p in sorted(SAMPLES.iterdir()) if p.suffix in (".json", ".jsonl")]
    tok = build_tokenizer(texts, root / "tokenizer", vocab_size=4096)
    for name, seed in (("student", 0), ("teacher", 1)):
        build_tiny_model(tok, root / name, hidden_size=128, heads=4, kv_heads=2, intermediate_size=256, layers=2,
                         seed=seed, max_positions=256)
    result = vllm_reuse_check(str(root / "student"), str(root / "teacher"), "float32", gpu=False)
    Path(target).write_text(json.dumps(result, default=str))
    return 0


def _rank_worker(config: str, out: str) -> int:
    """``--rank-worker CONFIG OUT`` (one torchrun rank of ``rank_placement``): the train job's door on round 0,
    observing the student's load — the device the stage passes, the current CUDA device, where the
    parameters landed, this process's allocations on every GPU right after — and the rank's peak memory.
    Writes ``OUT.rank<R>.json``."""
    import resource

    import torch

    from sapd import checkpoints
    rec: dict[str, Any] = {"rank": int(os.environ["RANK"]), "local_rank": int(os.environ["LOCAL_RANK"])}
    load = checkpoints.load_checkpoint_model

    def observed(root: str, k: int, dtype: Any = "float32", device: str = "cpu", trainable: bool = False) -> Any:
        if "load_device" not in rec:  # the trained student (checkpoint 0 for a KL term would come later)
            rec["load_device"] = str(device)
            if torch.cuda.is_available():
                rec["current_device_at_load"] = torch.cuda.current_device()
        model = load(root, k, dtype, device, trainable)
        if "params_device" not in rec:
            rec["params_device"] = str(next(model.parameters()).device)
            if torch.cuda.is_available():
                rec["allocated_after_load_by_gpu"] = [torch.cuda.memory_allocated(i)
                                                      for i in range(torch.cuda.device_count())]
        return model

    checkpoints.load_checkpoint_model = observed  # observes only: the model it returns is the stage's own
    from sapd.jobs.train import main as train_main
    rec["rc"] = train_main(["--config", config, "--round", "0", "--no-progress"])
    if torch.cuda.is_available():
        rec["peak_allocated_bytes"] = torch.cuda.max_memory_allocated()
        rec["peak_reserved_bytes"] = torch.cuda.max_memory_reserved()
    else:
        rec["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    Path(f"{out}.rank{rec['rank']}.json").write_text(json.dumps(rec))
    return int(rec["rc"])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny shape, short responses: checks the script")
    ap.add_argument("--size", choices=["0.5b", "1.5b"], default="0.5b")
    ap.add_argument("--out", default="bench/results", help="where gpu_check.json / gpu_check.md go")
    ap.add_argument("--work", default=None, help="scratch folder (default: OUT/gpu-check-work, removed after)")
    ap.add_argument("--keep", action="store_true", help="keep the scratch folder")
    ap.add_argument("--gradient-checkpointing", action=argparse.BooleanOptionalAction, default=None,
                    help="training with gradient checkpointing (default: on for the GPU run, off for the dry "
                         "run); the KV cache is off under it, so train.shared_prompt has no effect")
    ap.add_argument("--shared-prompt", choices=["auto", "on", "off"], default="auto",
                    help="train.shared_prompt of every run (auto: off on a GPU)")
    ap.add_argument("--vllm-python", default=os.environ.get("SAPD_VLLM_PYTHON"),
                    help="an interpreter with vLLM (its CPU build) for the vLLM engine-reuse check where this one "
                         "has none (the dry run; default $SAPD_VLLM_PYTHON)")
    ap.add_argument("--only", default=None, metavar="SECTIONS",
                    help="comma-separated sections to run, with the ones they need (e.g. sharded_checkpoint,"
                         "checkpoint_memory,vllm_engine_reuse: the checks of sharded checkpoints, checkpoint "
                         "memory and in-place weight sync), or a preset: scale = "
                         + ",".join(PRESETS["scale"]) + " (the bf16, rank and vLLM-teacher proofs, ~10 min); "
                         "or alone: one-gpu (bench/one_gpu.py: sapd run on one GPU, ≤ 8 min), ranks "
                         "(bench/gpu_ranks.py: the multi-rank path on one GPU, ≤ 5 min)")
    ap.add_argument("--checkpoint-memory-before", metavar="REV", default=None,
                    help="checkpoint_memory also measures the code at git revision REV (needs the git history)")
    ap.add_argument("--vllm-reuse-only", nargs=2, metavar=("WORK", "OUT"), help=argparse.SUPPRESS)
    ap.add_argument("--rank-worker", nargs=2, metavar=("CONFIG", "OUT"), help=argparse.SUPPRESS)
    ap.add_argument("--peak-tflops", type=float, default=None,
                    help="the device's peak dense bf16 TFLOP/s for MFU (default: a small table by device name)")
    args = ap.parse_args(argv)
    if args.vllm_reuse_only:
        return _vllm_reuse_only(*args.vllm_reuse_only)
    if args.rank_worker:
        return _rank_worker(*args.rank_worker)
    if args.only in SCRIPTS:
        return subprocess.call([sys.executable, str(REPO / "bench" / SCRIPTS[args.only]), "--out", args.out,
                                *(["--dry-run"] if args.dry_run else [])], cwd=REPO)

    import torch

    from sapd import checkpoints
    from sapd.config import config_from_dict
    from sapd.run.local import run_pipeline

    def log(s: str) -> None:
        print(s, flush=True)

    dry = args.dry_run
    cuda = torch.cuda.is_available()
    if not dry and not cuda:
        log("no CUDA device: run with --dry-run for the CPU check")
        return 2
    device = "cpu" if dry else "cuda"
    dtype: DType = "float32" if dry else "bfloat16"
    shape = SHAPES["dry" if dry else args.size]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(args.work) if args.work else out / "gpu-check-work"
    if work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True)
    if dry:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    ckpt = args.gradient_checkpointing
    results: dict[str, Any] = {
        "mode": ("dry-run (CPU)" if dry else f"GPU, Qwen2.5-{args.size} shape")
        + ("" if ckpt is None else f", gradient checkpointing {'on' if ckpt else 'off'}")
        + ("" if args.shared_prompt == "auto" else f", train.shared_prompt {args.shared_prompt}")
        + (f", only {args.only}" if args.only else ""),
        "device": torch.cuda.get_device_name(0) if cuda and not dry else platform.processor() or "cpu",
        "torch": torch.__version__, "shape": shape, "dtype": dtype,
    }
    quiet: dict[str, Any] = dict(log=lambda s: None, show_progress=False)
    t_all = time.perf_counter()
    paths: dict[str, str] = {}
    dims: dict[str, int] = {}
    # the run roots of the training sections, for the π_old and FLOP/s read-backs
    roots = {"hf_torch": work / "hf-torch", "vllm": work / "vllm-torch",
             "deepspeed_zero2": work / "hf-deepspeed", "deepspeed_zero3": work / "hf-deepspeed-zero3"}
    micro = run_config(work, "", "", backend="hf", engine="torch", dry=dry, device=device, dtype=dtype,
                                          checkpointing=ckpt, shared_prompt=args.shared_prompt,
                       rounds=1)["train"]["micro_batch_prefixes"]

    def done(name: str) -> bool:
        return isinstance(results.get(name), dict) and results[name].get("status") == "ok"

    def models() -> dict[str, Any]:
        paths["student"], paths["teacher"] = build_models(work, shape, dtype)
        from sapd.models.loading import load_causal_lm
        model = load_causal_lm(paths["student"], dtype=dtype)
        n = sum(p.numel() for p in model.parameters())
        results["parameters"] = n
        dims.update(model_dims(model))
        return {"parameters": n, **dims}

    def hf_torch() -> dict[str, Any]:
        cfg = config_from_dict(run_config(roots["hf_torch"], paths["student"], paths["teacher"], backend="hf",
                                          engine="torch", dry=dry, device=device, dtype=dtype,
                                          checkpointing=ckpt, shared_prompt=args.shared_prompt, rounds=2))
        run_pipeline(cfg, **quiet)
        return summarize_run(cfg.run_root)

    def engine_reuse() -> dict[str, Any]:
        """The student engine kept across rounds: new weights loaded in place (the teacher checkpoint has
        the student's shape) against a fresh model load, and the tokens sampled after it against a
        freshly built engine's on the same weights and seed."""
        from sapd.models.generation import HFGenerator, SamplingParams
        from sapd.models.loading import load_causal_lm, load_tokenizer
        tok = load_tokenizer(paths["student"])
        live = HFGenerator(load_causal_lm(paths["student"], dtype=dtype, device=device), tok, device=device)
        t0 = time.perf_counter()
        live.load_weights(paths["teacher"])
        in_place = time.perf_counter() - t0
        t0 = time.perf_counter()
        fresh = HFGenerator(load_causal_lm(paths["teacher"], dtype=dtype, device=device), tok, device=device)
        rebuild = time.perf_counter() - t0
        params = SamplingParams(n=2, temperature=1.0, top_p=1.0, max_new_tokens=8, stop=(), seed=0)
        prompts = ["You are in a kitchen. Your task is to: heat some water.", "Find a red mug under 10 dollars."]
        a, b = live.generate(prompts, params), fresh.generate(prompts, params)
        same = [[s.token_ids for s in g] for g in a] == [[s.token_ids for s in g] for g in b]
        if not same:
            raise RuntimeError("tokens sampled after the in-place update differ from a fresh engine's")
        return {"in_place_seconds": in_place, "rebuild_seconds": rebuild, "tokens_match_fresh": same}

    def vllm_sampling() -> dict[str, Any]:
        if dry or not _importable("vllm"):
            raise _Skip("vLLM is not installed here" if not _importable("vllm") else "dry run (CPU): HF only")
        cfg = config_from_dict(run_config(roots["vllm"], paths["student"], paths["teacher"], backend="vllm",
                                          engine="torch", dry=dry, device=device, dtype=dtype,
                                          checkpointing=ckpt, shared_prompt=args.shared_prompt, rounds=1))
        run_pipeline(cfg, **quiet)
        return summarize_run(cfg.run_root)

    def deepspeed_run(stage: int) -> dict[str, Any]:
        if not _importable("deepspeed"):
            raise _Skip("DeepSpeed is not installed here (pip install deepspeed)")
        src = roots["hf_torch"]
        if not checkpoints.is_committed(str(src), 1):
            raise _Skip("the hf-torch section did not finish: nothing to compare against")
        root = roots[f"deepspeed_zero{stage}"]
        seed_root(src, root)  # the torch run's inputs: the first losses must agree
        cfg = config_from_dict(run_config(root, paths["student"], paths["teacher"], backend="hf", engine="deepspeed",
                                          dry=dry, device=device, dtype=dtype,
                                          checkpointing=ckpt, shared_prompt=args.shared_prompt, rounds=1,
                                          zero_stage=stage))
        run_pipeline(cfg, **quiet)
        got = summarize_run(str(root))
        for key in ("generated_tokens", "sample_tokens_per_s", "score_tokens_per_s"):
            got.pop(key)  # round 0 was sampled and scored by the torch section, not here
        ref = json.loads((src / "logs" / "round-000000.jsonl").read_text().splitlines()[0])
        got["first_loss_vs_torch"] = abs(got["first_loss"] - ref["loss"])
        return got

    def deepspeed_zero2() -> dict[str, Any]:
        return deepspeed_run(2)

    def shared_prompt_ab() -> dict[str, Any]:
        """One training round (torch engine, gradient checkpointing off) of the hf_torch run's committed
        round 0, with ``train.shared_prompt`` off (G full sequences in one batch) and on (each prompt
        once), alternated twice; each side's best training loop (π_old + optimizer steps)."""
        from sapd.run.report import read_step_log
        src = roots["hf_torch"]
        if not checkpoints.is_committed(str(src), 1):
            raise _Skip("the hf-torch section did not finish: nothing to train on")
        best: dict[str, float] = {}
        first_loss: dict[str, float] = {}
        for rep in range(2):
            for mode in ("off", "on"):
                root = work / f"shared-prompt-{mode}-{rep}"
                seed_root(src, root)
                cfg = config_from_dict(run_config(root, paths["student"], paths["teacher"], backend="hf",
                                                  engine="torch", dry=dry, device=device, dtype=dtype,
                                                  checkpointing=False, shared_prompt=mode, rounds=1))
                run_pipeline(cfg, **quiet)
                steps = read_step_log(str(root))
                loop = sum(x.get("step_seconds", 0.0) + x.get("old_logp_seconds", 0.0) for x in steps)
                best[mode] = min(best.get(mode, float("inf")), loop)
                first_loss[mode] = steps[0]["loss"]
                shutil.rmtree(root, ignore_errors=True)
        return {"off_loop_seconds": best["off"], "on_loop_seconds": best["on"],
                "on_vs_off": best["on"] / best["off"], "first_loss_delta": abs(first_loss["on"] - first_loss["off"])}

    def deepspeed_zero3() -> dict[str, Any]:
        """ZeRO-3 on the same scored round, and what the training stage's ``load_partitioned`` returned:
        the student as built under ``zero.Init``, before ``deepspeed.initialize`` saw it (which would
        otherwise partition a whole model itself). Every parameter must be a DeepSpeed-partitioned one
        (``ds_id``), hold no whole tensor (``.data`` empty: the values live in ``ds_tensor``), and the
        partitions of the W ranks must cover the model (on one device, W = 1: the one partition is it)."""
        from sapd.stages import train as train_stage
        built: dict[str, Any] = {}
        original = train_stage.load_partitioned

        def observed(path: str, cfg: Any) -> Any:
            model = original(path, cfg)
            ps = list(model.parameters())
            built.update(
                world_size=torch.distributed.get_world_size(), parameter_tensors=len(ps),
                ds_parameter_tensors=sum(hasattr(p, "ds_id") for p in ps),
                local_numel=sum(p.data.numel() for p in ps),
                partition_numel=sum(p.ds_tensor.numel() for p in ps if hasattr(p, "ds_tensor")),
                full_numel=sum(p.ds_numel for p in ps if hasattr(p, "ds_numel")))
            return model

        train_stage.load_partitioned = observed  # observes only: the model it returns is the stage's own
        try:
            got = deepspeed_run(3)
        finally:
            train_stage.load_partitioned = original
        if not built:
            raise RuntimeError("the ZeRO-3 training stage did not build its student through load_partitioned")
        W, n = built["world_size"], built["parameter_tensors"]
        problems = []
        if built["ds_parameter_tensors"] != n:
            problems.append(f"{n - built['ds_parameter_tensors']} of {n} parameters are not DeepSpeed-partitioned")
        if built["local_numel"] != 0:
            problems.append(f"{built['local_numel']} elements held as whole tensors outside the partitions")
        if built["full_numel"] != results["parameters"]:
            problems.append(f"partitioned parameters describe {built['full_numel']} elements, "
                            f"the model has {results['parameters']}")
        if not built["full_numel"] <= built["partition_numel"] * W <= built["full_numel"] + W * n:
            problems.append(f"partition of {built['partition_numel']} elements × {W} ranks does not cover "
                            f"{built['full_numel']} (plus at most one pad element per tensor and rank)")
        if problems:
            raise RuntimeError("ZeRO-3 student not built partitioned: " + "; ".join(problems))
        built["partition_fraction"] = built["partition_numel"] / built["full_numel"]
        return {**got, "partitioned_init": built}

    def sharded_checkpoint() -> dict[str, Any]:
        """Sharded optimizer checkpoints on this machine: the ZeRO-3 run's checkpoint 1 holds its optimizer
        state as one DCP shard per rank beside a small ``trainer.pt``, and round 1 resumes from it under
        ZeRO-3 itself, under ZeRO-2 (the state resharded from ZeRO-3's per-parameter partitions onto
        ZeRO-2's flat partition) and under the torch engine; ZeRO-2's round-1 losses must equal ZeRO-3's
        (≤ 1e-6 on the CPU in fp32, ≤ 1e-2 relative in bf16 on a GPU); the torch engine's are reported
        (in bf16 it keeps no fp32 master weights, so it drifts by design)."""
        from sapd import storage
        from sapd.run.report import read_step_log
        src, scored = roots["deepspeed_zero3"], roots["hf_torch"]
        if not (done("deepspeed_zero3") and checkpoints.is_committed(str(scored), 2)):
            raise _Skip("the ZeRO-3 and hf-torch sections did not finish: nothing to resume")
        files = sorted(f.rsplit("/", 1)[1] for f in storage.list_files(checkpoints.optimizer_dir(str(src), 1)))
        trainer_pt = (src / "checkpoints" / "000001" / "state" / "trainer.pt").stat().st_size
        whole = 8 * results["parameters"]  # exp_avg + exp_avg_sq, fp32
        shard_bytes = sum((src / "checkpoints" / "000001" / "state" / "optimizer" / f).stat().st_size
                          for f in files if f.endswith(".distcp"))
        if ".metadata" not in files or not any(f.endswith(".distcp") for f in files):
            raise RuntimeError(f"checkpoint 1 of the ZeRO-3 run has no sharded optimizer state: {files}")
        losses: dict[str, list[float]] = {}
        for name, engine, stage in (("zero3", "deepspeed", 3), ("zero2", "deepspeed", 2), ("torch", "torch", 2)):
            root = work / f"resume-{name}"
            for part in ("prefixes", "checkpoints/000000", "checkpoints/000001", "rounds/000000"):
                shutil.copytree(src / part, root / part)
            shutil.copytree(scored / "rounds" / "000001", root / "rounds" / "000001")  # round 1's scored data
            cfg = config_from_dict(run_config(root, paths["student"], paths["teacher"], backend="hf", engine=engine,
                                              dry=dry, device=device, dtype=dtype, checkpointing=ckpt,
                                              shared_prompt=args.shared_prompt, rounds=2, zero_stage=stage))
            run_pipeline(cfg, **quiet)
            losses[name] = [r["loss"] for r in read_step_log(str(root)) if r["round"] == 1]
            shutil.rmtree(root, ignore_errors=True)
        ref = losses["zero3"]

        def diff(name: str) -> float:
            return max(abs(a - b) / (1.0 if dry else max(abs(b), 1e-6)) for a, b in zip(losses[name], ref))

        out = {"optimizer_files": files, "trainer_pt_bytes": trainer_pt, "optimizer_shard_bytes": shard_bytes,
               "whole_state_bytes": whole, "round1_losses": losses, "zero2_vs_zero3": diff("zero2"),
               "torch_vs_zero3": diff("torch"), "tolerance": 1e-6 if dry else 1e-2,
               "diff_is": "absolute" if dry else "relative"}
        if not ref or len(losses["zero2"]) != len(ref) or out["zero2_vs_zero3"] > out["tolerance"]:
            raise RuntimeError(f"ZeRO-3 → ZeRO-2 resume: round-1 losses differ ({json.dumps(out, default=str)})")
        return out

    def checkpoint_memory() -> dict[str, Any]:
        """``bench/checkpoint_memory.py``: the peak host memory a rank adds while saving and loading a
        checkpoint, 1 and 2 ranks (DeepSpeed ZeRO-2 on the CPU, gloo: two ranks cannot share one GPU),
        as a multiple of the whole optimizer state; rank 0's must be about 1/W (≤ 0.75 with 2 ranks, at
        the 110m shape; the dry run's tiny shape only checks the script). ``--checkpoint-memory-before
        REV`` measures the code at REV too (needs the git history)."""
        if not _importable("deepspeed"):
            raise _Skip("DeepSpeed is not installed here (pip install deepspeed)")
        target = work / "checkpoint-memory"
        cmd = [sys.executable, str(REPO / "bench" / "checkpoint_memory.py"), "--shape", "tiny" if dry else "110m",
               "--ranks", "1", "2", "--out", str(target)]
        if args.checkpoint_memory_before:
            cmd += ["--before", args.checkpoint_memory_before]
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=1800)
        if proc.returncode != 0:
            raise RuntimeError(f"bench/checkpoint_memory.py failed: {(proc.stdout + proc.stderr)[-1500:]}")
        data = json.loads((target / "checkpoint_memory.json").read_text())
        last = [line for line in proc.stdout.splitlines() if line.startswith("checkpoint memory:")][-1]
        by_code = {}
        for code, by_w in data["results"].items():
            by_code[code] = {w: {"rank0_save": rows[0]["save_peak_bytes"] / rows[0]["whole_state_bytes"],
                                 "rank0_load": rows[0]["load_peak_bytes"] / rows[0]["whole_state_bytes"]}
                             for w, rows in by_w.items()}
        after = by_code[list(by_code)[-1]]["2"]
        out = {"shape": data["shape"], "by_code": by_code, "last_line": last,
               "rank0_peak_2_ranks": max(after["rank0_save"], after["rank0_load"]),
               "table": (target / "checkpoint_memory.txt").read_text()}
        if not dry and out["rank0_peak_2_ranks"] > 0.75:
            raise RuntimeError(f"rank 0 holds {out['rank0_peak_2_ranks']:.2f} of the whole state with 2 ranks; "
                               "about 1/2 expected")
        return out

    def pi_old_once() -> dict[str, Any]:
        """π_old is computed once per round: each run's step log says how long it took and how many
        forward passes rank 0 made; the passes must equal the round's micro-batches (each forwarded
        once), and the time is set beside one plain no-grad forward over the same sequences (the same
        checkpoint and micro-batches; after a warm-up pass, the best of two) and beside the training loop."""
        from sapd.data.scored import read_scored, scored_prefixes
        from sapd.models.loading import load_tokenizer
        from sapd.models.scoring import response_logprobs
        if not done("hf_torch"):
            raise _Skip("the hf-torch section did not finish: no step logs")
        pad = load_tokenizer(paths["student"]).pad_token_id

        def sync() -> None:
            if device == "cuda":
                torch.cuda.synchronize()

        plain: dict[int, float] = {}
        src = str(roots["hf_torch"])
        for k in sorted(round_logs(src)):
            prefixes = scored_prefixes(read_scored(src, k))
            model = checkpoints.load_checkpoint_model(src, k, dtype, device, trainable=True)
            model.eval()
            chunks = [prefixes[s:s + micro] for s in range(0, len(prefixes), micro)]
            with torch.no_grad():
                for rep in range(3):  # a warm-up pass, then the best of two timed ones
                    sync()
                    t0 = time.perf_counter()
                    for chunk in chunks:
                        response_logprobs(model, [sp.prompt for sp in chunk for _ in sp.responses_G_T],
                                          [r for sp in chunk for r in sp.responses_G_T], pad)
                    sync()
                    if rep:
                        plain[k] = min(plain.get(k, float("inf")), time.perf_counter() - t0)
            del model
        runs: dict[str, list[dict[str, Any]]] = {}
        for name in ("hf_torch", "deepspeed_zero2", "deepspeed_zero3"):
            if not done(name):
                continue
            rows = []
            for k, recs in sorted(round_logs(str(roots[name])).items()):
                first, n_prefixes = recs[0], len(round_prefixes(str(roots[name]), k))
                expected = -(-n_prefixes // micro)
                if first.get("old_logp_forward_passes") != expected:
                    raise RuntimeError(f"{name} round {k}: π_old took {first.get('old_logp_forward_passes')} "
                                       f"forward passes for {expected} micro-batches")
                loop = sum(r["step_seconds"] for r in recs)
                old = first["old_logp_seconds"]
                rows.append({"round": k, "prefixes": n_prefixes, "micro_batches": expected,
                             "forward_passes": first["old_logp_forward_passes"], "old_logp_seconds": old,
                             "plain_forward_seconds": plain.get(k),
                             "old_vs_plain_forward": old / plain[k] if plain.get(k) else None,
                             "training_loop_seconds": loop, "old_vs_training_loop": old / loop if loop else None})
            runs[name] = rows
        return {"micro_batch_prefixes": micro, "runs": runs}

    def throughput_mfu() -> dict[str, Any]:
        """Achieved model FLOP/s and their fraction of the device's peak dense bf16 FLOP/s: training
        (6·N per token plus the LM head at response positions and attention), π_old (one forward), and
        the sampling and scoring stages (a forward with the prompt shared by its group)."""
        from sapd.run.report import round_timings
        if not dims:
            raise _Skip("no model dimensions (the models section failed)")
        peak, source = peak_flops(results["device"], args.peak_tflops)
        N = dims["non_embedding_parameters"]
        out: dict[str, Any] = {"peak_flops_per_s": peak, "peak_source": source, "non_embedding_parameters": N,
                               "train_flops_per_token_dense": 6 * N, "forward_flops_per_token_dense": 2 * N}
        for name in ("hf_torch", "deepspeed_zero2", "deepspeed_zero3", "vllm"):
            if not done(name):
                continue
            root = str(roots[name])
            r = training_flops(root, dims, peak)
            fwd = tokens = sample_s = score_s = 0.0
            # the DeepSpeed runs train on a round the torch run sampled and scored (its manifest copied)
            for t in round_timings(root) if not name.startswith("deepspeed") else []:
                shapes = round_prefixes(root, t["round"])
                fwd += sum(shared_prefix_forward_flops(dims, p, rs) for p, rs in shapes)
                tokens += sum(sum(rs) for _, rs in shapes)
                sample_s += t["sample_seconds"]
                score_s += t.get("score_seconds", 0.0)
            if sample_s and score_s:
                r.update(sampled_tokens=tokens, sample_flops_per_s=fwd / sample_s, score_flops_per_s=fwd / score_s,
                         sample_mfu=fwd / sample_s / peak if peak else None,
                         score_mfu=fwd / score_s / peak if peak else None)
            out[name] = r
        if not any(isinstance(v, dict) for v in out.values()):
            raise _Skip("no training section finished")
        return out

    def bf16_master() -> dict[str, Any]:
        return bf16_master_check(work / "bf16-master", paths["student"], paths["teacher"], dry=dry, device=device,
                                 checkpointing=ckpt, shared_prompt=args.shared_prompt)

    def vllm_engine_reuse() -> dict[str, Any]:
        """The vLLM student engine kept across rounds (:func:`vllm_reuse_check`): here where vLLM imports
        (the GPU image), else — the dry run — in the interpreter ``--vllm-python`` names (vLLM's CPU build
        in its own environment), on models of its own."""
        if _importable("vllm") and not dry:
            return vllm_reuse_check(paths["student"], paths["teacher"], dtype, gpu=True)
        if not args.vllm_python:
            raise _Skip("vLLM is not installed here" + ("" if not dry else " (pass --vllm-python for the CPU build)"))
        target = work / "vllm-reuse.json"
        env = {**os.environ, "PYTHONPATH": str(REPO),
               "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1"}
        proc = subprocess.run([args.vllm_python, str(Path(__file__).resolve()), "--vllm-reuse-only", str(work / "vllm"),
                               str(target)], cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
        if proc.returncode != 0:
            raise RuntimeError(f"{args.vllm_python}: the vLLM reuse check failed: "
                               f"{(proc.stdout + proc.stderr)[-1500:]}")
        return json.loads(target.read_text())

    def rank_placement() -> dict[str, Any]:
        """Two training processes (torchrun, the train job's door, DeepSpeed ZeRO-2) on a round sampled and
        scored here: each rank must load the student onto cuda:LOCAL_RANK (its current device at the
        load) and allocate nothing on the other rank's GPU; each one's device and peak memory reported.
        The dry run: 2 CPU processes (gloo), devices "cpu"."""
        from sapd import storage
        from sapd.config import dump_config
        from sapd.models.loading import load_tokenizer
        from sapd.stages import teacher_scores
        from sapd.stages.build_prefixes import ensure_initial_checkpoint, ensure_prefixes
        if not _importable("deepspeed"):
            raise _Skip("DeepSpeed is not installed here (pip install deepspeed)")
        if not dry and torch.cuda.device_count() < 2:
            raise _Skip(f"needs 2 GPUs (this machine has {torch.cuda.device_count()}); run it on a 2-GPU machine")
        root = work / "rank-placement"
        raw = run_config(root, paths["student"], paths["teacher"], backend="hf", engine="deepspeed", dry=dry,
                         device=device, dtype=dtype, rounds=1, zero_stage=2, checkpointing=ckpt)
        raw["train"].update(trajectories_per_round=1, minibatch_prefixes=4, micro_batch_prefixes=1)
        raw["sampling"]["max_new_tokens"] = 16 if dry else 64
        cfg = config_from_dict(raw)
        tok = load_tokenizer(paths["student"])
        ensure_prefixes(cfg, tok, **quiet)
        ensure_initial_checkpoint(cfg, lambda s: None)
        teacher_scores.run_worker(cfg, 0, 0, teacher_scores.student_generator(cfg, 0, tok),
                                  teacher_scores.teacher_scorer(cfg, tok), tok, **quiet)
        config = work / "rank-placement.yaml"
        config.write_text(dump_config(cfg))
        out = work / "rank-placement"
        port = str(_free_port())
        env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE",
               **({"DS_ACCELERATOR": "cpu"} if dry else {})}
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
               "--master-port", port, str(Path(__file__).resolve()), "--rank-worker", str(config), str(out)]
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
        seconds = time.perf_counter() - t0
        if proc.returncode != 0:
            raise RuntimeError(f"torchrun of the train job failed: {(proc.stdout + proc.stderr)[-2000:]}")
        ranks = [json.loads(Path(f"{out}.rank{r}.json").read_text()) for r in (0, 1)]
        problems = []
        for r in ranks:
            want = "cpu" if dry else f"cuda:{r['local_rank']}"
            if r["load_device"] != want or r["params_device"] != want:
                problems.append(f"rank {r['rank']} loaded onto {r['load_device']} (parameters on "
                                f"{r['params_device']}), not {want}")
            if not dry:
                if r.get("current_device_at_load") != r["local_rank"]:
                    problems.append(f"rank {r['rank']}: current CUDA device {r.get('current_device_at_load')} "
                                    "at the load")
                elsewhere = [i for i, b in enumerate(r["allocated_after_load_by_gpu"]) if i != r["local_rank"] and b]
                if elsewhere:
                    problems.append(f"rank {r['rank']} allocated memory on GPU {elsewhere} at the load")
        if not checkpoints.is_committed(str(root), 1) or not storage.exists(str(root / "logs" / "round-000000.jsonl")):
            problems.append("checkpoint 1 was not committed")
        if problems:
            raise RuntimeError("rank placement: " + "; ".join(problems))
        return {"world_size": 2, "ranks": ranks, "torchrun_seconds": seconds}

    def vllm_teacher_scoring() -> dict[str, Any]:
        """The teacher's vLLM scoring (``bench/teacher_scoring.py --backend vllm``): tokens computed and time
        per group, each prompt read from the prefix cache against recomputed per response; here where vLLM
        imports (the GPU image: on the run's teacher, in its dtype), else — the dry run — in the interpreter
        ``--vllm-python`` names, on a model of its own. In a subprocess of its own: its GPU memory is
        returned when it ends."""
        if _importable("vllm") and not dry:
            python, model = sys.executable, ["--model", paths["teacher"], "--dtype", dtype]
        elif args.vllm_python:
            python, model = args.vllm_python, []
        else:
            raise _Skip("vLLM is not installed here" + ("" if not dry else " (pass --vllm-python for the CPU build)"))
        target = work / "vllm-teacher-scoring.json"
        shape = ["--prompt-tokens", "264", "--response-tokens", "77", "--group", "8",
                 "--groups", "4" if dry else "32", "--repeats", "2"]
        env = {**os.environ, "PYTHONPATH": str(REPO),
               "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1"}
        proc = subprocess.run([python, str(REPO / "bench" / "teacher_scoring.py"), "--backend", "vllm", *model, *shape,
                               "--json", str(target)], cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
        if proc.returncode != 0:
            raise RuntimeError(f"bench/teacher_scoring.py --backend vllm failed: {(proc.stdout + proc.stderr)[-1500:]}")
        out = json.loads(target.read_text())
        tolerance = 1e-4 if out["dtype"] == "float32" else 5e-2
        if not (out["shared_computed_tokens_per_group"] < out["naive_computed_tokens_per_group"]
                and out["max_abs_logprob_diff"] <= tolerance):
            raise RuntimeError(f"vLLM teacher scoring: {json.dumps(out)}")
        return {**out, "tolerance": tolerance}

    sections: list[tuple[str, Callable[[], dict[str, Any]]]] = [
        ("hf_torch", hf_torch), ("engine_reuse", engine_reuse), ("vllm", vllm_sampling),
        # before DeepSpeed sets this process's torch.distributed variables, which vLLM's workers would inherit
        ("vllm_engine_reuse", vllm_engine_reuse), ("vllm_teacher_scoring", vllm_teacher_scoring),
        ("shared_prompt_ab", shared_prompt_ab),
        ("deepspeed_zero2", deepspeed_zero2), ("deepspeed_zero3", deepspeed_zero3),
        ("sharded_checkpoint", sharded_checkpoint), ("checkpoint_memory", checkpoint_memory),
        ("pi_old_once", pi_old_once), ("throughput_mfu", throughput_mfu), ("rank_placement", rank_placement),
        ("bf16_master", bf16_master)]
    wanted = {name for name, _ in sections}
    if args.only:
        asked = {y for x in args.only.split(",") if x.strip() for y in PRESETS.get(x.strip(), (x.strip(),))}
        unknown = asked - wanted
        if unknown:
            log(f"--only: no section {sorted(unknown)[0]!r}; sections: {', '.join(n for n, _ in sections)}")
            return 2
        wanted = set(asked)
        for name in list(asked):
            wanted.update(NEEDS.get(name, ()))
        results["only"] = sorted(wanted)
    _section(results, "models", models, log)
    if results["models"]["status"] == "ok":
        for name, fn in sections:
            if name in wanted:
                _section(results, name, fn, log)
        if cuda and not dry:
            results["max_memory_allocated_gib"] = torch.cuda.max_memory_allocated() / 2**30
    results["seconds"] = time.perf_counter() - t_all
    table = render_table(results)
    log("\n" + table)
    (out / "gpu_check.json").write_text(json.dumps(results, indent=2, default=str) + "\n")
    (out / "gpu_check.md").write_text(f"# GPU check ({results['mode']})\n\n{table}\n")
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    failed = [k for k, v in results.items() if isinstance(v, dict) and v.get("status") == "failed"]
    return 1 if failed else 0


def render_table(results: dict[str, Any]) -> str:
    def f(x: Any, fmt: str) -> str:
        return "—" if x is None else format(x, fmt)

    lines = [f"mode: {results['mode']}; device: {results['device']}; torch {results['torch']}; "
             f"dtype {results['dtype']}; parameters: {f(results.get('parameters'), ',')}",
             "",
             "| section | status | sample tok/s | score tok/s | step s (median) | first-loss Δ vs torch |",
             "|---|---|---|---|---|---|"]
    for name in ("hf_torch", "vllm", "deepspeed_zero2", "deepspeed_zero3"):
        r = results.get(name)
        if r is None:
            continue
        if r["status"] != "ok":
            lines.append(f"| {name} | {r['status']}: {r['reason'].splitlines()[0][:80]} | | | | |")
            continue
        lines.append(f"| {name} | ok | {f(r.get('sample_tokens_per_s'), '.0f')} "
                     f"| {f(r.get('score_tokens_per_s'), '.0f')} | {f(r.get('step_seconds_median'), '.3f')} "
                     f"| {f(r.get('first_loss_vs_torch'), '.2e')} |")
    reuse = results.get("engine_reuse")
    if reuse is not None:
        lines.append(f"\nstudent engine reuse: {reuse['status']}" + (
            f"; in-place weight load {reuse['in_place_seconds']:.2f} s vs rebuild {reuse['rebuild_seconds']:.2f} s; "
            f"tokens match a fresh engine: {reuse['tokens_match_fresh']}" if reuse["status"] == "ok"
            else f": {reuse['reason'].splitlines()[0][:80]}"))

    def not_ok(r: dict[str, Any]) -> str:
        return f"{r['status']}: {r['reason'].splitlines()[0][:100]}"

    z3 = results.get("deepspeed_zero3")
    if z3 is not None and z3["status"] == "ok":
        b = z3["partitioned_init"]
        lines.append(f"\nZeRO-3 partitioned init (zero.Init, world size {b['world_size']}): "
                     f"{b['ds_parameter_tensors']}/{b['parameter_tensors']} parameters DeepSpeed-partitioned, "
                     f"{b['local_numel']} elements held whole, this rank's partitions "
                     f"{b['partition_numel']:,} of {b['full_numel']:,} ({b['partition_fraction']:.3f})")
    old = results.get("pi_old_once")
    if old is not None:
        if old["status"] != "ok":
            lines.append(f"\nπ_old once per round: {not_ok(old)}")
        else:
            lines += ["\nπ_old once per round (first step record of each round's log):", "",
                      "| run | round | forward passes / micro-batches | π_old s | plain no-grad forward s "
                      "| π_old / plain | training loop s | π_old / loop |", "|---|---|---|---|---|---|---|---|"]
            for run, rows in old["runs"].items():
                for r in rows:
                    lines.append(f"| {run} | {r['round']} | {r['forward_passes']} / {r['micro_batches']} "
                                 f"| {r['old_logp_seconds']:.3f} | {f(r['plain_forward_seconds'], '.3f')} "
                                 f"| {f(r['old_vs_plain_forward'], '.2f')} | {r['training_loop_seconds']:.3f} "
                                 f"| {f(r['old_vs_training_loop'], '.2f')} |")
    ab = results.get("shared_prompt_ab")
    if ab is not None:
        if ab["status"] != "ok":
            lines.append(f"\ntrain.shared_prompt on vs off: {not_ok(ab)}")
        else:
            lines.append(f"\ntrain.shared_prompt on vs off (torch engine, no checkpointing, same round, best of 2): "
                         f"training loop {ab['on_loop_seconds']:.3f} s vs {ab['off_loop_seconds']:.3f} s "
                         f"= {ab['on_vs_off']:.2f}×; first-loss Δ {ab['first_loss_delta']:.2e}")
    mfu = results.get("throughput_mfu")
    if mfu is not None:
        if mfu["status"] != "ok":
            lines.append(f"\nFLOP/s and MFU: {not_ok(mfu)}")
        else:
            peak = mfu["peak_flops_per_s"]
            lines += [f"\nFLOP/s and MFU (model FLOPs: 6·N per trained token, 2·N per forward token, "
                      f"N = {mfu['non_embedding_parameters']:,} non-embedding parameters, plus LM head and "
                      f"attention); peak bf16: " + (f"{peak / 1e12:.0f} TFLOP/s ({mfu['peak_source']})" if peak
                                                   else f"peak {mfu['peak_source']}"), "",
                      "| run | train tok/s | train TFLOP/s | train MFU | π_old TFLOP/s | π_old MFU "
                      "| sample TFLOP/s | sample MFU | score TFLOP/s | score MFU |",
                      "|---|---|---|---|---|---|---|---|---|---|"]

            def tf(x: Any) -> str:
                return "—" if x is None else f"{x / 1e12:.4g}"

            def pct(x: Any) -> str:
                return "—" if x is None else f"{100 * x:.1f}%"

            for run, r in mfu.items():
                if not isinstance(r, dict):
                    continue
                lines.append(f"| {run} | {r['train_tokens_per_s']:.0f} | {tf(r['train_flops_per_s'])} "
                             f"| {pct(r['train_mfu'])} | {tf(r['old_logp_flops_per_s'])} | {pct(r['old_logp_mfu'])} "
                             f"| {tf(r.get('sample_flops_per_s'))} | {pct(r.get('sample_mfu'))} "
                             f"| {tf(r.get('score_flops_per_s'))} | {pct(r.get('score_mfu'))} |")
    sc = results.get("sharded_checkpoint")
    if sc is not None:
        lines.append("\nsharded optimizer checkpoint: " + (not_ok(sc) if sc["status"] != "ok" else (
            f"ok; ZeRO-3 checkpoint 1 holds {', '.join(sc['optimizer_files'])} "
            f"({sc['optimizer_shard_bytes']:,} bytes of shards for a {sc['whole_state_bytes']:,}-byte state) "
            f"and a {sc['trainer_pt_bytes']:,}-byte trainer.pt; "
            f"round 1 resumed under ZeRO-2 vs ZeRO-3: max {sc['diff_is']} loss Δ {sc['zero2_vs_zero3']:.1e} "
            f"(≤ {sc['tolerance']:g}); under the torch engine: {sc['torch_vs_zero3']:.1e}")))
    cm = results.get("checkpoint_memory")
    if cm is not None:
        lines.append("\ncheckpoint memory (bench/checkpoint_memory.py): " + (not_ok(cm) if cm["status"] != "ok" else (
            f"ok; shape {cm['shape']}; " + "; ".join(
                f"{code}: " + ", ".join(f"{w} rank(s) rank-0 save {v['rank0_save']:.2f} / load {v['rank0_load']:.2f}"
                                        for w, v in by_w.items()) for code, by_w in cm["by_code"].items())
            + f"\n{cm['last_line']}")))
    vr = results.get("vllm_engine_reuse")
    if vr is not None:
        lines.append("\nvLLM student engine reuse: " + (not_ok(vr) if vr["status"] != "ok" else (
            f"ok; weight sync path: {vr['weight_sync']}; deadline probe: "
            + ("—" if vr.get("deadline_seconds") is None else
               f"{'kept' if vr['deadline_kept'] else 'MISSED'} ({vr['deadline_seconds']:.2f} s for a 0.5 s deadline)")
            + f"; in-place load_weights {vr['in_place_seconds']:.2f} s vs fresh engine {vr['rebuild_seconds']:.2f} s; "
            f"tokens match a fresh engine: {vr['tokens_match_fresh']} (max log-prob Δ "
            f"{f(vr['max_logprob_diff'], '.1e')}); release() sleeps: {vr['sleeps']}, freed "
            f"{vr['freed_by_release_gib']:.1f} GiB, generate while asleep refused: "
            f"{vr.get('generate_refused_while_asleep', '—')}; wake + reload {vr['wake_reload_seconds']:.2f} s, "
            f"tokens still match: {vr['tokens_match_after_release']}")))
    rp = results.get("rank_placement")
    if rp is not None:
        if rp["status"] != "ok":
            lines.append(f"\nrank placement (2 training processes): {not_ok(rp)}")
        else:
            lines += [f"\nrank placement: 2 training processes (torchrun, the train job, ZeRO-2), "
                      f"{rp['torchrun_seconds']:.0f} s", "",
                      "| rank | loads onto | parameters on | allocated per GPU after the load | peak |",
                      "|---|---|---|---|---|"]
            for r in rp["ranks"]:
                per_gpu = ", ".join(f"{b / 2**30:.2f}" for b in r.get("allocated_after_load_by_gpu", [])) or "—"
                peak = r.get("peak_allocated_bytes", r.get("peak_rss_bytes", 0)) / 2**30
                kind = "allocated" if "peak_allocated_bytes" in r else "RSS"
                lines.append(f"| {r['rank']} | {r['load_device']} | {r['params_device']} | {per_gpu} GiB "
                             f"| {peak:.2f} GiB {kind} |")
    ts = results.get("vllm_teacher_scoring")
    if ts is not None:
        lines.append("\nvLLM teacher scoring: " + (not_ok(ts) if ts["status"] != "ok" else (
            f"ok; {ts['device']} {ts['dtype']}, KV block {ts['block_size']}; tokens computed per group "
            f"{ts['shared_computed_tokens_per_group']:.0f} with each prompt once (P + G·R = "
            f"{ts['shared_prompt_tokens_per_group']:.0f}) vs {ts['naive_computed_tokens_per_group']:.0f} with the "
            f"prompt per response (G·(P + R) = {ts['per_response_tokens_per_group']:.0f}); "
            f"{1e3 * ts['shared_seconds_per_group']:.1f} vs {1e3 * ts['naive_seconds_per_group']:.1f} ms per group; "
            f"max |Δ log-prob| {ts['max_abs_logprob_diff']:.1e}")))
    bf = results.get("bf16_master")
    if bf is not None:
        if bf["status"] != "ok":
            lines.append(f"\nbf16 master (bf16 learns like float32): {not_ok(bf)}")
        else:
            lines += [f"\nbf16 master: one round of the same scored data at lr {bf['lr']:g} "
                      f"({bf['optimizer_steps']} optimizer steps); the bf16 run's fp32 master update against the "
                      f"float32 run's weight update; bf16 weights changed: float32 run rounded to bf16 "
                      f"{100 * bf['float32_changed_share_bf16']:.2f} %", "",
                      "| bf16 run | cosine | norm ratio | ckpt 0 master = student | folder = master's rounding "
                      "| bf16 weights changed | applied / computed | s |", "|---|---|---|---|---|---|---|---|"]
            for name, a in bf["arms"].items():
                lines.append(f"| {name} | {a['cosine_vs_float32']:.4f} | {a['norm_vs_float32']:.4f} "
                             f"| {a['master0_is_the_student']} | {a['folder_is_master_rounding']} "
                             f"| {100 * a['changed_share_bf16']:.2f} % | {a['round_update_applied_ratio']:.4f} "
                             f"| {a['seconds']:.1f} |")
            lines += [f"({s})" for s in bf["skipped"]]
    if "max_memory_allocated_gib" in results:
        lines.append(f"\npeak GPU memory allocated: {results['max_memory_allocated_gib']:.1f} GiB")
    lines.append(f"\ntotal {results['seconds']:.0f} s")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
